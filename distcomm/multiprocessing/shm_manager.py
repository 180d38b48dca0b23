"""The shared-memory manager daemon and its client: named segments are unlinked once unused.

The ``file_system`` sharing strategy names its POSIX shared-memory segments
(``/dev/shm/distcomm_*``) so that other processes can open them. A name outlives every
process that crashes before unlinking it, so each process tree gets one manager daemon
(torch's ``torch_shm_manager``) that counts references per segment and unlinks a segment
when its count reaches zero, when the last client has gone, or on SIGTERM.

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

Protocol (version 1): ASCII lines over an abstract-namespace unix stream socket
(``"\\0" + address``). The client opens with ``HELLO <version> <pid>``, answered by
``OK <version> <manager pid>``. Then ``REG <name>``, ``SEND <name>`` and ``STAT [<name>]``
are answered, in order, by ``OK [...]`` or ``ERR <message>``; ``CLAIM <name>`` and
``REL <name>`` get no answer (the manager logs what it cannot do). A line that is not
ASCII, longer than `MAX_LINE` bytes or has an unknown operation closes the connection.
Only processes of the manager's own user are served (``SO_PEERCRED``): the abstract
namespace has no file permissions.

Daemon lifetime. `start_manager` runs ``python -m distcomm.multiprocessing.shm_manager
ADDRESS --detach`` in a new session (``start_new_session=True``), so a signal to the job's
process group does not reach it. With ``--detach`` that process binds the socket, forks
the daemon and exits at once; the starter reaps it and reads the daemon's ``READY <pid>``
line. The daemon is thus nobody's child in the job: it is re-parented to init (or the
nearest subreaper), which reaps it, so it never lingers as the starter's zombie, and a
launcher that kills a worker's process tree (``psutil`` children) does not kill it before
it could clean up.

This module is Linux-only (abstract unix sockets, ``SO_PEERCRED``).
"""

from __future__ import annotations

import argparse
import collections
import errno
import logging
import os
import re
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar

from distcomm.deadline import Deadline, to_seconds
from distcomm.errors import DistError, DistNetworkError, DistTimeoutError

try:
    import _posixshmem
except ImportError:  # pragma: no cover - every POSIX CPython has it
    _posixshmem = None

__all__ = [
    "ADDRESS_ENV",
    "DEFAULT_LINGER",
    "DEFAULT_STARTUP_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "MAX_NAME_LENGTH",
    "NAME_PREFIX",
    "PROTOCOL_VERSION",
    "ManagerClient",
    "SegmentTable",
    "ShmManager",
    "ShmManagerConnectionError",
    "ShmManagerError",
    "ShmManagerTimeoutError",
    "StartedManager",
    "main",
    "start_manager",
    "validate_name",
]

log = logging.getLogger("distcomm.multiprocessing.shm_manager")

#: Environment variable naming this process tree's manager (its abstract socket address).
ADDRESS_ENV = "DISTCOMM_SHM_MANAGER"
#: Every segment name the manager accepts starts with this.
NAME_PREFIX = "distcomm_"
#: Longest segment name, in characters.
MAX_NAME_LENGTH = 200
#: Seconds the manager waits, once its last client has gone, before it cleans up and exits.
DEFAULT_LINGER = 2.0
#: Seconds the manager waits for its first client before it gives up and exits.
DEFAULT_STARTUP_TIMEOUT = 30.0
#: Seconds a client waits for the manager (start, connect, lock, answer) before raising.
DEFAULT_TIMEOUT = 30.0
#: Version of the line protocol spoken between clients and the manager.
PROTOCOL_VERSION = 1
#: Longest request or reply line, in bytes (without the newline).
MAX_LINE = 512

_MODULE = "distcomm.multiprocessing.shm_manager"
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
_MAX_ADDRESS_BYTES = 107  # sun_path is 108 bytes, one of them the leading NUL
_MAX_PENDING_REPLIES = 1 << 20  # bytes of unread answers before a client is dropped
_ACCEPT_PAUSE = 0.1  # seconds to stop accepting after running out of descriptors
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_REAP_WAIT = 5.0  # seconds for the started process to exit after forking the daemon


