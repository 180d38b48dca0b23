"""Receive matching: posted receives, messages that arrived first, and collective checks."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable

from ....arrays import dtype_from_code
from ....errors import DistBackendError, DistError
from ..protocol import COLL, P2P, PROGRESS, Failure, Header, Signature, mismatch_message

__all__ = ["P2P_STREAM", "Mailbox", "Recv"]

#: seconds after taking a point-to-point message from a peer during which that peer's
#: next large one waits briefly for its receive (`Mailbox.claim`)
P2P_STREAM = 0.05


#: makes a receive's completion happen once, whichever threads complete it
_FINISHING = threading.Lock()


class Recv:
    """A posted receive: where the payload goes and what the sender must match.

    Once complete it holds neither its buffer nor its callback: the caller may close or
    resize the memory it received into (an mmap, a bytearray) as soon as it is told, and
    a receive kept (in a Work's timeout handler, in the I/O thread's variables) must not
    keep an export of it.
    """

    __slots__ = (
        "_done",
        "_latch",
        "buffer",
        "callback",
        "dtype",
        "error",
        "key",
        "order",
        "peer",
        "signature",
        "source",
        "tag",
    )

    def __init__(
        self,
        peer: int | None,
        key: tuple,
        buffer: memoryview,
        dtype: int,
        signature: Signature | None,
        order: int,
        callback: Callable[[Recv], None] | None = None,
    ) -> None:
        self.peer = peer  # None: any source (point-to-point only)
        self.key = key
        self.buffer: memoryview | None = buffer  # None once complete
        self.dtype = dtype
        self.signature = signature
        self.order = order
        # completion: a lock held until then (releasing one is a single call, where an
        # Event's set takes a condition, its lock and a notify; on every small message)
        self._latch = threading.Lock()
        self._latch.acquire()
        self._done = False
        self.error: DistError | None = None
        self.source = -1
        self.callback = callback  # None once complete

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None) -> bool:
        """Wait up to `timeout` seconds (None: no limit) for the receive to complete;
        returns whether it did."""
        if self._done:
            return True
        latch = self._latch
        if latch.acquire(True, -1 if timeout is None else max(0.0, timeout)):
            latch.release()  # for any other waiter
            return True
        return self._done

    def _finish(self, source: int, error: DistError | None) -> None:
        """Complete the receive (the first outcome counts: a payload that lands as the
        group fails, say), having let go of its buffer and callback (see the class)."""
        with _FINISHING:
            if self._done:
                return
            self.source, self.error = source, error
            self._done = True
            callback, self.callback, self.buffer = self.callback, None, None
        self._latch.release()
        if callback is not None:
            callback(self)


class Mailbox:
    """Matches incoming messages to posted receives; holds unexpected ones until posted.

    The transport's I/O thread calls `claim` (a posted receive for this header, if any)
    and `stash` (keep a message nobody posted for yet). Collectives and receives call
    `post`. One lock guards it all.
    """

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.lock = threading.Lock()
        self._posted_cond = threading.Condition(self.lock)
        self._waiting_readers = 0
        self._posted: dict[tuple, deque[Recv]] = {}
        self._any: dict[int, deque[Recv]] = {}  # tag -> any-source receives
        self._unexpected: dict[tuple, deque[tuple[int, tuple, bytearray]]] = {}
        self._arrivals = itertools.count()
        self._orders = itertools.count()
        self._done_seq = -1
        self._current: tuple[int, Signature] | None = None
        self._early_sigs: dict[int, tuple[int, Signature]] = {}
        self._history: dict[int, Signature] = {}
        self.failure: Failure | None = None
        self._gone: dict[int, Failure] = {}
        self._listeners: list[Callable[[], None]] = []
        self._statuses: dict[int, tuple[int, int]] = {}
        #: the late ranks the last diagnosis of a late collective named: (seq, ranks)
        self._late: tuple[int, tuple[int, ...]] | None = None
        #: peer -> when this rank last took a point-to-point message from it (`claim`)
        self.p2p_taken: dict[int, float] = {}
        #: called after every posted receive (the transport's reader may wait for one)
        self.on_post: Callable[[], None] | None = None

    # -- keys ------------------------------------------------------------------------------

    @staticmethod
    def coll_key(peer: int, seq: int, step: int) -> tuple:
        return (COLL, peer, seq, step)

    @staticmethod
    def p2p_key(peer: int | None, tag: int) -> tuple:
        return (P2P, peer, tag)

    @staticmethod
    def key_of(peer: int, header: Header) -> tuple:
        if header.kind == COLL:
            return (COLL, peer, header.seq, header.step)
        return (P2P, peer, header.seq)

    # -- posting ---------------------------------------------------------------------------

    def post(
        self,
        peer: int | None,
        key: tuple,
        buffer: memoryview,
        dtype: int,
        signature: Signature | None,
        callback: Callable[[Recv], None] | None = None,
    ) -> Recv:
        """Post a receive; it completes at once if a matching message already arrived.

        `callback(recv)` runs (in whichever thread completes it) once it completes.
        """
        found = failure = None
        with self.lock:
            recv = Recv(peer, key, buffer, dtype, signature, next(self._orders), callback)
            failure = self.failure
            if failure is None:
                found = self._take_unexpected(recv)
                if found is None:
                    failure = self._gone.get(peer) if peer is not None else None
                    if failure is None:
                        if peer is None:
                            self._any.setdefault(key[2], deque()).append(recv)
                        else:
                            self._posted.setdefault(key, deque()).append(recv)
                        if self._waiting_readers:
                            self._posted_cond.notify_all()
                        if self.on_post is not None:
                            self.on_post()
                        return recv
        if found is not None:
            if key[0] == P2P:
                self.p2p_taken[found[0]] = time.monotonic()
            self.deliver(recv, *found)
        else:
            recv._finish(-1, failure.error())
        return recv

    def _take_unexpected(self, recv: Recv) -> tuple[int, Header, bytearray] | None:
        if recv.peer is not None:
            queue = self._unexpected.get(recv.key)
            if not queue:
                return None
            _arrival, header, payload = queue.popleft()
            if not queue:
                del self._unexpected[recv.key]
            return recv.peer, header, payload
        tag = recv.key[2]
        best = None
        for key, queue in self._unexpected.items():
            if key[0] == P2P and key[2] == tag and (best is None or queue[0][0] < best[1][0][0]):
                best = (key, queue)
        if best is None:
            return None
        key, queue = best
        _arrival, header, payload = queue.popleft()
        if not queue:
            del self._unexpected[key]
        return key[1], header, payload

    def cancel(self, recv: Recv) -> bool:
        """Withdraw a receive nobody has matched yet; False if it is already matched."""
        with self.lock:
            queues = (
                [self._any.get(recv.key[2])] if recv.peer is None else [self._posted.get(recv.key)]
            )
            for queue in queues:
                if queue and recv in queue:
                    queue.remove(recv)
                    return True
            return False

    # -- delivery (the I/O thread) ---------------------------------------------------------

    def claim(self, peer: int, header: Header) -> Recv | None:
        """The posted receive an incoming message from `peer` goes to, removed from the
        queue; None if none is posted yet (see `worth_waiting`).

        Raises:
            DistBackendError: a collective message that cannot belong to what this rank
                is doing (`_check_collective`).
        """
        key = self.key_of(peer, header)
        with self.lock:
            self._check_collective(peer, header)
            return self._pop_posted(key)

    def worth_waiting(self, peer: int, header: Header, most: float) -> float:
        """How long (at most `most` seconds, 0: not at all) a reader that found no receive
        for this message may hold it back for one to be posted, so that a large payload
        lands in place instead of being buffered and copied: a message of the collective
        this rank is running (or will run next), or a point-to-point message from a peer
        whose last one this rank took less than `P2P_STREAM` seconds ago (it is receiving
        a stream; the wait ends with that window). The bounds keep a message that is not
        needed soon from holding up the connection behind it."""
        with self.lock:
            if self.failure is not None:
                return 0.0
            if header.kind == COLL:
                return most if self._expected_soon(header) else 0.0
            left = self.p2p_taken.get(peer, -P2P_STREAM) + P2P_STREAM - time.monotonic()
            return min(most, left) if left > 0 else 0.0

    def has_left(self, peer: int) -> bool:
        """Whether `peer` left the group cleanly (no lock: a send's quick check)."""
        return peer in self._gone

    def _expected_soon(self, header: Header) -> bool:
        # the next collective too while this one still runs: a peer's reader is usually
        # done with this rank's message before this rank has closed the collective, and
        # everything the peer sent for this one came before on the connection
        current = self._current[0] if self._current is not None else -1
        return current <= header.seq <= current + 1

    def _pop_posted(self, key: tuple) -> Recv | None:
        queue = self._posted.get(key)
        specific = queue[0] if queue else None
        anyq = self._any.get(key[2]) if key[0] == P2P else None
        other = anyq[0] if anyq else None
        if specific is None and other is None:
            return None
        if other is None or (specific is not None and specific.order < other.order):
            queue.popleft()
            if not queue:
                del self._posted[key]
            return specific
        anyq.popleft()
        if not anyq:
            del self._any[key[2]]
        return other

    def stash(self, peer: int, header: Header, payload: bytearray) -> None:
        """Keep a message nobody had posted for; deliver it if a receive was posted meanwhile."""
        key = self.key_of(peer, header)
        with self.lock:
            recv = self._pop_posted(key)
            if recv is None:
                self._unexpected.setdefault(key, deque()).append(
                    (next(self._arrivals), header, payload)
                )
                return
        self.deliver(recv, peer, header, payload)

    def deliver(self, recv: Recv, peer: int, header: Header, payload: bytes | bytearray) -> None:
        """Complete `recv` with an already-read payload."""
        error = self.check(recv, peer, header)
        if error is None:
            recv.buffer[:] = payload
        recv._finish(peer, error)

    def check(self, recv: Recv, peer: int, header: Header) -> DistError | None:
        """The error a message from `peer` with `header` means for `recv`, if any."""
        kind, dtype, seq, nbytes = header.kind, header.dtype, header.seq, header.nbytes
        if kind == COLL:
            theirs = header.signature()
            mine = recv.signature
            if mine is not None and theirs != mine:
                return DistBackendError(
                    mismatch_message(self.rank, self.size, seq, mine, peer, theirs)
                )
        if nbytes != len(recv.buffer) or dtype != recv.dtype:
            mine_n = len(recv.buffer) // max(1, dtype_from_code(recv.dtype).itemsize)
            theirs_n = nbytes // max(1, dtype_from_code(dtype).itemsize)
            what = "message" if kind == COLL else f"recv (tag {seq})"
            return DistBackendError(
                f"[rank {self.rank}/{self.size}] {what}: this rank expects "
                f"{mine_n} {dtype_from_code(recv.dtype)} ({len(recv.buffer)} bytes) from rank "
                f"{peer}, which sent {theirs_n} {dtype_from_code(dtype)} ({nbytes} bytes); "
                "sender and receiver must use arrays of the same size and dtype"
            )
        return None

    def _check_collective(self, peer: int, header: Header) -> None:
        """Raise if a collective message cannot belong to what this rank is doing."""
        if header.kind != COLL:
            return
        seq, theirs = header.seq, header.signature()
        if seq <= self._done_seq:
            raise DistBackendError(self._late_message(peer, seq, theirs))
        current = self._current
        if current is not None and current[0] == seq and current[1] != theirs:
            raise DistBackendError(
                mismatch_message(self.rank, self.size, seq, current[1], peer, theirs)
            )

    def _late_message(self, peer: int, seq: int, theirs: Signature) -> str:
        mine = self._history.get(seq)
        if mine is None:
            return (
                f"[rank {self.rank}/{self.size}] collective mismatch: rank {peer} sent "
                f"data for collective #{seq} ({theirs.describe()}) after this rank had "
                "finished it; every rank of a group must issue the same collectives in "
                "the same order"
            )
        return mismatch_message(self.rank, self.size, seq, mine, peer, theirs)

    # -- collective bookkeeping -----------------------------------------------------------

    def check_signature(self, peer: int, header: Header) -> None:
        """Check a neighbour's SIG message now, or when this rank reaches its collective.

        Raises:
            DistBackendError: the neighbour's collective differs from this rank's.
        """
        seq, theirs = header.seq, header.signature()
        with self.lock:
            current = self._current
            mine = (
                current[1]
                if current is not None and current[0] == seq
                else (self._history.get(seq))
            )
            if mine is None:
                if seq > self._done_seq:
                    self._early_sigs[seq] = (peer, theirs)
                return
        if mine != theirs:
            raise DistBackendError(mismatch_message(self.rank, self.size, seq, mine, peer, theirs))

    def begin_collective(self, seq: int, signature: Signature) -> None:
        """Record that this rank starts collective `seq`; early messages for it must match.

        Raises:
            DistBackendError: a peer already sent data for `seq` as a different collective.
        """
        with self.lock:
            self._current = (seq, signature)
            early = self._early_sigs.pop(seq, None)
            if early is not None and early[1] != signature:
                raise DistBackendError(
                    mismatch_message(self.rank, self.size, seq, signature, early[0], early[1])
                )
            for (kind, peer, msg_seq, *_), queue in self._unexpected.items():
                if kind == COLL and msg_seq == seq:
                    self._check_collective(peer, queue[0][1])

    def finish_collective(self, seq: int, signature: Signature) -> None:
        """Record that this rank finished collective `seq`; leftovers for it are a mismatch.

        Raises:
            DistBackendError: a peer sent this rank a message the collective did not use.
        """
        with self.lock:
            self._done_seq = seq
            self._history[seq] = signature
            self._history.pop(seq - 64, None)
            for (kind, peer, msg_seq, *_), queue in self._unexpected.items():
                if kind == COLL and msg_seq <= seq:
                    theirs = queue[0][1].signature()
                    raise DistBackendError(self._late_message(peer, msg_seq, theirs))

    # -- progress (timeout diagnosis) -----------------------------------------------------

    def progress(self) -> tuple[int, int]:
        """(the collective this rank last began, the last one it finished); -1 for none."""
        with self.lock:
            return (self._current[0] if self._current is not None else -1), self._done_seq

    def note_late(self, seq: int, ranks: tuple[int, ...]) -> None:
        """Record the ranks a diagnosis of collective `seq` found late (behind it or
        silent): the TCP diagnosis does, and a path that diagnoses its own way should, so
        that a timeout of `seq` names them (`late`)."""
        self._late = (seq, tuple(ranks))

    def late(self, seq: int) -> tuple[int, ...] | None:
        """The ranks the last diagnosis of collective `seq` found late, or None when it
        named none or `seq` was not diagnosed: how the runner names them for a
        `Work.wait` timeout, and for a timeout its path explained in words only (the
        shared-memory engine's `Call.explain`)."""
        late = self._late
        if late is None or late[0] != seq or not late[1]:
            return None
        return late[1]

    def clear_statuses(self) -> None:
        with self.lock:
            self._statuses.clear()

    def record_status(self, peer: int, payload: bytes) -> None:
        """A peer's answer to a progress query."""
        with self.lock:
            self._statuses[peer] = PROGRESS.unpack(payload)
            self._posted_cond.notify_all()

    def wait_statuses(self, peers: list[int], timeout: float) -> dict[int, tuple[int, int]]:
        """The answers of `peers` that arrive within `timeout` seconds."""
        end = time.monotonic() + timeout
        with self.lock:
            self._waiting_readers += 1
            try:
                while not all(p in self._statuses for p in peers):
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._posted_cond.wait(left)
            finally:
                self._waiting_readers -= 1
            return {p: self._statuses[p] for p in peers if p in self._statuses}

    # -- failure ---------------------------------------------------------------------------

    def add_listener(self, fn: Callable[[], None]) -> None:
        """Call `fn()` (from any thread) whenever the group fails or a peer leaves."""
        self._listeners.append(fn)

    def gone(self, peer: int) -> Failure | None:
        """Why `peer` left the group, or None while it is still there."""
        with self.lock:
            return self._gone.get(peer)

    def failed(self, peer: int) -> Failure | None:
        """Why the group failed, or why `peer` left it; None while both are well (the
        shared-memory engine's `FailureWatch`)."""
        return self.failure or self.gone(peer)

    def blame(self, error: DistError) -> None:
        """Mark `error`, raised with the message of a failure recorded here (the group's,
        or a departed peer's), with that failure's peers (see `errors.caused_by_peers`)."""
        if error.peer_ranks is not None:
            return
        with self.lock:
            failures = [self.failure, *self._gone.values()]
        text = str(error)
        for failure in failures:
            if failure is not None and failure.peers is not None and failure.message in text:
                error.peer_ranks = failure.peers
                return

    def _notify(self) -> None:
        for fn in list(self._listeners):
            fn()

    def fail(self, failure: Failure) -> bool:
        """Fail every posted and future receive; False if the mailbox had already failed."""
        with self.lock:
            if self.failure is not None:
                return False
            self.failure = failure
            self._posted_cond.notify_all()
            pending = [r for q in self._posted.values() for r in q]
            pending += [r for q in self._any.values() for r in q]
            self._posted.clear()
            self._any.clear()
        for recv in pending:
            recv._finish(-1, failure.error())
        self._notify()
        return True

    def peer_gone(self, peer: int, failure: Failure) -> None:
        """`peer` left the group cleanly: fail receives that wait for it, now and later."""
        with self.lock:
            self._gone[peer] = failure
            pending = []
            for key in [k for k in self._posted if k[1] == peer]:
                pending += self._posted.pop(key)
        for recv in pending:
            recv._finish(-1, failure.error())
        self._notify()

    def pending_peers(self) -> list[int]:
        """The peers some posted receive is still waiting for."""
        with self.lock:
            peers = {key[1] for key, queue in self._posted.items() if queue}
            if any(self._any.values()):
                peers.add(-1)
        return sorted(peers)
