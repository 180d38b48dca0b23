"""One TCPStore client connection: frames out, answers in, under kernel timeouts.

`Connection` wraps an open, authenticated socket to the server and runs one request at a
time on it: it sends a small request without waiting (the kernel takes it at once, so no
send timeout is needed), bounds each receive, and each send that must wait, with
SO_RCVTIMEO/SO_SNDTIMEO (set only when the bound already set does not serve the request's
budget: a request costs two system calls, its send and its receive), reads an answer into
place, keeps the bytes read past it, and sets aside the late answers that refuse an
earlier quiet request. It raises the socket's own
errors; `requests.StoreClient` turns them into the store's.
"""

from __future__ import annotations

import socket
import struct
import time

from ...deadline import FOREVER
from ...net import send_now
from .protocol import HEADER, Status, decode_args

__all__ = ["Connection", "PeerClosed"]

_TIMEVAL = struct.Struct("@ll")
_LATE_ERROR = int(Status.LATE_ERROR)
#: How far the kernel timeout already set may be from a request's budget and still serve
#: it: up to `LONGER` seconds longer, or `SHORTER` shorter (a budget runs a second past the
#: server's own deadline, `requests.SAFETY_MARGIN`), so that requests whose budgets differ only
#: by the time that passed between them (the register, then every request with the store
#: timeout) set it once.
LONGER, SHORTER = 1.0, 0.25


def _kernel_seconds(seconds: float | None) -> float:
    """A bound for SO_RCVTIMEO/SO_SNDTIMEO: 0 (the kernel's "none") for None or huge, else
    at least 1 ms."""
    return 0.0 if seconds is None or seconds > FOREVER else max(seconds, 0.001)


def _serves(current: float, bound: float) -> bool:
    """Whether the kernel timeout `current` serves for `bound` (0: none, for both)."""
    if current == 0.0 or bound == 0.0:
        return current == bound
    return bound - SHORTER <= current <= bound + LONGER


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return _TIMEVAL.pack(whole, int((seconds - whole) * 1e6))


class PeerClosed(Exception):
    """The server closed the connection."""


class Connection:
    """An open, authenticated connection to a TCPStore server (blocking socket).

    Args:
        sock: the connected socket, its handshake done; the connection owns it.
        pushback: what the handshake read past its end (the start of an answer).
    """

    def __init__(self, sock: socket.socket, pushback: bytes = b"") -> None:
        if sock.gettimeout() is not None:
            sock.settimeout(None)  # blocking; requests bound each call with kernel timeouts
        self.sock = sock
        self._rcv: float = -1.0  # the receive timeout set on the socket (-1: not known)
        self._snd: float = -1.0  # the send timeout set on the socket (-1: not known)
        self._rcv_for = -1.0  # the budget `_rcv` was last checked against
        self._pushback = pushback  # bytes read past the last answer

    @property
    def local_address(self) -> str:
        """The IP address of this end of the connection (asked when wanted: a system call
        that, with thousands of client threads, also hands the GIL to another)."""
        return self.sock.getsockname()[0]

    def exchange(
        self, frame: list[bytes], seconds: float, quiet: bool = False
    ) -> tuple[int, list[bytes], str | None]:
        """Send one request and (unless `quiet`) read its answer within `seconds`.

        Returns:
            (status, arguments, late): `late` is the message of an answer refusing an
            earlier quiet request, read before this one's, or None.

        Raises:
            TimeoutError, BlockingIOError: no answer in time (a kernel timeout surfaces
                as EAGAIN).
            PeerClosed, OSError: the connection failed.
        """
        sock = self.sock
        if len(frame) == 1:  # a small request: the kernel takes it at once
            data = frame[0]
            sent = send_now(sock, data)
            if sent < len(data):  # the server is not reading: wait, within `seconds`
                self._bound_send(seconds)
                sock.sendall(memoryview(data)[sent:])
        else:
            self._bound_send(seconds)
            for part in frame:
                sock.sendall(part)
        if quiet:
            return 0, [], None
        return self.answer(seconds)

    def answer(self, seconds: float) -> tuple[int, list[bytes], str | None]:
        """Read the answer to the request sent last, within `seconds`; as `exchange`."""
        late = None
        while True:
            if self._pushback:
                status, result = self._unpush(seconds)
            else:
                status, result = self._read_reply(seconds)
            if status != _LATE_ERROR:
                return status, result, late
            late = result[0].decode(errors="replace") if result else "unknown error"

    def close(self, shutdown: bool) -> None:
        """Close the socket; with `shutdown`, first shut it down, which wakes a thread
        blocked on it (in a forked child it would also cut the parent's connection)."""
        if shutdown:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.sock.close()

    def _bound_recv(self, seconds: float) -> None:
        """Bound each receive by about `seconds` (SO_RCVTIMEO, see `LONGER`), before a
        receive that may wait."""
        self._rcv_for = seconds
        bound = _kernel_seconds(seconds)
        if not _serves(self._rcv, bound):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(bound))
            self._rcv = bound

    def _bound_send(self, seconds: float) -> None:
        """Bound each send by about `seconds` (SO_SNDTIMEO), before a send that may wait
        (one of a large request, or one the server is slow to read)."""
        bound = _kernel_seconds(seconds)
        if not _serves(self._snd, bound):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(bound))
            self._snd = bound

    def _read_reply(self, seconds: float) -> tuple[int, list[bytes]]:
        sock = self.sock
        if seconds != self._rcv_for:  # most requests have the budget of the one before
            self._bound_recv(seconds)
        data = sock.recv(1 << 16)
        while len(data) < HEADER.size:
            if not data:
                raise PeerClosed
            more = sock.recv(1 << 16)
            if not more:
                raise PeerClosed
            data += more
        size, status = HEADER.unpack_from(data)
        end = HEADER.size + size
        if len(data) < end:  # a large answer: receive the rest into place
            buffer = bytearray(end)
            buffer[: len(data)] = data
            view = memoryview(buffer)
            got = len(data)
            end_time = time.monotonic() + seconds
            while got < end:
                if time.monotonic() > end_time:
                    raise TimeoutError
                count = sock.recv_into(view[got:])
                if not count:
                    raise PeerClosed
                got += count
            data = buffer
        elif len(data) > end:  # an answer refusing an earlier quiet request, then ours
            self._pushback = data[end:]
        return status, decode_args(data, HEADER.size, end)

    def _unpush(self, seconds: float) -> tuple[int, list[bytes]]:
        """Read an answer whose start came with the previous one (often all of it: the
        answer to the REGISTER sent with the handshake comes with the greeting)."""
        sock = self.sock
        data, self._pushback = self._pushback, b""
        end_time = time.monotonic() + seconds
        while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
            if time.monotonic() > end_time:
                raise TimeoutError
            self._bound_recv(seconds)
            more = sock.recv(1 << 16)
            if not more:
                raise PeerClosed
            data += more
        end = HEADER.size + HEADER.unpack_from(data)[0]
        self._pushback = data[end:]
        return HEADER.unpack_from(data)[1], decode_args(data, HEADER.size, end)
