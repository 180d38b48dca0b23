"""Socket helpers shared by the stores and the transports: listen, connect, exact reads."""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import random
import resource
import socket
import struct
import time
import warnings
from collections.abc import Iterator

from .deadline import FOREVER, Deadline, StallClock
from .errors import DistNetworkError

__all__ = [
    "connect",
    "descriptor_shortage",
    "format_address",
    "interface_address",
    "is_loopback",
    "listen",
    "listen_backlog",
    "log_retrying",
    "raise_file_limit",
    "recv_exact",
    "recv_within",
    "reserve_descriptors",
    "retry_delays",
    "send_now",
    "set_keepalive",
    "split_address",
]

log = logging.getLogger(__name__)

#: descriptors kept free beyond what a caller of `reserve_descriptors` asks for
_SPARE_DESCRIPTORS = 64
#: The listen backlog where the kernel's limit cannot be read, and the least ever asked.
DEFAULT_BACKLOG = 4096
MIN_BACKLOG = 1024
_SOMAXCONN = "/proc/sys/net/core/somaxconn"
#: TCP_KEEPIDLE, TCP_KEEPINTVL and TCP_KEEPCNT, None where this platform lacks one
_KEEPALIVE_OPTIONS = tuple(
    getattr(socket, name, None) for name in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT")
)

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


def _open_descriptors() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def descriptor_shortage(exc: OSError, action: str) -> str | None:
    """For EMFILE/ENFILE, what ran out and what to do; None for any other error.

    Args:
        exc: the error a call that makes a descriptor raised.
        action: what was being done ("connect to rank 3 at 10.0.0.2:41234").
    """
    if exc.errno not in (errno.EMFILE, errno.ENFILE):
        return None
    if exc.errno == errno.ENFILE:
        return (
            f"cannot {action}: the system is out of file descriptors (fs.file-max); "
            "close other programs or raise fs.file-max (sysctl)"
        )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    count = _open_descriptors()
    in_use = f"{count} in use" if count is not None else "all in use"
    return (
        f"cannot {action}: this process is out of file descriptors (RLIMIT_NOFILE: "
        f"soft limit {soft}, hard limit {hard}, {in_use}). Each connection to a peer "
        "takes one: raise the limit in the shell or batch script that starts the job "
        f"(ulimit -n {hard if hard != resource.RLIM_INFINITY else 65536}; a hard "
        "limit is raised by the administrator, e.g. in /etc/security/limits.conf)"
    )


def raise_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit (a process that holds a
    connection per peer or per client needs many); returns the soft limit now in force (a
    large number for none)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return 1024
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError):
            pass
    return 1 << 30 if soft == resource.RLIM_INFINITY else soft


def reserve_descriptors(count: int, what: str) -> None:
    """Make room for `count` more descriptors: where the soft RLIMIT_NOFILE is below what
    is open now plus `count` (and a margin), raise it to the hard limit, as MPI libraries
    do; where even the hard limit is too low, warn, naming both and `ulimit -n`.

    Args:
        what: who needs them, for the warning ("[rank 3/2048] tcp set-up").
    """
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return
    in_use = _open_descriptors() or 0
    need = in_use + count + _SPARE_DESCRIPTORS
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    soft = raise_file_limit()
    if soft < need:
        log.warning(
            "%s: may need %d file descriptors (%d open, %d more for its connections), more "
            "than RLIMIT_NOFILE allows (soft %d, hard %d): connections will fail once it is "
            "reached. Raise it in the shell or batch script that starts the job (ulimit -n)",
            what,
            need,
            in_use,
            count,
            soft,
            hard,
        )


def listen_backlog() -> int:
    """The listen backlog to ask for: the kernel's limit (net.core.somaxconn), which caps
    any larger request anyway, so that thousands of clients connecting at once wait in the
    accept queue rather than have their SYNs dropped (a dropped SYN is retried by the
    client's kernel after 1 s, then 3 s, ...); `DEFAULT_BACKLOG` where it cannot be read,
    and never less than `MIN_BACKLOG`."""
    try:
        with open(_SOMAXCONN) as f:
            limit = int(f.read().strip())
    except (OSError, ValueError):
        limit = DEFAULT_BACKLOG
    return max(MIN_BACKLOG, limit)


