"""The expiration-timer contract: requests, clients, request queues, the watchdog server.

A worker wraps a block that might hang in `expires(after=...)`: on entry its
`TimerClient` asks the `TimerServer` (in the launcher's process) to reap the worker
at `time.time() + after`, on exit it releases the timer. The server's watchdog loop
is one `run_once()` step repeated: drain requests, register them, find expired timers,
reap their workers, forget the reaped ones::

    worker ── TimerClient.acquire/release ──> RequestQueue ──> TimerServer.run_once()
                                                               └─ _reap_worker(worker_id)

`configure(client)` sets the client `expires` uses by default; a worker started by
distcomm-run needs no call: `expires` builds a `FileTimerClient` for the named pipe
the launcher exports in DISTCOMM_TIMER_FILE.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from ...config import get as env_var
from ...config import positive_seconds
from ...errors import DistError

__all__ = [
    "TIMER_FILE_ENV",
    "RequestQueue",
    "TimerClient",
    "TimerRequest",
    "TimerServer",
    "TimerServerUnavailableError",
    "configure",
    "expires",
]

log = logging.getLogger(__name__)

#: The environment variable through which distcomm-run tells each worker its timer pipe.
TIMER_FILE_ENV = "DISTCOMM_TIMER_FILE"

# what `stop()` waits beyond `max_interval`: a step may be reaping (grace period, kill wait)
_STOP_JOIN_SLACK = 30.0


class TimerServerUnavailableError(DistError, BrokenPipeError):
    """A timer client could not reach its server (none is listening, or it went away).

    A `BrokenPipeError` (so a `ConnectionError`), as torch's `FileTimerClient` raises.
    """


@dataclass(frozen=True)
class TimerRequest:
    """One acquisition or release of a countdown timer, sent from a client to its server.

    A timer is identified by ``(worker_id, scope_id)``; acquiring it again moves its
    deadline. An `expiration_time` <= 0 asks to release the timer.

    Attributes:
        worker_id: identifies the worker to reap; its type belongs to the client/server
            pair (both pairs shipped here use the worker's pid).
        scope_id: names the timed block within the worker.
        expiration_time: when the timer expires, in `time.time()` seconds.
    """

    worker_id: Any
    scope_id: str
    expiration_time: float

    @property
    def is_release(self) -> bool:
        """Whether this request releases the timer instead of setting it."""
        return self.expiration_time <= 0


class TimerClient(ABC):
    """Acquires and releases countdown timers by talking to a `TimerServer`."""

    @abstractmethod
    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Set (or move) this worker's timer `scope_id` to expire at `expiration_time`.

        Args:
            scope_id: names the timed block.
            expiration_time: deadline in `time.time()` seconds.
        """

    @abstractmethod
    def release(self, scope_id: str) -> None:
        """Release this worker's timer `scope_id`; releasing an unknown scope does nothing."""


class RequestQueue(ABC):
    """The server's side of the channel that carries `TimerRequest`s from the clients."""

    @abstractmethod
    def size(self) -> int:
        """How many requests are waiting (may be approximate; 0 when it cannot tell)."""

    @abstractmethod
    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        """Take up to `size` requests, waiting at most `timeout` seconds for them.

        Returns whatever arrived by then: the list may be shorter than `size`, or empty.
        """


class TimerServer(ABC):
    """Watchdog that reaps workers whose timers expired.

    Subclasses keep the timers (`register_timers`, `clear_timers`, `get_expired_timers`)
    and reap workers (`_reap_worker`); this class runs the loop, either in a background
    thread (`start`/`stop`) or one step at a time (`run_once`, also reachable under
    torch's name `_run_watchdog`, for tests).

    Args:
        request_queue: where the clients' requests arrive.
        max_interval: longest wait for requests in one step, in seconds; a step ends
            sooner when a registered timer falls due, so reaping is not delayed by it.
        daemon: whether the watchdog thread is a daemon thread.

    Raises:
        ValueError: `max_interval` is not a finite number > 0.
    """

    #: Longest wait of one step in the background loop, so `stop()` is noticed that soon;
    #: None where `_wake` can interrupt the wait instead.
    _stop_poll_interval: float | None = 1.0

    def __init__(self, request_queue: RequestQueue, max_interval: float, daemon: bool = True):
        self._request_queue = request_queue
        self._max_interval = _positive_seconds(max_interval, "max_interval")
        self._daemon = daemon
        self._thread: threading.Thread | None = None
        self._stop_requested = threading.Event()
        self._step_lock = threading.Lock()
        self._reap_failed = False

    @abstractmethod
    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        """Apply requests in order: set or move a timer, or release it (expiration <= 0)."""

    @abstractmethod
    def clear_timers(self, worker_ids: set[Any]) -> None:
        """Forget every timer of the given workers."""

    @abstractmethod
    def get_expired_timers(self, deadline: float) -> dict[Any, list[TimerRequest]]:
        """The timers due by `deadline` (`time.time()` seconds), grouped by worker id."""

    @abstractmethod
    def _reap_worker(self, worker_id: Any) -> bool:
        """Kill the worker; True when it is gone (its timers are then cleared).

        False keeps its timers, so a later step tries again. An exception is logged and
        counts as True (the worker's timers are cleared, as in torch): a reap that raises
        would raise again at every step. The other workers due in the step are reaped
        either way.
        """

    def _next_expiration(self) -> float | None:
        """The earliest registered expiration time, or None; lets a step end when it is due.

        The default (None) makes every step wait the full `max_interval` for requests.
        """
        return None

    def _notify_expired(self, worker_id: Any, expired: list[TimerRequest]) -> None:  # noqa: B027
        """Called with a worker's expired timers just before it is reaped (a no-op here).

        Before, not after: whoever watches the worker (the launcher) must be able to tell
        why it died by the time it sees it dead. Called again if a reap is retried.
        """

    def _should_reap(self, worker_id: Any, expired: list[TimerRequest]) -> bool:
        """Whether these expired timers call for reaping the worker (default: always).

        A subclass that answers False must drop or move those timers itself, or they are
        found expired again in the next step.
        """
        return True

    def _wake(self) -> None:  # noqa: B027 - optional hook, a no-op unless overridden
        """Interrupt a step waiting for requests so `stop()` returns promptly (optional)."""

    def run_once(self) -> None:
        """One step of the watchdog loop.

        Waits for requests (at most `max_interval`, less when a timer falls due sooner),
        registers them, reaps every worker with an expired timer and clears the timers of
        the workers it reaped. A worker that could not be reaped keeps its timers; the
        background loop tries again `max_interval` later.
        """
        self._run_watchdog()

    def _run_watchdog(self) -> None:
        """One step of the loop (torch's name; the background loop calls it each step)."""
        self._step(self._stop_poll_interval or self._max_interval)

    def _step(self, longest_wait: float) -> None:
        with self._step_lock:
            wait = min(longest_wait, self._max_interval)
            due = self._next_expiration()
            if due is not None:
                wait = min(wait, max(0.0, due - time.time()))
            batch = max(1, self._request_queue.size())
            self.register_timers(self._request_queue.get(batch, wait))
            reaped = set()
            failed = False
            for worker_id, expired in self.get_expired_timers(time.time()).items():
                scopes = ", ".join(repr(t.scope_id) for t in expired)
                self._notify_expired(worker_id, expired)
                if not self._should_reap(worker_id, expired):
                    continue
                try:
                    gone = self._reap_worker(worker_id)
                except Exception:
                    log.exception(
                        "timer server %s: reaping worker %s (timer(s) %s expired) raised; "
                        "clearing its timers and going on with the other workers (fix the "
                        "_reap_worker of this server: it should return False to retry)",
                        type(self).__name__,
                        worker_id,
                        scopes,
                    )
                    reaped.add(worker_id)
                    continue
                if gone:
                    reaped.add(worker_id)
                    log.warning(
                        "timer server reaped worker %s: timer(s) %s expired", worker_id, scopes
                    )
                else:
                    failed = True
                    log.error(
                        "timer server could not reap worker %s (timer(s) %s expired); "
                        "will try again",
                        worker_id,
                        scopes,
                    )
            self.clear_timers(reaped)
            self._reap_failed = failed

    def _watchdog_loop(self) -> None:
        while not self._stop_requested.is_set():
            try:
                self._run_watchdog()
            except Exception:
                log.exception("timer server %s: watchdog step failed", type(self).__name__)
                self._reap_failed = True
            if self._reap_failed:
                self._stop_requested.wait(self._max_interval)

    def start(self) -> None:
        """Run the watchdog loop in a background thread; returns at once.

        Starting a server that is running already does nothing (its one watchdog thread
        goes on), as torch's tolerates a second `start()`.

        Raises:
            RuntimeError: a `stop()` that timed out is still waiting for the old watchdog
                thread to end (it is reaping); start again once it has.
        """
        if self._thread is not None and self._thread.is_alive():
            if self._stop_requested.is_set():
                raise RuntimeError(
                    f"{type(self).__name__} is still stopping: its watchdog thread has not "
                    f"ended yet (a reap in progress?); call start() again once it has"
                )
            log.debug("%s is already running; start() does nothing", type(self).__name__)
            return
        self._stop_requested.clear()
        self._thread = threading.Thread(
            target=self._watchdog_loop,
            name=f"{type(self).__name__}-watchdog",
            daemon=self._daemon,
        )
        self._thread.start()
        log.info("%s started (max_interval=%s s)", type(self).__name__, self._max_interval)

    def stop(self) -> None:
        """Stop the watchdog thread and wait for it; safe to call more than once."""
        self._stop_requested.set()
        thread = self._thread
        if thread is None:
            return
        self._wake()
        thread.join(self._max_interval + _STOP_JOIN_SLACK)
        if thread.is_alive():
            log.warning("%s watchdog thread did not stop in time", type(self).__name__)
            return
        self._thread = None
        log.info("%s stopped", type(self).__name__)

    def __enter__(self) -> TimerServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _positive_seconds(value: object, name: str) -> float:
    """A finite number (not its text) of seconds > 0, for the timers' arguments."""
    return positive_seconds(name, value, finite=True, text=False)


# The one client `expires` uses when none is passed: set by `configure`, or built from
# DISTCOMM_TIMER_FILE on first use (torch keeps the same module-level default).
_timer_client: TimerClient | None = None

# Builds the client for the pipe DISTCOMM_TIMER_FILE names. file_based_local_timer registers
# its FileTimerClient when it is imported (the package imports it), so that this module,
# which holds the abstract types, imports no implementation.
_pipe_client_factory: Callable[[str], TimerClient] | None = None


def register_pipe_client(factory: Callable[[str], TimerClient]) -> None:
    """Set how `expires` builds its default client from DISTCOMM_TIMER_FILE's path."""
    global _pipe_client_factory
    _pipe_client_factory = factory


def configure(timer_client: TimerClient | None) -> None:
    """Make `timer_client` the client `expires` uses when none is passed.

    Args:
        timer_client: the client; it replaces any client configured before. None unsets
            it, as in torch: `expires` without `client=` then raises, unless
            DISTCOMM_TIMER_FILE names a timer pipe (as under distcomm-run).

    Raises:
        TypeError: `timer_client` is neither a `TimerClient` nor None.
    """
    global _timer_client
    if timer_client is not None and not isinstance(timer_client, TimerClient):
        raise TypeError(
            f"configure() needs a TimerClient (e.g. LocalTimerClient, FileTimerClient), "
            f"or None to unset it; got {type(timer_client).__name__}"
        )
    _timer_client = timer_client
    if timer_client is None:
        log.info("timer client unset")
    else:
        log.info("timer client configured: %s", type(timer_client).__name__)


def _default_client() -> TimerClient:
    global _timer_client
    if _timer_client is None:
        path = env_var(TIMER_FILE_ENV)
        if not path:
            raise RuntimeError(
                "expires() has no timer client: call "
                "distcomm.launch.timer.configure(client) first, pass client=..., or run "
                f"under distcomm-run (which sets {TIMER_FILE_ENV} in every worker)"
            )
        if _pipe_client_factory is None:  # only if the package was bypassed
            raise RuntimeError("no pipe timer client: import distcomm.launch.timer")
        _timer_client = _pipe_client_factory(path)
        log.info("timer client configured from %s=%s", TIMER_FILE_ENV, path)
    return _timer_client


def expires(
    after: float, scope: str | None = None, client: TimerClient | None = None
) -> AbstractContextManager[None]:
    """Reap this worker unless the `with` block finishes within `after` seconds.

    The timer is acquired on entry (expiring `after` seconds from then) and released
    on exit, also when the block raises. Nested blocks need distinct scopes: the timer
    of a scope is one timer, and releasing it ends it for the outer block too.

    Args:
        after: seconds the block may take; a finite number > 0.
        scope: names the block in the server's reports; default: the caller's
            ``"file:line"``.
        client: the client to use; default: the one `configure` set, else a
            `FileTimerClient` for the pipe in DISTCOMM_TIMER_FILE (set by distcomm-run).

    Raises:
        TypeError: `after` is not a number.
        ValueError: `after` is not finite and > 0.
        RuntimeError: no client was passed or configured, and DISTCOMM_TIMER_FILE is unset.
    """
    seconds = _positive_seconds(after, "expires: after")
    if scope is None:
        caller = sys._getframe(1)
        scope = f"{caller.f_code.co_filename}:{caller.f_lineno}"
    elif not isinstance(scope, str):
        raise TypeError(f"scope must be a str, got {type(scope).__name__}")
    return _timed_scope(client if client is not None else _default_client(), scope, seconds)


@contextmanager
def _timed_scope(client: TimerClient, scope: str, seconds: float) -> Iterator[None]:
    client.acquire(scope, time.time() + seconds)
    try:
        yield
    finally:
        client.release(scope)
