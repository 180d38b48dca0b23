"""Watching a round of the rendezvous on a thread of its own, and what the agent does next.

While its workers run, the agent must notice three things about the other nodes: the
rendezvous was closed, a node counted a failure of this round, or the membership changed
(nodes wait to join, or the round is over: a node left it). Each look is a store read,
which takes milliseconds, or as long as the store's timeout when the link to the store is
down. `RoundWatch` reads on its own thread and keeps the latest answer; the agent's
monitor loop never waits for the store, so it goes on watching its workers (and the
expiration timers) through any outage, and it says so when an answer is late.

`next_step` and `barrier_step` are the agent's decisions, as pure functions of what the
workers and the watch say, so they are tested without processes.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from ...errors import DistError
from ...store import Store
from ..rendezvous import RendezvousHandler, RoundView

__all__ = [
    "SLOW_STORE_S",
    "Observation",
    "RoundWatch",
    "RunResult",
    "barrier_step",
    "failed_round_key",
    "next_step",
    "slow_store",
]

log = logging.getLogger("distcomm.launch")

#: seconds after which a store call counts as slow and is logged
SLOW_STORE_S = 2.0


@contextlib.contextmanager
def slow_store(what: str) -> Iterator[None]:
    """Log a line when the store calls inside took longer than SLOW_STORE_S."""
    started = time.monotonic()
    try:
        yield
    finally:
        took = time.monotonic() - started
        if took > SLOW_STORE_S:
            log.warning(
                "distcomm-run: the rendezvous store took %.1f s for %s (is the link "
                "to it slow or down?)",
                took,
                what,
            )


def failed_round_key(round_: int) -> str:
    """The run-store key a node sets (with `add`) when round `round_` failed on it."""
    return f"failed_round_{round_}"


class RunResult(enum.Enum):
    """How one round ended for this node's agent.

    SUCCEEDED: every worker here exited 0 (and, after the exit barrier, everywhere).
    FAILED: a worker here failed, or another node counted a failure of the round.
    MEMBERSHIP_CHANGED: nodes wait to join, or the round is over: join the next one.
    CLOSED: the rendezvous was closed by another node.
    """

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    MEMBERSHIP_CHANGED = "membership changed"
    CLOSED = "closed"


@dataclass(frozen=True)
class Observation:
    """One answer of the watch.

    Attributes:
        view: the rendezvous as `RendezvousHandler.watch()` saw it.
        failed: a node counted a failure of the watched round.
    """

    view: RoundView
    failed: bool


def next_step(codes: Mapping[int, int | None], seen: Observation | None) -> RunResult | None:
    """What the agent does while its workers run: None to go on watching.

    Args:
        codes: local rank -> exit code (None while running).
        seen: the watch's latest answer, or None before the first.
    """
    if any(code not in (None, 0) for code in codes.values()):
        return RunResult.FAILED
    if all(code == 0 for code in codes.values()):
        return RunResult.SUCCEEDED
    if seen is None:
        return None
    if seen.failed:
        return RunResult.FAILED
    if seen.view.closed:
        return RunResult.CLOSED
    if seen.view.nodes_waiting > 0:
        return RunResult.MEMBERSHIP_CHANGED
    return None


def barrier_step(seen: Observation | None) -> RunResult | None:
    """What an agent whose workers succeeded does while it waits for the other nodes'.

    Nodes waiting to join do not end the wait (the round's work is nearly done); a failure
    of the round, a closed rendezvous or a round left by one of its nodes does: that node's
    workers cannot finish, so waiting out the exit barrier would only hide it.
    """
    if seen is None:
        return None
    if seen.failed:
        return RunResult.FAILED
    if seen.view.closed:
        return RunResult.CLOSED
    if seen.view.round_over:
        return RunResult.MEMBERSHIP_CHANGED
    return None


class RoundWatch:
    """Reads `handler.watch()` and the round's failure key every `interval` on a thread.

    Args:
        handler: this node's rendezvous handler.
        run_store: the run's store (RendezvousInfo.run_store).
        round_: the round to watch.
        where: the store, for log lines ("the c10d rendezvous store at host:port").
        interval: seconds between two reads.
        slow_after: seconds after which a read counts as slow and is logged.
    """

    def __init__(
        self,
        handler: RendezvousHandler,
        run_store: Store,
        round_: int,
        where: str,
        interval: float = 0.5,
        slow_after: float = SLOW_STORE_S,
    ) -> None:
        self._handler = handler
        self._run_store = run_store
        self._key = failed_round_key(round_)
        self._where = where
        self._interval = interval
        self._slow_after = slow_after
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._latest: Observation | None = None
        self._pending_since: float | None = None
        self._stall_told = False
        self._failing = False
        self._thread = threading.Thread(
            target=self._run, name=f"distcomm-watch-{round_}", daemon=True
        )

    def start(self) -> None:
        """Start reading (the first read at once)."""
        self._thread.start()

    def stop(self, wait: float = 1.0) -> None:
        """Stop reading; waits up to `wait` seconds for a read in progress, then leaves it
        to finish on its own (its answer is dropped)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(wait)

    def latest(self) -> Observation | None:
        """The latest answer, or None before the first."""
        with self._lock:
            return self._latest

    def check_stall(self) -> float:
        """Log once when the read in progress is late; seconds it has been pending (0.0 if
        none). Called from the monitor loop, which never waits for the read."""
        with self._lock:
            since = self._pending_since
            if since is None:
                return 0.0
            pending = time.monotonic() - since
            tell = pending > self._slow_after and not self._stall_told
            if tell:
                self._stall_told = True
        if tell:
            log.warning(
                "distcomm-run: %s has not answered for %.1f s (is the link to it "
                "down?); the workers are still watched",
                self._where,
                pending,
            )
        return pending

    def read_once(self) -> Observation:
        """One read (what the thread does each interval).

        Raises:
            DistError: the store failed.
        """
        view = self._handler.watch()
        failed = self._run_store.check([self._key])
        return Observation(view=view, failed=failed)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            with self._lock:
                self._pending_since, self._stall_told = started, False
            try:
                seen = self.read_once()
            except (DistError, OSError) as exc:
                if not self._failing:
                    log.warning(
                        "distcomm-run: %s failed to answer (%s); retrying every "
                        "%.1f s while the workers are watched",
                        self._where,
                        exc,
                        self._interval,
                    )
                self._failing = True
                seen = None
            finally:
                with self._lock:
                    self._pending_since = None
            took = time.monotonic() - started
            if took > self._slow_after:
                log.warning("distcomm-run: %s took %.1f s to answer", self._where, took)
            if seen is not None:
                if self._failing:
                    log.warning("distcomm-run: %s answers again", self._where)
                    self._failing = False
                with self._lock:
                    if not self._stop.is_set():
                        self._latest = seen
            self._stop.wait(self._interval)
