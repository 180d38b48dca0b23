"""The TCP transport of one group: its channel on the process's fabric (`fabric.py`).

A group's transport opens no socket and no thread of its own, and waits for no peer: it
joins the process's fabric as a channel (an id every member computes from the group's
store and set-up number: one store request) and then sends each message over the
fabric's connection to the peer's process, which is made the first time any group sends
there. (The group's set-up checks that every member came: `check_same_backends`.) The
fabric's I/O thread hands every message of the channel to `incoming`, which
matches it in the group's `Mailbox` and says where its payload goes: straight into a
posted receive (`recv_into` on its memoryview), into a buffer kept until the receive is
posted, or, for a large one that is needed soon, nowhere yet (the connection pauses
briefly so the payload can land in place).

A connection that breaks aborts the group: every pending and later operation raises
`DistNetworkError` naming the peer, and the group's other connected peers are told why
(ABORT), and tell theirs, so every rank fails within moments instead of waiting out its
timeout. The news names the ranks the failure blames (a timeout's late ranks, a lost
peer), and every rank that hears it raises with them in `peer_ranks`; a rank blamed itself
raises with none (it is the cause). Leaving the group says goodbye (BYE) to the members
this rank talked to: their receives from it fail at once, naming it.

News of an abort for a member this rank has no connection to (ranks of one host talk
through shared memory) is passed on by a short-lived thread that dials it (a teller).
Closing the group waits a little for its tellers only when the process's fabric closes
with it: a group replaced (a re-forming, a shrink) or destroyed beside others leaves them
running on the fabric the other groups keep open, so evicting a stopped rank never waits
on a dial that rank cannot answer; at exit they get `_TELL_DIAL_S` in all.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .... import net
from ....deadline import Deadline
from ....errors import (
    DistBackendError,
    DistError,
    DistNetworkError,
    DistTimeoutError,
    GroupDestroyedError,
    caused_by_peers,
)
from ....store.base import Store
from ..protocol import (
    ABORT,
    BYE,
    COLL,
    P2P,
    PROGRESS,
    QUERY,
    SIG,
    STATUS,
    AbortNotice,
    Failure,
    Header,
    blamed_message,
)
from .base import Transport
from .conn import _CID, DISCARD, Conn
from .fabric import Fabric, attach, channel_id
from .links import (
    LINK_TIMEOUT_MAX,
    LINK_TIMEOUT_MIN,
    LOGGER_NAME,
    STALL_AFTER,
    failure_reason,
    link_timeout,
)
from .mailbox import Mailbox

__all__ = [
    "LINK_TIMEOUT_MAX",
    "LINK_TIMEOUT_MIN",
    "STALL_AFTER",
    "TcpTransport",
    "link_timeout",
]

log = logging.getLogger(LOGGER_NAME)

_FAILURE_KINDS: tuple[type[DistError], ...] = (DistNetworkError, DistBackendError, DistTimeoutError)
#: payloads at least this large wait briefly for their receive, so they land in place
_WAIT_FOR_POST_MIN = 64 * 1024
_WAIT_FOR_POST = 0.25
#: a late collective's diagnosis asks every member of a group up to this size (dialling
#: the ones not connected yet); a larger group asks only the members it talks to
PROBE_ALL = 64
#: the most distinct aborts (by origin) a rank passes on; more at once is a mass failure
#: that every rank finds out about by itself
_ORIGINS = 4
#: how long passing on an abort may take to dial a member not connected yet
_TELL_DIAL_S = 5.0


class TcpTransport(Transport):
    """One group's messages over the process's fabric: connections made on first use,
    shared with the process's other groups.

    Args:
        store: the group's private store (its set-up round is counted there).
        rank, size: this rank and the group size.
        deadline: how long the set-up may take.
        label: prefix of messages, e.g. "[rank 1/4] tcp backend (group 'default')".
        link_timeout: seconds a connection may acknowledge nothing before it is dropped
            and the groups using it aborted (see `links.link_timeout()`); the first group
            of a process sets it for the process's connections.
        global_ranks: each group rank's process rank at the job's start (default: the
            group ranks); connections are per process, so groups share them.
        process_store: the job's store, where every process publishes its address once
            (default: `store`, when the group is made outside a job's world).
        generation: the number of this set-up of the group on `store`, the same on every
            rank (the roll call's, `BackendOptions.setup_round`); None: counted here, with
            one store request.
    """

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        deadline: Deadline,
        label: str,
        link_timeout: float = LINK_TIMEOUT_MAX,
        global_ranks: Sequence[int] | None = None,
        process_store: Store | None = None,
        generation: int | None = None,
    ) -> None:
        super().__init__(rank, size)
        self.mailbox = Mailbox(rank, size)
        self._label = label
        self._closing = False
        self._pranks = list(global_ranks) if global_ranks else list(range(size))
        if len(self._pranks) != size:
            raise ValueError(f"{label}: {len(self._pranks)} global ranks for {size} ranks")
        self._rank_of = {p: r for r, p in enumerate(self._pranks)}
        self._names = [f"rank {r}" for r in range(size)]
        self._conns: list[Conn | None] = [None] * size
        self._relayed: set[int] = set()  # the origins of aborts this rank passed on
        #: the reason of the first news of an abort this rank heard
        self._news: str | None = None
        self.fabric: Fabric | None = None
        self.cid = 0
        #: the number of this set-up of the group on its store (0 for one rank)
        self.generation = 0
        if size == 1:
            return
        net.reserve_descriptors(size, label)  # a socket per peer at most, and a listener
        if generation is None:
            generation = (store.add("tcp/joined", 1) - 1) // size
        self.generation = generation
        self.cid = channel_id(store, generation)
        self._cid_bytes = memoryview(_CID.pack(self.cid))
        self.fabric = attach(
            process_store if process_store is not None else store,
            self._pranks[rank],
            link_timeout,
            generation,
        )
        self.mailbox.on_post = self.fabric.wake_if_paused
        self.fabric.add_channel(self)

    # -- the fabric's side ----------------------------------------------------------------

    def rank_of(self, prank: int) -> int | None:
        return self._rank_of.get(prank)

    def incoming(self, rank: int, header: Header, patient: bool) -> Any:
        """Where the payload of a message from `rank` goes (see `fabric.Channel`)."""
        kind, nbytes = header.kind, header.nbytes
        mailbox, fabric = self.mailbox, self.fabric
        if self._closing:
            return DISCARD
        if kind in (COLL, P2P):
            try:
                recv = mailbox.claim(rank, header)
            except DistError as exc:  # a message for a collective this rank finished
                self.abort(Failure(type(exc), str(exc)))
                return DISCARD
            if recv is None:
                if patient and nbytes >= _WAIT_FOR_POST_MIN:
                    wait = mailbox.worth_waiting(rank, header, _WAIT_FOR_POST)
                    if wait > 0:
                        return wait
                payload = bytearray(nbytes)
                return memoryview(payload), lambda: mailbox.stash(rank, header, payload)
            error = mailbox.check(recv, rank, header)
            if error is not None:
                recv._finish(rank, error)
                if kind == COLL:
                    self.abort(Failure(type(error), str(error)))
                return DISCARD

            def landed() -> None:
                fabric.landed(recv, rank)
                if kind == P2P:  # the next one waits briefly for its receive
                    mailbox.p2p_taken[rank] = time.monotonic()

            return recv.buffer, landed
        if kind == SIG:
            try:
                mailbox.check_signature(rank, header)
            except DistError as exc:
                self.abort(Failure(type(exc), str(exc)))
            return DISCARD
        if kind == QUERY:
            conn = self._conns[rank] or self.fabric.connections().get(self._pranks[rank])
            if conn is not None:
                self._control(conn, STATUS, PROGRESS.pack(*mailbox.progress()))
            return DISCARD
        if kind == STATUS:
            payload = bytearray(nbytes)
            return memoryview(payload), lambda: mailbox.record_status(rank, bytes(payload))
        if kind == ABORT:
            payload = bytearray(nbytes)

            def aborted() -> None:
                notice = AbortNotice.unpack(header, payload)
                if not 0 <= notice.origin < self.size:
                    notice = notice._replace(origin=rank)
                if not 0 <= notice.code < len(_FAILURE_KINDS):
                    notice = notice._replace(code=1)
                if self._news is None:  # before the failure wakes anything (`abort`)
                    self._news = notice.reason
                self.abort(self._heard(notice), tell=rank, notice=notice)

            return memoryview(payload), aborted
        if kind == BYE:  # the peer left this group (destroy, or a shrink without it)
            self.peer_left(rank)
            return DISCARD
        return DISCARD

    def _heard(self, notice: AbortNotice) -> Failure:
        """The failure the news of another rank's abort means here: it blames the ranks
        the notice names (the origin when it names none); a rank named itself is the cause,
        and its error says so rather than blaming a peer."""
        kind, origin, blamed = _FAILURE_KINDS[notice.code], notice.origin, notice.peers
        if blamed and self.rank in blamed:
            others = tuple(r for r in blamed if r != self.rank)
            return Failure(kind, blamed_message(origin, notice.reason, others))
        return Failure(
            kind, f"rank {origin} aborted the group: {notice.reason}", blamed or (origin,)
        )

    def peer_left(self, rank: int) -> None:
        self.mailbox.peer_gone(
            rank,
            Failure(
                DistNetworkError,
                f"rank {rank} has left the group (destroy_process_group or exit)",
                (rank,),
            ),
        )

    def peer_ended(self, rank: int) -> None:
        self.mailbox.peer_gone(
            rank,
            Failure(DistNetworkError, f"rank {rank}'s process ended (exit or crash?)", (rank,)),
        )

    def check_peers(self, ranks: list[int]) -> None:
        """(engine) The processes of `ranks` lost their connection to this one before this
        group was made here: dial them aside, one after the other, in one thread (however
        many were lost) and within `_TELL_DIAL_S` in all. The first where nothing listens
        any more, or that closes the dial, fails the group as a lost connection would have,
        rather than leave a receive from it waiting for the timeout; a process still there
        (a member dropped and back) takes the dial, and those not reached in time are left
        to the group's own waits."""
        if self._closing or self.fabric is None:
            return

        def probe() -> None:
            deadline = Deadline(_TELL_DIAL_S)
            for rank in ranks:
                try:
                    self._conn(rank, deadline)
                except DistTimeoutError:
                    return  # the time is spent
                except DistError as exc:
                    fabric = self.fabric
                    if not self._closing and fabric is not None and not fabric.closing:
                        self.abort(Failure(DistNetworkError, str(exc), (rank,)))
                    return

        threading.Thread(target=probe, daemon=True, name=f"distcomm-probe-{self.rank}").start()

    def know_local_peers(self, pids: dict[int, int], addresses: dict[int, str]) -> None:
        """The members on this host (the shared-memory set-up's): waits for one fail as
        soon as its process ends (`pids`: group rank -> process id), and dialling one
        needs no store (`addresses`: group rank -> its fabric's address), so an abort
        reaches them even when the store cannot be reached."""
        if self.fabric is None:
            return
        for rank, pid in pids.items():
            if rank != self.rank:
                self.fabric.watch_process(self._pranks[rank], pid)
        self.fabric.learn_addresses(
            {self._pranks[r]: a for r, a in addresses.items() if r != self.rank and a}
        )

    def peer_lost(self, rank: int, conn: Conn, exc: BaseException) -> None:
        if self._closing or self.fabric is None:
            return
        reason = failure_reason(conn, exc, f"rank {rank}", self.fabric.link_timeout)
        self.abort(Failure(DistNetworkError, reason, (rank,)))

    def _conn(self, rank: int, deadline: Deadline) -> Conn:
        conn = self._conns[rank]
        if conn is None or conn.closed:
            if self.fabric is None:
                raise DistNetworkError(f"{self._label}: the group was destroyed")
            conn = self.fabric.connection(
                self._pranks[rank], deadline, f"rank {rank}", self._label, self._pranks
            )
            self._conns[rank] = conn
        return conn

    def _failed(self) -> DistError | None:
        failure = self.mailbox.failure
        return failure.error() if failure is not None else None

    # -- sending ---------------------------------------------------------------------------

    def send(
        self,
        peer: int,
        header: Header,
        payload: memoryview,
        deadline: Deadline,
        first: Header | None = None,
    ) -> None:
        mailbox = self.mailbox
        if mailbox.failure is not None:
            raise mailbox.failure.error()
        conn = self._conns[peer]
        try:
            if conn is None or conn.closed:
                if mailbox.has_left(peer):
                    raise self._left(peer)
                conn = self._conn(peer, deadline)
            if conn.gone or mailbox.has_left(peer):
                raise self._left(peer)
            frame = [self._cid_bytes, header.pack(), payload]
            if first is not None:
                frame[:0] = (self._cid_bytes, first.pack())
            self.fabric.send(conn, frame, deadline, self._failed, self._names[peer])
        except DistNetworkError as exc:
            if mailbox.failure is not None or exc.peer_ranks is not None:
                raise
            # the connection failed, could not be made, or is unusable after a cut send
            failure = Failure(DistNetworkError, str(exc), (peer,))
            self.abort(failure)
            raise failure.error() from None

    def connected(self, peer: int) -> bool:
        conn = self._conns[peer]
        if conn is None and self.fabric is not None:  # another group's, maybe
            conn = self.fabric.existing(self._pranks[peer])
            if conn is not None:
                self._conns[peer] = conn
        return conn is not None and not conn.closed

    @staticmethod
    def _left(peer: int) -> DistNetworkError:
        return caused_by_peers(
            DistNetworkError(f"rank {peer} has left the group; cannot send to it"), [peer]
        )

    def _members(self) -> list[tuple[int, Conn]]:
        """The members this rank holds a connection to, with it, in rank order (one look
        at the fabric; as many steps as connections, not members)."""
        if self.fabric is None:
            return []
        found = []
        for prank, conn in self.fabric.connections().items():
            rank = self._rank_of.get(prank)
            if rank is not None and rank != self.rank:
                self._conns[rank] = conn
                found.append((rank, conn))
        return sorted(found, key=lambda item: item[0])

    def _control(self, conn: Conn, kind: int, payload: bytes = b"", code: int = 0) -> bool:
        if conn.gone or self.fabric is None:
            return False
        return self.fabric.control(
            conn, self.cid, Header(kind, code, nbytes=len(payload)), payload[:4096]
        )

    def probe(self, timeout: float) -> dict[int, tuple[int, int] | None]:
        """Ask members how far they got: every member of a group of up to `PROBE_ALL`
        ranks, else those this rank is connected to and those it waits for. Members not
        connected yet are dialled (at once, each in a short-lived thread: this only runs
        when a collective is late), within the same `timeout`."""
        members = dict(self._members())
        wanted = (
            set(range(self.size))
            if self.size <= PROBE_ALL
            else {p for p in self.mailbox.pending_peers() if p >= 0}
        )
        wanted -= set(members) | {self.rank}
        if wanted:
            deadline = Deadline(timeout)

            dialers = [
                self._dial_aside(rank, deadline, members.__setitem__, "probe")
                for rank in sorted(wanted)
            ]
            for thread in dialers:
                thread.join(deadline.slice(timeout))
        peers = sorted(r for r, c in list(members.items()) if not c.gone and not c.dirty)
        peers += sorted(wanted - set(peers))  # not reached: silent
        self.mailbox.clear_statuses()
        for rank in peers:
            if rank in members:
                self._control(members[rank], QUERY)
        answers = self.mailbox.wait_statuses(peers, timeout)
        return {rank: answers.get(rank) for rank in peers}

    # -- failure and shutdown --------------------------------------------------------------

    def abort(
        self, failure: Failure, tell: int | None = None, notice: AbortNotice | None = None
    ) -> None:
        """Fail the group here and pass the news on; idempotent.

        The news of one rank's abort (`notice`: its origin, the ranks it blames and its
        reason; this rank's own abort when None) spreads over a binomial tree rooted at
        the origin, so it reaches every member in log2(size) hops however few connections
        exist (a group that talks through shared memory has none); each rank also tells
        the members it is connected to (they may be waiting for it). A rank passes on the
        news of a few distinct origins at most. `tell`: the member it came from.

        A rank whose operation failed because of news it heard spreads that news again as
        its own (over its own tree: a member late or stopped in the first one holds up
        nobody), with the reason it heard rather than its error quoting it, so that the
        late rank is told in the words of the rank that blamed it.
        """
        first = self.mailbox.fail(failure)
        if first:
            log.warning("%s: group aborted: %s", self._label, failure.message)
        if notice is None:
            reason = failure.message if self._news is None else self._news
            notice = AbortNotice(self.rank, _code(failure.kind), failure.peers, reason)
        origin = notice.origin
        if self.fabric is None or origin in self._relayed or len(self._relayed) >= _ORIGINS:
            return
        self._relayed.add(origin)
        header, text = notice.pack()
        connected = dict(self._members())
        skip = {tell, origin}  # the teller, the origin, and the ranks lost (not the late)
        if _FAILURE_KINDS[notice.code] is not DistTimeoutError:
            skip.update(notice.peers or ())
        for rank in sorted(set(connected) | set(_tree_children(self.rank, origin, self.size))):
            if rank in skip:
                continue
            conn = connected.get(rank)
            if conn is not None:
                if not conn.gone:
                    self.fabric.control(conn, self.cid, header, text)
            elif not self.mailbox.has_left(rank):
                # the last group to close on the fabric, or the process's exit, waits a
                # little for these (`close`, `_join_tellers`)
                teller = self._dial_aside(
                    rank,
                    Deadline(_TELL_DIAL_S),
                    lambda _rank, conn: self.fabric.control(conn, self.cid, header, text),
                    "abort",
                )
                _TELLERS[teller] = self.fabric

    def _dial_aside(
        self, rank: int, deadline: Deadline, then: Callable[[int, Conn], object], what: str
    ) -> threading.Thread:
        """Connect to member `rank` in a short-lived thread (dialling blocks: never in the
        caller's or the I/O thread; one per member, so an unreachable one holds up no
        other), then call `then(rank, conn)`; a member gone or unreachable is skipped (it
        learns from its own waits)."""

        def dial() -> None:
            try:
                conn = self._conn(rank, deadline)
            except DistError:
                return
            then(rank, conn)

        thread = threading.Thread(
            target=dial, daemon=True, name=f"distcomm-{what}-{self.rank}-{rank}"
        )
        thread.start()
        return thread

    def fail(self, reason: str) -> None:
        self.abort(Failure(DistNetworkError, reason))

    def close(self) -> None:
        """Leave the group: say goodbye, release the fabric; idempotent.

        Tellers still passing an abort on are waited for (up to `_TELL_DIAL_S` in all)
        only when the fabric closes with this group, since they need it. A group replaced
        (re-formed, shrunk) or destroyed while other groups keep the fabric open leaves
        them running: they end by themselves, within their dial's deadline, and a member
        they cannot reach (a stopped process) holds up nothing.
        """
        if self._closing:
            return
        self._closing = True
        fabric = self.fabric
        if fabric is not None:
            if not fabric.shared():
                _join_tellers(fabric)  # the abort's news goes out before the fabric closes
            for _rank, conn in self._members():
                self._control(conn, BYE)
            fabric.remove_channel(self.cid)
            fabric.release()
        self.mailbox.fail(Failure(GroupDestroyedError, "the process group was destroyed"))


#: the threads passing an abort on (tellers), with the fabric they dial through
_TELLERS: weakref.WeakKeyDictionary[threading.Thread, Fabric] = weakref.WeakKeyDictionary()


@atexit.register
def _join_tellers(fabric: Fabric | None = None) -> None:
    """Give the tellers still running (those dialling through `fabric`; at exit, all) up
    to `_TELL_DIAL_S` in all to finish."""
    end = time.monotonic() + _TELL_DIAL_S
    for teller, used in list(_TELLERS.items()):
        if (fabric is None or used is fabric) and teller is not threading.current_thread():
            teller.join(max(0.0, end - time.monotonic()))


def _code(kind: type[DistError]) -> int:
    """The number an ABORT message gives a failure of `kind` (its nearest known base;
    DistBackendError for any other)."""
    return next((i for i, known in enumerate(_FAILURE_KINDS) if issubclass(kind, known)), 1)


def _tree_children(rank: int, root: int, size: int) -> list[int]:
    """`rank`'s children in the binomial tree over `size` ranks rooted at `root`."""
    relative = (rank - root) % size
    step = 1
    while step <= relative:
        step <<= 1
    children = []
    while relative + step < size:
        children.append((relative + step + root) % size)
        step <<= 1
    return children
