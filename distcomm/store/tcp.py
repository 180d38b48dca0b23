"""TCPStore: a key-value store served over TCP by the master process (torch's TCPStore).

The master (`is_master=True`) binds the listening socket and runs the server
(`tcp_server.StoreServer`: one event loop in a daemon thread, serving any number of
clients); every TCPStore object, the master's included, is a client of it with one
connection, used by one request at a time. Every connection proves DISTCOMM_AUTH_KEY
(when set) before any request is served.

A waiting request (get, wait, multi_get) is answered by the server itself at its
deadline, so the connection stays in step; the client's socket timeout is a little
longer, and if that safety net ever fires the connection is dropped and reopened on the
next request. If the server goes away, requests raise `DistNetworkError` at once.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence
from datetime import timedelta

from .. import auth, config
from ..config import DEFAULT_STORE_TIMEOUT
from ..deadline import Deadline, to_seconds
from ..errors import DistNetworkError, DistStoreError, DistStoreTimeoutError
from ..net import connect, format_address
from .base import Store, check_key, to_bytes
from .hash import check_amount, check_keys, check_values, timeout_error
from .tcp_server import HEADER, SECONDS, Cmd, Status, StoreServer, decode_args, encode_frame

__all__ = ["TCPStore"]

#: Extra seconds the client waits beyond a request's own timeout before giving up on it.
SAFETY_MARGIN = 1.0


class _PeerClosed(Exception):
    """The server closed the connection."""


class TCPStore(Store):
    """A store served over TCP by the master process (torch.distributed.TCPStore).

    Args:
        host_name: the master's address; the master binds exactly this address
            ("0.0.0.0" to listen on every interface).
        port: the master's port; with `is_master`, 0 picks a free one (read `port`).
        world_size: how many TCPStore clients the job has (the master's included); None
            if unknown.
        is_master: host the server in this process.
        timeout: connecting, waiting for workers and the default for `get`/`wait`
            (seconds or timedelta; default 300 s).
        wait_for_workers: with `is_master` and `world_size`, the constructor returns once
            `world_size` clients have connected.

    Raises:
        DistNetworkError: the master cannot bind, or a client cannot reach or authenticate
            with the master before `timeout` (the message names host:port).
        DistStoreTimeoutError: fewer than `world_size` clients connected in time.
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: float | timedelta = timedelta(seconds=DEFAULT_STORE_TIMEOUT),
        wait_for_workers: bool = True,
    ) -> None:
        self._closed = False
        self._pid = os.getpid()
        self._sock: socket.socket | None = None
        self._server: StoreServer | None = None
        super().__init__(timeout)
        if not isinstance(host_name, str) or not host_name:
            raise ValueError(f"TCPStore host_name must be a non-empty str, got {host_name!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"TCPStore port must be an int in 0..65535, got {port!r}")
        if port == 0 and not is_master:
            raise ValueError("TCPStore port 0 (any free port) only works with is_master=True")
        if world_size is not None and (
            isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1
        ):
            raise ValueError(f"TCPStore world_size must be None or an int >= 1, got {world_size!r}")
        self._host = host_name
        self._port = port
        self.world_size = world_size
        self._auth_key = config.load().auth_key
        self._lock = threading.Lock()
        self._registered = False
        self._broken: str | None = None
        self._local_address = ""
        try:
            if is_master:
                self._server = StoreServer(host_name, port, self._auth_key)
                self._port = self._server.port
                self._server.start()
            deadline = Deadline(self._timeout)
            with self._lock:
                self._connect(deadline)
            if is_master and wait_for_workers and world_size is not None:
                self._wait_for_workers(world_size, deadline)
        except BaseException:
            self.close()
            raise

    # -- properties -----------------------------------------------------------------------

    @property
    def host(self) -> str:
        """The master's host name, as given."""
        return self._host

    @property
    def port(self) -> int:
        """The master's port (the one picked, when created with port 0)."""
        return self._port

    @property
    def local_address(self) -> str:
        """The IP address of this process's end of its connection to the store."""
        return self._local_address

    @property
    def _where(self) -> str:
        return f"the TCPStore at {format_address(self._host, self._port)}"

    # -- the connection -------------------------------------------------------------------

    def _connect(self, deadline: Deadline) -> None:
        """Open, authenticate and (the first time) register the connection; lock held."""
        sock = connect(self._host, self._port, deadline, what="the TCPStore")
        try:
            auth.client_handshake(sock, self._auth_key, deadline, self._where)
            self._local_address = sock.getsockname()[0]
            self._sock = sock
            if not self._registered:
                self._exchange(Cmd.REGISTER, [], deadline, "register")
                self._registered = True
        except BaseException:
            self._drop()
            sock.close()
            raise

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if os.getpid() == self._pid:  # wakes a thread blocked on it; in a forked child it
            try:  # would also cut the parent's connection
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        sock.close()

    def _recv_exact(self, sock: socket.socket, size: int, deadline: Deadline) -> bytearray:
        buffer = bytearray(size)
        view = memoryview(buffer)
        got = 0
        while got < size:
            left = deadline.remaining()
            if left is not None and left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            count = sock.recv_into(view[got:])
            if not count:
                raise _PeerClosed
            got += count
        return buffer

    def _exchange(
        self, code: Cmd, args: list[bytes], deadline: Deadline, what: str
    ) -> tuple[int, list[bytes]]:
        """Send one request and read its response on the open connection; lock held."""
        sock = self._sock
        if sock is None:
            raise DistStoreError(f"{self._where}: no connection (closed?)")
        try:
            for part in encode_frame(code, args):
                sock.settimeout(deadline.remaining())
                sock.sendall(part)
            size, status = HEADER.unpack(self._recv_exact(sock, HEADER.size, deadline))
            return status, decode_args(self._recv_exact(sock, size, deadline))
        except TimeoutError:
            self._drop()
            if self._closed:
                raise DistStoreError(f"{self._where} was closed during {what}") from None
            raise DistStoreTimeoutError(
                f"{self._where} did not answer {what} within {deadline.seconds:.1f} s; "
                "the connection was reset and is reopened by the next request"
            ) from None
        except (_PeerClosed, OSError) as exc:
            self._drop()
            if self._closed:
                raise DistStoreError(f"{self._where} was closed during {what}") from None
            reason = "" if isinstance(exc, _PeerClosed) else f" ({exc})"
            self._broken = (
                f"store at {format_address(self._host, self._port)} closed the connection"
                f"{reason} (did the master process exit?)"
            )
            raise DistNetworkError(f"{self._broken}; {what} failed") from None

    def _request(
        self, code: Cmd, args: list[bytes], what: str, wait: float | None = None
    ) -> tuple[int, list[bytes]]:
        """One request: (status, arguments); `wait` is the server-side wait, if any.

        Raises:
            DistStoreError: the server reported an error, or this store is closed.
            DistNetworkError: the connection to the master failed.
            DistStoreTimeoutError: no answer in time (the connection is then reset).
        """
        budget = (self._timeout if wait is None else wait) + SAFETY_MARGIN
        if not self._lock.acquire(timeout=budget):
            raise DistStoreTimeoutError(
                f"{what} on {self._where} waited {budget:.1f} s for another thread of this "
                "process to finish its request on the shared connection"
            )
        try:
            if self._closed:
                raise DistStoreError(f"{self._where} is closed; {what} is not possible")
            if self._broken is not None:
                raise DistNetworkError(f"{self._broken}; {what} failed")
            if self._sock is None:
                self._connect(Deadline(self._timeout))
            status, result = self._exchange(code, args, Deadline(budget), what)
        finally:
            self._lock.release()
        if status == Status.ERROR:
            message = result[0].decode(errors="replace") if result else "unknown error"
            raise DistStoreError(f"{self._where} refused {what}: {message}")
        return status, result

    def _call(
        self, code: Cmd, args: list[bytes], what: str, wait: float | None = None
    ) -> list[bytes]:
        """A request that must succeed: its results, or the right exception."""
        status, result = self._request(code, args, what, wait)
        if status == Status.TIMEOUT:
            missing = [key.decode(errors="replace") for key in result]
            raise timeout_error(missing, wait or 0.0, self._where)
        return result

    def _wait_for_workers(self, world_size: int, deadline: Deadline) -> None:
        left = deadline.remaining() or 0.0
        status, result = self._request(
            Cmd.WAIT_WORKERS,
            [SECONDS.pack(left), str(world_size).encode()],
            "wait_for_workers",
            wait=left,
        )
        if status == Status.TIMEOUT:
            arrived = int(result[0]) if result else 0
            raise DistStoreTimeoutError(
                f"only {arrived} of {world_size} store clients connected to {self._where} "
                f"within {self._timeout:.1f} s (world_size={world_size}, the master included): "
                "are all processes started, with this address and port?"
            )

    # -- the Store methods ----------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        """Store `value` under `key`, replacing any previous value."""
        self._call(Cmd.SET, [check_key(key).encode(), to_bytes(value)], f"set({key!r})")

    def get(self, key: str) -> bytes:
        """The value of `key`, waiting up to the store timeout for it to be set.

        Raises:
            DistStoreTimeoutError: the key was not set in time (the message names it).
        """
        return self.multi_get([key])[0]

    def add(self, key: str, amount: int) -> int:
        """Add `amount` to the counter `key` (created at 0); returns the new value.

        Raises:
            DistStoreError: the key holds something other than an integer.
        """
        args = [check_key(key).encode(), str(check_amount(amount)).encode()]
        return int(self._call(Cmd.ADD, args, f"add({key!r})")[0])

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Atomically set `key` to `desired_value` if it holds `expected_value` (see Store)."""
        args = [
            check_key(key).encode(),
            to_bytes(expected_value, "expected_value"),
            to_bytes(desired_value, "desired_value"),
        ]
        return self._call(Cmd.COMPARE_SET, args, f"compare_set({key!r})")[0]

    def wait(self, keys: Sequence[str], timeout: float | timedelta | None = None) -> None:
        """Block until every key in `keys` is set, up to `timeout` (default: the store's).

        Raises:
            DistStoreTimeoutError: names the keys still missing.
        """
        names = check_keys(keys)
        seconds = self._timeout if timeout is None else to_seconds(timeout)
        args = [SECONDS.pack(seconds), *(name.encode() for name in names)]
        self._call(Cmd.WAIT, args, f"wait({names!r})", wait=seconds)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in `keys` is set, without waiting."""
        names = check_keys(keys)
        return self._call(Cmd.CHECK, [n.encode() for n in names], "check")[0] == b"\x01"

    def delete_key(self, key: str) -> bool:
        """Delete `key`; returns whether it existed."""
        args = [check_key(key).encode()]
        return self._call(Cmd.DELETE_KEY, args, f"delete_key({key!r})")[0] == b"\x01"

    def num_keys(self) -> int:
        """The number of keys in the store."""
        return int(self._call(Cmd.NUM_KEYS, [], "num_keys")[0])

    def append(self, key: str, value: str | bytes) -> None:
        """Append `value` to the value of `key` (created empty)."""
        self._call(Cmd.APPEND, [check_key(key).encode(), to_bytes(value)], f"append({key!r})")

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of `keys`, waiting up to the store timeout for all of them.

        Raises:
            DistStoreTimeoutError: names the keys still missing.
        """
        names = check_keys(keys)
        args = [SECONDS.pack(self._timeout), *(name.encode() for name in names)]
        what = f"get({names[0]!r})" if len(names) == 1 else f"multi_get({names!r})"
        return self._call(Cmd.MULTI_GET, args, what, wait=self._timeout)

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Set each key of `keys` to the value at the same position of `values`, atomically."""
        names = check_keys(keys)
        args = []
        for name, value in zip(names, check_values(names, values), strict=True):
            args += (name.encode(), value)
        self._call(Cmd.MULTI_SET, args, "multi_set")

    # -- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection and, on the master, stop the server (idempotent).

        Requests blocked in other threads fail with `DistStoreError`.
        """
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._drop()
        server, self._server = self._server, None
        if server is not None and os.getpid() == self._pid:
            server.stop()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        role = "master" if self._server is not None else "client"
        return f"TCPStore({format_address(self._host, self._port)}, {role})"
