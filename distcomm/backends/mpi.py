"""The `mpi` backend: every op on mpi4py's buffer (uppercase) methods, zero-copy.

Collectives call MPI's blocking functions, so they run at the speed of raw mpi4py.
`async_op=True` runs the same blocking call on the group's worker thread, in issue
order, and returns at once (mpi4py releases the GIL, so the caller computes meanwhile).
MPI's non-blocking collectives (Iallreduce, ...) are not used for it: MPI never matches
a blocking collective with a non-blocking one, and torch semantics let one rank call
`all_reduce(async_op=True)` where another calls `all_reduce()`. A watchdog thread aborts
the MPI job (MPI_Abort, with a message naming the op) when an operation outlives the
group timeout, since MPI operations cannot be cancelled. Point-to-point operations are
MPI requests (Isend/Irecv) whose Work drives MPI's progress while it waits.

The default group runs on a duplicate of MPI.COMM_WORLD, subgroups on communicators
made by `Create_group` (only the members take part). Dtypes map to MPI datatypes;
float16 moves as 16-bit words and is reduced by a user-defined op; bool reductions use
MPI's logical ops. CuPy arrays go to MPI directly when the library is CUDA-aware (every
op first synchronises the current stream of each array's device: MPI is not ordered by
streams) and through pinned host memory otherwise.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..arrays import address, copy_on_device, may_share_memory, on_device
from ..bootstrap.mpi import MPI_BACKEND_NEEDS
from ..bootstrap.mpi import world_mpi as mpi  # MPI.COMM_WORLD checked (re-exported here)
from ..errors import DistBackendError, DistTimeoutError, GroupDestroyedError
from ..gpu.runtime import is_cupy_array, synchronize_arrays
from ..mpiutil import abort, install_abort_hook, is_mpi4py_available, load_mpi
from ..ops import MPI_OP_NAMES, ReduceOp, average_into, reduce_into
from ..store.base import Store
from ..work import Future, Work
from .base import Backend, BackendOptions, OpQueue
from .mpi_uneven import MpiUneven

__all__ = ["WORLD", "MpiBackend", "mpi"]

#: the world's communicator once it was re-formed (`mpi_reform`): groups made later are
#: made from it, not from MPI.COMM_WORLD (empty until then)
WORLD: list[Any] = []

_AVG = ReduceOp.AVG  # a module global: faster to reach than the enum's attribute

_DTYPES = {
    "bool": "C_BOOL",
    "int8": "INT8_T",
    "int16": "INT16_T",
    "int32": "INT32_T",
    "int64": "INT64_T",
    "uint8": "UINT8_T",
    "uint16": "UINT16_T",
    "uint32": "UINT32_T",
    "uint64": "UINT64_T",
    "float16": "UINT16_T",
    "float32": "FLOAT",
    "float64": "DOUBLE",
    "complex64": "C_FLOAT_COMPLEX",
    "complex128": "C_DOUBLE_COMPLEX",
}
_BOOL_OPS = {
    ReduceOp.SUM: "LOR",
    ReduceOp.PRODUCT: "LAND",
    ReduceOp.MIN: "LAND",
    ReduceOp.MAX: "LOR",
    ReduceOp.BAND: "LAND",
    ReduceOp.BOR: "LOR",
    ReduceOp.BXOR: "LXOR",
}
_SPIN_YIELD = 64  # Test calls between sched_yields while waiting on a request
_SPIN_SECONDS = 10.0  # then the waiter sleeps between tests (a hung peer costs no CPU)


class _MpiWork(Work):
    """A Work on an MPI request; `wait` and `is_completed` drive MPI's progress."""

    def __init__(
        self,
        description: str,
        outputs: list[Any],
        request: Any,
        finish: Callable[[], None] | None,
        timeout: float,
        status: Any = None,
        on_timeout: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(description, outputs, timeout=timeout)
        self._request, self._finish, self._status = request, finish, status
        self._lock = threading.Lock()
        self._on_expiry = on_timeout

    def _test(self) -> bool:
        with self._lock:
            if self._future.done():
                return True
            try:
                done = self._request.Test(self._status)
            except Exception as exc:  # MPI.Exception
                self.fail(DistBackendError(f"{self.description}: {_mpi_error(exc)}"))
                return True
            if done:
                try:
                    if self._finish is not None:
                        self._finish()
                except BaseException as exc:
                    self.fail(exc)
                    return True
                source = self._status.Get_source() if self._status is not None else -1
                self.complete(source)
            return done

    def _drive(self, seconds: float | None) -> bool:
        start = time.monotonic()
        spins = 0
        while not self._test():
            spins += 1
            if spins % _SPIN_YIELD:
                continue
            waited = time.monotonic() - start
            if seconds is not None and waited >= seconds:
                return False
            if waited > _SPIN_SECONDS:
                time.sleep(0.001)
            else:
                os.sched_yield()
        return True

    def wait(self, timeout: Any = None) -> bool:
        from ..deadline import to_seconds

        seconds = to_seconds(timeout)
        if seconds is None:
            seconds = self._default_timeout
        if not self._drive(seconds):
            if self._on_expiry is not None:
                self._on_expiry()
            raise DistTimeoutError(
                f"{self.description} did not complete within {seconds:.1f} s; an MPI "
                "operation cannot be cancelled, so this group can no longer be used"
            )
        return super().wait(0)

    def is_completed(self) -> bool:
        return self._test()

    def get_future(self) -> Future:
        if not self._future.done():
            threading.Thread(
                target=self._drive, args=(None,), daemon=True, name="distcomm-mpi-future"
            ).start()
        return self._future


def _mpi_error(exc: BaseException) -> str:
    getter = getattr(exc, "Get_error_string", None)
    return getter() if getter is not None else str(exc)


class MpiBackend(MpiUneven, Backend):
    """MPI through mpi4py: zero-copy buffer methods on a communicator per group (the
    uneven collectives, MPI's v-calls, in `mpi_uneven.py`)."""

    name = "mpi"
    devices = ("cpu", "cuda")
    stages_device_arrays = True

    @classmethod
    def is_available(cls) -> bool:
        return is_mpi4py_available()

    @classmethod
    def unavailable_reason(cls) -> str:
        return MPI_BACKEND_NEEDS

    @classmethod
    def from_options(cls, options: BackendOptions, pg_options: Any = None) -> MpiBackend:
        """The group's communicator is made from its ranks in MPI.COMM_WORLD."""
        return cls(
            options.store,
            options.group_rank,
            options.group_size,
            options.timeout,
            options.group_id,
            options.global_ranks_in_group or None,
        )

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: float,
        group_name: str = "",
        global_ranks: Sequence[int] | None = None,
        comm: Any = None,
    ) -> None:
        super().__init__(store, rank, size, timeout, group_name)
        # `comm`: a communicator made elsewhere (a re-formed world, `mpi_reform`), owned now
        MPI = self._MPI = mpi() if comm is None and not WORLD else load_mpi()
        install_abort_hook()  # an uncaught exception ends the job instead of hanging it
        world = WORLD[0] if WORLD else MPI.COMM_WORLD
        ranks = list(global_ranks) if global_ranks is not None else list(range(size))
        if comm is not None:
            pass
        elif world.size < len(ranks) or max(ranks, default=0) >= world.size:
            raise DistBackendError(
                f"{self.label()} mpi backend: the group needs ranks {ranks} but "
                f"MPI.COMM_WORLD has {world.size} process(es); start the job with "
                f"mpiexec -n {max(ranks) + 1} or more"
            )
        if comm is not None:
            pass
        elif ranks == list(range(world.size)):
            comm = world.Dup()
        else:
            everyone = world.Get_group()
            members = everyone.Incl(ranks)
            try:
                comm = world.Create_group(members)
            finally:
                members.Free()
                everyone.Free()
        if comm.rank != rank or comm.size != size:
            got = (comm.rank, comm.size)
            comm.Free()
            raise DistBackendError(
                f"{self.label()} mpi backend: MPI places this process at rank {got[0]} of "
                f"{got[1]}, but the group was created with rank {rank} of {size}; under "
                "mpiexec let init_process_group('mpi') take rank and world size from MPI"
            )
        comm.Set_name(f"distcomm:{self.group_name}")
        self._comm = comm
        self._tag_ub = int(comm.Get_attr(MPI.TAG_UB) or 32767)
        self._user_ops: dict[ReduceOp, Any] = {}
        self._ops: dict[tuple[ReduceOp, Any], Any] = {}  # (op, dtype) -> MPI.Op
        self._datatypes: dict[Any, Any] = {}  # numpy dtype -> MPI.Datatype
        self._cuda_aware = _cuda_aware(MPI)
        if self._cuda_aware:  # MPI is not ordered by CUDA streams: each buffer synchronises
            self._buf = self._synced_buf  # type: ignore[method-assign]
        self._queue = OpQueue(f"distcomm-mpi-ops-{self.group_name}")
        # async collectives need MPI calls from the worker thread: MPI_THREAD_MULTIPLE
        self._threaded = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self._closed = False
        self._broken = ""
        self._inflight: tuple[float, str] | None = None
        self._watchdog: threading.Thread | None = None
        self._watch_stop = threading.Event()

    @property
    def comm(self) -> Any:
        """The group's MPI communicator (re-forming makes a new one from it)."""
        return self._comm

    # -- plumbing -----------------------------------------------------------------------------

    def _buf(self, array: Any) -> list[Any]:
        if array is None:
            return None  # type: ignore[return-value]
        datatype = self._datatypes.get(array.dtype)
        if datatype is None:
            name = _DTYPES[np.dtype(array.dtype).name]
            datatype = self._datatypes[array.dtype] = getattr(self._MPI, name)
        return [array, datatype]

    def _synced_buf(self, array: Any) -> list[Any]:
        if is_cupy_array(array):
            synchronize_arrays([array])  # the kernels queued on its device's stream first
        return MpiBackend._buf(self, array)

    def _op(self, op: ReduceOp, dtype: np.dtype) -> Any:
        key = (op, dtype)
        found = self._ops.get(key)
        if found is None:
            found = self._ops[key] = self._lookup_op(op, np.dtype(dtype))
        return found

    def _lookup_op(self, op: ReduceOp, dtype: np.dtype) -> Any:
        MPI = self._MPI
        if dtype.name == "float16":
            user = self._user_ops.get(op)
            if user is None:

                def combine(inbuf: Any, inout: Any, datatype: Any, op: ReduceOp = op) -> None:
                    incoming = np.frombuffer(inbuf, dtype=np.float16)
                    acc = np.frombuffer(inout, dtype=np.float16)
                    reduce_into(acc, incoming, op)

                user = self._user_ops[op] = MPI.Op.Create(combine, commute=True)
            return user
        if dtype.kind == "b":
            return getattr(MPI, _BOOL_OPS[op])
        return getattr(MPI, MPI_OP_NAMES[op])

    def _check(self, what: str) -> str:
        description = self.describe(what)
        if self._closed:
            raise GroupDestroyedError(f"{description}: the process group was destroyed")
        if self._broken:
            raise DistBackendError(f"{description}: the group is unusable: {self._broken}")
        return description

    def _break(self, description: str) -> None:
        """Refuse every later operation: `description` timed out and is still in MPI."""
        self._broken = f"{description} timed out and could not be cancelled"
        self.notify_abort(self._broken)

    def _run(
        self,
        what: str,
        blocking: Callable[[], None],
        outputs: list[Any],
        async_op: bool,
        finish: Callable[[], None] | None = None,
    ) -> Work:
        """Run the blocking MPI call `blocking()` in issue order (on the worker thread when
        `async_op`), then `finish()`."""
        if not async_op and not self._broken:
            # the common synchronous call: nothing queued before it, so run it right here
            done = self._queue.run_now(what, outputs, self.timeout, self._call, blocking, finish)
            if done is not None:
                return done
        description = self._check(what)

        def on_timeout(seconds: float) -> BaseException:
            self._break(description)
            return DistTimeoutError(
                f"{description} did not complete within {seconds:.1f} s (Work.wait timeout); "
                "an MPI operation cannot be cancelled, so this group can no longer be used"
            )

        def run() -> None:
            self._call(what, blocking, finish)

        work = Work(description, outputs, on_timeout=on_timeout, timeout=self.timeout)
        return self._queue.submit(run, work, async_op and self._threaded)

    def _call(
        self, what: str, blocking: Callable[[], None], finish: Callable[[], None] | None
    ) -> None:
        """Make the blocking MPI call under the watchdog's eye, then `finish()`."""
        self._inflight = (time.monotonic(), what)
        if self._watchdog is None:
            self._start_watchdog()
        try:
            blocking()
        except self._MPI.Exception as exc:
            raise DistBackendError(f"{self.describe(what)}: {_mpi_error(exc)}") from None
        finally:
            self._inflight = None
        if finish is not None:
            finish()

    def _request(
        self,
        what: str,
        start: Callable[[], Any],
        outputs: list[Any],
        finish: Callable[[], None] | None = None,
        status: Any = None,
    ) -> Work:
        """Start a point-to-point request; its Work drives MPI's progress when waited on."""
        description = self._check(what)
        try:
            request = start()
        except self._MPI.Exception as exc:
            raise DistBackendError(f"{description}: {_mpi_error(exc)}") from None
        return _MpiWork(
            description,
            outputs,
            request,
            finish,
            self.timeout,
            status,
            lambda: self._break(description),
        )

    # -- the watchdog of blocking calls ---------------------------------------------------------

    def _start_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch_loop, daemon=True, name="distcomm-mpi-watchdog"
            )
            self._watchdog.start()

    def _watch_loop(self) -> None:
        interval = min(1.0, max(self.timeout / 4, 0.05))
        while not self._watch_stop.wait(interval):
            inflight = self._inflight
            if inflight is None or time.monotonic() - inflight[0] < self.timeout:
                continue
            print(
                f"{self.describe(inflight[1])} did not complete within {self.timeout:.1f} s "
                "(the group timeout): a rank has not called it, or called a different "
                "operation. An "
                "MPI operation cannot be cancelled, so the MPI job is aborted.",
                file=sys.stderr,
                flush=True,
            )
            abort(self._MPI)

    # -- GPU arrays -------------------------------------------------------------------------

    def takes_device_arrays(self) -> bool:
        return self._cuda_aware

    # -- the op set ------------------------------------------------------------------------

    def broadcast(self, array: Any, root: int, *, async_op: bool = False) -> Work:
        buf, comm = self._buf(array), self._comm
        return self._run("broadcast", lambda: comm.Bcast(buf, root), [array], async_op)

    def all_reduce(self, array: Any, op: ReduceOp, *, async_op: bool = False) -> Work:
        buf, comm, IN_PLACE = self._buf(array), self._comm, self._MPI.IN_PLACE
        mop = self._op(op, array.dtype)
        return self._run(
            "all_reduce",
            lambda: comm.Allreduce(IN_PLACE, buf, mop),
            [array],
            async_op,
            self._averaged(op, array),
        )

    def _averaged(self, op: ReduceOp, array: Any) -> Callable[[], None] | None:
        if op is not _AVG:
            return None
        if is_cupy_array(array):  # a kernel on the array's device (the call may run elsewhere)
            return lambda: on_device(array, lambda: average_into(array, self.size))
        return lambda: average_into(array, self.size)

    def reduce(self, array: Any, root: int, op: ReduceOp, *, async_op: bool = False) -> Work:
        comm, buf, mop = self._comm, self._buf(array), self._op(op, array.dtype)
        if self.rank == root:
            send, recv = self._MPI.IN_PLACE, buf
        else:
            send, recv = buf, None
        finish = self._averaged(op, array) if self.rank == root else None
        return self._run(
            "reduce", lambda: comm.Reduce(send, recv, mop, root), [array], async_op, finish
        )

    def _in_place(self, output: Any, input: Any, index: int) -> Any:
        """MPI.IN_PLACE when `input` already is slot `index` of `output`; else `input`'s
        buffer (copied first if it overlaps `output` elsewhere, which MPI forbids)."""
        if output is None:
            return self._buf(input)
        numpy = type(input) is np.ndarray  # so is output (one device): numpy's check, directly
        if not (np.shares_memory(output, input) if numpy else may_share_memory(output, input)):
            return self._buf(input)
        m = input.size
        if address(output[index * m : (index + 1) * m]) == address(input):
            return self._MPI.IN_PLACE
        return self._buf(copy_on_device(input))

    def all_gather(self, output: Any, input: Any, *, async_op: bool = False) -> Work:
        comm, send, recv = self._comm, self._in_place(output, input, self.rank), self._buf(output)
        return self._run("all_gather", lambda: comm.Allgather(send, recv), [output], async_op)

    def gather(self, output: Any | None, input: Any, root: int, *, async_op: bool = False) -> Work:
        comm = self._comm
        if self.rank == root:
            send, recv = self._in_place(output, input, root), self._buf(output)
        else:
            send, recv = self._buf(input), None
        return self._run(
            "gather",
            lambda: comm.Gather(send, recv, root),
            [output] if output is not None else [],
            async_op,
        )

    def scatter(self, output: Any, input: Any | None, root: int, *, async_op: bool = False) -> Work:
        comm = self._comm
        if self.rank == root:
            send = self._buf(
                input if not may_share_memory(input, output) else copy_on_device(input)
            )
        else:
            send = None
        recv = self._buf(output)
        return self._run("scatter", lambda: comm.Scatter(send, recv, root), [output], async_op)

    def reduce_scatter(
        self, output: Any, input: Any, op: ReduceOp, *, async_op: bool = False
    ) -> Work:
        comm, mop = self._comm, self._op(op, output.dtype)
        send = self._buf(input if not may_share_memory(input, output) else copy_on_device(input))
        recv = self._buf(output)
        return self._run(
            "reduce_scatter",
            lambda: comm.Reduce_scatter_block(send, recv, mop),
            [output],
            async_op,
            self._averaged(op, output),
        )

    def all_to_all(
        self,
        output: Any,
        input: Any,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        *,
        async_op: bool = False,
    ) -> Work:
        comm = self._comm
        source = input if not may_share_memory(input, output) else copy_on_device(input)
        if len(set(input_splits)) <= 1 and list(input_splits) == list(output_splits):
            send, recv = self._buf(source), self._buf(output)
            blocking = lambda: comm.Alltoall(send, recv)  # noqa: E731
        else:
            send, recv = self._counted(source, input_splits), self._counted(output, output_splits)
            blocking = lambda: comm.Alltoallv(send, recv)  # noqa: E731
        return self._run("all_to_all", blocking, [output], async_op)

    def barrier(self, *, async_op: bool = False) -> Work:
        comm = self._comm
        return self._run("barrier", comm.Barrier, [], async_op)

    # -- point to point -------------------------------------------------------------------

    def _tag(self, tag: int, what: str) -> int:
        if tag < 0:  # distcomm's own messages (monitored_barrier): the top of the range
            return self._tag_ub + tag + 1
        if tag > self._tag_ub - 16:
            raise ValueError(
                f"{what}: tag {tag} is too large for this MPI library (the "
                f"largest is {self._tag_ub - 16}); use a smaller tag"
            )
        return tag

    def send(self, array: Any, dst: int, tag: int) -> Work:
        if is_cupy_array(array) and not self._cuda_aware:
            array = array.get()  # the host copy is taken now, as a send must
        buf, comm = self._buf(array), self._comm
        what = f"send to rank {dst} (tag {tag})"
        mpi_tag = self._tag(tag, what)
        return self._request(what, lambda: comm.Isend(buf, dst, mpi_tag), [array])

    def recv(self, array: Any, src: int | None, tag: int) -> Work:
        what = f"recv from {'any rank' if src is None else f'rank {src}'} (tag {tag})"
        target = array
        finish = None
        if is_cupy_array(array) and not self._cuda_aware:
            target = np.empty(array.shape, dtype=array.dtype)

            def finish() -> None:
                array.set(target)

        buf, comm, MPI = self._buf(target), self._comm, self._MPI
        source = MPI.ANY_SOURCE if src is None else src
        mpi_tag = self._tag(tag, what)
        status = MPI.Status()
        return self._request(
            what, lambda: comm.Irecv(buf, source, mpi_tag), [array], finish, status
        )

    # -- lifecycle -------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        self._broken = reason
        self.notify_abort(reason)

    def abort_reason(self) -> str | None:
        return self._broken or None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.close(
            GroupDestroyedError(f"{self.describe('operation')}: the process group was destroyed")
        )
        self._watch_stop.set()
        if self._watchdog is not None:
            self._watchdog.join(5.0)
        for op in self._user_ops.values():
            op.Free()
        self._user_ops.clear()
        self._ops.clear()
        try:
            self._comm.Free()
        except self._MPI.Exception:
            pass


def _cuda_aware(MPI: Any) -> bool:
    """Whether the MPI library takes CUDA device pointers (MPIX_Query_cuda_support)."""
    query = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(query()) if query is not None else False
    except Exception:  # not supported by this library
        return False
