"""Expiration timers over a named pipe (FIFO), for any process on the host that knows its path.

Protocol: each request is one line of JSON,
``{"version": 1, "pid": ..., "scope_id": ..., "expiration_time": ..., "signal": ...}``,
written with a single ``write`` of at most PIPE_BUF bytes, so concurrent writers never
interleave. A release has ``expiration_time`` <= 0 and ``signal`` 0. A timer whose
``signal`` is <= 0 is only reported when it expires, not reaped (torch's rule). torch's
`FileTimerClient` writes the same lines, so it can talk to this server.

The pipe exists from the server's construction until `FileTimerServer.stop()`. A path
that already exists is reused only when it is a named pipe owned by this user that no
process is reading (a server that died left it behind); anything else is an error, so
two servers can never share a pipe and a regular file is never overwritten.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import select
import signal as _signal
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from ...deadline import Deadline
from ...procutil import is_gone, kill_process_tree
from ._fifo import FifoRequestQueue
from ._workers import WorkerTimers
from .api import (
    TimerClient,
    TimerRequest,
    TimerServer,
    TimerServerUnavailableError,
    _positive_seconds,
    register_pipe_client,
)
from .debug_info_logging import log_debug_info_for_expired_timers

__all__ = ["FileTimerClient", "FileTimerRequest", "FileTimerServer"]

log = logging.getLogger(__name__)

#: Version of the line protocol; the server drops requests of any other version.
PROTOCOL_VERSION = 1
#: Largest request a client sends: what one pipe write delivers atomically.
MAX_REQUEST_BYTES = select.PIPE_BUF


@dataclass(frozen=True, init=False)
class FileTimerRequest(TimerRequest):
    """A timer request on the named pipe; `worker_id` (also `worker_pid`) is the worker's pid.

    Args:
        worker_pid: the pid of the worker to reap.
        scope_id: names the timed block.
        expiration_time: when the timer expires, in `time.time()` seconds; <= 0 releases it.
        signal: what reaps the worker when the timer expires; <= 0 (the default, as in
            torch) reaps nothing: the expiry is only reported. `FileTimerClient` sends its
            own signal (SIGKILL unless told otherwise).

    Attributes:
        version: the protocol version.
    """

    signal: int
    version: int = field(default=PROTOCOL_VERSION, init=False)

    def __init__(
        self, worker_pid: int, scope_id: str, expiration_time: float, signal: int = 0
    ) -> None:
        object.__setattr__(self, "worker_id", worker_pid)
        object.__setattr__(self, "scope_id", scope_id)
        object.__setattr__(self, "expiration_time", expiration_time)
        object.__setattr__(self, "signal", signal)
        object.__setattr__(self, "version", PROTOCOL_VERSION)

    @property
    def worker_pid(self) -> int:
        """The worker's pid (torch's name for `worker_id` here)."""
        return self.worker_id

    @property
    def reaps(self) -> bool:
        """Whether the server reaps the worker when this timer expires (signal > 0)."""
        return self.signal > 0

    def to_json(self) -> str:
        """The request as one line of JSON, without the newline (torch's `to_json`)."""
        fields = {
            "version": self.version,
            "pid": self.worker_id,
            "scope_id": self.scope_id,
            "expiration_time": self.expiration_time,
            "signal": int(self.signal),
        }
        return json.dumps(fields, ensure_ascii=False, separators=(",", ":"))

    def _encode(self) -> bytes:
        """What a client writes to the pipe: `to_json()` and a newline, in UTF-8."""
        return (self.to_json() + "\n").encode()

    @classmethod
    def from_json(cls, line: str | bytes) -> FileTimerRequest:
        """Parse one line written by `to_json` (ours or torch's).

        Raises:
            ValueError: the line is not a valid request; the message says what is wrong.
        """
        try:
            fields = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not JSON ({exc})") from exc
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        version = fields.get("version")
        if version != PROTOCOL_VERSION:
            raise ValueError(f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
        pid = fields.get("pid")
        if type(pid) is not int or pid <= 0:
            raise ValueError(f"pid must be a positive int, got {pid!r}")
        scope_id = fields.get("scope_id")
        if not isinstance(scope_id, str):
            raise ValueError(f"scope_id must be a string, got {scope_id!r}")
        expiration_time = fields.get("expiration_time")
        if (
            isinstance(expiration_time, bool)
            or not isinstance(expiration_time, (int, float))
            or not math.isfinite(expiration_time)
        ):
            raise ValueError(f"expiration_time must be a finite number, got {expiration_time!r}")
        sig = fields.get("signal", 0)
        if type(sig) is not int or (sig > 0 and sig not in _signal.valid_signals()):
            raise ValueError(f"signal {sig!r} is not a signal number (or <= 0: do not reap)")
        return cls(pid, scope_id, float(expiration_time), sig)


class FileTimerClient(TimerClient):
    """Sends this process's timer requests (worker id: its pid) to a `FileTimerServer`.

    Each request opens the pipe without blocking, writes one line and closes it, so the
    client holds no descriptor and survives fork. While no server has the pipe open (or
    the pipe is full) it retries until `timeout`, then raises.

    Args:
        file_path: the server's named pipe (distcomm-run exports it as DISTCOMM_TIMER_FILE).
        signal: the signal the server sends the worker's process tree when a timer
            expires; anything but SIGKILL is followed by SIGKILL after a grace period.
            0 or less reaps nothing: the server only reports the expiry (torch's rule).
        timeout: seconds to keep trying to deliver one request (ours; torch tries for
            about a second).

    Attributes:
        signal: the signal, as given (torch's attribute).

    Raises:
        ValueError: `signal` is not a signal number nor <= 0, or `timeout` is not > 0.
    """

    def __init__(
        self,
        file_path: str | os.PathLike[str],
        signal: int = _signal.SIGKILL,
        *,
        timeout: float = 5.0,
    ) -> None:
        self._path = os.fspath(file_path)
        if isinstance(signal, bool) or not isinstance(signal, int):
            raise TypeError(f"signal must be a signal number, got {type(signal).__name__}")
        if signal > 0 and signal not in _signal.valid_signals():
            raise ValueError(
                f"signal={signal!r} is not a signal number on this platform; pass one such as "
                f"signal.SIGKILL, or 0 to have expiries reported without reaping"
            )
        self.signal = signal
        self._timeout = _positive_seconds(timeout, "timeout")

    @property
    def file_path(self) -> str:
        return self._path

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Ask the server to reap this process at `expiration_time` unless released.

        Raises:
            ValueError: the request would not fit one atomic pipe write (scope id too long).
            TimerServerUnavailableError: no server took the request within `timeout`.
        """
        request = FileTimerRequest(os.getpid(), scope_id, expiration_time, int(self.signal))
        self._send_request(request)

    def release(self, scope_id: str) -> None:
        """Release this process's timer `scope_id`.

        Raises:
            TimerServerUnavailableError: no server took the request within `timeout`.
        """
        self._send_request(FileTimerRequest(os.getpid(), scope_id, -1, 0))

    def _send_request(self, request: FileTimerRequest) -> None:
        """Deliver one request (torch's name for it: a subclass may send requests of its own).

        Raises:
            ValueError: the request would not fit one atomic pipe write.
            TimerServerUnavailableError: no server took it within `timeout`.
        """
        if not isinstance(request.scope_id, str):
            raise TypeError(f"scope_id must be a str, got {type(request.scope_id).__name__}")
        data = request._encode()
        if len(data) > MAX_REQUEST_BYTES:
            raise ValueError(
                f"timer scope id of {len(request.scope_id)} characters is too long: the request "
                f"would be {len(data)} bytes, over the {MAX_REQUEST_BYTES} bytes (PIPE_BUF) one "
                f"pipe write delivers atomically; use a shorter scope"
            )
        deadline = Deadline(self._timeout)
        pause = 0.01
        while True:
            problem = self._try_write(data)
            if problem is None:
                return
            if deadline.expired():
                raise TimerServerUnavailableError(
                    f"timer request for scope {request.scope_id!r} not delivered to "
                    f"{self._path} within {self._timeout} s: {problem}; is the timer server "
                    f"(distcomm-run's agent or a FileTimerServer) running?"
                )
            pause = deadline.nap(pause, 0.2)

    def _try_write(self, data: bytes) -> str | None:
        """Write `data` in one go; None on success, else why it could not (worth retrying)."""
        try:
            fd = os.open(self._path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return "the pipe does not exist"
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return "no server has the pipe open"
            raise TimerServerUnavailableError(
                f"cannot open the timer pipe {self._path}: {exc.strerror}"
            ) from exc
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                raise TimerServerUnavailableError(
                    f"{self._path} is not a named pipe, so no timer server listens there"
                )
            written = os.write(fd, data)
        except BlockingIOError:
            return "the pipe is full (the server is not keeping up)"
        except BrokenPipeError:
            return "the server closed the pipe"
        finally:
            os.close(fd)
        if written != len(data):  # cannot happen for <= PIPE_BUF bytes (POSIX)
            raise TimerServerUnavailableError(
                f"short write to the timer pipe {self._path}: {written} of {len(data)} bytes"
            )
        return None


class FileTimerServer(TimerServer):
    """Reaps workers whose timers, sent through a named pipe by `FileTimerClient`s, expired.

    The server creates the pipe (mode 0600) when constructed and removes it in `stop()`.
    When a worker's timers expire, `log_event("timer expired", request)` is called (from
    the watchdog thread) for each of them, once, and `on_expired(pid, scope_id,
    expiration_time)` for each that reaps, just before the worker is reaped, so that
    whoever sees the worker die already knows why. Reaping sends the first expired
    timer's signal to the worker's descendants and then the worker; unless that was
    SIGKILL, survivors get SIGKILL `reap_grace_period` seconds later. Timers with a
    signal <= 0 reap nothing: their expiry is reported and they are dropped.
    Requests from pids that no longer exist are dropped, and timers of workers that exit
    without releasing them are forgotten.

    `log_event` names, as torch's: "watchdog started", "watchdog stopped", "timer
    expired", "kill worker process"; and ours: "reap failed".

    Args:
        file_path: where to create the named pipe.
        run_id: the run this server belongs to (for logs).
        max_interval: longest wait for requests in one watchdog step, in seconds.
        daemon: whether the watchdog thread is a daemon thread.
        log_event: called as ``log_event(name, request_or_None)`` on the events above.
        on_expired: called as ``on_expired(pid, scope_id, expiration_time)`` for each
            expired timer that reaps, just before its worker is reaped.

    Raises:
        FileExistsError: `file_path` exists and is not a stale named pipe of this user.
        ValueError: `max_interval` is not a finite number > 0.
    """

    #: Seconds between the timer's signal (if not SIGKILL) and SIGKILL of what survived it.
    reap_grace_period: float = 5.0

    _stop_poll_interval = None

    def __init__(
        self,
        file_path: str | os.PathLike[str],
        run_id: str,
        max_interval: float = 10,
        daemon: bool = True,
        log_event: Callable[[str, FileTimerRequest | None], None] | None = None,
        *,
        on_expired: Callable[[int, str, float], None] | None = None,
    ) -> None:
        self._path = os.fspath(file_path)
        self._run_id = run_id
        self._log_event = log_event
        self._on_expired = on_expired
        self._timers: WorkerTimers[FileTimerRequest] = WorkerTimers()
        self._notified: set[TimerRequest] = set()  # expired timers already reported
        self._last_progress_time: int | None = None
        self._pipe = FifoRequestQueue(self._path, FileTimerRequest.from_json)
        super().__init__(self._pipe, max_interval, daemon)
        self._pipe.open()
        log.info("timer server of run %r listening on %s", run_id, self._path)

    @property
    def file_path(self) -> str:
        """The named pipe's path, for clients (distcomm-run exports it as DISTCOMM_TIMER_FILE)."""
        return self._path

    @staticmethod
    def is_process_running(pid: int) -> bool:
        """Whether a process `pid` exists and has not exited (a zombie has exited).

        Raises:
            TypeError: `pid` is not an int.
            ValueError: `pid` is not > 0 (0 and negative numbers name process groups).
        """
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise TypeError(f"pid must be an int, got {type(pid).__name__}")
        if pid <= 0:
            raise ValueError(f"pid must be > 0, got {pid} (0 and below name process groups)")
        try:
            return not is_gone(psutil.Process(pid))
        except psutil.NoSuchProcess:
            return False

    def get_last_progress_time(self) -> int:
        """When the watchdog last finished a step, in whole `time.time()` seconds.

        Before its first step it answers the current time (not stuck yet), as torch's does
        before a client has connected; a step that raises does not count as progress.
        """
        if self._last_progress_time is None:
            return int(time.time())
        return self._last_progress_time

    def _step(self, longest_wait: float) -> None:
        super()._step(longest_wait)
        self._last_progress_time = int(time.time())

    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        """Apply the requests in order, then forget timers of workers that have exited."""
        for request in timer_requests:
            self._timers.apply(request)
        self._timers.forget_exited()
        if self._notified:  # forget reports of timers since released or moved
            self._notified = {r for r in self._notified if r in self._timers.timers_of(r.worker_id)}

    def clear_timers(self, worker_pids: set[Any]) -> None:
        """Forget every timer of the given workers."""
        self._timers.clear(worker_pids)
        self._notified = {r for r in self._notified if r.worker_id not in worker_pids}

    def get_expired_timers(self, deadline: float) -> dict[Any, list[TimerRequest]]:
        return dict(self._timers.expired(deadline))

    def _next_expiration(self) -> float | None:
        return self._timers.next_expiration()

    def _should_reap(self, worker_id: Any, expired: list[TimerRequest]) -> bool:
        if any(_reaps(t) for t in expired):
            return True
        log.warning(
            "timer(s) %s of worker %s expired; not reaping it (signal <= 0: report only)",
            ", ".join(repr(t.scope_id) for t in expired),
            worker_id,
        )
        for request in expired:  # dropped, like a release
            self._timers.apply(FileTimerRequest(worker_id, request.scope_id, -1))
        self._notified.difference_update(expired)
        return False

    def _reap_worker(self, worker_id: Any) -> bool:
        proc = self._timers.process(worker_id)
        timers = sorted(
            (t for t in self._timers.timers_of(worker_id) if _reaps(t)),
            key=lambda t: t.expiration_time,
        )
        if proc is None or not timers:
            return True
        first = timers[0]
        if kill_process_tree(proc, first.signal, grace=self.reap_grace_period):
            self._emit("kill worker process", first)
            return True
        self._emit("reap failed", first)
        return False

    def _notify_expired(self, worker_id: Any, expired: list[TimerRequest]) -> None:
        fresh = [r for r in expired if r not in self._notified]
        if not fresh:
            return
        log_debug_info_for_expired_timers(
            self._run_id,
            {worker_id: [r.to_json() for r in fresh]},  # type: ignore[attr-defined]
        )
        for request in fresh:
            self._notified.add(request)
            if self._on_expired is not None and _reaps(request):
                try:
                    self._on_expired(worker_id, request.scope_id, request.expiration_time)
                except Exception:
                    log.exception("timer server: on_expired callback failed")
            self._emit("timer expired", request)

    def _emit(self, name: str, request: FileTimerRequest | None) -> None:
        if self._log_event is None:
            return
        try:
            self._log_event(name, request)
        except Exception:
            log.exception("timer server: log_event callback failed")

    def _wake(self) -> None:
        self._pipe.wake()

    def start(self) -> None:
        """Run the watchdog loop in a background thread; returns at once.

        Starting a server that is running already does nothing.

        Raises:
            RuntimeError: the server was stopped (its pipe is gone), or is still stopping.
        """
        if self._pipe.closed:
            raise RuntimeError(f"timer server on {self._path} was stopped; create a new one")
        thread = self._thread
        super().start()
        if self._thread is not thread:
            self._emit("watchdog started", None)

    def stop(self) -> None:
        """Stop the watchdog thread, close the pipe and remove it; safe to call twice."""
        super().stop()
        if self._thread is None and not self._pipe.closed:
            self._pipe.close()
            log.info("timer server of run %r stopped; removed %s", self._run_id, self._path)
            self._emit("watchdog stopped", None)


def _reaps(request: TimerRequest) -> bool:
    return getattr(request, "signal", 0) > 0


register_pipe_client(FileTimerClient)