class ShmManagerError(DistError):
    """The shared-memory manager refused a request or could not be used."""


class ShmManagerConnectionError(ShmManagerError, DistNetworkError):
    """No manager listens at the address, or the connection to it was lost (it died)."""


class ShmManagerTimeoutError(ShmManagerError, DistTimeoutError):
    """The manager did not start, accept or answer within the timeout."""


def validate_name(name: str) -> str:
    """Check a segment name: ``distcomm_`` then ``[A-Za-z0-9._-]``, at most 200 characters.

    Returns:
        The name, unchanged.

    Raises:
        TypeError: `name` is not a str.
        ValueError: the name breaks a rule; the message says which.
    """
    if not isinstance(name, str):
        raise TypeError(f"segment name must be a str, got {type(name).__name__}")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"segment name of {len(name)} characters is too long: at most {MAX_NAME_LENGTH}"
        )
    if not name.startswith(NAME_PREFIX) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"segment name {name!r} is invalid: it must start with {NAME_PREFIX!r} and "
            f"hold only ASCII letters, digits, '.', '_' and '-'"
        )
    return name


def _validate_address(address: str) -> str:
    if not isinstance(address, str):
        raise TypeError(f"manager address must be a str, got {type(address).__name__}")
    raw = address.encode("utf-8", "surrogateescape")
    if not address or "\0" in address or len(raw) > _MAX_ADDRESS_BYTES:
        raise ValueError(
            f"manager address {address!r} is invalid: it must be 1 to {_MAX_ADDRESS_BYTES} "
            f"bytes without NUL (check {ADDRESS_ENV})"
        )
    return address


def _positive_seconds(timeout: float | timedelta, name: str) -> float:
    seconds = to_seconds(timeout, name=name)
    if seconds is None or seconds <= 0:
        raise ValueError(f"{name} must be > 0 seconds, got {timeout!r}")
    return seconds


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


# -- reference counts ---------------------------------------------------------------------


@dataclass
class _Segment:
    owned: int = 0  # references held by connected processes, summed
    in_flight: int = 0  # references pickled into messages nobody has claimed yet


class SegmentTable:
    """Reference counts of the segments one manager tracks; no I/O, so tests drive it directly.

    Owners are connection ids. Every mutator returns the names whose count reached zero:
    they are forgotten, and the caller unlinks them.
    """

    def __init__(self) -> None:
        self._segments: dict[str, _Segment] = {}
        self._owners: dict[int, collections.Counter[str]] = {}

    def register(self, owner: int, name: str) -> None:
        """`owner` holds one more reference to `name` (a new or an already tracked segment)."""
        self._segments.setdefault(name, _Segment()).owned += 1
        self._owners.setdefault(owner, collections.Counter())[name] += 1

    def send(self, name: str) -> None:
        """One more in-flight reference to `name`.

        Raises:
            LookupError: `name` is not tracked (never registered, or already unlinked).
        """
        self._known(name).in_flight += 1

    def claim(self, owner: int, name: str) -> bool:
        """`owner` takes one in-flight reference to `name` as its own.

        Returns:
            True; False when no reference was in flight, in which case `owner` still gets
            one (it uses the segment, so the segment must live while it does).

        Raises:
            LookupError: `name` is not tracked.
        """
        segment = self._known(name)
        took = segment.in_flight > 0
        if took:
            segment.in_flight -= 1
        segment.owned += 1
        self._owners.setdefault(owner, collections.Counter())[name] += 1
        return took

    def release(self, owner: int, name: str) -> list[str]:
        """`owner` drops one of its references to `name`.

        Raises:
            LookupError: `owner` holds no reference to `name` (e.g. a forked child
                releasing what its parent registered).
        """
        held = self._owners.get(owner)
        if not held or held[name] <= 0:
            raise LookupError(f"connection holds no reference to {name}")
        held[name] -= 1
        if not held[name]:
            del held[name]
        self._segments[name].owned -= 1
        return self._collect([name])

    def drop_owner(self, owner: int) -> list[str]:
        """Drop every reference `owner` holds (its connection closed); in-flight ones stay."""
        held = self._owners.pop(owner, None)
        if not held:
            return []
        for name, count in held.items():
            self._segments[name].owned -= count
        return self._collect(held)

    def counts(self, name: str) -> tuple[int, int]:
        """(owned, in-flight) references to `name`; (0, 0) when it is not tracked."""
        segment = self._segments.get(name)
        return (0, 0) if segment is None else (segment.owned, segment.in_flight)

    def names(self) -> list[str]:
        """Every tracked segment, sorted."""
        return sorted(self._segments)

    def clear(self) -> list[str]:
        """Forget everything; the names that were tracked, sorted (to unlink them all)."""
        names = self.names()
        self._segments.clear()
        self._owners.clear()
        return names

    def __len__(self) -> int:
        return len(self._segments)

    def _known(self, name: str) -> _Segment:
        segment = self._segments.get(name)
        if segment is None:
            raise LookupError(f"segment {name} is not tracked (never registered, or unlinked)")
        return segment

    def _collect(self, names) -> list[str]:
        dead = [
            name
            for name in names
            if self._segments[name].owned + self._segments[name].in_flight <= 0
        ]
        for name in dead:
            del self._segments[name]
        return dead


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
        self._startup_timeout = _positive_seconds(startup_timeout, "startup_timeout")
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


