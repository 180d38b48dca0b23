"""An in-process stand-in for the part of CuPy and `cupy.cuda.nccl` that distcomm uses.

`CudaStandin()` builds fresh `cupy`, `cupy.cuda`, `cupy.cuda.runtime` and
`cupy.cuda.nccl` modules; `install(monkeypatch)` puts them in `sys.modules`, so
distcomm's `import cupy` and `from cupy.cuda import nccl` find them. Ranks of an NCCL
communicator are threads of this process. Nothing here needs a GPU.

What is modelled
----------------
* Device memory is host memory: a `cupy.ndarray` wraps a numpy array, and its
  `.data.ptr` is the numpy array's address. Every allocation is registered with its
  device, so every raw pointer the stand-in is handed (NCCL buffers, device-to-device
  copies) is checked to lie inside one live allocation of the right device. New
  arrays (`cupy.empty`) are filled with 0xA5 bytes, so reading unwritten memory shows.
  An allocation lives as long as its array (views keep it alive): once the array is
  collected CuPy's pool may hand the memory out again, so a kernel or copy still queued
  on a stream that touches it when it runs is a violation ("freed meanwhile").
* Devices: `device_count` fake GPUs; the current device is per thread (as CUDA's), set
  by `Device(i).use()` or `with Device(i):`. CUDA contexts per thread: a call that needs
  one (kernels, allocations, streams, events, copies, `setDevice`) binds the current
  device's context in the calling thread; CuPy's `with Device(i):` switches back on exit
  with `setDevice`, which (CUDA 12) binds that device's context too. A thread that has
  used one GPU and binds the context of another it never chose itself - a new thread's
  current device is 0 - makes an extra context there: a violation.
  `driver.ctxGetCurrent()` is 0 on a thread that has bound none.
* Sticky errors: `fault(device)` leaves a sticky CUDA error on a device (a kernel read
  an illegal address): its streams stop, `runtime.eventQuery(ptr)` returns the error's
  status (it returns 0, 600 for not ready, or an error, and never raises), so CuPy's
  `Event.done` (`eventQuery(...) == 0`) stays False for ever without raising; waiting,
  launching or allocating there raises CUDARuntimeError. NCCL's async error does not
  report it.
* Streams: each `Stream` (and each device's legacy null stream, ptr 0) is an in-order
  work queue. The current stream is per thread and per device (`with stream:`, which
  refuses a stream of another device, as CuPy does). Work on an idle stream runs at
  once in the calling thread; work on a stream that is blocked (waiting for an event
  that is not done, behind a hung NCCL operation, or paused by a test) is queued and
  runs, in order, when the blocker clears. Kernels (`a[...] = b`, `a /= n`,
  `bitwise_and`, `concatenate`, `zeros`, `asarray`) run on the current stream and
  refuse arrays of another device (CuPy's ValueError). `Event.record(stream)` marks a
  position in a queue; `done` is whether the queue has passed it; an event of one
  device cannot be recorded on another device's stream. `get()` synchronises the
  current stream first. `__array__` raises TypeError, as CuPy's does (use `.get()`).
* NCCL: communicators created with the same unique id rendezvous through the stand-in
  (`NcclCommunicator` blocks until all `ndev` ranks have joined, and refuses two ranks
  on one device with NCCL's "Duplicate GPU detected" error, failing only those two, as
  NCCL up to 2.29 does; when some rank fails to initialise, the others hang, as in real
  NCCL, until `end_hung_inits()` (the process's exit) or `wait_timeout`, counted in
  `hung_inits` and `init_hangs_timed_out`). The id must be `bytes`
  under CuPy >= 14 and a tuple of 128 signed chars under CuPy 13, else TypeError (the
  form follows `cupy.__version__`; `comm_id_form` overrides it). Collectives block the
  calling thread until every rank of the communicator issued its next collective, then
  every rank checks that all agree on (kind, count, datatype, op, root) - a mismatch
  raises `NcclError` on every rank instead of hanging (real NCCL would hang or corrupt
  memory) - and computes its result from snapshots of every rank's send buffer:
  reductions in the NCCL datatype, in rank order; AVG is the sum divided by the rank
  count in the datatype (refused with ncclInvalidArgument before NCCL 2.10). A
  collective of 0 elements is a no-op, as in NCCL. Between `groupStart()` and the
  outermost `groupEnd()` (a per-thread depth) operations are queued; `groupEnd()`
  posts every send, runs the collectives, then completes every receive (blocking until
  the matching message arrives); a group whose receive buffer overlaps another of its
  send or receive buffers raises NcclError (invalid usage, a violation): they run
  concurrently. Outside a group a `send` or `recv` is a stream item that completes only
  when the peer's matching operation (same pair, posting order) is running too - a lone
  receive waiting at the head of its stream, or a grouped receive, takes a lone send's
  message; until then the stream is blocked (later work waits, later events are not
  done). One never matched ends after `wait_timeout` with a violation and an async error
  on its communicator. Messages between two ranks match in posting order; count and
  datatype must match.
* Order on a GPU: NCCL launches (an operation, or a group) of one GPU start in the order
  they were issued there, by any communicator, stream or thread: each only once every
  earlier one has completed (a released communicator's no longer count). So ranks that
  issue operations of two communicators in different orders deadlock, and the
  collective or receive that waits reports it after `wait_timeout`. A launch that must
  wait is queued on its stream and run later on a thread of its own (the "GPU").
* In place: a collective whose send and receive buffers overlap must be NCCL's in-place
  form (allReduce, broadcast, reduce: the same buffer; allGather: sendbuff == recvbuff +
  rank * count; reduceScatter: recvbuff == sendbuff + rank * recvcount); any other
  overlap raises NcclError (invalid usage) and is a violation.
* `abort()`/`destroy()` release the communicator; later calls raise NcclError (invalid
  argument), as CuPy's do on a released communicator. CuPy's communicators are blocking:
  `abort()` while another thread is inside an NCCL call on the communicator (its
  collectives, send, recv, or a groupEnd holding its operations) is a violation, as
  NCCL forbids it. A non-blocking communicator (`nonblocking=True`: nccl4py's, made by
  tests/nccl4py_standin.py, which runs its rendezvous with `join()` on a thread of its
  own) may be aborted at any time, from any thread: that is no violation, and the abort
  ends its hung initialisation (the peers' wait, or the hang after a peer failed). An
  abort ends the communicator's hung operations, but the work queued
  behind them on their streams runs later, asynchronously: when something waits for
  that stream or one of its events, or at `settle()`. `destroy()` is a collective of
  the node's ranks (every rank of a clique here): it waits for the others to destroy
  theirs; after a peer's abort it would block for ever (a violation). `unreleased()`
  lists communicators neither aborted nor destroyed, which CuPy's `__dealloc__` would
  destroy at garbage collection or exit.
* Processes, IPC and fork: the stand-in's notion of a process is per thread
  (`with standin.as_process("A"):`, default "main"), since every stand-in process shares
  this interpreter: an allocation belongs to the process that made it.
  `runtime.ipcGetMemHandle(ptr)` gives the 64-byte handle of the whole allocation
  holding `ptr` (the same handle each time), and refuses, with cudaErrorInvalidValue as
  CUDA does, memory that is not the calling process's own - in particular memory it
  mapped with `ipcOpenMemHandle`. `ipcOpenMemHandle(handle)` in the exporting process
  fails with cudaErrorDeviceUninitialized ("invalid device context"), as CUDA does; in
  another it maps the allocation (at the exporter's address: one address space stands
  for all) until `ipcCloseMemHandle`; opening a handle twice in one process, or after
  the exporter freed the allocation, is cudaErrorInvalidValue. libcuda's
  `cuMemGetAddressRange_v2`, which CuPy does not bind, is `standin.libcuda.
  cuMemGetAddressRange_v2` with ctypes' calling convention (byref results, a CUresult):
  it finds the process's own allocations and the mappings it opened, else
  CUDA_ERROR_NOT_FOUND. `cupy.cuda.UnownedMemory`, `MemoryPointer(mem, offset)` and
  `cupy.ndarray(shape, dtype, memptr=, strides=)` build arrays over such memory.
  CUDA initialisation: runtime calls (the device count, current device, streams,
  allocations, kernels, IPC) initialise the driver (`cuda_initialized`);
  `cupy.cuda.driver.ctxGetCurrent()` never does, and raises `CUDADriverError` with
  status 3 (CUDA_ERROR_NOT_INITIALIZED) before. In a child that `os.fork()` made after
  the driver was initialised (`forked_after_init`), every such call raises
  CUDARuntimeError('cudaErrorInitializationError: initialization error'), as real CUDA
  does; a child forked before can use it.
* Arrays export `__cuda_array_interface__` (version 3, CuPy's form: the stream is the
  current stream of the array's device, 1 for the null stream), which mpi4py reads to
  hand the memory to a CUDA-aware MPI (here plain host memory), and `.base` (the array
  a view was taken from, as CuPy's).
* Test switches: `hang(ranks)` makes the communicators of those ranks accept operations
  that never complete (their data is not written, events after them stay not done,
  and the stream stays blocked) until `abort()`; `inject_async_error(rank)` makes
  `check_async_error()` raise; `fail_init(rank)` makes `NcclCommunicator` raise;
  `pause(stream)` / `resume(stream)` hold a stream's queue (to check ordering);
  `hold_aborts()` / `release_aborts()` keep `abort()` from returning (after it ended
  the hung operations), as NCCL's abort waits for the device's other kernels.
* Every call is logged (`calls()`), every blocking wait ends after `wait_timeout`
  seconds (or at once after `interrupt(reason)`, which a test harness calls when one
  rank failed so the others stop waiting for it), and misuse that a real GPU would
  punish (a pointer outside any allocation or on the wrong device, a stream of another
  device, a collective that times out, ncclCommDestroy with operations that can never
  finish, an operation on a released communicator) is recorded in `violations` as well
  as raised.

Not modelled: real asynchrony (an operation on an idle stream has finished when the call
returns; the exceptions are the work an abort leaves queued, and lone sends and
receives), several hosts (destroy's node is the whole clique), the legacy null stream's
implicit synchronisation with other blocking streams, per-thread default streams, peer
access, memory pools, kernels and array methods distcomm does not call, bfloat16,
ncclCommSplit/initAll, NCCL's pre-multiplied AVG for floats (here: sum, then divide),
and a hung operation that later completes (a hung operation only ends by `abort()`,
without writing data).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import os
import sys
import threading
import time
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Call", "CudaStandin", "NcclError", "StandinError"]

#: NCCL's datatype codes and the numpy dtype of each
NCCL_DTYPES = {
    0: np.dtype(np.int8),
    1: np.dtype(np.uint8),
    2: np.dtype(np.int32),
    3: np.dtype(np.uint32),
    4: np.dtype(np.int64),
    5: np.dtype(np.uint64),
    6: np.dtype(np.float16),
    7: np.dtype(np.float32),
    8: np.dtype(np.float64),
}
#: NCCL's reduction op codes
NCCL_OPS = {0: "SUM", 1: "PROD", 2: "MAX", 3: "MIN", 4: "AVG"}
_UFUNCS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum, 4: np.add}

# ncclResult_t (NCCL 2)
SUCCESS, UNHANDLED_CUDA_ERROR, SYSTEM_ERROR, INTERNAL_ERROR = 0, 1, 2, 3
INVALID_ARGUMENT, INVALID_USAGE, REMOTE_ERROR = 4, 5, 6
_STATUS = {
    0: ("NCCL_ERROR_SUCCESS", "no error"),
    1: ("NCCL_ERROR_UNHANDLED_CUDA_ERROR", "unhandled cuda error"),
    2: ("NCCL_ERROR_SYSTEM_ERROR", "unhandled system error"),
    3: ("NCCL_ERROR_INTERNAL_ERROR", "internal error"),
    4: ("NCCL_ERROR_INVALID_ARGUMENT", "invalid argument"),
    5: ("NCCL_ERROR_INVALID_USAGE", "invalid usage"),
    6: ("NCCL_ERROR_REMOTE_ERROR", "remote process exited or there was a network error"),
}
_UID_BYTES = 128
#: cudaError_t codes the stand-in returns, with their names and texts
_CUDA_ERRORS = {
    400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    600: ("cudaErrorNotReady", "device not ready"),
    700: ("cudaErrorIllegalAddress", "an illegal memory access was encountered"),
    719: ("cudaErrorLaunchFailure", "unspecified launch failure"),
}
_FILL = 0xA5  # what a new allocation holds


class NcclError(RuntimeError):
    """`cupy.cuda.nccl.NcclError`: an NCCL status code and its text."""

    def __init__(self, status: int, detail: str = "") -> None:
        self.status = status
        name, text = _STATUS.get(status, (f"NCCL_ERROR_{status}", "unknown error"))
        super().__init__(f"{name}: {text}" + (f" ({detail})" if detail else ""))

    def __reduce__(self) -> tuple:
        return (type(self), (self.status,))


class CUDARuntimeError(RuntimeError):
    """`cupy.cuda.runtime.CUDARuntimeError`."""


class StandinError(RuntimeError):
    """Misuse the stand-in detected that a real GPU would punish (also in `violations`)."""


# CUresult codes the driver calls below answer
CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_NOT_FOUND = 1, 3, 500
_CU_NAMES = {
    CUDA_ERROR_INVALID_VALUE: ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
    CUDA_ERROR_NOT_INITIALIZED: ("CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
    CUDA_ERROR_NOT_FOUND: ("CUDA_ERROR_NOT_FOUND", "named symbol not found"),
}
_INIT_ERROR = "cudaErrorInitializationError: initialization error"


class CUDADriverError(RuntimeError):
    """`cupy.cuda.driver.CUDADriverError`: a CUresult `status` and its text."""

    def __init__(self, status: int) -> None:
        self.status = status
        name, text = _CU_NAMES.get(status, (f"CUDA_ERROR_{status}", "unknown error"))
        super().__init__(f"{name}: {text}")

    def __reduce__(self) -> tuple:
        return (type(self), (self.status,))


# every stand-in alive, for the fork hook: a child forked after CUDA was initialised
# cannot use it (`CudaStandin.forked_after_init`)
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for standin in list(_LIVE):
        if standin.cuda_initialized:
            standin.forked_after_init = True


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass(frozen=True)
class Call:
    """One logged call: the calling thread's name, the communicator's rank (None for
    calls that have no communicator), the call's name and its arguments."""

    thread: str
    rank: int | None
    name: str
    args: dict = field(default_factory=dict)


