"""Array adaptation: which arrays (and buffers) ops accept, devices, dtype codes, flat views."""

from __future__ import annotations

import numbers
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .gpu.runtime import import_cupy, is_cupy_array, with_device

__all__ = [
    "DTYPES",
    "adapt",
    "address",
    "check_same",
    "concatenate",
    "copy_on_device",
    "device_of",
    "dtype_code",
    "dtype_from_code",
    "empty",
    "extent",
    "extents_overlap",
    "flat",
    "may_share_memory",
    "on_device",
]

#: The dtypes collectives accept, in wire-code order (the code is the index).
DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(name)
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
)
_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}

_DLPACK_CPU = 1
_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged


def device_of(array: Any) -> str:
    """'cpu' for numpy arrays, 'cuda' for CuPy arrays."""
    if type(array) is np.ndarray:  # the common case, without looking for CuPy
        return "cpu"
    return "cuda" if is_cupy_array(array) else "cpu"


def dtype_code(dtype: np.dtype) -> int:
    """The one-byte wire code of a supported dtype."""
    return _CODES[dtype]


def dtype_from_code(code: int) -> np.dtype:
    """The dtype behind a wire code (`dtype_code`'s inverse)."""
    return DTYPES[code]


def _from_dlpack(obj: Any, where: str, name: str) -> Any:
    try:
        device_type, _ = obj.__dlpack_device__()
    except Exception as exc:
        raise TypeError(
            f"{where}: {name} has __dlpack__ but its __dlpack_device__() failed ({exc}); "
            "pass a numpy or CuPy array"
        ) from exc
    if device_type == _DLPACK_CPU:
        return np.from_dlpack(obj)
    if device_type in _DLPACK_CUDA:
        # only reached for CUDA DLPack producers, which need CuPy anyway
        cupy = import_cupy(f"{where}: {name} (a CUDA DLPack array)", need_device=False)
        return cupy.from_dlpack(obj)
    raise TypeError(
        f"{where}: {name} lives on DLPack device type {device_type}; distcomm takes CPU "
        "(numpy) and CUDA (CuPy) arrays"
    )


def _scalar_message(obj: Any, where: str, name: str, writable: bool) -> str:
    """Why a numpy or Python scalar is no array argument, and what to pass instead."""
    kind = (
        f"a numpy scalar (numpy.{type(obj).__name__})"
        if isinstance(obj, np.generic)
        else f"a Python {type(obj).__name__}"
    )
    why = (
        f"so {where} cannot write its result into it"
        if writable
        else "and collectives take arrays, whose memory they use in place"
    )
    return (
        f"{where}: {name} is {kind}, which is immutable, {why}; pass numpy.asarray(value), "
        "a 0-d array (what a 0-d torch tensor is), or a 1-element array (x.mean(), x.sum() "
        "and x[i] give numpy scalars)"
    )


def _buffer_view(obj: Any) -> memoryview | None:
    """`obj`'s memory as a memoryview if it exports the buffer protocol, else None."""
    try:
        return memoryview(obj)
    except TypeError:
        return None


def _from_buffer(obj: Any, view: memoryview, where: str, name: str, writable: bool) -> Any:
    """A buffer-protocol object (bytes, bytearray, memoryview, mmap, array.array) as a
    zero-copy numpy view: untyped bytes (format "B" or "c") as uint8, a typed buffer
    (array.array("d"), memoryview.cast("i")) as the dtype of its format."""
    kind = type(obj).__name__
    message = None
    if not view.c_contiguous:
        message = (
            f"{where}: {name} is a non-contiguous {kind}, and {where} uses its memory as one "
            f"block; pass a contiguous copy: bytes({name}), or numpy.ascontiguousarray({name})"
            " (numpy.frombuffer(buffer, dtype=...) views a contiguous buffer as an array)"
        )
    elif writable and view.readonly:
        message = (
            f"{where}: {name} is a read-only {kind}, but {where} writes what it receives into "
            "it; pass a writable buffer of the sender's size and element type: a bytearray, "
            "an mmap opened for writing, or a writable numpy array (numpy.empty(n, dtype), "
            "numpy.frombuffer(bytearray(nbytes), dtype=...))"
        )
    if message is not None:
        view.release()  # the caller may resize or close it while the error is kept
        raise ValueError(message)
    form = view.format
    try:
        array = np.asarray(view)
    except (TypeError, ValueError) as exc:
        view.release()
        raise TypeError(
            f"{where}: {name} is a {kind} of buffer format {form!r}, which numpy cannot "
            f"read ({exc}); view its memory as an array with numpy.frombuffer({name}, "
            "dtype=...)"
        ) from exc
    return array.view(np.uint8) if form == "c" else array


