"""CuPy, CUDA devices and streams: the guarded import, device selection and stream helpers.

Nothing here imports CuPy at module import. `device_count()` and `is_available()` never
raise (0 and False without CuPy, a driver or a device), as torch.cuda's do; everything
that needs a device raises `BackendUnavailableError` naming what to install or check.

Device selection: `set_device(i)` makes device i current for the calling thread (CuPy's
current device is per thread, as CUDA's is) and remembers it for the process. Until it is
called, `current_device()` is `LOCAL_RANK % device_count()` when LOCAL_RANK is set (the
launcher sets it, one worker per GPU) and CUDA's current device otherwise.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from ..errors import BackendUnavailableError
from ..launcher_env import node_local_rank

__all__ = [
    "INSTALL_HINT",
    "chosen_device",
    "current_device",
    "current_stream",
    "device_count",
    "device_of",
    "import_cupy",
    "is_available",
    "is_cupy_array",
    "set_device",
    "synchronize",
]

#: what to install for the GPU path, by CUDA major version
INSTALL_HINT = (
    "pip install cupy-cuda12x nvidia-nccl-cu12 (CUDA 12) or pip install "
    "cupy-cuda13x nvidia-nccl-cu13 (CUDA 13)"
)

_lock = threading.Lock()
_chosen: int | None = None  # set by set_device


def is_cupy_array(obj: Any) -> bool:
    """Whether `obj` is a `cupy.ndarray`; never imports CuPy (False if it is not imported).

    The one test of "is this a GPU array" in distcomm: an instance of the loaded CuPy's
    ndarray (a subclass too), never a guess from the type's module name.
    """
    cupy = sys.modules.get("cupy")
    ndarray = getattr(cupy, "ndarray", None)
    return isinstance(ndarray, type) and isinstance(obj, ndarray)


def import_cupy(purpose: str = "the GPU path", *, need_device: bool = True) -> Any:
    """Import CuPy and, unless `need_device` is False, check that CUDA sees a device.

    Args:
        purpose: what needs CuPy, for messages ("staging GPU arrays").

    Returns:
        The `cupy` module.

    Raises:
        BackendUnavailableError: CuPy is not installed, or CUDA reports no usable device
            (no driver, a driver too old for the CUDA runtime, CUDA_VISIBLE_DEVICES empty).
    """
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailableError(
            f"{purpose} needs CuPy, which failed to import ({exc}); install the packages "
            f"matching your CUDA version: {INSTALL_HINT}"
        ) from exc
    if not need_device:
        return cupy
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no device, no driver, driver too old
        raise BackendUnavailableError(
            f"{purpose}: CuPy is installed but CUDA reports no usable device ({exc}); check "
            "the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
        ) from exc
    if count < 1:
        raise BackendUnavailableError(
            f"{purpose}: CuPy is installed but CUDA reports no device (cudaGetDeviceCount() "
            "= 0); check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
        )
    return cupy


def device_count() -> int:
    """The number of CUDA devices CuPy sees; 0 without CuPy, a driver or a device."""
    try:
        import cupy
    except Exception:  # not installed, or an installation that fails to import
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def is_available() -> bool:
    """Whether CuPy is installed and sees at least one CUDA device."""
    return device_count() > 0


def _index(device: Any, count: int, where: str) -> int:
    """A device index from an int, "cuda", "cuda:N" or a `cupy.cuda.Device`."""
    value = device
    if isinstance(device, str):
        text = device.strip().lower()
        if text == "cuda":
            return current_device()
        name, _, number = text.partition(":")
        if name != "cuda" or not number.isdigit():
            raise ValueError(f"{where}: device {device!r} is not 'cuda' or 'cuda:N'")
        value = int(number)
    elif hasattr(device, "id") and not isinstance(device, int):
        value = device.id
    elif getattr(device, "type", None) == "cuda":  # a torch.device
        value = current_device() if device.index is None else device.index
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{where}: device must be an int, 'cuda:N' or a cupy.cuda.Device, got {device!r}"
        )
    if not 0 <= value < count:
        raise ValueError(
            f"{where}: device {value} does not exist: CUDA sees {count} device(s) (0 to "
            f"{count - 1}); check CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}"
        )
    return value


def set_device(device: Any) -> None:
    """Make `device` (an index, "cuda:N" or a `cupy.cuda.Device`) this thread's current device
    and the process's device for `current_device()`.

    Raises:
        BackendUnavailableError: CuPy or a CUDA device is missing.
        ValueError: no such device.
    """
    global _chosen
    cupy = import_cupy("set_device")
    index = _index(device, cupy.cuda.runtime.getDeviceCount(), "set_device")
    cupy.cuda.Device(index).use()
    with _lock:
        _chosen = index


def chosen_device() -> int | None:
    """The device `set_device` chose for this process, or None if it was never called."""
    with _lock:
        return _chosen


def current_device() -> int:
    """The device this process uses: the last `set_device`, else LOCAL_RANK modulo the
    device count under a launcher, else CUDA's current device of the calling thread.

    Raises:
        BackendUnavailableError: CuPy or a CUDA device is missing.
        ValueError: LOCAL_RANK is not an integer.
    """
    cupy = import_cupy("current_device")
    with _lock:
        if _chosen is not None:
            return _chosen
    local = node_local_rank()
    if local is not None:
        return local % cupy.cuda.runtime.getDeviceCount()
    return int(cupy.cuda.runtime.getDevice())


def device_of(array: Any) -> int:
    """The device index of a `cupy.ndarray`."""
    return int(array.device.id)


def _device(device: Any, where: str) -> Any:
    """`device` (default: `current_device()`) as a `cupy.cuda.Device`."""
    cupy = import_cupy(where)
    index = (
        current_device()
        if device is None
        else _index(device, cupy.cuda.runtime.getDeviceCount(), where)
    )
    return cupy.cuda.Device(index)


def current_stream(device: Any = None) -> Any:
    """The calling thread's current CuPy stream on `device` (default: `current_device()`)."""
    with _device(device, "current_stream"):
        return sys.modules["cupy"].cuda.get_current_stream()


def synchronize(device: Any = None) -> None:
    """Wait for all work queued on `device` (default: `current_device()`) to finish."""
    _device(device, "synchronize").synchronize()
