"""The TCPStore wire protocol and its server: one selectors event loop in a daemon thread.

Every connection starts with the handshake of `distcomm.auth` (the server's side runs
inside the event loop: nothing but the client's proof is read until it verifies), then
carries frames, one request answered by one response, in order::

    request  = body length (u32 LE) + command (u8) + body
    response = body length (u32 LE) + status  (u8) + body
    body     = zero or more arguments, each a length (u32 LE) + bytes

Keys and values are raw bytes; the server never unpickles or evaluates anything.
Waiting commands (GET, MULTI_GET, WAIT, WAIT_WORKERS) carry their timeout in seconds
as their first argument (f64 LE); a request whose keys are missing is parked on the
server, answered as soon as they are set, and answered TIMEOUT (with the keys still
missing) at its deadline, so a client never loses its place in the stream.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from enum import IntEnum

from .. import auth
from ..errors import DistStoreError
from ..net import listen
from .hash import add_value, compare_set_value

__all__ = ["Cmd", "ProtocolError", "Status", "StoreServer", "decode_args", "encode_frame"]

log = logging.getLogger("distcomm.store")

HEADER = struct.Struct("<IB")
LENGTH = struct.Struct("<I")
SECONDS = struct.Struct("<d")
_COALESCE = 1 << 16  # frames smaller than this go out as one buffer
_RECV_SIZE = 1 << 18


class Cmd(IntEnum):
    """Request commands."""

    REGISTER = 1  # a client announces itself (counted for wait_for_workers)
    SET = 2
    GET = 3
    ADD = 4
    COMPARE_SET = 5
    WAIT = 6
    CHECK = 7
    DELETE_KEY = 8
    NUM_KEYS = 9
    MULTI_GET = 10
    MULTI_SET = 11
    APPEND = 12
    WAIT_WORKERS = 13  # wait until N clients have registered


_CODES = frozenset(Cmd)


class Status(IntEnum):
    """Response statuses: OK (results follow), TIMEOUT (missing keys follow), ERROR (message)."""

    OK = 0
    TIMEOUT = 1
    ERROR = 2


class ProtocolError(DistStoreError):
    """A frame that does not follow the protocol."""


def encode_frame(code: int, args: Sequence[bytes]) -> list[bytes]:
    """A frame as buffers to send in order (one buffer when it is small)."""
    parts: list[bytes] = []
    for arg in args:
        parts += (LENGTH.pack(len(arg)), arg)
    size = sum(len(part) for part in parts)
    if size > 0xFFFFFFFF:
        raise ValueError(f"store request of {size} bytes exceeds the 4 GiB frame limit")
    parts.insert(0, HEADER.pack(size, code))
    return [b"".join(parts)] if size < _COALESCE else parts


def decode_args(buffer: bytes | bytearray, start: int = 0, end: int | None = None) -> list[bytes]:
    """The arguments of a frame body held in `buffer[start:end]`.

    Raises:
        ProtocolError: the lengths do not add up.
    """
    end = len(buffer) if end is None else end
    args = []
    with memoryview(buffer) as view:
        offset = start
        while offset < end:
            if offset + LENGTH.size > end:
                raise ProtocolError("truncated argument length in store frame")
            (size,) = LENGTH.unpack_from(view, offset)
            offset += LENGTH.size
            if offset + size > end:
                raise ProtocolError("argument longer than its store frame")
            args.append(bytes(view[offset : offset + size]))
            offset += size
    return args


class _Conn:
    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock, self.name = sock, name
        self.inbuf = bytearray()
        self.out: deque[bytes] = deque()
        self.out_offset = 0
        self.authed = self.closed = self.writing = False
        self.nonce = b""
        self.parked: _Waiter | None = None


class _Waiter:
    """A parked request: keys it waits for (or a worker count), its deadline."""

    __slots__ = ("cmd", "conn", "done", "keys", "watching", "workers")

    def __init__(self, conn: _Conn, cmd: int, keys: list[bytes], workers: int = 0) -> None:
        self.conn, self.cmd, self.keys, self.workers = conn, cmd, keys, workers
        self.done = False
        self.watching: bytes | None = None


class StoreServer:
    """The TCPStore server: binds `host:port` at once; `start()` runs its thread.

    Args:
        host: the address to bind, exactly ("0.0.0.0" for every interface).
        port: the port; 0 picks a free one (see `port`).
        auth_key: the key clients must prove they hold, or None.

    Raises:
        DistNetworkError: the address cannot be bound.
    """

    #: Seconds a connection may take to prove the key before it is dropped.
    handshake_timeout = 10.0

    def __init__(self, host: str, port: int, auth_key: bytes | None) -> None:
        self._key = auth_key
        self._listener = listen(host, port)
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, "listener")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: set[_Conn] = set()
        self._data: dict[bytes, bytes] = {}
        self._watchers: dict[bytes, list[_Waiter]] = {}
        self._worker_waiters: list[_Waiter] = []
        self._workers = 0
        self._timers: list[tuple[float, int, object]] = []
        self._compact_at = 1024
        self._seq = itertools.count()
        self._runnable: deque[_Conn] = deque()
        self._stopping = False
        self._cleaned = False
        self._thread = threading.Thread(
            target=self._run, name=f"distcomm-store-server-{self.port}", daemon=True
        )

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Run the event loop in its daemon thread."""
        self._thread.start()

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
        for conn in list(self._conns):
            self._close(conn)
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, mask in self._selector.select(self._next_timer()):
                    if key.data == "listener":
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wakeups()
                    else:
                        self._guarded(key.data, self._on_event, key.data, mask)
                self._fire_timers()
                while self._runnable:
                    conn = self._runnable.popleft()
                    self._guarded(conn, self._process, conn)
        except Exception:
            log.exception(
                "the TCPStore server on port %d failed; closing every connection", self.port
            )
        finally:
            self._cleanup()

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    # -- timers: parked requests, handshakes, a paused listener ---------------------------

    def _add_timer(self, when: float, item: object) -> None:
        heapq.heappush(self._timers, (when, next(self._seq), item))

    def _live(self, item: object) -> bool:
        if isinstance(item, _Waiter):
            return not item.done
        if isinstance(item, _Conn):
            return not item.authed and not item.closed
        return True

    def _next_timer(self) -> float | None:
        if len(self._timers) > self._compact_at:  # drop the timers of answered requests
            self._timers = [entry for entry in self._timers if self._live(entry[2])]
            heapq.heapify(self._timers)
            self._compact_at = max(1024, 2 * len(self._timers))
        if not self._timers:
            return None
        return max(0.0, self._timers[0][0] - time.monotonic())

    def _fire_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, item = heapq.heappop(self._timers)
            if not self._live(item):
                continue
            if isinstance(item, _Waiter):
                self._finish(item, Status.TIMEOUT, self._timeout_args(item))
            elif isinstance(item, _Conn):
                log.info(
                    "dropping %s: no valid handshake within %.1f s",
                    item.name,
                    self.handshake_timeout,
                )
                self._close(item)
            else:  # the listener, paused after running out of file descriptors
                self._selector.register(self._listener, selectors.EVENT_READ, "listener")

    def _timeout_args(self, waiter: _Waiter) -> list[bytes]:
        if waiter.cmd == Cmd.WAIT_WORKERS:
            return [str(self._workers).encode()]
        return [key for key in waiter.keys if key not in self._data]

    # -- connections ----------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, typically: pause accepting
                log.warning("TCPStore server on port %d cannot accept: %s", self.port, exc)
                self._selector.unregister(self._listener)
                self._add_timer(time.monotonic() + 0.1, "listener")
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, f"store client {address[0]}:{address[1]}")
            self._conns.add(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)
            hello, conn.nonce = auth.hello_message(self._key)
            conn.authed = self._key is None
            if not conn.authed:
                self._add_timer(time.monotonic() + self.handshake_timeout, conn)
            self._send(conn, [hello])

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        if conn.parked is not None:
            self._unpark(conn.parked)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _guarded(self, conn: _Conn, step: Callable[..., None], *args: object) -> None:
        """Run one step for `conn`; a bug it hits closes that connection, not the server."""
        try:
            step(*args)
        except Exception:
            log.exception("TCPStore server: closing %s after an internal error", conn.name)
            self._close(conn)

    def _on_event(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_READ:
            self._on_readable(conn)
        if mask & selectors.EVENT_WRITE and not conn.closed:
            self._flush(conn)

    def _on_readable(self, conn: _Conn) -> None:
        want = _RECV_SIZE if conn.authed else auth.PROOF_SIZE - len(conn.inbuf)
        try:
            data = conn.sock.recv(want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.inbuf += data
        if conn.authed:
            self._process(conn)
        elif len(conn.inbuf) == auth.PROOF_SIZE:
            accept = auth.verify_proof(self._key or b"", conn.nonce, bytes(conn.inbuf))
            conn.inbuf.clear()
            if accept is None:
                log.warning(
                    "TCPStore server: %s failed authentication (wrong "
                    "DISTCOMM_AUTH_KEY?); closing it",
                    conn.name,
                )
                self._close(conn)
                return
            conn.authed = True
            self._send(conn, [accept])

    def _send(self, conn: _Conn, chunks: list[bytes]) -> None:
        if not conn.closed:
            conn.out.extend(chunks)
            self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        while conn.out:
            chunk = conn.out[0]
            try:
                sent = conn.sock.send(memoryview(chunk)[conn.out_offset :])
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(conn)
                return
            conn.out_offset += sent
            if conn.out_offset < len(chunk):
                break
            conn.out.popleft()
            conn.out_offset = 0
        if bool(conn.out) != conn.writing:
            conn.writing = bool(conn.out)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.writing else 0)
            self._selector.modify(conn.sock, events, conn)

    # -- requests -------------------------------------------------------------------------

    def _process(self, conn: _Conn) -> None:
        """Serve the complete frames buffered on `conn`, stopping at a parked request."""
        inbuf = conn.inbuf
        while not conn.closed and conn.parked is None and len(inbuf) >= HEADER.size:
            size, code = HEADER.unpack_from(inbuf)
            end = HEADER.size + size
            if len(inbuf) < end:
                return
            try:
                args = decode_args(inbuf, HEADER.size, end)
            except ProtocolError as exc:
                del inbuf[:end]
                self._reply(conn, Status.ERROR, [str(exc).encode()])
                continue
            del inbuf[:end]
            handler = (
                getattr(self, f"_do_{Cmd(code).name.lower()}", None) if code in _CODES else None
            )
            try:
                if handler is None:
                    raise ProtocolError(f"unknown store command {code} (client newer than server?)")
                result = handler(conn, args)
            except (DistStoreError, ValueError, IndexError, struct.error) as exc:
                message = (
                    str(exc)
                    if isinstance(exc, DistStoreError)
                    else (f"malformed {Cmd(code).name} request: {exc}")
                )
                self._reply(conn, Status.ERROR, [message.encode()])
                continue
            if result is not None:
                self._reply(conn, Status.OK, result)

    def _reply(self, conn: _Conn, status: Status, args: list[bytes]) -> None:
        self._send(conn, encode_frame(status, args))

    def _park(
        self, conn: _Conn, cmd: int, seconds: bytes, keys: list[bytes], workers: int = 0
    ) -> None:
        (timeout,) = SECONDS.unpack(seconds)
        if not math.isfinite(timeout) or timeout < 0:
            raise ValueError(f"timeout must be finite and >= 0, got {timeout}")
        waiter = _Waiter(conn, cmd, keys, workers)
        conn.parked = waiter
        if cmd == Cmd.WAIT_WORKERS:
            self._worker_waiters.append(waiter)
        else:
            self._watch(waiter)
        self._add_timer(time.monotonic() + timeout, waiter)

    def _watch(self, waiter: _Waiter) -> None:
        """Register `waiter` under its first missing key; `watching` stays None if none is."""
        for key in waiter.keys:
            if key not in self._data:
                waiter.watching = key
                self._watchers.setdefault(key, []).append(waiter)
                return
        waiter.watching = None

    def _unpark(self, waiter: _Waiter) -> None:
        waiter.done = True
        waiter.conn.parked = None
        if waiter.cmd == Cmd.WAIT_WORKERS:
            self._worker_waiters.remove(waiter)
        elif waiter.watching is not None:
            waiting = self._watchers.get(waiter.watching, [])
            if waiter in waiting:
                waiting.remove(waiter)
                if not waiting:
                    del self._watchers[waiter.watching]

    def _finish(self, waiter: _Waiter, status: Status, args: list[bytes]) -> None:
        self._unpark(waiter)
        self._reply(waiter.conn, status, args)
        self._runnable.append(waiter.conn)

    def _changed(self, key: bytes) -> None:
        """Answer the requests parked on `key` whose keys are now all set."""
        for waiter in self._watchers.pop(key, ()):
            if waiter.done:
                continue
            waiter.watching = None
            self._watch(waiter)
            if waiter.watching is None:
                self._finish(waiter, Status.OK, self._results(waiter))

    def _results(self, waiter: _Waiter) -> list[bytes]:
        return [] if waiter.cmd == Cmd.WAIT else [self._data[key] for key in waiter.keys]

    def _do_register(self, conn: _Conn, args: list[bytes]) -> list[bytes]:
        self._workers += 1
        for waiter in list(self._worker_waiters):
            if self._workers >= waiter.workers:
                self._finish(waiter, Status.OK, [str(self._workers).encode()])
        return [str(self._workers).encode()]

    def _do_wait_workers(self, conn: _Conn, args: list[bytes]) -> list[bytes] | None:
        seconds, count = args
        if self._workers >= int(count):
            return [str(self._workers).encode()]
        self._park(conn, Cmd.WAIT_WORKERS, seconds, [], int(count))
        return None

    def _do_set(self, conn: _Conn, args: list[bytes]) -> list[bytes]:
        key, value = args
        self._data[key] = value
        self._changed(key)
        return []

    def _do_get(self, conn: _Conn, args: list[bytes]) -> list[bytes] | None:
        """GET and MULTI_GET: the values, or park until all are set."""
        seconds, *keys = args
        if all(key in self._data for key in keys):
            return [self._data[key] for key in keys]
        self._park(conn, Cmd.MULTI_GET, seconds, keys)
        return None

    _do_multi_get = _do_get

    def _do_wait(self, conn: _Conn, args: list[bytes]) -> list[bytes] | None:
        seconds, *keys = args
        if all(key in self._data for key in keys):
            return []
        self._park(conn, Cmd.WAIT, seconds, keys)
        return None

    def _do_add(self, conn: _Conn, args: list[bytes]) -> list[bytes]:
        key, amount = args
        value = add_value(key.decode(errors="replace"), self._data.get(key), int(amount))
        self._data[key] = value
        self._changed(key)
        return [value]

    def _do_compare_set(self, conn: _Conn, args: list[bytes]) -> list[bytes]:
        key, expected, desired = args
        new, result = compare_set_value(self._data.get(key), expected, desired)
        if new is not None:
            self._data[key] = new
            self._changed(key)
        return [result]

    def _do_check(self, conn: _Conn, args: list[bytes]) -> list[bytes]:
        return [b"\x01" if all(key in self._data for key in args) else b"\x00"]

    def _do_delete_key(self, conn: _Conn, args: list[bytes]) -> list[bytes]:
        (key,) = args
        return [b"\x01" if self._data.pop(key, None) is not None else b"\x00"]

    def _do_num_keys(self, conn: _Conn, args: list[bytes]) -> list[bytes]:
        return [str(len(self._data)).encode()]

    def _do_multi_set(self, conn: _Conn, args: list[bytes]) -> list[bytes]:
        if len(args) % 2:
            raise ValueError("MULTI_SET needs key, value pairs")
        pairs = list(zip(args[::2], args[1::2], strict=True))
        self._data.update(pairs)
        for key, _ in pairs:
            self._changed(key)
        return []

    def _do_append(self, conn: _Conn, args: list[bytes]) -> list[bytes]:
        key, value = args
        self._data[key] = self._data.get(key, b"") + value
        self._changed(key)
        return []
