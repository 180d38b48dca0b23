"""The flight recorder: a ring of each group's last operations, and the per-rank dumps.

Every `ProcessGroup` owns a `Recorder` (`DISTCOMM_TRACE_BUFFER` entries, default 2,000;
0 turns it off). `distcomm.collectives` records each operation as it is issued
(`record`) and marks it completed or failed when its Work finishes (`settle`).
Collectives are numbered per group from 0 in issue order, so the same number on every
rank is the same collective; point-to-point operations carry the peer instead.

Its dumps (`dump`, on failure, at exit, on SIGTERM and SIGUSR1, on
`distcomm.dump_trace()`) are in `dumps.py`; their names are re-exported here.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

from .dumps import (
    FORMAT_VERSION,
    Groups,
    dump,
    dump_on_failure,
    dump_trace,
    install_signal_handlers,
    trace_file,
)

__all__ = [
    "FORMAT_VERSION",
    "Groups",
    "Recorder",
    "dump",
    "dump_on_failure",
    "dump_trace",
    "install_signal_handlers",
    "record_comm",
    "trace_file",
]

log = logging.getLogger(__name__)

QUEUED, STARTED, COMPLETED, FAILED = "queued", "started", "completed", "failed"

_clock = time.monotonic_ns


def _stack() -> str:
    return "".join(traceback.format_stack()[:-3])


_comm_name: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "distcomm_record_comm", default=None
)
#: how many record_comm blocks are open, in any thread: `record` reads the name only then
_open_names = 0
_names_lock = threading.Lock()


@contextlib.contextmanager
def record_comm(name: str) -> Iterator[None]:
    """Name the operations issued inside the block (torch.distributed.record_comm): the
    flight recorder's dumps give each one's `profiling_name`, e.g. "FSDP::all_gather"."""
    global _open_names
    if not isinstance(name, str):
        raise TypeError(f"record_comm: name must be a str, got {name!r}")
    token = _comm_name.set(name)
    with _names_lock:
        _open_names += 1
    try:
        yield
    finally:
        with _names_lock:
            _open_names -= 1
        _comm_name.reset(token)


class _NoArray:
    """What a barrier records in place of an array."""

    dtype = None
    size = 0


NO_ARRAY = _NoArray()


class Recorder:
    """A ring of a group's last `size` collectives, and one of its last `size` sends and
    receives (none when `size` is 0).

    A collective's id is its sequence number in the group; a send or receive gets a
    negative id. Each slot holds one tuple (id, op, dtype, count, root or peer, reduce
    op, start time) written when the operation is issued; `done[slot]` becomes its id
    when it completes (one list write on every operation's path, no clock read; a reused
    slot needs no reset). End times (monotonic clock) are kept where they cost nothing
    on that path: exact for an operation settled by `settle` (asynchronous ones,
    failures), else when `oldest_running` (the stall inspector's tick) first saw it
    completed; a time older than the slot's start belongs to an earlier occupant.
    Failures keep their message aside, by id. `record` returns the id, which `settle`
    takes.

    Every operation pays `record`, so it tests nothing: `Recorder.create` picks this
    class or a subclass that does more (`StackRecorder`) or nothing (`OffRecorder`).

    Args:
        size: how many entries to keep (DISTCOMM_TRACE_BUFFER), at least 1 (else
            ValueError: a recorder that is off is `Recorder.create(0)`).
        stack: accepted for `create`'s signature; `StackRecorder` keeps the stacks.
    """

    __slots__ = (
        "_ends",
        "_errors",
        "_ids",
        "_issued",
        "_names",
        "_ops",
        "_p2p_done",
        "_p2p_ends",
        "_p2p_ids",
        "_p2p_issued",
        "_p2p_ops",
        "_stacks",
        "done",
        "size",
    )

    def __init__(self, size: int, stack: bool = False) -> None:
        del stack  # the class says it (`create`)
        if type(self) is not OffRecorder and (
            isinstance(size, bool) or not isinstance(size, int) or size < 1
        ):
            raise ValueError(
                f"Recorder: size must be an int of at least 1, got {size!r}; "
                "Recorder.create(0) makes one that records nothing"
            )
        self.size = size
        self._ops: list[tuple[Any, ...] | None] = [None] * size
        #: the id of each slot's collective once it completed (ids are >= 0)
        self.done = [-1] * size
        self._ends = [0] * size
        self._p2p_ops: list[tuple[Any, ...] | None] = [None] * size
        self._p2p_done = [0] * size  # the ids of sends and receives are <= -1
        self._p2p_ends = [0] * size
        self._stacks: dict[int, str] = {}  # id -> stack, with `stack` only
        self._names: dict[int, str] = {}  # id -> record_comm's name, inside its blocks
        self._errors: dict[int, str] = {}  # id -> message
        self._ids = itertools.count()  # next() is atomic under the GIL
        self._p2p_ids = itertools.count()
        #: how many ids were handed out (a thread racing another may leave it one short
        #: until its next record; readers already allow for an id not yet written)
        self._issued = 0
        self._p2p_issued = 0

    @classmethod
    def create(cls, size: int, stack: bool = False) -> Recorder:
        """The recorder for a group: `OffRecorder` when `size` is 0 or less
        (DISTCOMM_TRACE_BUFFER=0, or a rank outside the group), `StackRecorder` with
        `stack` (DISTCOMM_DEBUG=DETAIL), else a `Recorder`."""
        if size <= 0:
            return OffRecorder(0)
        return StackRecorder(size) if stack else Recorder(size)

    def record(self, op: str, array: Any, root: int = -1, reduce_op: Any = None) -> int | None:
        """Note a collective as issued (`root`: a group rank; `array`: NO_ARRAY for a
        barrier); its id, the group's sequence number, or None when the recorder is off."""
        i = next(self._ids)
        self._issued = i + 1
        self._ops[i % self.size] = (i, op, array.dtype, array.size, root, reduce_op, _clock())
        if _open_names:
            self._keep_name(i)
        return i

    def record_p2p(self, op: str, array: Any, peer: int) -> int | None:
        """Note a send or receive as issued (`peer`: a group rank, -1 for any); its id."""
        k = next(self._p2p_ids)
        self._p2p_issued = k + 1
        i = -1 - k
        self._p2p_ops[k % self.size] = (i, op, array.dtype, array.size, peer, None, _clock())
        if _open_names:
            self._keep_name(i)
        return i

    def _keep_name(self, i: int) -> None:
        name = _comm_name.get()
        if name is None:  # a block is open in another thread or context
            return
        self._names[i] = name
        if len(self._names) > 2 * self.size:
            for old in sorted(self._names, key=abs)[: self.size]:
                del self._names[old]

    def _keep_stack(self, i: int) -> None:
        self._stacks[i] = _stack()
        if len(self._stacks) > 2 * self.size:
            for old in sorted(self._stacks, key=abs)[: self.size]:
                del self._stacks[old]

    def _ring(self, p2p: bool) -> tuple[list[Any], list[int], list[int]]:
        """(ops, done, end times) of the collectives or of the sends and receives."""
        if p2p:
            return self._p2p_ops, self._p2p_done, self._p2p_ends
        return self._ops, self.done, self._ends

    def settle(self, i: int | None, error: BaseException | None = None) -> None:
        """Mark operation `i` completed, or failed with `error` (which may dump)."""
        size = self.size
        if i is None or not size:
            return
        ops, done, ends = self._ring(i < 0)
        slot = (-1 - i) % size if i < 0 else i % size
        op = ops[slot]
        if op is None or op[0] != i:  # the slot was reused meanwhile
            return
        ends[slot] = _clock()
        if error is not None:
            self._errors[i] = f"{type(error).__name__}: {error}"
            if len(self._errors) > 2 * size:
                for old in sorted(self._errors, key=abs)[:size]:
                    del self._errors[old]
        done[slot] = i
        if error is not None:
            dump_on_failure(error)

    def finish(
        self, i: int | None, work: Any, async_op: bool, outputs: list[Any] | None = None
    ) -> Any:
        """Wait for `work` unless `async_op`, and settle its entry `i` either way; returns
        `work` for an asynchronous call, else None (the public functions return this).

        A synchronous operation that succeeded is marked completed without an end time
        (one write to the ring: every op's path; `oldest_running` gives it an end time
        later). `outputs`: the caller's arrays, which `work.result()` returns, where the
        backend saw flat views of them.
        """
        if async_op:
            if outputs is not None:
                work.set_outputs(outputs)
            self.settle_later(i, work)
            return work
        try:
            work.wait()
        except BaseException as exc:
            self.settle(i, exc)
            raise
        if i is not None:
            if work.finished_on_wait:
                self.done[i % self.size] = i
            else:  # the op may still run on the device: settled when it completes there
                if outputs is not None:
                    work.set_outputs(outputs)
                self.settle_later(i, work)
        return None

    def settle_later(self, i: int | None, work: Any) -> None:
        """Settle operation `i` when the (asynchronous) `work` finishes."""
        if i is None:
            return
        work.get_future().add_done_callback(lambda future: self.settle(i, future.exception()))
        # a Work.wait(timeout) that expires raises before the abort fails the work: settle
        # (and dump) when it expires, so the trace is written before the raise
        work.add_timeout_callback(lambda error: self.settle(i, error))

    # -- reading the rings (another thread may be recording) -----------------------------

    def issued(self, p2p: bool = False) -> int:
        """How many collectives (or sends and receives) were recorded so far."""
        return self._p2p_issued if p2p else self._issued

    def oldest_running(self, cursor: int, p2p: bool, now: int) -> tuple[Any, int]:
        """(the oldest operation still running numbered `cursor` or later, or None; the
        cursor to pass next time). Operations it passes that completed with no end time
        get `now` (monotonic ns) as theirs.
        """
        ops, done, ends = self._ring(p2p)
        size = self.size
        issued = self.issued(p2p)
        cursor = max(cursor, issued - size)
        while cursor < issued:
            slot = cursor % size
            op = ops[slot]
            if op is None:
                break
            k = op[0] if op[0] >= 0 else -1 - op[0]
            if k < cursor:  # numbered but not yet written
                break
            if k > cursor:  # overwritten by a newer one
                cursor = k - size + 1
                continue
            if done[slot] != op[0]:
                return op, cursor
            if ends[slot] < op[6]:
                ends[slot] = now
            cursor += 1
        return None, cursor

    def newest(self, p2p: bool = False) -> tuple[Any, bool, int | None] | None:
        """(op tuple, running, end time or None) of the newest collective (or send or
        receive), or None when there is none yet."""
        ops, done, ends = self._ring(p2p)
        issued = self.issued(p2p)
        for k in (issued - 1, issued - 2):  # the newest may be numbered but not yet written
            if k < 0:
                return None
            slot = k % self.size
            op = ops[slot]
            if op is not None and (op[0] if op[0] >= 0 else -1 - op[0]) == k:
                finished = done[slot] == op[0]
                end = ends[slot] if finished and ends[slot] >= op[6] else None
                return op, not finished, end
        return None

    def _slots(self) -> list[tuple[tuple[Any, ...], bool, int | None]]:
        """(op tuple, completed, end time or None) of every recorded operation."""
        out = []
        for p2p in (False, True):
            ops, done, ends = (list(part) for part in self._ring(p2p))
            for slot, op in enumerate(ops):
                if op is not None:
                    finished = done[slot] == op[0]
                    end = ends[slot] if finished and ends[slot] >= op[6] else None
                    out.append((op, finished, end))
        return out

    def as_dicts(self, ranks: list[int]) -> list[dict[str, Any]]:
        """The entries in the rings, oldest first, as JSON data; roots and peers as global
        ranks (`ranks`: the group's); times as wall-clock ns."""
        to_wall = time.time_ns() - _clock()
        errors, stacks, names = dict(self._errors), dict(self._stacks), dict(self._names)
        out = []
        slots = self._slots()
        # a backend runs a group's collectives in order (and its sends and receives): the
        # oldest unfinished one of each kind is running, those after it wait their turn
        running_ids = [op[0] for op, finished, _ in slots if not finished]
        started = {
            pick(ids)  # a send or receive's id is -1 - its number: the oldest is the largest
            for ids, pick in (
                ([i for i in running_ids if i >= 0], min),
                ([i for i in running_ids if i < 0], max),
            )
            if ids
        }
        for op, finished, end in sorted(slots, key=lambda item: (item[0][6], item[0][0])):
            i, name, dtype, count, rank, reduce_op, start = op
            error = errors.get(i) if finished else None
            peer = i < 0
            running = STARTED if i in started else QUEUED
            out.append(
                {
                    "id": i,
                    "seq": None if peer else i,
                    "op": name,
                    "profiling_name": names.get(i),
                    "dtype": None if dtype is None else str(dtype),
                    "count": count,
                    "root": None if peer or not 0 <= rank < len(ranks) else ranks[rank],
                    "reduce_op": None if reduce_op is None else str(reduce_op),
                    "peer": ranks[rank] if peer and 0 <= rank < len(ranks) else None,
                    "state": running if not finished else FAILED if error else COMPLETED,
                    "start_ns": start + to_wall,
                    "end_ns": None if end is None else end + to_wall,
                    "error": error,
                    "stack": stacks.get(i),
                }
            )
        return out

    def unfinished(self) -> bool:
        """Whether an operation in the rings is still running or failed."""
        return bool(self._errors) or any(not finished for _, finished, _ in self._slots())


class OffRecorder(Recorder):
    """The recorder switched off (DISTCOMM_TRACE_BUFFER=0): records nothing."""

    __slots__ = ()

    def record(self, op: str, array: Any, root: int = -1, reduce_op: Any = None) -> None:
        return None

    def record_p2p(self, op: str, array: Any, peer: int) -> None:
        return None


class StackRecorder(Recorder):
    """The recorder that also keeps each call's Python stack (DISTCOMM_DEBUG=DETAIL)."""

    __slots__ = ()

    def record(self, op: str, array: Any, root: int = -1, reduce_op: Any = None) -> int | None:
        i = Recorder.record(self, op, array, root, reduce_op)
        self._keep_stack(i)
        return i

    def record_p2p(self, op: str, array: Any, peer: int) -> int | None:
        i = Recorder.record_p2p(self, op, array, peer)
        self._keep_stack(i)
        return i
