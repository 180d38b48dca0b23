"""The Transport contract: moves headed messages between the ranks of one group.

Every message carries a `protocol.Header`. Collective messages are matched by (peer, seq,
step) and carry the collective's `Signature`; a receiver that finds a signature unlike its
own raises `DistBackendError` describing both sides, and a message for a collective
this rank has already finished is reported the same way. Because two mismatched
collectives may both only wait to receive, every rank also sends its signature to
its right-hand neighbour when a collective starts (a payload-free SIG message): if
any two ranks disagree, some neighbour pair does, and that rank aborts the group.
Point-to-point messages are matched by (peer, tag) in order, or by tag from any peer.
Matching lives in `mailbox.py`; a collective's view of the transport in `exchange.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from ....deadline import Deadline
from ..protocol import Failure, Header

if TYPE_CHECKING:
    from .mailbox import Mailbox

__all__ = ["Transport"]


class Transport(ABC):
    """Moves headed messages between the ranks of one group and feeds a Mailbox."""

    #: where incoming messages are matched to posted receives (a `Mailbox`)
    mailbox: Mailbox

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    @abstractmethod
    def send(
        self,
        peer: int,
        header: Header,
        payload: memoryview,
        deadline: Deadline,
        first: Header | None = None,
    ) -> None:
        """Send one message (`header`, then `payload`) to `peer`, blocking until written;
        `first`, a message without payload (a signature), goes just before it, in the same
        write.

        Raises:
            DistNetworkError: the connection failed.
            DistTimeoutError: the deadline passed (the group is aborted: the stream is cut).
        """

    def connected(self, peer: int) -> bool:
        """Whether a message to `peer` can go without making a connection first."""
        return False

    def probe(self, timeout: float) -> dict[int, tuple[int, int] | None]:
        """Ask every peer how far it got: {peer: (began, finished) or None if silent}."""
        return {}

    @abstractmethod
    def abort(self, failure: Failure) -> None:
        """Fail everything pending and tell the peers why; idempotent."""

    @abstractmethod
    def close(self) -> None:
        """Say goodbye to the peers and release every connection and thread; idempotent."""