# -- the client ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StartedManager:
    """A manager daemon `start_manager` started.

    Attributes:
        address: its abstract socket name (the value of DISTCOMM_SHM_MANAGER).
        pid: its process id.
    """

    address: str
    pid: int


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_manager(
    *,
    linger: float = DEFAULT_LINGER,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    log_file: str | None = None,
) -> StartedManager:
    """Start a manager daemon and wait until it listens; `ManagerClient.instance` calls this.

    The daemon is detached (see the module docstring): it is not a child of this process
    and needs no ``wait()``. Connect to it within `startup_timeout`, or it exits.

    Args:
        linger: seconds the daemon waits, once its last client has gone, before exiting.
        startup_timeout: seconds it waits for its first client.
        timeout: seconds to wait for it to listen.
        log_file: where the daemon appends its log (default: discarded).

    Raises:
        ValueError: a negative `linger`, or a `startup_timeout` or `timeout` not > 0.
        ShmManagerError: the daemon could not start; its output is in the message.
        ShmManagerTimeoutError: it did not report readiness within `timeout`.
    """
    _require_linux()
    deadline = Deadline(_positive_seconds(timeout, "timeout"))
    if not linger >= 0:
        raise ValueError(f"linger must be >= 0 seconds, got {linger!r}")
    _positive_seconds(startup_timeout, "startup_timeout")
    address = f"distcomm-shm-{os.getpid()}-{secrets.token_hex(8)}"
    command = [
        sys.executable,
        "-m",
        _MODULE,
        address,
        "--detach",
        "--linger",
        repr(float(linger)),
        "--startup-timeout",
        repr(float(startup_timeout)),
    ]
    if log_file is not None:
        command += ["--log", os.path.abspath(log_file)]
    env = dict(os.environ)
    env.pop(ADDRESS_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_package_root(), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.Popen(
            command,
            start_new_session=True,
            close_fds=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
    except OSError as exc:
        raise ShmManagerError(
            f"cannot start the shared-memory manager ({sys.executable} -m {_MODULE}): "
            f"{exc.strerror}"
        ) from exc
    try:
        pid = _await_ready(proc, address, deadline)
    except BaseException:
        proc.stdout.close()
        if proc.poll() is None:
            proc.kill()  # stuck before forking the daemon
        _reap(proc)
        raise
    proc.stdout.close()
    _reap(proc)
    log.debug("started shared-memory manager pid %d at %s", pid, address)
    return StartedManager(address, pid)


def _await_ready(proc: subprocess.Popen, address: str, deadline: Deadline) -> int:
    """Read the starter pipe until ``READY <pid>``; the daemon's pid."""
    fd = proc.stdout.fileno()
    output = bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            for line in output.splitlines(keepends=True):
                if line.startswith(b"READY ") and line.endswith(b"\n"):
                    return int(line.split()[1])
            left = deadline.remaining()
            if not left:
                raise ShmManagerTimeoutError(
                    f"the shared-memory manager at {address!r} did not report readiness within "
                    f"{deadline.seconds} s (is the machine overloaded?); its output so far: "
                    f"{_tail(output)}"
                )
            if not selector.select(left):
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            output += chunk
    raise ShmManagerError(
        f"the shared-memory manager at {address!r} exited before listening "
        f"({sys.executable} -m {_MODULE}); its output: {_tail(output)}"
    )


def _tail(output: bytes) -> str:
    text = output.decode("utf-8", "replace").strip()
    return repr(text[-2000:]) if text else "(none)"


def _reap(proc: subprocess.Popen) -> None:
    """Wait for the started process, which exits right after forking the daemon."""
    for attempt in range(2):
        try:
            proc.wait(timeout=_REAP_WAIT)
            return
        except subprocess.TimeoutExpired:
            if attempt:
                log.warning("pid %d (the manager's starter) did not exit", proc.pid)
            else:
                proc.kill()  # not the daemon: that is a separate process by now
        except ChildProcessError:  # SIGCHLD ignored: the kernel reaped it
            return


def _require_linux() -> None:
    if not sys.platform.startswith("linux"):
        raise ShmManagerError(
            f"the shared-memory manager needs Linux (abstract unix sockets), not "
            f"{sys.platform}; use the file_descriptor sharing strategy"
        )


class _Channel:
    """Line I/O on a connected socket under a deadline; socket errors pass through."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._rbuf = bytearray()

    def send(self, data: bytes, deadline: Deadline) -> None:
        self.sock.settimeout(_left(deadline))
        self.sock.sendall(data)

    def read_line(self, deadline: Deadline) -> str:
        while True:
            end = self._rbuf.find(b"\n")
            if end >= 0:
                line = bytes(self._rbuf[:end])
                del self._rbuf[: end + 1]
                return line.decode("ascii", "replace")
            if len(self._rbuf) > MAX_LINE:
                raise ConnectionError("answer line too long: not a distcomm manager")
            self.sock.settimeout(_left(deadline))
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("connection closed by the manager")
            self._rbuf += chunk


def _left(deadline: Deadline) -> float:
    left = deadline.remaining()
    if not left:
        raise TimeoutError("timed out")
    return left


def _connect(address: str, deadline: Deadline) -> tuple[socket.socket, _Channel, int]:
    """Connect and greet; the socket, its channel and the manager's pid.

    Raises:
        ShmManagerConnectionError: nobody listens, or the manager hung up during the greeting
            (it was exiting, or it serves another user).
        ShmManagerTimeoutError: no answer within the deadline.
        ShmManagerError: something else answers, or the manager speaks another version.
    """
    _require_linux()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = _Channel(sock)
    try:
        while True:
            try:
                sock.settimeout(_left(deadline))
                sock.connect("\0" + address)
                break
            except BlockingIOError:  # backlog full: retry
                time.sleep(min(0.01, deadline.remaining() or 0.0))
        channel.send(f"HELLO {PROTOCOL_VERSION} {os.getpid()}\n".encode(), deadline)
        reply = channel.read_line(deadline)
    except TimeoutError as exc:
        sock.close()
        raise ShmManagerTimeoutError(
            f"the shared-memory manager at {address!r} did not answer within "
            f"{deadline.seconds} s; it may be hung: find it with `pgrep -f {address}`"
        ) from exc
    except (ConnectionRefusedError, FileNotFoundError) as exc:
        sock.close()
        raise ShmManagerConnectionError(f"no shared-memory manager listens at {address!r}") from exc
    except OSError as exc:
        sock.close()
        raise ShmManagerConnectionError(
            f"the shared-memory manager at {address!r} hung up during the greeting "
            f"({exc}): it is exiting, or serves another user"
        ) from exc
    parts = reply.split()
    if len(parts) == 3 and parts[0] == "OK" and parts[1] == str(PROTOCOL_VERSION):
        try:
            return sock, channel, int(parts[2])
        except ValueError:
            pass
    sock.close()
    raise ShmManagerError(
        f"the process at {address!r} answered {reply!r} to distcomm's greeting: it is not a "
        f"distcomm shared-memory manager of protocol version {PROTOCOL_VERSION} (a different "
        f"distcomm version?); unset {ADDRESS_ENV} to start a new manager"
    )


class ManagerClient:
    """This process's connection to its process tree's shared-memory manager.

    Use `ManagerClient.instance()`: one client per process, connected to the manager named
    by DISTCOMM_SHM_MANAGER, or to one it starts (and then names there, so that processes
    started later find it). A forked child gets its own client on its first `instance()`
    call: the parent's connection is closed in the child right after the fork, and the
    child holds no references of its own (its `release` of an inherited segment is
    ignored; `register` the segments it keeps using past its parent's release).

    If the manager dies mid-run, every later call raises `ShmManagerConnectionError`, and
    `instance()` keeps returning this broken client instead of starting a second manager:
    that one would not know the segments registered with the first, so it could neither
    keep them alive nor unlink them, and processes would silently disagree about counts.
    Calling `close()` on the broken client lets the next `instance()` start afresh.

    Thread-safe: one lock guards the socket. A `claim` or `release` re-entered from a
    finalizer or signal handler while the same thread is inside a call is sent when that
    call finishes; `register` and `send` cannot be re-entered.

    Args:
        address: the manager's abstract socket name.
        timeout: seconds each call may wait (connect, lock, answer).

    Raises:
        ShmManagerConnectionError: no manager listens at `address`.
        ShmManagerTimeoutError: it did not answer the greeting within `timeout`.
        ShmManagerError: the process there is not a compatible manager.
    """

    _instance: ClassVar[ManagerClient | None] = None
    _instance_lock: ClassVar[threading.RLock] = threading.RLock()
    _creating: ClassVar[bool] = False

    def __init__(self, address: str, *, timeout: float | timedelta = DEFAULT_TIMEOUT) -> None:
        self._address = _validate_address(address)
        self._timeout = _positive_seconds(timeout, "timeout")
        self._pid = os.getpid()
        self._sock, self._channel, self._manager_pid = _connect(address, Deadline(self._timeout))
        self._lock = threading.RLock()
        self._depth = 0  # how deep the owning thread is inside calls
        self._deferred: list[bytes] = []  # re-entrant claims and releases
        self._broken: str | None = None
        self._closed = False

    @classmethod
    def instance(cls, *, timeout: float | timedelta = DEFAULT_TIMEOUT) -> ManagerClient:
        """This process's client, created on first use (and anew in a forked child).

        Connects to the manager named by DISTCOMM_SHM_MANAGER when one listens there;
        otherwise starts one and sets DISTCOMM_SHM_MANAGER to its address.

        Raises:
            ShmManagerError: a manager could not be started or reached (see the message).
            ShmManagerTimeoutError: that took longer than `timeout`.
            ValueError: DISTCOMM_SHM_MANAGER holds an invalid address.
        """
        seconds = _positive_seconds(timeout, "timeout")
        with cls._lock_class(seconds):
            current = cls._instance
            if current is not None and current._pid == os.getpid() and not current._closed:
                return current
            if cls._creating:
                raise ShmManagerError(
                    "ManagerClient.instance() was re-entered (from a finalizer or signal "
                    "handler?) while this thread was connecting to the shared-memory manager"
                )
            cls._creating = True
            try:
                client = cls._connect_or_start(seconds)
            finally:
                cls._creating = False
            cls._instance = client
            return client

    @classmethod
    def current(cls) -> ManagerClient | None:
        """This process's client if `instance()` created one (and it is open), else None.

        For finalizers: a process that never connected holds no references to release.
        """
        client = cls._instance
        if client is None or client._pid != os.getpid() or client._closed:
            return None
        return client

    @classmethod
    def _connect_or_start(cls, seconds: float) -> ManagerClient:
        address = os.environ.get(ADDRESS_ENV)
        if address:
            _validate_address(address)
            try:
                return cls(address, timeout=seconds)
            except ShmManagerConnectionError as exc:
                log.info(
                    "%s=%s is not usable (%s); starting a new manager", ADDRESS_ENV, address, exc
                )
        started = start_manager(timeout=seconds)
        client = cls(started.address, timeout=seconds)
        os.environ[ADDRESS_ENV] = started.address
        return client

    @classmethod
    def _lock_class(cls, seconds: float):
        if not cls._instance_lock.acquire(timeout=seconds):
            raise ShmManagerTimeoutError(
                f"ManagerClient.instance() waited {seconds} s for another thread that is "
                f"starting or connecting to the shared-memory manager"
            )
        return _Release(cls._instance_lock)

    @property
    def address(self) -> str:
        """The manager's abstract socket name (DISTCOMM_SHM_MANAGER)."""
        return self._address

    @property
    def manager_pid(self) -> int:
        """The manager daemon's process id."""
        return self._manager_pid

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._closed

    def register(self, name: str) -> None:
        """Hold one more reference to segment `name` (call before creating it; acked).

        Raises:
            ValueError: the name is invalid (see `validate_name`).
            ShmManagerConnectionError: the manager died or this client is closed.
            ShmManagerTimeoutError: no answer within the timeout.
        """
        self._call("REG", name, ack=True)

    def send(self, name: str) -> None:
        """Count one in-flight reference to `name` before its pickled bytes leave (acked).

        Raises:
            ValueError: the name is invalid.
            ShmManagerError: the manager does not track `name` (released already?).
            ShmManagerConnectionError: the manager died or this client is closed.
            ShmManagerTimeoutError: no answer within the timeout.
        """
        self._call("SEND", name, ack=True)

    def claim(self, name: str) -> None:
        """Take over one in-flight reference to `name` as this process's own (no ack).

        Raises:
            ValueError: the name is invalid.
            ShmManagerConnectionError: the manager died or this client is closed.
        """
        self._call("CLAIM", name, ack=False)

    def release(self, name: str) -> None:
        """Drop one of this process's references to `name` (no ack); at zero it is unlinked.

        Raises:
            ValueError: the name is invalid.
            ShmManagerConnectionError: the manager died or this client is closed.
        """
        self._call("REL", name, ack=False)

    def close(self) -> None:
        """Disconnect: the manager drops this process's references. Idempotent.

        Raises:
            ShmManagerTimeoutError: another thread's request held the client past the timeout.
        """
        if not self._lock.acquire(timeout=self._timeout):
            raise ShmManagerTimeoutError(
                f"close: waited {self._timeout} s for another thread's request to the "
                f"shared-memory manager at {self._address!r}"
            )
        try:
            if self._closed:
                return
            self._closed = True
            if self._pid == os.getpid():
                self._sock.close()
        finally:
            self._lock.release()
        cls = type(self)
        if cls._instance is self:
            cls._instance = None

    def __enter__(self) -> ManagerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "open"
        return f"ManagerClient({self._address!r}, manager pid {self._manager_pid}, {state})"

    def _stats(self, name: str | None = None) -> dict[str, int]:
        """The manager's counters (tests, debugging): clients and segments, or one segment's
        owned and in-flight references."""
        if name is not None:
            validate_name(name)
        reply = self._call("STAT", name or "", ack=True)
        return {key: int(value) for key, value in (f.split("=") for f in reply.split()[1:])}

    def _call(self, op: str, name: str, *, ack: bool) -> str:
        if op != "STAT":
            validate_name(name)
        line = f"{op} {name}\n".encode("ascii") if name else f"{op}\n".encode("ascii")
        if not self._lock.acquire(timeout=self._timeout):
            raise ShmManagerTimeoutError(
                f"{self._what(op, name)}: waited {self._timeout} s for another thread's request "
                f"to the shared-memory manager at {self._address!r}"
            )
        try:
            self._check_usable(op, name)
            if self._depth:
                if ack:
                    raise ShmManagerError(
                        f"{self._what(op, name)} was re-entered (from a finalizer or signal "
                        f"handler?) during another request on this thread"
                    )
                self._deferred.append(line)
                return ""
            self._depth += 1
            try:
                deadline = Deadline(self._timeout)
                reply = self._exchange(op, name, line, ack, deadline)
                # one re-entered after this loop waits for the next call (or the exit)
                while self._deferred:
                    self._exchange(op, name, self._deferred.pop(0), False, deadline)
            finally:
                self._depth -= 1
        finally:
            self._lock.release()
        if reply.startswith("ERR"):
            raise ShmManagerError(
                f"the shared-memory manager at {self._address!r} refused "
                f"{self._what(op, name)}: {reply[4:]}"
            )
        return reply

    def _exchange(self, op: str, name: str, line: bytes, ack: bool, deadline: Deadline) -> str:
        try:
            self._channel.send(line, deadline)
            return self._channel.read_line(deadline) if ack else ""
        except TimeoutError as exc:
            self._broken = (
                f"the shared-memory manager at {self._address!r} (pid {self._manager_pid}) did "
                f"not answer {self._what(op, name)} within {self._timeout} s, so this connection "
                f"is out of step; is the manager hung or the machine overloaded?"
            )
            raise ShmManagerTimeoutError(self._broken) from exc
        except OSError as exc:
            self._broken = (
                f"lost the connection to the shared-memory manager at {self._address!r} "
                f"(pid {self._manager_pid}) during {self._what(op, name)} ({exc}): it died or "
                f"was killed. Segments it tracked are no longer counted (and may be left in "
                f"/dev/shm if it was killed with SIGKILL); no second manager is started mid-run "
                f"because it would not know them. Restart the job, or call close() on this "
                f"client so that ManagerClient.instance() starts a fresh manager"
            )
            raise ShmManagerConnectionError(self._broken) from exc

    def _check_usable(self, op: str, name: str) -> None:
        if self._pid != os.getpid():
            raise ShmManagerConnectionError(
                f"{self._what(op, name)}: this ManagerClient belongs to pid {self._pid}, not to "
                f"this forked process {os.getpid()}; use ManagerClient.instance()"
            )
        if self._closed:
            raise ShmManagerConnectionError(
                f"{self._what(op, name)}: this client of the shared-memory manager at "
                f"{self._address!r} is closed; use ManagerClient.instance()"
            )
        if self._broken:
            raise ShmManagerConnectionError(self._broken)

    @staticmethod
    def _what(op: str, name: str) -> str:
        verb = {"REG": "register", "SEND": "send", "CLAIM": "claim", "REL": "release"}.get(op, op)
        return f"{verb}({name!r})" if name else verb

    def _after_fork_in_child(self) -> None:
        """In a forked child: close the inherited descriptor (the parent's connection must
        end when the parent does, not when its last child exits); keep no lock state."""
        self._lock = threading.RLock()
        self._depth = 0
        self._deferred = []
        self._sock.close()


class _Release:
    """Context manager releasing an already acquired lock."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()


def _reset_after_fork() -> None:
    ManagerClient._instance_lock = threading.RLock()
    ManagerClient._creating = False
    client = ManagerClient._instance
    if client is not None:
        client._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_after_fork)


if __name__ == "__main__":
    sys.exit(main())
