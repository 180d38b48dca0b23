"""The address an agent advertises to the other nodes: always an IP, never a host name.

When the rendezvous backend serves no store the workers can share (etcd, file), the
agent of node 0 hosts one and tells the other nodes where: this address. A host name
(torch advertises ``socket.getfqdn()``) is only usable where every node resolves it the
same way; an IP on the right interface works wherever the nodes can route to each other.
The rules, first match wins:

1. ``--local_addr`` as given (it may be a name: the user vouches for it);
2. a single-node run: 127.0.0.1;
3. a rendezvous endpoint that is a network address (etcd): the source address of the
   route to it, as the kernel picks it (``ip route get``); the nodes reach the endpoint,
   so they share its network;
4. no endpoint address (file): the IPv4 address of the interface of the default route;
   without one, of the first interface that is up and not loopback (a cluster fabric
   without a default route); without one, 127.0.0.1, with a warning naming --local_addr.

Route lookups connect a UDP socket, which sends nothing: only the routing table is read.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

import psutil

from ..rendezvous.backends import parse_endpoint

__all__ = [
    "advertised_address",
    "default_route_address",
    "endpoint_address",
    "resolve_ipv4",
    "route_source",
]

log = logging.getLogger("distcomm.launch")

_ROUTE_TABLE = "/proc/net/route"


def route_source(host: str, port: int) -> str | None:
    """The local IP the kernel would send from to reach `host:port`, or None.

    `host` may be a name; it is resolved here. Nothing is sent.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, address in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(address)
                source = probe.getsockname()[0]
        except OSError:
            continue
        if source and source not in ("0.0.0.0", "::"):
            return str(source).split("%")[0]
    return None


def _interface_ipv4(name: str) -> str | None:
    for address in psutil.net_if_addrs().get(name, []):
        if address.family == socket.AF_INET and address.address:
            return str(address.address)
    return None


def _default_route_interface() -> str | None:
    """The interface of the IPv4 default route with the lowest metric (Linux), or None."""
    try:
        with open(_ROUTE_TABLE, encoding="ascii") as table:
            rows = [line.split() for line in table.read().splitlines()[1:]]
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for row in rows:
        if len(row) < 8:
            continue
        iface, destination, flags, metric, mask = row[0], row[1], row[3], row[6], row[7]
        try:
            up = int(flags, 16) & 0x1  # RTF_UP
            default = int(destination, 16) == 0 and int(mask, 16) == 0
            rank = int(metric)
        except ValueError:
            continue
        if up and default and (best is None or rank < best[0]):
            best = (rank, iface)
    return None if best is None else best[1]


def default_route_address() -> str | None:
    """The IPv4 address of the default route's interface, else of the first interface
    that is up and not loopback; None when there is neither."""
    iface = _default_route_interface()
    if iface is not None:
        address = _interface_ipv4(iface)
        if address is not None:
            return address
    stats = psutil.net_if_stats()
    for name in sorted(psutil.net_if_addrs()):
        stat = stats.get(name)
        if stat is None or not stat.isup:
            continue
        address = _interface_ipv4(name)
        if address is not None and not ipaddress.ip_address(address).is_loopback:
            return address
    return None


def endpoint_address(backend: str, endpoint: str) -> tuple[str, int] | None:
    """(host, port) of --rdzv_endpoint when it is a network address a route leads to
    (etcd: "host[:port]" or "http://host:port", port 2379 when left out), else None
    (file: a path; c10d and static serve the workers' store themselves)."""
    if backend != "etcd":
        return None
    text = endpoint.strip()
    if "://" in text:
        text = text.split("://", 1)[1].rstrip("/")
    try:
        return parse_endpoint(text, 2379)
    except ValueError:
        return None


def advertised_address(
    local_addr: str | None, max_nodes: int, endpoint: tuple[str, int] | None
) -> str:
    """The address other nodes reach this node at (see the module's rules).

    Args:
        local_addr: --local_addr, or None.
        max_nodes: the largest number of nodes of the run (--nnodes).
        endpoint: (host, port) of the rendezvous endpoint when it is a network address
            (etcd), None when it is not (file).

    Returns:
        `local_addr` when given, otherwise an IP address.
    """
    if local_addr:
        return local_addr
    if max_nodes == 1:
        return "127.0.0.1"
    if endpoint is not None:
        source = route_source(*endpoint)
        if source is not None:
            return source
        log.warning(
            "distcomm-run: no route to the rendezvous endpoint %s:%d found; "
            "advertising the address of the default route's interface",
            *endpoint,
        )
    address = default_route_address()
    if address is not None:
        return address
    log.warning(
        "distcomm-run: this host has no network interface but loopback: the other "
        "nodes are told 127.0.0.1, which only works if they run on this host; pass "
        "--local_addr=IP (an address the other nodes reach this host at)"
    )
    return "127.0.0.1"


def resolve_ipv4(host: str) -> str:
    """`host`'s first IPv4 address (the address a store binds to), or `host` itself when it
    has none."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return host
