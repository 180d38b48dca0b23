"""One connection to a peer process: the frame format, its state, and writing frames on it.

A frame is the group's channel id (0: the fabric's own messages), then a `Header`, then
the payload. Senders write from their own thread, one frame at a time per connection
(the connection's lock), with `sendmsg` of the pieces (no copy); a write that stops
half-way spoils the stream, and the I/O thread cuts the connection so that every group
using it fails instead of waiting. The I/O thread's own small frames (answers, aborts
passed on, goodbyes) wait in the connection's outbox until the lock is free and never
block it (`Sending.control`, `Sending._flush`).
"""

from __future__ import annotations

import select
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from .... import net
from ....deadline import Deadline
from ....errors import DistError, DistNetworkError, DistTimeoutError
from ..protocol import Header
from . import links

__all__ = ["DISCARD", "FRAME_SIZE", "Conn", "Sending"]

#: a frame starts with the channel id of its group (0: the fabric's own messages)
_CID = struct.Struct("<Q")
FRAME_SIZE = _CID.size + Header.SIZE
#: a frame's start, parsed at once: the channel id, then a `Header`'s fields
_FRAME = struct.Struct("<Q" + Header.FORMAT[1:])
#: what `Channel.incoming` returns for a payload to read and drop
DISCARD = object()
#: the events the I/O thread polls a descriptor for
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
#: a blocked send wakes this often (seconds) to check its deadline and its group
_SEND_SLICE = 0.5


class _Sink:
    """Where the engine puts a frame's payload: `view` (then `done()`), or nowhere."""

    __slots__ = ("done", "got", "skip", "view")

    def __init__(
        self, view: memoryview | None, done: Callable[[], None] | None, skip: int = 0
    ) -> None:
        self.view, self.done, self.got, self.skip = view, done, 0, skip


class Conn:
    """One connection to a peer process, shared by every group that talks to it."""

    __slots__ = (
        "address",
        "answered",
        "closed",
        "dirty",
        "error",
        "events",
        "fd",
        "gone",
        "got",
        "head",
        "head_view",
        "idle",
        "leftover",
        "lock",
        "outbox",
        "partial",
        "paused",
        "prank",
        "sink",
        "sock",
        "stall",
    )

    def __init__(self, prank: int, sock: socket.socket, link_timeout: float) -> None:
        self.prank = prank
        self.sock = sock
        try:
            host, port = sock.getpeername()[:2]
            self.address = net.format_address(host, port)
        except OSError:
            self.address = "?"
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.idle = max(1, int(link_timeout / 3))  # seconds before keep-alive probes
        net.set_keepalive(
            sock, idle=self.idle, interval=max(1, int(link_timeout / 6)), user_timeout=link_timeout
        )
        # sends block in the kernel (faster than polling from Python), but never for
        # longer than this at a time, so the sender notices deadlines and aborts
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, int(_SEND_SLICE * 1e6))
        )
        self.stall: links.Stall | None = None
        self.lock = threading.Lock()  # one message at a time: frames never interleave
        self.dirty = False  # a send stopped half-way: the stream can carry nothing more
        self.gone = False  # the peer said goodbye (or this process did, and it answered)
        self.closed = False  # the I/O thread dropped the connection (see Fabric._drop)
        self.error: BaseException | None = None  # why, when it was lost
        self.answered = threading.Event()  # the peer answered this process's goodbye
        # the engine's side
        self.head = bytearray(FRAME_SIZE)
        self.head_view = memoryview(self.head)
        self.got = 0
        self.sink: _Sink | None = None
        self.paused: tuple[Any, int, Header, float] | None = None
        self.outbox: deque[bytes] = deque()  # the engine's frames, waiting for the lock
        self.partial: memoryview | None = None  # the rest of one the engine is writing
        self.events = 0
        self.fd = sock.fileno()
        self.leftover = b""  # staged bytes after the header of a paused frame

    def name(self) -> str:
        return f"rank {self.prank}"


def _unlock(conn: Conn) -> None:
    """Let go of `conn`'s write lock; close its socket if the I/O thread dropped the
    connection while the lock was held (it closes it itself only when the lock is free,
    so that a descriptor in use by a writer is never closed and reused under it).

    Released first, then checked: the I/O thread marks the connection closed before it
    tries the lock, so one of the two always sees the other and closes the socket."""
    conn.lock.release()
    if conn.closed:
        _close_if_free(conn)


def _close_if_free(conn: Conn) -> None:
    """Close `conn`'s socket if no sender holds the connection (else that one will)."""
    if conn.lock.acquire(blocking=False):
        conn.sock.close()
        conn.lock.release()


def _queued(conn: Conn) -> list[bytes | memoryview]:
    """Take the frames the I/O thread queued on `conn` (its lock is held): they go first."""
    frames: list[bytes | memoryview] = []
    while conn.outbox:
        frames.append(conn.outbox.popleft())
    return frames


