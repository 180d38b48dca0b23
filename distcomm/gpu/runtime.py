"""CuPy, CUDA devices and streams: the guarded import, device selection and stream helpers.

Nothing here imports CuPy at module import. `device_count()` and `is_available()` never
raise (0 and False without CuPy, a driver or a device), as torch.cuda's do; everything
that needs a device raises `BackendUnavailableError` naming what to install or check.
Those messages tell three cases apart: CuPy not installed (what to install); CuPy
installed but failing to import, or importing but finding no GPU (the error, the
CUDA_VISIBLE_DEVICES set, `python -m distcomm.info`, the gloo backend for CPU arrays:
installing CuPy again would not help); and, in `distcomm.gpu.nccl`, CuPy without its
NCCL library (the NCCL wheel to install).

CUDA and fork: the first CUDA call of a process initialises the driver (cuInit), and a
process forked after that cannot use CUDA. `device_count()` and `is_available()` ask
CUDA, so they initialise it; `cuda_initialized()` and `device_visible()` never do (the
availability probes and the default backend choice use them), so a program can ask
before it forks its workers.

Device selection: `set_device(i)` makes device i current for the calling thread (CuPy's
current device is per thread, as CUDA's is) and remembers it for the process. Until it is
called, `current_device()` is `LOCAL_RANK % device_count()` when LOCAL_RANK is set (the
launcher sets it, one worker per GPU) and CUDA's current device otherwise.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import BackendUnavailableError
from ..launcher_env import node_local_rank

__all__ = [
    "INSTALL_HINT",
    "chosen_device",
    "cuda_initialized",
    "current_device",
    "current_stream",
    "device_count",
    "device_of",
    "device_visible",
    "import_cupy",
    "is_available",
    "is_cupy_array",
    "load_cupy",
    "nccl_install_hint",
    "no_gpu_reason",
    "no_gpu_remedy",
    "set_device",
    "synchronize",
    "synchronize_arrays",
    "with_device",
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


def _installed_cupy() -> str | None:
    """The CuPy distribution installed beside the `cupy` package, as "13.3.0
    (cupy-cuda12x)", from the name of its .dist-info folder: found without importing CuPy
    and without reading every distribution's metadata. None where there is none."""
    try:
        spec = importlib.util.find_spec("cupy")
    except (ImportError, ValueError):  # a cupy entry of None in sys.modules
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    site = os.path.dirname(os.path.abspath(next(iter(spec.submodule_search_locations))))
    try:
        entries = sorted(os.listdir(site))
    except OSError:
        return None
    for entry in entries:
        found = re.fullmatch(r"(cupy(?:_[a-z0-9_]+)?)-([^-]+)\.dist-info", entry, re.IGNORECASE)
        if found:
            return f"{found.group(2)} ({found.group(1).replace('_', '-').lower()})"
    return None


def _first_cause(exc: BaseException) -> str:
    """An import error in one line: the "Original error:" line of CuPy's banner ("Failed
    to import CuPy. ..."), else the first line of the message, after the type."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip(" =")]
    if "Original error:" in lines[:-1]:
        return lines[lines.index("Original error:") + 1]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _visible_devices_note() -> str:
    """ "; CUDA_VISIBLE_DEVICES=''" where the variable is set, for no-GPU messages."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "" if text is None else f"; CUDA_VISIBLE_DEVICES={text!r}"


def no_gpu_remedy() -> str:
    """What to do where CuPy finds no GPU: the checks, distcomm.info, and gloo for CPU
    arrays (the sentence that ends the no-GPU messages)."""
    return (
        "Check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES, run `python -m "
        "distcomm.info` to see what distcomm found, and use the gloo backend for numpy "
        "(CPU) arrays"
    )