def _not_an_array(obj: Any, is_buffer: bool, where: str, name: str, buffers: bool) -> str:
    """Why `obj` is no array argument of `where`, and what to pass instead."""
    kind = type(obj).__name__
    if buffers:
        return (
            f"{where}: {name} must be a numpy.ndarray or cupy.ndarray, an object with "
            "__dlpack__, or a contiguous buffer (bytes, bytearray, memoryview, mmap, "
            f"array.array), got {kind}; make an array of it with numpy.asarray({name}), or "
            "view a buffer's memory as one with numpy.frombuffer(buffer, dtype=...)"
        )
    message = (
        f"{where}: {name} must be a numpy.ndarray or cupy.ndarray (or expose __dlpack__), "
        f"got {kind}"
    )
    if is_buffer:  # collectives take arrays; point-to-point also takes buffers
        message += (
            f"; view its memory as an array with numpy.frombuffer({name}, dtype=...) (no "
            "copy; a writable array needs a writable buffer, such as a bytearray)"
        )
    return message


def adapt(obj: Any, where: str, name: str, *, writable: bool, buffers: bool = False) -> Any:
    """Check that `obj` is an array a collective can use in place, and return it as one.

    numpy and CuPy arrays are returned as they are; other objects with `__dlpack__`
    (a CPU torch tensor, say) as a zero-copy numpy (or CuPy) view; with `buffers`, a
    contiguous buffer-protocol object as a zero-copy numpy view (`_from_buffer`).

    Args:
        where: the calling function, for messages ("all_reduce").
        name: the argument's name, for messages ("tensor").
        writable: the operation writes into the array.
        buffers: buffer-protocol objects are accepted (point-to-point, as mpi4py's
            `Send`/`Recv` take them); else they are refused, naming `numpy.frombuffer`.

    Raises:
        TypeError: not an array (a numpy or Python scalar: the message says so), or an
            unsupported dtype.
        ValueError: not C-contiguous, read-only where written, or not in native byte order.
    """
    if isinstance(obj, np.ndarray) or is_cupy_array(obj):
        array = obj
    elif hasattr(obj, "__dlpack__"):
        array = _from_dlpack(obj, where, name)
    elif isinstance(obj, (np.generic, numbers.Number)):
        raise TypeError(_scalar_message(obj, where, name, writable))
    else:
        view = _buffer_view(obj)
        if view is None or not buffers:
            if view is not None:
                view.release()
            raise TypeError(_not_an_array(obj, view is not None, where, name, buffers))
        array = _from_buffer(obj, view, where, name, writable)
    dtype = array.dtype
    if dtype not in _CODES:
        if dtype.kind in "biufc" and not dtype.isnative:
            raise ValueError(
                f"{where}: {name} has non-native byte order ({dtype.str}); pass "
                f"{name}.astype({name}.dtype.newbyteorder('='))"
            )
        raise TypeError(
            f"{where}: {name} has dtype {dtype}, which collectives do not support; use one of "
            + ", ".join(str(d) for d in DTYPES)
        )
    if not array.flags.c_contiguous:
        raise ValueError(
            f"{where}: {name} must be C-contiguous (collectives work in place on its memory); "
            f"pass a contiguous copy such as numpy.ascontiguousarray({name}) and copy results back"
        )
    if writable and not getattr(array.flags, "writeable", True):  # CuPy has no such flag
        raise ValueError(
            f"{where}: {name} is read-only but this operation writes its result into it; "
            f"pass a writable array, e.g. {name}.copy()"
        )
    return array


