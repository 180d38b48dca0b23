"""What both timer servers share: a table of timers per worker pid (process-tree reaping is
`distcomm.procutil.kill_process_tree`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Generic, TypeVar

import psutil

from ...procutil import is_gone
from .api import TimerRequest

__all__ = ["WorkerTimers"]

log = logging.getLogger(__name__)

R = TypeVar("R", bound=TimerRequest)


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