def listen(
    host: str,
    port: int = 0,
    backlog: int | None = None,
    *,
    authenticated: bool = True,
    what: str = "distcomm",
) -> socket.socket:
    """A listening TCP socket bound to `host:port` (port 0 picks a free port).

    Args:
        backlog: connections the kernel queues until they are accepted; None: the
            kernel's limit (`listen_backlog`).
        authenticated: whether connections must prove DISTCOMM_AUTH_KEY; when not, binding
            an address other than loopback warns (once per address and process).
        what: who listens, for that warning ("the TCPStore", "the tcp backend").

    Raises:
        DistNetworkError: the address cannot be bound (in use, not local, unresolvable).
    """
    try:
        sock = socket.socket(_family(host), socket.SOCK_STREAM)
    except OSError as exc:
        short = descriptor_shortage(exc, f"listen on {format_address(host, port)}")
        if short is None:
            raise
        raise DistNetworkError(short) from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(listen_backlog() if backlog is None else backlog)
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
    for option, value in zip(_KEEPALIVE_OPTIONS, (idle, interval, count), strict=True):
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
    if user_timeout is not None and hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(
            socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(user_timeout * 1000))
        )


def retry_delays(
    first: float = 0.01, most: float = 1.0, rng: random.Random | None = None
) -> Iterator[float]:
    """The pauses between a client's retries: exponential backoff with jitter (endless).

    The ceiling starts at `first` and doubles up to `most`; each pause is drawn uniformly
    between half the ceiling and the ceiling ("equal jitter"). So a retry never comes at
    once, and thousands of clients refused together come back spread over each interval
    rather than all at the same moment, as they would with fixed delays.

    Args:
        rng: the random source (default: the `random` module's).
    """
    uniform = (rng or random).uniform
    ceiling = first
    while True:
        yield uniform(ceiling / 2, ceiling)
        ceiling = min(ceiling * 2, most)


def log_retrying(stall: StallClock, what: str, reason: object, deadline: Deadline) -> None:
    """The warning of a retry loop that has run long: once `stall` says a report is due,
    say what is being retried (`what`: "connecting to the TCPStore at 10.0.0.1:29500"),
    for how long and why (`reason`: the last failure), and until when."""
    waited = stall.due()
    if waited is None:
        return
    until = "no limit" if deadline.seconds is None else f"{deadline.seconds:.1f} s"
    log.warning(
        "%s: still retrying after %.1f s (last: %s); is it running, and is the address "
        "reachable from this host? Retrying up to %s; next report at %.0f s",
        what,
        waited,
        reason,
        until,
        stall.next,
    )


def connect(
    host: str,
    port: int,
    deadline: Deadline,
    what: str = "peer",
    *,
    retry_refused: bool = True,
    stall: StallClock | None = None,
) -> socket.socket:
    """Connect to `host:port`, retrying refused connections until `deadline`.

    Retries (a refusal, a reset, a SYN unanswered) pause as `retry_delays` says: growing,
    randomised pauses, so that many clients refused together do not come back in step.

    Args:
        what: who listens there, for error messages ("the store", "rank 3").
        retry_refused: False where the address was published after its socket listened,
            so that a refusal means the listener is gone: it raises at once (the
            exception's `__cause__` is the ConnectionRefusedError).
        stall: when given, retrying past its next report is logged (`log_retrying`);
            the caller starts it, so that its own retries count on the same clock.

    Raises:
        DistNetworkError: no connection could be made before the deadline.
    """
    address = format_address(host, port)
    delays = retry_delays()
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
            sock = _dial(host, port, left)
        except socket.gaierror as exc:
            raise DistNetworkError(f"cannot resolve host {host!r}: {exc.strerror}") from exc
        except OSError as exc:
            short = descriptor_shortage(exc, f"connect to {what} at {address}")
            if short is not None:
                raise DistNetworkError(short) from exc
            if (exc.errno not in _RETRY_ERRNOS and not isinstance(exc, socket.timeout)) or (
                not retry_refused and exc.errno == errno.ECONNREFUSED
            ):
                raise DistNetworkError(
                    f"could not connect to {what} at {address}: {exc.strerror or exc}"
                ) from exc
            last = exc
            if stall is not None:
                log_retrying(
                    stall, f"connecting to {what} at {address}", exc.strerror or exc, deadline
                )
            time.sleep(deadline.slice(next(delays)))
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not host.startswith("127.") and host != "::1":  # a loopback peer cannot vanish
            set_keepalive(sock)  # unseen: its kernel answers for it (4 system calls saved)
        if sock.gettimeout() is not None:
            sock.settimeout(None)
        return sock


