"""GPU support through CuPy: devices, streams, NCCL helpers, host staging and CUDA IPC.

Importing this package never imports CuPy; each function imports it when called.
"""

from .runtime import (
    INSTALL_HINT,
    current_device,
    current_stream,
    device_count,
    import_cupy,
    is_available,
    is_cupy_array,
    set_device,
    synchronize,
)

__all__ = [
    "INSTALL_HINT",
    "current_device",
    "current_stream",
    "device_count",
    "import_cupy",
    "is_available",
    "is_cupy_array",
    "set_device",
    "synchronize",
]
