"""Expiration timers over a multiprocessing queue, for workers spawned by this host's launcher."""

from __future__ import annotations

import logging
import os
import queue
import signal
import time
from typing import Any

from ...procutil import kill_process_tree
from ._workers import WorkerTimers
from .api import RequestQueue, TimerClient, TimerRequest, TimerServer

__all__ = ["LocalTimerClient", "LocalTimerServer", "MultiprocessingRequestQueue"]

log = logging.getLogger(__name__)


class LocalTimerClient(TimerClient):
    """Sends this process's timer requests (worker id: its pid) into a multiprocessing queue.

    Args:
        mp_queue: a queue made by the server's side (``multiprocessing.get_context(...).Queue()``)
            and handed to the worker when it is spawned.
    """

    def __init__(self, mp_queue: Any) -> None:
        self._queue = mp_queue

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self._queue.put(TimerRequest(os.getpid(), scope_id, expiration_time))

    def release(self, scope_id: str) -> None:
        self._queue.put(TimerRequest(os.getpid(), scope_id, -1))


class MultiprocessingRequestQueue(RequestQueue):
    """The server's side of a multiprocessing queue of `TimerRequest`s."""

    def __init__(self, mp_queue: Any) -> None:
        self._queue = mp_queue

    def size(self) -> int:
        try:
            return self._queue.qsize()
        except NotImplementedError:  # macOS has no sem_getvalue
            return 0

    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        requests: list[TimerRequest] = []
        deadline = time.monotonic() + timeout
        while len(requests) < size:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if isinstance(item, TimerRequest):
                requests.append(item)
            else:
                log.warning("timer queue: ignoring %s (not a TimerRequest)", type(item).__name__)
        return requests


class LocalTimerServer(TimerServer):
    """Reaps workers (by pid) whose timers, sent through a multiprocessing queue, expired.

    Reaping sends SIGKILL to the worker's descendants and then to the worker. Timers of
    workers that exit without releasing them are forgotten.

    Args:
        mp_queue: the queue the workers' `LocalTimerClient`s write to.
        max_interval: longest wait for requests in one watchdog step, in seconds.
        daemon: whether the watchdog thread is a daemon thread.
    """

    # a multiprocessing queue cannot be woken from here: wait in short slices instead
    _stop_poll_interval = 0.5

    def __init__(self, mp_queue: Any, max_interval: float = 60, daemon: bool = True) -> None:
        super().__init__(MultiprocessingRequestQueue(mp_queue), max_interval, daemon)
        self._timers: WorkerTimers[TimerRequest] = WorkerTimers()

    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        """Apply the requests in order, then forget timers of workers that have exited."""
        for request in timer_requests:
            self._timers.apply(request)
        self._timers.forget_exited()

    def clear_timers(self, worker_ids: set[Any]) -> None:
        self._timers.clear(worker_ids)

    def get_expired_timers(self, deadline: float) -> dict[Any, list[TimerRequest]]:
        return dict(self._timers.expired(deadline))

    def _next_expiration(self) -> float | None:
        return self._timers.next_expiration()

    def _reap_worker(self, worker_id: Any) -> bool:
        proc = self._timers.process(worker_id)
        if proc is None:
            return True
        return kill_process_tree(proc, signal.SIGKILL)