def _check_progress(deadline: Deadline, failed: Callable[[], DistError | None], who: str) -> None:
    """A send that waits: raise the group's failure, or a timeout once `deadline` passed."""
    error = failed()
    if error is not None:
        raise error
    if deadline.expired():
        raise DistTimeoutError(
            f"sending to {who} made no progress for "
            f"{deadline.seconds:.1f} s (is it alive and reading?)"
        )


class Sending:
    """Writing frames (a mixin of `fabric.Fabric`): a sender's `send`, small `control`
    messages from any thread, and the I/O thread's `_flush` of what waits in outboxes.

    Uses the fabric's I/O thread (`_thread`), its set of connections to flush
    (`_to_flush`), `_post` and `_interest`.
    """

    _thread: threading.Thread
    _to_flush: set[Conn]
    link_timeout: float

    def send(
        self,
        conn: Conn,
        views: list[bytes | memoryview],
        deadline: Deadline,
        failed: Callable[[], DistError | None],
        who: str,
    ) -> None:
        """Write one frame (`views`: channel id, header, payload) on `conn`, blocking until
        written; `failed()` says when the group failed meanwhile (the send stops), `who`
        names the peer in messages.

        A send that stops half-way leaves the stream unusable: the connection is then cut,
        and every group using it fails.

        Raises:
            DistNetworkError: the connection failed, or was cut before.
            DistTimeoutError: the deadline passed.
        """
        self._acquire(conn, deadline, failed, who)
        try:
            if conn.dirty:
                raise DistNetworkError(
                    f"the connection to {who} was cut: a message to it stopped half-way"
                )
            self._write(conn, _queued(conn) + views, deadline, failed, who)
        except DistError:
            self._spoil(conn)
            raise
        finally:
            _unlock(conn)

    def _spoil(self, conn: Conn) -> None:
        """A write stopped half-way: nothing more can go on `conn`; the I/O thread cuts
        it, so that every group using it (here and at the peer) fails rather than waits."""
        if not conn.dirty:
            conn.dirty = True
            self._post("cut", conn)

    def _acquire(
        self, conn: Conn, deadline: Deadline, failed: Callable[[], DistError | None], who: str
    ) -> None:
        if conn.lock.acquire(False):
            return
        while not conn.lock.acquire(timeout=deadline.slice(_SEND_SLICE)):
            _check_progress(deadline, failed, who)

    def _write(
        self,
        conn: Conn,
        views: list[bytes | memoryview],
        deadline: Deadline,
        failed: Callable[[], DistError | None],
        who: str,
    ) -> None:
        total = sum(map(len, views))
        while total:
            try:
                sent = conn.sock.sendmsg(views, [], socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):  # SO_SNDTIMEO passed: check, retry
                sent = 0
            except OSError as exc:
                # a connection the I/O thread dropped fails for the reason it found
                reason = links.failure_reason(conn, conn.error or exc, who, self.link_timeout)
                raise DistNetworkError(reason) from None
            if sent == total:
                return
            total -= sent
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views.pop(0))
                else:
                    views[0] = views[0][sent:]
                    sent = 0
            _check_progress(deadline, failed, who)

    def control(self, conn: Conn, cid: int, header: Header, payload: bytes = b"") -> bool:
        """Send a small message (an answer, an abort, a goodbye) without blocking long and
        without interleaving another message; from the engine it is queued if the
        connection is busy. Returns whether it was sent or queued."""
        if conn.closed or conn.dirty:
            return False
        frame = _CID.pack(cid) + header.pack() + payload
        if threading.current_thread() is self._thread:
            conn.outbox.append(frame)
            self._flush(conn)
            return True
        if not conn.lock.acquire(timeout=1.0):
            return False
        try:
            if conn.dirty:
                return False
            self._write(conn, [*_queued(conn), frame], Deadline(1.0), lambda: None, conn.name())
            return True
        except DistTimeoutError:  # stopped half-way: the peer does not read
            self._spoil(conn)
            return False
        except DistError:  # the connection failed: its reader says why
            conn.dirty = True
            return False
        finally:
            _unlock(conn)

    def _flush(self, conn: Conn) -> None:
        """(engine) Write queued frames if no sender holds the connection; never block."""
        if conn.partial is None:
            if not conn.outbox or conn.closed:
                self._to_flush.discard(conn)
                return
            if not conn.lock.acquire(blocking=False):
                self._to_flush.add(conn)
                return
            if conn.dirty:
                conn.outbox.clear()
                conn.lock.release()
                self._to_flush.discard(conn)
                return
            conn.partial = memoryview(b"".join(conn.outbox))
            conn.outbox.clear()
        self._to_flush.discard(conn)
        try:
            while conn.partial:
                sent = conn.sock.send(conn.partial, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                conn.partial = conn.partial[sent:]
        except BlockingIOError:
            self._interest(conn)  # the lock stays with the engine until it is written
            return
        except OSError:
            conn.dirty = True  # the reader finds out why
        conn.partial = None
        conn.lock.release()
        self._interest(conn)
