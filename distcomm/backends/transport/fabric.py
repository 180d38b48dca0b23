"""One TCP endpoint per process, shared by every tcp and gloo group of a job: the fabric.

The first tcp or gloo group a process makes opens its fabric: one listening socket, whose
address is published once in the job's store, and one I/O thread (the engine) that serves
every connection of every group. Connections are made on first use: the first time a
group sends to a rank in a process this one has no connection to, the sending thread
dials it; a process already connected, by any group, is reached over that connection. A
rank therefore holds sockets only to the processes it talks to (a tree's or a ring's
neighbours, everyone only after an all-to-all), a new group of connected ranks opens no
socket, and a process's threads stay the same however many ranks and groups there are.

Every message starts with its group's channel id, then its `Header`. The engine reads
frames as bytes arrive (non-blocking reads, no thread per peer), asks the group's channel
(`tcp.TcpTransport.incoming`) where the payload goes and receives it straight into that
buffer: a posted receive, a buffer kept for a message nobody has asked for yet, or
nowhere (dropped). Messages for a group this process has not made yet are kept until it
does; messages for a group it has destroyed are dropped. Senders write from their own
thread (`sendmsg` of channel id, header and payload: no copy), one message at a time per
connection; the engine's own small messages (answers, aborts passed on) wait for the
connection to be free and never block the engine.

Set-up. A process's address is published under `distcomm/fabric/<rank>/<n>`, where `rank`
is its rank at the job's start and `n` the number of the set-up of the group that opened
the fabric, the same in every process (the roll call's; a job re-initialised on the same
store gets the next one, so an address from an earlier set-up is never used). A dial is
authenticated (`distcomm.auth`), then says who dials, which set-up it belongs to and whom
it wants; the acceptor answers with a verdict byte. Two processes that dial each other at
once end with one connection: the dial of the lower rank wins, the other is told so and
uses the winner's.

A connection that breaks aborts every group that has the peer in it (the groups tell
their other peers); a process that leaves says goodbye on every connection and waits for
the answers, so nothing sent before is lost to a reset. The links are watched as
`links.py` describes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ... import auth, net
from ...config import load as load_config
from ...deadline import Deadline, StallClock
from ...errors import DistError, DistNetworkError, DistTimeoutError
from ...store.base import Store
from ...store.prefix import PrefixStore
from ...store.ranks import log_missing, wait_for_ranks
from ..protocol import BYE, Header
from . import links

__all__ = [
    "DISCARD",
    "FRAME_SIZE",
    "Channel",
    "Conn",
    "Fabric",
    "attach",
    "channel_id",
    "local_address",
]

log = logging.getLogger("distcomm.backends.transport.tcp")

#: a frame starts with the channel id of its group (0: the fabric's own messages)
_CID = struct.Struct("<Q")
FRAME_SIZE = _CID.size + Header.SIZE
#: a dial's greeting after the handshake: magic, dialer's rank, set-up number, wanted rank
_HELLO = struct.Struct("<4sqqq")
_HELLO_MAGIC = b"DCF1"
#: the acceptor's verdict: refused (another set-up or process), accepted, or "my dial wins"
_REFUSED, _ACCEPTED, _OTHER_WINS = 0, 1, 2
#: what `Channel.incoming` returns for a payload to read and drop
DISCARD = object()
#: reads the engine makes from one connection before it serves the others
_READS_PER_TURN = 16
#: the engine reads into one buffer of this size (a frame's header and small payloads in
#: one system call) and parses it at once; a payload with more than this left lands in
#: place
_STAGING = 64 * 1024
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
_MAX_EVENTS = 256
#: a frame's start, parsed at once: the channel id, then a `Header`'s fields
_FRAME = struct.Struct("<Q" + Header.FORMAT[1:])
_new_header = tuple.__new__
#: how long an accepted connection may take to finish its handshake
_HANDSHAKE_S = 10.0
#: how long closing the fabric waits for the peers to answer its goodbye
_GOODBYE_WAIT = 5.0
#: how often the engine retries a small message for a connection a sender holds
_FLUSH_RETRY = 0.002
_SEND_SLICE = 0.5
_JOIN_SLICE = 3600.0
_HINT = ("did every rank of the group call init_process_group (or new_group) with this "
         "backend? Look at the missing ranks' output for an error")


class Channel(Protocol):
    """A group's side of the fabric (`tcp.TcpTransport`)."""

    cid: int

    def rank_of(self, prank: int) -> int | None:
        """The group rank of the process whose rank at the job's start is `prank`."""

    def incoming(self, rank: int, header: Header, patient: bool) -> Any:
        """Where the payload of a message from `rank` goes: None (no payload, handled),
        DISCARD, (view, done) to read it into `view` and then call `done()`, or, when
        `patient`, seconds to wait for a receive to be posted before asking again."""

    def peer_left(self, rank: int) -> None:
        """`rank`'s process said goodbye: everything it sent has been read."""

    def peer_lost(self, rank: int, conn: Conn, exc: BaseException) -> None:
        """The connection `conn` to `rank`'s process failed with `exc`."""

    def peer_ended(self, rank: int) -> None:
        """`rank`'s process (on this host, watched by `Fabric.watch_process`) ended."""

    def fail(self, reason: str) -> None:
        """Abort the group: the fabric cannot serve it any more."""