# -- streams ------------------------------------------------------------------------------


@dataclass
class _Item:
    kind: str  # "fn" (a kernel or copy), "wait" (an event), "hung", "comm" (deferred NCCL
    # group), "p2p" (a lone NCCL send or receive)
    fn: Callable[[], None] | None = None
    spans: tuple = ()  # (ptr, nbytes) of the memory a queued kernel or copy touches
    event: Any = None
    comm: Any = None
    comms: tuple = ()
    #: NCCL items: the launch's number on its device (-1: none); it starts only once
    #: every NCCL launch issued before it on that device has completed
    seq: int = -1
    device: int = -1
    op: Any = None  # "p2p" (a lone NCCL send or receive): the operation
    state: int = 0  # "p2p": 0 queued, 1 started (waiting for its peer), 2 done
    timer: Any = None  # "p2p": ends a wait that never matches


class _Queue:
    """The in-order work queue of one CUDA stream."""

    def __init__(self, ptr: int, device: int, label: str) -> None:
        self.ptr, self.device, self.label = ptr, device, label
        self.items: deque[_Item] = deque()
        self.submitted = 0  # positions handed out
        self.completed = 0  # positions passed
        self.paused = False
        self.running = False  # a deferred NCCL item is executing outside the lock
        #: an abort ended a hung NCCL operation here: the work queued behind it runs
        #: later, asynchronously (when something waits for this stream, or `settle()`)
        self.lagging = False

    def blocked(self) -> bool:
        return bool(self.paused or self.items or self.running)


# -- the per-world classes (subclassed with `_w` set by CudaStandin) ----------------------


class _MemoryPointer:
    """`cupy.cuda.MemoryPointer`: `.ptr` and device-to-device copies on a stream."""

    def __init__(self, world: CudaStandin, ptr: int, device_id: int) -> None:
        self._w, self.ptr, self.device_id = world, ptr, device_id

    def __int__(self) -> int:
        return self.ptr

    def copy_from_device_async(self, src: _MemoryPointer, size: int, stream: Any = None) -> None:
        w = self._w
        size = int(size)
        w._log(
            None,
            "copy_from_device_async",
            dst=self.ptr,
            src=src.ptr,
            size=size,
            stream=None if stream is None else stream.ptr,
        )
        if size <= 0:
            return
        w._check_memory(self.ptr, size, None, "copy_from_device_async destination")
        w._check_memory(src.ptr, size, None, "copy_from_device_async source")
        if self.ptr != src.ptr and self.ptr < src.ptr + size and src.ptr < self.ptr + size:
            # cudaMemcpyAsync of overlapping ranges is undefined (it is no memmove)
            w._violation(
                f"copy_from_device_async: source [{src.ptr:#x}, +{size}) and destination "
                f"[{self.ptr:#x}, +{size}) overlap"
            )
        queue = w._queue_of(w._current_stream() if stream is None else stream)
        dst_ptr, src_ptr = self.ptr, src.ptr
        w._touch()
        w._submit(
            queue,
            lambda: ctypes.memmove(dst_ptr, src_ptr, size),
            ((dst_ptr, size), (src_ptr, size)),
        )

    def _host_copy(self, what: str, host: Any, size: int, stream: Any, to_host: bool) -> None:
        """A copy between this device memory and host memory at `host` (a c_void_p)."""
        w = self._w
        size, address = int(size), int(host.value or 0)
        w._log(
            None,
            what,
            ptr=self.ptr,
            host=address,
            size=size,
            stream=None if stream is None else stream.ptr,
        )
        if size <= 0:
            return
        w._check_memory(self.ptr, size, None, what)
        queue = w._queue_of(w._current_stream() if stream is None else stream)
        if queue.device != self.device_id:
            w._violation(
                f"{what}: memory of device {self.device_id} copied on "
                f"{queue.label} of device {queue.device}"
            )
        dst, src = (address, self.ptr) if to_host else (self.ptr, address)
        w._touch()
        w._submit(queue, lambda: ctypes.memmove(dst, src, size), ((self.ptr, size),))

    def copy_to_host_async(self, mem: Any, size: int, stream: Any = None) -> None:
        self._host_copy("copy_to_host_async", mem, size, stream, to_host=True)

    def copy_from_host_async(self, mem: Any, size: int, stream: Any = None) -> None:
        self._host_copy("copy_from_host_async", mem, size, stream, to_host=False)


class _UnownedMemory:
    """`cupy.cuda.UnownedMemory`: device memory that `owner` keeps alive."""

    def __init__(self, ptr: int, size: int, owner: Any, device_id: int | None = None) -> None:
        if device_id is None:  # CuPy asks cudaPointerGetAttributes, not modelled
            raise NotImplementedError("the stand-in's UnownedMemory needs device_id")
        self.ptr, self.size, self.device_id = int(ptr), int(size), int(device_id)
        self._owner = owner


class _PointerInto(_MemoryPointer):
    """`cupy.cuda.MemoryPointer(mem, offset)`: a pointer into `mem`, keeping it alive."""

    _w: CudaStandin

    def __init__(self, mem: Any, offset: int) -> None:
        super().__init__(self._w, mem.ptr + int(offset), mem.device_id)
        self.mem = mem


class _Flags:
    def __init__(self, array: np.ndarray) -> None:
        self.c_contiguous = bool(array.flags.c_contiguous)
        self.f_contiguous = bool(array.flags.f_contiguous)
        self.owndata = bool(array.flags.owndata)
        # CuPy's flags have no `writeable`


class _NdArray:
    """`cupy.ndarray`: a numpy array standing for device memory on one device."""

    _w: CudaStandin

    def __init__(
        self, host: Any, device_id: Any = float, memptr: Any = None, strides: Any = None
    ) -> None:
        if not isinstance(host, np.ndarray):  # CuPy's ndarray(shape, dtype, memptr, strides)
            host, device_id = self._w._over_memory(host, device_id, memptr, strides)
        self._host = host
        self._device_id = device_id
        self._base: _NdArray | None = None  # a view keeps its allocation's array alive

    # -- attributes
    @property
    def data(self) -> _MemoryPointer:
        return _MemoryPointer(self._w, int(self._host.ctypes.data), self._device_id)

    @property
    def device(self) -> Any:
        return self._w.Device(self._device_id)

    @property
    def base(self) -> _NdArray | None:
        """The array this one is a view of (its root, as CuPy's); None for an owner."""
        return self._base

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CuPy's version 3 export: the stream is the current stream of the array's device
        (1 for the legacy null stream), which consumers such as mpi4py ignore."""
        host = self._host
        with self.device:
            stream = self._w._get_current_stream().ptr or 1
        return {
            "shape": host.shape,
            "typestr": host.dtype.str,
            "descr": host.dtype.descr,
            "data": (int(host.ctypes.data) if host.size else 0, False),
            "strides": None if host.flags.c_contiguous else host.strides,
            "version": 3,
            "stream": stream,
        }

    @property
    def size(self) -> int:
        return int(self._host.size)

    @property
    def dtype(self) -> np.dtype:
        return self._host.dtype

    @property
    def nbytes(self) -> int:
        return int(self._host.nbytes)

    @property
    def itemsize(self) -> int:
        return int(self._host.itemsize)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._host.shape

    @property
    def strides(self) -> tuple[int, ...]:
        return self._host.strides

    @property
    def ndim(self) -> int:
        return self._host.ndim

    @property
    def flags(self) -> _Flags:
        return _Flags(self._host)

    def __len__(self) -> int:
        return len(self._host)

    def __repr__(self) -> str:
        return (
            f"<stand-in cupy.ndarray shape={self.shape} dtype={self.dtype} "
            f"device={self._device_id}>"
        )

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. Please use "
            "`.get()` to construct a NumPy array explicitly."
        )

    # -- views (no data is read or written)
    def _wrap(self, host: np.ndarray) -> _NdArray:
        view = type(self)(host, self._device_id)
        view._base = self._base if self._base is not None else self
        return view

    def view(self, dtype: Any = None) -> _NdArray:
        return self._wrap(self._host.view() if dtype is None else self._host.view(dtype))

    def reshape(self, *shape: Any) -> _NdArray:
        return self._wrap(self._host.reshape(*shape))

    def ravel(self) -> _NdArray:
        return self.reshape(-1)

    def __getitem__(self, key: Any) -> _NdArray:
        """Basic indexing only (slices, ints, Ellipsis): a view sharing memory."""
        if not isinstance(key, tuple):
            key = (key,)
        if any(
            not isinstance(k, (slice, int, np.integer)) and k is not Ellipsis and k is not None
            for k in key
        ):
            raise NotImplementedError("the stand-in supports basic indexing only")
        if not any(k is Ellipsis for k in key):
            key = (*key, Ellipsis)  # an int index gives a 0-d view, as CuPy's does
        return self._wrap(self._host[key])

    # -- kernels (run on the current stream, in order)
    def __setitem__(self, key: Any, value: Any) -> None:
        arrays = [self]
        host = self._host
        if isinstance(value, _NdArray):
            arrays.append(value)
            source = value._host

            def run() -> None:
                host[key] = source
        else:
            captured = np.array(value, copy=True)

            def run() -> None:
                host[key] = captured

        self._w._kernel(arrays, run)

    def __itruediv__(self, other: Any) -> _NdArray:
        np.true_divide(self._host[:0], other, out=self._host[:0])  # CuPy's casting errors
        host = self._host
        self._w._kernel([self], lambda: np.true_divide(host, other, out=host))
        return self

    def __iadd__(self, other: Any) -> _NdArray:
        arrays = [self, other] if isinstance(other, _NdArray) else [self]
        operand = other._host if isinstance(other, _NdArray) else other
        host = self._host
        self._w._kernel(arrays, lambda: np.add(host, operand, out=host))
        return self

    def __imul__(self, other: Any) -> _NdArray:
        if isinstance(other, _NdArray):
            raise NotImplementedError("the stand-in multiplies by a scalar only")
        np.multiply(self._host[:0], other, out=self._host[:0])  # CuPy's casting errors
        host = self._host
        self._w._kernel([self], lambda: np.multiply(host, other, out=host))
        return self

    def __mul__(self, other: Any) -> _NdArray:
        """A scaled copy (ReduceOp.PREMUL_SUM on an input the caller keeps)."""
        if isinstance(other, _NdArray):
            raise NotImplementedError("the stand-in multiplies by a scalar only")
        dtype = np.result_type(self.dtype, other)
        out = self._w._alloc(self.shape, dtype)
        source, target = self._host, out._host
        self._w._kernel([self, out], lambda: np.multiply(source, other, out=target))
        return out

    def fill(self, value: Any) -> None:
        self[...] = value

    def copy(self) -> _NdArray:
        out = self._w._alloc(self.shape, self.dtype)
        source, target = self._host, out._host
        self._w._kernel([self, out], lambda: target.__setitem__(..., source))
        return out

    def astype(self, dtype: Any) -> _NdArray:
        out = self._w._alloc(self.shape, dtype)
        source, target = self._host, out._host
        self._w._kernel([self, out], lambda: target.__setitem__(..., source))
        return out

    def get(self, stream: Any = None) -> np.ndarray:
        """A host copy, after the current (or given) stream has finished its work."""
        w = self._w
        with self.device:
            queue = w._queue_of(w._current_stream() if stream is None else stream)
        w._drain(queue, f"ndarray.get() on {queue.label}")
        return self._host.copy()


class _Device:
    """`cupy.cuda.Device`."""

    _w: CudaStandin

    def __init__(self, device: Any = None) -> None:
        if device is None:
            device = self._w._current_device()
        self.id = int(device)

    def _check(self) -> None:
        if not 0 <= self.id < self._w.device_count:
            raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")

    def use(self) -> None:
        self._check()
        self._w._set_device(self.id, chosen=True)

    def __enter__(self) -> _Device:
        """As CuPy's: remember the current device (cudaGetDevice, no context) and switch
        (cudaSetDevice, which binds the device's context) when it differs."""
        self._check()
        state = self._w._tls_state()
        state.device_stack.append(state.device)
        if state.device != self.id:
            self._w._set_device(self.id, chosen=True)
        return self

    def __exit__(self, *exc: object) -> None:
        """As CuPy's: switch back with cudaSetDevice, which binds the previous device's
        context in this thread - on GPU 0 for a thread that never chose a device."""
        state = self._w._tls_state()
        previous = state.device_stack.pop()
        if previous != state.device:
            self._w._set_device(previous, chosen=False)

    def synchronize(self) -> None:
        self._check()
        w = self._w
        w._log(None, "Device.synchronize", device=self.id)
        for queue in w._queues_of_device(self.id):
            w._drain(queue, f"Device({self.id}).synchronize()")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Device) and other.id == self.id

    def __hash__(self) -> int:
        return self.id

    def __int__(self) -> int:
        return self.id

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


