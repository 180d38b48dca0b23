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
  than `max_pending` are waiting. A request left half-sent, or answers left unread, for
  `io_timeout` drop the connection, and TCP keep-alive finds peers whose host vanished.
  At start the server raises its process's open-file limit to the hard limit.
- Make it work quadratically. `append` grows the value in place; a request waiting for
  K keys watches one missing key at a time and moves on, O(K) over its life.

Queues are deques beside the keys. A `queue_pop` that finds its queue empty is parked
in the queue's line of poppers; a push hands its item to the first of them, so no
popper polls and no item is handed out twice. A WAIT counts a key with a non-empty queue
as set (a GET does not).

Warnings about misbehaving clients are rate-limited: one line per kind every 10 s, with
the number left out.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import resource
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from .. import auth
from ..errors import DistNetworkError, DistStoreError
from ..net import listen, set_keepalive
from .hash import KeysOrQueues, Values, add_value, compare_set_value
from .tcp_protocol import (
    HEADER,
    QUIET,
    SECONDS,
    Cmd,
    Limits,
    ProtocolError,
    Status,
    decode_args,
    encode_frame,
)

__all__ = ["StoreServer"]

log = logging.getLogger("distcomm.store")

_RECV_SIZE = 1 << 16  # a read of more is mapped and unmapped by malloc: 3 more system calls
_RECV_LARGE = 1 << 20  # the most read at once for the rest of a large request
_MAX_SLEEP = 3600.0  # epoll takes at most ~24.8 days; wake up hourly whatever the timers say
_IOV_MAX = 512  # buffers given to one sendmsg
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
_OK, _TIMEOUT = int(Status.OK), int(Status.TIMEOUT)
_GONE = select.EPOLLHUP | select.EPOLLERR