def channel_id(store: Store, generation: int) -> int:
    """A group's channel id: from its store's prefixes and its set-up number, so that every
    member computes the same one and two groups (or two set-ups of one) never share it."""
    parts = []
    inner: Any = store
    while isinstance(inner, PrefixStore):
        parts.append(inner.prefix)
        inner = inner.underlying_store
    text = "/".join(reversed(parts)) + f"#{generation}"
    cid = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return cid or 1


def local_address(store: Store) -> str:
    """The local address peers can reach: DISTCOMM_SOCKET_IFNAME's (or GLOO_SOCKET_IFNAME's),
    else the store route's.

    Falls back to this host name's address, then 127.0.0.1, for stores without a socket.
    """
    ifname = load_config().socket_ifname
    if ifname:
        return net.interface_address(ifname)
    inner: Any = store
    while inner is not None:
        address = getattr(inner, "local_address", None)
        if address:
            return address
        inner = getattr(inner, "underlying_store", None)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class _Sink:
    """Where the engine puts a frame's payload: `view` (then `done()`), or nowhere."""

    __slots__ = ("done", "got", "skip", "view")

    def __init__(self, view: memoryview | None, done: Callable[[], None] | None,
                 skip: int = 0) -> None:
        self.view, self.done, self.got, self.skip = view, done, 0, skip


class Conn:
    """One connection to a peer process, shared by every group that talks to it."""

    __slots__ = (
        "address",
        "answered",
        "closed",
        "dirty",
        "error",
        "events",
        "fd",
        "gone",
        "got",
        "head",
        "head_view",
        "idle",
        "leftover",
        "lock",
        "outbox",
        "partial",
        "paused",
        "prank",
        "sink",
        "sock",
        "stall",
    )

    def __init__(self, prank: int, sock: socket.socket, link_timeout: float) -> None:
        self.prank = prank
        self.sock = sock
        try:
            host, port = sock.getpeername()[:2]
            self.address = net.format_address(host, port)
        except OSError:
            self.address = "?"
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.idle = max(1, int(link_timeout / 3))  # seconds before keep-alive probes
        net.set_keepalive(sock, idle=self.idle, interval=max(1, int(link_timeout / 6)),
                          user_timeout=link_timeout)
        # sends block in the kernel (faster than polling from Python), but never for
        # longer than this at a time, so the sender notices deadlines and aborts
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", 0, int(_SEND_SLICE * 1e6)))
        self.stall: links.Stall | None = None
        self.lock = threading.Lock()  # one message at a time: frames never interleave
        self.dirty = False  # a send stopped half-way: the stream can carry nothing more
        self.gone = False  # the peer said goodbye (or this process did, and it answered)
        self.closed = False  # the I/O thread dropped the connection (see Fabric._drop)
        self.error: BaseException | None = None  # why, when it was lost
        self.answered = threading.Event()  # the peer answered this process's goodbye
        # the engine's side
        self.head = bytearray(FRAME_SIZE)
        self.head_view = memoryview(self.head)
        self.got = 0
        self.sink: _Sink | None = None
        self.paused: tuple[Any, int, Header, float] | None = None
        self.outbox: deque[bytes] = deque()  # the engine's frames, waiting for the lock
        self.partial: memoryview | None = None  # the rest of one the engine is writing
        self.events = 0
        self.fd = sock.fileno()
        self.leftover = b""  # staged bytes after the header of a paused frame

    def name(self) -> str:
        return f"rank {self.prank}"


def _unlock(conn: Conn) -> None:
    """Let go of `conn`'s write lock; close its socket if the I/O thread dropped the
    connection while the lock was held (it closes it itself only when the lock is free,
    so that a descriptor in use by a writer is never closed and reused under it).

    Released first, then checked: the I/O thread marks the connection closed before it
    tries the lock, so one of the two always sees the other and closes the socket."""
    conn.lock.release()
    if conn.closed:
        _close_if_free(conn)


def _close_if_free(conn: Conn) -> None:
    """Close `conn`'s socket if no sender holds the connection (else that one will)."""
    if conn.lock.acquire(blocking=False):
        conn.sock.close()
        conn.lock.release()


def _queued(conn: Conn) -> list[bytes | memoryview]:
    """Take the frames the I/O thread queued on `conn` (its lock is held): they go first."""
    frames: list[bytes | memoryview] = []
    while conn.outbox:
        frames.append(conn.outbox.popleft())
    return frames


def _check_progress(deadline: Deadline, failed: Callable[[], DistError | None],
                    who: str) -> None:
    """A send that waits: raise the group's failure, or a timeout once `deadline` passed."""
    error = failed()
    if error is not None:
        raise error
    if deadline.expired():
        raise DistTimeoutError(f"sending to {who} made no progress for "
                               f"{deadline.seconds:.1f} s (is it alive and reading?)")


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


class _Handshake:
    """An accepted connection until its dial is verified (the engine's state machine)."""

    __slots__ = ("buf", "deadline", "need", "nonce", "sock", "stage")

    def __init__(self, sock: socket.socket, nonce: bytes, keyed: bool) -> None:
        self.sock, self.nonce = sock, nonce
        self.stage = "proof" if keyed else "hello"
        self.need = auth.PROOF_SIZE if keyed else _HELLO.size
        self.buf = bytearray()
        self.deadline = time.monotonic() + _HANDSHAKE_S


