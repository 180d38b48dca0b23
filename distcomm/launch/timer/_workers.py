"""What both timer servers share: a table of timers per worker pid, and process-tree reaping."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterable
from typing import Generic, TypeVar

import psutil

from .api import TimerRequest

__all__ = ["WorkerTimers", "is_gone", "kill_process_tree"]

log = logging.getLogger(__name__)

R = TypeVar("R", bound=TimerRequest)

#: Seconds to wait for a SIGKILLed worker to disappear before reporting it survived.
KILL_WAIT = 10.0


def is_gone(proc: psutil.Process) -> bool:
    """Whether the process has exited: no longer exists, was replaced (pid reuse) or is a zombie.

    Never waits for the process: its parent (often the launcher) keeps its exit status.
    """
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(proc: psutil.Process, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    pause = 0.005
    while not is_gone(proc):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.1)
    return True


def _send(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass
    except psutil.AccessDenied:
        log.warning("not allowed to send %s to pid %d", signal.Signals(sig).name, proc.pid)


def kill_process_tree(proc: psutil.Process, sig: int = signal.SIGKILL, grace: float = 5.0) -> bool:
    """Signal a worker's descendants, then the worker; True once the worker has exited.

    With a signal other than SIGKILL, whatever is still alive `grace` seconds later
    (the worker or any descendant found at the start) gets SIGKILL.
    """
    if is_gone(proc):
        return True
    try:
        tree = [*proc.children(recursive=True), proc]
    except psutil.NoSuchProcess:
        return True
    for member in tree:
        _send(member, sig)
    if sig != signal.SIGKILL:
        _wait_gone(proc, grace)
        survivors = [member for member in tree if not is_gone(member)]
        if survivors:
            log.warning(
                "pid(s) %s still alive %s s after %s; sending SIGKILL",
                ", ".join(str(p.pid) for p in survivors),
                grace,
                signal.Signals(sig).name,
            )
        for member in survivors:
            _send(member, signal.SIGKILL)
    return _wait_gone(proc, KILL_WAIT)


class WorkerTimers(Generic[R]):
    """Timers keyed by (worker pid, scope id), with the worker's process captured on first use.

    Capturing a `psutil.Process` (pid plus start time) when a worker's first request
    arrives means a later reap can never hit an unrelated process that reused the pid.
    """

    def __init__(self) -> None:
        self._timers: dict[int, dict[str, R]] = {}
        self._procs: dict[int, psutil.Process] = {}

    def apply(self, request: R) -> None:
        """Set, move or release (expiration <= 0) one timer.

        Requests of pids that have exited, and of the server's own pid, are dropped.
        """
        pid = request.worker_id
        if request.is_release:
            scopes = self._timers.get(pid)
            if scopes is not None:
                scopes.pop(request.scope_id, None)
                if not scopes:
                    self.clear([pid])
            return
        if pid == os.getpid():
            log.warning(
                "ignoring timer %r: it would reap the timer server itself (pid %d)",
                request.scope_id,
                pid,
            )
            return
        proc = self._procs.get(pid)
        if proc is None or is_gone(proc):
            self.clear([pid])
            try:
                proc = psutil.Process(pid)
            except (psutil.NoSuchProcess, TypeError, ValueError):
                log.debug("dropping timer %r of pid %s: no such process", request.scope_id, pid)
                return
            if is_gone(proc):
                log.debug("dropping timer %r of pid %s: it has exited", request.scope_id, pid)
                return
            self._procs[pid] = proc
        self._timers.setdefault(pid, {})[request.scope_id] = request

    def forget_exited(self) -> None:
        """Drop the timers of workers that exited without releasing them."""
        gone = [pid for pid, proc in self._procs.items() if is_gone(proc)]
        if gone:
            log.debug("forgetting timers of exited pid(s) %s", gone)
            self.clear(gone)

    def clear(self, pids: Iterable[int]) -> None:
        for pid in pids:
            self._timers.pop(pid, None)
            self._procs.pop(pid, None)

    def expired(self, deadline: float) -> dict[int, list[R]]:
        """Timers due by `deadline`, per pid, earliest first."""
        due: dict[int, list[R]] = {}
        for pid, scopes in self._timers.items():
            timers = sorted(
                (t for t in scopes.values() if t.expiration_time <= deadline),
                key=lambda t: t.expiration_time,
            )
            if timers:
                due[pid] = timers
        return due

    def next_expiration(self) -> float | None:
        return min(
            (t.expiration_time for scopes in self._timers.values() for t in scopes.values()),
            default=None,
        )

    def timers_of(self, pid: int) -> list[R]:
        return list(self._timers.get(pid, {}).values())

    def process(self, pid: int) -> psutil.Process | None:
        return self._procs.get(pid)

    def __len__(self) -> int:
        return sum(len(scopes) for scopes in self._timers.values())
