"""The TCP transport: one persistent connection per pair of ranks, set up through the store.

The connections are made once, when the group is made (`mesh.connect_mesh`). One
reader thread per peer reads headers and receives
payloads straight into posted buffers (`recv_into` on memoryviews); senders use
`sendmsg` on the header and the payload, so no message is copied or pickled.

A connection that breaks aborts the group: every pending and later operation raises
`DistNetworkError` naming the peer, and the other peers are told why (ABORT), so
every rank fails within moments instead of waiting out its timeout.

Links between hosts can also fail silently: a pulled cable or a dead host sends nothing,
and the kernel retransmits for many minutes. Every connection therefore has a link
timeout (`link_timeout`: the group timeout, within 10 to 30 s): data unacknowledged that
long, or keep-alive probes unanswered that long after the last data, drop the connection
(TCP_USER_TIMEOUT, keep-alive) and abort the group, naming the peer and its address. A
watcher thread reads each connection's TCP state once a second and logs a warning when a
link stalls (nothing acknowledged for `STALL_AFTER` seconds while data waits, or the
peer's receive window closed that long) and again when it recovers, so a short outage
that the job survives is visible too.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
import threading
import time

from ... import net
from ...config import load as load_config
from ...deadline import Deadline
from ...errors import (
    DistBackendError,
    DistError,
    DistNetworkError,
    DistTimeoutError,
    GroupDestroyedError,
    caused_by_peers,
)
from ...store.base import Store
from ..protocol import ABORT, BYE, COLL, P2P, PROGRESS, QUERY, SIG, STATUS, Failure, Header
from .base import Transport
from .mailbox import Mailbox
from .mesh import connect_mesh

__all__ = [
    "LINK_TIMEOUT_MAX",
    "LINK_TIMEOUT_MIN",
    "STALL_AFTER",
    "TcpTransport",
    "link_timeout",
]

log = logging.getLogger(__name__)

#: the bounds of a group's link timeout (its group timeout, clamped): a connection that
#: acknowledges nothing this long is dead; at least 10 s, so a short hiccup between two
#: operations of a group with a small timeout does not drop it
LINK_TIMEOUT_MIN, LINK_TIMEOUT_MAX = 10.0, 30.0
#: a link is reported as stalled after this many seconds without progress
STALL_AFTER = 3.0
_WATCH_SLICE = 1.0
#: struct tcp_info (linux/tcp.h): the fields the watcher reads, by byte offset
_TCPI_PROBES, _TCPI_RETRANSMITS = 3, 2
_TCPI_UNACKED, _TCPI_LAST_DATA_RECV, _TCPI_LAST_ACK_RECV, _TCPI_SND_WND = 24, 52, 56, 228
_TCPI_BYTES = 232

_FAILURE_KINDS: tuple[type[DistError], ...] = (DistNetworkError, DistBackendError, DistTimeoutError)
_SEND_SLICE = 0.5
#: payloads at least this large wait briefly for their receive (Mailbox.claim)
_WAIT_FOR_POST_MIN = 64 * 1024
_WAIT_FOR_POST = 0.25
#: how long leaving the group waits for the peers to answer its goodbye (`close`)
_GOODBYE_WAIT = 5.0


def link_timeout(group_timeout: float | None) -> float:
    """How long a group's connection may stay silent (see the module doc): the group
    timeout, at least LINK_TIMEOUT_MIN and at most LINK_TIMEOUT_MAX seconds."""
    if group_timeout is None:
        return LINK_TIMEOUT_MAX
    return min(LINK_TIMEOUT_MAX, max(LINK_TIMEOUT_MIN, group_timeout))


class _Stall:
    """A link that makes no progress: why, since when, and whether it was logged."""

    __slots__ = ("kind", "logged", "since")

    def __init__(self, kind: str, since: float) -> None:
        self.kind, self.since, self.logged = kind, since, False


class _Peer:
    __slots__ = ("address", "dirty", "gone", "idle", "lock", "rank", "sock", "stall", "thread")

    def __init__(self, rank: int, sock: socket.socket, link_timeout: float) -> None:
        self.rank = rank
        self.sock = sock
        try:
            host, port = sock.getpeername()[:2]
            self.address = net.format_address(host, port)
        except OSError:
            self.address = "?"
        self.idle = max(1, int(link_timeout / 3))  # seconds before keep-alive probes
        net.set_keepalive(
            sock,
            idle=self.idle,
            interval=max(1, int(link_timeout / 6)),
            user_timeout=link_timeout,
        )
        self.stall: _Stall | None = None  # set by the link watcher
        # sends block in the kernel (faster than polling from Python), but never for
        # longer than this at a time, so the sender notices deadlines and aborts
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, int(_SEND_SLICE * 1e6))
        )
        self.lock = threading.Lock()  # one sender at a time: messages never interleave
        self.dirty = False  # a send stopped half-way: the stream can carry nothing more
        self.gone = False  # the peer said goodbye or the connection ended
        self.thread: threading.Thread | None = None


class TcpTransport(Transport):
    """Full-mesh TCP connections between the `size` ranks of one group.

    Args:
        store: the group's private store (addresses are published there).
        rank, size: this rank and the group size.
        deadline: how long connecting may take.
        label: prefix of messages, e.g. "[rank 1/4] tcp backend (group 'default')".
        link_timeout: seconds a connection may acknowledge nothing before it is dropped
            and the group aborted (see `link_timeout()`).
    """

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        deadline: Deadline,
        label: str,
        link_timeout: float = LINK_TIMEOUT_MAX,
    ) -> None:
        super().__init__(rank, size)
        self.mailbox = Mailbox(rank, size)
        self._label = label
        self._key = load_config().auth_key
        self._closing = False
        self._link_timeout = link_timeout
        self._peers: dict[int, _Peer] = {}
        self._stop_watch = threading.Event()
        self._watcher: threading.Thread | None = None
        if size > 1:
            sockets = connect_mesh(store, rank, size, deadline, label, self._key)
            self._peers = {p: _Peer(p, sock, link_timeout) for p, sock in sockets.items()}
        for peer in self._peers.values():
            peer.thread = threading.Thread(
                target=self._read_loop,
                args=(peer,),
                daemon=True,
                name=f"distcomm-recv-{rank}-{peer.rank}",
            )
            peer.thread.start()
        if self._peers:
            self._watcher = threading.Thread(
                target=self._watch_links, daemon=True, name=f"distcomm-links-{rank}"
            )
            self._watcher.start()

    # -- sending ---------------------------------------------------------------------------

    def send(self, peer: int, header: Header, payload: memoryview, deadline: Deadline) -> None:
        failure = self.mailbox.failure
        if failure is not None:
            raise failure.error()
        conn = self._peers.get(peer)
        if conn is None or conn.gone:
            raise caused_by_peers(
                DistNetworkError(f"rank {peer} has left the group; cannot send to it"), [peer]
            )
        packed = header.pack()
        with conn.lock:
            if conn.dirty:
                raise DistNetworkError(f"the connection to rank {peer} was cut mid-message")
            try:
                self._send_views(conn, [memoryview(packed), payload], deadline)
            except DistError:
                conn.dirty = True
                raise

    def _send_views(self, conn: _Peer, views: list[memoryview], deadline: Deadline) -> None:
        views = [v for v in views if len(v)]
        while views:
            try:
                sent = conn.sock.sendmsg(views, [], socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):  # SO_SNDTIMEO passed: check, retry
                sent = 0
            except OSError as exc:
                failure = self._connection_failure(conn.rank, exc)
                self.abort(failure)
                raise failure.error() from None
            while sent and views:
                if sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0
            if views:
                failure = self.mailbox.failure
                if failure is not None:
                    raise failure.error()
                if deadline.expired():
                    raise DistTimeoutError(
                        f"sending to rank {conn.rank} made no progress for "
                        f"{deadline.seconds:.1f} s (is it alive and reading?)"
                    )

    def _send_control(
        self, conn: _Peer, kind: int, payload: bytes = b"", code: int = 0, *, last: bool = False
    ) -> bool:
        """Best-effort ABORT/BYE/QUERY/STATUS: never blocks long, never interleaves a message.

        With `last`, nothing more is sent on the connection after this (it is marked gone
        under the send lock). Returns whether the message was sent.
        """
        if not conn.lock.acquire(timeout=1.0):
            return False
        try:
            if conn.dirty or conn.gone:
                return False
            payload = payload[:4096]
            header = Header(kind, code, nbytes=len(payload)).pack()
            try:
                self._send_views(conn, [memoryview(header), memoryview(payload)], Deadline(1.0))
            except DistError:
                conn.dirty = True
                return False
            return True
        finally:
            if last:
                conn.gone = True
            conn.lock.release()

    # -- receiving -------------------------------------------------------------------------

    def _read_loop(self, conn: _Peer) -> None:
        raw = bytearray(Header.SIZE)
        view = memoryview(raw)
        sock = conn.sock
        mailbox = self.mailbox
        try:
            while True:
                _read_into(sock, view)
                header = Header.unpack(raw)
                kind, nbytes = header.kind, header.nbytes
                if self._closing:
                    # this rank said goodbye: read and drop what still comes until the
                    # peer's BYE (its answer, or its own goodbye) or its close (`close`)
                    if kind == BYE:
                        return
                    _skip(sock, nbytes)
                    continue
                if kind == BYE:
                    # the mailbox first: a sender that finds `gone` set can ask it why
                    mailbox.peer_gone(
                        conn.rank,
                        Failure(
                            DistNetworkError,
                            f"rank {conn.rank} has left the group (destroy_process_group or exit)",
                            (conn.rank,),
                        ),
                    )
                    # answer with the last message sent to it: everything it sent is read
                    self._send_control(conn, BYE, last=True)
                    conn.gone = True  # also when the answer could not be sent
                    _drain(sock)
                    return
                if kind == ABORT:
                    reason = _read_bytes(sock, nbytes).decode(errors="replace")
                    code = header.op if header.op < len(_FAILURE_KINDS) else 1
                    self.abort(
                        Failure(
                            _FAILURE_KINDS[code],
                            f"rank {conn.rank} aborted the group: {reason}",
                            (conn.rank,),
                        ),
                        tell=conn.rank,
                    )
                    _drain(sock)
                    return
                if kind == QUERY:
                    self._send_control(conn, STATUS, PROGRESS.pack(*mailbox.progress()))
                    continue
                if kind == STATUS:
                    mailbox.record_status(conn.rank, _read_bytes(sock, nbytes))
                    continue
                if kind == SIG:
                    try:
                        mailbox.check_signature(conn.rank, header)
                    except DistError as exc:
                        self.abort(Failure(type(exc), str(exc)))
                    continue
                try:
                    recv = mailbox.claim(
                        conn.rank, header, _WAIT_FOR_POST if nbytes >= _WAIT_FOR_POST_MIN else 0.0
                    )
                except DistError as exc:  # a message for a collective this rank finished
                    _skip(sock, nbytes)
                    self.abort(Failure(type(exc), str(exc)))
                    continue
                if recv is None:
                    payload = bytearray(nbytes)
                    _read_into(sock, memoryview(payload))
                    mailbox.stash(conn.rank, header, payload)
                    continue
                error = mailbox.check(recv, conn.rank, header)
                if error is not None:
                    _skip(sock, nbytes)
                    recv._finish(conn.rank, error)
                    if kind == COLL:
                        self.abort(Failure(type(error), str(error)))
                    continue
                _read_into(sock, recv.buffer)
                recv._finish(conn.rank, None)
                if kind == P2P:  # the next one waits briefly for its receive (`claim`)
                    mailbox.p2p_taken[conn.rank] = time.monotonic()
        except (OSError, EOFError) as exc:
            conn.gone = True
            if self._closing:
                return
            self.abort(self._connection_failure(conn.rank, exc))

    def _connection_failure(self, peer: int, exc: BaseException) -> Failure:
        conn = self._peers.get(peer)
        stall = conn.stall if conn is not None else None
        code = getattr(exc, "errno", None)
        # the kernel gave up on the link (TCP_USER_TIMEOUT or keep-alive): ETIMEDOUT goes to
        # whichever of the reader and a sender asks first; the other finds the stream
        # closed, which a stall that has lasted about the link timeout explains too
        expired = stall is not None and (
            time.monotonic() - stall.since >= self._link_timeout - 2 * _WATCH_SLICE
        )
        if code == errno.ETIMEDOUT or expired:
            where = f" ({conn.address})" if conn is not None else ""
            limit = f"{self._link_timeout:.0f} s"
            if stall is not None and stall.kind == "window":
                why = f"rank {peer} read nothing from it for {limit} (is its process stopped?)"
            elif stall is not None and stall.kind == "probe":
                why = (
                    f"it was idle and keep-alive probes went unanswered for {limit} (link "
                    f"down, or the host of rank {peer} down or unreachable?)"
                )
            else:
                why = (
                    f"nothing sent on it was acknowledged for {limit} (link down, or the "
                    f"host of rank {peer} down or unreachable?)"
                )
            return Failure(
                DistNetworkError,
                f"the link to rank {peer}{where} failed: {why}; it was dropped after the link "
                f"timeout of {limit}",
                (peer,),
            )
        if isinstance(exc, EOFError) or code in (
            errno.ECONNRESET,
            errno.EPIPE,
            errno.ECONNABORTED,
        ):
            return Failure(
                DistNetworkError, f"rank {peer} closed the connection (exit or crash?)", (peer,)
            )
        return Failure(DistNetworkError, f"the connection to rank {peer} failed: {exc}", (peer,))

    # -- link watching ---------------------------------------------------------------------

    def _watch_links(self) -> None:
        """Once a second, log links that stall and links that recover (see the module doc)."""
        while not self._stop_watch.wait(_WATCH_SLICE):
            for conn in list(self._peers.values()):
                if conn.gone or self._closing:
                    continue
                try:
                    self._check_link(conn)
                except OSError:
                    continue  # closed meanwhile: the reader reports it
                except Exception:  # the watcher must outlive any surprise; it only logs
                    log.debug("%s: link watcher", self._label, exc_info=True)

    def _check_link(self, conn: _Peer) -> None:
        info = conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_BYTES)
        if len(info) < _TCPI_LAST_ACK_RECV + 4:
            return
        unacked = struct.unpack_from("I", info, _TCPI_UNACKED)[0]
        since_ack = struct.unpack_from("I", info, _TCPI_LAST_ACK_RECV)[0] / 1000.0
        since_data = struct.unpack_from("I", info, _TCPI_LAST_DATA_RECV)[0] / 1000.0
        window = (
            struct.unpack_from("I", info, _TCPI_SND_WND)[0]
            if len(info) >= _TCPI_SND_WND + 4
            else None
        )
        now = time.monotonic()
        kind, quiet = "", 0.0
        if unacked and since_ack >= STALL_AFTER:
            kind, quiet = "ack", since_ack  # sent, never acknowledged: retransmitting
        elif info[_TCPI_PROBES] and not unacked and window != 0:
            # keep-alive probes unanswered: they started `idle` seconds after the last data
            kind, quiet = "probe", max(0.0, since_data - conn.idle)
        elif window == 0:
            kind = "window"  # the peer's receive buffer is full: it does not read
        stall = conn.stall
        if not kind:
            if stall is not None and stall.logged:
                log.warning(
                    "%s: the link to rank %d (%s) recovered after a stall of %.1f s",
                    self._label,
                    conn.rank,
                    conn.address,
                    now - stall.since,
                )
            conn.stall = None
            return
        if stall is None or stall.kind != kind:
            stall = conn.stall = _Stall(kind, now - quiet)
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
                f"its receive window has been closed for {now - stall.since:.1f} s: rank "
                f"{conn.rank} does not read (stopped or hung?)"
            )
        log.warning(
            "%s: the link to rank %d (%s) has stalled: %s; it is dropped and the group "
            "aborted if this lasts %.0f s",
            self._label,
            conn.rank,
            conn.address,
            what,
            self._link_timeout,
        )

    def probe(self, timeout: float) -> dict[int, tuple[int, int] | None]:
        peers = [c.rank for c in self._peers.values() if not c.gone and not c.dirty]
        self.mailbox.clear_statuses()
        for rank in peers:
            self._send_control(self._peers[rank], QUERY)
        answers = self.mailbox.wait_statuses(peers, timeout)
        return {rank: answers.get(rank) for rank in peers}

    # -- failure and shutdown --------------------------------------------------------------

    def abort(self, failure: Failure, tell: int | None = None) -> None:
        if not self.mailbox.fail(failure):
            return
        log.warning("%s: group aborted: %s", self._label, failure.message)
        code = _FAILURE_KINDS.index(failure.kind) if failure.kind in _FAILURE_KINDS else 1
        for conn in self._peers.values():
            if conn.rank != tell and not conn.gone:
                self._send_control(conn, ABORT, failure.message.encode(), code)

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._stop_watch.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(5.0)
        told = [conn for conn in self._peers.values() if self._send_control(conn, BYE)]
        self._await_answers(told)
        for conn in self._peers.values():
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for conn in self._peers.values():
            if conn.thread is not None and conn.thread is not threading.current_thread():
                conn.thread.join(5.0)
            conn.sock.close()
        self.mailbox.fail(Failure(GroupDestroyedError, "the process group was destroyed"))

    def _await_answers(self, told: list[_Peer]) -> None:
        """Wait (at most `_GOODBYE_WAIT` s) until each peer told BYE has answered it.

        A peer answers once its reader reached the BYE, so everything sent to it before
        has been read. Closing earlier would lose some of that: a socket closed with
        unread bytes, or one that receives more after it closed (a peer's next
        signature), resets the connection, and the reset discards what the peer had not
        read yet, such as this rank's last broadcast.
        """
        deadline = time.monotonic() + _GOODBYE_WAIT
        logged = False
        for conn in told:
            thread = conn.thread
            if thread is None or thread is threading.current_thread():
                continue
            thread.join(max(0.0, min(deadline, time.monotonic() + 1.0) - time.monotonic()))
            if thread.is_alive() and not logged:
                logged = True
                late = [c.rank for c in told if c.thread is not None and c.thread.is_alive()]
                log.info(
                    "%s: leaving the group: waiting up to %.0f s for rank(s) %s to read what "
                    "was sent to them",
                    self._label,
                    max(0.0, deadline - time.monotonic()),
                    late,
                )
            thread.join(max(0.0, deadline - time.monotonic()))
        late = [c.rank for c in told if c.thread is not None and c.thread.is_alive()]
        if late:
            log.warning(
                "%s: rank(s) %s did not answer this rank's goodbye within %.0f s (busy, "
                "stopped or hung?); closing anyway: what they had not read yet may be lost",
                self._label,
                late,
                _GOODBYE_WAIT,
            )


def _skip(sock: socket.socket, nbytes: int) -> None:
    """Read and drop `nbytes` bytes."""
    scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
    while nbytes:
        received = sock.recv_into(scratch[: min(nbytes, len(scratch))])
        if not received:
            raise EOFError
        nbytes -= received


def _read_into(sock: socket.socket, view: memoryview) -> None:
    while view:
        received = sock.recv_into(view)
        if not received:
            raise EOFError
        view = view[received:]


def _read_bytes(sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray(nbytes)
    _read_into(sock, memoryview(data))
    return bytes(data)


def _drain(sock: socket.socket) -> None:
    """Read until the peer closes, so closing here never resets the peer's unread data."""
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass
