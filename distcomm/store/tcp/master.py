"""How a master TCPStore gets its server: its own, the process's shared multi-tenant one,
or none where a launcher's agent serves the store already.

`SHARED` finds the running server of a host and port for a second
`TCPStore(..., is_master=True, multi_tenant=True)` and stops it when its last tenant
closes; `listener_from_fd` checks a socket the caller bound (`master_listen_fd`);
`agent_serves` says whether a master that cannot bind should use the launcher's store,
as torch's does under torchrun (TORCHELASTIC_USE_AGENT_STORE). `unresolved` and
`unresolved_error` are the address part every TCPStore shares: a host name that does not
resolve yet is retried until the timeout, by the master and the clients alike, as torch
does (a DNS name may appear only once its host is up), then fails with torch's words.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from ... import config
from ...deadline import Deadline, StallClock
from ...errors import DistNetworkError
from ...net import format_address, log_retrying, retry_delays
from .server import StoreServer

__all__ = [
    "AGENT_STORE_VAR",
    "BIND_FAILED",
    "SHARED",
    "SharedServers",
    "agent_serves",
    "listener_from_fd",
    "open_server",
    "unresolved",
    "unresolved_error",
]

#: torchrun's variable, set in its workers: the agent already serves the store at
#: MASTER_ADDR:MASTER_PORT ("True"), so a worker's master TCPStore there is its client.
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"
#: torch's words for a master that cannot bind, which its tests and users match (the
#: rest of our message says which address and why).
BIND_FAILED = "The server socket has failed to listen on any local network address"
log = logging.getLogger(__name__)
#: getaddrinfo errors that a name which does not resolve *yet* gives (no such name, a
#: temporary failure, no address): retried; any other lookup error fails at once.
_NOT_YET = frozenset(
    code
    for code in (getattr(socket, name, None) for name in ("EAI_NONAME", "EAI_AGAIN", "EAI_NODATA"))
    if code is not None
)


def agent_serves(port: int) -> bool:
    """Whether a launcher's agent serves the store on `port`: TORCHELASTIC_USE_AGENT_STORE
    is true and MASTER_PORT is `port`, the test torch's TCPStore makes when its master
    cannot bind.

    Raises:
        ValueError: TORCHELASTIC_USE_AGENT_STORE is set to something other than a boolean.
    """
    if not config.get(AGENT_STORE_VAR):
        return False
    master_port = (config.get("MASTER_PORT") or "").strip()
    return master_port.isdigit() and int(master_port) == port


def unresolved(exc: BaseException) -> bool:
    """Whether `exc` (a DistNetworkError) came of a host name that does not resolve (yet)."""
    cause = exc.__cause__
    return isinstance(cause, socket.gaierror) and cause.errno in _NOT_YET


def unresolved_error(
    host: str, port: int, seconds: float | None, exc: BaseException
) -> DistNetworkError:
    """The error of a host name that still did not resolve at the timeout: torch's words
    ("The client socket has timed out after 1000ms while trying to connect to (host,
    port)"), then why and what to check."""
    cause = exc.__cause__
    reason = getattr(cause, "strerror", None) or str(cause or exc)
    waited = 0.0 if seconds is None else seconds
    return DistNetworkError(
        f"The client socket has timed out after {round(waited * 1000)}ms while trying to "
        f"connect to ({host}, {port}): the host name {host!r} did not resolve "
        f"({reason}) within {waited:.1f} s. Check it (MASTER_ADDR, the tcp:// URL or "
        f"TCPStore's host_name) and that this host can resolve it "
        f"(getent hosts {host}); {format_address(host, port)} was never reached"
    )


