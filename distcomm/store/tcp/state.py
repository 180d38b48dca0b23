"""What the TCPStore server keeps and does: keys, queues, and the requests parked on them.

`ServerState` holds the keys (`hash.Values`) and the queues, answers every command of
`protocol` (one `_do_*` method per command, in `handlers`), and parks the requests that
must wait: a GET or WAIT for a key not set yet, a `queue_pop` on an empty queue, a wait for
workers. It does no I/O: `server.StoreServer` reads the requests, calls the handlers and
sends what they return, and the state answers a parked request through the callables the
server gives it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...errors import DistStoreError
from ..hash import KeysOrQueues, Values, add_value, compare_set_value
from .protocol import SECONDS, Cmd, Limits, Status

if TYPE_CHECKING:
    from .bookkeeping import Conn

__all__ = ["ServerState", "Waiter"]


class Waiter:
    """A parked request: the keys it waits for (or a worker count)."""

    __slots__ = ("cmd", "conn", "done", "keys", "next", "workers")

    def __init__(self, conn: Conn, cmd: int, keys: list[bytes], workers: int = 0) -> None:
        self.conn, self.cmd, self.keys, self.workers = conn, cmd, keys, workers
        self.done = False
        self.next = 0  # keys before this index were set when last looked at


class ServerState:
    """The keys, the queues and the parked requests of one TCPStore server.

    Args:
        limits: what one request may carry.
        reply: queues an answer (status, args) on a connection.
        answered: called after a parked request's answer was queued; the server sends it
            and serves what the connection sent after it.
        add_timer: calls for `expire(waiter)` at a monotonic time (inf: never).
    """

    def __init__(
        self,
        limits: Limits,
        reply: Callable[[Conn, int, list[bytes]], None],
        answered: Callable[[Conn], None],
        add_timer: Callable[[float, object], None],
    ) -> None:
        self.limits = limits
        self._limits_args = limits.encode()  # the tail of every REGISTER answer
        self._reply, self._answered, self._add_timer = reply, answered, add_timer
        self._data = Values()
        self.queues: dict[bytes, deque[bytes]] = {}  # only non-empty queues
        self._set_or_queued = KeysOrQueues(self._data, self.queues)  # what WAIT counts
        self.poppers: dict[bytes, dict[Waiter, None]] = {}  # parked pops, oldest first
        self._watchers: dict[bytes, dict[Waiter, None]] = {}
        self._worker_waiters: dict[Waiter, None] = {}
        self._workers = 0
        #: The handler of each command: (connection, arguments) -> answer, or None when
        #: the request was parked (or answered otherwise).
        self.handlers: dict[int, Callable[[Conn, list[bytes]], list[bytes] | None]] = {
            Cmd.REGISTER: self._do_register,
            Cmd.SET: self._do_set,
            Cmd.GET: self._do_get,
            Cmd.ADD: self._do_add,
            Cmd.COMPARE_SET: self._do_compare_set,
            Cmd.WAIT: self._do_wait,
            Cmd.CHECK: self._do_check,
            Cmd.DELETE_KEY: self._do_delete_key,
            Cmd.NUM_KEYS: self._do_num_keys,
            Cmd.MULTI_GET: self._do_get,
            Cmd.MULTI_SET: self._do_multi_set,
            Cmd.APPEND: self._do_append,
            Cmd.WAIT_WORKERS: self._do_wait_workers,
            Cmd.LIST_KEYS: self._do_list_keys,
            Cmd.QUEUE_PUSH: self._do_queue_push,
            Cmd.QUEUE_POP: self._do_queue_pop,
            Cmd.QUEUE_LEN: self._do_queue_len,
        }

    def expire(self, waiter: Waiter) -> None:
        """`waiter`'s timeout came: answer TIMEOUT, unless it was answered already."""
        if not waiter.done:
            self._finish(waiter, Status.TIMEOUT, self._timeout_args(waiter))

    def _timeout_args(self, waiter: Waiter) -> list[bytes]:
        if waiter.cmd == Cmd.WAIT_WORKERS:
            return [str(self._workers).encode()]
        if waiter.cmd == Cmd.QUEUE_POP:
            return waiter.keys
        present = self._set_or_queued if waiter.cmd == Cmd.WAIT else self._data
        return [key for key in waiter.keys if key not in present]

    def _check_keys(self, keys: list[bytes]) -> None:
        limits = self.limits
        if len(keys) > limits.max_keys:
            raise DistStoreError(
                f"{len(keys):,} keys in one request; the limit is {limits.max_keys:,}"
            )
        for key in keys:
            if len(key) > limits.max_key:
                raise DistStoreError(
                    f"a key of {len(key):,} bytes is over the limit of {limits.max_key:,} "
                    "(DISTCOMM_STORE_MAX_KEY_BYTES on the process hosting the store)"
                )

    def _check_value(self, value: bytes) -> None:
        if len(value) > self.limits.max_value:
            raise DistStoreError(
                f"a value of {len(value):,} bytes is over the limit of "
                f"{self.limits.max_value:,} (DISTCOMM_STORE_MAX_VALUE_BYTES on the process "
                "hosting the store)"
            )

    @staticmethod
    def _seconds(raw: bytes) -> float:
        (seconds,) = SECONDS.unpack(raw)
        if math.isnan(seconds) or seconds < 0:
            raise ValueError(f"timeout must be >= 0 seconds (or inf), got {seconds}")
        return seconds

    def _park(self, conn: Conn, waiter: Waiter, seconds: float) -> None:
        conn.parked = waiter
        self._add_timer(time.monotonic() + seconds, waiter)  # inf: never fires

    def _watch(self, waiter: Waiter) -> bool:
        """Watch `waiter`'s first key not yet set; True when all are set (nothing watched).

        A WAIT counts a key whose queue holds an item as set.
        """
        data = self._set_or_queued if waiter.cmd == Cmd.WAIT else self._data
        keys = waiter.keys
        index = waiter.next
        while True:
            while index < len(keys) and keys[index] in data:
                index += 1
            if index < len(keys):
                waiter.next = index
                self._watchers.setdefault(keys[index], {})[waiter] = None
                return False
            # every key was set when passed; one may have been deleted since: look once more
            index = next((i for i, key in enumerate(keys) if key not in data), len(keys))
            if index == len(keys):
                waiter.next = index
                return True

    def unpark(self, waiter: Waiter) -> None:
        waiter.done = True
        waiter.conn.parked = None
        if waiter.cmd == Cmd.WAIT_WORKERS:
            self._worker_waiters.pop(waiter, None)
        elif waiter.cmd == Cmd.QUEUE_POP:
            key = waiter.keys[0]
            line = self.poppers.get(key)
            if line is not None:
                line.pop(waiter, None)
                if not line:
                    del self.poppers[key]
        elif waiter.next < len(waiter.keys):
            key = waiter.keys[waiter.next]
            waiting = self._watchers.get(key)
            if waiting is not None:
                waiting.pop(waiter, None)
                if not waiting:
                    del self._watchers[key]

    def _finish(self, waiter: Waiter, status: int, args: list[bytes]) -> None:
        self.unpark(waiter)
        self._reply(waiter.conn, status, args)
        self._answered(waiter.conn)

    def _changed(self, key: bytes) -> None:
        """Move on the requests watching `key`; answer those whose keys are all set."""
        waiting = self._watchers.pop(key, None)
        if waiting is None:
            return
        for waiter in waiting:
            if not waiter.done and self._watch(waiter):
                self._finish(waiter, Status.OK, self._results(waiter))

    def _results(self, waiter: Waiter) -> list[bytes]:
        if waiter.cmd == Cmd.WAIT:
            return []
        data = self._data
        return [data[key] for key in waiter.keys]

    def _do_register(self, conn: Conn, args: list[bytes]) -> list[bytes]:
        if not conn.registered:  # once per connection, however often it asks
            conn.registered = True
            self._workers += 1
            for waiter in list(self._worker_waiters):
                if self._workers >= waiter.workers:
                    self._finish(waiter, Status.OK, [str(self._workers).encode()])
        return [str(self._workers).encode(), *self._limits_args]

    def _do_wait_workers(self, conn: Conn, args: list[bytes]) -> list[bytes] | None:
        raw, count = args
        seconds, wanted = self._seconds(raw), int(count)
        if self._workers >= wanted:
            return [str(self._workers).encode()]
        waiter = Waiter(conn, Cmd.WAIT_WORKERS, [], wanted)
        self._worker_waiters[waiter] = None
        self._park(conn, waiter, seconds)
        return None

    def _do_set(self, conn: Conn, args: list[bytes]) -> None:
        key, value = args
        if len(key) > self.limits.max_key:
            self._check_keys([key])
        self._check_value(value)
        self._data[key] = value
        if key in self._watchers:
            self._changed(key)

    def _do_get(self, conn: Conn, args: list[bytes]) -> list[bytes] | None:
        """GET and MULTI_GET: the values, or park until all are set."""
        raw, *keys = args
        seconds = self._seconds(raw)
        data = self._data
        if len(keys) == 1:
            key = keys[0]
            if len(key) > self.limits.max_key:
                self._check_keys(keys)
            if key in data:
                return [data[key]]
        else:
            self._check_keys(keys)
        return self._wait_for(conn, Cmd.MULTI_GET, keys, seconds)

    def _do_wait(self, conn: Conn, args: list[bytes]) -> list[bytes] | None:
        raw, *keys = args
        seconds = self._seconds(raw)
        self._check_keys(keys)
        return self._wait_for(conn, Cmd.WAIT, keys, seconds)

    def _wait_for(
        self, conn: Conn, cmd: int, keys: list[bytes], seconds: float
    ) -> list[bytes] | None:
        waiter = Waiter(conn, cmd, keys)
        if self._watch(waiter):
            return self._results(waiter)
        if seconds == 0:  # nothing to wait for: answer at once
            self.unpark(waiter)
            self._reply(conn, Status.TIMEOUT, self._timeout_args(waiter))
            return None
        self._park(conn, waiter, seconds)
        return None

    def _do_add(self, conn: Conn, args: list[bytes]) -> list[bytes]:
        key, amount = args
        if len(key) > self.limits.max_key:
            self._check_keys([key])
        value = add_value(key, self._data.get(key), int(amount))
        self._data[key] = value
        if key in self._watchers:
            self._changed(key)
        return [value]

    def _do_compare_set(self, conn: Conn, args: list[bytes]) -> list[bytes]:
        key, expected, desired = args
        self._check_keys([key])
        self._check_value(desired)
        new, result = compare_set_value(self._data.get(key), expected, desired)
        if new is not None:
            self._data[key] = new
            if key in self._watchers:
                self._changed(key)
        return [result]

    def _do_check(self, conn: Conn, args: list[bytes]) -> list[bytes]:
        self._check_keys(args)
        data = self._set_or_queued
        return [b"\x01" if all(key in data for key in args) else b"\x00"]

    def _do_delete_key(self, conn: Conn, args: list[bytes]) -> list[bytes]:
        (key,) = args
        return [b"\x01" if self._data.delete(key) else b"\x00"]

    def _do_num_keys(self, conn: Conn, args: list[bytes]) -> list[bytes]:
        return [str(len(self._data)).encode()]

    def _do_multi_set(self, conn: Conn, args: list[bytes]) -> None:
        if len(args) % 2:
            raise ValueError("MULTI_SET needs key, value pairs")
        keys, values = args[::2], args[1::2]
        self._check_keys(keys)
        for value in values:
            self._check_value(value)
        data = self._data
        for key, value in zip(keys, values, strict=True):
            data[key] = value
        for key in keys:
            if key in self._watchers:
                self._changed(key)

    def _do_append(self, conn: Conn, args: list[bytes]) -> None:
        key, value = args
        self._check_keys([key])
        self._check_value(value)
        self._data.append(key, value)
        if key in self._watchers:
            self._changed(key)

    def _do_list_keys(self, conn: Conn, args: list[bytes]) -> list[bytes]:
        return list(self._data.keys())

    def _do_queue_push(self, conn: Conn, args: list[bytes]) -> None:
        key, value = args
        self._check_keys([key])
        self._check_value(value)
        line = self.poppers.get(key)
        if line:  # a pop is waiting: the item goes to the oldest, never into the queue
            self._finish(next(iter(line)), Status.OK, [value])
            return
        items = self.queues.get(key)
        if items is None:
            items = self.queues[key] = deque()
        items.append(value)
        if key in self._watchers:
            self._changed(key)

    def _do_queue_pop(self, conn: Conn, args: list[bytes]) -> list[bytes] | None:
        raw, key = args
        seconds = self._seconds(raw)
        self._check_keys([key])
        items = self.queues.get(key)
        if items:
            value = items.popleft()
            if not items:
                del self.queues[key]
            return [value]
        if seconds == 0:
            return []  # empty
        waiter = Waiter(conn, Cmd.QUEUE_POP, [key])
        self.poppers.setdefault(key, {})[waiter] = None
        self._park(conn, waiter, seconds)
        return None

    def _do_queue_len(self, conn: Conn, args: list[bytes]) -> list[bytes]:
        (key,) = args
        self._check_keys([key])
        items = self.queues.get(key)
        return [str(0 if items is None else len(items)).encode()]
