"""The errors of the shared-memory manager and its clients."""

from __future__ import annotations

from ..errors import DistError, DistNetworkError, DistTimeoutError

__all__ = ["ShmManagerConnectionError", "ShmManagerError", "ShmManagerTimeoutError"]


class ShmManagerError(DistError):
    """The shared-memory manager refused a request or could not be used."""


class ShmManagerConnectionError(ShmManagerError, DistNetworkError):
    """No manager listens at the address, or the connection to it was lost (it died)."""


class ShmManagerTimeoutError(ShmManagerError, DistTimeoutError):
    """The manager did not start, accept or answer within the timeout."""
