"""The client of the shared-memory manager daemon: `ManagerClient`, `start_manager`, errors.

Each process using the ``file_system`` sharing strategy talks to its process tree's
manager daemon (`manager`) through one `ManagerClient`: it registers the segments it
creates, counts the references it pickles into messages, claims the ones it receives and
releases the ones it drops (what each means is described in `manager`; the line
protocol is in `protocol`). `ManagerClient.instance` connects to the manager named
by DISTCOMM_SHM_MANAGER, or starts one with `start_manager`, which runs ``python -m
distcomm.multiprocessing.shm_manager ADDRESS --detach`` and waits for its ``READY <pid>``
line (the daemon then is nobody's child in the job). The connection itself is
`channel`'s. Failures raise `ShmManagerError` and its subclasses
`ShmManagerConnectionError` and `ShmManagerTimeoutError` (defined in `base`).

This module is Linux-only (abstract unix sockets).
"""

from __future__ import annotations

import logging
import os
import secrets
import selectors
import subprocess
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar

from ... import config
from ...config import positive_seconds
from ...deadline import Deadline
from ..base import (
    ShmManagerConnectionError,
    ShmManagerError,
    ShmManagerTimeoutError,
)
from .channel import connect, require_linux
from .protocol import (
    ADDRESS_ENV,
    DEFAULT_LINGER,
    DEFAULT_STARTUP_TIMEOUT,
    _validate_address,
    validate_name,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "ManagerClient",
    "ShmManagerConnectionError",
    "ShmManagerError",
    "ShmManagerTimeoutError",
    "StartedManager",
    "start_manager",
]

log = logging.getLogger(__name__)

#: Seconds a client waits for the manager (start, connect, lock, answer) before raising.
DEFAULT_TIMEOUT = 30.0

#: The daemon's public module, run with ``python -m`` (`ps` shows the documented command).
_MANAGER_MODULE = "distcomm.multiprocessing.shm_manager"
_REAP_WAIT = 5.0  # seconds for the started process to exit after forking the daemon


# -- starting the daemon ------------------------------------------------------------------


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
    """The directory that holds the `distcomm` package, for the daemon's PYTHONPATH: one
    level up per part of this module's dotted name, so that it holds wherever it moves."""
    path = os.path.abspath(__file__)
    for _ in range(__name__.count(".") + 1):
        path = os.path.dirname(path)
    return path


def start_manager(
    *,
    linger: float = DEFAULT_LINGER,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    log_file: str | None = None,
) -> StartedManager:
    """Start a manager daemon and wait until it listens; `ManagerClient.instance` calls this.

    The daemon is detached (see `manager`'s docstring): it is not a child of this process
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
    require_linux()
    deadline = Deadline(positive_seconds("timeout", timeout, text=False))
    if not linger >= 0:
        raise ValueError(f"linger must be >= 0 seconds, got {linger!r}")
    positive_seconds("startup_timeout", startup_timeout, text=False)
    address = f"distcomm-shm-{os.getpid()}-{secrets.token_hex(8)}"
    command = [
        sys.executable,
        "-m",
        _MANAGER_MODULE,
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
            f"cannot start the shared-memory manager ({sys.executable} -m {_MANAGER_MODULE}): "
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
        f"({sys.executable} -m {_MANAGER_MODULE}); its output: {_tail(output)}"
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
        self._timeout = positive_seconds("timeout", timeout, text=False)
        self._pid = os.getpid()
        self._sock, self._channel, self._manager_pid = connect(address, Deadline(self._timeout))
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
        seconds = positive_seconds("timeout", timeout, text=False)
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
        address = config.get(ADDRESS_ENV)
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
