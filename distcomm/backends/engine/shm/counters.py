"""The counters of a host's ranks in their shared segment, and waiting on them.

The segment's control area, in front of the collectives' slots: one sleep flag byte per
rank (in whole 64-byte lines), one line for the group (its first word is the abandon
mark), then 128 bytes of counters per rank: its arrival counter and the word that says
it left the group on one line, its reduced and completion counters on the next. A
counter holds the number of the last collective its rank reached that point of, plus
one, modulo 2**31, and has a single writer, its rank (the abandon mark may be written by
any rank, always with the same meaning).

A waiting rank polls without system calls while the host's ranks have a core each,
yields the CPU when they do not, and then sleeps on the futex; a rank wakes sleepers
only when one has said it sleeps (see `primitives`). A wait ends early when the group
fails (the watch, the TCP mailbox, says so), when the peer it waits for left the group,
or when a rank gave up on the group (the abandon mark: see `Counters.abandon`), and
never lasts past the collective's deadline.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ....errors import (
    DistBackendError,
    DistError,
    DistNetworkError,
    DistTimeoutError,
    GroupDestroyedError,
    caused_by_peers,
)
from ..protocol import Call, Failure
from .primitives import Segment, futex_wait, futex_wake, store_load_fence

__all__ = ["Counters", "FailureWatch"]

_MOD, _HALF = 1 << 31, 1 << 30  # counters are 31-bit and compared modulo
_STRIDE = 128  # bytes per rank of counters: arrival and completion on separate lines
_LEFT = 1  # the word after a rank's arrival counter: 1 once it has left the group
#: the words of a rank's counters after its arrival counter: its completion counter and,
#: on the same line, the one it raises once its slice of a reduction is reduced
_FINISH, _REDUCED = 16, 20
_GROUP_LINE = 64  # one line after the sleep flags: word 0 is the abandon mark
_POLLS = 200  # reads of a counter before yielding, when every local rank has a core
_SPINS = 40  # sched_yield rounds before sleeping on the futex
_SLICE = 0.25  # longest single futex sleep (failures wake sooner)
#: how long a collective that finds the segment marked waits to hear why (the marking rank
#: sends the group's failure at once; without it the error only says the group was given up)
_CAUSE_GRACE_S = 5.0


def _reached(value: int, target: int) -> bool:
    return (value - target) % _MOD < _HALF


def _ctrl_bytes(size: int) -> int:
    """The sleep flags: one byte per rank, in whole 64-byte lines."""
    return max(1, -(-size // 64)) * 64


class FailureWatch(Protocol):
    """What stops a wait early: the group failed, or a peer left it (the TCP mailbox)."""

    def failed(self, rank: int) -> Failure | None:
        """Why the group, or group rank `rank`, cannot take part any more; None if it can."""

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call `callback()` (from any thread) whenever a failure is recorded."""

    def note_late(self, seq: int, ranks: tuple[int, ...]) -> None:
        """Record the group ranks a diagnosis of collective `seq` found late (a
        `Work.wait` timeout names them in `peer_ranks`)."""


