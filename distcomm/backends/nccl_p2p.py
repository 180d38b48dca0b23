"""The nccl backend's sends and receives: lone ones deferred and posted together, batches.

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

Lanes: every nccl group of a process on one GPU shares that GPU's lane, the lock its
operations are issued under (so threads cannot interleave NCCL launches of different
groups, and a coalesced batch reaches the GPU whole) and its list of lone sends and
receives not posted yet.

`NcclPointToPoint` is a mixin of `nccl.NcclBackend`: it uses the backend's communicator
(`_comm`, `_device`, `_stream`, `_ensure`), its issue lock and watchdog, and its
operation helpers (`_issue_op`, `_work`, `_follow_caller`, `_launch_failed`, `_copy`,
`_staged`, `_device_id`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import groupby
from typing import Any

from ..arrays import extent, extents_overlap
from ..errors import DistError
from .nccl_watch import NcclWatchdog
from .nccl_work import NcclWork

__all__ = ["Lane", "NcclPointToPoint", "device_lane"]


class Lane:
    """What every nccl group on one CUDA device of this process shares: the lock their
    operations are issued under, and the lone sends and receives not posted yet, in the
    order they were called (`_Deferred`)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.deferred: list[_Deferred] = []


_LANES: dict[int, Lane] = {}
_LANES_LOCK = threading.Lock()


def device_lane(device_id: int) -> Lane:
    """The lane of CUDA device `device_id` (made on first use)."""
    lane = _LANES.get(device_id)  # one atomic read: lanes are never removed
    if lane is not None:
        return lane
    with _LANES_LOCK:
        lane = _LANES.get(device_id)
        if lane is None:
            lane = _LANES[device_id] = Lane()
        return lane


class _Deferred:
    """A lone send or receive (issued outside a coalesced batch), posted later as part of
    one NCCL group with the others (`NcclBackend._post_deferred`)."""

    __slots__ = ("array", "backend", "count", "dt", "kind", "peer", "work")

    def __init__(
        self, backend: NcclPointToPoint, kind: str, array: Any, peer: int, dt: Any, count: int
    ) -> None:
        self.backend, self.kind, self.array, self.peer = backend, kind, array, peer
        self.dt, self.count = dt, count
        self.work: NcclWork | None = None


class NcclPointToPoint:
    """Sends, receives and their batches of an nccl group (a mixin of `NcclBackend`)."""

    _issue: threading.RLock
    _watch: NcclWatchdog
    _nccl: Any
    _cupy: Any
    _comm: Any
    _device: Any
    _stream: Any
    _seq: int
    _grouped: list[NcclWork] | None
    _batch: list[tuple[str, tuple[int, int]]]
    _after: list[tuple[Any, Any]]
    _device_lane: Lane | None

    def _lane(self, device_id: int, op: str) -> Lane:
        """The lane of GPU `device_id`, once the group's communicator exists: it is made
        (or the device checked against its) first, outside the lane's lock (making it
        waits for every rank of the group)."""
        if self._comm is None or device_id != self._device.id:
            with self._issue:
                self._watch.raise_if_failed(self.describe(op))
                self._ensure(device_id, op)
        lane = self._device_lane
        if lane is None:  # the communicator's device, for the group's life
            lane = self._device_lane = device_lane(device_id)
        return lane

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
            work.defer(lambda: self._flush_lane(device_id))
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
            with device_lane(device.id).lock:
                self._flush_lane(device.id)

    def _flush_lane(self, device_id: int) -> None:
        """Post every lone send and receive of device `device_id` not posted yet, in the
        order they were called: each run of one group's as NCCL groups (`_post_deferred`)."""
        lane = device_lane(device_id)
        if not lane.deferred:  # the common case: nothing to post, no lock to take
            return
        with lane.lock:
            entries, lane.deferred = lane.deferred, []
            for entry in entries:  # asking their Works no longer posts anything
                entry.work.undefer()
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
                span = extent(entry.array)
                relays = entry.kind == "send" and any(extents_overlap(span, r) for r in received)
                if not groups or relays:
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
        array, span = entry.array, extent(entry.array)
        if entry.kind == "send":
            if any(kind == "recv" and extents_overlap(span, s) for kind, s in self._batch):
                array = self._staged(array, keep)
            comm.send(array.data.ptr, entry.count, entry.dt, entry.peer, stream)
        else:
            if any(extents_overlap(span, s) for _, s in self._batch):
                target, array = array, self._cupy.empty(array.shape, array.dtype)
                keep.append(array)
                self._after.append((target, array))
            comm.recv(array.data.ptr, entry.count, entry.dt, entry.peer, stream)
        self._batch.append((entry.kind, extent(array)))

    def _copy_after_batch(self) -> None:
        """Copy the temporaries of a group's overlapping receives into their arrays, in the
        order the receives were posted (on the group's stream, after the group)."""
        after, self._after, self._batch = self._after, [], []
        for target, temporary in after:
            self._copy(target, temporary)

    def shutdown(self) -> None:
        """Post the lone sends and receives not posted yet (a peer may wait for them), then
        release the communicator (`NcclCommunicator.shutdown`)."""
        device = self._device
        if device is not None:
            lane = device_lane(device.id)
            with lane.lock:
                if any(entry.backend is self for entry in lane.deferred):
                    self._flush_lane(device.id)
        super().shutdown()

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
