"""The stores under the dynamic rendezvous: c10d (a TCPStore an agent hosts), etcd and file.

c10d follows torch: the endpoint is "host[:port]" (port 29400 when left out, "localhost"
when empty). The agent hosts the TCPStore when ``--rdzv_conf is_host=true``, or, when
is_host is not given, when the endpoint's host is this machine; several agents on one
machine then race to bind the port and those that find it taken connect as clients (the
first agent to arrive hosts). The store dies with the hosting agent, so its `shutdown`
waits (up to close_timeout) until the other nodes have left. A store for a loopback
endpoint listens on that address only, any other on every interface. Port 0 hosts on a
free port (``--standalone`` uses "localhost:0").

etcd keeps the state in an etcd server (`distcomm.store.etcd.EtcdStore`, imported only
when used), under the prefix ``/distcomm/rdzv/<run_id>/``. file keeps it in a FileStore at
the endpoint's path, on a filesystem every node shares; the rendezvous never deletes that
file. Both keep a closed run's state: give each run a new --rdzv_id (or a new file).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import re
import socket

import psutil

from ...errors import DistError, DistNetworkError
from ...net import format_address, split_address
from ...store import FileStore, Store, TCPStore
from .api import RendezvousConnectionError, RendezvousError, RendezvousParameters
from .dynamic import DynamicRendezvousHandler
from .dynamic_rendezvous import create_store_handler
from .settings import RendezvousSettings, settings_from_params

__all__ = [
    "DEFAULT_C10D_PORT",
    "bind_address",
    "create_c10d_handler",
    "create_c10d_store",
    "create_etcd_handler",
    "create_etcd_store",
    "create_file_handler",
    "create_file_store",
    "host_tcp_store",
    "is_local_host",
    "parse_endpoint",
]

log = logging.getLogger("distcomm.launch.rendezvous")

#: torch's port for a c10d endpoint given without one
DEFAULT_C10D_PORT = 29400

_HOST_PATTERN = re.compile(r"^[\w.:%-]+$")


def parse_endpoint(endpoint: str | None, default_port: int) -> tuple[str, int]:
    """(host, port) of --rdzv_endpoint: "host", "host:port", "[v6]", "[v6]:port" or a bare
    IPv6 address; "" (or blanks) is ("localhost", default_port), as torch's
    `parse_rendezvous_endpoint`. A colon with no port after it ("host:") is refused, as
    torch refuses it, rather than read as the default port.

    Raises:
        ValueError: the endpoint is malformed; the message names --rdzv_endpoint and keeps
            torch's wording ("The port number of the rendezvous endpoint ... must be an
            integer between 0 and 65536", "The hostname of the rendezvous endpoint ...").
    """
    text = (endpoint or "").strip()
    if not text:
        return "localhost", default_port
    try:
        host, port_text = split_address(text)  # a bare IPv6 address is all host
    except ValueError:
        raise ValueError(
            f"--rdzv_endpoint={endpoint!r} is not HOST[:PORT] or [IPV6]:PORT"
        ) from None
    bracketed = text.startswith("[")
    has_port = (text.count(":") == 1 and not bracketed) or (bracketed and "]:" in text)
    if not bracketed and text.count(":") > 1 and not _is_ipv6(host):
        raise ValueError(
            f"--rdzv_endpoint={endpoint!r}: the hostname of the rendezvous endpoint "
            f"'{endpoint}' must be a dot-separated list of labels, an IPv4 address, or an "
            "IPv6 address (write an IPv6 address with a port as [ADDRESS]:PORT)"
        )
    if not host or not _HOST_PATTERN.match(host):
        raise ValueError(
            f"--rdzv_endpoint={endpoint!r}: the hostname of the rendezvous endpoint "
            f"'{endpoint}' must be a dot-separated list of labels, an IPv4 address, or an "
            f"IPv6 address, not {host!r}"
        )
    if not has_port:
        return host, default_port
    if not port_text.isascii() or not port_text.isdigit() or int(port_text) > 65535:
        what = "is missing after the ':'" if not port_text else f"{port_text!r} is not one"
        raise ValueError(
            f"--rdzv_endpoint={endpoint!r}: the port number of the rendezvous endpoint "
            f"'{endpoint}' must be an integer between 0 and 65536 (exclusive), and {what}; "
            "write HOST:PORT, or HOST alone for the default port"
        )
    return host, int(port_text)


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).version == 6
    except ValueError:
        return False


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def is_local_host(host: str) -> bool:
    """Whether `host` names this machine: localhost, its host name or one of its addresses."""
    if _is_loopback(host) or host in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):
        return False
    local = {
        addr.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for addr in addrs
    }
    return any(_is_loopback(address) or address in local for address in resolved)


def bind_address(host: str) -> str:
    """Where a store hosted for clients reaching `host` listens: a loopback address as is,
    anything else on every interface (the host name may resolve differently here)."""
    if _is_loopback(host):
        return host
    return "::" if ":" in host else "0.0.0.0"


def host_tcp_store(host: str, port: int, timeout: float, auth_key: bytes | None = None) -> TCPStore:
    """A TCPStore served by this process for clients that reach it at `host:port`, with
    `auth_key` (None: DISTCOMM_AUTH_KEY).

    Raises:
        DistNetworkError: the port cannot be bound (in use, not local).
    """
    return TCPStore(
        bind_address(host),
        port,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        auth_key=auth_key,
    )


def _address_in_use(exc: DistNetworkError) -> bool:
    """Whether the bind failed because the port is taken (an OSError EADDRINUSE anywhere
    down the chain of causes: the store may wrap it more than once)."""
    cause: BaseException | None = exc.__cause__
    for _ in range(8):
        if cause is None:
            return False
        if isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE:
            return True
        cause = cause.__cause__
    return False


def create_c10d_store(
    params: RendezvousParameters, settings: RendezvousSettings
) -> tuple[TCPStore, tuple[str, int], bool]:
    """The c10d rendezvous's TCPStore, its (host, port) and whether this process hosts it.

    Raises:
        ValueError: a malformed endpoint, or port 0 on an agent that does not host.
        RendezvousConnectionError: the store can be neither hosted nor reached.
    """
    host, port = parse_endpoint(params.endpoint, DEFAULT_C10D_PORT)
    address = format_address(host, port)
    is_host = settings.is_host if settings.is_host is not None else is_local_host(host)
    if port == 0 and not is_host:
        raise ValueError(
            f"--rdzv_endpoint={params.endpoint!r}: port 0 (any free port) only works on the "
            "agent that hosts the store (a local endpoint, or --rdzv_conf is_host=true); "
            "give the other nodes the port the host picked"
        )
    taken = False
    if is_host:
        try:
            store = host_tcp_store(host, port, settings.read_timeout, params.auth_key)
        except DistNetworkError as exc:
            if settings.is_host is not None or not _address_in_use(exc):
                raise RendezvousConnectionError(
                    f"--rdzv_backend=c10d: this agent cannot host the store at {address}: {exc}"
                ) from exc
            taken = True
            log.info(
                "c10d rendezvous: %s is taken (another agent hosts the store): connecting to it",
                address,
            )
        else:
            log.info(
                "c10d rendezvous: this agent hosts the store at %s",
                format_address(host, store.port),
            )
            return store, (host, store.port), True
    try:
        store = TCPStore(
            host, port, is_master=False, timeout=settings.read_timeout, auth_key=params.auth_key
        )
    except DistError as exc:
        note = (
            " (this agent found the port taken, so it connected to what holds it as to "
            "another agent's store)"
            if taken
            else ""
        )
        raise RendezvousConnectionError(
            f"--rdzv_backend=c10d: cannot reach the store at {address} within "
            f"read_timeout={settings.read_timeout:g} s{note}: {exc}"
        ) from exc
    return store, (host, port), False


def create_etcd_store(params: RendezvousParameters, settings: RendezvousSettings) -> Store:
    """An EtcdStore at --rdzv_endpoint with the prefix /distcomm/rdzv/<run_id>/.

    Raises:
        ValueError: a missing or malformed endpoint.
        RendezvousError: the etcd store is not available in this installation.
        RendezvousConnectionError: the etcd server cannot be used.
    """
    if not params.endpoint.strip():
        raise ValueError(
            "--rdzv_backend=etcd needs --rdzv_endpoint=HOST[:PORT] of an etcd "
            "server (port 2379 when left out)"
        )
    try:
        from ...store.etcd import EtcdStore
    except ImportError as exc:
        raise RendezvousError(f"--rdzv_backend=etcd is not available: {exc}") from exc
    try:
        return EtcdStore(
            params.endpoint,
            prefix=f"{settings.etcd_prefix}/{params.run_id}/",
            timeout=settings.read_timeout,
        )
    except ValueError as exc:
        raise ValueError(f"--rdzv_endpoint={params.endpoint!r}: {exc}") from exc
    except DistError as exc:
        raise RendezvousConnectionError(
            f"--rdzv_backend=etcd: cannot use the etcd server at {params.endpoint}: {exc}"
        ) from exc


def create_file_store(params: RendezvousParameters, settings: RendezvousSettings) -> FileStore:
    """A FileStore at the path --rdzv_endpoint, never deleted by the rendezvous.

    Raises:
        ValueError: no path given.
        RendezvousConnectionError: the file cannot be opened or is not a FileStore file.
    """
    path = params.endpoint.strip()
    if not path:
        raise ValueError(
            "--rdzv_backend=file needs --rdzv_endpoint=PATH: a file on a "
            "filesystem every node shares (created if missing)"
        )
    try:
        return FileStore(path, world_size=-1, timeout=settings.read_timeout)
    except DistError as exc:
        raise RendezvousConnectionError(f"--rdzv_backend=file: {exc}") from exc


def _handler_over(
    store: Store,
    params: RendezvousParameters,
    bootstrap_address: tuple[str, int] | None = None,
    hosts_store: bool = False,
) -> DynamicRendezvousHandler:
    try:
        return create_store_handler(
            store, params, bootstrap_address, owned_store=store, hosts_store=hosts_store
        )
    except BaseException:
        store.close()
        raise


def create_c10d_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """The c10d backend: a dynamic rendezvous in a TCPStore one agent hosts (in a FileStore
    at the path --rdzv_endpoint with --rdzv_conf store_type=file, as torch's c10d)."""
    settings = settings_from_params(params)
    if settings.store_type == "file":
        return create_file_handler(params)
    store, address, hosted = create_c10d_store(params, settings)
    return _handler_over(store, params, address, hosted)


def create_etcd_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """The etcd backend: a dynamic rendezvous in an etcd server."""
    return _handler_over(create_etcd_store(params, settings_from_params(params)), params)


def create_file_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """The file backend: a dynamic rendezvous in a FileStore on a shared filesystem."""
    return _handler_over(create_file_store(params, settings_from_params(params)), params)
