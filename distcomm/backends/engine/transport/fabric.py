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
their other peers), and a group made after the break dials the peer at once (a dead one
fails it then, a live one takes the dial); a process that leaves says goodbye on every
connection and waits for the answers, so nothing sent before is lost to a reset. The
links are watched as `links.py` describes.

This module holds the fabric itself: the `Channel` contract a group implements, the
registry (`attach`), the I/O thread's loop and chores, lost connections and ended
processes, and closing. Its parts are mixins in modules of their own: `dial.Dialling`
(set-up: dialling, accepting, the handshake), `conn.Sending` (the frame format, the
per-peer `Conn`, writing frames) and `reader.Reading` (parsing frames, landing payloads,
delivering them to channels).
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import socket
import threading
import time
from collections import deque
from typing import Any, Protocol

from .... import net
from ....config import load as load_config
from ....store.base import Store
from ....store.prefix import PrefixStore
from ..protocol import BYE, Header
from . import links
from .conn import _IN, _OUT, Conn, Sending, _close_if_free
from .dial import Dialling, _Handshake
from .reader import _STAGING, Reading

__all__ = [
    "Channel",
    "Fabric",
    "attach",
    "channel_id",
    "local_address",
]

log = logging.getLogger(links.LOGGER_NAME)

_MAX_EVENTS = 256
#: how long closing the fabric waits for the peers to answer its goodbye
_GOODBYE_WAIT = 5.0
#: how often the engine retries a small message for a connection a sender holds
_FLUSH_RETRY = 0.002


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

    def check_peers(self, ranks: list[int]) -> None:
        """The processes of `ranks` lost their connection to this one before the channel
        opened (they ended, or a link failed): find out whether they are still there."""

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


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


_registry: dict[tuple[int, int], Fabric] = {}
_registry_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child has none of its parent's I/O threads: it opens fabrics of its own."""
    global _registry_lock
    _registry.clear()
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def attach(store: Store, prank: int, link_timeout: float, generation: int | None = None) -> Fabric:
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


def generation_of(store: Store, prank: int) -> int | None:
    """The generation of this process's open fabric for process rank `prank` on `store`,
    or None where none is open (a process that joined a job and has no group yet)."""
    fabric = _registry.get((id(store), prank))
    return None if fabric is None or fabric.closing else fabric.generation


class Fabric(Dialling, Sending, Reading):
    """A process's connections to the processes of its job, and the I/O thread serving them.

    Use `attach` (one fabric per job store and process); see the module doc.
    """

    def __init__(
        self, store: Store, prank: int, link_timeout: float, generation: int | None = None
    ) -> None:
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
        #: the process ranks whose last connection failed without a goodbye (exit, crash,
        #: a dead link): a channel opened later asks whether they are still there
        self._broken: set[int] = set()
        self._staging = memoryview(bytearray(_STAGING))  # every read's first landing
        self._stop = False
        self._listener_paused_until = 0.0
        self._next_watch = time.monotonic() + links.WATCH_EVERY
        #: the number of the set-up that opened it: its first group's, the same in every
        #: process of the job (else counted per process rank on `store`)
        self.generation = (
            generation if generation is not None else store.add(f"distcomm/fabric/{prank}/n", 1)
        )
        host = local_address(store)
        self._listener = net.listen(
            host, 0, backlog=4096, authenticated=self._key is not None, what="the tcp transport"
        )
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
        self._thread = threading.Thread(target=self._run, name=f"distcomm-io-{prank}", daemon=True)
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

    def shared(self) -> bool:
        """Whether another `attach` holds the fabric: it stays open when the caller's
        `release` comes (another group of the process, the one replacing the caller's)."""
        with _registry_lock:
            return self.refs > 1

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
                if (
                    self._todo
                    or self._to_flush
                    or self._paused
                    or self._handshakes
                    or self._listener_paused_until
                    or time.monotonic() >= self._next_watch
                ):
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
                self._lost(
                    item,
                    OSError("a message to it was cut off half-way (a send timed out or failed)"),
                )
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

    # -- failures -------------------------------------------------------------------------

    def _lost(self, conn: Conn, exc: BaseException) -> None:
        """A connection ended: fail the groups that have the peer, unless it said goodbye."""
        expected = conn.gone or self.closing
        conn.error = exc
        self._drop(conn)
        if expected:
            self._broken.discard(conn.prank)
            conn.answered.set()
            return
        self._broken.add(conn.prank)
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
                log.info(
                    "%s: leaving: waiting up to %.0f s for rank(s) %s to read what was "
                    "sent to them",
                    self.label,
                    max(0.0, end - time.monotonic()),
                    late,
                )
            conn.answered.wait(max(0.0, end - time.monotonic()))
        late = [c.prank for c in told if not c.answered.is_set()]
        if late:
            log.warning(
                "%s: rank(s) %s did not answer this rank's goodbye within %.0f s (busy, "
                "stopped or hung?); closing anyway: what they had not read yet may be lost",
                self.label,
                late,
                _GOODBYE_WAIT,
            )
