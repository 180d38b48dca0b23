"""CUDA IPC for CuPy arrays crossing process boundaries (distcomm.multiprocessing's reducer).

A CuPy array is sent as a CUDA IPC handle of the device allocation that holds it (found
with `cuMemGetAddressRange`: CuPy's memory pool hands out pieces of larger allocations),
the byte offset of the array's first element in that allocation, shape, strides, dtype
and the device's PCI bus id (so a receiver with another CUDA_VISIBLE_DEVICES order
still finds the same GPU). The receiver opens the handle once per allocation and
process (`cudaIpcOpenMemHandle`, with that device current), builds the same view over
it, and closes the handle when the last array over it is collected.

Lifetime rule (CUDA's, as in torch): the sender must keep the array -- strictly, the
allocation under it -- alive and unchanged in purpose for as long as any receiver uses
its copy of the view. If the sender frees it, CuPy's pool may give the memory to another
array whose contents receivers would then see; if the sender exits, the receivers' views
become invalid. Keep the arrays you share referenced (a list in the sender) until the
receivers report they are done.

Ordering: before the handle is made, the sender synchronises its current stream on the
array's device, so work queued there before sending (the kernels that produced the
array) is complete when the receiver reads it. Work queued on other streams is the
caller's to synchronise.

fork: a process forked from one that had initialised CUDA cannot use CUDA. This module
notes at every `os.fork` whether the parent had initialised the CUDA driver (probed
without initialising it: `cuCtxGetCurrent` answers CUDA_ERROR_NOT_INITIALIZED before
`cuInit`), and in such a child sending or receiving a CuPy array raises RuntimeError
naming the remedy. The check is made in the process that would use CUDA, at pickling and
unpickling time, rather than on `multiprocessing.get_start_method()`: a program may mix
contexts, and a child forked before the parent touched CUDA can use it safely. A CuPy
array passed in the `args` of a fork-started Process is inherited, not pickled, and
cannot be guarded: use spawn or forkserver for processes that use CUDA.

A process receiving a handle it exported itself (a Queue read by its own writer) gets a
view of the original allocation, as long as the array it sent (or the array that one is
a view of) is still alive: CUDA cannot open a handle in the process that exported it.

Passing on: CUDA cannot export memory that a process mapped from another's handle
(`cudaIpcGetMemHandle` refuses it). An array received this way, or a view of it, is sent
on as the original handle with its offset in the original allocation and the original
sender's process id, so a third process opens the original allocation, and the original
sender gets a view of its own allocation back. The original sender must keep the array
alive while any process uses it, as above.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from typing import Any

from ..errors import DistBackendError
from .runtime import cuda_initialized, import_cupy, with_device

__all__ = ["check_fork_safe", "rebuild_cupy_array", "reduce_cupy_array"]

# set in a child forked from a process that had initialised CUDA
_forked_after_cuda = False
_cuda_at_fork = False

_lock = threading.Lock()
# handle -> the mapping this process opened (one per allocation and process)
_opened: weakref.WeakValueDictionary[bytes, _IpcMapping] = weakref.WeakValueDictionary()
# handle -> (the array this process sent, its allocation's base address)
_exported: dict[bytes, tuple[weakref.ref, int]] = {}


def _before_fork() -> None:
    global _cuda_at_fork
    try:
        _cuda_at_fork = cuda_initialized()  # never initialises it
    except BaseException:  # a fork hook must not fail
        _cuda_at_fork = False


def _after_fork_in_child() -> None:
    global _forked_after_cuda, _lock
    _forked_after_cuda = _forked_after_cuda or _cuda_at_fork
    _lock = threading.Lock()  # another thread may have held it at the fork
    _opened.clear()  # the parent's IPC mappings are not usable here
    _exported.clear()


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def check_fork_safe(action: str) -> None:
    """Refuse to use CUDA in a process forked from one that had initialised CUDA.

    Raises:
        RuntimeError: this process is such a child.
    """
    if _forked_after_cuda:
        raise RuntimeError(
            f"cannot {action} a CuPy array in process {os.getpid()}: it was started with "
            "fork from a process that had already initialised CUDA, and CUDA does not "
            "survive fork. Start processes that use CuPy arrays with the 'spawn' or "
            "'forkserver' start method: multiprocessing.set_start_method('spawn') or "
            "multiprocessing.get_context('spawn')"
        )


_get_address_range: Any = None


def _import_cupy(action: str) -> Any:
    return import_cupy(
        f"cannot {action} a CuPy array in process {os.getpid()}: this", need_device=False
    )


def _allocation_range(ptr: int) -> tuple[int, int]:
    """(base address, size) of the device allocation containing `ptr` (driver API).

    The calling thread must have the device's context current (any runtime call made
    with the device selected does that).
    """
    global _get_address_range
    fn = _get_address_range
    if fn is None:
        try:
            libcuda = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise DistBackendError(f"CUDA IPC needs the CUDA driver library ({exc})") from exc
        fn = libcuda.cuMemGetAddressRange_v2
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64,
        ]
        _get_address_range = fn
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = fn(ctypes.byref(base), ctypes.byref(size), ptr)
    if status != 0:
        raise DistBackendError(
            f"CUDA IPC: cuMemGetAddressRange({ptr:#x}) failed with CUresult {status}; the "
            "array's memory is not a device allocation CUDA can export"
        )
    return base.value, size.value


def reduce_cupy_array(array: Any) -> tuple[Any, tuple[Any, ...]]:
    """ForkingPickler's reducer for cupy.ndarray: a CUDA IPC handle and the layout.

    Raises:
        RuntimeError: this process was forked after CUDA was initialised.
        DistBackendError: the memory cannot be exported (managed memory, memory from a
            stream-ordered pool, a CUDA error).
    """
    check_fork_safe("send")
    cupy = _import_cupy("send")
    dtype = array.dtype if array.dtype.fields is not None else array.dtype.str
    if array.size == 0:
        return _rebuild_empty, (array.shape, dtype)
    runtime = cupy.cuda.runtime
    ptr = array.data.ptr
    try:
        with with_device(array.device):
            cupy.cuda.get_current_stream().synchronize()
            mapping = _mapping_holding(ptr)
            if mapping is not None:  # memory another process exported: pass its handle on
                return rebuild_cupy_array, (
                    mapping.handle,
                    mapping.size,
                    ptr - mapping.ptr,
                    array.shape,
                    array.strides,
                    dtype,
                    mapping.bus_id,
                    mapping.sender_pid,
                )
            base, size = _allocation_range(ptr)
            handle = bytes(runtime.ipcGetMemHandle(base))
            bus_id = runtime.deviceGetPCIBusId(array.device.id)
    except runtime.CUDARuntimeError as exc:
        raise DistBackendError(
            f"CUDA IPC: cannot export a CuPy array on device {array.device.id} ({exc}); "
            "only memory from cudaMalloc (CuPy's default pool) can be shared, not managed "
            "memory or a stream-ordered (async) pool"
        ) from exc
    _remember_export(handle, array, base)
    return rebuild_cupy_array, (
        handle,
        size,
        ptr - base,
        array.shape,
        array.strides,
        dtype,
        bus_id,
        os.getpid(),
    )


def _remember_export(handle: bytes, array: Any, base: int) -> None:
    root = array
    while root.base is not None:  # the array that owns the memory: views sent are temporary
        root = root.base
    try:
        ref = weakref.ref(root)
    except TypeError:  # an ndarray type without weak references: no same-process path
        return
    with _lock:
        if len(_exported) >= 64:
            for key in [k for k, (r, _) in _exported.items() if r() is None]:
                del _exported[key]
        _exported[handle] = (ref, base)


def _rebuild_empty(shape: tuple[int, ...], dtype: Any) -> Any:
    return _import_cupy("receive").empty(shape, dtype)


def _mapping_holding(ptr: int) -> _IpcMapping | None:
    """The mapping this process opened that holds device address `ptr`, if any."""
    with _lock:
        for mapping in list(_opened.values()):
            if mapping.ptr <= ptr < mapping.ptr + mapping.size:
                return mapping
    return None


class _IpcMapping:
    """An opened IPC handle; closed when the last array over it is collected. It keeps
    what passing the memory on needs: the handle, the allocation's size, its GPU's bus id
    and the process that exported it."""

    __slots__ = ("__weakref__", "bus_id", "device_id", "handle", "ptr", "sender_pid", "size")

    def __init__(
        self, cupy: Any, handle: bytes, device_id: int, size: int, bus_id: str, sender_pid: int
    ) -> None:
        runtime = cupy.cuda.runtime
        with with_device(cupy.cuda.Device(device_id)):
            self.ptr = runtime.ipcOpenMemHandle(handle)  # lazily enables peer access
        self.device_id = device_id
        self.handle, self.size, self.bus_id, self.sender_pid = handle, size, bus_id, sender_pid
        fin = weakref.finalize(self, _close, cupy, self.ptr, device_id, os.getpid())
        fin.atexit = False  # CUDA tears its contexts down itself at exit


def _close(cupy: Any, ptr: int, device_id: int, pid: int) -> None:
    if os.getpid() != pid:
        return
    try:
        with with_device(cupy.cuda.Device(device_id)):
            cupy.cuda.runtime.ipcCloseMemHandle(ptr)
    except Exception:  # the context is already gone (shutdown): nothing left to close
        pass


def _same_process_memory(cupy: Any, handle: bytes, size: int) -> Any:
    with _lock:
        entry = _exported.get(handle)
    original = entry[0]() if entry else None
    if original is None:
        raise DistBackendError(
            "cannot receive a CuPy array in the process that sent it: the array it was a "
            "view of has been freed (keep sent arrays alive while they are in flight)"
        )
    # the allocation itself, kept alive by the array this process sent
    return cupy.cuda.UnownedMemory(entry[1], size, original, original.device.id)


def rebuild_cupy_array(
    handle: bytes,
    size: int,
    offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: Any,
    bus_id: str,
    sender_pid: int,
) -> Any:
    """Receiver side: open the IPC handle (once per process) and build the same view.

    Raises:
        RuntimeError: this process was forked after CUDA was initialised.
        BackendUnavailableError: CuPy or a CUDA device is missing here.
        DistBackendError: the sender's GPU is not visible here, or CUDA refused the handle.
    """
    check_fork_safe("receive")
    cupy = _import_cupy("receive")
    if sender_pid == os.getpid():
        memory = _same_process_memory(cupy, handle, size)
        with with_device(cupy.cuda.Device(memory.device_id)):
            return cupy.ndarray(
                shape, dtype, memptr=cupy.cuda.MemoryPointer(memory, offset), strides=strides
            )
    runtime = cupy.cuda.runtime
    try:
        device_id = runtime.deviceGetByPCIBusId(bus_id)
    except runtime.CUDARuntimeError as exc:
        raise DistBackendError(
            f"cannot receive a CuPy array from GPU {bus_id} (sent by process {sender_pid}): "
            f"that GPU is not visible to this process ({exc}); check CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}"
        ) from exc
    with _lock:
        mapping = _opened.get(handle)
        if mapping is None:
            try:
                mapping = _IpcMapping(cupy, handle, device_id, size, bus_id, sender_pid)
            except runtime.CUDARuntimeError as exc:
                raise DistBackendError(
                    f"cannot open the CUDA IPC handle of a CuPy array sent by process "
                    f"{sender_pid} on GPU {bus_id} ({exc}); has the sender freed the array "
                    "or exited? It must keep sent arrays alive while receivers use them"
                ) from exc
            _opened[handle] = mapping
    memory = cupy.cuda.UnownedMemory(mapping.ptr, size, mapping, device_id)
    with with_device(cupy.cuda.Device(device_id)):
        return cupy.ndarray(
            shape, dtype, memptr=cupy.cuda.MemoryPointer(memory, offset), strides=strides
        )