def _dial(host: str, port: int, seconds: float | None) -> socket.socket:
    """One connection attempt of up to `seconds` (None: the kernel's own limit).

    An IPv4 address is dialled without a name lookup, on a blocking socket whose connect
    the kernel bounds (SO_SNDTIMEO): one system call that lets go of the GIL where the
    lookup and a timed connect take three, which counts when thousands of threads
    connect at once. A timeout raises TimeoutError, as `socket.create_connection` does.
    """
    try:
        socket.inet_pton(socket.AF_INET, host)
    except OSError:  # a name or an IPv6 address
        return socket.create_connection((host, port), timeout=seconds)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if sock.gettimeout() is not None:  # a process-wide default timeout
            sock.settimeout(None)
        if seconds is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))
        try:
            sock.connect((host, port))
        except BlockingIOError as exc:  # EINPROGRESS: the send timeout ran out first
            raise TimeoutError(errno.ETIMEDOUT, "timed out") from exc
        if seconds is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(0.0))
    except BaseException:
        sock.close()
        raise
    return sock


def _timeval(seconds: float) -> bytes:
    """A struct timeval of `seconds` (0: none; anything else at least 1 ms)."""
    if seconds > 0:
        seconds = min(max(seconds, 0.001), FOREVER)
    whole = int(seconds)
    return struct.pack("@ll", whole, int((seconds - whole) * 1e6))


_NO_TIMEOUT = _timeval(0.0)


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


def recv_within(sock: socket.socket, size: int, seconds: float) -> bytes | None:
    """Up to `size` bytes of what `sock` receives within `seconds` (> 0); None when nothing
    came in time, b"" when the peer closed.

    On a blocking socket the kernel bounds the read (SO_RCVTIMEO, cleared again after):
    one system call that lets go of the GIL, where a socket timeout costs three (a change
    of mode, a poll, the read), which counts when thousands of threads connect at once. A
    socket in timeout mode is read with its timeout set to `seconds`.

    Raises:
        OSError: the read failed (a reset connection, typically).
    """
    if sock.gettimeout() is None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
        try:
            return sock.recv(size)
        except (BlockingIOError, TimeoutError):  # the kernel's timeout surfaces as EAGAIN
            return None
        finally:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _NO_TIMEOUT)
    sock.settimeout(seconds)
    try:
        return sock.recv(size)
    except TimeoutError:
        return None


_SEND_NOW = getattr(socket, "MSG_DONTWAIT", 0) | getattr(socket, "MSG_NOSIGNAL", 0)


def send_now(sock: socket.socket, data: bytes) -> int:
    """Send what the kernel takes of `data` at once, without waiting; returns the bytes
    sent (0 when the socket's buffer is full). A small request always fits, so a blocking
    socket needs no send timeout set for it.

    Raises:
        OSError: the send failed (a reset connection, typically).
    """
    try:
        return sock.send(data, _SEND_NOW)
    except BlockingIOError:
        return 0


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
