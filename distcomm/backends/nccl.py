"""The `nccl` backend: CuPy arrays through NCCL (CuPy's `cupy.cuda.nccl` bindings).

Streams and completion (torch's semantics): each group runs its operations on its own
non-blocking CUDA stream, which first waits for the caller's current stream, so kernels
queued before the call (producers) are ordered before the collective. The returned
`Work` completes on a CUDA event recorded after the operation. `wait()` makes the
caller's current stream wait for that event and returns at once; `wait(timeout)` (and
every wait when DISTCOMM_NCCL_BLOCKING_WAIT=1) blocks the host until the event, and when
the timeout expires aborts the communicator (ncclCommAbort) and raises
`DistTimeoutError` naming the op and its sequence number. `barrier()` blocks the host.
Arrays an operation uses are kept alive by its Work until the event has passed.

Watchdog (`nccl_watch.py`; the Work is `nccl_work.py`; the backend owns one
`NcclWatchdog` per group and passes it what it watches): while operations are pending, a
thread polls their events (completing their futures), `check_async_error()` (a failed
peer or network error becomes `DistBackendError` and aborts the communicator instead of
a hang), the group timeout, and an abort notice other ranks leave in the store. After an
abort every operation of the group raises; destroy the group and create a new one.

Ops: all_reduce, broadcast, reduce, all_gather and reduce_scatter are NCCL collectives;
gather, scatter and all_to_all are grouped sends and receives (ncclGroupStart/End);
barrier is a one-element all_reduce. Point-to-point messages between two ranks are
matched in the order they were posted; tags are accepted and ignored (as with torch's
NCCL), and a receive must name its source. `batch_isend_irecv` runs as one NCCL group.
Dtypes and reductions NCCL lacks are mapped as `distcomm.gpu.nccl` describes.

Lone sends and receives are deferred and posted together as NCCL groups, and every
group on a GPU issues under one lock (its lane): `nccl_p2p.NcclPointToPoint`, a mixin of
`NcclBackend`, says how and why.

Order across groups: NCCL kernels of different communicators on one GPU may wait for
each other, so every rank must issue the operations of different groups in the same
order (as torch documents; NCCL before 2.26 deadlocks otherwise). Every nccl group of a
process on one GPU issues under one lock, so two threads cannot interleave their NCCL
calls and a coalesced batch reaches the GPU whole; which thread goes first is still the
caller's to order.

In-place forms: NCCL defines only all_reduce, broadcast and reduce with one buffer,
all_gather whose input is this rank's piece of its output, and reduce_scatter whose
output is this rank's piece of its input. Any other overlap of an operation's input and
output (all_to_all(x, x), an all_gather from another slice of its output, gather and
scatter pieces, a send and a receive of one array in one batch) is staged: the input is
copied to a temporary on the group's stream first, kept alive until the operation's
event.

The communicator's life (made on a group's first operation, each group its own; aborted
with the group) and the DISTCOMM_DEBUG=DETAIL signature check are
`nccl_comm.NcclCommunicator`, a mixin of `NcclBackend`.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .. import config
from ..arrays import extent, extents_overlap
from ..errors import (
    BackendUnavailableError,
    DistBackendError,
    DistError,
)
from ..gpu import nccl as nccl_types
from ..gpu import runtime
from ..launcher_env import node_local_rank
from ..ops import ReduceOp, average_into
from ..store.base import Store
from ..store.prefix import PrefixStore
from ..work import Work
from .base import Backend, setup_round
from .engine.protocol import Signature
from .nccl_comm import NcclCommunicator
from .nccl_p2p import Lane, NcclPointToPoint, device_lane
from .nccl_watch import NcclWatchdog
from .nccl_work import NcclWork

__all__ = ["NcclBackend", "NcclWork"]


class NcclBackend(NcclPointToPoint, NcclCommunicator, Backend):
    """Collectives on CuPy arrays through NCCL, one communicator and CUDA stream per group."""

    name = "nccl"
    devices = ("cuda",)

    @classmethod
    def is_available(cls) -> bool:
        return not cls.unavailable_reason()

    @classmethod
    def unavailable_reason(cls) -> str:
        """Why CuPy's NCCL cannot run here ('' if it can). Like torch's
        `is_nccl_available()`, it asks only whether CuPy and the NCCL library are there,
        never CUDA, so asking does not initialise CUDA (a process forked after that cannot
        use it); a missing GPU is reported when the backend is made. Where CuPy fails to
        import or its NCCL is missing, the reason also says whether the driver (NVML, which
        does not initialise CUDA) shows a GPU: on a host without one it says that, not
        what to install (`distcomm.gpu.runtime.load_cupy`, `distcomm.gpu.nccl`)."""
        try:
            nccl_types.import_nccl(need_device=False)
        except BackendUnavailableError as exc:
            return str(exc)
        return ""

    def __init__(
        self, store: Store, rank: int, size: int, timeout: float, group_name: str = ""
    ) -> None:
        super().__init__(store, rank, size, timeout, group_name)
        self._nccl, self._version = nccl_types.import_nccl()
        # a group re-created on the same store (re-initialisation) gets keys of its own:
        # every rank joins once per group, so the join count numbers the groups
        self.store = PrefixStore(f"g{setup_round(store, 'joined', size)}", store)
        self._cupy = sys.modules["cupy"]
        cfg = config.load()
        self._blocking_wait = cfg.nccl_blocking_wait
        self._detail = cfg.debug == "DETAIL"
        if runtime.chosen_device() is None and node_local_rank() is not None:
            runtime.set_device(runtime.current_device())  # one GPU per launcher worker
        # operations are issued one at a time, in order: under this lock, and under the
        # lock of the device's lane (taken first), which every group on the GPU shares
        self._issue = threading.RLock()
        self._watch = NcclWatchdog(
            self.store, rank, timeout, self.describe, self.group_name, self._detail
        )
        self._watch.on_failure = self.notify_abort
        self._watch.size = size
        self._comm: Any = None
        self._device: Any = None
        self._stream: Any = None
        self._seq = 0  # operations issued, for messages
        self._coll_seq = 0  # collectives issued, for the DETAIL signature check
        self._grouped: list[NcclWork] | None = None  # Works of an open coalesced batch
        self._device_lane: Lane | None = None  # what the groups on its GPU share
        # the sends and receives of the NCCL group being posted, (kind, byte span) each,
        # and the copies out of the temporaries its overlapping receives used
        self._batch: list[tuple[str, tuple[int, int]]] = []
        self._after: list[tuple[Any, Any]] = []
        self._barrier_buffer: Any = None
        self._caller_event: Any = None  # records the caller's stream for _follow_caller
        self._plans: dict[tuple[Any, ReduceOp], tuple[Any, int, Any, str]] = {}

    # -- issuing operations -------------------------------------------------------------------

    def _device_id(self, array: Any, op: str) -> int:
        """The GPU of a CuPy array; TypeError for anything else."""
        if not runtime.is_cupy_array(array):
            raise TypeError(
                f"{self.describe(op)}: the nccl backend takes CuPy arrays, got "
                f"{type(array).__module__}.{type(array).__name__}; use a group with a CPU "
                "backend for host arrays, e.g. backend='cpu:gloo,cuda:nccl'"
            )
        return runtime.device_of(array)

    def _issue_op(
        self,
        op: str,
        device_id: int,
        launch: Callable[[Any, int], None],
        outputs: list[Any],
        keep: list[Any],
        signature: Callable[[], Signature] | None = None,
        host_wait: bool = False,
        source_rank: int = -1,
    ) -> NcclWork:
        """Queue `launch(comm, stream_ptr)` on the group's stream; the Work of the operation.

        `signature` (collectives) makes the op's signature, which is checked against every
        rank's in DETAIL mode (made only then: it costs a microsecond per op). The lone
        sends and receives of the device not posted yet are posted first (an operation
        inside a coalesced batch excepted).
        """
        with self._lane(device_id, op).lock, self._issue:
            if self._grouped is None:
                self._flush_lane(device_id)
            self._seq += 1
            description = self.describe(f"{op} #{self._seq}")
            self._watch.raise_if_failed(description)
            comm = self._ensure(device_id, op)
            if signature is not None:
                self._coll_seq += 1
                if self._detail:
                    self._check_signature(self._coll_seq, signature(), description)
            work = self._work(description, outputs, keep, host_wait, source_rank)
            with self._device:
                if self._grouped is None:
                    self._follow_caller()
                self._watch.launch_started(description)
                try:
                    launch(comm, self._stream.ptr)
                except Exception as exc:
                    raise self._launch_failed(description, exc) from exc
                finally:
                    self._watch.launch_ended()
                # the group failed while the call was inside NCCL (its abort waited for it)
                self._watch.raise_if_failed(description)
                if self._grouped is not None:
                    self._grouped.append(work)
                else:
                    work._record(self._stream)
                    self._watch.track([work])
            return work

    def _work(
        self,
        description: str,
        outputs: list[Any],
        keep: list[Any],
        host_wait: bool = False,
        source_rank: int = -1,
    ) -> NcclWork:
        """The Work of an operation being issued (`host_wait`: its wait() blocks the host,
        as every one does with DISTCOMM_NCCL_BLOCKING_WAIT=1)."""
        return NcclWork(
            self._watch,
            self._cupy,
            description,
            outputs,
            keep,
            host_wait=host_wait or self._blocking_wait,
            source_rank=source_rank,
            then=self._then,
        )

    def _follow_caller(self) -> None:
        """Make the group's stream wait for the work queued so far on the caller's stream."""
        cupy = self._cupy
        if self._caller_event is None:
            # one event serves every op: cudaStreamWaitEvent waits for the record made
            # just before it, whatever is recorded on the event afterwards
            self._caller_event = cupy.cuda.Event(disable_timing=True)
        self._caller_event.record(cupy.cuda.get_current_stream())
        self._stream.wait_event(self._caller_event)

    def _launch_failed(self, description: str, exc: BaseException) -> DistError:
        failure = self._watch.failure
        if failure is not None:  # aborted meanwhile (watchdog): that is the reason
            error = type(failure)(f"{description}: the group was aborted: {failure}")
            error.peer_ranks = failure.peer_ranks
            return error
        error = DistBackendError(f"{description}: NCCL refused the operation: {exc}")
        self._watch.fail(error)
        return error

    def _then(self, inner: NcclWork, finalize: Callable[[], None], outputs: list[Any]) -> NcclWork:
        with device_lane(self._device.id).lock, self._issue:
            self._flush_lane(self._device.id)  # `inner` may be a lone send or receive
            self._watch.raise_if_failed(inner.description)
            # `finalize` holds the buffers it copies from: they live until the copies ran
            work = self._work(inner.description, outputs, [*(inner._keep or []), finalize])
            with self._device, self._stream:
                finalize()
                work._record(self._stream)
            self._watch.track([work])
            return work

    def _staged(self, array: Any, keep: list[Any]) -> Any:
        """A copy of `array` made on the group's stream, kept alive by `keep` (the Work's):
        the input of an operation whose output overlaps it in a way NCCL does not allow."""
        copy = self._cupy.empty(array.shape, array.dtype)
        self._copy(copy, array)
        keep.append(copy)
        return copy

    # -- the op set -----------------------------------------------------------------------------

    def _moved(self, array: Any) -> tuple[int, int]:
        """(NCCL type, count) that move `array` unchanged (bytes for types NCCL lacks)."""
        plan = nccl_types.movement(array.dtype)
        return getattr(self._nccl, plan.dtype), array.size * plan.factor

    def broadcast(self, array: Any, root: int, *, async_op: bool = False) -> Work:
        dt, count = self._moved(array)

        def launch(comm: Any, stream: int) -> None:
            if count:
                comm.broadcast(array.data.ptr, array.data.ptr, count, dt, root, stream)

        return self._issue_op(
            "broadcast",
            self._device_id(array, "broadcast"),
            launch,
            [array],
            [array],
            lambda: Signature.of("broadcast", array, root=root),
        )

    def _reduction(self, op: ReduceOp, array: Any, where: str) -> tuple[Any, int, Any, str]:
        """(NCCL type, elements per array element, NCCL op, post step) of a reduction,
        worked out once per dtype and op (a refused one raises each time)."""
        key = (array.dtype, op)
        found = self._plans.get(key)
        if found is None:
            plan = nccl_types.reduction(array.dtype, op, self._version, where, self.size)
            found = (
                getattr(self._nccl, plan.dtype),
                plan.factor,
                getattr(self._nccl, plan.op),
                plan.post,
            )
            self._plans[key] = found
        return found

    def _post(self, post: str, array: Any) -> None:
        """Finish a reduction on the group's stream: divide (AVG), keep the parity bit, or
        nothing ("")."""
        if not post:
            return
        with self._stream:
            if post == "divide":  # AVG on an NCCL without it: on the device
                average_into(array, self.size)
            else:  # "parity"
                bits = array.view(self._cupy.uint8)
                self._cupy.bitwise_and(bits, 1, out=bits)

    def all_reduce(self, array: Any, op: ReduceOp, *, async_op: bool = False) -> Work:
        dt, factor, nop, post = self._reduction(op, array, "all_reduce")
        count = array.size * factor

        def launch(comm: Any, stream: int) -> None:
            if count:
                comm.allReduce(array.data.ptr, array.data.ptr, count, dt, nop, stream)
                self._post(post, array)

        return self._issue_op(
            "all_reduce",
            self._device_id(array, "all_reduce"),
            launch,
            [array],
            [array],
            lambda: Signature.of("all_reduce", array, op),
        )

    def reduce(self, array: Any, root: int, op: ReduceOp, *, async_op: bool = False) -> Work:
        dt, factor, nop, post = self._reduction(op, array, "reduce")
        count = array.size * factor

        def launch(comm: Any, stream: int) -> None:
            if count:
                comm.reduce(array.data.ptr, array.data.ptr, count, dt, nop, root, stream)
                if self.rank == root:
                    self._post(post, array)

        return self._issue_op(
            "reduce",
            self._device_id(array, "reduce"),
            launch,
            [array],
            [array],
            lambda: Signature.of("reduce", array, op, root),
        )

    def all_gather(self, output: Any, input: Any, *, async_op: bool = False) -> Work:
        dt, count = self._moved(input)
        keep = [output, input]
        # NCCL's in-place form: the input is this rank's piece of the output
        at = output.data.ptr + self.rank * input.nbytes
        in_place = extent(input) == (at, at + input.nbytes)

        def launch(comm: Any, stream: int) -> None:
            if count:
                source = input
                if not in_place and extents_overlap(extent(input), extent(output)):
                    source = self._staged(input, keep)
                comm.allGather(source.data.ptr, output.data.ptr, count, dt, stream)

        return self._issue_op(
            "all_gather",
            self._device_id(input, "all_gather"),
            launch,
            [output],
            keep,
            lambda: Signature.of("all_gather", input),
        )

    def reduce_scatter(
        self, output: Any, input: Any, op: ReduceOp, *, async_op: bool = False
    ) -> Work:
        dt, factor, nop, post = self._reduction(op, output, "reduce_scatter")
        count = output.size * factor
        keep = [output, input]
        # NCCL's in-place form: the output is this rank's piece of the input
        at = input.data.ptr + self.rank * output.nbytes
        in_place = extent(output) == (at, at + output.nbytes)

        def launch(comm: Any, stream: int) -> None:
            if count:
                source = input
                if not in_place and extents_overlap(extent(input), extent(output)):
                    source = self._staged(input, keep)
                comm.reduceScatter(source.data.ptr, output.data.ptr, count, dt, nop, stream)
                self._post(post, output)

        return self._issue_op(
            "reduce_scatter",
            self._device_id(output, "reduce_scatter"),
            launch,
            [output],
            keep,
            lambda: Signature.of("reduce_scatter", output, op),
        )

    def _copy(self, dst: Any, src: Any) -> None:
        """Copy `src` into `dst` (same size) on the group's stream."""
        if dst.nbytes and dst.data.ptr != src.data.ptr:
            dst.data.copy_from_device_async(src.data, dst.nbytes, self._stream)

    def gather(self, output: Any | None, input: Any, root: int, *, async_op: bool = False) -> Work:
        m = input.size
        outputs = [output] if output is not None else []
        keep = [*outputs, input]

        def launch(comm: Any, stream: int) -> None:
            if self.rank != root:
                self._grouped_p2p(comm, [(root, input)], [], stream)
                return
            mine = output[root * m : (root + 1) * m]
            source = input
            whole = extent(input)
            if whole != extent(mine) and extents_overlap(whole, extent(output)):
                source = self._staged(input, keep)
            self._copy(mine, source)
            self._grouped_p2p(
                comm,
                [],
                [(p, output[p * m : (p + 1) * m]) for p in range(self.size) if p != root],
                stream,
            )

        return self._issue_op(
            "gather",
            self._device_id(input, "gather"),
            launch,
            outputs,
            keep,
            lambda: Signature.of("gather", input, root=root),
        )

    def scatter(self, output: Any, input: Any | None, root: int, *, async_op: bool = False) -> Work:
        m = output.size
        keep = [output] if input is None else [output, input]

        def launch(comm: Any, stream: int) -> None:
            if self.rank != root:
                self._grouped_p2p(comm, [], [(root, output)], stream)
                return
            source = input
            if extent(output) != extent(input[root * m : (root + 1) * m]) and extents_overlap(
                extent(input), extent(output)
            ):
                source = self._staged(input, keep)  # the copy below would overwrite a piece
            self._copy(output, source[root * m : (root + 1) * m])
            self._grouped_p2p(
                comm,
                [(p, source[p * m : (p + 1) * m]) for p in range(self.size) if p != root],
                [],
                stream,
            )

        return self._issue_op(
            "scatter",
            self._device_id(output, "scatter"),
            launch,
            [output],
            keep,
            lambda: Signature.of("scatter", output, root=root),
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
        me = self.rank
        if input_splits[me] != output_splits[me]:
            raise ValueError(
                f"all_to_all: this rank sends {input_splits[me]} elements to itself but "
                f"expects {output_splits[me]} from itself; input_split_sizes[{me}] and "
                f"output_split_sizes[{me}] must match"
            )
        in_at = [sum(input_splits[:p]) for p in range(self.size)]
        out_at = [sum(output_splits[:p]) for p in range(self.size)]

        def piece(array: Any, at: list[int], splits: Sequence[int], p: int) -> Any:
            return array[at[p] : at[p] + splits[p]]

        keep = [output, input]

        def launch(comm: Any, stream: int) -> None:
            source = input
            # sends and receives run concurrently
            if extents_overlap(extent(input), extent(output)):
                source = self._staged(input, keep)
            self._copy(
                piece(output, out_at, output_splits, me), piece(source, in_at, input_splits, me)
            )
            peers = [p for p in range(self.size) if p != me]
            self._grouped_p2p(
                comm,
                [(p, piece(source, in_at, input_splits, p)) for p in peers],
                [(p, piece(output, out_at, output_splits, p)) for p in peers],
                stream,
            )

        return self._issue_op(
            "all_to_all",
            self._device_id(input, "all_to_all"),
            launch,
            [output],
            keep,
            lambda: Signature.of("all_to_all", input, count=-1),
        )

    def send(self, array: Any, dst: int, tag: int) -> Work:
        dt, count = self._moved(array)
        return self._p2p("send", array, dst, dt, count)

    def recv(self, array: Any, src: int | None, tag: int) -> Work:
        if src is None:
            raise ValueError(
                "recv: NCCL cannot receive from any source; pass src (the sending rank)"
            )
        dt, count = self._moved(array)
        return self._p2p("recv", array, src, dt, count, source_rank=src)

    def barrier(self, *, async_op: bool = False) -> Work:
        return self.barrier_on(None, async_op=async_op)

    def barrier_on(self, device_id: int | None, *, async_op: bool = False) -> Work:
        """A barrier on GPU `device_id` (torch's `barrier(device_ids=[i])`), which is the
        device of the communicator when the group has one already; default:
        `distcomm.gpu.current_device()`."""
        if self._device is not None:
            device_id = self._device.id
        elif device_id is None:
            device_id = runtime.current_device()
        if self._barrier_buffer is None:
            with runtime.with_device(self._cupy.cuda.Device(device_id)):
                self._barrier_buffer = self._cupy.zeros(1, self._cupy.float32)
        buffer = self._barrier_buffer
        dt, op = self._nccl.NCCL_FLOAT32, self._nccl.NCCL_SUM

        def launch(comm: Any, stream: int) -> None:
            comm.allReduce(buffer.data.ptr, buffer.data.ptr, 1, dt, op, stream)

        return self._issue_op(
            "barrier",
            self._device_id(buffer, "barrier"),
            launch,
            [],
            [buffer],
            lambda: Signature.of("barrier"),
            host_wait=True,
        )