_registry: dict[tuple[int, int], Fabric] = {}
_registry_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child has none of its parent's I/O threads: it opens fabrics of its own."""
    global _registry_lock
    _registry.clear()
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def attach(store: Store, prank: int, link_timeout: float,
           generation: int | None = None) -> Fabric:
    """The fabric of process rank `prank` on `store` (the job's store), opened if needed;
    every `attach` is matched by one `Fabric.release`.

    Raises:
        DistNetworkError: the listening socket cannot be made.
    """
    with _registry_lock:
        fabric = _registry.get((id(store), prank))
        if fabric is None or fabric.closing:
            fabric = Fabric(store, prank, link_timeout, generation)
            _registry[(id(store), prank)] = fabric
        fabric.refs += 1
        return fabric


class Fabric:
    """A process's connections to the processes of its job, and the I/O thread serving them.

    Use `attach` (one fabric per job store and process); see the module doc.
    """

    def __init__(self, store: Store, prank: int, link_timeout: float,
                 generation: int | None = None) -> None:
        self.store, self.prank, self.link_timeout = store, prank, link_timeout
        self.refs = 0
        self.closing = False
        self._key = load_config().auth_key
        self.label = f"[rank {prank}] tcp transport"
        self._lock = threading.Condition()
        self._conns: dict[int, Conn] = {}
        self._dialing: set[int] = set()
        self._addresses: dict[int, tuple[str, str]] = {}
        # owned by the engine thread
        self._channels: dict[int, Channel] = {}
        self._early: dict[int, list[tuple[int, Header, bytearray]]] = {}
        self._closed_channels: set[int] = set()
        self._handshakes: set[_Handshake] = set()
        self._paused: set[Conn] = set()
        self._to_flush: set[Conn] = set()
        self._todo: deque[tuple[str, Any]] = deque()
        #: receives whose payload has landed, completed just before the engine blocks
        self._landed: list[tuple[Any, int]] = []
        self._watched: dict[int, tuple[int, int | None]] = {}  # prank -> (pid, pidfd)
        self._ended: set[int] = set()
        self._staging = memoryview(bytearray(_STAGING))  # every read's first landing
        self._stop = False
        self._listener_paused_until = 0.0
        self._next_watch = time.monotonic() + links.WATCH_EVERY
        #: the number of the set-up that opened it: its first group's, the same in every
        #: process of the job (else counted per process rank on `store`)
        self.generation = generation if generation is not None else store.add(
            f"distcomm/fabric/{prank}/n", 1)
        host = local_address(store)
        self._listener = net.listen(host, 0, backlog=4096, authenticated=self._key is not None,
                                    what="the tcp transport")
        self._listener.setblocking(False)
        port = self._listener.getsockname()[1]
        self.address = net.format_address(host, port)
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poll = select.epoll()
        self._fds: dict[int, Any] = {}  # what each registered descriptor is
        self._register(self._wake_fd, _IN, "wake")
        self._register(self._listener.fileno(), _IN, "listen")
        try:
            store.set(self._address_key(prank), self.address)
        except BaseException:
            self._release_os()
            raise
        self._thread = threading.Thread(target=self._run, name=f"distcomm-io-{prank}",
                                        daemon=True)
        self._thread.start()

    def _address_key(self, prank: int) -> str:
        return f"distcomm/fabric/{prank}/{self.generation}"

    # -- groups ---------------------------------------------------------------------------

    def add_channel(self, channel: Channel) -> None:
        """Start delivering `channel`'s messages (those that came early first)."""
        self._post("add", channel)

    def remove_channel(self, cid: int) -> None:
        """Stop delivering the channel's messages: later ones are dropped."""
        self._post("remove", cid)

    def learn_addresses(self, addresses: dict[int, str]) -> None:
        """Addresses of processes (by process rank) learnt elsewhere than the store."""
        with self._lock:
            for prank, address in addresses.items():
                self._addresses.setdefault(prank, net.split_address(address))

    def watch_process(self, prank: int, pid: int) -> None:
        """Tell the groups with `prank` when its process, `pid` on this host, ends, whether
        or not a connection to it exists (a group that talks through shared memory has
        none): their waits for it fail at once (`Channel.peer_ended`)."""
        self._post("pid", (prank, pid))

    def release(self) -> None:
        """Drop one `attach`; the last closes the fabric (goodbyes, then the sockets)."""
        with _registry_lock:
            self.refs -= 1
            if self.refs > 0:
                return
            self.closing = True
            if _registry.get((id(self.store), self.prank)) is self:
                del _registry[(id(self.store), self.prank)]
        self._close()

    def existing(self, prank: int) -> Conn | None:
        """The connection to process rank `prank`, if one is made (no lock: one read)."""
        return self._conns.get(prank)

    def connections(self) -> dict[int, Conn]:
        """The open connections, by the peer's process rank."""
        with self._lock:
            return {p: c for p, c in self._conns.items() if not c.closed}

    # -- sending --------------------------------------------------------------------------

    def connection(self, prank: int, deadline: Deadline, who: str, label: str,
                   members: Sequence[int]) -> Conn:
        """The connection to process `prank`, dialled now if there is none.

        `who` names the peer in messages ("rank 3"), `label` is the group's message prefix
        and `members` gives each group rank's process rank: the first dial of a group
        fetches the addresses of all its members not known yet, in one request.

        Raises:
            DistTimeoutError: the peer did not publish its address or answer in time.
            DistNetworkError: the connection could not be made.
        """
        conn = self._conns.get(prank)
        if conn is not None and not conn.closed:
            return conn
        with self._lock:
            while True:
                conn = self._conns.get(prank)
                if conn is not None and not conn.closed:
                    return conn
                if self.closing:
                    raise DistNetworkError(f"{label}: the transport is closed")
                if prank not in self._dialing:
                    self._dialing.add(prank)
                    break
                if deadline.expired():
                    raise DistTimeoutError(
                        f"{label}: connecting to {who} took longer than "
                        f"{deadline.seconds:.1f} s")
                self._lock.wait(deadline.slice(_SEND_SLICE))
        try:
            return self._dial(prank, deadline, who, label, members)
        finally:
            with self._lock:
                self._dialing.discard(prank)
                self._lock.notify_all()

    def _dial(self, prank: int, deadline: Deadline, who: str, label: str,
              members: Sequence[int]) -> Conn:
        if prank not in self._addresses:
            self._look_up(members, deadline, label)
        host, port = self._addresses[prank]
        where = f"{who} at {net.format_address(host, int(port))}"
        try:
            sock = net.connect(host, int(port), deadline, what=where, retry_refused=False)
        except DistNetworkError as exc:
            if isinstance(exc.__cause__, ConnectionRefusedError):
                raise DistNetworkError(
                    f"{who} is gone: nothing listens at its address "
                    f"{net.format_address(host, int(port))} any more (its process ended, or "
                    "it destroyed its process group: exit or crash?)") from exc
            raise
        try:
            auth.client_handshake(sock, self._key, deadline, where)
            sock.sendall(_HELLO.pack(_HELLO_MAGIC, self.prank, self.generation, prank))
            verdict = net.recv_exact(sock, 1, deadline, where)
        except (OSError, DistError) as exc:
            sock.close()
            cause = exc if isinstance(exc, OSError) else exc.__cause__
            if isinstance(cause, (ConnectionResetError, BrokenPipeError)):
                # it accepted, then its process ended (the kernel still took the dial)
                raise DistNetworkError(self._closed_in_handshake(label, who, where)) from exc
            raise DistNetworkError(f"{label}: connecting to {who}: {exc}") from exc
        if verdict == bytes([_ACCEPTED]):
            sock.settimeout(None)  # the handshake's read timeout must not outlive it
            return self._adopt(prank, sock)
        sock.close()
        if verdict == bytes([_OTHER_WINS]):  # it dialled this process at the same time
            return self._await_conn(prank, deadline, who, label)
        raise DistNetworkError(
            f"{label}: {where} refused the connection: it belongs to another set-up of "
            "the job (was the job re-initialised on the same store a different number of "
            "times by different ranks?)" if verdict else
            self._closed_in_handshake(label, who, where))

    @staticmethod
    def _closed_in_handshake(label: str, who: str, where: str) -> str:
        return (f"{label}: connecting to {who}: {who} closed the connection (exit or "
                f"crash?) during the handshake ({where})")

    def _look_up(self, members: Sequence[int], deadline: Deadline, label: str) -> None:
        """Learn the addresses of the group's members not known yet: one wait (naming the
        ranks that have not published theirs) and one `multi_get`, however many."""
        keys = {rank: self._address_key(p) for rank, p in enumerate(members)
                if p != self.prank and p not in self._addresses}
        if not keys:
            return
        wait_for_ranks(self.store, keys, deadline, label, hint=_HINT,
                       arrived="published their address")
        values = self.store.multi_get(list(keys.values()))
        with self._lock:
            for rank, value in zip(keys, values, strict=True):
                self._addresses[members[rank]] = net.split_address(value.decode())

    def _await_conn(self, prank: int, deadline: Deadline, who: str, label: str) -> Conn:
        stall = StallClock(load_config().stall_warn_s)
        with self._lock:
            while True:
                conn = self._conns.get(prank)
                if conn is not None and not conn.closed:
                    return conn
                if deadline.expired():
                    raise DistTimeoutError(
                        f"{label}: {who} dialled this rank but did not finish connecting "
                        f"within {deadline.seconds:.1f} s")
                self._lock.wait(deadline.slice(min(stall.until_next(), _JOIN_SLICE)))
                waited = stall.due()
                if waited is not None:
                    log_missing(label, waited, [prank], 1, "connected to this rank", _HINT,
                                deadline, stall.next)

    def _adopt(self, prank: int, sock: socket.socket) -> Conn:
        conn = Conn(prank, sock, self.link_timeout)
        with self._lock:
            if self.closing:  # a dial that finished while the fabric closed
                sock.close()
                raise DistNetworkError(f"{self.label}: the transport is closed")
            self._conns[prank] = conn
            self._lock.notify_all()
        if threading.current_thread() is self._thread:
            self._interest(conn)
        else:
            self._post("conn", conn)
        return conn

    def send(self, conn: Conn, views: list[bytes | memoryview], deadline: Deadline,
             failed: Callable[[], DistError | None], who: str) -> None:
        """Write one frame (`views`: channel id, header, payload) on `conn`, blocking until
        written; `failed()` says when the group failed meanwhile (the send stops), `who`
        names the peer in messages.

        A send that stops half-way leaves the stream unusable: the connection is then cut,
        and every group using it fails.

        Raises:
            DistNetworkError: the connection failed, or was cut before.
            DistTimeoutError: the deadline passed.
        """
        self._acquire(conn, deadline, failed, who)
        try:
            if conn.dirty:
                raise DistNetworkError(
                    f"the connection to {who} was cut: a message to it stopped half-way")
            self._write(conn, _queued(conn) + views, deadline, failed, who)
        except DistError:
            self._spoil(conn)
            raise
        finally:
            _unlock(conn)

    def _spoil(self, conn: Conn) -> None:
        """A write stopped half-way: nothing more can go on `conn`; the I/O thread cuts
        it, so that every group using it (here and at the peer) fails rather than waits."""
        if not conn.dirty:
            conn.dirty = True
            self._post("cut", conn)

    def _acquire(self, conn: Conn, deadline: Deadline,
                 failed: Callable[[], DistError | None], who: str) -> None:
        if conn.lock.acquire(False):
            return
        while not conn.lock.acquire(timeout=deadline.slice(_SEND_SLICE)):
            _check_progress(deadline, failed, who)

    def _write(self, conn: Conn, views: list[bytes | memoryview], deadline: Deadline,
               failed: Callable[[], DistError | None], who: str) -> None:
        total = sum(map(len, views))
        while total:
            try:
                sent = conn.sock.sendmsg(views, [], socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):  # SO_SNDTIMEO passed: check, retry
                sent = 0
            except OSError as exc:
                # a connection the I/O thread dropped fails for the reason it found
                reason = links.failure_reason(conn, conn.error or exc, who, self.link_timeout)
                raise DistNetworkError(reason) from None
            if sent == total:
                return
            total -= sent
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views.pop(0))
                else:
                    views[0] = views[0][sent:]
                    sent = 0
            _check_progress(deadline, failed, who)

    def control(self, conn: Conn, cid: int, header: Header, payload: bytes = b"") -> bool:
        """Send a small message (an answer, an abort, a goodbye) without blocking long and
        without interleaving another message; from the engine it is queued if the
        connection is busy. Returns whether it was sent or queued."""
        if conn.closed or conn.dirty:
            return False
        frame = _CID.pack(cid) + header.pack() + payload
        if threading.current_thread() is self._thread:
            conn.outbox.append(frame)
            self._flush(conn)
            return True
        if not conn.lock.acquire(timeout=1.0):
            return False
        try:
            if conn.dirty:
                return False
            self._write(conn, [*_queued(conn), frame], Deadline(1.0), lambda: None,
                        conn.name())
            return True
        except DistTimeoutError:  # stopped half-way: the peer does not read
            self._spoil(conn)
            return False
        except DistError:  # the connection failed: its reader says why
            conn.dirty = True
            return False
        finally:
            _unlock(conn)

    def _flush(self, conn: Conn) -> None:
        """(engine) Write queued frames if no sender holds the connection; never block."""
        if conn.partial is None:
            if not conn.outbox or conn.closed:
                self._to_flush.discard(conn)
                return
            if not conn.lock.acquire(blocking=False):
                self._to_flush.add(conn)
                return
            if conn.dirty:
                conn.outbox.clear()
                conn.lock.release()
                self._to_flush.discard(conn)
                return
            conn.partial = memoryview(b"".join(conn.outbox))
            conn.outbox.clear()
        self._to_flush.discard(conn)
        try:
            while conn.partial:
                sent = conn.sock.send(conn.partial, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                conn.partial = conn.partial[sent:]
        except BlockingIOError:
            self._interest(conn)  # the lock stays with the engine until it is written
            return
        except OSError:
            conn.dirty = True  # the reader finds out why
        conn.partial = None
        conn.lock.release()
        self._interest(conn)

    # -- the engine ----------------------------------------------------------------------

    def _post(self, what: str, item: Any) -> None:
        self._todo.append((what, item))
        self.wake()

    def wake(self) -> None:
        """Make the engine look at its queue and its paused connections now."""
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:
            pass  # closed: the engine has stopped

    def landed(self, recv: Any, rank: int) -> None:
        """(engine) `recv`'s payload from `rank` is in place: complete it (wake its waiter)
        once this turn's reading is done, right before the engine blocks again, so that
        the woken thread does not wait for the engine to let go of the interpreter."""
        self._landed.append((recv, rank))

    def wake_if_paused(self) -> None:
        """A receive was posted: a paused connection may now land its payload in place."""
        if self._paused:
            self.wake()

    def _register(self, fd: int, events: int, what: Any) -> None:
        self._poll.register(fd, events)
        self._fds[fd] = what

    def _unregister(self, fd: int) -> None:
        self._fds.pop(fd, None)
        try:
            self._poll.unregister(fd)
        except (OSError, ValueError):
            pass

    def _interest(self, conn: Conn) -> None:
        events = 0
        if not conn.closed:
            if conn.paused is None:
                events |= _IN
            if conn.partial is not None:
                events |= _OUT
        if events == conn.events:
            return
        if conn.events == 0:
            self._register(conn.fd, events, conn)
        elif events == 0:
            self._unregister(conn.fd)
        else:
            self._poll.modify(conn.fd, events)
        conn.events = events

    def _run(self) -> None:
        fds, poll = self._fds, self._poll.poll
        try:
            while not self._stop:
                timeout = self._timeout()
                if self._landed:  # last before blocking: the woken waiter finds the GIL free
                    landed, self._landed = self._landed, []
                    for recv, rank in landed:
                        recv._finish(rank, None)
                for fd, mask in poll(timeout, _MAX_EVENTS):
                    what = fds.get(fd)
                    if what.__class__ is Conn:
                        if mask & _OUT:
                            self._flush(what)
                        if mask & ~_OUT and what.events & _IN:
                            self._read(what)
                    elif what == "wake":
                        try:
                            os.eventfd_read(self._wake_fd)
                        except OSError:
                            pass
                    elif what == "listen":
                        self._accept()
                    elif what.__class__ is int:  # a watched process's pidfd
                        self._process_ended(what)
                    elif what is not None:
                        self._handshake_step(what)
                if (self._todo or self._to_flush or self._paused or self._handshakes
                        or self._listener_paused_until
                        or time.monotonic() >= self._next_watch):
                    self._chores()
        except Exception:  # the engine must not die silently: every group would hang
            log.exception("%s: the I/O thread failed", self.label)
            self._fail_all("the transport's I/O thread failed (see the log above)")
        finally:
            for recv, rank in self._landed:
                recv._finish(rank, None)
            self._landed = []

    def _timeout(self) -> float:
        if self._todo:
            return 0.0
        now = time.monotonic()
        timeout = self._next_watch - now
        if self._to_flush:
            timeout = min(timeout, _FLUSH_RETRY)
        for conn in self._paused:
            timeout = min(timeout, conn.paused[3] - now)
        if self._handshakes:
            timeout = min(timeout, 1.0)
        if self._listener_paused_until:
            timeout = min(timeout, self._listener_paused_until - now)
        return max(0.0, timeout)

    def _chores(self) -> None:
        while self._todo:
            what, item = self._todo.popleft()
            if what == "conn":
                self._interest(item)
            elif what == "add":
                self._open_channel(item)
            elif what == "remove":
                self._close_channel(item)
            elif what == "pid":
                self._watch_pid(*item)
            elif what == "cut" and not item.closed:
                self._lost(item, OSError("a message to it was cut off half-way (a send "
                                         "timed out or failed)"))
        for conn in list(self._to_flush):
            self._flush(conn)
        for conn in list(self._paused):
            self._retry(conn)
        now = time.monotonic()
        if self._handshakes:
            for hs in [h for h in self._handshakes if h.deadline <= now]:
                self._drop_handshake(hs)
        if self._listener_paused_until and now >= self._listener_paused_until:
            self._listener_paused_until = 0.0
            self._register(self._listener.fileno(), _IN, "listen")
        if now >= self._next_watch:
            self._next_watch = now + links.WATCH_EVERY
            for prank, (pid, fd) in list(self._watched.items()):
                if fd is None and not _alive(pid):
                    self._process_ended(prank)
            for conn in list(self._conns.values()):
                if conn.closed or conn.gone:
                    continue
                try:
                    links.check_link(conn, self.label, conn.name(), self.link_timeout)
                except OSError:
                    continue  # closed meanwhile: the reader reports it
                except Exception:  # the watcher only logs; it must not stop the engine
                    log.debug("%s: link watcher", self.label, exc_info=True)

    # -- reading --------------------------------------------------------------------------

    def _read(self, conn: Conn) -> None:
        """Read what `conn` has: into its staging buffer, parsed frame by frame, or, for
        the rest of a large payload, straight into the payload's buffer."""
        sock = conn.sock
        try:
            for _ in range(_READS_PER_TURN):
                if conn.paused is not None or conn.closed:
                    return
                sink = conn.sink
                if sink is not None and sink.view is not None \
                        and len(sink.view) - sink.got >= _STAGING:
                    got = sock.recv_into(sink.view[sink.got:], 0, socket.MSG_DONTWAIT)
                    if not got:
                        raise EOFError
                    sink.got += got
                    if sink.got == len(sink.view):
                        conn.sink = None
                        if sink.done is not None:
                            sink.done()
                    continue
                got = sock.recv_into(self._staging, 0, socket.MSG_DONTWAIT)
                if not got:
                    raise EOFError
                self._consume(conn, self._staging, got)
                if got < _STAGING:
                    return  # drained: the next bytes come with the next event
        except BlockingIOError:
            return
        except (OSError, EOFError) as exc:
            self._lost(conn, exc)

    def _consume(self, conn: Conn, data: memoryview, end: int, pos: int = 0) -> None:
        """Parse `data[pos:end]`: frame headers, and payload bytes for their sinks."""
        while pos < end:
            sink = conn.sink
            if sink is None:
                if conn.got == 0 and end - pos >= FRAME_SIZE:
                    head = data[pos:pos + FRAME_SIZE]
                    pos += FRAME_SIZE
                else:
                    take = min(FRAME_SIZE - conn.got, end - pos)
                    conn.head[conn.got:conn.got + take] = data[pos:pos + take]
                    conn.got += take
                    pos += take
                    if conn.got < FRAME_SIZE:
                        return
                    conn.got = 0
                    head = conn.head_view
                where, nbytes = self._frame(conn, head)
                if conn.paused is not None:  # keep the rest for when it resumes
                    conn.leftover = bytes(data[pos:end])
                    return
                if where is None:
                    continue
                if where is DISCARD:
                    take = min(nbytes, end - pos)
                    pos += take
                    if take < nbytes:
                        conn.sink = _Sink(None, None, nbytes - take)
                    continue
                view, done = where
                if nbytes <= end - pos:  # all of it is here: it lands now
                    if nbytes:
                        view[:] = data[pos:pos + nbytes]
                        pos += nbytes
                    done()
                    continue
                conn.sink = sink = _Sink(view, done)
            take = min(end - pos, (sink.skip if sink.view is None else len(sink.view) - sink.got))
            if sink.view is None:
                sink.skip -= take
                done_now = not sink.skip
            else:
                sink.view[sink.got:sink.got + take] = data[pos:pos + take]
                sink.got += take
                done_now = sink.got == len(sink.view)
            pos += take
            if done_now:
                conn.sink = None
                if sink.done is not None:
                    sink.done()

    def _frame(self, conn: Conn, head: memoryview) -> tuple[Any, int]:
        """A frame's header has arrived on `conn`: where its payload goes (see
        `Channel.incoming`; a paused connection keeps it for later) and its length."""
        fields = _FRAME.unpack(head)
        cid = fields[0]
        header = _new_header(Header, fields[1:])
        nbytes = header.nbytes
        if cid == 0:
            return self._fabric_message(conn, header), nbytes
        channel = self._channels.get(cid)
        if channel is None:
            if cid in self._closed_channels or self.closing:
                return DISCARD, nbytes
            return self._keep_early(conn, cid, header), nbytes
        rank = channel.rank_of(conn.prank)
        if rank is None:
            return DISCARD, nbytes
        where = channel.incoming(rank, header, True)
        if where.__class__ is float:
            conn.paused = (channel, rank, header, time.monotonic() + where)
            self._paused.add(conn)
            self._interest(conn)
            return None, 0
        return where, nbytes

    def _expect(self, conn: Conn, where: Any, nbytes: int) -> None:
        if where is None or (not nbytes and where is DISCARD):
            return
        if where is DISCARD:
            conn.sink = _Sink(None, None, nbytes)
            return
        view, done = where
        if len(view):
            conn.sink = _Sink(view, done)
        else:
            done()

    def _retry(self, conn: Conn) -> None:
        """Ask again where a paused connection's payload goes (a receive was posted, or
        the wait is over)."""
        if conn.paused is None:
            self._paused.discard(conn)
            return
        channel, rank, header, until = conn.paused
        patient = time.monotonic() < until and channel.cid in self._channels
        where = channel.incoming(rank, header, patient) if channel.cid in self._channels \
            else DISCARD
        if isinstance(where, float):
            return
        conn.paused = None
        self._paused.discard(conn)
        self._expect(conn, where, header.nbytes)
        leftover, conn.leftover = conn.leftover, b""
        if leftover:
            self._consume(conn, memoryview(leftover), len(leftover))
        self._interest(conn)

    def _keep_early(self, conn: Conn, cid: int, header: Header) -> Any:
        """Keep a message for a group this process has not made yet (it is on its way)."""
        payload = bytearray(header.nbytes)
        early = self._early.setdefault(cid, [])

        def done() -> None:
            channel = self._channels.get(cid)
            if channel is None:
                if cid not in self._closed_channels:
                    early.append((conn.prank, header, payload))
            else:  # it was made while the payload arrived: the earlier ones are delivered
                self._replay(channel, conn.prank, header, payload)

        return memoryview(payload), done

    def _replay(self, channel: Channel, prank: int, header: Header, payload: bytearray) -> None:
        rank = channel.rank_of(prank)
        if rank is None:
            return
        where = channel.incoming(rank, header, False)
        if where is None or where is DISCARD:
            return
        view, done = where
        view[:] = payload
        done()

    def _open_channel(self, channel: Channel) -> None:
        self._channels[channel.cid] = channel
        for prank, header, payload in self._early.pop(channel.cid, []):
            self._replay(channel, prank, header, payload)
        for prank in self._ended:
            rank = channel.rank_of(prank)
            if rank is not None:
                channel.peer_ended(rank)

    def _close_channel(self, cid: int) -> None:
        self._channels.pop(cid, None)
        self._early.pop(cid, None)
        self._closed_channels.add(cid)
        for conn in [c for c in self._paused if c.paused and c.paused[0].cid == cid]:
            self._retry(conn)

    def _channels_with(self, prank: int) -> list[tuple[Channel, int]]:
        found = []
        for channel in list(self._channels.values()):
            rank = channel.rank_of(prank)
            if rank is not None:
                found.append((channel, rank))
        return found

    def _fabric_message(self, conn: Conn, header: Header) -> Any:
        if header.kind != BYE:
            return DISCARD
        if self.closing or conn.gone:
            conn.answered.set()  # the answer to this process's goodbye (or theirs, crossed)
            conn.gone = True
            return None
        # the peer process is leaving: everything it sent is read; it waits for this answer
        conn.gone = True
        for channel, rank in self._channels_with(conn.prank):
            channel.peer_left(rank)
        self.control(conn, 0, Header(BYE))
        return None

    def _lost(self, conn: Conn, exc: BaseException) -> None:
        """A connection ended: fail the groups that have the peer, unless it said goodbye."""
        expected = conn.gone or self.closing
        conn.error = exc
        self._drop(conn)
        if expected:
            conn.answered.set()
            return
        for channel, rank in self._channels_with(conn.prank):
            channel.peer_lost(rank, conn, exc)

    def _drop(self, conn: Conn) -> None:
        conn.paused = None
        self._paused.discard(conn)
        self._to_flush.discard(conn)
        conn.closed = True
        self._interest(conn)
        with self._lock:
            if self._conns.get(conn.prank) is conn:
                del self._conns[conn.prank]
            self._lock.notify_all()
        try:  # a sender blocked on it wakes, and a later one fails at once
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if conn.partial is not None:  # the engine held the lock for its own write
            conn.partial = None
            conn.lock.release()
        _close_if_free(conn)  # else the sender holding it does, as it lets go (_unlock)

    def _watch_pid(self, prank: int, pid: int) -> None:
        if prank in self._watched or prank == self.prank:
            return
        try:
            fd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfd (Linux < 5.3): polled once a second
            fd = None
            if not _alive(pid):
                self._watched[prank] = (pid, None)
                self._process_ended(prank)
                return
        self._watched[prank] = (pid, fd)
        if fd is not None:
            self._register(fd, _IN, prank)

    def _process_ended(self, prank: int) -> None:
        _pid, fd = self._watched.pop(prank, (0, None))
        if fd is not None:
            self._unregister(fd)
            os.close(fd)
        conn = self._conns.get(prank)
        if conn is not None and not conn.closed and conn.events & _IN:
            self._read(conn)  # what it sent before it ended (an abort's reason) comes first
        self._ended.add(prank)
        for channel, rank in self._channels_with(prank):
            channel.peer_ended(rank)

    # -- accepting ------------------------------------------------------------------------

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        except OSError as exc:
            short = net.descriptor_shortage(exc, "accept a connection from a peer")
            if short is not None:
                log.error("%s: %s", self.label, short)
                self._unregister(self._listener.fileno())  # try again in a second
                self._listener_paused_until = time.monotonic() + 1.0
            return
        sock.setblocking(True)
        greeting, nonce = auth.hello_message(self._key)
        hs = _Handshake(sock, nonce, self._key is not None)
        try:
            if sock.send(greeting, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL) != len(greeting):
                raise OSError("short write")
        except OSError:
            sock.close()
            return
        self._handshakes.add(hs)
        self._register(sock.fileno(), _IN, hs)

    def _drop_handshake(self, hs: _Handshake, keep: bool = False) -> None:
        self._handshakes.discard(hs)
        self._unregister(hs.sock.fileno())
        if not keep:
            hs.sock.close()

    def _handshake_step(self, hs: _Handshake) -> None:
        try:
            data = hs.sock.recv(hs.need - len(hs.buf), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            self._drop_handshake(hs)
            return
        if not data:
            self._drop_handshake(hs)
            return
        hs.buf += data
        if len(hs.buf) < hs.need:
            return
        if hs.stage == "proof":
            accept = auth.verify_proof(self._key, hs.nonce, bytes(hs.buf))
            if accept is None or not self._send_small(hs.sock, accept):
                self._drop_handshake(hs)
                return
            hs.stage, hs.need, hs.buf = "hello", _HELLO.size, bytearray()
            return
        magic, dialer, generation, wanted = _HELLO.unpack(bytes(hs.buf))
        if magic != _HELLO_MAGIC or wanted != self.prank or generation != self.generation:
            self._send_small(hs.sock, bytes([_REFUSED]))
            self._drop_handshake(hs)
            return
        with self._lock:
            existing = self._conns.get(dialer)
            other_wins = (existing is not None and not existing.closed) or (
                dialer in self._dialing and self.prank < dialer)
        if other_wins:
            self._send_small(hs.sock, bytes([_OTHER_WINS]))
            self._drop_handshake(hs)
            return
        self._drop_handshake(hs, keep=True)
        if not self._send_small(hs.sock, bytes([_ACCEPTED])):
            hs.sock.close()
            return
        self._adopt(dialer, hs.sock)

    @staticmethod
    def _send_small(sock: socket.socket, data: bytes) -> bool:
        try:
            return sock.send(data, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL) == len(data)
        except OSError:
            return False

    # -- closing --------------------------------------------------------------------------

    def _fail_all(self, reason: str) -> None:
        for channel in list(self._channels.values()):
            channel.fail(f"{self.label}: {reason}")

    def _close(self) -> None:
        """Say goodbye on every connection, wait for the answers, then close everything."""
        with self._lock:  # dials under way finish (or fail) first
            end = time.monotonic() + _GOODBYE_WAIT
            while self._dialing and time.monotonic() < end:
                self._lock.wait(0.1)
        conns = [c for c in self.connections().values() if not c.gone]
        told = [c for c in conns if self.control(c, 0, Header(BYE))]
        self._await_answers(told)
        self._stop = True
        self.wake()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
        for conn in list(self._conns.values()):
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.closed = True
            conn.sock.close()
        with self._lock:
            self._conns.clear()
            self._lock.notify_all()
        for hs in list(self._handshakes):
            hs.sock.close()
        self._handshakes.clear()
        self._release_os()
        # the address key stays: a peer that dials later is refused there and says this
        # rank is gone, where a missing key would leave it waiting

    def _release_os(self) -> None:
        for _pid, fd in self._watched.values():
            if fd is not None:
                os.close(fd)
        self._watched.clear()
        self._listener.close()
        self._poll.close()
        try:
            os.close(self._wake_fd)
        except OSError:
            pass

    def _await_answers(self, told: list[Conn]) -> None:
        """Wait (at most `_GOODBYE_WAIT` s) until each peer told goodbye has answered.

        A peer answers once it has read up to the goodbye, so everything sent to it before
        has been read. Closing earlier could lose some of it: a socket closed with unread
        bytes, or one that receives more after it closed, resets the connection, and the
        reset discards what the peer had not read yet, such as this rank's last broadcast.
        """
        end = time.monotonic() + _GOODBYE_WAIT
        logged = False
        for conn in told:
            conn.answered.wait(max(0.0, min(end, time.monotonic() + 1.0) - time.monotonic()))
            if not conn.answered.is_set() and not logged:
                logged = True
                late = [c.prank for c in told if not c.answered.is_set()]
                log.info("%s: leaving: waiting up to %.0f s for rank(s) %s to read what was "
                         "sent to them", self.label, max(0.0, end - time.monotonic()), late)
            conn.answered.wait(max(0.0, end - time.monotonic()))
        late = [c.prank for c in told if not c.answered.is_set()]
        if late:
            log.warning(
                "%s: rank(s) %s did not answer this rank's goodbye within %.0f s (busy, "
                "stopped or hung?); closing anyway: what they had not read yet may be lost",
                self.label, late, _GOODBYE_WAIT)