def no_gpu_reason() -> str:
    """Why no GPU is visible to this process ("" when one is), with CUDA_VISIBLE_DEVICES
    where it is set, found without initialising CUDA (safe before a fork, as
    `device_visible` is): CUDA's device count where this process initialised CUDA
    already, else NVML's GPUs under CUDA_VISIBLE_DEVICES."""
    if cuda_initialized():
        return "" if device_count() > 0 else f"CUDA reports no device{_visible_devices_note()}"
    listed = _nvml_device_count()
    if listed is None:
        why = "no NVIDIA driver answers: libnvidia-ml.so.1 does not load or start"
    elif listed == 0:
        why = "the NVIDIA driver lists no GPU"
    elif _visible(listed) == 0:
        text = os.environ.get("CUDA_VISIBLE_DEVICES")
        return f"CUDA_VISIBLE_DEVICES={text!r} hides the {listed} GPU(s) the driver lists"
    else:
        return ""
    return why + _visible_devices_note()


def nccl_install_hint() -> str:
    """The pip command that installs NCCL for the installed CuPy's CUDA version (both
    CUDA 12's and 13's where the CuPy distribution does not name one)."""
    match = re.search(r"\(cupy-cuda(\d+)x\)", _installed_cupy() or "")
    if match:
        return f"pip install nvidia-nccl-cu{match.group(1)}"
    return "pip install nvidia-nccl-cu12 (CUDA 12) or pip install nvidia-nccl-cu13 (CUDA 13)"


def load_cupy() -> Any:
    """Import CuPy; no device is looked for.

    Returns:
        The `cupy` module.

    Raises:
        BackendUnavailableError: CuPy cannot be imported; the message says which case:
            not installed (what to install), or installed but failing to import (its
            error and, where no GPU is visible, that: CuPy's import needs the NVIDIA
            driver's libcuda, which a host without a GPU lacks).
    """
    try:
        import cupy
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "cupy":
            raise BackendUnavailableError(
                f"CuPy is not installed ({exc}): install the packages matching your CUDA "
                f"version: {INSTALL_HINT}"
            ) from exc
        installed = _installed_cupy()
        head = (
            f"CuPy {installed + ' ' if installed else ''}is installed but fails to import "
            f"({_first_cause(exc)})"
        )
        absent = no_gpu_reason()
        if absent:
            raise BackendUnavailableError(
                f"{head}: no GPU is visible to this process ({absent}). {no_gpu_remedy()}"
            ) from exc
        raise BackendUnavailableError(
            f"{head}: reinstall the CuPy wheel that matches this host's CUDA version "
            f"({INSTALL_HINT}), or put its CUDA libraries on LD_LIBRARY_PATH; run "
            "`python -m distcomm.info` to see what distcomm found"
        ) from exc
    return cupy


def import_cupy(purpose: str = "the GPU path", *, need_device: bool = True) -> Any:
    """Import CuPy and, unless `need_device` is False, check that CUDA sees a device.

    Args:
        purpose: what needs CuPy, for messages ("staging GPU arrays").

    Returns:
        The `cupy` module.

    Raises:
        BackendUnavailableError: CuPy is not installed or fails to import (`load_cupy`),
            or CUDA reports no usable device (no driver, a driver too old for the CUDA
            runtime, CUDA_VISIBLE_DEVICES empty); the message says which, and what to do.
    """
    try:
        cupy = load_cupy()
    except BackendUnavailableError as exc:
        raise BackendUnavailableError(f"{purpose} needs CuPy: {exc}") from exc.__cause__
    if not need_device:
        return cupy
    version = getattr(cupy, "__version__", "?")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no device, no driver, driver too old
        raise BackendUnavailableError(
            f"{purpose}: CuPy is installed but CUDA reports no usable device ({exc}): no "
            f"GPU is visible to this process (CuPy {version}{_visible_devices_note()}). "
            f"{no_gpu_remedy()}"
        ) from exc
    if count < 1:
        raise BackendUnavailableError(
            f"{purpose}: CuPy is installed but CUDA reports no device (cudaGetDeviceCount() "
            f"= 0): no GPU is visible to this process (CuPy {version}"
            f"{_visible_devices_note()}). {no_gpu_remedy()}"
        )
    return cupy


def cuda_initialized() -> bool:
    """Whether this process has initialised the CUDA driver; never initialises it (nor
    imports CuPy: False until something imported it).

    `cuCtxGetCurrent` answers CUDA_ERROR_NOT_INITIALIZED before `cuInit`.
    """
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return False
    try:
        cupy.cuda.driver.ctxGetCurrent()
    except Exception as exc:
        return getattr(exc, "status", None) != _CUDA_ERROR_NOT_INITIALIZED
    return True


