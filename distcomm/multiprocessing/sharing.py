"""Shared numpy arrays: the two sharing strategies, allocation in segments, lookup.

numpy cannot move an existing array's storage, so sharing is explicit: `share_memory`
returns an array with the same contents in a shared segment (the array itself when it
already lies in one), `empty`/`zeros` allocate there directly, and `is_shared` tells.
Any view of a shared array (slice, transpose, reshape, `memoryview`) is shared too:
`find_segment` walks `.base` (and a memoryview's `.obj`) to the `SharedSegment` that
owns the mapping and returns the byte offset of the view's first element in it.

Strategies (torch.multiprocessing's names and API):

- ``file_descriptor`` (default on Linux): an anonymous `memfd_create` segment. Its
  descriptor stays open with the mapping (one descriptor per live segment, like torch's
  cached fd) and is passed to receivers (`multiprocessing.reduction.DupFd`); nothing
  ever appears in /dev/shm, so nothing can leak there, whatever kills the processes.
- ``file_system``: a named file ``/dev/shm/distcomm_<pid>_<counter>_<random>``
  (O_CREAT|O_EXCL, mode 0600) whose descriptor is closed once mapped, so thousands of
  segments cost no descriptors. Names are reference-counted by the shm manager daemon
  (`shm.client.ManagerClient`): the creator registers the name before creating the
  file, each message in flight holds a reference, each process's mapping holds one until
  it is finalized; the manager unlinks a name at count 0, drops the references of a
  process whose connection closed (exit, kill -9), and unlinks every name it still
  tracks once all its clients have gone.

The segments themselves are the `segments` module's. A process maps a segment once however
often it receives it (`open_fd_segment`, `open_named_segment` keep a weak cache keyed by
(st_dev, st_ino) or name), so arrays sent back to their creator are views of the
creator's own mapping.

Mappings are made with libc `mmap` rather than `mmap.mmap` (which keeps a private
duplicate of the descriptor in Python < 3.13): a `SharedSegment` owns the address range,
and a `weakref.finalize` unmaps it, closes its descriptor and, for a named segment,
releases this process's reference once the last array over it is gone. Finalizers do not
run at interpreter exit (the kernel unmaps and closes, and the manager drops the
references of a client whose connection closed).

A process forked (start method ``fork``) inherits its parent's segments: the mappings
are MAP_SHARED, so arrays inherited that way stay shared. A forked child holds no
references to inherited named segments; when it sends one it first registers its own
(`send_reference`), released when its copy of the segment is collected.

The strategy is per process, as in torch: `set_sharing_strategy` in a parent does not
reach children started with ``spawn`` or ``forkserver``; it decides how new segments
are created (and how plain arrays are copied when sent). A segment is always sent the
way it was created.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import numpy as np

from ..gpu.runtime import is_cupy_array
from .segments import (
    FILE_DESCRIPTOR,
    FILE_SYSTEM,
    SHM_DIR,
    SharedSegment,
    create_fd_segment,
    create_named_segment,
    manager_client,
)

__all__ = [
    "SharedSegment",
    "array_in",
    "empty",
    "find_segment",
    "get_all_sharing_strategies",
    "get_sharing_strategy",
    "is_shared",
    "manager_client",
    "set_sharing_strategy",
    "share_memory",
    "zeros",
]

_ALL_STRATEGIES = frozenset(
    ({FILE_DESCRIPTOR} if hasattr(os, "memfd_create") else set())
    | ({FILE_SYSTEM} if os.path.isdir(SHM_DIR) else set())
)
# torch's default: file_descriptor wherever it exists
_strategy = FILE_DESCRIPTOR if FILE_DESCRIPTOR in _ALL_STRATEGIES else FILE_SYSTEM


# -- strategies -------------------------------------------------------------------------------


def get_all_sharing_strategies() -> set[str]:
    """The sharing strategies this system supports (a new set each call)."""
    return set(_ALL_STRATEGIES)


def get_sharing_strategy() -> str:
    """The strategy used to create shared segments in this process."""
    return _strategy


def set_sharing_strategy(new_strategy: str) -> None:
    """Choose how this process creates shared segments from now on.

    Choosing ``file_system`` in the main process also connects to (or starts) the shm
    manager right away, so that processes started afterwards -- a forkserver included --
    inherit its address. A child process connects when it first needs to, preferably to
    the manager named by the first array it receives (`manager_client`).

    Args:
        new_strategy: one of `get_all_sharing_strategies()`.

    Raises:
        ValueError: `new_strategy` is not a supported strategy.
        ShmManagerError: ``file_system`` was chosen in the main process and no manager
            could be reached or started (the strategy stays unchanged).
    """
    global _strategy
    if new_strategy not in _ALL_STRATEGIES:
        valid = ", ".join(repr(s) for s in sorted(_ALL_STRATEGIES))
        raise ValueError(
            f"invalid sharing strategy {new_strategy!r}: this system supports {valid} "
            "(see get_all_sharing_strategies())"
        )
    if new_strategy == FILE_SYSTEM and multiprocessing.parent_process() is None:
        manager_client()
    _strategy = new_strategy


def _create_segment(nbytes: int) -> SharedSegment:
    size = max(nbytes, 1)  # mmap refuses empty mappings
    if _strategy == FILE_SYSTEM:
        return create_named_segment(size)
    return create_fd_segment(size)


# -- arrays -----------------------------------------------------------------------------------


def _extent(array: np.ndarray) -> tuple[int, int, int]:
    """(first element, lowest byte, one past the highest byte) of `array`'s memory."""
    data = array.__array_interface__["data"][0]
    low = high = data
    if array.size:
        for n, stride in zip(array.shape, array.strides, strict=True):
            if stride < 0:
                low += (n - 1) * stride
            else:
                high += (n - 1) * stride
        high += array.itemsize
    return data, low, high


