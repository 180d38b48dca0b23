"""The stores under the dynamic rendezvous: c10d (a TCPStore an agent hosts), etcd and file.

c10d follows torch: the endpoint is "host[:port]" (port 29400 when left out, "localhost"
when empty). The agent hosts the TCPStore when ``--rdzv_conf is_host=true``, or, when
is_host is not given, when the endpoint's host is this machine; several agents on one
machine then race to bind the port and those that find it taken connect as clients (the
first agent to arrive hosts). The store dies with the hosting agent, so its `shutdown`
waits (up to close_timeout) until the other nodes have left. A store for a loopback
endpoint listens on that address only, any other on every interface (the name may resolve
to another address here than elsewhere, behind NAT say), once the endpoint's host resolves:
an agent told to host for a name that does not resolve within read_timeout raises
`RendezvousConnectionError`, as torch's does. Port 0 hosts on a free port
(``--standalone`` uses "localhost:0").

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
import time

import psutil

from ...deadline import Deadline
from ...errors import DistError, DistNetworkError
from ...net import format_address, retry_delays, split_address
from ...store import FileStore, Store, TCPStore
from ..wording import given, torch_message
from .api import RendezvousConnectionError, RendezvousError, RendezvousParameters
from .dynamic import DynamicRendezvousHandler
from .dynamic_rendezvous import create_store_handler
from .settings import RendezvousSettings, settings_from_params

__all__ = [
    "C10D_FAILED",
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
    "wait_resolvable",
]

log = logging.getLogger("distcomm.launch.rendezvous")

#: torch's port for a c10d endpoint given without one
DEFAULT_C10D_PORT = 29400

_HOST_PATTERN = re.compile(r"^[\w.:%-]+$")


def parse_endpoint(
    endpoint: str | None, default_port: int, *, from_flags: bool = False
) -> tuple[str, int]:
    """(host, port) of a rendezvous endpoint: "host", "host:port", "[v6]", "[v6]:port" or a
    bare IPv6 address; "" (or blanks) is ("localhost", default_port), as torch's
    `parse_rendezvous_endpoint`. A colon with no port after it ("host:") is refused, as
    torch refuses it, rather than read as the default port.

    Args:
        from_flags: the endpoint came from --rdzv_endpoint: the message names the flag
            (else the parameter, ``endpoint``).

    Raises:
        ValueError: the endpoint is malformed: torch's sentence ("The port number of the
            rendezvous endpoint ... must be an integer between 0 and 65536.", "The hostname
            of the rendezvous endpoint ..."), then the parameter or flag and what to write.
    """
    text = (endpoint or "").strip()
    if not text:
        return "localhost", default_port
    where = given("endpoint", endpoint, from_flags)
    bad_host = torch_message(
        f"The hostname of the rendezvous endpoint '{text}' must be a dot-separated list of "
        "labels, an IPv4 address, or an IPv6 address.",
        where,
        "write HOST, HOST:PORT or [IPV6]:PORT",
    )
    try:
        host, port_text = split_address(text)  # a bare IPv6 address is all host
    except ValueError:
        raise ValueError(bad_host) from None
    bracketed = text.startswith("[")
    has_port = (text.count(":") == 1 and not bracketed) or (bracketed and "]:" in text)
    if not bracketed and text.count(":") > 1 and not _is_ipv6(host):
        raise ValueError(bad_host)
    if not host or not _HOST_PATTERN.match(host):
        raise ValueError(bad_host)
    if not has_port:
        return host, default_port
    if not port_text.isascii() or not port_text.isdigit() or int(port_text) > 65535:
        alone = "" if default_port < 0 else f", or HOST alone for port {default_port}"
        raise ValueError(
            torch_message(
                f"The port number of the rendezvous endpoint '{text}' must be an integer "
                "between 0 and 65536.",
                where,
                f"write HOST:PORT with a port in 0..65535{alone}",
            )
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


#: torch's sentence for a c10d store that can be neither hosted nor reached
C10D_FAILED = "The connection to the C10d store has failed. See inner exception for details."
#: getaddrinfo errors of a name that does not resolve *yet* (no such name, a temporary
#: failure, no address): retried until the read timeout, as a TCPStore client retries them
_NOT_YET = frozenset(
    code
    for code in (getattr(socket, name, None) for name in ("EAI_NONAME", "EAI_AGAIN", "EAI_NODATA"))
    if code is not None
)


def wait_resolvable(host: str, seconds: float) -> BaseException | None:
    """Wait up to `seconds` for `host` to resolve; None once it does, else the last lookup
    error. A name that does not resolve yet (a DNS record still being published) is
    retried until then; any other lookup error is returned at once."""
    deadline = Deadline(seconds)
    delays = retry_delays()
    while True:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            return None
        except UnicodeError as exc:
            return exc
        except socket.gaierror as exc:
            if exc.errno not in _NOT_YET or deadline.expired():
                return exc
            time.sleep(deadline.slice(next(delays)))


def create_c10d_store(
    params: RendezvousParameters, settings: RendezvousSettings
) -> tuple[TCPStore, tuple[str, int], bool]:
    """The c10d rendezvous's TCPStore, its (host, port) and whether this process hosts it.

    An agent that hosts the store (listening on every interface, or on a loopback address)
    first waits, up to read_timeout, for the endpoint's host to resolve, as torch's host
    waits for its own client to reach the store by that name: a name that resolves nowhere
    is an error here too, not a store no node can reach.

    Raises:
        ValueError: a malformed endpoint, or port 0 on an agent that does not host.
        RendezvousConnectionError: the store can be neither hosted nor reached, or the
            host of the endpoint of an agent that hosts it does not resolve (torch's
            sentence, then which endpoint and why).
    """
    from_flags = params.from_flags
    host, port = parse_endpoint(params.endpoint, DEFAULT_C10D_PORT, from_flags=from_flags)
    address = format_address(host, port)
    where = given("endpoint", params.endpoint, from_flags)
    is_host = settings.is_host if settings.is_host is not None else is_local_host(host)
    if port == 0 and not is_host:
        raise ValueError(
            f"{where}: port 0 (any free port) only works on the agent that hosts the store "
            f"(a local endpoint, or {given('is_host', 'true', from_flags)}); give the other "
            "nodes the port the host picked"
        )
    taken = False
    if is_host:
        unresolved = wait_resolvable(host, settings.read_timeout)
        if unresolved is not None:
            reason = getattr(unresolved, "strerror", None) or unresolved
            raise RendezvousConnectionError(
                torch_message(
                    C10D_FAILED,
                    where,
                    f"this agent hosts the store, but the endpoint's host {host!r} does not "
                    f"resolve ({reason}; waited up to read_timeout="
                    f"{settings.read_timeout:g} s), so no node could reach the store by that "
                    "name: give an endpoint every node resolves to this machine (its name or "
                    f"address), or check the name (getent hosts {host})",
                )
            ) from unresolved
        try:
            store = host_tcp_store(host, port, settings.read_timeout, params.auth_key)
        except DistNetworkError as exc:
            if settings.is_host is not None or not _address_in_use(exc):
                raise RendezvousConnectionError(
                    torch_message(
                        C10D_FAILED, where, f"this agent cannot host the store at {address}: {exc}"
                    )
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
            torch_message(
                C10D_FAILED,
                where,
                f"cannot reach the store at {address} within read_timeout="
                f"{settings.read_timeout:g} s{note}: {exc}",
            )
        ) from exc
    return store, (host, port), False


def create_etcd_store(params: RendezvousParameters, settings: RendezvousSettings) -> Store:
    """An EtcdStore at --rdzv_endpoint with the prefix /distcomm/rdzv/<run_id>/.

    Raises:
        ValueError: a missing or malformed endpoint.
        RendezvousError: the etcd store is not available in this installation.
        RendezvousConnectionError: the etcd server cannot be used.
    """
    ff = params.from_flags
    if not params.endpoint.strip():
        raise ValueError(
            f"{given('backend', 'etcd', ff)} needs {given('endpoint', 'HOST[:PORT]', ff)} of "
            "an etcd server (port 2379 when left out)"
        )
    try:
        from ...store.etcd import EtcdStore
    except ImportError as exc:
        raise RendezvousError(f"{given('backend', 'etcd', ff)} is not available: {exc}") from exc
    try:
        return EtcdStore(
            params.endpoint,
            prefix=f"{settings.etcd_prefix}/{params.run_id}/",
            timeout=settings.read_timeout,
        )
    except ValueError as exc:
        raise ValueError(f"{given('endpoint', params.endpoint, ff)}: {exc}") from exc
    except DistError as exc:
        raise RendezvousConnectionError(
            f"{given('backend', 'etcd', ff)}: cannot use the etcd server at "
            f"{params.endpoint}: {exc}"
        ) from exc


def create_file_store(params: RendezvousParameters, settings: RendezvousSettings) -> FileStore:
    """A FileStore at the path --rdzv_endpoint, never deleted by the rendezvous.

    Raises:
        ValueError: no path given.
        RendezvousConnectionError: the file cannot be opened or is not a FileStore file.
    """
    path = params.endpoint.strip()
    ff = params.from_flags
    if not path:
        raise ValueError(
            f"{given('backend', 'file', ff)} needs {given('endpoint', 'PATH', ff)}: a file on "
            "a filesystem every node shares (created if missing)"
        )
    try:
        return FileStore(path, world_size=-1, timeout=settings.read_timeout)
    except DistError as exc:
        raise RendezvousConnectionError(f"{given('backend', 'file', ff)}: {exc}") from exc


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
