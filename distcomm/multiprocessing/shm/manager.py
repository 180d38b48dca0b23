"""The shared-memory manager daemon: counts references to named segments, unlinks unused ones.

The ``file_system`` sharing strategy names its POSIX shared-memory segments
(``/dev/shm/distcomm_*``) so that other processes can open them. A name outlives every
process that crashes before unlinking it, so each process tree gets one manager daemon
(torch's ``torch_shm_manager``) that counts references per segment and unlinks a segment
when its count reaches zero, when the last client has gone, or on SIGTERM. This module
holds the daemon: its event loop (`ShmManager`), over the reference table of `table`,
and its command line (`main`). Processes talk to it through `client.ManagerClient`;
the line protocol both sides speak is in `protocol`.

References. A segment's count is the sum of the references each connected process holds
plus the references "in flight" (pickled into a message no process has claimed yet):

- ``register(name)``: this process holds one more reference (acknowledged). Register
  *before* creating the segment, so that a crash between the two cannot leak it.
- ``send(name)``: one more in-flight reference, taken at pickling time (acknowledged, so
  the manager counts it before any receiver can release).
- ``claim(name)``: the receiving process takes one in-flight reference as its own.
- ``release(name)``: this process drops one of its own references.

A closed connection (exit, crash, ``kill -9``: the kernel closes the socket) drops that
process's own references; in-flight ones stay for a receiver to claim. An in-flight
reference nobody ever claims keeps its segment until the manager exits. When no client
has been connected for `linger` seconds (or none connected within the startup timeout),
and on SIGTERM or SIGINT, the manager unlinks every segment it still tracks and exits 0.

Daemon lifetime. `client.start_manager` runs ``python -m
distcomm.multiprocessing.shm_manager ADDRESS --detach`` in a new session
(``start_new_session=True``), so a signal to the job's process group does not reach it.
With ``--detach`` that process binds the socket, forks the daemon and exits at once; the
starter reaps it and reads the daemon's ``READY <pid>`` line. The daemon is thus nobody's
child in the job: it is re-parented to init (or the nearest subreaper), which reaps it, so
it never lingers as the starter's zombie, and a launcher that kills a worker's process
tree (``psutil`` children) does not kill it before it could clean up.

This module is Linux-only (abstract unix sockets, ``SO_PEERCRED``).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import selectors
import signal
import socket
import struct
import sys
import time

from ...config import positive_seconds
from .protocol import (
    DEFAULT_LINGER,
    DEFAULT_STARTUP_TIMEOUT,
    MAX_LINE,
    PROTOCOL_VERSION,
    _validate_address,
    validate_name,
)
from .table import SegmentTable

try:
    import _posixshmem
except ImportError:  # pragma: no cover - every POSIX CPython has it
    _posixshmem = None

__all__ = [
    "SegmentTable",
    "ShmManager",
    "main",
]

log = logging.getLogger(__name__)

#: The public module that runs this daemon (`main`) with ``python -m``.
_MODULE = "distcomm.multiprocessing.shm_manager"
_MAX_PENDING_REPLIES = 1 << 20  # bytes of unread answers before a client is dropped
_ACCEPT_PAUSE = 0.1  # seconds to stop accepting after running out of descriptors
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _unlink_segment(name: str) -> bool:
    """Unlink the shared-memory segment `name`; False when it no longer existed."""
    try:
        if _posixshmem is not None:
            _posixshmem.shm_unlink("/" + name)
        else:  # pragma: no cover
            os.unlink("/dev/shm/" + name)
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("cannot unlink shared-memory segment %s: %s", name, exc.strerror)
        return False
    return True


# -- the daemon ---------------------------------------------------------------------------


class _Connection:
    __slots__ = ("closing", "greeted", "id", "peer_pid", "rbuf", "sock", "wbuf", "writing")

    def __init__(self, conn_id: int, sock: socket.socket, peer_pid: int) -> None:
        self.id = conn_id
        self.sock = sock
        self.peer_pid = peer_pid
        self.rbuf = bytearray()
        self.wbuf = bytearray()
        self.greeted = False
        self.closing = False  # close once wbuf is flushed
        self.writing = False  # registered for EVENT_WRITE

    def __repr__(self) -> str:
        return f"client #{self.id} (pid {self.peer_pid})"


class _Protocol(Exception):
    """A client broke the protocol; its connection gets closed."""


class ShmManager:
    """The manager: one selectors loop over a listening socket and its clients.

    Args:
        listener: a bound, listening unix stream socket.
        linger: seconds without any client, once one has connected, before exiting.
        startup_timeout: seconds to wait for the first client before exiting.
    """

    def __init__(
        self,
        listener: socket.socket,
        *,
        linger: float = DEFAULT_LINGER,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    ) -> None:
        if linger < 0:
            raise ValueError(f"linger must be >= 0 seconds, got {linger}")
        self._startup_timeout = positive_seconds("startup_timeout", startup_timeout, text=False)
        self._linger = float(linger)
        self._listener = listener
        listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._table = SegmentTable()
        self._conns: dict[int, _Connection] = {}
        self._next_id = 1
        self._started = time.monotonic()
        self._empty_since: float | None = None  # set once a client connected and all left
        self._accept_paused_until: float | None = None
        self._signal: int | None = None
        self._signals_installed = False
        self._uid = os.getuid()

    # one step of the loop, and the loop

    def step(self) -> str | None:
        """Wait for the next events (at most until a deadline), handle them.

        Returns:
            None to go on, or why the manager should now clean up and exit.
        """
        for key, mask in self._selector.select(self._wait_time()):
            if key.data == "accept":
                self._accept()
            elif key.data == "wake":
                self._drain_wakeup()
            elif key.data.id in self._conns:
                if mask & selectors.EVENT_READ:
                    self._read(key.data)
                if mask & selectors.EVENT_WRITE and key.data.id in self._conns:
                    self._flush(key.data)
        now = time.monotonic()
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._accept_paused_until = None
            self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        reason = self._exit_reason(now)
        if reason is not None and self._signal is None and self._accept_paused_until is None:
            self._accept()  # a client that connected just now keeps the manager
            reason = self._exit_reason(now)
        return reason

    def serve(self) -> int:
        """Run until idle or signalled, then unlink every tracked segment; the exit status."""
        try:
            reason = None
            while reason is None:
                reason = self.step()
            log.info("exiting: %s", reason)
        finally:
            self.shutdown()
        return 0

    def shutdown(self) -> None:
        """Stop listening, close every connection and unlink every tracked segment."""
        if self._signals_installed:
            signal.set_wakeup_fd(-1)
            self._signals_installed = False
        if self._listener.fileno() >= 0:
            if self._accept_paused_until is None:
                self._selector.unregister(self._listener)
            self._listener.close()
        for conn in list(self._conns.values()):
            self._selector.unregister(conn.sock)
            conn.sock.close()
        self._conns.clear()
        unlinked = [name for name in self._table.clear() if _unlink_segment(name)]
        if unlinked:
            log.info("unlinked %d segment(s) at exit: %s", len(unlinked), " ".join(unlinked))
        for sock in (self._wake_r, self._wake_w):
            sock.close()
        self._selector.close()

    def install_signal_handlers(self) -> None:
        """Make SIGTERM and SIGINT end the loop (the caller then cleans up); main thread only."""
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        self._signals_installed = True
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signal = signum

    def _drain_wakeup(self) -> None:
        try:
            while self._wake_r.recv(512):
                pass
        except BlockingIOError:
            pass

    def _wait_time(self) -> float | None:
        if self._signal is not None:
            return 0.0
        now = time.monotonic()
        ends = []
        if self._accept_paused_until is not None:
            ends.append(self._accept_paused_until)
        if not self._conns:
            if self._empty_since is None:
                ends.append(self._started + self._startup_timeout)
            else:
                ends.append(self._empty_since + self._linger)
        return max(0.0, min(ends) - now) if ends else None

    def _exit_reason(self, now: float) -> str | None:
        if self._signal is not None:
            return f"received {signal.Signals(self._signal).name}"
        if self._conns:
            return None
        if self._empty_since is None:
            if now >= self._started + self._startup_timeout:
                return f"no client connected within {self._startup_timeout} s"
        elif now >= self._empty_since + self._linger:
            return f"no client for {self._linger} s"
        return None

    # connections

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("cannot accept a client (%s); pausing", exc.strerror)
                    self._selector.unregister(self._listener)
                    self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE
                elif exc.errno != errno.ECONNABORTED:
                    log.warning("accept failed: %s", exc.strerror)
                return
            pid, uid, _gid = _UCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )
            if uid != self._uid:
                log.warning(
                    "refused pid %d of uid %d (this manager serves uid %d only)",
                    pid,
                    uid,
                    self._uid,
                )
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Connection(self._next_id, sock, pid)
            self._next_id += 1
            self._conns[conn.id] = conn
            self._empty_since = None
            self._selector.register(sock, selectors.EVENT_READ, conn)
            log.info("%r connected", conn)

    def _close(self, conn: _Connection, why: str) -> None:
        self._selector.unregister(conn.sock)
        conn.sock.close()
        del self._conns[conn.id]
        dead = self._table.drop_owner(conn.id)
        log.info("%r gone (%s); unlinking %d segment(s)", conn, why, len(dead))
        for name in dead:
            _unlink_segment(name)
        if not self._conns:
            self._empty_since = time.monotonic()

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as exc:
            self._close(conn, exc.strerror or "read error")
            return
        if not data:
            self._close(conn, "closed")
            return
        conn.rbuf += data
        while not conn.closing:
            end = conn.rbuf.find(b"\n")
            if end < 0:
                if len(conn.rbuf) > MAX_LINE:
                    self._close(conn, f"line over {MAX_LINE} bytes")
                return
            line = bytes(conn.rbuf[:end])
            del conn.rbuf[: end + 1]
            try:
                self._handle(conn, line)
            except _Protocol as exc:
                self._close(conn, f"protocol error: {exc}")
                return
            if conn.id not in self._conns:
                return

    def _reply(self, conn: _Connection, text: str) -> None:
        conn.wbuf += text.encode("ascii", "replace") + b"\n"
        self._flush(conn)

    def _flush(self, conn: _Connection) -> None:
        try:
            while conn.wbuf:
                sent = conn.sock.send(conn.wbuf)
                del conn.wbuf[:sent]
        except BlockingIOError:
            pass
        except OSError as exc:
            self._close(conn, exc.strerror or "write error")
            return
        if conn.closing and not conn.wbuf:
            self._close(conn, "refused")
        elif len(conn.wbuf) > _MAX_PENDING_REPLIES:
            self._close(conn, "does not read its answers")
        elif conn.writing != bool(conn.wbuf):
            conn.writing = bool(conn.wbuf)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.writing else 0)
            self._selector.modify(conn.sock, events, conn)

    # requests

    def _handle(self, conn: _Connection, line: bytes) -> None:
        if len(line) > MAX_LINE:
            raise _Protocol(f"line over {MAX_LINE} bytes")
        try:
            text = line.decode("ascii")
        except UnicodeDecodeError:
            raise _Protocol("line is not ASCII") from None
        op, _, arg = text.partition(" ")
        if not conn.greeted:
            self._hello(conn, op, arg)
            return
        if op == "STAT":
            self._stat(conn, arg)
            return
        if op not in ("REG", "SEND", "CLAIM", "REL"):
            raise _Protocol(f"unknown operation {op!r}")
        try:
            validate_name(arg)
        except ValueError as exc:
            if op in ("REG", "SEND"):
                self._reply(conn, f"ERR {exc}")
            else:
                log.warning("%r: %s %s", conn, op, exc)
            return
        if op == "REG":
            self._table.register(conn.id, arg)
            self._reply(conn, "OK")
        elif op == "SEND":
            try:
                self._table.send(arg)
            except LookupError as exc:
                self._reply(conn, f"ERR {exc}")
            else:
                self._reply(conn, "OK")
        elif op == "CLAIM":
            try:
                if not self._table.claim(conn.id, arg):
                    log.warning(
                        "%r claimed %s with no reference in flight (unpickled twice?); "
                        "counting a reference for it anyway",
                        conn,
                        arg,
                    )
            except LookupError as exc:
                log.warning("%r: cannot claim: %s", conn, exc)
        else:
            try:
                dead = self._table.release(conn.id, arg)
            except LookupError as exc:
                log.debug("%r: release ignored: %s", conn, exc)
                return
            for name in dead:
                _unlink_segment(name)

    def _hello(self, conn: _Connection, op: str, arg: str) -> None:
        parts = arg.split()
        if op != "HELLO" or len(parts) != 2:
            raise _Protocol(f"expected 'HELLO <version> <pid>', got {op!r}")
        if parts[0] != str(PROTOCOL_VERSION):
            conn.closing = True
            self._reply(
                conn,
                f"ERR protocol version {parts[0]} is not this manager's version {PROTOCOL_VERSION}",
            )
            return
        conn.greeted = True
        self._reply(conn, f"OK {PROTOCOL_VERSION} {os.getpid()}")

    def _stat(self, conn: _Connection, arg: str) -> None:
        if not arg:
            self._reply(conn, f"OK clients={len(self._conns)} segments={len(self._table)}")
            return
        owned, in_flight = self._table.counts(arg)
        self._reply(conn, f"OK owned={owned} in_flight={in_flight}")


def _listen(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + address)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def _detach() -> None:
    """Fork; the parent exits at once, the child goes on as the daemon (nobody's child)."""
    if os.getsid(0) != os.getpid():
        os.setsid()  # run by hand: still leave the caller's session
    if os.fork() > 0:
        os._exit(0)
    os.chdir("/")


def _redirect_stdio(log_file: str | None) -> None:
    """Point fds 0-2 at /dev/null (or fds 1-2 at the log file): the starter's pipe closes."""
    devnull = os.open(os.devnull, os.O_RDWR)
    target = devnull
    if log_file is not None:
        target = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(devnull, 0)
    os.dup2(target, 1)
    os.dup2(target, 2)
    for fd in {devnull, target}:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m distcomm.multiprocessing.shm_manager ADDRESS``."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {_MODULE}",
        description="Track distcomm's named shared-memory segments and unlink them once unused.",
    )
    parser.add_argument("address", help="abstract unix socket name to listen on (without NUL)")
    parser.add_argument(
        "--linger",
        type=float,
        default=DEFAULT_LINGER,
        help="seconds without clients before exiting (default %(default)s)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=DEFAULT_STARTUP_TIMEOUT,
        help="seconds to wait for the first client (default %(default)s)",
    )
    parser.add_argument(
        "--detach",
        action="store_true",
        help="fork after binding; the started process exits at once",
    )
    parser.add_argument(
        "--log", metavar="FILE", help="append the log here after startup (default: discard it)"
    )
    args = parser.parse_args(argv)
    try:
        _validate_address(args.address)
        if args.linger < 0:
            raise ValueError(f"--linger must be >= 0 seconds, got {args.linger}")
        if not args.startup_timeout > 0:
            raise ValueError(f"--startup-timeout must be > 0 seconds, got {args.startup_timeout}")
    except ValueError as exc:
        parser.error(str(exc))
    if args.log is not None:
        args.log = os.path.abspath(args.log)  # before --detach changes directory
    try:
        listener = _listen(args.address)
    except OSError as exc:
        print(f"shm_manager: cannot listen at {args.address!r}: {exc.strerror}", file=sys.stderr)
        return 1
    if args.detach:
        _detach()
    manager = ShmManager(listener, linger=args.linger, startup_timeout=args.startup_timeout)
    manager.install_signal_handlers()
    try:
        print(f"READY {os.getpid()}", flush=True)
    except BrokenPipeError:  # the starter gave up waiting: nobody will connect
        manager.shutdown()
        return 1
    _redirect_stdio(args.log)
    logging.basicConfig(
        level=logging.INFO if args.log else logging.WARNING,
        format=f"%(asctime)s shm_manager[{os.getpid()}] %(levelname)s %(message)s",
        stream=sys.stderr,
        force=True,
    )
    return manager.serve()


if __name__ == "__main__":
    sys.exit(main())