def check_same(arrays: list[Any], where: str, name: str) -> tuple[str, np.dtype]:
    """Check that `arrays` share one device and one dtype; returns them.

    Raises:
        ValueError: devices differ.
        TypeError: dtypes differ.
    """
    dtype = arrays[0].dtype
    for array in arrays:  # the common case first: numpy arrays of one dtype
        if type(array) is not np.ndarray or array.dtype != dtype:
            break
    else:
        return "cpu", dtype
    devices = {device_of(a) for a in arrays}
    if len(devices) > 1:
        raise ValueError(
            f"{where}: {name} mixes devices ({', '.join(sorted(devices))}); "
            "pass arrays that all live on the same device"
        )
    if devices == {"cuda"}:
        gpus = {a.device.id for a in arrays}
        if len(gpus) > 1:
            raise ValueError(
                f"{where}: {name} are on different GPUs ({', '.join(map(str, sorted(gpus)))});"
                " pass arrays that all live on the same GPU"
            )
    dtypes = {a.dtype for a in arrays}
    if len(dtypes) > 1:
        raise TypeError(
            f"{where}: {name} mixes dtypes ({', '.join(sorted(map(str, dtypes)))}); "
            "pass arrays of one dtype"
        )
    return devices.pop(), dtypes.pop()


def flat(array: Any) -> Any:
    """A 1-D view of a C-contiguous array (no copy; a 1-D array itself)."""
    return array if array.ndim == 1 else array.reshape(-1)


def empty(size: int, like: Any) -> Any:
    """A new flat array of `size` elements of `like`'s dtype, on `like`'s device."""
    if device_of(like) == "cuda":
        cupy = sys.modules["cupy"]  # `like` is a CuPy array: CuPy is imported
        with like.device:
            return cupy.empty(size, like.dtype)
    return np.empty(size, like.dtype)


def concatenate(arrays: list[Any], like: Any) -> Any:
    """The flat concatenation of `arrays`, on `like`'s device (an empty array if none)."""
    if not arrays:
        return empty(0, like)
    if device_of(like) == "cuda":
        cupy = sys.modules["cupy"]
        with like.device:
            return cupy.concatenate([flat(a) for a in arrays])
    return np.concatenate([flat(a) for a in arrays])


# -- memory: where an array's elements lie (host or device) ------------------------------------


def address(array: Any) -> int:
    """The address of an array's first element (a CuPy array's is a device address)."""
    if isinstance(array, np.ndarray):  # the common case first: no look for CuPy
        return int(array.ctypes.data)
    return int(array.data.ptr) if is_cupy_array(array) else int(array.ctypes.data)


def extent(array: Any) -> tuple[int, int]:
    """[first byte, end) of the memory an array's elements span."""
    start = address(array)
    if array.size == 0:
        return start, start
    low = sum(min(0, (n - 1) * s) for n, s in zip(array.shape, array.strides, strict=True))
    high = sum(max(0, (n - 1) * s) for n, s in zip(array.shape, array.strides, strict=True))
    return start + low, start + high + array.itemsize


def may_share_memory(a: Any, b: Any) -> bool:
    """Whether two arrays may share memory. CuPy arrays cannot go to numpy's check (they
    refuse conversion): their byte extents are compared; host and device never overlap."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):  # no look for CuPy
        return bool(np.shares_memory(a, b))
    if not (is_cupy_array(a) or is_cupy_array(b)):
        return bool(np.shares_memory(a, b))
    if not (is_cupy_array(a) and is_cupy_array(b)):
        return False
    return extents_overlap(extent(a), extent(b))


def extents_overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether two extents ([first byte, end), as `extent` gives) share a byte; an empty
    one shares none."""
    return a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]


def on_device(array: Any, fn: Callable[[], Any]) -> Any:
    """`fn()` with a CuPy array's device current (binding no CUDA context of another
    device in this thread: `distcomm.gpu.runtime.with_device`)."""
    with with_device(array.device):
        return fn()


def copy_on_device(array: Any) -> Any:
    """A copy of `array`; a CuPy array's is made on its own device."""
    if is_cupy_array(array):
        return on_device(array, array.copy)
    return array.copy()