class _Stream:
    """`cupy.cuda.Stream`; `Stream.null` (ptr 0) is the current device's legacy stream."""

    _w: CudaStandin
    null: _Stream

    def __init__(
        self,
        null: bool = False,
        non_blocking: bool = False,
        ptds: bool = False,
        priority: Any = None,
    ) -> None:
        w = self._w
        self.non_blocking = non_blocking
        if null:
            self.ptr, self.device_id = 0, -1
            return
        self.device_id = w._current_device()
        w._touch()
        self.ptr = next(w._ptrs)
        with w.lock:
            w._queues[self.ptr] = _Queue(self.ptr, self.device_id, f"stream {self.ptr:#x}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stream) and other.ptr == self.ptr

    def __hash__(self) -> int:
        return self.ptr

    def __repr__(self) -> str:
        return f"<Stream {self.ptr} (device {self.device_id})>"

    def _device_matches(self) -> int:
        current = self._w._current_device()
        device = current if self.device_id == -1 else self.device_id
        if device != current:
            raise RuntimeError(
                f"The device that the stream is created on ({device}) does "
                f"not match with the current device ({current})"
            )
        return device

    def __enter__(self) -> _Stream:
        device = self._device_matches()
        state = self._w._tls_state()
        state.streams.setdefault(device, []).append(self)
        state.stream_devices.append(device)
        return self

    def __exit__(self, *exc: object) -> None:
        state = self._w._tls_state()
        device = state.stream_devices.pop()
        state.streams[device].pop()

    def use(self) -> _Stream:
        device = self._device_matches()
        stack = self._w._tls_state().streams.setdefault(device, [])
        if stack:
            stack[-1] = self
        else:
            stack.append(self)
        return self

    @property
    def done(self) -> bool:
        queue = self._w._queue_of(self)
        with self._w.lock:
            return not queue.blocked()

    def synchronize(self) -> None:
        queue = self._w._queue_of(self)
        self._w._log(None, "Stream.synchronize", stream=self.ptr)
        self._w._drain(queue, f"{queue.label}.synchronize()")

    def record(self, event: Any = None) -> Any:
        if event is None:
            event = self._w.Event()
        event.record(self)
        return event

    def wait_event(self, event: Any) -> None:
        w = self._w
        queue = w._queue_of(self)
        w._log(None, "Stream.wait_event", stream=self.ptr, device=queue.device, event=event)
        w._touch()
        with w.lock:
            queue.submitted += 1
            if not queue.blocked() and event._is_done():
                queue.completed += 1
            else:
                queue.items.append(_Item("wait", event=event))


class _Event:
    """`cupy.cuda.Event`: a position in a stream's queue."""

    _w: CudaStandin

    def __init__(
        self, block: bool = False, disable_timing: bool = False, interprocess: bool = False
    ) -> None:
        w = self._w
        w._touch()
        self.ptr = next(w._ptrs)
        self.device_id = w._current_device()
        self._queue: _Queue | None = None
        self._target = 0
        w._events[self.ptr] = self

    def __repr__(self) -> str:
        return f"<Event {self.ptr:#x} (device {self.device_id})>"

    def record(self, stream: Any = None) -> None:
        w = self._w
        if stream is None:
            stream = w._current_stream()
        queue = w._queue_of(stream)
        w._log(None, "Event.record", event=self, stream=queue.ptr, device=queue.device)
        w._touch()
        if queue.device != self.device_id:
            w._violation(
                f"Event.record: event of device {self.device_id} recorded on "
                f"{queue.label} of device {queue.device}"
            )
            raise CUDARuntimeError("cudaErrorInvalidResourceHandle: invalid resource handle")
        with w.lock:
            self._queue, self._target = queue, queue.submitted

    @property
    def done(self) -> bool:
        """CuPy's: `runtime.eventQuery(ptr) == 0`. It never raises: after a sticky CUDA
        error it is False for ever (the error is only in eventQuery's status)."""
        return self._w._event_query(self.ptr) == 0

    def _is_done(self) -> bool:
        with self._w.lock:
            return self._queue is None or self._queue.completed >= self._target

    def synchronize(self) -> None:
        w = self._w
        w._touch()
        w._raise_fault(self.device_id)
        w._catch_up(self._queue)
        w._wait_until(self._is_done, f"Event.synchronize() of {self!r}", self.device_id)


# -- NCCL ----------------------------------------------------------------------------------


class _Clique:
    """The communicators that share one unique id."""

    def __init__(self, uid: bytes, ndev: int) -> None:
        self.uid, self.ndev = uid, ndev
        self.members: dict[int, Any] = {}
        self.colls: dict[int, dict] = {}  # collective number -> posts and readers left
        self.mail: dict[tuple[int, int], deque] = {}  # (src, dst) -> messages in order
        #: (src, dst) -> the lone receive at the head of dst's stream, waiting for a message
        self.waiting: dict[tuple[int, int], _Item] = {}
        self.failures: dict[int, NcclError] | None = None  # set once every rank joined


@dataclass
class _Message:
    count: int
    datatype: int
    payload: bytes
    item: _Item | None = None  # a lone send's item: it completes when a receive takes this


@dataclass
class _Op:
    """One NCCL operation, run now or at the outermost groupEnd."""

    comm: Any
    kind: str  # "coll", "send", "recv"
    name: str
    stream: int
    desc: tuple = ()
    send: tuple[int, int] | None = None  # (ptr, nbytes) read
    recv: tuple[int, int] | None = None  # (ptr, nbytes) written
    count: int = 0
    datatype: int = 0
    peer: int = -1
    queue: _Queue | None = None


class _NcclCommunicator:
    """`cupy.cuda.nccl.NcclCommunicator` for one rank (a thread) of a clique."""

    _w: CudaStandin
    #: a non-blocking communicator (nccl4py's: tests/nccl4py_standin.py): abort() is
    #: allowed while another thread is inside a call, and ends a hung initialisation
    nonblocking = False

    def __init__(self, ndev: int, commId: Any, rank: int, *, nonblocking: bool = False) -> None:
        """CuPy's signature; `nonblocking`: returns before the rendezvous, which `join()`
        runs (on the thread of nccl4py's stand-in that initialises it)."""
        w = self._w
        form = w._comm_id_form()
        if form is bytes:
            if not isinstance(commId, bytes):
                raise TypeError(
                    "Argument 'commId' has incorrect type (expected bytes, got "
                    f"{type(commId).__name__})"
                )
            uid = commId
        else:
            if not isinstance(commId, tuple):
                raise TypeError(
                    "Argument 'commId' has incorrect type (expected tuple, got "
                    f"{type(commId).__name__})"
                )
            if any(not isinstance(v, int) or not -128 <= v <= 127 for v in commId):
                raise OverflowError("value too large to convert to char")
            uid = bytes(v & 0xFF for v in commId)
        if len(uid) != _UID_BYTES:
            raise AssertionError("len(commId) == NCCL_UNIQUE_ID_BYTES")
        self.ndev, self.rank, self.uid = int(ndev), int(rank), uid
        self.device = w._current_device()
        self.hang = False  # per-communicator switch, as `CudaStandin.hang`
        self.aborted = self.destroyed = False
        self.destroying = False  # in ncclCommDestroy, waiting for the node's other ranks
        self.inside: dict[int, str] = {}  # thread id -> the NCCL call it is inside
        self.async_error: NcclError | None = None
        self._coll_seq = 0
        w._log(
            rank,
            "NcclCommunicator",
            ndev=ndev,
            rank=rank,
            device=self.device,
            uid=uid,
            id_type=type(commId).__name__,
        )
        if not 0 <= self.rank < self.ndev:
            raise NcclError(INVALID_ARGUMENT, f"rank {rank} is not in 0..{ndev - 1}")
        self.nonblocking = nonblocking
        if not nonblocking:
            self.clique = w._join(self)

    def join(self) -> None:
        """A non-blocking communicator's rendezvous (ncclCommInitRankConfig's work)."""
        self.clique = self._w._join(self)

    # -- queries and lifetime
    @property
    def released(self) -> bool:
        return self.aborted or self.destroyed

    def _live(self, name: str, violation: bool = True) -> None:
        if self.released:
            state = "aborted" if self.aborted else "destroyed"
            if violation:
                self._w._violation(f"rank {self.rank}: {name} on a communicator already {state}")
            raise NcclError(INVALID_ARGUMENT, f"the communicator was {state}")

    def device_id(self) -> int:
        self._live("device_id", violation=False)
        return self.device

    def rank_id(self) -> int:
        self._live("rank_id", violation=False)
        return self.rank

    def size(self) -> int:
        self._live("size", violation=False)
        return self.ndev

    def check_async_error(self) -> None:
        self._live("check_async_error", violation=False)
        if self.async_error is not None:
            raise self.async_error

    def abort(self) -> None:
        w = self._w
        w._log(self.rank, "abort")
        if self.released:
            return  # CuPy: a released communicator's handle is 0, abort does nothing
        me = threading.get_ident()
        with w.nccl_cond:
            others = sorted(name for thread, name in self.inside.items() if thread != me)
        if others and not self.nonblocking:
            # CuPy makes blocking communicators only; NCCL allows ncclCommAbort from
            # another thread only for non-blocking ones (use after free, or a hang)
            w._violation(
                f"rank {self.rank}: ncclCommAbort while another thread is inside {others} "
                "on this blocking communicator"
            )
        self.aborted = True
        with w.lock:  # the work queued behind the hung operations runs later, on the GPU
            for queue in (*w._queues.values(), *w._null.values()):
                if any(item.kind == "hung" and item.comm is self for item in queue.items):
                    queue.lagging = True
        with w.nccl_cond:
            w.nccl_cond.notify_all()  # wake this rank's waits (they fail) and its peers'
        w._pump()
        w._abort_gate(self.rank)  # then, as NCCL's, it waits for the device's other work

    def destroy(self) -> None:
        """ncclCommDestroy: a collective of the node's ranks (all of a clique here). It
        waits until each has called it; after a peer's abort, or with operations that
        never complete, it would block for ever (recorded, then it returns)."""
        w = self._w
        w._log(self.rank, "destroy")
        if self.released:
            return
        if w._hung_items(self):
            w._violation(
                f"rank {self.rank}: ncclCommDestroy with operations that never "
                "complete would block forever (use abort)"
            )
        deadline = time.monotonic() + w.wait_timeout
        with w.nccl_cond:
            self.destroying = True
            w.nccl_cond.notify_all()
            while True:
                peers = [c for c in self.clique.members.values() if c is not self]
                aborted = sorted(c.rank for c in peers if c.aborted)
                if aborted:
                    w._violation(
                        f"rank {self.rank}: ncclCommDestroy after ranks {aborted} aborted "
                        "theirs: destroy is a collective of the node's ranks and would "
                        "block for ever (use ncclCommAbort)"
                    )
                    break
                if all(c.destroying or c.destroyed for c in peers):
                    break
                left = deadline - time.monotonic()
                if left <= 0 or w._interrupted is not None:
                    late = sorted(c.rank for c in peers if not (c.destroying or c.destroyed))
                    w._violation(
                        f"rank {self.rank}: ncclCommDestroy waited {w.wait_timeout} s for "
                        f"ranks {late} to destroy theirs (a collective of the node's ranks)"
                    )
                    break
                w.nccl_cond.wait(min(left, 0.1))
            self.destroyed = True

    # -- collectives
    def allReduce(
        self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int
    ) -> None:
        self._coll("allReduce", stream, count, datatype, op, -1, sendbuf, 1, recvbuf, 1)

    def reduce(
        self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int, stream: int
    ) -> None:
        self._coll(
            "reduce",
            stream,
            count,
            datatype,
            op,
            root,
            sendbuf,
            1,
            recvbuf if self.rank == root else None,
            1,
        )

    def broadcast(
        self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int, stream: int
    ) -> None:
        self._coll(
            "broadcast",
            stream,
            count,
            datatype,
            -1,
            root,
            sendbuff if self.rank == root else None,
            1,
            recvbuff,
            1,
        )

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:
        self._coll("allGather", stream, count, datatype, -1, -1, sendbuf, 1, recvbuf, self.ndev)

    def reduceScatter(
        self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int, stream: int
    ) -> None:
        self._coll(
            "reduceScatter", stream, recvcount, datatype, op, -1, sendbuf, self.ndev, recvbuf, 1
        )

    def _coll(
        self,
        name: str,
        stream: int,
        count: int,
        datatype: int,
        op: int,
        root: int,
        send: int | None,
        send_factor: int,
        recv: int | None,
        recv_factor: int,
    ) -> None:
        w = self._w
        args = dict(count=count, datatype=datatype, stream=stream)
        if op >= 0:
            args["op"] = op
        if root >= 0:
            args["root"] = root
        args.update(sendbuf=send, recvbuf=recv)
        w._log(self.rank, name, **args)
        self._live(name)
        dtype = self._dtype(datatype)
        if op >= 0:
            if op not in NCCL_OPS:
                raise NcclError(INVALID_ARGUMENT, f"op {op} is not an NCCL reduction")
            if op == 4 and w.nccl_version < 21000:
                raise NcclError(INVALID_ARGUMENT, "ncclAvg needs NCCL >= 2.10")
        if name in ("reduce", "broadcast") and not 0 <= root < self.ndev:
            raise NcclError(INVALID_ARGUMENT, f"root {root} is not a rank")
        if count == 0:
            return  # NCCL returns at once for empty collectives
        nbytes = int(count) * dtype.itemsize
        sendspan = recvspan = None
        if send is not None:
            sendspan = (int(send), nbytes * send_factor)
            w._check_memory(*sendspan, self.device, f"{name} sendbuf", nccl=True)
        if recv is not None:
            recvspan = (int(recv), nbytes * recv_factor)
            w._check_memory(*recvspan, self.device, f"{name} recvbuf", nccl=True)
        if sendspan is not None and recvspan is not None and _overlap(sendspan, recvspan):
            self._check_in_place(name, sendspan, recvspan, nbytes)
        desc = (name, int(count), int(datatype), int(op), int(root))
        self._issue(
            _Op(
                self, "coll", name, int(stream), desc, sendspan, recvspan, int(count), int(datatype)
            )
        )

    def _check_in_place(
        self, name: str, send: tuple[int, int], recv: tuple[int, int], nbytes: int
    ) -> None:
        """Overlapping buffers must be one of NCCL's in-place forms; any other overlap
        reads data the operation is overwriting (undefined results on NCCL)."""
        w = self._w
        if name == "allGather":
            form = "sendbuff == recvbuff + rank * count"
            legal = send[0] == recv[0] + self.rank * nbytes
        elif name == "reduceScatter":
            form = "recvbuff == sendbuff + rank * recvcount"
            legal = recv[0] == send[0] + self.rank * nbytes
        else:
            form = "sendbuff == recvbuff"
            legal = send[0] == recv[0]
        if legal:
            return
        text = (
            f"rank {self.rank}: {name} with sendbuf {_span_text(send)} overlapping recvbuf "
            f"{_span_text(recv)} is not NCCL's in-place form ({form}): the result is "
            "undefined (copy the input to a separate buffer first)"
        )
        w._violation(text)
        raise NcclError(INVALID_USAGE, f"stand-in: {text}")

    # -- point to point
    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._p2p("send", sendbuf, count, datatype, peer, stream)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._p2p("recv", recvbuf, count, datatype, peer, stream)

    def _p2p(self, name: str, buf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        w = self._w
        w._log(self.rank, name, buf=buf, count=count, datatype=datatype, peer=peer, stream=stream)
        self._live(name)
        dtype = self._dtype(datatype)
        if not 0 <= peer < self.ndev:
            raise NcclError(INVALID_ARGUMENT, f"peer {peer} is not a rank")
        span = (int(buf), int(count) * dtype.itemsize)
        w._check_memory(*span, self.device, f"{name} buffer", nccl=True)
        self._issue(
            _Op(
                self,
                name,
                name,
                int(stream),
                send=span if name == "send" else None,
                recv=span if name == "recv" else None,
                count=int(count),
                datatype=int(datatype),
                peer=int(peer),
            )
        )

    def _dtype(self, datatype: int) -> np.dtype:
        if datatype not in NCCL_DTYPES:
            raise NcclError(INVALID_ARGUMENT, f"datatype {datatype} is not an NCCL type")
        return NCCL_DTYPES[datatype]

    def _issue(self, op: _Op) -> None:
        w = self._w
        op.queue = w._queue_for_nccl(self, op.stream)
        state = w._tls_state()
        if state.group_depth:
            state.group_ops.append(op)
            return
        w._launch([op], lone=True)


def _tracked(method: Callable[..., None]) -> Callable[..., None]:
    """Mark the calling thread inside an NCCL call on the communicator while it runs."""

    def call(self: Any, *args: Any, **kwargs: Any) -> None:
        me = threading.get_ident()
        with self._w.nccl_cond:
            self.inside[me] = method.__name__
        try:
            method(self, *args, **kwargs)
        finally:
            with self._w.nccl_cond:
                self.inside.pop(me, None)

    call.__name__ = method.__name__
    call.__doc__ = method.__doc__
    return call


for _name in ("allReduce", "reduce", "broadcast", "allGather", "reduceScatter", "send", "recv"):
    setattr(_NcclCommunicator, _name, _tracked(getattr(_NcclCommunicator, _name)))


# -- the stand-in ----------------------------------------------------------------------------


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.device = 0
        self.device_stack: list[int] = []
        self.streams: dict[int, list[Any]] = {}
        self.stream_devices: list[int] = []
        self.group_depth = 0
        self.group_ops: list[_Op] = []
        self.chosen: set[int] = set()  # devices this thread made current itself
        self.touched: list[int] = []  # devices whose context this thread bound, in order


class CudaStandin:
    """A fake CUDA machine with `device_count` GPUs, its CuPy modules and its NCCL.

    Args:
        device_count: how many GPUs `getDeviceCount()` reports.
        cupy_version: `cupy.__version__` (settable later: `standin.cupy.__version__`).
        nccl_version: what `nccl.get_version()` returns (settable: `nccl_version`).
        wait_timeout: the longest any blocking wait of the stand-in lasts, in seconds.
    """

    def __init__(
        self,
        device_count: int = 4,
        cupy_version: str = "14.2.0",
        nccl_version: int = 23203,
        wait_timeout: float = 30.0,
    ) -> None:
        self.device_count = device_count
        self.nccl_version = nccl_version
        #: what `nccl.get_build_version()` returns (None: the runtime's version)
        self.nccl_build_version: int | None = None
        self.wait_timeout = wait_timeout
        #: None: the id form follows cupy.__version__; else bytes or tuple
        self.comm_id_form: type | None = None
        self.lock = threading.RLock()  # streams, events, allocations
        self.cond = threading.Condition(self.lock)
        self.nccl_cond = threading.Condition()  # cliques, rendezvous, mailboxes
        self.violations: list[str] = []
        self.unique_ids: list[bytes] = []
        self._calls: list[Call] = []
        self._ptrs = itertools.count(0x7F00_0000_1000, 0x100)
        self._ids = itertools.count(1)
        self._tls = _ThreadState()
        self._queues: dict[int, _Queue] = {}
        self._null: dict[int, _Queue] = {}
        self._allocs: dict[int, tuple[int, weakref.ref, int]] = {}
        self._cliques: dict[bytes, _Clique] = {}
        self._hang: set[int] | None = set()  # None: every rank
        self._aborts_held = threading.Event()  # set: aborts return at once
        self._aborts_held.set()
        self.aborts_in_progress = 0  # aborts called that have not returned (hold_aborts)
        self._init_failures: dict[int, NcclError] = {}
        self._interrupted: str | None = None
        #: NCCL launches in issue order: device -> the numbers of those not completed
        self._launches = itertools.count()
        self._unfinished: dict[int, set[int]] = {}
        self._faults: dict[int, int] = {}  # device -> its sticky CUDA error
        self._inits_ended = False
        #: ncclCommInitRank calls hanging now because a peer failed, and those that were
        #: still hanging after `wait_timeout` (each a caller real NCCL would never release)
        self.hung_inits = 0
        self.init_hangs_timed_out = 0
        self._events: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        # processes and CUDA IPC (see "Processes, IPC and fork" above)
        self._proc = threading.local()  # .name: the stand-in process of the calling thread
        self._owners: dict[int, str] = {}  # allocation start -> the process that made it
        #: handle -> (exporting process, allocation start, end, its weakref, device)
        self._ipc_handles: dict[bytes, tuple[str, int, int, weakref.ref, int]] = {}
        #: process -> start of a mapping it opened -> (end, device, handle)
        self._mappings: dict[str, dict[int, tuple[int, int, bytes]]] = {}
        #: this (real) process has initialised the CUDA driver
        self.cuda_initialized = False
        #: this process was forked after that: every CUDA call fails
        self.forked_after_init = False
        _LIVE.add(self)
        self._build_modules(cupy_version)

    # -- modules ----------------------------------------------------------------------------

    def _build_modules(self, cupy_version: str) -> None:
        w = self
        self.ndarray = type("ndarray", (_NdArray,), {"__module__": "cupy", "_w": w})
        self.Device = type("Device", (_Device,), {"__module__": "cupy.cuda.device", "_w": w})
        self.Stream = type("Stream", (_Stream,), {"__module__": "cupy.cuda.stream", "_w": w})
        self.Stream.null = self.Stream(null=True)
        self.Event = type("Event", (_Event,), {"__module__": "cupy.cuda.stream", "_w": w})
        self.NcclCommunicator = type(
            "NcclCommunicator", (_NcclCommunicator,), {"__module__": "cupy.cuda.nccl", "_w": w}
        )

        cupy = types.ModuleType("cupy")
        cupy.__version__ = cupy_version
        cupy.ndarray = self.ndarray
        for name in (
            "bool_",
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
        ):
            setattr(cupy, name, getattr(np, name))
        cupy.empty = self._empty
        cupy.zeros = self._zeros
        cupy.ones = lambda shape, dtype=float: self._full(shape, 1, dtype)
        cupy.full = self._full
        cupy.arange = self._arange
        cupy.asarray = self._asarray
        cupy.array = self._asarray
        cupy.asnumpy = lambda a, stream=None: a.get(stream)
        cupy.concatenate = self._concatenate
        cupy.bitwise_and = self._bitwise_and

        runtime = types.ModuleType("cupy.cuda.runtime")
        runtime.CUDARuntimeError = CUDARuntimeError
        runtime.getDeviceCount = self._get_device_count
        runtime.getDevice = self._current_device
        runtime.setDevice = lambda i: self.Device(i).use()
        runtime.eventQuery = self._event_query
        runtime.deviceGetPCIBusId = self._bus_id
        runtime.deviceGetByPCIBusId = self._device_by_bus_id
        runtime.cudaIpcMemLazyEnablePeerAccess = 1
        runtime.ipcGetMemHandle = self._ipc_get_mem_handle
        runtime.ipcOpenMemHandle = self._ipc_open_mem_handle
        runtime.ipcCloseMemHandle = self._ipc_close_mem_handle
        driver = types.ModuleType("cupy.cuda.driver")
        driver.CUDADriverError = CUDADriverError
        driver.ctxGetCurrent = self._ctx_get_current
        #: libcuda's cuMemGetAddressRange_v2 as ctypes calls it (CuPy has no binding)
        self.libcuda = types.SimpleNamespace(cuMemGetAddressRange_v2=self._mem_get_address_range)

        nccl = types.ModuleType("cupy.cuda.nccl")
        nccl.available = True
        nccl.NcclError = NcclError
        nccl.NcclCommunicator = self.NcclCommunicator
        nccl.get_version = lambda: self.nccl_version
        nccl.get_build_version = lambda: (
            self.nccl_version if self.nccl_build_version is None else self.nccl_build_version
        )
        nccl.get_unique_id = self._get_unique_id
        nccl.groupStart = self._group_start
        nccl.groupEnd = self._group_end
        for code, dtype in NCCL_DTYPES.items():
            setattr(nccl, f"NCCL_{dtype.name.upper()}", code)
        for code, name in NCCL_OPS.items():
            setattr(nccl, f"NCCL_{name}", code)

        cuda = types.ModuleType("cupy.cuda")
        cuda.runtime = runtime
        cuda.nccl = nccl
        cuda.Device = self.Device
        cuda.Stream = self.Stream
        cuda.Event = self.Event
        cuda.MemoryPointer = type(
            "MemoryPointer", (_PointerInto,), {"__module__": "cupy.cuda.memory", "_w": w}
        )
        cuda.UnownedMemory = _UnownedMemory
        cuda.driver = driver
        cuda.get_current_stream = self._get_current_stream
        cuda.alloc_pinned_memory = lambda nbytes: bytearray(int(nbytes))  # page-locked here
        cuda.get_device_id = self._current_device
        cupy.cuda = cuda

        self.cupy, self.cuda, self.runtime, self.nccl = cupy, cuda, runtime, nccl
        self.driver = driver

    def modules(self) -> dict[str, types.ModuleType]:
        """The modules by import name, for sys.modules."""
        return {
            "cupy": self.cupy,
            "cupy.cuda": self.cuda,
            "cupy.cuda.runtime": self.runtime,
            "cupy.cuda.nccl": self.nccl,
            "cupy.cuda.driver": self.driver,
        }

    def install(self, monkeypatch: Any) -> CudaStandin:
        """Put the modules in sys.modules for the test (monkeypatch restores them)."""
        for name, module in self.modules().items():
            monkeypatch.setitem(sys.modules, name, module)
        return self

    # -- test switches and inspection --------------------------------------------------------

    def hang(self, ranks: Iterable[int] | None = None) -> None:
        """From now on, NCCL operations of `ranks` (None: every rank) never complete."""
        self._hang = None if ranks is None else set(ranks)

    def unhang(self) -> None:
        """New operations complete again (operations already hung stay hung)."""
        self._hang = set()

    def inject_async_error(self, rank: int | None = None, status: int = REMOTE_ERROR) -> None:
        """Make `check_async_error()` of the communicators of `rank` (None: all) raise."""
        for comm in self.communicators(rank):
            comm.async_error = NcclError(status, "injected by the test")

    def fail_init(self, rank: int, status: int = SYSTEM_ERROR) -> None:
        """Make the next `NcclCommunicator` of `rank` fail (after the ranks rendezvous)."""
        self._init_failures[rank] = NcclError(status, "injected by the test")

    def hold_aborts(self) -> None:
        """From now on `abort()` does not return until `release_aborts()`: NCCL's abort
        frees device memory, which waits for the kernels queued on the GPU (other
        streams' too) to end. Hung operations still end at once."""
        self._aborts_held.clear()

    def release_aborts(self) -> None:
        """Let held aborts return."""
        self._aborts_held.set()

    def _abort_gate(self, rank: int) -> None:
        with self.lock:
            self.aborts_in_progress += 1
        try:
            if not self._aborts_held.wait(self.wait_timeout):
                self._violation(f"rank {rank}: abort held for {self.wait_timeout} s")
        finally:
            with self.lock:
                self.aborts_in_progress -= 1

    def pause(self, stream: Any) -> None:
        """Hold `stream`'s queue: work submitted to it waits until `resume`."""
        queue = self._queue_of(stream)
        with self.lock:
            queue.paused = True

    def resume(self, stream: Any) -> None:
        """Release a paused stream and run what it holds (in this thread)."""
        queue = self._queue_of(stream)
        with self.lock:
            queue.paused = False
        self._pump()

    def interrupt(self, reason: str | None) -> None:
        """Make every blocking wait of the stand-in (rendezvous, receives, stream
        synchronisation) raise StandinError(`reason`) at once, so that the other ranks of
        a test whose rank failed stop instead of waiting `wait_timeout`; None resets."""
        self._interrupted = reason
        with self.nccl_cond:
            self.nccl_cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def _check_interrupt(self) -> None:
        if self._interrupted is not None:
            raise StandinError(f"interrupted: {self._interrupted}")

    def communicators(self, rank: int | None = None) -> list[Any]:
        """Every communicator created so far (of `rank`), in creation order."""
        with self.nccl_cond:
            comms = [c for clique in self._cliques.values() for c in clique.members.values()]
        return [c for c in comms if rank is None or c.rank == rank]

    def calls(
        self,
        name: str | Iterable[str] | None = None,
        *,
        thread: str | None = None,
        rank: int | None = None,
    ) -> list[Call]:
        """The logged calls, optionally only those named `name`, made by `thread` or by
        the communicator of `rank`."""
        names = {name} if isinstance(name, str) else None if name is None else set(name)
        return [
            c
            for c in list(self._calls)
            if (names is None or c.name in names)
            and (thread is None or c.thread == thread)
            and (rank is None or c.rank == rank)
        ]

    def clear_calls(self) -> None:
        self._calls.clear()

    # -- logging and misuse ------------------------------------------------------------------

    def _log(self, _rank: int | None, _name: str, **args: Any) -> None:
        self._calls.append(Call(threading.current_thread().name, _rank, _name, args))

    def _violation(self, text: str) -> None:
        self.violations.append(text)

    # -- devices, streams, memory --------------------------------------------------------

    def _get_device_count(self) -> int:
        self._init_cuda()
        return self.device_count

    def _bus_id(self, device: int) -> str:
        self._init_cuda()
        if not 0 <= device < self.device_count:
            raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
        return f"0000:{device:02x}:00.0"

    def _tls_state(self) -> _ThreadState:
        self._init_cuda()
        return self._tls

    def _current_device(self) -> int:
        self._init_cuda()
        return self._tls.device

    def _set_device(self, device: int, chosen: bool) -> None:
        """cudaSetDevice: make `device` current and bind its context in this thread (CUDA
        12 creates the primary context here); `chosen`: the thread asked for it, rather
        than CuPy switching back to a device the thread never chose."""
        state = self._tls
        state.device = device
        if chosen:
            state.chosen.add(device)
        self._touch()

    def _touch(self) -> None:
        """A call that needs a CUDA context: it binds the current device's context in this
        thread. A thread that uses one GPU and binds the context of another it never chose
        (a new thread's current device is 0) makes an extra context there: a violation."""
        self._init_cuda()
        state = self._tls
        device = state.device
        if device in state.touched:
            return
        if state.touched and device not in state.chosen:
            self._violation(
                f"{threading.current_thread().name}: a CUDA context on GPU {device}, "
                f"which this thread never chose, after it used GPU {state.touched[0]} "
                "(an extra context: cudaSetDevice back to a new thread's default device?)"
            )
        state.touched.append(device)

    def _thread_context(self) -> int:
        """cuCtxGetCurrent: a handle of the context bound in this thread, 0 for none."""
        state = self._tls
        return 0x6C000 + state.device if state.device in state.touched else 0

    # -- sticky CUDA errors ------------------------------------------------------------------

    def fault(self, device: int, status: int = 700) -> None:
        """A sticky CUDA error on `device` (700: cudaErrorIllegalAddress, what a kernel
        reading a bad address leaves): its streams stop, `cudaEventQuery` of its events
        returns `status` (so CuPy's `Event.done`, which is `eventQuery(...) == 0`, stays
        False and never raises), and synchronising, launching or allocating there raises
        CUDARuntimeError. NCCL's async error does not report it (NCCL did not fail)."""
        with self.cond:
            self._faults[device] = status
            self.cond.notify_all()

    def _fault_text(self, status: int) -> str:
        name, text = _CUDA_ERRORS.get(status, (f"cudaError{status}", "unknown error"))
        return f"{name}: {text}"

    def _raise_fault(self, device: int) -> None:
        status = self._faults.get(device)
        if status is not None:
            raise CUDARuntimeError(self._fault_text(status))

    def _event_query(self, ptr: int) -> int:
        """runtime.eventQuery: 0 (done), 600 (cudaErrorNotReady) or the device's sticky
        error; CuPy returns the status, it does not raise."""
        event = self._events.get(ptr)
        if event is None:
            return 400  # cudaErrorInvalidResourceHandle
        self._touch()
        status = self._faults.get(event.device_id)
        if status is not None:
            return status
        self._catch_up(event._queue)
        return 0 if event._is_done() else 600

    def _get_current_stream(self, device_id: int = -1) -> Any:
        device = self._current_device() if device_id == -1 else device_id
        stack = self._tls.streams.get(device)
        return stack[-1] if stack else self.Stream.null

    def _current_stream(self) -> Any:
        return self._get_current_stream()

    def _null_queue(self, device: int) -> _Queue:
        with self.lock:
            queue = self._null.get(device)
            if queue is None:
                queue = self._null[device] = _Queue(0, device, f"null stream of GPU {device}")
            return queue

    def _queue_of(self, stream: Any) -> _Queue:
        """The queue of a Stream object (the null stream: the current device's)."""
        self._init_cuda()
        if stream.ptr == 0:
            return self._null_queue(self._current_device())
        return self._queues[stream.ptr]

    def _queue_for_nccl(self, comm: Any, ptr: int) -> _Queue:
        if ptr == 0:
            return self._null_queue(comm.device)
        queue = self._queues.get(ptr)
        if queue is None:
            self._violation(f"rank {comm.rank}: NCCL operation on unknown stream {ptr:#x}")
            raise NcclError(UNHANDLED_CUDA_ERROR, f"invalid stream {ptr:#x}")
        if queue.device != comm.device:
            self._violation(
                f"rank {comm.rank}: NCCL operation of the communicator on GPU "
                f"{comm.device} issued on {queue.label} of GPU {queue.device}"
            )
            raise NcclError(UNHANDLED_CUDA_ERROR, "stream of another device")
        return queue

    def _queues_of_device(self, device: int) -> list[_Queue]:
        with self.lock:
            return [q for q in (*self._queues.values(), *self._null.values()) if q.device == device]

    def _alloc(self, shape: Any, dtype: Any, device: int | None = None) -> _NdArray:
        host = np.empty(shape, dtype)
        if host.nbytes:
            host.reshape(-1).view(np.uint8)[...] = _FILL
        device = self._current_device() if device is None else device
        if not 0 <= device < self.device_count:
            raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
        self._touch()
        self._raise_fault(device)
        array = self.ndarray(host, device)
        with self.lock:
            if len(self._allocs) > 512:
                self._allocs = {k: v for k, v in self._allocs.items() if v[1]() is not None}
            if host.nbytes:
                # the allocation lives as long as its array (views keep that alive): once
                # the array is collected CuPy's pool may hand the memory out again
                start = int(host.ctypes.data)
                self._allocs[start] = (start + host.nbytes, weakref.ref(array), device)
                self._owners[start] = self._process()
        return array

    def _check_memory(
        self, ptr: int, nbytes: int, device: int | None, what: str, nccl: bool = False
    ) -> None:
        """`[ptr, ptr + nbytes)` must lie in one live allocation (of `device`)."""
        if nbytes <= 0:
            return
        with self.lock:
            for start, (end, ref, dev) in self._allocs.items():
                if start <= ptr and ptr + nbytes <= end and ref() is not None:
                    if device is None or dev == device:
                        return
                    problem = f"is memory of GPU {dev}, not GPU {device}"
                    break
            else:
                problem = "is not inside any live allocation"
        text = f"{what} [{ptr:#x}, +{nbytes}) {problem}"
        self._violation(text)
        if nccl:
            raise NcclError(INVALID_ARGUMENT, text)
        raise StandinError(f"illegal memory access: {text}")

    @staticmethod
    def _bytes_at(ptr: int, nbytes: int) -> np.ndarray:
        if nbytes <= 0:
            return np.empty(0, np.uint8)
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

    def _submit(self, queue: _Queue, fn: Callable[[], Any], spans: tuple = ()) -> None:
        """Run `fn` on `queue`: now if it is idle, else when the work before it is done
        (`spans`: the memory it touches, which must still be allocated then)."""
        self._init_cuda()
        self._raise_fault(queue.device)
        with self.lock:
            queue.submitted += 1
            if queue.blocked():
                queue.items.append(_Item("fn", fn=fn, spans=spans))
                return
            fn()
            queue.completed += 1

    def _freed(self, spans: tuple) -> list[tuple[int, int]]:
        """The spans that no longer lie inside a live allocation."""
        with self.lock:
            live = [(start, end) for start, (end, ref, _) in self._allocs.items() if ref()]
        return [(ptr, n) for ptr, n in spans if not any(a <= ptr and ptr + n <= b for a, b in live)]

    def _kernel(self, arrays: list[_NdArray], fn: Callable[[], Any]) -> None:
        current = self._current_device()
        for array in arrays:
            if array._device_id != current:
                self._violation(
                    f"kernel on an array of GPU {array._device_id} while GPU {current} is current"
                )
                raise ValueError(
                    f"Array device must be same as the current device: array "
                    f"device = {array._device_id} while current = {current}"
                )
        self._touch()
        spans = tuple((int(a._host.ctypes.data), a.nbytes) for a in arrays if a.nbytes)
        self._submit(self._queue_of(self._current_stream()), fn, spans)

    def _wait_until(self, ready: Callable[[], bool], what: str, device: int = -1) -> None:
        deadline = time.monotonic() + self.wait_timeout
        with self.cond:
            while not ready():
                self._check_interrupt()
                self._raise_fault(device)  # a sticky error ends every wait on the device
                left = deadline - time.monotonic()
                if left <= 0:
                    self._violation(f"{what} did not finish within {self.wait_timeout} s")
                    raise StandinError(
                        f"{what} did not finish within {self.wait_timeout} s "
                        "(a hung or paused stream?)"
                    )
                self.cond.wait(min(left, 0.05))

    def _drain(self, queue: _Queue, what: str) -> None:
        self._touch()
        self._raise_fault(queue.device)
        self._catch_up(queue)
        self._wait_until(lambda: not queue.blocked(), what, queue.device)

    def _catch_up(self, queue: _Queue | None) -> None:
        """Something waits for `queue`: the work an abort left queued on it runs now."""
        if queue is not None and queue.lagging:
            queue.lagging = False
            self._pump()

    def settle(self) -> None:
        """Let the GPUs finish: run the work aborts left queued (on their streams, in
        order), as a real device does on its own shortly after."""
        with self.lock:
            queues = [q for q in (*self._queues.values(), *self._null.values()) if q.lagging]
        for queue in queues:
            self._catch_up(queue)

    def _hung_items(self, comm: Any) -> int:
        with self.lock:
            return sum(
                1
                for q in (*self._queues.values(), *self._null.values())
                for item in q.items
                if item.comm is comm and (item.kind == "hung" or item.kind == "p2p")
            )

    def _pump(self) -> None:
        """Run queued work whose blockers have cleared, until nothing more can run."""
        while True:
            picked: tuple[_Queue, _Item] | None = None
            changed = False
            with self.cond:
                for queue in (*self._queues.values(), *self._null.values()):
                    if queue.lagging or queue.device in self._faults:
                        continue
                    while queue.items and not queue.paused and not queue.running:
                        item = queue.items[0]
                        if item.kind == "wait" and not item.event._is_done():
                            break
                        if item.kind == "hung" and not item.comm.released:
                            break
                        if item.kind == "comm":
                            if not self._turn(item.seq, item.device):
                                break
                            queue.running = True
                            picked = (queue, item)
                            break
                        if item.kind == "p2p" and not self._p2p_done(item):
                            break
                        queue.items.popleft()
                        self._finish_launch(item.seq, item.device)
                        freed = self._freed(item.spans) if item.kind == "fn" else []
                        if freed:
                            self._violation(
                                f"a kernel queued on {queue.label} ran on memory that was "
                                f"freed meanwhile {[(hex(p), n) for p, n in freed]}: its "
                                "array was collected while the GPU could still touch it "
                                "(CuPy's pool may have handed the memory out again)"
                            )
                        if item.kind == "fn":
                            try:
                                item.fn()
                            except Exception as exc:
                                self._violation(f"queued work on {queue.label} failed: {exc!r}")
                        queue.completed += 1
                        changed = True
                    if picked:
                        break
                self.cond.notify_all()
            if picked is None:
                if not changed:
                    return
                continue
            # the GPU runs it, not the thread that unblocked it: an NCCL operation waits
            # for its peers, and that thread may be the one a peer waits for
            threading.Thread(
                target=self._run_deferred, args=picked, daemon=True, name="standin-gpu"
            ).start()

    def _run_deferred(self, queue: _Queue, item: _Item) -> None:
        """Run a "comm" item (a group of NCCL operations whose stream was blocked when it
        was issued), then what its stream holds behind it."""
        try:
            item.fn()
        except Exception as exc:  # an asynchronous NCCL failure
            self._violation(f"deferred NCCL work on {queue.label} failed: {exc!r}")
            for comm in item.comms:
                comm.async_error = NcclError(INTERNAL_ERROR, f"deferred operation: {exc}")
        with self.cond:
            queue.items.popleft()
            queue.running = False
            queue.completed += 1
            self._finish_launch(item.seq, item.device)
            self.cond.notify_all()
        self._pump()

    # -- processes, CUDA initialisation, IPC and the driver ----------------------------------

    @contextlib.contextmanager
    def as_process(self, name: str) -> Iterator[None]:
        """Within the block, the calling thread acts as stand-in process `name` (the
        default is "main"): it owns what it allocates, and its IPC handles and mappings
        are its own."""
        previous = getattr(self._proc, "name", "main")
        self._proc.name = name
        try:
            yield
        finally:
            self._proc.name = previous

    def _process(self) -> str:
        return getattr(self._proc, "name", "main")

    def _init_cuda(self) -> None:
        """A call that initialises the CUDA driver (cuInit), which fails in a process
        forked after its parent had initialised it."""
        if self.forked_after_init:
            raise CUDARuntimeError(_INIT_ERROR)
        self.cuda_initialized = True

    def _ctx_get_current(self) -> int:
        """cuCtxGetCurrent: CUDA_ERROR_NOT_INITIALIZED before cuInit (it never initialises);
        else the context bound in the calling thread (its current device's, once a call
        bound it), 0 for none."""
        if self.forked_after_init or not self.cuda_initialized:
            raise CUDADriverError(CUDA_ERROR_NOT_INITIALIZED)
        return self._thread_context()

    def _device_by_bus_id(self, bus_id: str) -> int:
        self._init_cuda()
        parts = str(bus_id).split(":")
        try:
            device = int(parts[1], 16)
        except (IndexError, ValueError):
            device = -1
        if len(parts) != 3 or not 0 <= device < self.device_count:
            raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
        return device

    def _allocation_at(self, ptr: int) -> tuple[int, int, weakref.ref, int] | None:
        """(start, end, weakref, device) of the live allocation holding `ptr`."""
        with self.lock:
            for start, (end, ref, device) in self._allocs.items():
                if start <= ptr < end and ref() is not None:
                    return start, end, ref, device
        return None

    def _mapping_at(self, process: str, ptr: int) -> tuple[int, int, int, bytes] | None:
        """(start, end, device, handle) of an IPC mapping `process` opened holding `ptr`."""
        with self.lock:
            for start, (end, device, handle) in self._mappings.get(process, {}).items():
                if start <= ptr < end:
                    return start, end, device, handle
        return None

    def _mem_get_address_range(self, pbase: Any, psize: Any, ptr: int) -> int:
        """cuMemGetAddressRange_v2 as ctypes calls it (`pbase`, `psize`: byref results):
        the allocation of this process, or the IPC mapping it opened, holding `ptr`."""
        if self.forked_after_init or not self.cuda_initialized:
            return CUDA_ERROR_NOT_INITIALIZED
        ptr, process = int(ptr), self._process()
        self._log(None, "cuMemGetAddressRange", ptr=ptr, process=process)
        mapped = self._mapping_at(process, ptr)
        if mapped is not None:
            start, end = mapped[0], mapped[1]
        else:
            found = self._allocation_at(ptr)
            if found is None or self._owners.get(found[0]) != process:
                return CUDA_ERROR_NOT_FOUND  # not a pointer of this process
            start, end = found[0], found[1]
        pbase._obj.value, psize._obj.value = start, end - start
        return 0

    def _ipc_get_mem_handle(self, ptr: int) -> bytes:
        """cudaIpcGetMemHandle: a handle of the whole allocation holding `ptr`, which must
        be this process's own (memory it mapped from another process's handle is refused
        with cudaErrorInvalidValue, as CUDA does)."""
        self._init_cuda()
        ptr, process = int(ptr), self._process()
        self._log(None, "ipcGetMemHandle", ptr=ptr, process=process)
        found = self._allocation_at(ptr)
        if (
            self._mapping_at(process, ptr) is not None
            or found is None
            or self._owners.get(found[0]) != process
        ):
            raise CUDARuntimeError("cudaErrorInvalidValue: invalid argument")
        start, end, ref, device = found
        with self.lock:
            for handle, entry in self._ipc_handles.items():
                if entry[3] is ref:  # the same allocation: the same handle
                    return handle
            handle = hashlib.blake2b(
                f"{process}:{start:#x}:{next(self._ids)}".encode(), digest_size=64
            ).digest()
            self._ipc_handles[handle] = (process, start, end, ref, device)
        return handle

    def _ipc_open_mem_handle(self, handle: bytes, flags: int = 1) -> int:
        """cudaIpcOpenMemHandle in the calling thread's process: the mapping's address
        (here the exporter's own address: one address space stands for all processes)."""
        self._init_cuda()
        if not isinstance(handle, bytes):
            raise TypeError(
                f"Argument 'handle' has incorrect type (expected bytes, got "
                f"{type(handle).__name__})"
            )
        process = self._process()
        self._log(None, "ipcOpenMemHandle", handle=handle, process=process)
        entry = self._ipc_handles.get(handle)
        if entry is None:
            raise CUDARuntimeError("cudaErrorInvalidValue: invalid argument")
        owner, start, end, ref, device = entry
        if owner == process:
            raise CUDARuntimeError("cudaErrorDeviceUninitialized: invalid device context")
        found = self._allocation_at(start)
        if ref() is None or found is None or found[2] is not ref:  # freed by its exporter
            raise CUDARuntimeError("cudaErrorInvalidValue: invalid argument")
        current = self._tls.device
        if current != device:
            self._violation(
                f"ipcOpenMemHandle: memory of GPU {device} opened with GPU {current} "
                "current (peer mappings are not modelled)"
            )
        with self.lock:
            mappings = self._mappings.setdefault(process, {})
            if start in mappings:  # modelled strictly: one open per handle and process
                raise CUDARuntimeError("cudaErrorInvalidValue: invalid argument")
            mappings[start] = (end, device, handle)
        return start

    def _ipc_close_mem_handle(self, ptr: int) -> None:
        self._init_cuda()
        ptr, process = int(ptr), self._process()
        self._log(None, "ipcCloseMemHandle", ptr=ptr, process=process)
        with self.lock:
            if self._mappings.get(process, {}).pop(ptr, None) is None:
                raise CUDARuntimeError("cudaErrorInvalidValue: invalid argument")

    def _over_memory(self, shape: Any, dtype: Any, memptr: Any, strides: Any) -> tuple:
        """(host array, device) of `cupy.ndarray(shape, dtype, memptr, strides)`."""
        if memptr is None:
            array = self._alloc(self._shape(shape), dtype)
            return array._host, array._device_id
        shape, dtype = self._shape(shape), np.dtype(dtype)
        if strides is None:
            strides = np.empty(shape, dtype).strides if shape else ()
        extents = [(n - 1) * s for n, s in zip(shape, strides, strict=True)]
        low = sum(min(0, e) for e in extents)
        high = sum(max(0, e) for e in extents) + dtype.itemsize
        size = 0 if 0 in shape else high - low
        self._check_memory(memptr.ptr + low, size, memptr.device_id, "ndarray(memptr=...)")
        buffer = (ctypes.c_uint8 * max(size, 1)).from_address(memptr.ptr + low)
        buffer.memptr = memptr  # the numpy array keeps the memory's owner alive
        host = np.ndarray(shape, dtype, buffer=buffer, offset=-low, strides=strides)
        return host, memptr.device_id

    # -- cupy functions ---------------------------------------------------------------------

    @staticmethod
    def _shape(shape: Any) -> tuple[int, ...]:
        return (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)

    def _empty(self, shape: Any, dtype: Any = float, order: str = "C") -> _NdArray:
        return self._alloc(self._shape(shape), dtype)

    def _zeros(self, shape: Any, dtype: Any = float, order: str = "C") -> _NdArray:
        out = self._alloc(self._shape(shape), dtype)
        target = out._host
        self._kernel([out], lambda: target.__setitem__(..., 0))
        return out

    def _full(self, shape: Any, fill_value: Any, dtype: Any = None) -> _NdArray:
        if dtype is None:
            dtype = np.array(fill_value).dtype
        out = self._alloc(self._shape(shape), dtype)
        target = out._host
        self._kernel([out], lambda: target.__setitem__(..., fill_value))
        return out

    def _arange(self, *args: Any, dtype: Any = None) -> _NdArray:
        return self._asarray(np.arange(*args, dtype=dtype))

    def _asarray(self, a: Any, dtype: Any = None) -> _NdArray:
        if isinstance(a, _NdArray):
            return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
        host = np.array(a, dtype=dtype, copy=True)
        out = self._alloc(host.shape, host.dtype)
        target = out._host
        self._kernel([out], lambda: target.__setitem__(..., host))
        return out

    def _concatenate(self, arrays: Any, axis: int = 0) -> _NdArray:
        arrays = list(arrays)
        if not arrays:
            raise ValueError("need at least one array to concatenate")
        shapes = [a.shape for a in arrays]
        rows = sum(s[axis] for s in shapes)
        shape = list(shapes[0])
        shape[axis] = rows
        out = self._alloc(tuple(shape), np.result_type(*[a.dtype for a in arrays]))
        sources, target = [a._host for a in arrays], out._host
        self._kernel([*arrays, out], lambda: np.concatenate(sources, axis=axis, out=target))
        return out

    def _bitwise_and(self, a: _NdArray, b: Any, out: _NdArray | None = None) -> _NdArray:
        if out is None:
            out = self._alloc(a.shape, a.dtype)
        operand = b._host if isinstance(b, _NdArray) else b
        arrays = [a, out] + ([b] if isinstance(b, _NdArray) else [])
        source, target = a._host, out._host
        self._kernel(arrays, lambda: np.bitwise_and(source, operand, out=target))
        return out

    # -- nccl module functions -----------------------------------------------------------

    def _comm_id_form(self) -> type:
        if self.comm_id_form is not None:
            return self.comm_id_form
        return self._cupy_id_form()

    def _cupy_id_form(self) -> type:
        try:
            major = int(str(self.cupy.__version__).split(".", 1)[0])
        except ValueError:
            major = 14
        return bytes if major >= 14 else tuple

    def _get_unique_id(self) -> Any:
        n = next(self._ids)
        data = (
            hashlib.sha512(f"uid-{id(self)}-{n}-a".encode()).digest()
            + hashlib.sha512(f"uid-{id(self)}-{n}-b".encode()).digest()
        )
        self.unique_ids.append(data)
        self._log(None, "get_unique_id", uid=data)
        if self._cupy_id_form() is bytes:
            return data
        return tuple(b - 256 if b > 127 else b for b in data)

    def _group_start(self) -> None:
        self._log(None, "groupStart")
        self._tls.group_depth += 1

    def _group_end(self) -> None:
        self._log(None, "groupEnd")
        state = self._tls
        if state.group_depth == 0:
            self._violation("groupEnd without groupStart")
            raise NcclError(INVALID_USAGE, "groupEnd without groupStart")
        state.group_depth -= 1
        if state.group_depth:
            return
        ops, state.group_ops = state.group_ops, []
        comms = list({id(op.comm): op.comm for op in ops}.values())
        me = threading.get_ident()
        with self.nccl_cond:  # ncclGroupEnd is inside an NCCL call on each of them
            for comm in comms:
                comm.inside[me] = "groupEnd"
        try:
            self._launch(ops)
        finally:
            with self.nccl_cond:
                for comm in comms:
                    comm.inside.pop(me, None)

    # -- NCCL execution --------------------------------------------------------------------

    def _hung(self, comm: Any) -> bool:
        return comm.hang or self._hang is None or comm.rank in self._hang

    def _join(self, comm: Any) -> _Clique:
        """ncclCommInitRank: wait until every rank joined; then fail the ranks that share a
        GPU (NCCL's check, which fails only those up to NCCL 2.29) and a rank whose failure
        the test injected. As in real NCCL, the other ranks of a clique where some rank
        failed hang: until `end_hung_inits()` (the process exiting) or `wait_timeout`
        (counted in `init_hangs_timed_out`), then NcclError."""
        deadline = time.monotonic() + self.wait_timeout
        with self.nccl_cond:
            clique = self._cliques.get(comm.uid)
            if clique is None:
                clique = self._cliques[comm.uid] = _Clique(comm.uid, comm.ndev)
            if clique.ndev != comm.ndev:
                raise NcclError(
                    INVALID_USAGE,
                    f"rank {comm.rank} says {comm.ndev} ranks, the others {clique.ndev}",
                )
            if comm.rank in clique.members:
                raise NcclError(INVALID_USAGE, f"rank {comm.rank} joined twice")
            clique.members[comm.rank] = comm
            if len(clique.members) == clique.ndev:
                clique.failures = self._init_outcome(clique)
                self.nccl_cond.notify_all()
            while clique.failures is None:
                self._check_interrupt()
                if comm.aborted:  # a non-blocking communicator's abort ends its init
                    raise NcclError(INVALID_ARGUMENT, "the communicator was aborted")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(clique.ndev)) - set(clique.members))
                    raise NcclError(
                        SYSTEM_ERROR,
                        f"stand-in: ncclCommInitRank of rank "
                        f"{comm.rank} timed out waiting for ranks {missing}",
                    )
                self.nccl_cond.wait(min(left, 0.1))
            failure = clique.failures.get(comm.rank)
            if failure is None and clique.failures:
                self.hung_inits += 1
                try:
                    while not self._inits_ended and not comm.aborted:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            self.init_hangs_timed_out += 1
                            break
                        self.nccl_cond.wait(min(left, 0.1))
                finally:
                    self.hung_inits -= 1
                failure = NcclError(
                    SYSTEM_ERROR,
                    f"stand-in: ncclCommInitRank of rank {comm.rank} hung: ranks "
                    f"{sorted(clique.failures)} failed to initialise",
                )
        if failure is not None:
            raise failure
        return clique

    def end_hung_inits(self) -> None:
        """End every ncclCommInitRank that hangs because a peer failed (as the process's
        exit would); later ones end at once."""
        with self.nccl_cond:
            self._inits_ended = True
            self.nccl_cond.notify_all()

    def unreleased(self) -> list[Any]:
        """The communicators neither aborted nor destroyed: left to CuPy's `__dealloc__`,
        which calls ncclCommDestroy (a collective) at garbage collection or exit."""
        return [c for c in self.communicators() if not c.released]

    def _init_outcome(self, clique: _Clique) -> dict[int, NcclError]:
        failures: dict[int, NcclError] = {}
        members = clique.members
        for rank, comm in members.items():
            twins = sorted(r for r, c in members.items() if r != rank and c.device == comm.device)
            if twins:
                failures[rank] = NcclError(
                    INVALID_USAGE,
                    f"Duplicate GPU detected : rank {rank} and rank {twins[0]} "
                    f"both on CUDA device {comm.device}",
                )
            elif rank in self._init_failures:
                failures[rank] = self._init_failures.pop(rank)
        return failures

    def _launch(self, ops: list[_Op], lone: bool = False) -> None:
        """Issue `ops` (one operation, or one group) as one launch on their GPU: it starts
        once every NCCL launch issued on that GPU before it (by any communicator or
        thread) has completed. Hung ones are parked on their streams; a `lone` send or
        receive is queued as a stream item that completes when its peer's match runs
        (`_p2p_done`); the others run now, or are queued when their stream is blocked or
        an earlier launch on the GPU has not completed."""
        if len(ops) > 1:
            self._check_group_overlap(ops)
        live = []
        for op in ops:
            if self._hung(op.comm):
                with self.lock:
                    op.queue.submitted += 1
                    op.queue.items.append(_Item("hung", comm=op.comm))
            else:
                live.append(op)
        if not live:
            return
        device = live[0].comm.device
        comms = tuple({id(op.comm): op.comm for op in live}.values())
        queues = {id(op.queue): op.queue for op in live}
        with self.lock:
            seq = next(self._launches)
            self._unfinished.setdefault(device, {})[seq] = live[0].comm
            if lone and live[0].kind != "coll":
                (op,) = live
                op.queue.submitted += 1
                op.queue.items.append(
                    _Item("p2p", comm=op.comm, comms=comms, seq=seq, device=device, op=op)
                )
                wait = None
            else:
                blocked = [q for q in queues.values() if q.blocked()]
                wait = bool(blocked) or not self._turn(seq, device)
                if wait and len(queues) == 1:
                    queue = next(iter(queues.values()))
                    queue.submitted += 1
                    queue.items.append(
                        _Item(
                            "comm",
                            fn=lambda: self._execute(live),
                            comms=comms,
                            seq=seq,
                            device=device,
                        )
                    )
                    return
                if wait:
                    self._finish_launch(seq, device)
        if wait is None:
            self._pump()
            return
        if wait:
            self._violation("a group of NCCL operations on several streams, one blocked")
            raise StandinError("the stand-in cannot defer a group spanning several streams")
        try:
            self._execute(live)
            with self.lock:
                for op in live:
                    op.queue.submitted += 1
                    op.queue.completed += 1
        finally:
            with self.lock:
                self._finish_launch(seq, device)
            self._pump()

    def _turn(self, seq: int, device: int) -> bool:
        """Whether every NCCL launch issued on `device` before launch `seq` has completed
        (those of a released communicator no longer count: the abort ended them)."""
        return all(
            s >= seq or comm.released for s, comm in self._unfinished.get(device, {}).items()
        )

    def _finish_launch(self, seq: int, device: int) -> None:
        if seq >= 0:
            self._unfinished.get(device, {}).pop(seq, None)

    def _check_group_overlap(self, ops: list[_Op]) -> None:
        """The sends and receives of one group run concurrently: a receive buffer that
        overlaps another operation's buffer in the group gives undefined data on NCCL."""
        spans = [
            (op, kind, span)
            for op in ops
            if op.kind != "coll"
            for kind, span in (("send", op.send), ("recv", op.recv))
            if span is not None and span[1] > 0
        ]
        for i, (a, akind, aspan) in enumerate(spans):
            for b, bkind, bspan in spans[i + 1 :]:
                if "recv" not in (akind, bkind) or not _overlap(aspan, bspan):
                    continue
                text = (
                    f"rank {a.comm.rank}: in one NCCL group, the {akind} with rank {a.peer} "
                    f"{_span_text(aspan)} overlaps the {bkind} with rank {b.peer} "
                    f"{_span_text(bspan)}: they run concurrently, so what is sent or received "
                    "there is undefined (stage one of them in a separate buffer)"
                )
                self._violation(text)
                raise NcclError(INVALID_USAGE, f"stand-in: {text}")

    def _execute(self, ops: list[_Op]) -> None:
        """Post every send, run the collectives, then complete every receive."""
        for op in ops:
            if op.kind == "send":
                self._post(op)
        for op in ops:
            if op.kind == "coll":
                self._collective(op)
        for op in ops:
            if op.kind == "recv":
                self._receive(op)

    def _post(self, op: _Op) -> None:
        """A grouped send: its message is posted (a lone receive waiting for it takes it)."""
        message = _Message(op.count, op.datatype, self._bytes_at(*op.send).tobytes())
        comm = op.comm
        with self.nccl_cond:
            waiters = comm.clique.waiting.get((comm.rank, op.peer))
            taken = bool(waiters)
            if taken:
                self._deliver_lone(waiters.popleft(), message)
            else:
                box = comm.clique.mail.setdefault((comm.rank, op.peer), deque())
                box.append(message)
            self.nccl_cond.notify_all()
        if taken:
            self._pump()  # the lone receive has completed

    def _receive(self, op: _Op) -> None:
        comm = op.comm
        deadline = time.monotonic() + self.wait_timeout
        with self.nccl_cond:
            box = comm.clique.mail.setdefault((op.peer, comm.rank), deque())
            while not box:
                self._check_interrupt()
                if comm.released:
                    raise NcclError(INVALID_ARGUMENT, "the communicator was released")
                left = deadline - time.monotonic()
                if left <= 0:
                    text = (
                        f"rank {comm.rank}: recv of {op.count} x type {op.datatype} from "
                        f"rank {op.peer} found no message within {self.wait_timeout} s"
                    )
                    self._violation(text)
                    raise NcclError(SYSTEM_ERROR, f"stand-in: {text}")
                self.nccl_cond.wait(min(left, 0.1))
            message = box.popleft()
            text = self._deliver(op, message)
        if message.item is not None:
            self._pump()  # the lone send that posted it has completed
        if text:
            raise NcclError(INVALID_USAGE, f"stand-in: {text}")

    # -- lone sends and receives: stream items that wait for their peer ----------------------

    def _deliver(self, op: _Op, message: _Message) -> str | None:
        """Write `message` into receive `op`'s buffer (the lone send that posted it is done
        then); the mismatch's text, also a violation, if they disagree on count or type.
        Holds nccl_cond."""
        if message.item is not None:
            self._end_p2p(message.item)
        if (message.count, message.datatype) != (op.count, op.datatype):
            text = (
                f"rank {op.comm.rank}: recv of {op.count} x type {op.datatype} from rank "
                f"{op.peer} matched a send of {message.count} x type {message.datatype}"
            )
            self._violation(text)
            return text
        self._bytes_at(*op.recv)[...] = np.frombuffer(message.payload, np.uint8)
        return None

    def _deliver_lone(self, item: _Item, message: _Message) -> None:
        """A lone receive waiting at the head of its stream takes `message`. Holds
        nccl_cond."""
        text = self._deliver(item.op, message)
        self._end_p2p(item)
        if text:  # on a GPU the kernel would fail or corrupt memory: an async error here
            item.comm.async_error = NcclError(INVALID_USAGE, f"stand-in: {text}")

    def _end_p2p(self, item: _Item) -> None:
        item.state = 2
        if item.timer is not None:
            item.timer.cancel()

    def _p2p_done(self, item: _Item) -> bool:
        """A lone send or receive at the head of its stream (holding the lock): start it
        once it is its turn on the GPU - a send posts its message, a receive takes the
        pair's next message or waits for it - and say whether it has completed: a send
        once a receive took its message, a receive once it has its message. An aborted
        communicator's end at once, without data."""
        op, comm = item.op, item.comm
        if comm.released:
            with self.nccl_cond:
                self._forget_p2p(item)
                self._end_p2p(item)
            return True
        if item.state == 0:
            if not self._turn(item.seq, item.device):
                return False
            clique = comm.clique
            with self.nccl_cond:
                item.state = 1
                if op.kind == "send":
                    payload = self._bytes_at(*op.send).tobytes()
                    message = _Message(op.count, op.datatype, payload, item)
                    waiters = clique.waiting.get((comm.rank, op.peer))
                    if waiters:
                        self._deliver_lone(waiters.popleft(), message)
                    else:
                        clique.mail.setdefault((comm.rank, op.peer), deque()).append(message)
                else:
                    box = clique.mail.get((op.peer, comm.rank))
                    if box:
                        self._deliver_lone(item, box.popleft())
                    else:
                        clique.waiting.setdefault((op.peer, comm.rank), deque()).append(item)
                self.nccl_cond.notify_all()
                if item.state == 1:
                    item.timer = threading.Timer(self.wait_timeout, self._expire_p2p, (item,))
                    item.timer.daemon = True
                    item.timer.start()
        return item.state == 2

    def _forget_p2p(self, item: _Item) -> None:
        """Take a lone operation's message or wait out of its clique. Holds nccl_cond."""
        op, comm = item.op, item.comm
        if op.kind == "send":
            box = comm.clique.mail.get((comm.rank, op.peer), deque())
            for message in [m for m in box if m.item is item]:
                box.remove(message)
        else:
            waiters = comm.clique.waiting.get((op.peer, comm.rank), deque())
            if item in waiters:
                waiters.remove(item)

    def _expire_p2p(self, item: _Item) -> None:
        """A lone send or receive whose peer never ran the matching operation: on a GPU
        its stream, and every later NCCL operation of its GPU, would wait for ever."""
        op, comm = item.op, item.comm
        with self.lock, self.nccl_cond:
            if item.state == 2:
                return
            self._forget_p2p(item)
            self._end_p2p(item)
            way = "to" if op.kind == "send" else "from"
            text = (
                f"rank {comm.rank}: lone {op.kind} of {op.count} x type {op.datatype} "
                f"{way} rank {op.peer} was not matched within {self.wait_timeout} s by a "
                f"running {'recv' if op.kind == 'send' else 'send'} of that rank: a lone "
                "send or recv blocks its stream (and later NCCL work of its GPU) until the "
                "peer's matching operation runs - a deadlock on a GPU (issue such pairs in "
                "one NCCL group)"
            )
            self._violation(text)
            comm.async_error = NcclError(SYSTEM_ERROR, f"stand-in: {text}")
        self._pump()

    def _collective(self, op: _Op) -> None:
        comm = op.comm
        clique = comm.clique
        seq = comm._coll_seq
        comm._coll_seq += 1
        snapshot = self._bytes_at(*op.send).copy() if op.send is not None else None
        deadline = time.monotonic() + self.wait_timeout
        with self.nccl_cond:
            slot = clique.colls.setdefault(seq, {"posts": {}, "left": clique.ndev})
            slot["posts"][comm.rank] = (op.desc, snapshot)
            self.nccl_cond.notify_all()
            while len(slot["posts"]) < clique.ndev:
                self._check_interrupt()
                if comm.released:
                    raise NcclError(INVALID_ARGUMENT, "the communicator was released")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(clique.ndev)) - set(slot["posts"]))
                    text = (
                        f"rank {comm.rank}: collective #{seq} ({op.name}) timed out "
                        f"waiting for ranks {missing}"
                    )
                    self._violation(text)
                    raise NcclError(SYSTEM_ERROR, f"stand-in: {text}")
                self.nccl_cond.wait(min(left, 0.1))
            posts = dict(slot["posts"])
            slot["left"] -= 1
            if not slot["left"]:
                del clique.colls[seq]
        for peer, (desc, _) in sorted(posts.items()):
            if desc != op.desc:
                raise NcclError(
                    INVALID_USAGE,
                    f"stand-in: collective mismatch at #{seq}: "
                    f"rank {comm.rank} called {_describe(op.desc)}, rank {peer} "
                    f"called {_describe(desc)}",
                )
        name, count, datatype, nop, root = op.desc
        dtype = NCCL_DTYPES[datatype]
        n = clique.ndev

        def data(rank: int) -> np.ndarray:
            return posts[rank][1].view(dtype)

        if name == "broadcast":
            result = data(root)
        elif name == "allGather":
            result = np.concatenate([data(r) for r in range(n)])
        else:
            result = data(0).copy()
            for r in range(1, n):
                _UFUNCS[nop](result, data(r), out=result)
            if nop == 4:  # AVG: the sum divided by the rank count, in the datatype
                if dtype.kind == "f":
                    np.true_divide(result, dtype.type(n), out=result)
                else:
                    np.floor_divide(result, dtype.type(n), out=result)
            if name == "reduceScatter":
                result = result[comm.rank * count : (comm.rank + 1) * count]
            elif name == "reduce" and comm.rank != root:
                return
        self._bytes_at(*op.recv)[...] = np.ascontiguousarray(result).view(np.uint8)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether the byte spans (ptr, nbytes) `a` and `b` share a byte."""
    return a[1] > 0 and b[1] > 0 and a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


def _span_text(span: tuple[int, int]) -> str:
    return f"[{span[0]:#x}, +{span[1]})"


def _describe(desc: tuple) -> str:
    name, count, datatype, op, root = desc
    text = f"{name} of {count} x {NCCL_DTYPES[datatype]}"
    if op >= 0:
        text += f" op {NCCL_OPS[op]}"
    if root >= 0:
        text += f" root {root}"
    return text
