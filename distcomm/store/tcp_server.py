"""The TCPStore server: one epoll event loop in a daemon thread, which no client can break.

The protocol is `tcp_protocol`'s. Every connection starts with the handshake of
`distcomm.auth` (the server's side runs inside the loop: nothing but the client's proof is
read until it verifies). What a client, buggy or hostile, cannot do:

- Stop the server. A fault while serving one connection closes that connection; a fault
  in the loop itself is logged and the loop goes on. Timeouts of any size, infinite
  included, are served: the loop never sleeps more than an hour at a time.
- Exhaust its memory. A request whose header declares more than `Limits.max_request`
  bytes is refused before its body is read, and the connection closed; keys and values
  over their limits are refused. A connection whose unread answers exceed
  `out_high_water` bytes is neither read from nor served until they drain, and each
  connection is served at most `frames_per_turn` requests per turn of the loop.
- Hold descriptors. A connection that has not sent a complete request (the handshake
  included) within `handshake_timeout` is dropped; so is the oldest of them when more
  than `max_pending` are waiting (half the open-file limit: thousands of clients
  connecting at once are a job starting, not an attack). A request left half-sent, or
  answers left unread, for `io_timeout` drop the connection, and TCP keep-alive finds
  peers whose host vanished. At start the server raises its process's open-file limit to
  the hard limit.
- Make it work quadratically. `append` grows the value in place; a request waiting for
  K keys watches one missing key at a time and moves on, O(K) over its life.

This module is the loop: it accepts (every connection waiting, in one turn: it listens
with the kernel's largest backlog, so that a whole job connecting at once waits there;
without a key it reads a new connection at once, where the client's REGISTER usually
waits already, so that the answer leaves with the greeting, and with a key it reads on
after a verified proof for the same reason), reads, hands each request to the handlers
of `tcp_state.ServerState` (the keys, the queues and the requests parked on them), and
sends the answers; `tcp_conn` keeps its record of each connection and its timers.
Queues are deques beside the keys. A `queue_pop` that finds its queue empty is parked in
the queue's line of poppers; a push hands its item to the first of them, so no popper
polls and no item is handed out twice.
A WAIT counts a key with a non-empty queue as set (a GET does not).

Warnings about misbehaving clients are rate-limited: one line per kind every 10 s, with
the number left out.
"""

from __future__ import annotations

import itertools
import select
import socket
import threading
import time
from collections import deque

from .. import auth
from ..errors import DistNetworkError, DistStoreError
from ..net import listen, listen_backlog, raise_file_limit, set_keepalive
from .tcp_conn import Conn, Throttle, Timers
from .tcp_protocol import (
    HEADER,
    QUIET,
    Cmd,
    Limits,
    ProtocolError,
    Status,
    decode_args,
    encode_frame,
)
from .tcp_state import ServerState, Waiter

__all__ = ["StoreServer"]

_RECV_SIZE = 1 << 16  # a read of more is mapped and unmapped by malloc: 3 more system calls
_RECV_LARGE = 1 << 20  # the most read at once for the rest of a large request
_MAX_SLEEP = 3600.0  # epoll takes at most ~24.8 days; wake up hourly whatever the timers say
_IOV_MAX = 512  # buffers given to one sendmsg
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
_OK = int(Status.OK)
_GONE = select.EPOLLHUP | select.EPOLLERR


