"""The nccl backend's supervision: the watchdog, failures and aborts.

`NcclWork` (nccl_work.py) completes on a CUDA event. `NcclWatchdog` watches a group's
operations after they were issued: it tracks pending Works, runs the watchdog thread
(events, the group timeout, NCCL calls that block the host, `check_async_error`, other
ranks' abort notices), and fails the group (ncclCommAbort, every pending Work failed, a
notice in the store). `NcclBackend` owns one per group and hands it everything it uses:
the store, rank, timeout and `describe` when it is made, the communicator and its device
when `start()` is called, once the communicator exists. It knows nothing else of the
backend.

Where real CuPy and NCCL differ from what their names suggest: an event's status is read
with `cudaEventQuery` (CuPy's `Event.done` stays False after a sticky CUDA error instead
of raising); the abort waits for an NCCL call in progress to return (CuPy's
communicators are blocking, and NCCL forbids aborting those while a call is inside them;
nccl4py's non-blocking ones are aborted at once); events are queried and waited on with
the group's device current, switching a thread's device only where that binds no new
CUDA context (CUDA 12's cudaSetDevice makes one); and the arrays of failed operations
outlive the abort until the group's stream has run what is queued behind them.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ..deadline import Deadline
from ..errors import (
    DistBackendError,
    DistError,
    DistTimeoutError,
    GroupDestroyedError,
    caused_by_peers,
)
from ..gpu import runtime
from ..store.base import Store
from .engine.protocol import blamed_message
from .nccl_work import _CUDA_NOT_READY, _POLL_MOST, _WATCH_FIRST, _WATCH_MOST, NcclWork

__all__ = ["NcclWatchdog"]

log = logging.getLogger("distcomm.backends.nccl")

#: how long the watchdog, woken by a first operation, lets more be issued before it looks:
#: ops issued back to back then share one look (each look takes the GIL from the thread
#: issuing them); what waits on the watchdog (future callbacks) learns of completion later
_WAKE_GRACE = 0.002
#: pending work older than this makes the watchdog look for other ranks' abort notices
_NOTICE_AFTER = 1.0
_ABORT_KEY = "abort"
#: "who waits in an operation?": a rank whose operation timed out asks, the others answer
_QUERY_KEY = "waiting"
#: how long it waits for answers: past the answering watchdogs' period (_NOTICE_AFTER)
_ASK_S = 2.5 * _NOTICE_AFTER
_UNBOUNDED = Deadline(None)  # the watchdog's naps have no end of their own
#: how long destroying a failed group waits for its stream to run what an abort left
_SETTLE_S = 10.0

#: the watchdogs whose communicator is not released yet: released at interpreter exit,
#: before CuPy's garbage collection would run ncclCommDestroy, a collective, on them
_live: weakref.WeakSet[NcclWatchdog] = weakref.WeakSet()
#: arrays the GPU may still touch after a failed group was destroyed (its stream did not
#: finish in time): kept for the life of the process rather than handed back to CuPy
_stranded: list[Any] = []


def _release_at_exit() -> None:
    """Abort the communicators of groups never destroyed, at interpreter exit: CuPy's
    NcclCommunicator would otherwise call ncclCommDestroy when collected, which waits for
    every rank of the node to do the same (a hang when one has exited or aborted)."""
    for watch in list(_live):
        watch.release()


atexit.register(_release_at_exit)


def _notice(rank: int, error: DistError) -> str:
    """The abort notice rank `rank` leaves in the group's store for `error`: the rank, the
    ranks it blames (`peer_ranks`: a timeout's silent ranks; "-" for none) and the error,
    separated by "|" (`_read_notice`)."""
    peers = error.peer_ranks
    blamed = "-" if peers is None else ",".join(map(str, peers))
    return f"{rank}|{blamed}|{error}"


def _read_notice(value: str) -> tuple[int | None, tuple[int, ...] | None, str]:
    """(origin, blamed ranks or None, reason) of an abort notice (`_notice`); a notice of
    another form names no origin and blames ranks unknown."""
    parts = value.split("|", 2)
    try:
        origin, blamed, reason = int(parts[0]), parts[1], parts[2]
        ranks = None if blamed == "-" else tuple(int(r) for r in blamed.split(",") if r)
    except (IndexError, ValueError):
        return None, (), value
    return origin, ranks, reason


class NcclWatchdog:
    """Pending operations, the watchdog thread and failure handling of one nccl group.

    Args:
        store: the group's store, where an abort leaves its notice for the other ranks.
        rank: this rank in the group (the notice names it).
        timeout: the group timeout, in seconds: what a pending operation or a blocking
            NCCL call may take before the group is aborted.
        describe: the backend's `describe(op)`, which heads every message.
        name: the group's name, for the thread's name.
        detail: DISTCOMM_DEBUG=DETAIL checks every collective's signature (a timeout's
            message says so).
    """

    def __init__(
        self,
        store: Store,
        rank: int,
        timeout: float,
        describe: Callable[[str], str],
        name: str,
        detail: bool,
    ) -> None:
        self.store = store
        self.rank = rank
        self.timeout = timeout
        self.describe = describe
        self._name = name
        self._detail = detail
        self._comm: Any = None  # the communicator and its device, from start()
        self.device: Any = None
        self._cond = threading.Condition()  # guards the state below; wakes the watchdog
        self._pending: list[NcclWork] = []
        self._failure: DistError | None = None
        self._closed = False
        self._watchdog: threading.Thread | None = None
        self._launching: tuple[str, float] | None = None  # an NCCL call in progress, since
        self._failed_works: list[NcclWork] = []  # their arrays live until shutdown
        self._released = False  # the communicator was aborted or destroyed
        self._aborter: threading.Thread | None = None  # runs the abort `fail` started
        self._cuda: Any = None  # cupy.cuda, from start()
        #: called with the failure's text once the group failed (the abort listeners)
        self.on_failure: Callable[[str], None] | None = None
        #: the group's size (set by the backend): how many ranks a timeout asks about
        self.size = 1
        self._answered = 0  # the last "who waits?" question this rank answered
        self._asked: set[int] = set()  # the questions this rank asked

    @property
    def failure(self) -> DistError | None:
        """The error the group failed with (it was aborted), or None."""
        return self._failure

    def start(self, comm: Any, device: Any) -> None:
        """Watch `comm` (a `NcclCommunicator` on the `cupy.cuda.Device` `device`) from now."""
        self._comm, self.device = comm, device
        self._cuda = sys.modules["cupy"].cuda
        _live.add(self)
        self._watchdog = threading.Thread(
            target=self._run, daemon=True, name=f"distcomm-nccl-watchdog-{self._name}"
        )
        self._watchdog.start()

    # -- the device, from any thread ------------------------------------------------------------

    def query(self, event: Any) -> int:
        """cudaEventQuery's status for `event`: 0, cudaErrorNotReady, or an error."""
        return int(self._cuda.runtime.eventQuery(event.ptr))

    def on_device(self) -> AbstractContextManager[None]:
        """The group's device current for a block, binding no CUDA context of another
        device in this thread (`distcomm.gpu.runtime.with_device`)."""
        return runtime.with_device(self.device)

    def raise_if_failed(self, description: str) -> None:
        """Raise if the group was aborted (its failure's type) or destroyed.

        Raises:
            DistError: the group was aborted; the failure is the cause.
            GroupDestroyedError: the group was destroyed.
        """
        failure = self._failure
        if failure is not None:
            error = type(failure)(f"{description}: the group was aborted: {failure}")
            error.peer_ranks = failure.peer_ranks
            raise error from failure
        if self._closed:
            raise GroupDestroyedError(f"{description}: the process group was destroyed")

    def launch_started(self, description: str) -> None:
        """Mark an NCCL call in progress: one that blocks the host (NCCL connects to peers
        lazily, inside the first operations) is then bounded by the watchdog too. One
        attribute store, so no lock, and no wake-up: the watchdog looks within a second."""
        self._launching = (description, time.monotonic())

    def launch_ended(self) -> None:
        """The NCCL call `launch_started` marked has returned: an abort the group's failure
        deferred until then starts now."""
        self._launching = None
        if self._failure is not None:
            self._start_abort()

    def track(self, works: list[NcclWork]) -> None:
        """Watch `works`, just issued, until they complete.

        Only the first of a run of operations wakes the watchdog: while any is pending it
        looks at all of them on its own schedule, so ops issued back to back cost no
        thread switch each (a wake per op took the GIL from the issuing thread).
        """
        with self._cond:
            idle = not self._pending
            self._pending.extend(works)
            if idle:
                self._cond.notify_all()

    def timed_out(self, work: NcclWork, seconds: float) -> DistTimeoutError:
        """Fail the group because `work` did not finish in `seconds`; the error to raise."""
        check = (
            "every rank issued it (DISTCOMM_DEBUG=DETAIL checked)"
            if self._detail
            else "set DISTCOMM_DEBUG=DETAIL to check that every rank issued it with the "
            "same arguments"
        )
        missing = self._not_waiting()
        who = (
            f"rank(s) {', '.join(map(str, missing))} did not answer: they wait in no "
            "operation of this group (not called yet, or gone); "
            if missing
            else ""
        )
        error = DistTimeoutError(
            f"{work.description} did not complete within {seconds:g} s; {who}{check}. The "
            "group's NCCL communicator was aborted: destroy the group and create a new one"
        )
        if missing:
            error = caused_by_peers(error, tuple(missing))
        self.fail(error)
        return error

    def _not_waiting(self) -> list[int]:
        """The other ranks that wait in no operation of the group: this rank asks through
        the store, and a rank whose operations have been pending a while answers from its
        watchdog (`_answer`); those silent after `_ASK_S` are named. NCCL itself cannot
        tell which rank has not called."""
        if self.size < 2:
            return []
        try:
            query = int(self.store.add(_QUERY_KEY, 1))
            self._asked.add(query)  # this rank's watchdog does not answer its own question
            count = f"{_QUERY_KEY}/{query}/n"
            end = time.monotonic() + _ASK_S
            # one request a look (the count of answers); each rank's key is read once, at
            # the end, only when some did not answer
            while int(self.store.add(count, 0)) < self.size - 1:
                if time.monotonic() > end:
                    return [
                        r
                        for r in range(self.size)
                        if r != self.rank and not self.store.check([f"{_QUERY_KEY}/{query}/{r}"])
                    ]
                time.sleep(0.05)
            return []
        except Exception:  # the store is gone: name nobody rather than guess
            return []

    def _answer(self) -> None:
        """Answer the other ranks' questions "who waits in an operation?" (`_not_waiting`):
        this rank does (its watchdog calls this only while operations are pending)."""
        asked = int(self.store.add(_QUERY_KEY, 0))
        for query in range(self._answered + 1, asked + 1):
            if query in self._asked:
                continue
            self.store.set(f"{_QUERY_KEY}/{query}/{self.rank}", "1")
            self.store.add(f"{_QUERY_KEY}/{query}/n", 1)
        self._answered = max(self._answered, asked)

    def fail(self, error: DistError, notify: bool = True) -> None:
        """Abort the communicator, fail every pending operation, and (`notify`) leave a
        notice for the other ranks unless one is there already."""
        with self._cond:
            if self._failure is not None:
                return
            self._failure = error
            pending, self._pending = self._pending, []
            self._cond.notify_all()
        log.error("%s: aborting the NCCL communicator: %s", self.describe("abort"), error)
        if self.on_failure is not None:
            self.on_failure(str(error))
        # NCCL forbids ncclCommAbort on a blocking communicator (CuPy's) while another
        # thread is inside an NCCL call on it: an abort that finds a call in progress waits
        # for it to return (`launch_ended` starts it; a peer's abort or exit makes a call
        # stuck on that peer return with an error). A non-blocking one (nccl4py's) may be
        # aborted at any time: its calls return at once, and their polls end on the abort
        if self._launching is None or getattr(self._comm, "nonblocking", False):
            self._start_abort()
        # kernels queued behind the aborted ones may still run: keep their arrays until
        # the group is destroyed and its stream has run them
        self._failed_works = pending
        for work in pending:
            try:
                work.fail(error)
            except RuntimeError:  # it completed meanwhile
                pass
        try:
            if notify and not self._closed:
                self.store.compare_set(_ABORT_KEY, "", _notice(self.rank, error))
        except Exception:  # the store may be gone with the failed rank
            pass

    def _start_abort(self) -> None:
        """Start the abort `fail` asked for, once. ncclCommAbort frees the communicator's
        device memory, which waits for the GPU to finish what is queued before it, other
        streams' kernels included (seen with NCCL 2.28.9: a wait(timeout=1) raised only
        after 8 s, when a kernel ahead of the op ended). It runs on a thread of its own, so
        the caller and the watchdog report the failure at once; destroying the group waits
        for it."""
        with self._cond:
            if self._aborter is not None or self._released or self._comm is None:
                return
            self._aborter = threading.Thread(
                target=self.release,
                daemon=True,
                name=f"distcomm-nccl-abort-{self._name}",
            )
        self._aborter.start()

    def _run(self) -> None:
        try:
            self.device.use()  # a new thread's device is 0: never make a context there
            self._watch_loop()
        except Exception as exc:  # a watchdog that died silently would hide every failure
            self.fail(DistBackendError(f"{self.describe('watchdog')} failed: {exc!r}"))

    def _watch_loop(self) -> None:
        delay = _WATCH_FIRST
        last_notice = 0.0
        while True:
            with self._cond:
                woken = False
                while (
                    not self._closed
                    and self._failure is None
                    and not self._pending
                    and self._launching is None
                ):
                    delay = _WATCH_FIRST
                    woken = True
                    self._cond.wait(1.0)
            if woken:  # let a run of operations be issued before looking at them
                time.sleep(_WAKE_GRACE)
            with self._cond:
                if self._closed or self._failure is not None:
                    return
                pending, launching = list(self._pending), self._launching
            if launching is not None and time.monotonic() - launching[1] > self.timeout:
                when = (
                    "is aborted"
                    if getattr(self._comm, "nonblocking", False)
                    else "is aborted once that call returns (NCCL forbids aborting a "
                    "blocking communicator while a call is inside it)"
                )
                self.fail(
                    DistTimeoutError(
                        f"{launching[0]}: NCCL did not return within {self.timeout:g} s (it "
                        "waits for a peer that never connected?); the group failed, and its "
                        f"communicator {when}: destroy the group and create a new one"
                    )
                )
                return
            done = {id(w) for w in pending if w._poll(True)}
            with self._cond:
                self._pending = [w for w in self._pending if id(w) not in done]
                oldest = self._pending[0] if self._pending else None
            if oldest is not None:
                waited = time.monotonic() - oldest._issued
                if waited > self.timeout:
                    self.timed_out(oldest, self.timeout)
                    return
                if self._async_error():
                    return
                if waited > _NOTICE_AFTER and time.monotonic() - last_notice > _NOTICE_AFTER:
                    last_notice = time.monotonic()
                    if self.abort_notice():
                        return
                    try:
                        self._answer()
                    except Exception:  # an unreachable store: nobody can ask either
                        pass
            delay = _UNBOUNDED.nap(delay, _WATCH_MOST)

    def _async_error(self) -> bool:
        try:
            self._comm.check_async_error()
        except Exception as exc:  # NcclError
            self.fail(
                DistBackendError(
                    f"{self.describe('watchdog')}: NCCL reported an asynchronous error ({exc}); "
                    "a peer rank probably failed or its connection broke"
                )
            )
            return True
        return False

    def abort_notice(self) -> bool:
        """Whether another rank left an abort notice in the store; fails the group if so."""
        try:
            if not self.store.check([_ABORT_KEY]):
                return False
            notice = self.store.get(_ABORT_KEY).decode(errors="replace")
            origin, blamed, reason = _read_notice(notice)
        except Exception:  # an unreachable store is no notice
            return False
        where = self.describe("watchdog")
        if blamed and self.rank in blamed:  # this rank is the cause, not a consequence
            others = tuple(r for r in blamed if r != self.rank)
            error = DistBackendError(f"{where}: {blamed_message(origin, reason, others)}")
        elif origin is None:
            error = caused_by_peers(
                DistBackendError(f"{where}: another rank aborted the group ({reason})")
            )
        else:
            error = caused_by_peers(
                DistBackendError(
                    f"{where}: another rank aborted the group (rank {origin}: {reason})"
                ),
                blamed or (origin,),
            )
        self.fail(error, notify=False)
        return True

    def release(self) -> None:
        """Abort the communicator, once, whichever thread asks first. Never
        ncclCommDestroy: that is a collective of the node's ranks, which hangs after a
        peer's abort or when a peer never destroys."""
        with self._cond:
            comm = self._comm
            if self._released or comm is None:
                return
            self._released = True
        _live.discard(self)
        try:
            comm.abort()
        except Exception as exc:  # an NcclError while releasing changes nothing
            log.warning(
                "%s: abort of the NCCL communicator failed: %s", self.describe("shutdown"), exc
            )

    def finish_abort(self, timeout: float) -> None:
        """Wait up to `timeout` s for an abort under way (`fail`) to return; say so if it
        does not (the GPU is still busy with work queued before the aborted ops: their
        arrays then stay referenced until it returns)."""
        aborter = self._aborter
        if aborter is None or aborter is threading.current_thread():
            return
        aborter.join(timeout)
        if aborter.is_alive():
            log.warning(
                "%s: ncclCommAbort has not returned after %g s: it waits for the "
                "kernels queued on this GPU before the aborted operations to end; "
                "the communicator is left to it",
                self.describe("shutdown"),
                timeout,
            )

    def stop(self) -> list[NcclWork] | None:
        """Stop the watchdog; the operations still pending after up to 10 s (at most the
        group timeout) of waiting for them, or None if it was stopped already."""
        with self._cond:
            if self._closed:
                return None
            self._closed = True
            pending = list(self._pending)
            self._cond.notify_all()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(10.0)
        deadline = Deadline(min(self.timeout, 10.0))
        if pending and self._comm is not None:
            with self.on_device():
                while pending and not deadline.expired():
                    pending = [w for w in pending if not w._poll(True)]
                    if pending:
                        time.sleep(0.001)
        return pending

    def keep_until_settled(self, works: list[NcclWork]) -> None:
        """Keep the arrays of `works` (failed, or abandoned at destroy) until `forget`
        has seen the group's stream run what is queued on it."""
        self._failed_works = [*self._failed_works, *works]

    def forget(self, stream: Any) -> None:
        """Let go of the communicator and of the arrays of the operations a failure failed
        (once `stop()` and `release()` are done: the group is gone). An abort ends the
        NCCL kernels, but the work queued behind them on `stream` (an average's division,
        copies out of a joined buffer) still runs afterwards: the arrays are handed back
        to CuPy (whose pool may give their memory to new arrays) only once the stream has
        run it, else they stay referenced for the life of the process."""
        self._comm = None
        works, self._failed_works = self._failed_works, []
        if not works:
            return
        arrays = [w._keep for w in works]
        aborter = self._aborter
        if (aborter is not None and aborter.is_alive()) or not self._settle(stream):
            _stranded.append(arrays)
            log.warning(
                "%s: the GPU has not finished the work queued on the group's stream "
                "behind its failed operations; their arrays stay allocated until the "
                "process exits",
                self.describe("shutdown"),
            )

    def _settle(self, stream: Any) -> bool:
        """Whether `stream` ran everything queued on it, waiting up to `_SETTLE_S`."""
        if stream is None:
            return True
        deadline = Deadline(_SETTLE_S)
        delay = _WATCH_FIRST
        with self.on_device():
            event = self._cuda.Event(disable_timing=True)
            event.record(stream)
            while True:
                status = self.query(event)
                if status == 0:
                    return True
                if status != _CUDA_NOT_READY or deadline.expired():
                    return False
                delay = deadline.nap(delay, _POLL_MOST)
