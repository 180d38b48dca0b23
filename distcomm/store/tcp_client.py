"""One TCPStore client connection: frames out, answers in, under kernel timeouts.

`Connection` wraps an open, authenticated socket to the server and runs one request at a
time on it: it bounds each send and receive with SO_RCVTIMEO/SO_SNDTIMEO (set only when
the bound changes), reads an answer into place, keeps the bytes read past it, and sets
aside the late answers that refuse an earlier quiet request. It raises the socket's own
errors; `tcp.TCPStore` turns them into the store's.
"""

from __future__ import annotations

import socket
import struct
import time

from ..deadline import FOREVER
from .tcp_protocol import HEADER, Status, decode_args

__all__ = ["Connection", "PeerClosed"]

_TIMEVAL = struct.Struct("@ll")
_LATE_ERROR = int(Status.LATE_ERROR)


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
        self._sock_timeout: float | None = -1.0  # the kernel timeouts set on the socket
        self._bound_for: float | None = -1.0  # the seconds _bound was last given
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
        if seconds != self._bound_for:
            self._bound(seconds)
        for part in frame:
            self.sock.sendall(part)
        if quiet:
            return 0, [], None
        return self.answer(seconds)

    def answer(self, seconds: float) -> tuple[int, list[bytes], str | None]:
        """Read the answer to the request sent last, within `seconds`; as `exchange`."""
        if seconds != self._bound_for:
            self._bound(seconds)
        late = None
        while True:
            if self._pushback:
                status, result = self._unpush(time.monotonic() + seconds)
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

    def _bound(self, seconds: float | None) -> None:
        """Bound each send and receive on `sock` by `seconds` (None or huge: unbounded)."""
        sock = self.sock
        given = seconds
        # 0 is the kernel's "no timeout"
        seconds = 0.0 if seconds is None or seconds > FOREVER else max(seconds, 0.001)
        if seconds != self._sock_timeout:
            whole = int(seconds)
            timeval = _TIMEVAL.pack(whole, int((seconds - whole) * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            self._sock_timeout = seconds
        self._bound_for = given

    def _read_reply(self, seconds: float) -> tuple[int, list[bytes]]:
        sock = self.sock
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

    def _unpush(self, end_time: float) -> tuple[int, list[bytes]]:
        """Read an answer whose start came with the previous one."""
        sock = self.sock
        data, self._pushback = self._pushback, b""
        while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
            if time.monotonic() > end_time:
                raise TimeoutError
            more = sock.recv(1 << 16)
            if not more:
                raise PeerClosed
            data += more
        end = HEADER.size + HEADER.unpack_from(data)[0]
        self._pushback = data[end:]
        return HEADER.unpack_from(data)[1], decode_args(data, HEADER.size, end)