class _Conn:
    """One client connection and what the loop knows of it."""

    __slots__ = (
        "accepted",
        "authed",
        "blocked",
        "closed",
        "closing",
        "fd",
        "inbuf",
        "mask",
        "name",
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

    def __init__(self, sock: socket.socket, name: str, now: float) -> None:
        self.sock, self.name, self.fd = sock, name, sock.fileno()
        self.inbuf = bytearray()
        self.out: deque[bytes | memoryview] = deque()
        self.out_bytes = 0
        self.authed = self.closed = self.closing = self.blocked = False
        self.pending = True  # no complete request yet
        self.registered = False
        self.nonce = b""
        self.parked: _Waiter | None = None
        self.accepted = now
        self.partial_since: float | None = None  # a request has been half-received since
        self.out_since: float | None = None  # answers have waited unsent since
        self.timer_at: float | None = None
        self.mask = _IN


class _Waiter:
    """A parked request: the keys it waits for (or a worker count)."""

    __slots__ = ("cmd", "conn", "done", "keys", "next", "workers")

    def __init__(self, conn: _Conn, cmd: int, keys: list[bytes], workers: int = 0) -> None:
        self.conn, self.cmd, self.keys, self.workers = conn, cmd, keys, workers
        self.done = False
        self.next = 0  # keys before this index were set when last looked at


class _Throttle:
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
    #: Connections without a complete request yet; beyond it the oldest is dropped.
    max_pending = 1024
    #: Unread answer bytes above which a connection is not served until they drain.
    out_high_water = 4 << 20
    #: Requests served per connection per turn of the loop.
    frames_per_turn = 32

    def __init__(self, host: str, port: int, auth_key: bytes | None,
                 limits: Limits | None = None, listener: socket.socket | None = None) -> None:
        self._key = auth_key
        self.limits = limits or Limits.from_env()
        self._max_request = self.limits.max_request
        if listener is None:
            listener = listen(host, port, authenticated=auth_key is not None,
                              what="the TCPStore")
        else:
            try:
                listener.listen(1024)
            except OSError as exc:
                listener.close()
                raise DistNetworkError(
                    f"cannot listen on the socket given to the TCPStore: {exc.strerror}"
                ) from exc
        self._listener = listener
        self.port: int = self._listener.getsockname()[1]
        _raise_file_limit()
        self._wake_r, self._wake_w = socket.socketpair()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.setblocking(False)
        self._epoll = select.epoll()
        self._listen_fd, self._wake_fd = self._listener.fileno(), self._wake_r.fileno()
        self._epoll.register(self._listen_fd, _IN)
        self._epoll.register(self._wake_fd, _IN)
        self._conns: dict[int, _Conn] = {}
        self._pending: dict[_Conn, None] = {}  # oldest first
        self._data = Values()
        self._queues: dict[bytes, deque[bytes]] = {}  # only non-empty queues
        self._set_or_queued = KeysOrQueues(self._data, self._queues)  # what WAIT counts
        self._poppers: dict[bytes, dict[_Waiter, None]] = {}  # parked pops, oldest first
        self._watchers: dict[bytes, dict[_Waiter, None]] = {}
        self._worker_waiters: dict[_Waiter, None] = {}
        self._workers = 0
        self._timers: list[tuple[float, int, object]] = []
        self._compact_at = 1024
        self._seq = itertools.count()
        self._runnable: deque[_Conn] = deque()
        self._throttle = _Throttle()
        self._handlers: dict[int, Callable[[_Conn, list[bytes]], list[bytes] | None]] = {
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
        for fd, mask in self._epoll.poll(0.0 if self._runnable else self._sleep_time()):
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
        if self._timers and self._timers[0][0] <= time.monotonic():
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

    def _fault(self, conn: _Conn) -> None:
        """Serving `conn` raised: close that connection, not the server (in an except)."""
        self._throttle.warn(
            "internal", "TCPStore server: closing %s after an internal error", conn.name,
            exc_info=True,
        )
        self._close(conn)

    # -- timers: parked requests, connection watchdogs, a paused listener -----------------

    def _add_timer(self, when: float, item: object) -> None:
        heapq.heappush(self._timers, (when, next(self._seq), item))

    def _sleep_time(self) -> float:
        timers = self._timers
        if len(timers) > self._compact_at:  # drop the timers of answered requests
            self._timers = timers = [entry for entry in timers if self._live(entry[2])]
            heapq.heapify(timers)
            self._compact_at = max(1024, 2 * len(timers))
        if not timers:
            return _MAX_SLEEP
        return min(_MAX_SLEEP, max(0.0, timers[0][0] - time.monotonic()))

    @staticmethod
    def _live(item: object) -> bool:
        if isinstance(item, _Waiter):
            return not item.done
        if isinstance(item, _Conn):
            return not item.closed and item.timer_at is not None
        return True

    def _fire_timers(self) -> None:
        now = time.monotonic()
        timers = self._timers
        while timers and timers[0][0] <= now:
            when, _, item = heapq.heappop(timers)
            if isinstance(item, _Waiter):
                if not item.done:
                    self._finish(item, Status.TIMEOUT, self._timeout_args(item))
            elif isinstance(item, _Conn):
                if not item.closed and item.timer_at == when:
                    item.timer_at = None
                    self._watchdog(item, now)
            else:  # the listener, paused after running out of file descriptors
                self._epoll.register(self._listen_fd, _IN)

    def _arm(self, conn: _Conn, when: float) -> None:
        """Make sure `conn`'s watchdog runs at `when` or earlier."""
        if conn.timer_at is None or when < conn.timer_at:
            conn.timer_at = when
            self._add_timer(when, conn)

    def _watchdog(self, conn: _Conn, now: float) -> None:
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

    def _timeout_args(self, waiter: _Waiter) -> list[bytes]:
        if waiter.cmd == Cmd.WAIT_WORKERS:
            return [str(self._workers).encode()]
        if waiter.cmd == Cmd.QUEUE_POP:
            return waiter.keys
        present = self._set_or_queued if waiter.cmd == Cmd.WAIT else self._data
        return [key for key in waiter.keys if key not in present]

    # -- connections ----------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, address = self._listener.accept()
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
                self._add_timer(time.monotonic() + 0.1, "listener")
                return
            try:
                self._admit(sock, address)
            except OSError:
                sock.close()

    def _admit(self, sock: socket.socket, address: tuple) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_keepalive(sock)
        now = time.monotonic()
        if len(self._pending) >= self.max_pending:
            oldest = next(iter(self._pending))
            self._throttle.warn(
                "pending", "TCPStore server: more than %d connections without a request; "
                "dropping the oldest, %s", self.max_pending, oldest.name,
            )
            self._close(oldest)
        conn = _Conn(sock, f"store client {address[0]}:{address[1]}", now)
        self._conns[conn.fd] = conn
        self._pending[conn] = None
        self._epoll.register(conn.fd, _IN)
        hello, conn.nonce = auth.hello_message(self._key)
        conn.authed = self._key is None
        self._arm(conn, now + self.handshake_timeout)
        self._queue(conn, [hello])
        self._flush(conn)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        del self._conns[conn.fd]
        self._pending.pop(conn, None)
        if conn.parked is not None:
            self._unpark(conn.parked)
        try:
            self._epoll.unregister(conn.fd)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock.close()
        conn.out.clear()
        conn.inbuf = bytearray()

    def _on_readable(self, conn: _Conn) -> None:
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

    def _on_proof(self, conn: _Conn, data: bytes) -> None:
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
            self._close(conn)
            return
        conn.authed = True
        self._queue(conn, [accept])
        self._flush(conn)

    def _process(self, conn: _Conn) -> None:
        """Serve what is buffered on `conn` (after a park ended or the queue drained)."""
        inbuf = conn.inbuf
        if inbuf:
            used = self._serve(conn, inbuf)
            if used:
                del inbuf[:used]
        self._settle(conn)

    def _settle(self, conn: _Conn) -> None:
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

    def _want(self, conn: _Conn, read: bool, write: bool) -> None:
        mask = (_IN if read else 0) | (_OUT if write else 0)
        if mask != conn.mask:
            conn.mask = mask
            self._epoll.modify(conn.fd, mask)

    # -- answers --------------------------------------------------------------------------

    def _queue(self, conn: _Conn, parts: list[bytes]) -> None:
        if not conn.closed:
            conn.out.extend(parts)
            for part in parts:
                conn.out_bytes += len(part)

    def _reply(self, conn: _Conn, status: int, args: list[bytes]) -> None:
        parts = encode_frame(status, args)
        if len(parts) == 1:
            conn.out.append(parts[0])
            conn.out_bytes += len(parts[0])
        else:
            self._queue(conn, parts)

    def _flush(self, conn: _Conn) -> None:
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

    def _refuse(self, conn: _Conn, message: str) -> None:
        """Answer ERROR, then close once the answer is out (nothing more is read)."""
        self._throttle.warn("refuse", "TCPStore server: closing %s: %s", conn.name, message)
        self._reply(conn, Status.ERROR, [message.encode()])
        conn.closing = True
        conn.inbuf = bytearray()

    # -- requests -------------------------------------------------------------------------

    def _serve(self, conn: _Conn, buf: bytes | bytearray) -> int:
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

    def _check_keys(self, keys: list[bytes]) -> None:
        limits = self.limits
        if len(keys) > limits.max_keys:
            raise DistStoreError(f"{len(keys):,} keys in one request; the limit is "
                                 f"{limits.max_keys:,}")
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

    def _park(self, conn: _Conn, waiter: _Waiter, seconds: float) -> None:
        conn.parked = waiter
        self._add_timer(time.monotonic() + seconds, waiter)  # inf: never fires

    def _watch(self, waiter: _Waiter) -> bool:
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

    def _unpark(self, waiter: _Waiter) -> None:
        waiter.done = True
        waiter.conn.parked = None
        if waiter.cmd == Cmd.WAIT_WORKERS:
            self._worker_waiters.pop(waiter, None)
        elif waiter.cmd == Cmd.QUEUE_POP:
            key = waiter.keys[0]
            line = self._poppers.get(key)
            if line is not None:
                line.pop(waiter, None)
                if not line:
                    del self._poppers[key]
        elif waiter.next < len(waiter.keys):
            key = waiter.keys[waiter.next]
            waiting = self._watchers.get(key)
            if waiting is not None:
                waiting.pop(waiter, None)
                if not waiting:
                    del self._watchers[key]

    def _finish(self, waiter: _Waiter, status: int, args: list[bytes]) -> None:
        self._unpark(waiter)
        conn = waiter.conn
        self._reply(conn, status, args)
        if conn.inbuf:
            self._runnable.append(conn)  # requests came after it: serve them in turn
        else:
            self._settle(conn)  # answer now

    def _changed(self, key: bytes) -> None:
        """Move on the requests watching `key`; answer those whose keys are all set."""
        waiting = self._watchers.pop(key, None)
        if waiting is None:
            return
        for waiter in waiting:
            if not waiter.done and self._watch(waiter):
                self._finish(waiter, Status.OK, self._results(waiter))

    def _results(self, waiter: _Waiter) -> list[bytes]:
        if waiter.cmd == Cmd.WAIT:
            return []
        data = self._data
        return [data[key] for key in waiter.keys]

    def _do_register(self, conn: _Conn, args: list[bytes]) -> list[bytes]:
        if not conn.registered:  # once per connection, however often it asks
            conn.registered = True
            self._workers += 1
            for waiter in list(self._worker_waiters):
                if self._workers >= waiter.workers:
                    self._finish(waiter, Status.OK, [str(self._workers).encode()])
        return [str(self._workers).encode(), *self.limits.encode()]

    def _do_wait_workers(self, conn: _Conn, args: list[bytes]) -> list[bytes] | None:
        raw, count = args
        seconds, wanted = self._seconds(raw), int(count)
        if self._workers >= wanted:
            return [str(self._workers).encode()]
        waiter = _Waiter(conn, Cmd.WAIT_WORKERS, [], wanted)
        self._worker_waiters[waiter] = None
        self._park(conn, waiter, seconds)
        return None

    def _do_set(self, conn: _Conn, args: list[bytes]) -> None:
        key, value = args
        if len(key) > self.limits.max_key:
            self._check_keys([key])
        self._check_value(value)
        self._data[key] = value
        if key in self._watchers:
            self._changed(key)

    def _do_get(self, conn: _Conn, args: list[bytes]) -> list[bytes] | None:
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

    def _do_wait(self, conn: _Conn, args: list[bytes]) -> list[bytes] | None:
        raw, *keys = args
        seconds = self._seconds(raw)
        self._check_keys(keys)
        return self._wait_for(conn, Cmd.WAIT, keys, seconds)

    def _wait_for(self, conn: _Conn, cmd: int, keys: list[bytes],
                  seconds: float) -> list[bytes] | None:
        waiter = _Waiter(conn, cmd, keys)
        if self._watch(waiter):
            return self._results(waiter)
        if seconds == 0:  # nothing to wait for: answer at once
            self._unpark(waiter)
            self._reply(conn, Status.TIMEOUT, self._timeout_args(waiter))
            return None
        self._park(conn, waiter, seconds)
        return None

    def _do_add(self, conn: _Conn, args: list[bytes]) -> list[bytes]:
        key, amount = args
        if len(key) > self.limits.max_key:
            self._check_keys([key])
        value = add_value(key, self._data.get(key), int(amount))
        self._data[key] = value
        if key in self._watchers:
            self._changed(key)
        return [value]

    def _do_compare_set(self, conn: _Conn, args: list[bytes]) -> list[bytes]:
        key, expected, desired = args
        self._check_keys([key])
        self._check_value(desired)
        new, result = compare_set_value(self._data.get(key), expected, desired)
        if new is not None:
            self._data[key] = new
            if key in self._watchers:
                self._changed(key)
        return [result]

    def _do_check(self, conn: _Conn, args: list[bytes]) -> list[bytes]:
        self._check_keys(args)
        data = self._set_or_queued
        return [b"\x01" if all(key in data for key in args) else b"\x00"]

    def _do_delete_key(self, conn: _Conn, args: list[bytes]) -> list[bytes]:
        (key,) = args
        return [b"\x01" if self._data.delete(key) else b"\x00"]

    def _do_num_keys(self, conn: _Conn, args: list[bytes]) -> list[bytes]:
        return [str(len(self._data)).encode()]

    def _do_multi_set(self, conn: _Conn, args: list[bytes]) -> None:
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

    def _do_append(self, conn: _Conn, args: list[bytes]) -> None:
        key, value = args
        self._check_keys([key])
        self._check_value(value)
        self._data.append(key, value)
        if key in self._watchers:
            self._changed(key)

    def _do_list_keys(self, conn: _Conn, args: list[bytes]) -> list[bytes]:
        return list(self._data.keys())

    def _do_queue_push(self, conn: _Conn, args: list[bytes]) -> None:
        key, value = args
        self._check_keys([key])
        self._check_value(value)
        line = self._poppers.get(key)
        if line:  # a pop is waiting: the item goes to the oldest, never into the queue
            self._finish(next(iter(line)), _OK, [value])
            return
        items = self._queues.get(key)
        if items is None:
            items = self._queues[key] = deque()
        items.append(value)
        if key in self._watchers:
            self._changed(key)

    def _do_queue_pop(self, conn: _Conn, args: list[bytes]) -> list[bytes] | None:
        raw, key = args
        seconds = self._seconds(raw)
        self._check_keys([key])
        items = self._queues.get(key)
        if items:
            value = items.popleft()
            if not items:
                del self._queues[key]
            return [value]
        if seconds == 0:
            return []  # empty
        waiter = _Waiter(conn, Cmd.QUEUE_POP, [key])
        self._poppers.setdefault(key, {})[waiter] = None
        self._park(conn, waiter, seconds)
        return None

    def _do_queue_len(self, conn: _Conn, args: list[bytes]) -> list[bytes]:
        (key,) = args
        self._check_keys([key])
        items = self._queues.get(key)
        return [str(0 if items is None else len(items)).encode()]


def _raise_file_limit() -> None:
    """Raise this process's soft open-file limit to its hard limit (a store serves many)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        pass
