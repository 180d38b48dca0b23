"""The bytes of one TCPStore server connection: its requests in, its answers out.

`Serving` is the half of `server.StoreServer` that works on one connection at a time: it
reads (the client's proof first, while `distcomm.auth`'s handshake is not done, then
frames), serves every complete request at the start of the buffer through the handlers of
`state.ServerState`, queues the answers and sends them, in one system call where the
kernel takes them all. It applies the per-connection limits of the threat model stated in
`server`: a request over `Limits.max_request` is refused before its body is read, a
connection whose unread answers pass `out_high_water` is not served until they drain, and
each connection is served at most `frames_per_turn` requests per turn of the loop. Which
connections exist, their watchdogs and when they close are the loop's (`server`).
"""

from __future__ import annotations

import itertools
import select
import time
from collections import deque
from collections.abc import Callable

from ... import auth
from ...errors import DistStoreError
from .bookkeeping import Conn, Throttle
from .protocol import HEADER, QUIET, Cmd, ProtocolError, Status, decode_args, encode_frame

__all__ = ["Serving"]

_RECV_SIZE = 1 << 16  # a read of more is mapped and unmapped by malloc: 3 more system calls
_RECV_LARGE = 1 << 20  # the most read at once for the rest of a large request
_IOV_MAX = 512  # buffers given to one sendmsg
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
_OK = int(Status.OK)


