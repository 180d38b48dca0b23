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

Watchdog (`nccl_watch.py`, with the Work; the backend owns one `NcclWatchdog` per group
and passes it what it watches): while operations are pending, a thread polls
their events (completing their futures), `check_async_error()` (a failed peer or
network error becomes `DistBackendError` and aborts the communicator instead of a
hang), the group timeout, and an abort notice other ranks leave in the store. After an
abort every operation of the group raises; destroy the group and create a new one.

Ops: all_reduce, broadcast, reduce, all_gather and reduce_scatter are NCCL collectives;
gather, scatter and all_to_all are grouped sends and receives (ncclGroupStart/End);
barrier is a one-element all_reduce. Point-to-point messages between two ranks are
matched in the order they were posted; tags are accepted and ignored (as with torch's
NCCL), and a receive must name its source. `batch_isend_irecv` runs as one NCCL group.
Dtypes and reductions NCCL lacks are mapped as `distcomm.gpu.nccl` describes.

Lone sends and receives: an ncclSend or ncclRecv outside an NCCL group blocks its stream
until the peer runs the matching call, so `isend(right); irecv(left)` rings and crossing
exchanges would deadlock if each were launched at once. A send or receive issued outside
`batch_isend_irecv` is therefore deferred and posted, with the device's other deferred
ones (of every group, in the order they were called; each group's run of them as one
NCCL group), at the first of: a use of one of their Works (wait, is_completed, result,
exception, the future's value or wait), any other operation on the device, a
`batch_isend_irecv` (its list spanning several groups flushes each), and the group's
destruction (posted, not dropped: a peer may wait for it). Messages between two ranks
still match in posting order; the group timeout counts from the posting. Within a posted
group a send whose array a receive before it wrote starts a new NCCL group (it sends what
was received), and a receive into an array an earlier send reads lands in a temporary
copied into it afterwards, so the deferred operations mean what they would have meant
one by one.

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
or destroyed with the group) and the DISTCOMM_DEBUG=DETAIL signature check are
`nccl_comm.NcclCommunicator`, a mixin of `NcclBackend`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import groupby
from typing import Any

from .. import config
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
from ..work import Future, Work
from .base import Backend, setup_round
from .engine.protocol import Signature
from .nccl_comm import NcclCommunicator
from .nccl_watch import NcclWatchdog, NcclWork

__all__ = ["NcclBackend", "NcclWork"]


class _Lane:
    """What every nccl group on one CUDA device of this process shares: the lock their
    operations are issued under, and the lone sends and receives not posted yet, in the
    order they were called (`_Deferred`)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.deferred: list[_Deferred] = []


_LANES: dict[int, _Lane] = {}
_LANES_LOCK = threading.Lock()


def _lane(device_id: int) -> _Lane:
    """The lane of CUDA device `device_id` (made on first use)."""
    lane = _LANES.get(device_id)  # one atomic read: lanes are never removed
    if lane is not None:
        return lane
    with _LANES_LOCK:
        lane = _LANES.get(device_id)
        if lane is None:
            lane = _LANES[device_id] = _Lane()
        return lane


class _PostingFuture(Future):
    """The future of a lone send or receive not posted yet: asking it anything (done,
    value, exception, a wait, `then`) posts it first; a done-callback does not."""

    __slots__ = ("_post",)

    def __init__(self, post: Callable[[], None]) -> None:
        super().__init__()
        self._post: Callable[[], None] | None = post

    def _posted(self) -> None:
        post = self._post
        if post is not None:
            post()

    def done(self) -> bool:
        self._posted()
        return super().done()

    def exception(self) -> BaseException | None:
        self._posted()
        return super().exception()

    def wait_done(self, timeout: float | None = None) -> bool:
        self._posted()
        return super().wait_done(timeout)

    def value(self) -> Any:
        self._posted()
        return super().value()

    def then(self, callback: Callable[[Future], Any]) -> Future:
        self._posted()
        return super().then(callback)


class _Deferred:
    """A lone send or receive (issued outside a coalesced batch), posted later as part of
    one NCCL group with the others (`NcclBackend._post_deferred`)."""

    __slots__ = ("array", "backend", "count", "dt", "kind", "peer", "work")

    def __init__(
        self, backend: NcclBackend, kind: str, array: Any, peer: int, dt: Any, count: int
    ) -> None:
        self.backend, self.kind, self.array, self.peer = backend, kind, array, peer
        self.dt, self.count = dt, count
        self.work: NcclWork | None = None

    def span(self) -> tuple[int, int]:
        return (self.array.data.ptr, self.array.nbytes) if self.count else (0, 0)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether the byte spans (address, size) `a` and `b` share a byte."""
    return a[1] > 0 and b[1] > 0 and a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


