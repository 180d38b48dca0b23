"""Host staging of CuPy arrays for CPU backends: pinned copies in, the CPU op, copies back.

Lifetime and synchronisation:

- A `HostStaging` serves one queue of operations that run one at a time (one backend's
  collective queue); it is not thread-safe. A host array it returns stays valid until the
  next call that uses the same slot, or `clear()`.
- Device-to-host copies run on the stream passed in or, by default, on the calling
  thread's current stream of the array's device; that stream is synchronised before the
  host data is used, so work the caller queued on it before the operation (the kernels
  producing an input) is complete. An operation run on another thread than the one that
  issued it (an `async_op`) must pass the stream captured at issue (`current_stream`):
  the worker thread's current stream is not the caller's.
- Host-to-device copies run on the same stream, which is synchronised before returning:
  the CuPy array holds the result when the operation returns (the CPU backends'
  synchronous semantics) and the pinned buffer is free for the next operation.
- CuPy is imported only when staging is first needed; without it `import_cupy` (and any
  allocation) raises `BackendUnavailableError`.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from .runtime import import_cupy as _import_cupy
from .runtime import is_cupy_array

__all__ = ["HostStaging", "current_stream", "import_cupy", "is_cupy_array", "run_staged"]

T = TypeVar("T")


def import_cupy() -> Any:
    """CuPy, checked to see a CUDA device (`distcomm.gpu.import_cupy` for staging).

    Raises:
        BackendUnavailableError: CuPy is not installed, or CUDA reports no usable device.
    """
    return _import_cupy("staging GPU arrays")


def _check(array: Any, name: str, contiguous: bool = True) -> None:
    if not is_cupy_array(array):
        raise TypeError(
            f"host staging: {name} must be a cupy.ndarray, got "
            f"{type(array).__module__}.{type(array).__name__}"
        )
    if contiguous and not array.flags.c_contiguous:
        raise ValueError(
            f"host staging: {name} must be C-contiguous (it is copied as one block of "
            f"memory); pass cupy.ascontiguousarray({name}) and copy results back"
        )


def current_stream(array: Any) -> Any:
    """The calling thread's current CUDA stream on `array`'s device.

    Capture it when an operation is issued and pass it as `stream=` when the operation
    runs on another thread.

    Raises:
        TypeError: `array` is not a `cupy.ndarray`.
    """
    _check(array, "array", contiguous=False)
    with array.device:
        return sys.modules["cupy"].cuda.get_current_stream()


class _Streams:
    """The streams one staging step copied on, to synchronise each once on its device."""

    def __init__(self, stream: Any) -> None:
        self._given = stream
        self._used: dict[tuple[int, int], tuple[Any, Any]] = {}

    def get(self, array: Any) -> Any:
        device = array.device
        if self._given is not None:
            stream = self._given
        else:
            with device:
                stream = sys.modules["cupy"].cuda.get_current_stream()
        self._used.setdefault((device.id, stream.ptr), (device, stream))
        return stream

    def synchronize(self) -> None:
        for device, stream in self._used.values():
            with device:  # the legacy null stream (ptr 0) means the current device's
                stream.synchronize()
        self._used.clear()


def _to_host_async(array: Any, host: np.ndarray, stream: Any) -> None:
    with array.device:
        array.data.copy_to_host_async(ctypes.c_void_p(host.ctypes.data), array.nbytes, stream)


def _to_device_async(host: np.ndarray, array: Any, stream: Any) -> None:
    with array.device:
        array.data.copy_from_host_async(ctypes.c_void_p(host.ctypes.data), array.nbytes, stream)


class HostStaging:
    """Pinned host buffers for one operation queue, one per slot, kept until `clear()`.

    A slot's buffer is replaced by a larger one when a call needs more than it holds; its
    capacity is a power of two (at least `MIN_BYTES`), so CuPy's pinned memory pool, which
    reuses freed blocks of equal size only, sees few distinct sizes.
    """

    #: the smallest buffer allocated
    MIN_BYTES = 64 * 1024

    def __init__(self) -> None:
        self._buffers: dict[int, np.ndarray] = {}
        self._cupy: Any = None

    def buffer(self, slot: int, nbytes: int) -> np.ndarray:
        """The first `nbytes` bytes of slot `slot`'s pinned buffer, as a writable uint8 array.

        Raises:
            BackendUnavailableError: CuPy or a CUDA device is missing.
        """
        if nbytes == 0:
            return np.empty(0, np.uint8)
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.nbytes < nbytes:
            if self._cupy is None:
                self._cupy = import_cupy()
            self._buffers.pop(slot, None)  # hand the old block back before taking a new one
            capacity = max(self.MIN_BYTES, 1 << (nbytes - 1).bit_length())
            memory = self._cupy.cuda.alloc_pinned_memory(capacity)
            buffer = np.ndarray((capacity,), np.uint8, buffer=memory)  # keeps `memory` alive
            self._buffers[slot] = buffer
        return buffer[:nbytes]

    def to_host(
        self, array: Any, slot: int, copy: bool = True, *, stream: Any = None
    ) -> np.ndarray:
        """A flat numpy array over slot `slot`'s pinned buffer, sized and typed as `array`.

        Args:
            array: a C-contiguous `cupy.ndarray`.
            slot: which buffer to use; one operation uses distinct slots for its arrays.
            copy: copy `array`'s data in (on `stream`, then synchronised); False leaves the
                host contents undefined, for arrays the operation only writes.
            stream: the CuPy stream to copy on; None: the current stream of `array`'s device.

        Raises:
            TypeError: `array` is not a `cupy.ndarray`.
            ValueError: `array` is not C-contiguous.
            BackendUnavailableError: CuPy or a CUDA device is missing.
        """
        _check(array, "array")
        host = self.buffer(slot, array.nbytes).view(array.dtype)
        if copy and array.size:
            streams = _Streams(stream)
            _to_host_async(array, host, streams.get(array))
            streams.synchronize()
        return host

    def to_device(self, host: np.ndarray, array: Any, *, stream: Any = None) -> None:
        """Copy `host` into `array` on `stream` and synchronise it.

        Args:
            host: a C-contiguous numpy array of `array`'s dtype and size (any shape).
            array: a C-contiguous `cupy.ndarray`.
            stream: the CuPy stream to copy on; None: the current stream of `array`'s device.

        Raises:
            TypeError: `array` is not a `cupy.ndarray`, or `host` not a numpy array of its
                dtype.
            ValueError: either is not C-contiguous, or their sizes differ.
        """
        _check(array, "array")
        if not isinstance(host, np.ndarray) or host.dtype != array.dtype:
            raise TypeError(
                f"host staging: host must be a numpy.ndarray of dtype {array.dtype}, got "
                + (f"dtype {host.dtype}" if isinstance(host, np.ndarray) else type(host).__name__)
            )
        if host.size != array.size:
            raise ValueError(
                f"host staging: host has {host.size} elements but the CuPy "
                f"array has {array.size}; they must match"
            )
        if not host.flags.c_contiguous:
            raise ValueError(
                "host staging: host must be C-contiguous; pass numpy.ascontiguousarray(host)"
            )
        if array.size:
            streams = _Streams(stream)
            _to_device_async(host, array, streams.get(array))
            streams.synchronize()

    def clear(self) -> None:
        """Drop every buffer (back to CuPy's pinned-memory allocator)."""
        self._buffers.clear()


def run_staged(
    fn: Callable[..., T],
    outputs: Sequence[Any | None],
    inputs: Sequence[Any | None],
    staging: HostStaging,
    *,
    stream: Any = None,
) -> T:
    """Run the CPU operation `fn` on pinned host copies of CuPy arrays.

    Calls `fn(*host_outputs, *host_inputs)`, one flat numpy array per position (None stays
    None), and returns its result. Arrays whose device memory overlaps get host arrays
    that overlap the same way, so the same array passed as output and input (an in-place
    all_reduce), or an input that is a slice of the output (an in-place all_gather),
    stays in place on the host.

    Every input's bytes are copied in before `fn` runs; output bytes that belong to no
    input are not, so `fn` must write all of them: an array an operation both reads and
    writes (all_reduce, broadcast, reduce) goes in both lists. After `fn` returns the outputs are
    copied back (not when it raises). Each step synchronises its streams. Uses slots
    0, 1, ... of `staging`, one per group of overlapping arrays.

    Args:
        fn: the synchronous CPU operation.
        outputs: C-contiguous CuPy arrays `fn` writes (None allowed).
        inputs: C-contiguous CuPy arrays `fn` reads (None allowed).
        staging: the pinned buffers to use.
        stream: the CuPy stream to copy on; None: each array's device's current stream.

    Raises:
        TypeError: an array is not a `cupy.ndarray`.
        ValueError: an array is not C-contiguous.
        BackendUnavailableError: CuPy or a CUDA device is missing.
    """
    arrays = [*outputs, *inputs]
    for i, array in enumerate(arrays):
        if array is not None:
            _check(array, f"outputs[{i}]" if i < len(outputs) else f"inputs[{i - len(outputs)}]")
    hosts = _layout(arrays, staging)
    streams = _Streams(stream)

    for i in _distinct(arrays, range(len(outputs), len(arrays))):
        _to_host_async(arrays[i], hosts[i], streams.get(arrays[i]))
    streams.synchronize()

    result = fn(*hosts)

    for i in _distinct(arrays, range(len(outputs))):
        _to_device_async(hosts[i], arrays[i], streams.get(arrays[i]))
    streams.synchronize()
    return result


def _span(array: Any) -> tuple[int, int, int]:
    """(device id, first byte, end byte) of a CuPy array's memory."""
    ptr = array.data.ptr
    return (array.device.id, ptr, ptr + array.nbytes)


def _distinct(arrays: list[Any], positions: range) -> list[int]:
    """The positions holding a non-empty array, the first of each memory span only."""
    seen: set[tuple[int, int, int]] = set()
    chosen = []
    for i in positions:
        array = arrays[i]
        if array is not None and array.size and _span(array) not in seen:
            seen.add(_span(array))
            chosen.append(i)
    return chosen


def _layout(arrays: list[Any], staging: HostStaging) -> list[np.ndarray | None]:
    """Host arrays for `arrays`: each group of overlapping ones shares one slot's buffer,
    at the same relative offsets as on the device."""
    hosts: list[np.ndarray | None] = [None if a is None else np.empty(0, a.dtype) for a in arrays]
    extents: list[tuple[int, int, int, list[int]]] = []  # device, start, end, members
    spans = sorted((*_span(a), i) for i, a in enumerate(arrays) if a is not None and a.size)
    for device, start, end, i in spans:
        if extents and extents[-1][0] == device and start < extents[-1][2]:
            last = extents[-1]
            extents[-1] = (device, last[1], max(last[2], end), [*last[3], i])
        else:
            extents.append((device, start, end, [i]))
    for slot, (_, start, end, members) in enumerate(extents):
        buffer = staging.buffer(slot, end - start)
        for i in members:
            array = arrays[i]
            offset = array.data.ptr - start
            hosts[i] = buffer[offset : offset + array.nbytes].view(array.dtype)
    return hosts