class SharedServers:
    """The servers of multi-tenant TCPStores in this process, by (host, port), with the
    number of tenants using each: a server stops when its last tenant closes.

    This is process-wide on purpose (torch keeps the same cache): it is how a second
    `TCPStore(..., is_master=True, multi_tenant=True)` finds the first one's server.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._servers: dict[tuple[str, int], list] = {}  # (host, port) -> [server, tenants]

    def acquire(self, host: str, port: int, make: Callable[[], StoreServer]) -> StoreServer:
        """The running server of `host:port` (port 0: always a new one), with one more
        tenant; `make()` starts one where there is none."""
        with self._lock:
            entry = self._servers.get((host, port)) if port else None
            if entry is None or entry[0].stopped:
                server = make()
                entry = self._servers[(host, server.port)] = [server, 0]
            entry[1] += 1
            return entry[0]

    def release(self, host: str, server: StoreServer) -> bool:
        """One tenant less; True when it was the last (the caller stops the server)."""
        with self._lock:
            entry = self._servers.get((host, server.port))
            if entry is None or entry[0] is not server:
                return True
            entry[1] -= 1
            if entry[1] > 0:
                return False
            del self._servers[(host, server.port)]
            return True


SHARED = SharedServers()


def listener_from_fd(fd: int, port: int) -> socket.socket:
    """A socket on a duplicate of `fd`, checked to be a TCP socket bound to `port` (any
    port when `port` is 0).

    Raises:
        TypeError: `fd` is not an int.
        ValueError: `fd` is not an open TCP socket, is not bound, or is bound to another
            port.
    """
    if isinstance(fd, bool) or not isinstance(fd, int):
        raise TypeError(f"TCPStore master_listen_fd must be an int, got {type(fd).__name__}")
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError as exc:
        raise ValueError(
            f"TCPStore master_listen_fd {fd} is not an open socket ({exc.strerror}); pass "
            "the fileno() of a TCP socket bound to the store's port"
        ) from exc
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            raise ValueError(
                f"TCPStore master_listen_fd {fd} is not a TCP socket; pass the fileno() of "
                "a TCP socket bound to the store's port"
            )
        bound = sock.getsockname()[1]
        if bound == 0:
            raise ValueError(
                f"TCPStore master_listen_fd {fd} is not bound to a port; bind it first "
                "(port 0 there picks a free one, which the store's port then reports)"
            )
        if port and bound != port:
            raise ValueError(
                f"TCPStore master_listen_fd {fd} is bound to port {bound}, but the store was "
                f"given port {port}; pass port={bound}, or 0 to take the socket's"
            )
    except BaseException:
        sock.close()
        raise
    return sock


def open_server(
    host: str,
    port: int,
    auth_key: bytes | None,
    listener: socket.socket | None,
    multi_tenant: bool,
    deadline: Deadline,
    stall_warn: float,
) -> tuple[StoreServer | None, bool]:
    """The master's server, started (or the tenant's server that runs already), and
    whether it is shared; (None, False) where a launcher's agent serves the store already.

    A host name that does not resolve yet is retried until `deadline`, as clients do.
    A master that cannot bind where the agent serves the store (`agent_serves`:
    TORCHELASTIC_USE_AGENT_STORE, with `port` as MASTER_PORT) becomes a client of that
    store, as torch's does: the caller connects to it as to any.

    Args:
        listener: a socket the caller bound (`master_listen_fd`), closed here when no
            server of ours serves on it.
        stall_warn: seconds of retrying a name before it is logged (DISTCOMM_STALL_WARN_S).

    Raises:
        DistNetworkError: the address cannot be bound (opening with torch's words,
            `BIND_FAILED`), or its name did not resolve before `deadline`.
        ValueError: TORCHELASTIC_USE_AGENT_STORE holds no boolean.
    """
    started: list[StoreServer] = []

    def start() -> StoreServer:
        server = StoreServer(host, port, auth_key, listener=listener)
        started.append(server)
        server.start()
        return server

    stall = StallClock(stall_warn)
    delays = retry_delays()
    where = f"the TCPStore at {format_address(host, port)}"
    try:
        while True:
            try:
                if multi_tenant:
                    return SHARED.acquire(host, port, start), True
                return start(), False
            except DistNetworkError as exc:
                if listener is not None:
                    raise
                if unresolved(exc):
                    if deadline.expired():
                        raise unresolved_error(host, port, deadline.seconds, exc) from exc
                    log_retrying(stall, f"resolving {host!r} for {where}", exc, deadline)
                    time.sleep(deadline.slice(next(delays)))
                    continue
                if port and agent_serves(port):
                    log.info(
                        "%s: the launcher's agent serves the store there already (%s, "
                        "MASTER_PORT=%d): this master is its client (%s)",
                        where,
                        AGENT_STORE_VAR,
                        port,
                        exc,
                    )
                    return None, False
                raise DistNetworkError(f"{BIND_FAILED}: {exc}") from exc
    finally:
        if listener is not None and not started:
            listener.close()  # not served on: a tenant's server serves already
