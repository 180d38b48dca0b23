"""distcomm: torch.distributed's model for numpy and CuPy arrays (public API, re-exported)."""

from .errors import (
    BackendUnavailableError,
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    DistStoreTimeoutError,
    DistTimeoutError,
)