class Counters:
    """This host's ranks' counters in `segment`, and this rank's waits on them.

    Args:
        segment: the host's shared segment (the control area is at its start).
        rank, size: this rank's index among the host's ranks, and their number.
        names: the group ranks of the host's ranks (for messages and `peer_ranks`).
        watch: reports the group's failures; they interrupt waits and mark the segment.
    """

    def __init__(
        self, segment: Segment, rank: int, size: int, names: list[int], watch: FailureWatch
    ) -> None:
        self.rank, self.size, self.names = rank, size, names
        self._segment, self._watch = segment, watch
        ctrl = _ctrl_bytes(size)
        self._mem = memoryview(segment.bytes)[: self.area_bytes(size)]
        self.words = self._mem.cast("i")
        self.flags = self._mem[:ctrl]  # byte r: rank r may sleep on a futex
        self.flag_words = self.flags.cast("q")
        self.abandon_at = ctrl // 4  # the group line's first word
        #: the word indices of each rank's counters
        self.arrive_at = [self.word(r, "arrive") for r in range(size)]
        self.reduced_at = [self.word(r, "reduced") for r in range(size)]
        self.finish_at = [self.word(r, "finish") for r in range(size)]
        self.left_at = [self.word(r, "arrive") + _LEFT for r in range(size)]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self._polls = _POLLS if size <= cores else 0  # never poll on a shared core
        self._waiting = 0
        self._closed = False
        self._mark_lock = threading.Lock()  # marking from a listener vs. releasing views
        watch.add_listener(self.interrupt)

    @staticmethod
    def area_bytes(size: int) -> int:
        """Bytes of the control area for `size` ranks."""
        return _ctrl_bytes(size) + _GROUP_LINE + size * _STRIDE

    def interrupt(self) -> None:
        """The watch recorded a failure: mark the segment if the group failed (not when a
        peer merely left, nor when this rank destroys the group), and wake this rank's
        waiter."""
        failure = self._watch.failed(self.names[self.rank])
        if failure is not None and not issubclass(failure.kind, GroupDestroyedError):
            self.abandon()
        address = self._waiting
        if address:
            futex_wake(address)

    def abandon(self) -> None:
        """Mark the segment: this rank gave up on the group, so no rank may complete a
        collective on it any more. Called before the caller of the collective this rank
        gave up gets its arrays back (a wait that raises, the group's abort listener);
        every rank reads the mark after each wait and after its last read of a peer's
        memory (`settle`). Idempotent; wakes the peers that sleep."""
        with self._mark_lock:
            if self._closed or self.words[self.abandon_at]:
                return
            self.words[self.abandon_at] = self.names[self.rank] + 1
            store_load_fence()
            if any(self.flag_words):
                for index in (*self.arrive_at, *self.reduced_at, *self.finish_at):
                    futex_wake(self._segment.address + 4 * index)

    def abandoned(self, call: Call) -> DistError:
        """The error of a collective that finds the segment marked (`abandon`): the
        group's failure as this rank's watch hears of it (the rank that marked the
        segment passes it on at once, with its cause), or, if nothing comes within
        `_CAUSE_GRACE_S`, that the group was given up."""
        end = time.monotonic() + _CAUSE_GRACE_S
        while True:
            failure = self._watch.failed(self.names[self.rank])
            if failure is not None and not issubclass(failure.kind, GroupDestroyedError):
                return failure.error(f"{call.describe}: ")
            if time.monotonic() >= end:
                break
            time.sleep(0.01)
        marked = int(self.words[self.abandon_at]) - 1
        who = "this rank" if marked == self.names[self.rank] else f"rank {marked}"
        return DistBackendError(
            f"{call.describe}: the group was given up while this rank took part in it "
            f"({who} timed out, aborted the group or lost a peer); this rank's part is "
            "discarded and its arrays hold no valid result. Re-form the group without the "
            "lost ranks (reconfigure, distcomm.recovery.Manager) or destroy it"
        )

    def settle(self, call: Call) -> None:
        """The last step of every collective, after this rank's last read of a peer's
        memory: fail if a rank gave up on the group meanwhile (see `abandon`)."""
        if self.words[self.abandon_at]:
            raise self.abandoned(call)

    def set(self, index: int, value: int) -> None:
        """Raise this rank's counter `index` to `value`; wake the peers that may sleep."""
        self.words[index] = value % _MOD
        store_load_fence()  # the counter is visible before the flags are read
        if any(self.flag_words):
            futex_wake(self._segment.address + 4 * index)

    def wait(self, call: Call, index: int, target: int, peer: int, what: str) -> None:
        words, goal = self.words, target % _MOD
        address = self._segment.address + 4 * index
        polls, spins = self._polls, 0
        while True:
            value = words[index]
            if _reached(value, goal):
                if words[self.abandon_at]:  # the peer got here before a rank gave up
                    raise self.abandoned(call)
                return
            if polls:  # no system call while the peer runs on a core of its own
                polls -= 1
                continue
            if spins < _SPINS:
                spins += 1
                os.sched_yield()
                continue
            # `peer` counts this host's ranks; the watch knows the group's
            failure = self._watch.failed(self.names[peer])
            if failure is None and words[self.left_at[peer]]:
                name = self.names[peer]
                failure = Failure(
                    DistNetworkError,
                    f"rank {name} has left the group (destroy_process_group or exit)",
                    (name,),
                )
            if failure is not None:
                self.abandon()
                raise failure.error(f"{call.describe}: ")
            if words[self.abandon_at]:
                raise self.abandoned(call)
            left = call.deadline.remaining()
            if left is not None and left <= 0:
                late, why = self.lagging(target, what)
                if call.explain is not None:  # a step of a collective across hosts:
                    why, late = call.explain(), []  # the runner names the late ranks
                self.abandon()  # before the caller has its arrays back
                error = DistTimeoutError(
                    f"{call.describe} timed out after {call.deadline.seconds:.1f} s: "
                    f"{why or 'the peers did not wake this rank'}"
                )
                raise caused_by_peers(error, late) if late else error
            self._waiting = address
            self.flags[self.rank] = 1
            store_load_fence()  # the flag is visible before the kernel reads the counter
            try:
                futex_wait(address, value, _SLICE if left is None else min(left, _SLICE))
            finally:
                self.flags[self.rank] = 0
                self._waiting = 0

    def lagging(self, target: int, what: str) -> tuple[list[int], str]:
        """The peers that have not reached counter value `target`, as group ranks, and
        what they have not done (in the TCP diagnosis's words)."""
        at = {"arrive": self.arrive_at, "reduced": self.reduced_at, "finish": self.finish_at}
        value = {p: int(self.words[at[what][p]]) for p in range(self.size) if p != self.rank}
        late = [p for p, v in value.items() if not _reached(v, target % _MOD)]
        if not late:
            return [], ""
        names = [self.names[p] for p in late]
        ranks = ", ".join(map(str, names))
        if what != "arrive":
            done = "finished" if what == "finish" else "reduced"
            return names, (
                f"rank(s) {ranks} have not {done} their part of collective #{target - 1}"
            )
        where = "; ".join(
            f"rank {self.names[p]} is at collective #{value[p] - 1}"
            if value[p]
            else f"rank {self.names[p]} has run no collective yet"
            for p in late
        )
        return names, f"rank(s) {ranks} have not called collective #{target - 1} ({where})"

    def word(self, rank: int, what: str) -> int:
        """Index of `rank`'s arrival, reduced or completion counter among the int32 words."""
        extra = _FINISH if what == "finish" else _REDUCED if what == "reduced" else 0
        return (_ctrl_bytes(self.size) + _GROUP_LINE + rank * _STRIDE) // 4 + extra

    def diagnose(self, seq: int) -> str:
        """Why collective `seq` has not completed: the peers that have not reached it
        (noted with the watch, which names them in a `Work.wait` timeout's error)."""
        for what in ("arrive", "reduced", "finish"):
            late, why = self.lagging(seq + 1, what)
            if late:
                self._watch.note_late(seq, tuple(late))
                return why
        return "every rank has finished it"

    def leave(self) -> None:
        """Say in the segment that this rank left the group (peers waiting for it fail
        at once, naming it), and wake them."""
        left = self.left_at[self.rank]
        self.words[left] = 1
        store_load_fence()
        mine = (self.arrive_at, self.reduced_at, self.finish_at)
        for index in (left, *(counter[self.rank] for counter in mine)):
            futex_wake(self._segment.address + 4 * index)

    def release(self) -> None:
        """Let go of the views of the segment (they keep it mapped)."""
        with self._mark_lock:
            self._closed = True
            for view in (self.flag_words, self.flags, self.words, self._mem):
                view.release()
