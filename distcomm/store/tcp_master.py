"""How a master TCPStore gets its server: its own, or the process's shared multi-tenant one.

`SHARED` finds the running server of a host and port for a second
`TCPStore(..., is_master=True, multi_tenant=True)` and stops it when its last tenant
closes; `listener_from_fd` checks a socket the caller bound (`master_listen_fd`).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable

from .tcp_server import StoreServer

__all__ = ["SHARED", "SharedServers", "listener_from_fd"]


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
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                  socket.AF_INET6):
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
