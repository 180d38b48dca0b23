"""The TCPStore server's bookkeeping: a record per connection, its timers, its warnings.

`Conn` is what the event loop knows of one client connection, `Timers` the heap of
deadlines it watches (parked requests, connection watchdogs, a paused listener), and
`Throttle` rate-limits the warnings about misbehaving clients.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import select
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .state import Waiter

__all__ = ["Conn", "Throttle", "Timers"]

log = logging.getLogger("distcomm.store")


class Conn:
    """One client connection and what the loop knows of it."""

    __slots__ = (
        "accepted",
        "address",
        "authed",
        "blocked",
        "closed",
        "closing",
        "fd",
        "inbuf",
        "mask",
        "nonce",
        "out",
        "out_bytes",
        "out_since",
        "parked",
        "partial_since",
        "pending",
        "registered",
        "sock",
        "timer_at",
    )

    def __init__(self, sock: socket.socket, address: tuple, now: float) -> None:
        self.sock, self.address, self.fd = sock, address, sock.fileno()
        self.inbuf = bytearray()
        self.out: deque[bytes | memoryview] = deque()
        self.out_bytes = 0
        self.authed = self.closed = self.closing = self.blocked = False
        self.pending = True  # no complete request yet
        self.registered = False
        self.nonce = b""
        self.parked: Waiter | None = None
        self.accepted = now
        self.partial_since: float | None = None  # a request has been half-received since
        self.out_since: float | None = None  # answers have waited unsent since
        self.timer_at: float | None = None
        self.mask = select.EPOLLIN

    @property
    def name(self) -> str:
        """The connection, for messages ("store client 10.0.0.2:41234")."""
        return f"store client {self.address[0]}:{self.address[1]}"


class Throttle:
    """Rate-limited warnings: each kind at most once per `every` seconds, with a count."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def warn(self, kind: str, message: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -math.inf) < self.every:
            self._left_out[kind] = self._left_out.get(kind, 0) + 1
            return
        self._last[kind] = now
        skipped = self._left_out.pop(kind, 0)
        if skipped:
            message += f" ({skipped} more like this in the last {self.every:.0f} s)"
        log.warning(message, *args, exc_info=exc_info)


class Timers:
    """A heap of (when, item) deadlines on the monotonic clock, oldest first.

    Items are not removed when they stop mattering (a parked request answered, a
    connection closed): `live(item)` says whether one still does, and the heap drops the
    dead ones in bulk whenever it has doubled since it was last compacted.

    Args:
        live: whether an item still matters.
        longest: the most `sleep_time` returns, however far the next deadline.
    """

    def __init__(self, live: Callable[[object], bool], longest: float) -> None:
        self._live, self._longest = live, longest
        self._heap: list[tuple[float, int, object]] = []
        self._compact_at = 1024
        self._seq = itertools.count()

    def add(self, when: float, item: object) -> None:
        """Have `item` come out of `pop_due` at `when` (inf: never)."""
        heapq.heappush(self._heap, (when, next(self._seq), item))

    def due(self) -> bool:
        """Whether a deadline has come."""
        heap = self._heap
        return bool(heap) and heap[0][0] <= time.monotonic()

    def pop_due(self, now: float) -> tuple[float, object] | None:
        """The next deadline at or before `now` with its item, or None."""
        heap = self._heap
        if heap and heap[0][0] <= now:
            when, _, item = heapq.heappop(heap)
            return when, item
        return None

    def sleep_time(self) -> float:
        """Seconds until the next deadline, at most `longest` (compacts the heap first)."""
        heap = self._heap
        if len(heap) > self._compact_at:  # drop the timers of answered requests
            self._heap = heap = [entry for entry in heap if self._live(entry[2])]
            heapq.heapify(heap)
            self._compact_at = max(1024, 2 * len(heap))
        if not heap:
            return self._longest
        return min(self._longest, max(0.0, heap[0][0] - time.monotonic()))
