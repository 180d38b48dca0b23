"""The collective protocol every backend speaks: op codes, signatures, failures, the header.

A collective is identified across ranks by its `Signature` (op, dtype, reduce op, root,
count): every rank of a group must issue the same signatures in the same order, and a
backend that finds two ranks disagreeing reports both sides with `mismatch_message`. A
group that stops records why as a `Failure`, which every later operation raises.

Messages between ranks (the TCP transport's) start with a `Header`: what kind of message
it is, the collective's signature, its sequence number (a tag for point-to-point
messages), the step within the collective and the payload's length. An ABORT message is
an `AbortNotice`: who aborted the group, the ranks it blames, and why. The shared-memory
engine keeps signatures in its slots and the nccl backend exchanges them through the
store (`Signature.to_text`), so the three paths check collectives the same way.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ...arrays import dtype_code, dtype_from_code
from ...deadline import Deadline
from ...errors import DistError
from ...ops import ReduceOp

__all__ = [
    "ABORT",
    "BYE",
    "COLL",
    "NOTICE_PEERS_MAX",
    "NOTICE_REASON_MAX",
    "NO_REDOP",
    "OP_CODES",
    "OP_NAMES",
    "P2P",
    "PROGRESS",
    "QUERY",
    "SIG",
    "STATUS",
    "AbortNotice",
    "Call",
    "Failure",
    "Header",
    "Signature",
    "as_bytes",
    "blamed_message",
    "mismatch_message",
]

#: message kinds: collective data, point-to-point data, control, the signature check, and
#: the progress query a timing-out rank sends (answered by the peers' I/O threads)
COLL, P2P, ABORT, BYE, SIG, QUERY, STATUS = 1, 2, 3, 4, 5, 6, 7
#: a STATUS payload: the peer's current (last begun) and last finished collective
PROGRESS = struct.Struct("<qq")

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
    """Why a group stopped: the exception type and message every later operation raises,
    and `peers`: the group ranks whose failure caused it (() unknown), None if none did."""

    kind: type[DistError]
    message: str
    peers: tuple[int, ...] | None = None

    def error(self, prefix: str = "") -> DistError:
        error = self.kind(f"{prefix}{self.message}")
        error.peer_ranks = self.peers
        return error


_new_tuple = tuple.__new__  # builds a NamedTuple without its argument-binding __new__


class Signature(NamedTuple):
    """What a collective is, as every rank must agree: op, dtype, reduce op, root, count.

    A tuple, not a dataclass: every collective makes one, and a frozen dataclass costs
    twice as much to build.
    """

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
        code = NO_REDOP if redop is None else int(redop)
        if array is None:
            return _new_tuple(cls, (OP_CODES[op], 0, code, root, 0 if count is None else count))
        return _new_tuple(
            cls,
            (
                OP_CODES[op],
                dtype_code(array.dtype),
                code,
                root,
                array.size if count is None else count,
            ),
        )

    def to_text(self) -> str:
        """The signature as a store value ("op,dtype,redop,root,count")."""
        return f"{self.op},{self.dtype},{self.redop},{self.root},{self.count}"

    @classmethod
    def from_text(cls, text: str) -> Signature:
        """The inverse of `to_text`."""
        return cls(*(int(v) for v in text.split(",")))

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


class Call(NamedTuple):
    """One collective as a backend's path runs it, passed to every step that may wait.

    Attributes:
        seq: its number in the group (the shared-memory engine numbers its own steps).
        signature: what every rank must have called.
        describe: the collective, as its errors name it ("[rank 1/4] all_reduce ... #7").
        deadline: when its waits give up; passed down, never re-derived.
        explain: why it is late, in the group's terms, for a step of a collective that
            spans hosts: a host's shared-memory counters number the host's own steps and
            can only name the same-host ranks it waits for, not a late rank on another
            host. None: the path that waits explains it.
    """

    seq: int
    signature: Signature
    describe: str
    deadline: Deadline
    explain: Callable[[], str] | None = None


#: the wire layout of a `Header`: kind, op, dtype, redop, root, seq, step, count, nbytes
_HEADER = struct.Struct("<BBBBiqqqQ")


class Header(NamedTuple):
    """The fixed-size header in front of every message between two ranks.

    Attributes:
        kind: COLL, P2P, ABORT, BYE, SIG, QUERY or STATUS.
        op, dtype, redop, root, count: the collective's `Signature` (for P2P: the send's
            op and dtype, and the element count; an ABORT's are `AbortNotice`'s).
        seq: the collective's sequence number in its group; for P2P, the tag.
        step: which message of the collective this is (algorithms number their steps).
        nbytes: the length of the payload that follows.
    """

    kind: int
    op: int = 0
    dtype: int = 0
    redop: int = 0
    root: int = 0
    seq: int = 0
    step: int = 0
    count: int = 0
    nbytes: int = 0

    #: bytes on the wire, and their struct format
    SIZE = _HEADER.size
    FORMAT = _HEADER.format

    @classmethod
    def collective(
        cls, kind: int, signature: Signature, seq: int, step: int = 0, nbytes: int = 0
    ) -> Header:
        """The header of message `step` of collective `seq` (kind COLL, or SIG: no payload)."""
        s = signature
        return cls(kind, s.op, s.dtype, s.redop, s.root, seq, step, s.count, nbytes)

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> Header:
        return cls._make(_HEADER.unpack(data))

    def pack(self) -> bytes:
        return _HEADER.pack(*self)

    def signature(self) -> Signature:
        """The collective this message belongs to, as its sender called it."""
        return Signature(self.op, self.dtype, self.redop, self.root, self.count)


#: the most ranks an ABORT message names: a failure that blames more goes out blaming
#: ranks it does not name (())
NOTICE_PEERS_MAX = 1024
#: the most bytes of an ABORT message's reason
NOTICE_REASON_MAX = 4096


class AbortNotice(NamedTuple):
    """The news of an abort as one rank passes it to another: an ABORT message.

    Attributes:
        origin: the group rank that aborted the group.
        code: the failure's kind, as the transport numbers its failure kinds.
        peers: the group ranks the failure blames (`Failure.peers`: the late ranks of a
            timeout, a lost peer; () when it cannot tell which), None when it blames none.
        reason: why, in the origin's words.

    On the wire: a `Header` of kind ABORT whose `op` is `code`, `root` is `origin` and
    `count` is the number of blamed ranks (-1 for None), then the blamed ranks (int32
    each), then the reason in UTF-8, cut to `NOTICE_REASON_MAX` bytes.
    """

    origin: int
    code: int
    peers: tuple[int, ...] | None
    reason: str

    def pack(self) -> tuple[Header, bytes]:
        """The message: its header and its payload."""
        peers = self.peers
        if peers is not None and len(peers) > NOTICE_PEERS_MAX:
            peers = ()
        ranks = b"" if peers is None else struct.pack(f"<{len(peers)}i", *peers)
        payload = ranks + self.reason.encode(errors="replace")[:NOTICE_REASON_MAX]
        count = -1 if peers is None else len(peers)
        header = Header(ABORT, self.code, root=self.origin, count=count, nbytes=len(payload))
        return header, payload

    @classmethod
    def unpack(cls, header: Header, payload: bytes | bytearray) -> AbortNotice:
        """The notice an ABORT message (`header`, then `payload`) carries."""
        count, start = header.count, 0
        peers: tuple[int, ...] | None = None
        if 0 <= count <= min(NOTICE_PEERS_MAX, len(payload) // 4):
            start = 4 * count
            peers = struct.unpack_from(f"<{count}i", payload)
        elif count >= 0:  # not a list this version wrote: blamed, names unknown
            peers = ()
        reason = bytes(payload[start:]).decode(errors="replace")
        return cls(header.root, header.op, peers, reason)


def blamed_message(origin: int, reason: str, others: tuple[int, ...] = ()) -> str:
    """What a rank that another rank's abort blames (a late rank) is told, on every
    backend: it is the cause, in words a launcher's failure report does not take for a
    peer's failure (so its `peer_ranks` stays None)."""
    also = f" (with rank(s) {', '.join(map(str, others))})" if others else ""
    return (
        f"the group was aborted by rank {origin}, which blames this rank{also}: {reason}. "
        "This rank is the cause: find out why it was late or stopped; the others give it "
        "up (re-form the group without it, or destroy the group)"
    )


def mismatch_message(
    rank: int, size: int, seq: int, mine: Signature, peer: int, theirs: Signature
) -> str:
    """The error every path raises when ranks `rank` and `peer` called different collectives."""
    return (
        f"[rank {rank}/{size}] collective mismatch at collective #{seq}: this rank called "
        f"{mine.describe()}, rank {peer} called {theirs.describe()}; every rank of a group "
        "must issue the same collectives in the same order with the same size, dtype, op "
        "and root"
    )