class Serving:
    """Reading, serving and answering one connection: a mixin of `server.StoreServer`.

    The server sets what this reads: `_key` (the auth key, or None), `_epoll`, `_handlers`
    (command -> handler, from `state.ServerState`), `_max_request`, `_pending` (the
    connections without a complete request yet), `_runnable` (connections to serve again
    on the next turn), `_throttle`, and the limits `io_timeout`, `out_high_water` and
    `frames_per_turn`; and it provides `_arm` (a connection's watchdog) and `_close`.
    """

    _key: bytes | None
    _epoll: select.epoll
    _handlers: dict[int, Callable]
    _max_request: int
    _pending: dict[Conn, None]
    _runnable: deque[Conn]
    _throttle: Throttle
    io_timeout: float
    out_high_water: int
    frames_per_turn: int

    def _arm(self, conn: Conn, when: float) -> None:
        raise NotImplementedError  # the server's: its watchdogs

    def _close(self, conn: Conn) -> None:
        raise NotImplementedError  # the server's: it knows every connection

    def _on_readable(self, conn: Conn) -> None:
        inbuf = conn.inbuf
        if not conn.authed:
            want = auth.PROOF_SIZE - len(inbuf)
        elif len(inbuf) >= HEADER.size:  # the rest of a request: in one read, if large
            rest = HEADER.size + HEADER.unpack_from(inbuf)[0] - len(inbuf)
            want = min(max(rest, _RECV_SIZE), _RECV_LARGE)
        else:
            want = _RECV_SIZE
        try:
            data = conn.sock.recv(want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        if not conn.authed:
            self._on_proof(conn, data)
            return
        if inbuf:
            inbuf += data
            used = self._serve(conn, inbuf)
            del inbuf[:used]
        else:  # the common case: serve straight from what was read
            used = self._serve(conn, data)
            if used < len(data):
                inbuf += memoryview(data)[used:]
        self._settle(conn)

    def _on_proof(self, conn: Conn, data: bytes) -> None:
        conn.inbuf += data
        if len(conn.inbuf) < auth.PROOF_SIZE:
            return
        accept = auth.verify_proof(self._key or b"", conn.nonce, bytes(conn.inbuf))
        conn.inbuf.clear()
        if accept is None:
            self._throttle.warn(
                "auth",
                "TCPStore server: %s failed authentication (wrong DISTCOMM_AUTH_KEY?); closing it",
                conn.name,
            )
            try:  # the request sent with the proof, unread, would make the close a reset,
                conn.sock.recv(_RECV_SIZE)  # which the client takes for a shed connection
            except OSError:
                pass
            self._close(conn)
            return
        conn.authed = True
        self._queue(conn, [accept])
        # a client sends its first request with the proof: serve it now, so that its answer
        # goes out with the ACCEPT, in one send
        self._on_readable(conn)
        if conn.out and not conn.closed:
            self._flush(conn)

    def _process(self, conn: Conn) -> None:
        """Serve what is buffered on `conn` (after a park ended or the queue drained)."""
        inbuf = conn.inbuf
        if inbuf:
            used = self._serve(conn, inbuf)
            if used:
                del inbuf[:used]
        self._settle(conn)

    def _settle(self, conn: Conn) -> None:
        """After serving: send the answers, then set the events and the watchdog to match."""
        if conn.closed:
            return
        if conn.out:
            self._flush(conn)
            if conn.closed:
                return
        inbuf = conn.inbuf
        if not inbuf and conn.mask == _IN and not conn.out:  # the common case: all served
            conn.partial_since = None
            return
        complete = False
        if len(inbuf) >= HEADER.size:
            complete = len(inbuf) >= HEADER.size + HEADER.unpack_from(inbuf)[0]
        if inbuf and not complete:
            if conn.partial_since is None:
                conn.partial_since = now = time.monotonic()
                self._arm(conn, now + self.io_timeout)
        else:
            conn.partial_since = None
        # a complete request still buffered waits for a park, the answers or the next turn:
        # read no more until it is served
        self._want(conn, not complete and not conn.closing, bool(conn.out))

    def _want(self, conn: Conn, read: bool, write: bool) -> None:
        mask = (_IN if read else 0) | (_OUT if write else 0)
        if mask != conn.mask:
            conn.mask = mask
            self._epoll.modify(conn.fd, mask)

    # -- answers --------------------------------------------------------------------------

    def _queue(self, conn: Conn, parts: list[bytes]) -> None:
        if not conn.closed:
            conn.out.extend(parts)
            for part in parts:
                conn.out_bytes += len(part)

    def _reply(self, conn: Conn, status: int, args: list[bytes]) -> None:
        parts = encode_frame(status, args)
        if len(parts) == 1:
            conn.out.append(parts[0])
            conn.out_bytes += len(parts[0])
        else:
            self._queue(conn, parts)

    def _answered(self, conn: Conn) -> None:
        """A parked request of `conn` got its answer: send it, or serve what came after."""
        if conn.inbuf:
            self._runnable.append(conn)  # requests came after it: serve them in turn
        else:
            self._settle(conn)  # answer now

    def _flush(self, conn: Conn) -> None:
        """Send what `conn` has queued, in one system call where the kernel takes it all."""
        out = conn.out
        sock = conn.sock
        if len(out) == 1 and not conn.closing and conn.mask == _IN:  # the common case
            head = out[0]
            try:
                sent = sock.send(head)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close(conn)
                return
            if sent == len(head):
                out.clear()
                conn.out_bytes = 0
                conn.out_since = None
                if conn.blocked:
                    conn.blocked = False
                    self._runnable.append(conn)
                return
            conn.out_bytes -= sent
            out[0] = memoryview(head)[sent:]
        while out:
            try:
                if len(out) == 1:
                    sent = sock.send(out[0])
                else:
                    sent = sock.sendmsg(list(itertools.islice(out, _IOV_MAX)))
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(conn)
                return
            conn.out_bytes -= sent
            while out and sent >= len(out[0]):  # empty pieces (an empty value) go too
                sent -= len(out[0])
                out.popleft()
            if sent:
                out[0] = memoryview(out[0])[sent:]
            if out:
                conn.out_since = time.monotonic()  # progress: the clock starts again
        if out:
            if conn.out_since is None:
                conn.out_since = time.monotonic()
            self._arm(conn, conn.out_since + self.io_timeout)
            if not conn.mask & _OUT:
                self._want(conn, bool(conn.mask & _IN), True)
            return
        conn.out_since = None
        if conn.closing:
            self._close(conn)
            return
        if conn.mask & _OUT:
            self._want(conn, bool(conn.mask & _IN), False)
        if conn.blocked:
            conn.blocked = False
            self._runnable.append(conn)

    def _refuse(self, conn: Conn, message: str) -> None:
        """Answer ERROR, then close once the answer is out (nothing more is read)."""
        self._throttle.warn("refuse", "TCPStore server: closing %s: %s", conn.name, message)
        self._reply(conn, Status.ERROR, [message.encode()])
        conn.closing = True
        conn.inbuf = bytearray()

    # -- requests -------------------------------------------------------------------------

    def _serve(self, conn: Conn, buf: bytes | bytearray) -> int:
        """Serve the complete requests at the start of `buf`; returns the bytes used."""
        pos, size_buf, served = 0, len(buf), 0
        handlers, high_water, turn = self._handlers, self.out_high_water, self.frames_per_turn
        while size_buf - pos >= 5 and conn.parked is None and not conn.closing:
            if conn.out_bytes > high_water:
                conn.blocked = True  # served again once the answers drain
                break
            if served == turn:
                self._runnable.append(conn)  # the others' turn first
                break
            size, code = HEADER.unpack_from(buf, pos)
            if size > self._max_request:
                self._refuse(
                    conn,
                    (
                        f"a request of {size:,} bytes is over the limit of {self._max_request:,} "
                        "(DISTCOMM_STORE_MAX_VALUE_BYTES, plus 1 MiB, on the process hosting "
                        "the store)"
                    ),
                )
                return size_buf
            end = pos + 5 + size
            if end > size_buf:
                break
            served += 1
            try:
                handler = handlers.get(code)
                if handler is None:
                    raise ProtocolError(f"unknown store command {code} (client newer than server?)")
                result = handler(conn, decode_args(buf, pos + 5, end))
            except (DistStoreError, ValueError, IndexError, TypeError, OverflowError) as exc:
                message = (
                    str(exc)
                    if isinstance(exc, DistStoreError)
                    else (f"malformed {Cmd(code).name} request: {exc}")
                )
                status = Status.LATE_ERROR if code in QUIET else Status.ERROR
                self._reply(conn, status, [message.encode()])
            else:
                if result is not None:
                    self._reply(conn, _OK, result)
            pos = end
        if served and conn.pending:
            conn.pending = False
            del self._pending[conn]
        return pos