class StoreServer:
    """The TCPStore server: binds `host:port` at once; `start()` runs its thread.

    Args:
        host: the address to bind, exactly ("0.0.0.0" for every interface).
        port: the port; 0 picks a free one (see `port`).
        auth_key: the key clients must prove they hold, or None.
        limits: what one request may carry (default: DISTCOMM_STORE_MAX_* or torch's).
        listener: a bound TCP socket to serve on instead of binding `host:port` (it is
            made to listen; the server closes it when it stops).

    Raises:
        DistNetworkError: the address cannot be bound.
    """

    #: Seconds a connection may take to complete its first request (handshake included).
    handshake_timeout = 10.0
    #: Seconds a request may stay half-received, or answers unread, before the drop.
    io_timeout = 60.0
    #: Connections without a complete request yet; beyond it the oldest is dropped. None:
    #: half the open-file limit (at least 1024), so that a job whose clients all connect
    #: at once is served, and a client that hoards connections still leaves half of them.
    max_pending: int | None = None
    #: Unread answer bytes above which a connection is not served until they drain.
    out_high_water = 4 << 20
    #: Requests served per connection per turn of the loop.
    frames_per_turn = 32

    def __init__(self, host: str, port: int, auth_key: bytes | None,
                 limits: Limits | None = None, listener: socket.socket | None = None) -> None:
        self._key = auth_key
        self._open_hello = auth.hello_message(None)[0]  # the greeting when no key is set
        self.limits = limits or Limits.from_env()
        self._max_request = self.limits.max_request
        self._backlog = listen_backlog()
        # a listener of our own hands its options to every connection it accepts (Linux
        # copies them), which saves five system calls a connection; a socket the caller
        # gave (`listener`), which it shares, is left as it is
        self._inherited = listener is None
        if listener is None:
            listener = listen(host, port, self._backlog, authenticated=auth_key is not None,
                              what="the TCPStore")
            _tune(listener)
        else:
            try:
                listener.listen(self._backlog)
            except OSError as exc:
                listener.close()
                raise DistNetworkError(
                    f"cannot listen on the socket given to the TCPStore: {exc.strerror}"
                ) from exc
        self._listener = listener
        self.port: int = self._listener.getsockname()[1]
        self._pending_cap = max(1024, raise_file_limit() // 2)
        self._wake_r, self._wake_w = socket.socketpair()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.setblocking(False)
        self._epoll = select.epoll()
        self._listen_fd, self._wake_fd = self._listener.fileno(), self._wake_r.fileno()
        self._epoll.register(self._listen_fd, _IN)
        self._epoll.register(self._wake_fd, _IN)
        self._conns: dict[int, Conn] = {}
        self._pending: dict[Conn, None] = {}  # oldest first
        self._timers = Timers(self._live, _MAX_SLEEP)
        self._runnable: deque[Conn] = deque()
        self._throttle = Throttle()
        self._state = ServerState(self.limits, self._reply, self._answered, self._timers.add)
        self._handlers = self._state.handlers
        # the state's own dicts, also reachable from the server for inspection
        self._queues, self._poppers = self._state.queues, self._state.poppers
        self._stopping = False
        self._cleaned = False
        self._thread = threading.Thread(
            target=self._run, name=f"distcomm-store-server-{self.port}", daemon=True
        )

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Run the event loop in its daemon thread."""
        self._thread.start()

    @property
    def stopped(self) -> bool:
        """Whether `stop` was called."""
        return self._stopping

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop, close every socket and join the thread (idempotent)."""
        self._stopping = True
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        if threading.current_thread() is self._thread:
            return  # garbage collected on the loop's own thread: it exits on its next turn
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self._thread.ident is None:
            self._cleanup()

    def _cleanup(self) -> None:
        if self._cleaned:
            return
        self._cleaned = True
        for conn in list(self._conns.values()):
            self._close(conn)
        self._epoll.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def _run(self) -> None:
        faults = 0
        try:
            while not self._stopping:
                try:
                    self._turn()
                    faults = 0
                except Exception:
                    faults += 1
                    self._throttle.warn(
                        "loop", "TCPStore server on port %d: internal error in its event loop; "
                        "serving on", self.port, exc_info=True,
                    )
                    time.sleep(min(0.5, 0.001 * faults))  # never spin on a lasting fault
        finally:
            self._cleanup()

    def _turn(self) -> None:
        """One turn: wait for events or the next timer, serve, fire timers, run the queue."""
        conns = self._conns
        for fd, mask in self._epoll.poll(0.0 if self._runnable else self._timers.sleep_time()):
            conn = conns.get(fd)
            if conn is None:
                if fd == self._listen_fd:
                    self._accept()
                elif fd == self._wake_fd:
                    self._drain_wakeups()
            elif mask & _GONE:
                self._close(conn)  # reset, or gone both ways: nobody reads answers any more
            else:
                try:
                    if mask & _IN:
                        self._on_readable(conn)
                    if mask & _OUT and not conn.closed:
                        self._flush(conn)
                except Exception:
                    self._fault(conn)
        if self._timers.due():
            self._fire_timers()
        runnable = self._runnable
        for _ in range(len(runnable)):
            conn = runnable.popleft()
            if not conn.closed:
                try:
                    self._process(conn)
                except Exception:
                    self._fault(conn)

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _fault(self, conn: Conn) -> None:
        """Serving `conn` raised: close that connection, not the server (in an except)."""
        self._throttle.warn(
            "internal", "TCPStore server: closing %s after an internal error", conn.name,
            exc_info=True,
        )
        self._close(conn)

    # -- timers: parked requests, connection watchdogs, a paused listener -----------------

    @staticmethod
    def _live(item: object) -> bool:
        if isinstance(item, Waiter):
            return not item.done
        if isinstance(item, Conn):
            return not item.closed and item.timer_at is not None
        return True

    def _fire_timers(self) -> None:
        now = time.monotonic()
        while (due := self._timers.pop_due(now)) is not None:
            when, item = due
            if isinstance(item, Waiter):
                self._state.expire(item)
            elif isinstance(item, Conn):
                if not item.closed and item.timer_at == when:
                    item.timer_at = None
                    self._watchdog(item, now)
            else:  # the listener, paused after running out of file descriptors
                self._epoll.register(self._listen_fd, _IN)

    def _arm(self, conn: Conn, when: float) -> None:
        """Make sure `conn`'s watchdog runs at `when` or earlier."""
        if conn.timer_at is None or when < conn.timer_at:
            conn.timer_at = when
            self._timers.add(when, conn)

    def _watchdog(self, conn: Conn, now: float) -> None:
        """Drop `conn` if it overstayed a limit; else re-arm for the next one that applies."""
        checks = []
        if conn.pending:
            checks.append((conn.accepted + self.handshake_timeout,
                           f"no complete request within {self.handshake_timeout:g} s of "
                           "connecting"))
        if conn.partial_since is not None:
            checks.append((conn.partial_since + self.io_timeout,
                           f"a request left half-sent for {self.io_timeout:g} s"))
        if conn.out_since is not None:
            checks.append((conn.out_since + self.io_timeout,
                           f"answers left unread for {self.io_timeout:g} s"))
        for due, why in checks:
            if due <= now:
                self._throttle.warn("drop", "TCPStore server: dropping %s: %s", conn.name, why)
                self._close(conn)
                return
        if checks:
            self._arm(conn, min(due for due, _ in checks))

    # -- connections ----------------------------------------------------------------------

    def _accept(self) -> None:
        """Accept every connection waiting (epoll said there is one): until EAGAIN, or a
        backlog's worth, after which the loop serves the others before it goes on."""
        listener, admit = self._listener, self._admit
        for _ in range(self._backlog):
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, typically
                self._throttle.warn(
                    "accept", "TCPStore server on port %d cannot accept connections (%s); "
                    "pausing for 0.1 s and dropping the oldest connection without a request",
                    self.port, exc,
                )
                if self._pending:
                    self._close(next(iter(self._pending)))
                self._epoll.unregister(self._listen_fd)
                self._timers.add(time.monotonic() + 0.1, "listener")
                return
            try:
                admit(sock, address)
            except OSError:
                sock.close()

    def _admit(self, sock: socket.socket, address: tuple) -> None:
        sock.setblocking(False)
        if not self._inherited:
            _tune(sock)
        now = time.monotonic()
        cap = self.max_pending or self._pending_cap
        if len(self._pending) >= cap:
            oldest = next(iter(self._pending))
            self._throttle.warn(
                "pending", "TCPStore server: more than %d connections without a request; "
                "dropping the oldest, %s", cap, oldest.name,
            )
            self._close(oldest)
        conn = Conn(sock, address, now)
        self._conns[conn.fd] = conn
        self._pending[conn] = None
        self._epoll.register(conn.fd, _IN)
        if self._key is None:  # no proof to come: the greeting's nonce is never used
            conn.authed = True
            conn.out.append(self._open_hello)
            conn.out_bytes = len(self._open_hello)
            try:
                # a keyless client sends its REGISTER without waiting for the greeting (it is
                # usually here by now): serve it, and its answer goes out with the greeting
                self._on_readable(conn)
            except Exception:
                self._fault(conn)
                return
        else:
            hello, conn.nonce = auth.hello_message(self._key)
            self._queue(conn, [hello])
        if conn.closed:
            return
        if conn.out:
            self._flush(conn)
        if conn.pending and not conn.closed:
            self._arm(conn, now + self.handshake_timeout)

    def _close(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        del self._conns[conn.fd]
        self._pending.pop(conn, None)
        if conn.parked is not None:
            self._state.unpark(conn.parked)
        try:
            self._epoll.unregister(conn.fd)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock.close()
        conn.out.clear()
        conn.inbuf = bytearray()

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
                "auth", "TCPStore server: %s failed authentication (wrong DISTCOMM_AUTH_KEY?); "
                "closing it", conn.name,
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
                self._refuse(conn, (
                    f"a request of {size:,} bytes is over the limit of {self._max_request:,} "
                    "(DISTCOMM_STORE_MAX_VALUE_BYTES, plus 1 MiB, on the process hosting "
                    "the store)"
                ))
                return size_buf
            end = pos + 5 + size
            if end > size_buf:
                break
            served += 1
            try:
                handler = handlers.get(code)
                if handler is None:
                    raise ProtocolError(f"unknown store command {code} (client newer than "
                                        "server?)")
                result = handler(conn, decode_args(buf, pos + 5, end))
            except (DistStoreError, ValueError, IndexError, TypeError, OverflowError) as exc:
                message = str(exc) if isinstance(exc, DistStoreError) else (
                    f"malformed {Cmd(code).name} request: {exc}")
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


def _tune(sock: socket.socket) -> None:
    """No Nagle delay, and keep-alive to notice a client whose host vanished."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    set_keepalive(sock)