def find_segment(array: np.ndarray) -> tuple[SharedSegment, int] | None:
    """The shared segment `array`'s memory lies in, and its first element's byte offset.

    Follows `.base` from array to array (a memoryview's `.obj`, the helper objects of
    `as_strided`/`broadcast_to`) to the `SharedSegment`, and checks that every byte
    the array can reach lies inside it.

    Returns:
        (segment, offset), or None when the array is not in one of our segments.
    """
    owner: Any = array
    for _ in range(64):  # views of views: the chain is short, never cyclic
        if isinstance(owner, SharedSegment):
            break
        if isinstance(owner, memoryview):
            owner = owner.obj
        elif isinstance(owner, np.ndarray) or hasattr(owner, "__array_interface__"):
            owner = getattr(owner, "base", None)
        else:
            return None
    else:
        return None
    data, low, high = _extent(array)
    if low < owner.address or high > owner.address + owner.size:
        return None
    return owner, data - owner.address


def is_shared(array: Any) -> bool:
    """Whether `array` (or the array it is a view of) lies in shared memory.

    CuPy arrays count as shared: device memory always crosses processes by CUDA IPC
    (torch says the same of CUDA tensors).

    Raises:
        TypeError: `array` is neither a numpy nor a CuPy array.
    """
    if is_cupy_array(array):
        return True
    if not isinstance(array, np.ndarray):
        raise TypeError(
            f"is_shared() takes a numpy or CuPy array, got "
            f"{type(array).__module__}.{type(array).__name__}"
        )
    return find_segment(array) is not None


def _check_dtype(dtype: np.dtype, what: str) -> None:
    if dtype.hasobject:
        raise TypeError(
            f"{what}: dtype {dtype} holds Python object references, which mean nothing in "
            "another process, so it cannot live in shared memory; use a numeric, bool, "
            "string or structured dtype without object fields (such arrays are still "
            "pickled when sent)"
        )


def array_in(
    segment: SharedSegment,
    offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...] | None,
    dtype: np.dtype | str,
    writeable: bool = True,
) -> np.ndarray:
    """An array over `segment` whose first element is at byte `offset`.

    Raises:
        TypeError, ValueError: the layout reaches outside the segment (numpy's checks).
    """
    whole = np.asarray(segment)
    array = np.ndarray(shape, dtype, buffer=whole, offset=offset, strides=strides)
    if not writeable:
        array.flags.writeable = False
    return array