def _span(array: Any) -> tuple[int, int]:
    return (array.data.ptr, array.nbytes) if array is not None and array.nbytes else (0, 0)


class NcclBackend(NcclCommunicator, Backend):
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
        use it); a missing GPU is reported when the backend is made."""
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
        self._device_lane: _Lane | None = None  # what the groups on its GPU share
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

    def _lane(self, device_id: int, op: str) -> _Lane:
        """The lane of GPU `device_id`, once the group's communicator exists: it is made
        (or the device checked against its) first, outside the lane's lock (making it
        waits for every rank of the group)."""
        if self._comm is None or device_id != self._device.id:
            with self._issue:
                self._watch.raise_if_failed(self.describe(op))
                self._ensure(device_id, op)
        lane = self._device_lane
        if lane is None:  # the communicator's device, for the group's life
            lane = self._device_lane = _lane(device_id)
        return lane

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
        with _lane(self._device.id).lock, self._issue:
            self._flush_lane(self._device.id)  # `inner` may be a lone send or receive
            self._watch.raise_if_failed(inner.description)
            # `finalize` holds the buffers it copies from: they live until the copies ran
            work = self._work(inner.description, outputs, [*(inner._keep or []), finalize])
            with self._device, self._stream:
                finalize()
                work._record(self._stream)
            self._watch.track([work])
            return work

    @contextmanager
    def coalesce(self, array: Any) -> Iterator[None]:
        """Issue the operations posted inside as one NCCL group (ncclGroupStart/End); their
        Works complete together. `array` picks the device, as a first operation would.

        The device's lone sends and receives not posted yet are posted first, and no other
        group on the device issues anything until the batch is posted. Within the batch,
        a send whose array overlaps an earlier receive's is sent from a copy made before
        the batch, and a receive whose array overlaps an earlier send's or receive's lands
        in a temporary copied into it after the batch: every send reads the data as it was
        before the batch, and the receives are written in the order they were posted.
        """
        device_id = self._device_id(array, "batch_isend_irecv")
        with self._lane(device_id, "batch_isend_irecv").lock, self._issue:
            if self._grouped is not None:
                yield
                return
            self._flush_lane(device_id)
            self._watch.raise_if_failed(self.describe("batch_isend_irecv"))
            self._ensure(device_id, "batch_isend_irecv")
            with self._device:
                self._follow_caller()
                self._nccl.groupStart()
                self._grouped, self._batch, self._after = [], [], []
                try:
                    yield
                finally:
                    works, self._grouped = self._grouped, None
                    self._watch.launch_started(self.describe("batch_isend_irecv"))
                    try:
                        self._nccl.groupEnd()
                    except Exception as exc:
                        raise self._launch_failed(self.describe("batch_isend_irecv"), exc) from exc
                    finally:
                        self._watch.launch_ended()
                    self._copy_after_batch()
                    for work in works:
                        work._record(self._stream)
                    self._watch.track(works)

    # -- lone sends and receives, and NCCL groups of sends and receives ---------------------

    def _p2p(
        self, op: str, array: Any, peer: int, dt: Any, count: int, source_rank: int = -1
    ) -> NcclWork:
        """A send or receive: in an open coalesced batch, one more operation of its NCCL
        group; otherwise deferred, posted with the device's other lone ones as one NCCL
        group when something needs it (`_flush_lane`)."""
        device_id = self._device_id(array, op)
        entry = _Deferred(self, op, array, peer, dt, count)
        lane = self._lane(device_id, op)
        with lane.lock, self._issue:
            if self._grouped is not None:
                keep = [array]

                def launch(comm: Any, stream: int) -> None:
                    self._batch_op(comm, entry, stream, keep)

                return self._issue_op(op, device_id, launch, [array], keep, source_rank=source_rank)
            self._seq += 1
            description = self.describe(f"{op} #{self._seq}")
            self._watch.raise_if_failed(description)
            self._ensure(device_id, op)
            work = self._work(description, [array], [array], source_rank=source_rank)
            work._future = _PostingFuture(lambda: self._flush_lane(device_id))
            entry.work = work
            with self._device:
                # ordered after the caller's work so far, as it would be if posted now
                self._follow_caller()
            lane.deferred.append(entry)
            return work

    def flush(self) -> None:
        """Post the lone sends and receives not posted yet, this group's and those of the
        other groups on its device (`batch_isend_irecv` calls it for every group of a
        batch that spans several)."""
        device = self._device
        if device is not None:
            with _lane(device.id).lock:
                self._flush_lane(device.id)

    def _flush_lane(self, device_id: int) -> None:
        """Post every lone send and receive of device `device_id` not posted yet, in the
        order they were called: each run of one group's as NCCL groups (`_post_deferred`)."""
        lane = _lane(device_id)
        if not lane.deferred:  # the common case: nothing to post, no lock to take
            return
        with lane.lock:
            entries, lane.deferred = lane.deferred, []
            for entry in entries:  # asking their Works no longer posts anything
                entry.work._future._post = None
            for backend, run in groupby(entries, key=lambda e: e.backend):
                backend._post_deferred(list(run))

    def _post_deferred(self, entries: list[_Deferred]) -> None:
        """Post lone sends and receives of this group, in order, as few NCCL groups as keep
        their meaning: a send whose array overlaps an earlier receive's starts a new group
        (it sends what that receive wrote). A failure fails their Works, not the caller."""
        with self._issue:
            groups: list[list[_Deferred]] = []
            received: list[tuple[int, int]] = []
            for entry in entries:
                span = entry.span()
                if not groups or (
                    entry.kind == "send" and any(_overlap(span, r) for r in received)
                ):
                    groups.append([])
                    received = []
                groups[-1].append(entry)
                if entry.kind == "recv":
                    received.append(span)
            for at, group in enumerate(groups):
                error = self._post_group(group)
                if error is not None:
                    for entry in [e for g in groups[at:] for e in g]:
                        try:
                            entry.work.fail(error)
                        except RuntimeError:  # failed by the group's abort meanwhile
                            pass
                    return

    def _post_group(self, entries: list[_Deferred]) -> DistError | None:
        """Post `entries` as one NCCL group (a single one alone), then their events; the
        error if the group failed or NCCL refused them."""
        description = entries[0].work.description
        if len(entries) > 1:
            description += f" with {len(entries) - 1} more send(s)/recv(s)"
        try:
            self._watch.raise_if_failed(description)
        except DistError as exc:
            return exc
        works = [entry.work for entry in entries]
        posted = [entry for entry in entries if entry.count]
        with self._device:
            self._batch, self._after = [], []
            self._watch.launch_started(description)
            try:
                if len(posted) > 1:
                    self._nccl.groupStart()
                try:
                    for entry in posted:
                        self._batch_op(self._comm, entry, self._stream.ptr, entry.work._keep)
                finally:
                    if len(posted) > 1:
                        self._nccl.groupEnd()
            except Exception as exc:
                return self._launch_failed(description, exc)
            finally:
                self._watch.launch_ended()
            self._copy_after_batch()
            now = time.monotonic()
            for work in works:
                work._issued = now  # the group timeout counts from the posting
                work._record(self._stream)
            self._watch.track(works)
        return None

    def _batch_op(self, comm: Any, entry: _Deferred, stream: int, keep: list[Any]) -> None:
        """Post a send or receive of the NCCL group being posted (they run concurrently):
        a send whose array overlaps an earlier receive's goes from a copy made now; a
        receive whose array overlaps an earlier operation's lands in a temporary copied
        into it after the group (`_copy_after_batch`). The temporaries live in `keep`."""
        if not entry.count:
            return
        array, span = entry.array, entry.span()
        if entry.kind == "send":
            if any(kind == "recv" and _overlap(span, s) for kind, s in self._batch):
                array = self._staged(array, keep)
            comm.send(array.data.ptr, entry.count, entry.dt, entry.peer, stream)
        else:
            if any(_overlap(span, s) for _, s in self._batch):
                target, array = array, self._cupy.empty(array.shape, array.dtype)
                keep.append(array)
                self._after.append((target, array))
            comm.recv(array.data.ptr, entry.count, entry.dt, entry.peer, stream)
        self._batch.append((entry.kind, _span(array)))

    def _copy_after_batch(self) -> None:
        """Copy the temporaries of a group's overlapping receives into their arrays, in the
        order the receives were posted (on the group's stream, after the group)."""
        after, self._after, self._batch = self._after, [], []
        for target, temporary in after:
            self._copy(target, temporary)

    def _staged(self, array: Any, keep: list[Any]) -> Any:
        """A copy of `array` made on the group's stream, kept alive by `keep` (the Work's):
        the input of an operation whose output overlaps it in a way NCCL does not allow."""
        copy = self._cupy.empty(array.shape, array.dtype)
        self._copy(copy, array)
        keep.append(copy)
        return copy

    def shutdown(self) -> None:
        """Post the lone sends and receives not posted yet (a peer may wait for them), then
        release the communicator (`NcclCommunicator.shutdown`)."""
        device = self._device
        if device is not None:
            lane = _lane(device.id)
            with lane.lock:
                if any(entry.backend is self for entry in lane.deferred):
                    self._flush_lane(device.id)
        super().shutdown()

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
        in_place = _span(input) == (output.data.ptr + self.rank * input.nbytes, input.nbytes)

        def launch(comm: Any, stream: int) -> None:
            if count:
                source = input
                if not in_place and _overlap(_span(input), _span(output)):
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
        in_place = _span(output) == (input.data.ptr + self.rank * output.nbytes, output.nbytes)

        def launch(comm: Any, stream: int) -> None:
            if count:
                source = input
                if not in_place and _overlap(_span(input), _span(output)):
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

    def _grouped_p2p(
        self,
        comm: Any,
        sends: Sequence[tuple[int, Any]],
        recvs: Sequence[tuple[int, Any]],
        stream: int,
    ) -> None:
        """Post `sends` and `recvs` ((peer, array) pairs) as one NCCL group."""
        if not any(a.size for _, a in (*sends, *recvs)):
            return
        nccl = self._nccl
        nccl.groupStart()
        try:
            for peer, array in sends:
                if array.size:
                    dt, count = self._moved(array)
                    comm.send(array.data.ptr, count, dt, peer, stream)
            for peer, array in recvs:
                if array.size:
                    dt, count = self._moved(array)
                    comm.recv(array.data.ptr, count, dt, peer, stream)
        finally:
            nccl.groupEnd()

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
            if _span(input) != _span(mine) and _overlap(_span(input), _span(output)):
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
            if _span(output) != _span(input[root * m : (root + 1) * m]) and _overlap(
                _span(input), _span(output)
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
            if _overlap(_span(input), _span(output)):  # sends and receives run concurrently
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
