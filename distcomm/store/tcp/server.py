"""The TCPStore server: one epoll event loop in a daemon thread, which no client can break.

The protocol is `protocol`'s. Every connection starts with the handshake of
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
after a verified proof for the same reason), watches each connection's deadlines and
closes it; `serving.Serving` reads each connection, hands each request to the handlers
of `state.ServerState` (the keys, the queues and the requests parked on them), and
sends the answers; `bookkeeping` keeps its record of each connection and its timers.
Queues are deques beside the keys. A `queue_pop` that finds its queue empty is parked in
the queue's line of poppers; a push hands its item to the first of them, so no popper
polls and no item is handed out twice.
A WAIT counts a key with a non-empty queue as set (a GET does not).

Warnings about misbehaving clients are rate-limited: one line per kind every 10 s, with
the number left out.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections import deque

from ... import auth
from ...errors import DistNetworkError
from ...net import listen, listen_backlog, raise_file_limit, set_keepalive
from .bookkeeping import Conn, Throttle, Timers
from .protocol import Limits
from .serving import Serving
from .state import ServerState, Waiter

__all__ = ["StoreServer"]

_MAX_SLEEP = 3600.0  # epoll takes at most ~24.8 days; wake up hourly whatever the timers say
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
_GONE = select.EPOLLHUP | select.EPOLLERR


class StoreServer(Serving):
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

    def __init__(
        self,
        host: str,
        port: int,
        auth_key: bytes | None,
        limits: Limits | None = None,
        listener: socket.socket | None = None,
    ) -> None:
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
            listener = listen(
                host, port, self._backlog, authenticated=auth_key is not None, what="the TCPStore"
            )
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
                        "loop",
                        "TCPStore server on port %d: internal error in its event loop; serving on",
                        self.port,
                        exc_info=True,
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
            "internal",
            "TCPStore server: closing %s after an internal error",
            conn.name,
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
            checks.append(
                (
                    conn.accepted + self.handshake_timeout,
                    f"no complete request within {self.handshake_timeout:g} s of connecting",
                )
            )
        if conn.partial_since is not None:
            checks.append(
                (
                    conn.partial_since + self.io_timeout,
                    f"a request left half-sent for {self.io_timeout:g} s",
                )
            )
        if conn.out_since is not None:
            checks.append(
                (conn.out_since + self.io_timeout, f"answers left unread for {self.io_timeout:g} s")
            )
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
                    "accept",
                    "TCPStore server on port %d cannot accept connections (%s); "
                    "pausing for 0.1 s and dropping the oldest connection without a request",
                    self.port,
                    exc,
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
                "pending",
                "TCPStore server: more than %d connections without a request; "
                "dropping the oldest, %s",
                cap,
                oldest.name,
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


def _tune(sock: socket.socket) -> None:
    """No Nagle delay, and keep-alive to notice a client whose host vanished."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    set_keepalive(sock)
