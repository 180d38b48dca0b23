"""TCPStore: a key-value store served over TCP by the master process (torch's TCPStore).

The master (`is_master=True`) binds the listening socket and runs the server
(`tcp_server.StoreServer`: one event loop in a daemon thread, serving any number of
clients); every TCPStore object, the master's included, is a client of it with one
connection, used by one request at a time. Every connection proves DISTCOMM_AUTH_KEY
(when set) before any request is served.

`set`, `append` and `multi_set` return once the request is sent, as torch's do: the
server answers them only to refuse them (which a client that checked the server's limits
never sees), and such a refusal is raised by the next request of this object. A waiting
request (get, wait, multi_get) is answered by the server itself at its deadline, however
far (infinite included), so the connection stays in step; the client's kernel timeouts
are a little longer, and if that safety net ever fires the connection is dropped and
reopened on the next request. If the server goes away, requests raise
`DistNetworkError` at once. No request is ever sent twice: one whose answer is lost (a
timeout, a dropped connection) raises, and where it changes the store in a way that a
repetition would change again (add, compare_set, delete_key, append, queue_push,
queue_pop) the message says it may or may not have been applied.

Connecting retries, until the timeout, what a server that is not up yet or is shedding
load does: a refused or reset connection, a SYN left unanswered, a connection closed
after the server's greeting and before its answer to the first request; and, as torch
does, a host name that does not resolve yet (the master too: `tcp_master`). The pauses
grow and are randomised (`net.retry_delays`), so that thousands of clients refused
together do not come back together; a retry still going after DISTCOMM_STALL_WARN_S is
logged. A client pointed at a port that another program holds says so: the server
greets first and at once (`distcomm.auth`), so other bytes, or a close before any
greeting, fail the connection at once (no retry), and silence makes it warn after a few
seconds (it still waits its timeout, as a server serving thousands of clients may greet
late).

A new client without a key sends its REGISTER as soon as it is connected, before the
greeting, and the server answers it in the packet that carries the greeting: the
constructor waits one round trip, where a client that read the greeting first waited two
(a client with a key sends it with its proof). After a failed attempt the next one reads
the greeting first, so that a program that resets the connection on those bytes is still
told from a TCPStore.

The socket work of one connection is `tcp_client.Connection`'s; `tcp_master` finds or
starts the master's server.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

from .. import auth, config
from ..config import DEFAULT_STORE_TIMEOUT
from ..deadline import FOREVER, Deadline, StallClock, to_seconds
from ..errors import DistNetworkError, DistStoreError, DistStoreTimeoutError
from ..net import connect, format_address, log_retrying, retry_delays
from .base import Store, check_block, check_key, to_bytes
from .hash import (
    check_amount,
    check_keys,
    check_values,
    log_still_waiting,
    queue_empty_error,
    queue_timeout_error,
    timeout_error,
)
from .tcp_client import Connection, PeerClosed
from .tcp_master import SHARED, listener_from_fd, open_server, unresolved, unresolved_error
from .tcp_protocol import HEADER, SECONDS, Cmd, Limits, Status, encode_frame
from .tcp_server import StoreServer

__all__ = ["TCPStore"]

#: Extra seconds the client waits beyond a request's own timeout before giving up on it.
SAFETY_MARGIN = 1.0
#: Seconds of silence after connecting before a client warns that what answers may not
#: be a TCPStore (the server greets at once; one busy with thousands of clients may greet
#: late, so the client keeps waiting); DISTCOMM_STALL_WARN_S when that is shorter.
GREETING_WARN_S = 5.0
#: What to do when what answers at the address is not a TCPStore.
FOREIGN_HINT = ("is another program using this port? Pick another port (MASTER_PORT, or "
                "the port of distcomm-run's --rdzv_endpoint)")
log = logging.getLogger(__name__)

_ERROR, _TIMEOUT = int(Status.ERROR), int(Status.TIMEOUT)
#: How torch's TCPStore shows keys in its timeout message (it stores each under "/"):
#: ours repeat that list after torch's words, so that code matching them finds them.
_TORCH_KEYS = "/"
_REGISTER = encode_frame(Cmd.REGISTER, [])[0]
#: Requests that a repetition would apply again (or, for a pop, whose item would be lost
#: with its answer): one whose answer is lost may or may not have been applied.
_UNREPEATABLE = frozenset({Cmd.ADD, Cmd.COMPARE_SET, Cmd.DELETE_KEY, Cmd.APPEND,
                           Cmd.QUEUE_PUSH, Cmd.QUEUE_POP})
#: What the server does to a connection it sheds while it is being made: the errors
#: (a `__cause__`) after which a client connects again.
_DROPPED = (PeerClosed, ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


def _fate(frame: list[bytes], what: str | tuple[str, object]) -> str:
    """For a request whose answer was lost: that it may have been applied, where that
    matters (see `_UNREPEATABLE`)."""
    if HEADER.unpack_from(frame[0])[1] not in _UNREPEATABLE:
        return ""
    name = what[0] if isinstance(what, tuple) else what
    return (f"; the {name} may or may not have been applied, and it is not sent again: "
            "look at the store before repeating it")


def _describe(what: str | tuple[str, object]) -> str:
    """A request for messages: "num_keys", or ("get", "k") as "get('k')" (made on error only)."""
    return what if isinstance(what, str) else f"{what[0]}({what[1]!r})"


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
            raise ValueError(f"{lead}world_size must be None (unknown) or an int >= 1, got "
                             f"{world_size!r}")
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
            raise ValueError("TCPStore auth_key must not be empty: give a key, or None for "
                             "DISTCOMM_AUTH_KEY")
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
            if is_master:  # None: the launcher's agent serves the store (see tcp_master)
                self._server, self._shared = open_server(
                    host_name, port, self._auth_key, listener, multi_tenant, deadline,
                    self._stall_warn)
                if self._server is not None:
                    self._port = self._server.port
            with self._lock:
                self._connect(deadline)
            # a master that became the agent's client waits for no one, as torch's
            if (self._server is not None and wait_for_workers
                    and world_size is not None):
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

    @property
    def _where(self) -> str:
        return f"the TCPStore at {format_address(self._host, self._port)}"

    # -- the connection -------------------------------------------------------------------

    def _connect(self, deadline: Deadline) -> None:
        """Open, authenticate and (the first time) register the connection, retrying a
        connection the server sheds until `deadline` (see the module doc); lock held."""
        stall = StallClock(self._stall_warn)
        delays = None
        early = True
        unknown: DistNetworkError | None = None  # the last failure: a name not resolved
        while True:
            try:
                self._connect_once(deadline, stall, early)
                return
            except DistNetworkError as exc:
                unknown = exc if unresolved(exc) else None  # retried until the deadline
                if unknown is None and (not isinstance(exc.__cause__, _DROPPED)
                                        or deadline.expired()):
                    raise
                self._broken = None  # a registration cut short: not the store gone
                log_retrying(stall, f"connecting to {self._where}", exc, deadline)
            # a connection reset before the greeting was read may be another program that
            # closed on the early REGISTER: from now on, read the greeting before sending
            early = False
            delays = delays or retry_delays()
            time.sleep(deadline.slice(next(delays)))
            if unknown is not None and deadline.expired():
                raise unresolved_error(self._host, self._port, deadline.seconds,
                                       unknown) from unknown

    def _connect_once(self, deadline: Deadline, stall: StallClock, early: bool) -> None:
        """One connection; with `early`, a keyless client's REGISTER goes out before the
        greeting is read, and its answer comes with the greeting (`auth.client_handshake`):
        one round trip where there were two."""
        sock = connect(self._host, self._port, deadline, what="the TCPStore", stall=stall)
        try:
            register = not self._registered
            first = _REGISTER if register and (early or self._auth_key) else b""
            rest = auth.client_handshake(
                sock, self._auth_key, deadline, self._where, expected="a distcomm TCPStore",
                hint=FOREIGN_HINT, warn_after=min(GREETING_WARN_S, self._stall_warn),
                first=first, address=format_address(self._host, self._port))
            self._conn = Connection(sock, rest)
            self._local_address = ""
            if register:
                # counted once per connection: one cut short before its answer was most
                # likely shed unserved, and this connection registers anew
                left = deadline.remaining()
                _, result = self._exchange(
                    [_REGISTER], FOREVER if left is None else left + SAFETY_MARGIN,
                    "register", sent=bool(first))
                self._limits = Limits.decode(result[1:])
                self._registered = True
        except BaseException:
            self._drop()
            sock.close()
            raise

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:  # a shutdown wakes a thread blocked on it; in a forked child
            conn.close(shutdown=os.getpid() == self._pid)  # it would cut the parent's too

    def _exchange(
        self, frame: list[bytes], seconds: float, what: str | tuple[str, object],
        quiet: bool = False, sent: bool = False
    ) -> tuple[int, list[bytes]]:
        """Send one request and (unless `quiet`) read its answer; lock held. With `sent`,
        `frame` went out already (with the handshake): only its answer is read.

        An answer refusing an earlier quiet request is read first and raised as
        DistStoreError once this request's own answer is in.
        """
        conn = self._conn
        if conn is None:
            raise DistStoreError(f"{self._where}: no connection (closed?)")
        try:
            if sent:
                status, result, late = conn.answer(seconds)
            else:
                status, result, late = conn.exchange(frame, seconds, quiet)
        except (TimeoutError, BlockingIOError) as exc:  # a kernel timeout surfaces as EAGAIN
            self._drop()
            if self._closed:
                raise DistStoreError(
                    f"{self._where} was closed during {_describe(what)}") from exc
            raise DistStoreTimeoutError(
                f"{self._where} did not answer {_describe(what)} within {seconds:.1f} s; "
                "the connection was reset and is reopened by the next request"
                f"{_fate(frame, what)}"
            ) from exc
        except (PeerClosed, OSError) as exc:
            self._drop()
            if self._closed:
                raise DistStoreError(
                    f"{self._where} was closed during {_describe(what)}") from exc
            reason = "" if isinstance(exc, PeerClosed) else f" ({exc})"
            self._broken = (
                f"store at {format_address(self._host, self._port)} closed the connection"
                f"{reason} (did the master process exit?)"
            )
            raise DistNetworkError(
                f"{self._broken}; {_describe(what)} failed{_fate(frame, what)}") from exc
        if late is not None:
            raise DistStoreError(
                f"{self._where} refused an earlier set, append or multi_set of this process: "
                f"{late} (reported by {_describe(what)}, which completed)"
            )
        return status, result

    def _request(
        self, code: int, args: list[bytes], what: str | tuple[str, object],
        wait: float | None = None,
        keys: Sequence[bytes] = (), values: Sequence[bytes] = (), quiet: bool = False,
    ) -> tuple[int, list[bytes]]:
        """One request: (status, arguments); `wait` is the server-side wait, if any.

        `keys` and `values` are the request's keys and values, checked against the
        server's limits before anything is sent. A `quiet` request (SET, APPEND,
        MULTI_SET) returns once sent, as torch's do.

        Raises:
            ValueError: the request is over the server's limits (nothing was sent).
            DistStoreError: the server refused this request or an earlier quiet one, or
                this store is closed.
            DistNetworkError: the connection to the master failed.
            DistStoreTimeoutError: no answer in time (the connection is then reset).
        """
        frame = encode_frame(code, args)
        limits = self._limits
        body = (len(frame[0]) if len(frame) == 1 else sum(map(len, frame))) - HEADER.size
        if (body > limits.max_value or len(keys) > 1
                or (keys and len(keys[0]) > limits.max_key)):
            limits.check_request(_describe(what), keys, values, body)
        budget = (self._timeout if wait is None else wait) + SAFETY_MARGIN
        lock = self._lock
        if not lock.acquire(False) and not lock.acquire(
                timeout=min(budget, threading.TIMEOUT_MAX)):
            raise DistStoreTimeoutError(
                f"{_describe(what)} on {self._where} waited {budget:.1f} s for another thread "
                "of this process to finish its request on the shared connection"
            )
        try:
            if self._conn is None or self._closed or self._broken is not None:
                self._reopen(what)
            status, result = self._exchange(frame, budget, what, quiet)
        finally:
            lock.release()
        if status == _ERROR:
            self._failed(status, result, what, wait)
        return status, result

    def _reopen(self, what: str | tuple[str, object]) -> None:
        """Before a request with no open connection: refuse, or connect again; lock held."""
        if self._closed:
            raise DistStoreError(f"{self._where} is closed; {_describe(what)} is not possible")
        if self._broken is not None:
            raise DistNetworkError(f"{self._broken}; {_describe(what)} failed")
        self._connect(Deadline(self._timeout))

    def _call(
        self, code: int, args: list[bytes], what: str | tuple[str, object],
        wait: float | None = None,
        keys: Sequence[bytes] = (), values: Sequence[bytes] = (), quiet: bool = False,
    ) -> list[bytes]:
        """A request that must succeed: its results, or the right exception."""
        status, result = self._request(code, args, what, wait, keys, values, quiet)
        if status:
            self._failed(status, result, what, wait)
        return result

    def _failed(self, status: int, result: list[bytes], what: str | tuple[str, object],
                wait: float | None) -> None:
        """Raise for an answer that is not OK."""
        if status == _TIMEOUT:
            missing = [key.decode(errors="replace") for key in result]
            if isinstance(what, tuple) and what[0] == "queue_pop":
                raise queue_timeout_error(missing[0], wait or 0.0, self._where, _TORCH_KEYS)
            raise timeout_error(missing, wait or 0.0, self._where, _TORCH_KEYS)
        message = result[0].decode(errors="replace") if result else "unknown error"
        raise DistStoreError(f"{self._where} refused {_describe(what)}: {message}")

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
        self._call(Cmd.SET, [name, data], ("set", key), keys=(name,), values=(data,),
                   quiet=True)

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
        return self._call(Cmd.COMPARE_SET, [name, expected, desired], ("compare_set", key),
                          keys=(name,), values=(expected, desired))[0]

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
        self._call(Cmd.APPEND, [name, data], ("append", key), keys=(name,), values=(data,),
                   quiet=True)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of `keys`, waiting up to the store timeout for all of them.

        Raises:
            DistStoreTimeoutError: names the keys still missing.
        """
        names = [name.encode() for name in check_keys(keys)]
        what = ("get", keys[0]) if len(names) == 1 else ("multi_get", list(keys))
        return self._waiting(Cmd.MULTI_GET, names, self._timeout, what)

    def _waiting(self, code: int, names: list[bytes], seconds: float,
                 what: str | tuple[str, object]) -> list[bytes]:
        """A WAIT, MULTI_GET or QUEUE_POP of up to `seconds`, which, when it is still waiting
        after DISTCOMM_STALL_WARN_S, logs the keys still missing, then again after twice as
        long each time (the server is asked in slices that end at each warning)."""
        warn = self._stall_warn
        if not 0 < warn < seconds:
            return self._call(code, [SECONDS.pack(seconds), *names], what, wait=seconds,
                              keys=names)
        # slices end at each warning; the first is `warn` long, and most waits end within
        # it, so the clocks of the later ones start only when one is needed
        started = time.monotonic()
        step = warn
        deadline = stall = None
        while True:
            status, result = self._request(code, [SECONDS.pack(step), *names], what,
                                           wait=step, keys=names)
            if status != _TIMEOUT:
                if status:
                    self._failed(status, result, what, step)
                return result
            if deadline is None or stall is None:
                deadline = Deadline(seconds - (time.monotonic() - started))
                stall = StallClock(warn, started)
            missing = [key.decode(errors="replace") for key in result]
            if deadline.expired():
                if code == Cmd.QUEUE_POP:
                    raise queue_timeout_error(missing[0], seconds, self._where, _TORCH_KEYS)
                raise timeout_error(missing, seconds, self._where, _TORCH_KEYS)
            waited = stall.due()
            if waited is not None:
                log_still_waiting(log, f"{_describe(what)} on {self._where}", waited, missing,
                                  seconds, stall.next)
            step = deadline.slice(stall.until_next())

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
        return [key.decode(errors="replace")
                for key in self._call(Cmd.LIST_KEYS, [], "list_keys")]

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Append `value` to the queue `key` (see Store.queue_push); returns once sent, as
        `set` does."""
        name, data = check_key(key).encode(), to_bytes(value)
        self._call(Cmd.QUEUE_PUSH, [name, data], ("queue_push", key), keys=(name,),
                   values=(data,), quiet=True)

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
            result = self._call(Cmd.QUEUE_POP, [SECONDS.pack(0.0), name], what, wait=0.0,
                                keys=(name,))
            if not result:
                raise queue_empty_error(key, self._where)
            return result[0]
        result = self._waiting(Cmd.QUEUE_POP, [name], self._timeout, what)
        if not result:  # a store timeout of 0: asked without waiting
            raise queue_timeout_error(key, self._timeout, self._where, _TORCH_KEYS)
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
        return TCPStore(self._host, self._port, is_master=False, timeout=self._timeout,
                        wait_for_workers=False, use_libuv=self._use_libuv,
                        auth_key=self._auth_key)

    def close(self) -> None:
        """Close the connection and, on the master, stop the server (idempotent).

        Requests blocked in other threads fail with `DistStoreError`.
        """
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._drop()
        server, self._server = self._server, None
        if (server is not None and os.getpid() == self._pid
                and (not self._shared or SHARED.release(self._host, server))):
            server.stop()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        role = "master" if self._server is not None else "client"
        return f"TCPStore({format_address(self._host, self._port)}, {role})"