def _allocate(shape: tuple[int, ...], dtype: np.dtype, axes: list[int] | None) -> np.ndarray:
    """A new shared array laid out C-contiguously over `axes` (outermost first)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    segment = _create_segment(nbytes)
    if axes is None:
        return array_in(segment, 0, shape, None, dtype)
    inner = array_in(segment, 0, tuple(shape[a] for a in axes), None, dtype)
    return inner.transpose(np.argsort(axes))


def _new(shape: Any, dtype: Any, order: str, what: str) -> np.ndarray:
    dtype = np.dtype(dtype)
    _check_dtype(dtype, what)
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(n) for n in shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"{what}: negative dimensions are not allowed, got shape {shape}")
    if order not in ("C", "F"):
        raise ValueError(f"{what}: order must be 'C' or 'F', got {order!r}")
    axes = None if order == "C" else list(range(len(shape)))[::-1]
    return _allocate(shape, dtype, axes)


def empty(shape: int | tuple[int, ...], dtype: Any = float, order: str = "C") -> np.ndarray:
    """A new array in shared memory (numpy.empty's signature).

    New segments read as zeros, so this is also `zeros`.

    Args:
        shape: int or tuple of ints.
        dtype: any numpy dtype without object fields.
        order: 'C' (row-major) or 'F' (column-major).

    Raises:
        TypeError: an object dtype.
        ValueError: a negative dimension or another order.
        OSError: the segment could not be created (the descriptor limit under
            ``file_descriptor``, a full /dev/shm under ``file_system``).
    """
    return _new(shape, dtype, order, "empty()")


def zeros(shape: int | tuple[int, ...], dtype: Any = float, order: str = "C") -> np.ndarray:
    """A new zero-filled array in shared memory (numpy.zeros's signature); see `empty`."""
    return _new(shape, dtype, order, "zeros()")


def _axes_like(array: np.ndarray) -> list[int] | None:
    """The axis order that keeps `array`'s memory layout (numpy's order='K'); None is C."""
    if array.ndim < 2 or array.flags.c_contiguous:
        return None
    return sorted(range(array.ndim), key=lambda a: -abs(array.strides[a]))  # stable


#: the most bytes Linux moves in one write()
_MAX_WRITE = 0x7FFFF000


def _write_through(shared: np.ndarray, array: np.ndarray) -> bool:
    """Copy C-contiguous `array` into the new segment under `shared` with pwrite.

    The kernel fills the segment's pages directly, so the copy takes no page fault per
    4 KiB (about twice as fast as copying through the fresh mapping). Returns False when
    the segment has no descriptor to write through (the caller then copies).
    """
    found = find_segment(shared)
    if found is None or array.nbytes == 0:
        return False
    segment, offset = found
    fd, opened = segment.fd, False
    if fd is None:
        if segment.name is None:
            return False
        fd, opened = os.open(os.path.join(SHM_DIR, segment.name), os.O_WRONLY | os.O_CLOEXEC), True
    try:
        data = array.reshape(-1).view(np.uint8)
        done = 0
        while done < data.nbytes:
            done += os.pwrite(fd, data[done : done + _MAX_WRITE], offset + done)
    finally:
        if opened:
            os.close(fd)
    return True


def share_memory(array: Any) -> np.ndarray:
    """`array` if it is already shared, otherwise a copy of it in shared memory.

    The copy keeps the contents, dtype, shape, the order of the axes in memory (a
    transposed or Fortran-ordered array stays so, compacted) and the writeable flag.
    A subclass (np.memmap, np.matrix, ...) gives a plain ndarray. CuPy arrays are
    returned as they are (see `is_shared`).

    Raises:
        TypeError: not an array, or an object dtype.
        OSError: the segment could not be created (see `empty`).
    """
    if is_cupy_array(array):
        return array
    if not isinstance(array, np.ndarray):
        raise TypeError(
            f"share_memory() takes a numpy array, got "
            f"{type(array).__module__}.{type(array).__name__}; convert it with "
            "numpy.asarray() first"
        )
    _check_dtype(array.dtype, "share_memory()")
    if find_segment(array) is not None:
        return array
    shared = _allocate(array.shape, array.dtype, _axes_like(array))
    if not (
        array.flags.c_contiguous and shared.flags.c_contiguous and _write_through(shared, array)
    ):
        np.copyto(shared, array, casting="no")
    if not array.flags.writeable:
        shared.flags.writeable = False
    return shared