#: cuCtxGetCurrent's status before the driver was initialised
_CUDA_ERROR_NOT_INITIALIZED = 3


def _nvml_device_count() -> int | None:
    """The GPUs NVML (the driver's management library) lists, or None where it cannot
    say. NVML does not initialise CUDA, so this is safe before a fork (torch's
    PYTORCH_NVML_BASED_CUDA_CHECK); it ignores CUDA_VISIBLE_DEVICES."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
    except (OSError, AttributeError):  # no NVIDIA driver
        return None
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        return int(count.value)
    finally:
        nvml.nvmlShutdown()


def _visible(listed: int) -> int:
    """How many of `listed` GPUs CUDA_VISIBLE_DEVICES leaves visible: CUDA takes the
    entries up to the first invalid one (indices, GPU-/MIG- UUIDs)."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return listed
    count = 0
    for entry in (part.strip() for part in text.split(",")):
        if (entry.isdigit() and int(entry) < listed) or entry.startswith(("GPU-", "MIG-")):
            count += 1
        else:
            break
    return count


def device_visible() -> bool:
    """Whether CUDA would see a device, found without initialising CUDA (safe before a
    fork): CUDA's device count where this process initialised CUDA already, else NVML's
    count under CUDA_VISIBLE_DEVICES; False without CuPy or an NVIDIA driver."""
    if cuda_initialized():
        return device_count() > 0
    try:
        import cupy  # noqa: F401 - importing CuPy does not initialise CUDA
    except Exception:  # not installed, or an installation that fails to import
        return False
    listed = _nvml_device_count()
    return listed is not None and _visible(listed) > 0


def device_count() -> int:
    """The number of CUDA devices CuPy sees; 0 without CuPy, a driver or a device.

    It asks CUDA, which initialises it in this process: a process forked afterwards cannot
    use CUDA (`device_visible()` asks without initialising it).
    """
    try:
        import cupy
    except Exception:  # not installed, or an installation that fails to import
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def is_available() -> bool:
    """Whether CuPy is installed and sees at least one CUDA device (initialising CUDA,
    as `device_count()` does)."""
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


def synchronize_arrays(arrays: Iterable[Any]) -> None:
    """Wait until the calling thread's current stream on the device of each CuPy array in
    `arrays` (others are skipped) has run what was queued on it: the kernels that produce
    or last used the arrays. Call it before a library that is not ordered by CUDA streams
    (a CUDA-aware MPI) reads or writes their memory; each array's own device counts, not
    the current one."""
    cupy = sys.modules.get("cupy")
    done: set[int] = set()
    for array in arrays:
        if array is None or not is_cupy_array(array):
            continue
        device = array.device
        if device.id not in done:
            done.add(device.id)
            with with_device(device):
                cupy.cuda.get_current_stream().synchronize()


@contextmanager
def with_device(device: Any) -> Iterator[None]:
    """Run the block with `device` (a `cupy.cuda.Device`) current in this thread, without
    binding a CUDA context of another device here, as torch's device guard avoids doing.

    CuPy's `with device:` switches back with cudaSetDevice, which in CUDA 12 makes the
    previous device's context: on a thread that never chose a device (a new thread's is
    0) that is an extra context on GPU 0, hundreds of MB of its memory. So a thread whose
    device is `device` stays; a thread with no context bound yet is left on `device`; any
    other switches and comes back to a device whose context it has already.
    """
    cuda = sys.modules["cupy"].cuda
    if int(cuda.runtime.getDevice()) == device.id:
        yield
        return
    driver = getattr(cuda, "driver", None)
    try:
        bound = driver is None or int(driver.ctxGetCurrent()) != 0
    except Exception as exc:  # CUDA_ERROR_NOT_INITIALIZED: no context anywhere yet
        bound = getattr(exc, "status", None) != _CUDA_ERROR_NOT_INITIALIZED
    if not bound:
        device.use()
        yield
        return
    with device:
        yield


def synchronize(device: Any = None) -> None:
    """Wait for all work queued on `device` (default: `current_device()`) to finish."""
    _device(device, "synchronize").synchronize()
