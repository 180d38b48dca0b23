"""A collective's view of its transport (Exchange), and the diagnosis of a late collective."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ....deadline import Deadline
from ....errors import DistError, DistNetworkError, DistTimeoutError, caused_by_peers
from ..protocol import COLL, SIG, Header, Signature, as_bytes
from ..scratch import ScratchPool
from .base import Transport
from .mailbox import Mailbox, Recv

__all__ = ["Diagnosis", "Exchange", "SubExchange", "diagnose", "diagnosis"]


class Exchange:
    """One collective's view of the transport: its seq, signature, deadline and messages."""

    __slots__ = (
        "deadline",
        "describe",
        "rank",
        "scratch",
        "seq",
        "signal",
        "signature",
        "size",
        "transport",
    )

    def __init__(
        self,
        transport: Transport,
        seq: int,
        signature: Signature,
        deadline: Deadline,
        describe: str,
        scratch: ScratchPool | None = None,
    ) -> None:
        self.scratch = scratch if scratch is not None else ScratchPool()
        self.transport = transport
        self.rank, self.size = transport.rank, transport.size
        self.seq = seq
        self.signature = signature
        self.deadline = deadline
        self.describe = describe
        #: the signature message not sent yet: (transport rank, header), see `announce`
        self.signal: tuple[int, Header] | None = None

    def _global(self, peer: int) -> int:
        """The transport rank of algorithm rank `peer`."""
        return peer

    def announce(self) -> None:
        """Make this collective's signature known to the right-hand neighbour, whose rank
        compares it with its own (a mismatch is found even where ranks only wait).

        Where this rank is connected to that neighbour already it is not sent at once: it
        rides in the same write as this rank's first message to the neighbour (one write
        and one wake-up of the neighbour's I/O thread fewer, for every small collective),
        or goes alone before this rank first waits, or when the collective ends (`flush`).
        Otherwise it goes now, so that the connection is made while every rank is still in
        the collective, not at its end, when ranks that finished may have left (and the
        store with them)."""
        if self.size > 1:
            peer = self._global((self.rank + 1) % self.size)
            self.signal = (peer, Header.collective(SIG, self.signature, self.seq))
            if not self.transport.connected(peer):
                self.flush()

    def flush(self) -> None:
        """Send the signature if no message to the neighbour took it along yet."""
        signal = self.signal
        if signal is None:
            return
        self.signal = None
        peer, header = signal
        try:
            self.transport.send(peer, header, memoryview(b""), self.deadline)
        except DistNetworkError:
            # a neighbour that already finished this collective and left the group
            # (a late rank's last collective) has nothing left to compare
            if self.transport.mailbox.gone(peer) is None:
                raise

    def send(self, peer: int, step: int, array: np.ndarray) -> None:
        """Send `array`'s bytes to `peer` as message `step` of this collective."""
        payload = as_bytes(array)
        header = Header.collective(COLL, self.signature, self.seq, step, len(payload))
        peer = self._global(peer)
        signal = self.signal
        if signal is not None and signal[0] == peer:
            self.signal = None
            first = signal[1]
        else:
            first = None
        try:
            self.transport.send(peer, header, payload, self.deadline, first)
        except DistError as exc:
            raise type(exc)(f"{self.describe}: {exc}") from exc

    def post(self, peer: int, step: int, array: np.ndarray) -> Recv:
        """Post the receive of message `step` from `peer` into `array`."""
        peer = self._global(peer)
        return self.transport.mailbox.post(
            peer,
            Mailbox.coll_key(peer, self.seq, step),
            as_bytes(array),
            self.signature.dtype,
            self.signature,
        )

    def wait(self, recv: Recv) -> None:
        """Wait for a posted receive until the collective's deadline.

        Raises:
            DistTimeoutError: the deadline passed; names the ranks not heard from.
            DistError: the receive failed (mismatch, peer failure, abort).
            The caller aborts the group on any of these.
        """
        if self.signal is not None and not recv.done():
            self.flush()  # the neighbour must see it even if this rank waits forever
        if not recv.wait(self.deadline.remaining()):
            found = diagnosis(self.transport, self.seq)
            error = DistTimeoutError(
                f"{self.describe} timed out after {self.deadline.seconds:.1f} s: {found.text}"
            )
            raise caused_by_peers(error, found.late) if found.late else error
        if recv.error is not None:
            error = recv.error
            raise type(error)(_prefixed(self.describe, str(error))) from error

    def recv(self, peer: int, step: int, array: np.ndarray) -> None:
        """Receive message `step` from `peer` into `array` (post, then wait)."""
        self.wait(self.post(peer, step, array))


class SubExchange(Exchange):
    """An Exchange among some of the transport's ranks: algorithm rank i is `ranks[i]`."""

    __slots__ = ("ranks",)

    def __init__(
        self,
        transport: Transport,
        seq: int,
        signature: Signature,
        deadline: Deadline,
        describe: str,
        scratch: ScratchPool | None,
        ranks: list[int],
    ) -> None:
        super().__init__(transport, seq, signature, deadline, describe, scratch)
        self.ranks = ranks
        self.rank, self.size = ranks.index(transport.rank), len(ranks)

    def _global(self, peer: int) -> int:
        return self.ranks[peer]


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


class Diagnosis(NamedTuple):
    """Why a collective is late: in words, and the ranks to blame."""

    #: the ranks that have not begun it, those that did not answer, those this rank waits for
    text: str
    #: the late ranks: those that have not begun it or did not answer; () when none is
    late: tuple[int, ...]


def diagnose(transport: Transport, seq: int, probe_timeout: float = 1.0) -> str:
    """Why collective `seq` is stuck, in words (`diagnosis`)."""
    return diagnosis(transport, seq, probe_timeout).text


def diagnosis(transport: Transport, seq: int, probe_timeout: float = 1.0) -> Diagnosis:
    """Why collective `seq` is stuck, from the peers' answers to a progress query.

    Names the ranks that have not begun it (and where they are), those that did not
    answer, and the ranks this rank is waiting for. The late ones are also recorded in the
    mailbox (`Mailbox.late`), where the runner finds them for a timeout that a path
    explained with this diagnosis's words only.
    """
    waiting = [p for p in transport.mailbox.pending_peers() if p >= 0]
    statuses = transport.probe(probe_timeout)
    behind = sorted(p for p, st in statuses.items() if st is not None and st[0] < seq)
    silent = sorted(p for p, st in statuses.items() if st is None)
    parts = []
    if behind:
        where = "; ".join(
            f"rank {p} is at collective #{statuses[p][0]}"
            if statuses[p][0] >= 0
            else f"rank {p} has run no collective yet"
            for p in behind
        )
        parts.append(f"rank(s) {_ranks(behind)} have not called collective #{seq} ({where})")
    if silent:
        parts.append(f"rank(s) {_ranks(silent)} did not answer (hung, stopped or dead?)")
    if waiting:
        parts.append(f"this rank was waiting for rank(s) {_ranks(waiting)}")
    if not behind and not silent:
        parts.append(
            "every rank has reached this collective: did they all call it with the same arguments?"
        )
    late = tuple(sorted(behind + silent))
    transport.mailbox.note_late(seq, late)
    return Diagnosis("; ".join(parts), late)


def _prefixed(describe: str, message: str) -> str:
    return message if message.startswith("[rank") else f"{describe}: {message}"
