"""TCPStore: a key-value store served over TCP by the master process (torch's TCPStore).

The master (`is_master=True`) binds the listening socket and runs the server
(`server.StoreServer`: one event loop in a daemon thread, serving any number of
clients); every TCPStore object, the master's included, is a client of it with one
connection, used by one request at a time. Every connection proves DISTCOMM_AUTH_KEY
(when set) before any request is served.

`set`, `append` and `multi_set` return once sent, as torch's do; a waiting request is
answered by the server at its deadline; connecting retries what a server not up yet or
shedding load does; no request is ever sent twice. How, and the errors each failure
raises, is `requests.StoreClient`'s, the half of this class that talks to the server;
`master` finds or starts the master's server.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from datetime import timedelta

from ... import config
from ...config import DEFAULT_STORE_TIMEOUT
from ...deadline import Deadline, to_seconds
from ...errors import DistStoreError, DistStoreTimeoutError
from ...net import format_address
from ..base import CloseOnCollect, Store, check_block, check_key, to_bytes
from ..hash import check_amount, check_keys, check_values, queue_empty_error, queue_timeout_error
from .connection import Connection
from .master import SHARED, listener_from_fd, open_server
from .protocol import SECONDS, Cmd, Limits, Status
from .requests import TORCH_KEYS, StoreClient
from .server import StoreServer

__all__ = ["TCPStore"]


class TCPStore(StoreClient, CloseOnCollect, Store):
    """A store served over TCP by the master process (torch.distributed.TCPStore).

    Args:
        host_name: the master's address; the master binds exactly this address
            ("0.0.0.0" to listen on every interface).
        port: the master's port; with `is_master`, 0 picks a free one (read `port`).
        world_size: how many TCPStore clients the job has (the master's included); None
            if unknown.
        is_master: host the server in this process.
        timeout: connecting, waiting for workers and the default for `get`/`wait`
            (seconds or timedelta, of any length; default 300 s).
        wait_for_workers: with `is_master` and `world_size`, the constructor returns once
            `world_size` clients have connected.
        multi_tenant: with `is_master`, share one server among every multi-tenant
            TCPStore of this process on the same host and port: the first starts it, a
            later one uses it instead of failing to bind, and it stops when the last of
            them closes.
        master_listen_fd: with `is_master`, serve on this socket (bound, listening or
            not) instead of binding `host_name:port`; `port` must be its port, or 0 to
            take it. The server uses a duplicate of the descriptor: the caller keeps its
            own and closes it when it likes (torch's server takes the descriptor over).
            Ignored by clients, as in torch.
        use_libuv: accepted for torch's signature and reported by `libuvBackend`;
            distcomm has one server either way, an epoll loop in a thread, which does what
            torch's libuv server does (queues included).
        auth_key: the job's key (bytes or str): a client proves it holds it and a master
            admits only clients that do; None (the default) takes DISTCOMM_AUTH_KEY, and no
            key at all means no authentication. A distcomm extension; keyword only.

    Keys are limited to 8 KiB and values to 8 MiB by default, as in torch; the process
    that hosts the store sets other limits with DISTCOMM_STORE_MAX_KEY_BYTES and
    DISTCOMM_STORE_MAX_VALUE_BYTES, and clients learn them when they connect. A request
    over a limit raises `ValueError` before anything is sent.

    Under a launcher whose agent serves the store already (torchrun's and distcomm-run's
    workers: TORCHELASTIC_USE_AGENT_STORE is true), a master on MASTER_PORT that cannot
    bind it becomes a client of the agent's store, as torch's does, and does not wait for
    workers. A host name that does not resolve is retried until `timeout` by master and
    clients alike (as torch's do: a DNS name may appear only once its host is up).

    Errors open with torch's words for the same failure ("The server socket has failed
    to listen on any local network address", "wait timeout after 500ms", "Timed out after
    2 seconds waiting for clients", "TCPStore world size cannot be 0"), then say which
    address, keys or clients, and what to do.

    Raises:
        ValueError: an argument is out of range (world_size 0, a port outside 0..65535).
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
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
        *,
        auth_key: bytes | str | None = None,
    ) -> None:
        self._closed = False
        self._pid = os.getpid()
        self._conn: Connection | None = None
        self._server: StoreServer | None = None
        self._shared = False
        super().__init__(timeout)
        for name, flag in (("multi_tenant", multi_tenant), ("use_libuv", use_libuv)):
            if not isinstance(flag, bool):
                raise TypeError(f"TCPStore {name} must be True or False, got {flag!r}")
        if not isinstance(host_name, str) or not host_name:
            raise ValueError(f"TCPStore host_name must be a non-empty str, got {host_name!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"TCPStore port must be an int in 0..65535, got {port!r}")
        if world_size is not None and (
            isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1
        ):
            # torch's words for 0 first, which its users match
            lead = "TCPStore world size cannot be 0: " if world_size == 0 else "TCPStore "
            raise ValueError(
                f"{lead}world_size must be None (unknown) or an int >= 1, got {world_size!r}"
            )
        if port == 0 and not is_master:
            raise ValueError("TCPStore port 0 (any free port) only works with is_master=True")
        listener = None
        if is_master and master_listen_fd is not None:
            listener = listener_from_fd(master_listen_fd, port)
            port = listener.getsockname()[1]
        self._host = host_name
        self._port = port
        self.world_size = world_size
        if isinstance(auth_key, str):
            auth_key = auth_key.encode()
        elif auth_key is not None and not isinstance(auth_key, bytes):
            raise TypeError(f"TCPStore auth_key must be bytes, str or None, got {auth_key!r}")
        if auth_key == b"":
            raise ValueError(
                "TCPStore auth_key must not be empty: give a key, or None for DISTCOMM_AUTH_KEY"
            )
        if auth_key is None:  # the two variables a client reads (config.load reads them all)
            auth_key = (config.get("DISTCOMM_AUTH_KEY") or "").encode() or None
        self._auth_key = auth_key
        # a wait still waiting after this says so
        self._stall_warn: float = config.get("DISTCOMM_STALL_WARN_S")
        self._lock = threading.Lock()
        self._registered = False
        self._limits = Limits()
        self._broken: str | None = None
        self._local_address = ""
        self._use_libuv = use_libuv
        try:
            deadline = Deadline(self._timeout)
            if is_master:  # None: the launcher's agent serves the store (see master.open_server)
                self._server, self._shared = open_server(
                    host_name,
                    port,
                    self._auth_key,
                    listener,
                    multi_tenant,
                    deadline,
                    self._stall_warn,
                )
                if self._server is not None:
                    self._port = self._server.port
            with self._lock:
                self._connect(deadline)
            # a master that became the agent's client waits for no one, as torch's
            if self._server is not None and wait_for_workers and world_size is not None:
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
    def libuvBackend(self) -> bool:  # torch's name
        """The `use_libuv` this store was created with (True by default), as torch reports
        which server was asked for. distcomm has one server either way, an epoll loop that
        does what torch's libuv server does, queues included, so the value changes nothing
        here; it is there for code that reads or checks it."""
        return self._use_libuv

    @property
    def local_address(self) -> str:
        """The IP address of this process's end of its connection to the store."""
        if not self._local_address and self._conn is not None:
            try:
                self._local_address = self._conn.local_address
            except OSError:
                pass
        return self._local_address

    @property
    def limits(self) -> Limits:
        """What one request may carry, as the server said when this client connected."""
        return self._limits

    def _wait_for_workers(self, world_size: int, deadline: Deadline) -> None:
        left = deadline.remaining()
        left = float("inf") if left is None else left
        status, result = self._request(
            Cmd.WAIT_WORKERS,
            [SECONDS.pack(left), str(world_size).encode()],
            "wait_for_workers",
            wait=left,
        )
        if status == Status.TIMEOUT:
            arrived = int(result[0]) if result else 0
            waited = self._timeout
            shown = f"{waited:.0f}" if waited == int(waited) else f"{waited:.1f}"
            # torch's words first ("Timed out after 2 seconds waiting for clients. 1/2
            # clients joined."), which its users match
            raise DistStoreTimeoutError(
                f"Timed out after {shown} seconds waiting for clients. {arrived}/{world_size} "
                f"clients joined: only {arrived} of {world_size} store clients connected to "
                f"{self._where} (world_size={world_size}, the master included): are all "
                "processes started, with this address and port?"
            )

    # -- the Store methods ----------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        """Store `value` under `key`, replacing any previous value."""
        name, data = check_key(key).encode(), to_bytes(value)
        self._call(Cmd.SET, [name, data], ("set", key), keys=(name,), values=(data,), quiet=True)

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
        name = check_key(key).encode()
        args = [name, str(check_amount(amount)).encode()]
        return int(self._call(Cmd.ADD, args, ("add", key), keys=(name,))[0])

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Atomically set `key` to `desired_value` if it holds `expected_value` (see Store)."""
        name = check_key(key).encode()
        expected = to_bytes(expected_value, "expected_value")
        desired = to_bytes(desired_value, "desired_value")
        return self._call(
            Cmd.COMPARE_SET,
            [name, expected, desired],
            ("compare_set", key),
            keys=(name,),
            values=(expected, desired),
        )[0]

    def wait(self, keys: Sequence[str], timeout: float | timedelta | None = None) -> None:
        """Block until every key in `keys` is set, up to `timeout` (default: the store's).

        Raises:
            DistStoreTimeoutError: names the keys still missing.
        """
        names = [name.encode() for name in check_keys(keys)]
        seconds = self._timeout if timeout is None else to_seconds(timeout)
        self._waiting(Cmd.WAIT, names, seconds, ("wait", list(keys)))

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in `keys` is set, without waiting."""
        names = [name.encode() for name in check_keys(keys)]
        return self._call(Cmd.CHECK, names, "check", keys=names)[0] == b"\x01"

    def delete_key(self, key: str) -> bool:
        """Delete `key`; returns whether it existed."""
        args = [check_key(key).encode()]
        return self._call(Cmd.DELETE_KEY, args, ("delete_key", key), keys=args)[0] == b"\x01"

    def num_keys(self) -> int:
        """The number of keys set in the store (queues are not keys).

        torch's also counts an internal key its clients count themselves in with (once a
        client given `world_size` has joined), so it is one more there; the server counts
        clients here without a key.
        """
        return int(self._call(Cmd.NUM_KEYS, [], "num_keys")[0])

    def append(self, key: str, value: str | bytes) -> None:
        """Append `value` to the value of `key` (created empty)."""
        name, data = check_key(key).encode(), to_bytes(value)
        self._call(
            Cmd.APPEND, [name, data], ("append", key), keys=(name,), values=(data,), quiet=True
        )

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of `keys`, waiting up to the store timeout for all of them.

        Raises:
            DistStoreTimeoutError: names the keys still missing.
        """
        names = [name.encode() for name in check_keys(keys)]
        what = ("get", keys[0]) if len(names) == 1 else ("multi_get", list(keys))
        return self._waiting(Cmd.MULTI_GET, names, self._timeout, what)

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Set each key of `keys` to the value at the same position of `values`, atomically."""
        names = check_keys(keys)
        datas = check_values(names, values)
        encoded = [name.encode() for name in names]
        args = []
        for name, data in zip(encoded, datas, strict=True):
            args += (name, data)
        self._call(Cmd.MULTI_SET, args, "multi_set", keys=encoded, values=datas, quiet=True)

    # -- the extended API -----------------------------------------------------------------

    def has_extended_api(self) -> bool:
        """True: every extended operation is served by the server."""
        return True

    def list_keys(self) -> list[str]:
        """Every key in the store (queues are not keys)."""
        return [key.decode(errors="replace") for key in self._call(Cmd.LIST_KEYS, [], "list_keys")]

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Append `value` to the queue `key` (see Store.queue_push); returns once sent, as
        `set` does."""
        name, data = check_key(key).encode(), to_bytes(value)
        self._call(
            Cmd.QUEUE_PUSH,
            [name, data],
            ("queue_push", key),
            keys=(name,),
            values=(data,),
            quiet=True,
        )

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest item of queue `key`, removed (see Store.queue_pop).

        A blocking pop waits at the server, which hands it the next item pushed: it does
        not poll, and pops waiting together are served in the order they arrived.

        Raises:
            QueueEmptyError: `block` is False and the queue is empty.
            DistStoreTimeoutError: no item came within the store timeout.
        """
        name = check_key(key).encode()
        what = ("queue_pop", key)
        if not check_block(block):
            result = self._call(
                Cmd.QUEUE_POP, [SECONDS.pack(0.0), name], what, wait=0.0, keys=(name,)
            )
            if not result:
                raise queue_empty_error(key, self._where)
            return result[0]
        result = self._waiting(Cmd.QUEUE_POP, [name], self._timeout, what)
        if not result:  # a store timeout of 0: asked without waiting
            raise queue_timeout_error(key, self._timeout, self._where, TORCH_KEYS)
        return result[0]

    def queue_len(self, key: str) -> int:
        """The number of items in queue `key` (0 when it has none)."""
        name = check_key(key).encode()
        return int(self._call(Cmd.QUEUE_LEN, [name], ("queue_len", key), keys=(name,))[0])

    # -- teardown -------------------------------------------------------------------------

    def clone(self) -> TCPStore:
        """A new client connection to the same server (never a master), with this one's
        timeout: for another thread, which would otherwise queue behind this connection's
        requests.

        Raises:
            DistStoreError: this store is closed.
            DistNetworkError: the server cannot be reached.
        """
        if self._closed:
            raise DistStoreError(f"{self._where} is closed; it cannot be cloned")
        return TCPStore(
            self._host,
            self._port,
            is_master=False,
            timeout=self._timeout,
            wait_for_workers=False,
            use_libuv=self._use_libuv,
            auth_key=self._auth_key,
        )

    def close(self) -> None:
        """Close the connection and, on the master, stop the server (idempotent).

        Requests blocked in other threads fail with `DistStoreError`.
        """
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._drop()
        server, self._server = self._server, None
        if (
            server is not None
            and os.getpid() == self._pid
            and (not self._shared or SHARED.release(self._host, server))
        ):
            server.stop()

    def __repr__(self) -> str:
        role = "master" if self._server is not None else "client"
        return f"TCPStore({format_address(self._host, self._port)}, {role})"
