"""Transport-independent messaging: the wire header, signatures, failures, the Transport ABC.

Every message carries a header. Collective messages are matched by (peer, seq, step)
and carry the collective's `Signature`; a receiver that finds a signature unlike its
own raises `DistBackendError` describing both sides, and a message for a collective
this rank has already finished is reported the same way. Because two mismatched
collectives may both only wait to receive, every rank also sends its signature to
its right-hand neighbour when a collective starts (a payload-free SIG message): if
any two ranks disagree, some neighbour pair does, and that rank aborts the group.
Point-to-point messages are matched by (peer, tag) in order, or by tag from any peer.
Matching lives in `mailbox.py`; a collective's view of the transport in `exchange.py`.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...arrays import dtype_code, dtype_from_code
from ...deadline import Deadline
from ...errors import DistError
from ...ops import ReduceOp

if TYPE_CHECKING:
    from .mailbox import Mailbox

__all__ = [
    "ABORT",
    "BYE",
    "COLL",
    "HEADER",
    "NO_REDOP",
    "OP_CODES",
    "OP_NAMES",
    "P2P",
    "PROGRESS",
    "QUERY",
    "SIG",
    "STATUS",
    "Failure",
    "Signature",
    "Transport",
    "as_bytes",
    "mismatch_message",
]

# message kinds: collective data, point-to-point data, control, the signature check, and
# the progress query a timing-out rank sends (answered by the peers' reader threads)
COLL, P2P, ABORT, BYE, SIG, QUERY, STATUS = 1, 2, 3, 4, 5, 6, 7
#: a STATUS payload: the peer's current (last begun) and last finished collective
PROGRESS = struct.Struct("<qq")
#: kind, op, dtype, redop, root, seq (or tag), step, count, payload bytes
HEADER = struct.Struct("<BBBBiqqqQ")

OP_NAMES = (
    "none",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "barrier",
    "send",
)
OP_CODES = {name: code for code, name in enumerate(OP_NAMES)}
NO_REDOP = 255


def as_bytes(array: np.ndarray) -> memoryview:
    """A flat contiguous array's memory as a writable-if-possible byte memoryview."""
    return memoryview(array.reshape(-1).view(np.uint8))


@dataclass(frozen=True)
class Failure:
    """Why a group stopped: the exception type and message every later operation raises."""

    kind: type[DistError]
    message: str

    def error(self, prefix: str = "") -> DistError:
        return self.kind(f"{prefix}{self.message}")


@dataclass(frozen=True)
class Signature:
    """What a collective is, as every rank must agree: op, dtype, reduce op, root, count."""

    op: int
    dtype: int = 0
    redop: int = NO_REDOP
    root: int = -1
    count: int = 0

    @classmethod
    def of(
        cls,
        op: str,
        array: Any = None,
        redop: ReduceOp | None = None,
        root: int = -1,
        count: int | None = None,
    ) -> Signature:
        """The signature of collective `op` on `array` (count: its size unless given)."""
        return cls(
            OP_CODES[op],
            dtype_code(array.dtype) if array is not None else 0,
            NO_REDOP if redop is None else int(redop),
            root,
            (array.size if array is not None else 0) if count is None else count,
        )

    def describe(self) -> str:
        name = OP_NAMES[self.op]
        if self.op == OP_CODES["barrier"]:
            return name
        text = name
        if self.redop != NO_REDOP:
            text += f"({ReduceOp(self.redop).name})"
        if self.count >= 0:
            text += f" of {self.count} {dtype_from_code(self.dtype)}"
        else:
            text += f" of {dtype_from_code(self.dtype)}"
        if self.root >= 0:
            text += f" with root {self.root}"
        return text


def mismatch_message(
    rank: int, size: int, seq: int, mine: Signature, peer: int, theirs: Signature
) -> str:
    return (
        f"[rank {rank}/{size}] collective mismatch at collective #{seq}: this rank called "
        f"{mine.describe()}, rank {peer} called {theirs.describe()}; every rank of a group "
        "must issue the same collectives in the same order with the same size, dtype, op "
        "and root"
    )


class Transport(ABC):
    """Moves headed messages between the ranks of one group and feeds a Mailbox."""

    #: where incoming messages are matched to posted receives (a `Mailbox`)
    mailbox: Mailbox

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    @abstractmethod
    def send(self, peer: int, fields: tuple, payload: memoryview, deadline: Deadline) -> None:
        """Send one message (header `fields`, then `payload`) to `peer`, blocking until written.

        Raises:
            DistNetworkError: the connection failed.
            DistTimeoutError: the deadline passed (the group is aborted: the stream is cut).
        """

    def probe(self, timeout: float) -> dict[int, tuple[int, int] | None]:
        """Ask every peer how far it got: {peer: (began, finished) or None if silent}."""
        return {}

    @abstractmethod
    def abort(self, failure: Failure) -> None:
        """Fail everything pending and tell the peers why; idempotent."""

    @abstractmethod
    def close(self) -> None:
        """Say goodbye to the peers and release every connection and thread; idempotent."""
