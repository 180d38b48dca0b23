"""Socket helpers shared by the stores and the transports: listen, connect, exact reads."""

from __future__ import annotations

import errno
import ipaddress
import socket
import warnings

from .deadline import Deadline
from .errors import DistNetworkError

__all__ = [
    "connect",
    "format_address",
    "interface_address",
    "is_loopback",
    "listen",
    "recv_exact",
    "set_keepalive",
    "split_address",
]

# Errors that mean "nobody listens there yet": a client retries them until its deadline.
_RETRY_ERRNOS = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ETIMEDOUT,
    errno.EAGAIN,
}


def format_address(host: str, port: int) -> str:
    """`host:port`, with IPv6 hosts bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_address(text: str) -> tuple[str, str]:
    """(host, port text) of "host:port", "[ipv6]:port", "host", "[ipv6]" or a bare IPv6
    address (all host); the port text is "" when none is given. The inverse of
    `format_address`; callers check the parts and word their own errors.

    Raises:
        ValueError: a "[" without its "]", or something other than ":port" after it.
    """
    if text.startswith("["):
        host, bracket, tail = text[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise ValueError(f"{text!r} is not [IPV6]:PORT")
        return host, tail[1:]
    if text.count(":") == 1:
        host, _, port = text.partition(":")
        return host, port
    return text, ""


def _family(host: str) -> socket.AddressFamily:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise DistNetworkError(f"cannot resolve host {host!r}: {exc.strerror}") from exc
    families = [info[0] for info in infos]
    return socket.AF_INET if socket.AF_INET in families else families[0]


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback address (127.0.0.0/8, ::1).

    "0.0.0.0" and "::" (every interface) are not; neither is a name that does not resolve.
    """
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    addresses = {info[4][0].split("%")[0] for info in infos}
    try:
        return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)
    except ValueError:
        return False


def listen(
    host: str,
    port: int = 0,
    backlog: int = 1024,
    *,
    authenticated: bool = True,
    what: str = "distcomm",
) -> socket.socket:
    """A listening TCP socket bound to `host:port` (port 0 picks a free port).

    Args:
        authenticated: whether connections must prove DISTCOMM_AUTH_KEY; when not, binding
            an address other than loopback warns (once per address and process).
        what: who listens, for that warning ("the TCPStore", "the tcp backend").

    Raises:
        DistNetworkError: the address cannot be bound (in use, not local, unresolvable).
    """
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        hint = (
            "another process listens there; pick another port or pass 0 for a free one"
            if exc.errno == errno.EADDRINUSE
            else "is it an address of this host?"
        )
        raise DistNetworkError(
            f"cannot listen on {format_address(host, port)}: {exc.strerror} ({hint})"
        ) from exc
    if not authenticated and not is_loopback(host):
        warnings.warn(  # the default filter shows each distinct message once per process
            f"{what} listens on {host}, which other hosts can reach, and DISTCOMM_AUTH_KEY is "
            "not set: anyone who can reach the port can read and change the job's state. "
            "Set the same DISTCOMM_AUTH_KEY on every process of the job",
            RuntimeWarning,
            stacklevel=3,
        )
    return sock


def set_keepalive(
    sock: socket.socket,
    idle: int = 10,
    interval: int = 5,
    count: int = 3,
    user_timeout: float | None = None,
) -> None:
    """Enable TCP keep-alive so a vanished peer host is noticed in about idle+interval*count s.

    Keep-alive only probes a connection with nothing in flight. With `user_timeout`
    (seconds), data left unacknowledged that long also drops the connection
    (TCP_USER_TIMEOUT), as does a keep-alive unanswered that long after the last data
    received, so a dead link or host is found within `user_timeout` whatever the connection
    was doing; without it the kernel retransmits for about 15 minutes. A peer that is alive
    but does not read (stopped: its receive window stays closed) counts as dead too once
    `user_timeout` passes.
    """
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", idle),
        ("TCP_KEEPINTVL", interval),
        ("TCP_KEEPCNT", count),
    ):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if user_timeout is not None and hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(
            socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(user_timeout * 1000))
        )


def connect(host: str, port: int, deadline: Deadline, what: str = "peer") -> socket.socket:
    """Connect to `host:port`, retrying refused connections until `deadline`.

    Args:
        what: who listens there, for error messages ("the store", "rank 3").

    Raises:
        DistNetworkError: no connection could be made before the deadline.
    """
    address = format_address(host, port)
    delay = 0.01
    last: OSError | None = None
    while True:
        left = deadline.remaining()
        if left is not None and left <= 0:
            reason = f": {last.strerror or last}" if last else ""
            raise DistNetworkError(
                f"could not connect to {what} at {address} within {deadline.seconds:.1f} s"
                f"{reason} (is it running, and is the address reachable from this host?)"
            )
        try:
            sock = socket.create_connection((host, port), timeout=left if left else None)
        except socket.gaierror as exc:
            raise DistNetworkError(f"cannot resolve host {host!r}: {exc.strerror}") from exc
        except OSError as exc:
            if exc.errno not in _RETRY_ERRNOS and not isinstance(exc, socket.timeout):
                raise DistNetworkError(
                    f"could not connect to {what} at {address}: {exc.strerror or exc}"
                ) from exc
            last = exc
            delay = deadline.nap(delay, 1.0)
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_keepalive(sock)
        sock.settimeout(None)
        return sock


def recv_exact(sock: socket.socket, size: int, deadline: Deadline, what: str) -> bytes:
    """Read exactly `size` bytes; fewer only when the peer closes the connection first.

    Raises:
        DistNetworkError: the deadline passed or the socket failed.
    """
    data = bytearray()
    while len(data) < size:
        left = deadline.remaining()
        if left is not None and left <= 0:
            raise DistNetworkError(f"timed out reading from {what}")
        sock.settimeout(left)
        try:
            chunk = sock.recv(size - len(data))
        except TimeoutError:
            raise DistNetworkError(f"timed out reading from {what}") from None
        except OSError as exc:
            raise DistNetworkError(f"reading from {what} failed: {exc}") from exc
        if not chunk:
            break
        data += chunk
    return bytes(data)


def interface_address(ifname: str) -> str:
    """The first IPv4 (else IPv6) address of network interface `ifname`.

    Raises:
        ValueError: no such interface, or it has no IP address; lists the interfaces.
    """
    import psutil  # its import costs every process ~20 ms: only where an interface is named

    addresses = psutil.net_if_addrs()
    if ifname not in addresses:
        raise ValueError(
            f"network interface {ifname!r} (DISTCOMM_SOCKET_IFNAME or GLOO_SOCKET_IFNAME) "
            f"does not exist; "
            f"this host has: {', '.join(sorted(addresses))}"
        )
    for family in (socket.AF_INET, socket.AF_INET6):
        for addr in addresses[ifname]:
            if addr.family == family:
                return addr.address.split("%")[0]
    raise ValueError(f"network interface {ifname!r} has no IP address")
