"""Watching TCP links between hosts: the link timeout, stall reports and why a link failed.

Links between hosts can fail silently: a pulled cable or a dead host sends nothing, and
the kernel retransmits for many minutes. Every connection therefore has a link timeout
(`link_timeout`: the group timeout, within 10 to 30 s): data unacknowledged that long, or
keep-alive probes unanswered that long after the last data, drop the connection
(TCP_USER_TIMEOUT, keep-alive) and abort every group that uses it, naming the peer and its
address. The fabric's I/O thread reads each connection's TCP state once a second
(`check_link`) and logs a warning when a link stalls (nothing acknowledged for
`STALL_AFTER` seconds while data waits, or the peer's receive window closed that long)
and again when it recovers, so a short outage that the job survives is visible too.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
import time
from typing import Protocol

__all__ = [
    "LINK_TIMEOUT_MAX",
    "LINK_TIMEOUT_MIN",
    "LOGGER_NAME",
    "STALL_AFTER",
    "WATCH_EVERY",
    "Stall",
    "check_link",
    "failure_reason",
    "link_timeout",
]

#: the logger of the TCP transport (fabric, links, channels): the name users filter on, kept
#: from before the transport moved under `engine/`
LOGGER_NAME = "distcomm.backends.transport.tcp"

log = logging.getLogger(LOGGER_NAME)

#: the bounds of a connection's link timeout (the group timeout, clamped): a connection
#: that acknowledges nothing this long is dead; at least 10 s, so a short hiccup between
#: two operations of a group with a small timeout does not drop it
LINK_TIMEOUT_MIN, LINK_TIMEOUT_MAX = 10.0, 30.0
#: a link is reported as stalled after this many seconds without progress
STALL_AFTER = 3.0
#: how often the I/O thread looks at every link
WATCH_EVERY = 1.0
#: struct tcp_info (linux/tcp.h): the fields read here, by byte offset
_TCPI_PROBES, _TCPI_RETRANSMITS = 3, 2
_TCPI_UNACKED, _TCPI_LAST_DATA_RECV, _TCPI_LAST_ACK_RECV, _TCPI_SND_WND = 24, 52, 56, 228
_TCPI_BYTES = 232


def link_timeout(group_timeout: float | None) -> float:
    """How long a connection may stay silent (see the module doc): the group timeout, at
    least LINK_TIMEOUT_MIN and at most LINK_TIMEOUT_MAX seconds."""
    if group_timeout is None:
        return LINK_TIMEOUT_MAX
    return min(LINK_TIMEOUT_MAX, max(LINK_TIMEOUT_MIN, group_timeout))


class Stall:
    """A link that makes no progress: why, since when, and whether it was logged."""

    __slots__ = ("kind", "logged", "since")

    def __init__(self, kind: str, since: float) -> None:
        self.kind, self.since, self.logged = kind, since, False


class Link(Protocol):
    """What the watcher needs of a connection."""

    sock: socket.socket
    address: str
    idle: int
    stall: Stall | None


def check_link(link: Link, label: str, peer: str, timeout: float) -> None:
    """Look at one connection's TCP state; log a stall once and its recovery.

    Raises:
        OSError: the socket was closed meanwhile (its reader reports that).
    """
    info = link.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_BYTES)
    if len(info) < _TCPI_LAST_ACK_RECV + 4:
        return
    unacked = struct.unpack_from("I", info, _TCPI_UNACKED)[0]
    since_ack = struct.unpack_from("I", info, _TCPI_LAST_ACK_RECV)[0] / 1000.0
    since_data = struct.unpack_from("I", info, _TCPI_LAST_DATA_RECV)[0] / 1000.0
    window = (
        struct.unpack_from("I", info, _TCPI_SND_WND)[0] if len(info) >= _TCPI_SND_WND + 4 else None
    )
    now = time.monotonic()
    kind, quiet = "", 0.0
    if unacked and since_ack >= STALL_AFTER:
        kind, quiet = "ack", since_ack  # sent, never acknowledged: retransmitting
    elif info[_TCPI_PROBES] and not unacked and window != 0:
        # keep-alive probes unanswered: they started `idle` seconds after the last data
        kind, quiet = "probe", max(0.0, since_data - link.idle)
    elif window == 0:
        kind = "window"  # the peer's receive buffer is full: it does not read
    stall = link.stall
    if not kind:
        if stall is not None and stall.logged:
            log.warning(
                "%s: the link to %s (%s) recovered after a stall of %.1f s",
                label,
                peer,
                link.address,
                now - stall.since,
            )
        link.stall = None
        return
    if stall is None or stall.kind != kind:
        stall = link.stall = Stall(kind, now - quiet)
    if stall.logged or now - stall.since < STALL_AFTER:
        return
    stall.logged = True
    if kind == "ack":
        what = (
            f"{unacked} segment(s) unacknowledged for {now - stall.since:.1f} s, "
            f"{info[_TCPI_RETRANSMITS]} retransmission(s) so far (link down, or the "
            "host unreachable?)"
        )
    elif kind == "probe":
        what = (
            f"keep-alive probes unanswered for {now - stall.since:.1f} s (the connection "
            "was idle; link down, or the host unreachable?)"
        )
    else:
        what = (
            f"its receive window has been closed for {now - stall.since:.1f} s: {peer} "
            "does not read (stopped or hung?)"
        )
    log.warning(
        "%s: the link to %s (%s) has stalled: %s; it is dropped and the groups using it "
        "aborted if this lasts %.0f s",
        label,
        peer,
        link.address,
        what,
        timeout,
    )


def failure_reason(link: Link | None, exc: BaseException, peer: str, timeout: float) -> str:
    """Why the connection to `peer` ("rank 3") ended with `exc`, for the groups' failure."""
    stall = link.stall if link is not None else None
    code = getattr(exc, "errno", None)
    # the kernel gave up on the link (TCP_USER_TIMEOUT or keep-alive): ETIMEDOUT goes to
    # whichever of the reader and a sender asks first; the other finds the stream closed,
    # which a stall that has lasted about the link timeout explains too
    expired = stall is not None and (time.monotonic() - stall.since >= timeout - 2 * WATCH_EVERY)
    if code == errno.ETIMEDOUT or expired:
        where = f" ({link.address})" if link is not None else ""
        limit = f"{timeout:.0f} s"
        if stall is not None and stall.kind == "window":
            why = f"{peer} read nothing from it for {limit} (is its process stopped?)"
        elif stall is not None and stall.kind == "probe":
            why = (
                f"it was idle and keep-alive probes went unanswered for {limit} (link "
                f"down, or the host of {peer} down or unreachable?)"
            )
        else:
            why = (
                f"nothing sent on it was acknowledged for {limit} (link down, or the "
                f"host of {peer} down or unreachable?)"
            )
        return (
            f"the link to {peer}{where} failed: {why}; it was dropped after the link "
            f"timeout of {limit}"
        )
    if isinstance(exc, EOFError) or code in (errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED):
        return f"{peer} closed the connection (exit or crash?)"
    return f"the connection to {peer} failed: {exc}"
