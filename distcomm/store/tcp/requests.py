"""The request path of a TCPStore: connecting with retries, one exchange, the errors.

`StoreClient` is the half of `store.TCPStore` that talks to the server: it opens,
authenticates and registers the connection (`connection.Connection` does the socket
work), sends one request at a time under the connection lock, reads its answer and
turns every failure into the store's errors. `TCPStore` adds the constructor and the
Store methods, each one call of `_call`, `_request` or `_waiting`.

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
does, a host name that does not resolve yet (the master too: `master.open_server`). The pauses
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
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence

from ... import auth
from ...deadline import FOREVER, Deadline, StallClock
from ...errors import DistNetworkError, DistStoreError, DistStoreTimeoutError
from ...net import connect, format_address, log_retrying, retry_delays
from ..hash import log_still_waiting, queue_timeout_error, timeout_error
from .connection import Connection, PeerClosed
from .master import unresolved, unresolved_error
from .protocol import HEADER, SECONDS, Cmd, Limits, Status, encode_frame

__all__ = ["FOREIGN_HINT", "GREETING_WARN_S", "SAFETY_MARGIN", "TORCH_KEYS", "StoreClient"]

#: Extra seconds the client waits beyond a request's own timeout before giving up on it.
SAFETY_MARGIN = 1.0
#: Seconds of silence after connecting before a client warns that what answers may not
#: be a TCPStore (the server greets at once; one busy with thousands of clients may greet
#: late, so the client keeps waiting); DISTCOMM_STALL_WARN_S when that is shorter.
GREETING_WARN_S = 5.0
#: What to do when what answers at the address is not a TCPStore.
FOREIGN_HINT = (
    "is another program using this port? Pick another port (MASTER_PORT, or "
    "the port of distcomm-run's --rdzv_endpoint)"
)
log = logging.getLogger(__name__)

_ERROR, _TIMEOUT = int(Status.ERROR), int(Status.TIMEOUT)
#: How torch's TCPStore shows keys in its timeout message (it stores each under "/"):
#: ours repeat that list after torch's words, so that code matching them finds them.
TORCH_KEYS = "/"
_REGISTER = encode_frame(Cmd.REGISTER, [])[0]
#: Requests that a repetition would apply again (or, for a pop, whose item would be lost
#: with its answer): one whose answer is lost may or may not have been applied.
_UNREPEATABLE = frozenset(
    {Cmd.ADD, Cmd.COMPARE_SET, Cmd.DELETE_KEY, Cmd.APPEND, Cmd.QUEUE_PUSH, Cmd.QUEUE_POP}
)
#: What the server does to a connection it sheds while it is being made: the errors
#: (a `__cause__`) after which a client connects again.
_DROPPED = (PeerClosed, ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


def _fate(frame: list[bytes], what: str | tuple[str, object]) -> str:
    """For a request whose answer was lost: that it may have been applied, where that
    matters (see `_UNREPEATABLE`)."""
    if HEADER.unpack_from(frame[0])[1] not in _UNREPEATABLE:
        return ""
    name = what[0] if isinstance(what, tuple) else what
    return (
        f"; the {name} may or may not have been applied, and it is not sent again: "
        "look at the store before repeating it"
    )


def _describe(what: str | tuple[str, object]) -> str:
    """A request for messages: "num_keys", or ("get", "k") as "get('k')" (made on error only)."""
    return what if isinstance(what, str) else f"{what[0]}({what[1]!r})"


class StoreClient:
    """A TCPStore's connection to its server and the requests it runs on it.

    A mixin of `store.TCPStore`, which sets, before its first request, what this reads:
    `_host`, `_port`, `_auth_key`, `_timeout`, `_stall_warn`, `_pid` (the creating
    process), `_lock` (one request at a time on the shared connection), `_conn` (None
    until connected), `_closed`, `_broken` (why the server is taken for gone, or None),
    `_registered`, `_limits` and `_local_address`.
    """

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
                if unknown is None and (
                    not isinstance(exc.__cause__, _DROPPED) or deadline.expired()
                ):
                    raise
                self._broken = None  # a registration cut short: not the store gone
                log_retrying(stall, f"connecting to {self._where}", exc, deadline)
            # a connection reset before the greeting was read may be another program that
            # closed on the early REGISTER: from now on, read the greeting before sending
            early = False
            delays = delays or retry_delays()
            time.sleep(deadline.slice(next(delays)))
            if unknown is not None and deadline.expired():
                raise unresolved_error(
                    self._host, self._port, deadline.seconds, unknown
                ) from unknown

    def _connect_once(self, deadline: Deadline, stall: StallClock, early: bool) -> None:
        """One connection; with `early`, a keyless client's REGISTER goes out before the
        greeting is read, and its answer comes with the greeting (`auth.client_handshake`):
        one round trip where there were two."""
        sock = connect(self._host, self._port, deadline, what="the TCPStore", stall=stall)
        try:
            register = not self._registered
            first = _REGISTER if register and (early or self._auth_key) else b""
            rest = auth.client_handshake(
                sock,
                self._auth_key,
                deadline,
                self._where,
                expected="a distcomm TCPStore",
                hint=FOREIGN_HINT,
                warn_after=min(GREETING_WARN_S, self._stall_warn),
                first=first,
                address=format_address(self._host, self._port),
            )
            self._conn = Connection(sock, rest)
            self._local_address = ""
            if register:
                # counted once per connection: one cut short before its answer was most
                # likely shed unserved, and this connection registers anew
                left = deadline.remaining()
                _, result = self._exchange(
                    [_REGISTER],
                    FOREVER if left is None else left + SAFETY_MARGIN,
                    "register",
                    sent=bool(first),
                )
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
        self,
        frame: list[bytes],
        seconds: float,
        what: str | tuple[str, object],
        quiet: bool = False,
        sent: bool = False,
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
                raise DistStoreError(f"{self._where} was closed during {_describe(what)}") from exc
            raise DistStoreTimeoutError(
                f"{self._where} did not answer {_describe(what)} within {seconds:.1f} s; "
                "the connection was reset and is reopened by the next request"
                f"{_fate(frame, what)}"
            ) from exc
        except (PeerClosed, OSError) as exc:
            self._drop()
            if self._closed:
                raise DistStoreError(f"{self._where} was closed during {_describe(what)}") from exc
            reason = "" if isinstance(exc, PeerClosed) else f" ({exc})"
            self._broken = (
                f"store at {format_address(self._host, self._port)} closed the connection"
                f"{reason} (did the master process exit?)"
            )
            raise DistNetworkError(
                f"{self._broken}; {_describe(what)} failed{_fate(frame, what)}"
            ) from exc
        if late is not None:
            raise DistStoreError(
                f"{self._where} refused an earlier set, append or multi_set of this process: "
                f"{late} (reported by {_describe(what)}, which completed)"
            )
        return status, result

    def _request(
        self,
        code: int,
        args: list[bytes],
        what: str | tuple[str, object],
        wait: float | None = None,
        keys: Sequence[bytes] = (),
        values: Sequence[bytes] = (),
        quiet: bool = False,
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
        if body > limits.max_value or len(keys) > 1 or (keys and len(keys[0]) > limits.max_key):
            limits.check_request(_describe(what), keys, values, body)
        budget = (self._timeout if wait is None else wait) + SAFETY_MARGIN
        lock = self._lock
        if not lock.acquire(False) and not lock.acquire(timeout=min(budget, threading.TIMEOUT_MAX)):
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
        self,
        code: int,
        args: list[bytes],
        what: str | tuple[str, object],
        wait: float | None = None,
        keys: Sequence[bytes] = (),
        values: Sequence[bytes] = (),
        quiet: bool = False,
    ) -> list[bytes]:
        """A request that must succeed: its results, or the right exception."""
        status, result = self._request(code, args, what, wait, keys, values, quiet)
        if status:
            self._failed(status, result, what, wait)
        return result

    def _failed(
        self, status: int, result: list[bytes], what: str | tuple[str, object], wait: float | None
    ) -> None:
        """Raise for an answer that is not OK."""
        if status == _TIMEOUT:
            missing = [key.decode(errors="replace") for key in result]
            if isinstance(what, tuple) and what[0] == "queue_pop":
                raise queue_timeout_error(missing[0], wait or 0.0, self._where, TORCH_KEYS)
            raise timeout_error(missing, wait or 0.0, self._where, TORCH_KEYS)
        message = result[0].decode(errors="replace") if result else "unknown error"
        raise DistStoreError(f"{self._where} refused {_describe(what)}: {message}")

    def _waiting(
        self, code: int, names: list[bytes], seconds: float, what: str | tuple[str, object]
    ) -> list[bytes]:
        """A WAIT, MULTI_GET or QUEUE_POP of up to `seconds`, which, when it is still waiting
        after DISTCOMM_STALL_WARN_S, logs the keys still missing, then again after twice as
        long each time (the server is asked in slices that end at each warning)."""
        warn = self._stall_warn
        if not 0 < warn < seconds:
            return self._call(code, [SECONDS.pack(seconds), *names], what, wait=seconds, keys=names)
        # slices end at each warning; the first is `warn` long, and most waits end within
        # it, so the clocks of the later ones start only when one is needed
        started = time.monotonic()
        step = warn
        deadline = stall = None
        while True:
            status, result = self._request(
                code, [SECONDS.pack(step), *names], what, wait=step, keys=names
            )
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
                    raise queue_timeout_error(missing[0], seconds, self._where, TORCH_KEYS)
                raise timeout_error(missing, seconds, self._where, TORCH_KEYS)
            waited = stall.due()
            if waited is not None:
                log_still_waiting(
                    log, f"{_describe(what)} on {self._where}", waited, missing, seconds, stall.next
                )
            step = deadline.slice(stall.until_next())
