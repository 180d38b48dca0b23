"""Public point-to-point functions: isend, irecv, send, recv and batch_isend_irecv.

Peers are global ranks (`dst`, `src`, `peer`) or ranks within the group (`group_dst`,
`group_src`, `group_peer`); a receive may name no source. Each is validated, recorded in
the group's flight recorder and posted on the backend of its array's device. Each but
batch_isend_irecv takes `timeout=` (seconds or a timedelta): it bounds that call alone, as
for the collectives (`distcomm.collectives`); a receive that times out is cancelled where
the backend can (tcp, gloo), else the group is aborted.

Beyond torch (whose functions take tensors), each also takes a C-contiguous buffer-protocol
object (bytes, bytearray, memoryview, mmap, array.array), as mpi4py's `Send`/`Recv` do,
through a zero-copy numpy view: untyped bytes as uint8, a typed buffer (array.array("d"))
as its format's dtype. A send only reads it, so bytes and read-only views do; a receive
writes it, so it must be writable. As for arrays, the receiver's dtype and element count
must be the sender's: bytes sent arrive in a bytearray or uint8 array of as many bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._calls import check_tag, op_timeout, rank_arg, timed
from .arrays import adapt, flat
from .work import Work
from .world import outside, resolve

if TYPE_CHECKING:
    from .process_group import ProcessGroup

__all__ = ["P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"]


class _Posting:
    """A validated point-to-point operation, ready to post on its backend.

    Args:
        group: the operation's group.
        kind: "send" or "recv", for the flight recorder.
        tensor: the caller's array, which the Work's result holds.
        array: `tensor` as an array a backend takes.
        backend: the group's backend for the array's device.
        peer: the other side's group rank (None: a receive from any rank).
        issue: posts the operation on `backend`; its Work.
    """

    __slots__ = ("_issue", "_kind", "_peer", "_tensor", "array", "backend", "group")

    def __init__(
        self,
        group: ProcessGroup,
        kind: str,
        tensor: Any,
        array: Any,
        backend: Any,
        peer: int | None,
        issue: Callable[[], Work],
    ) -> None:
        self.group, self._kind, self._tensor, self._peer = group, kind, tensor, peer
        self.array, self.backend, self._issue = array, backend, issue

    def post(self) -> Work:
        """Record the operation in the group's flight recorder and post it; its Work."""
        trace = self.group.recorder
        entry = trace.record_p2p(self._kind, self.array, -1 if self._peer is None else self._peer)
        work = self._issue()
        trace.settle_later(entry, work)
        work.global_ranks = self.group.ranks
        work.set_outputs([self._tensor])
        return work


def _sending(
    tensor: Any,
    dst: int | None,
    group: ProcessGroup | None,
    tag: int,
    group_dst: int | None,
    where: str = "isend",
) -> _Posting:
    """Validate a send; its messages name `where`, the function the caller called.

    `tensor` may also be a contiguous buffer-protocol object (bytes, memoryview, ...):
    a send only reads it.
    """
    pg = resolve(group, where)
    tag = check_tag(tag, where)
    array = adapt(tensor, where, "tensor", writable=False, buffers=True)
    peer = rank_arg(pg, dst, group_dst, where, "dst")
    backend = pg.backend_for(array, where)
    if peer == pg.rank():
        raise ValueError(
            f"{where}: dst {pg.ranks[peer]} is this process itself; send to another rank"
        )
    return _Posting(
        pg, "send", tensor, array, backend, peer, lambda: backend.send(flat(array), peer, tag)
    )


def _receiving(
    tensor: Any,
    src: int | None,
    group: ProcessGroup | None,
    tag: int,
    group_src: int | None,
    where: str = "irecv",
) -> _Posting:
    """Validate a receive; its messages name `where`, the function the caller called.

    `tensor` may also be a writable contiguous buffer-protocol object (bytearray, ...).
    """
    pg = resolve(group, where)
    tag = check_tag(tag, where)
    array = adapt(tensor, where, "tensor", writable=True, buffers=True)
    backend = pg.backend_for(array, where)
    peer = None
    if src is not None or group_src is not None:
        peer = rank_arg(pg, src, group_src, where, "src")
        if peer == pg.rank():
            raise ValueError(
                f"{where}: src {pg.ranks[peer]} is this process itself; receive from another rank"
            )
    return _Posting(
        pg, "recv", tensor, array, backend, peer, lambda: backend.recv(flat(array), peer, tag)
    )


def isend(
    tensor: Any,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
    *,
    timeout: Any = None,
) -> Work:
    """Send `tensor` to `dst` without blocking; returns the Work to wait on (None on a
    rank outside `group`).

    Args:
        tensor: an array, or a contiguous buffer (bytes, bytearray, memoryview, mmap,
            array.array), which must not change until the Work completes.
        timeout: seconds or timedelta that the Work's `wait()` waits at most (default:
            the group's timeout); on expiry the group is aborted.
    """
    if outside(group, "isend"):
        return None
    posting = _sending(tensor, dst, group, tag, group_dst)
    if timeout is not None:
        return timed(posting.group, timeout, "isend", True, posting.post)
    return posting.post()


def irecv(
    tensor: Any,
    src: int | None = None,
    group: ProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
    *,
    timeout: Any = None,
) -> Work:
    """Post a receive into `tensor` from `src` (None: any rank); `Work.source_rank()` tells
    (None on a rank outside `group`).

    Args:
        tensor: an array, or a writable contiguous buffer (bytearray, a writable
            memoryview or mmap, array.array) of the sender's dtype and size.
        timeout: seconds or timedelta that the Work's `wait()` waits at most (default:
            the group's timeout); on expiry the receive is cancelled (tcp, gloo) or the
            group aborted.
    """
    if outside(group, "irecv"):
        return None
    posting = _receiving(tensor, src, group, tag, group_src)
    if timeout is not None:
        return timed(posting.group, timeout, "irecv", True, posting.post)
    return posting.post()


def send(
    tensor: Any,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
    *,
    timeout: Any = None,
) -> None:
    """Send `tensor` to `dst`, blocking until it is handed to the transport.

    Args:
        tensor: an array, or a contiguous buffer (bytes, bytearray, memoryview, mmap,
            array.array).
        timeout: seconds or timedelta this call waits at most (default: the group's
            timeout); on expiry the group is aborted and `DistTimeoutError` raised.
    """
    if outside(group, "isend"):  # torch's send is an isend, and warns so
        return
    posting = _sending(tensor, dst, group, tag, group_dst, "send")
    if timeout is not None:
        timed(posting.group, timeout, "send", False, posting.post)
        return
    work = posting.post()
    # a failed send's error keeps this frame (its traceback): not the view of the caller's
    # buffer, nor the Work that keeps the error (a cycle only the collector would free)
    posting = None
    try:
        work.wait()
    except BaseException:
        work = None
        raise


def recv(
    tensor: Any,
    src: int | None = None,
    group: ProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
    *,
    timeout: Any = None,
) -> int:
    """Receive into `tensor` from `src` (None: any rank); returns the sender's global rank
    (-1 on a rank outside `group`).

    Args:
        tensor: an array, or a writable contiguous buffer (bytearray, a writable
            memoryview or mmap, array.array) of the sender's dtype and size.
        timeout: seconds or timedelta this call waits at most (default: the group's
            timeout); on expiry the receive is cancelled (tcp, gloo) or the group aborted,
            and `DistTimeoutError` raised.
    """
    if outside(group, "irecv"):  # torch's recv is an irecv, and warns so
        return -1
    posting = _receiving(tensor, src, group, tag, group_src, "recv")
    # validated before the receive is posted; passed explicitly, since a device Work's
    # plain wait() only orders a stream
    seconds = None if timeout is None else op_timeout(timeout, posting.group, "recv")
    work = posting.post()
    posting = None  # as in `send`: the error's traceback keeps this frame
    try:
        work.wait(seconds)
    except BaseException:
        work = None
        raise
    return work.source_rank()


class P2POp:
    """One point-to-point operation for `batch_isend_irecv` (torch.distributed.P2POp).

    Args:
        op: `distcomm.isend` or `distcomm.irecv`.
        tensor: the array (or buffer, as `isend` and `irecv` take) to send or receive
            into.
        peer: the other side's global rank (or `group_peer`, its rank within `group`).
    """

    def __init__(
        self,
        op: Callable[..., Work],
        tensor: Any,
        peer: int | None = None,
        group: ProcessGroup | None = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        if op not in (isend, irecv):
            raise ValueError(
                "P2POp: op must be distcomm.isend or distcomm.irecv, got "
                f"{getattr(op, '__name__', op)!r}"
            )
        if peer is None and group_peer is None:
            raise ValueError("P2POp: peer (a global rank) or group_peer is required")
        self.op, self.tensor, self.peer, self.group = op, tensor, peer, group
        self.tag, self.group_peer = tag, group_peer

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: Sequence[P2POp], *, timeout: Any = None) -> list[Work]:
    """Post every operation of the list in order; returns their Works.

    On a backend that groups operations (nccl), the list is issued as one group, so
    sends and receives between the same ranks cannot block one another; a list spanning
    several groups is issued as one group per group (in the order each first appears).

    Args:
        timeout: seconds or timedelta (at most each operation's group's timeout): what
            each returned Work's `wait()` waits at most, as for `isend`/`irecv`.
    """
    if not isinstance(p2p_op_list, (list, tuple)) or not all(
        isinstance(p, P2POp) for p in p2p_op_list
    ):
        raise TypeError("batch_isend_irecv: p2p_op_list must be a list of P2POp")
    if not p2p_op_list:
        raise ValueError("batch_isend_irecv: p2p_op_list must not be empty")
    postings = [
        (_sending if p.op is isend else _receiving)(p.tensor, p.peer, p.group, p.tag, p.group_peer)
        for p in p2p_op_list
    ]
    seconds = (
        None
        if timeout is None
        else [op_timeout(timeout, p.group, "batch_isend_irecv") for p in postings]
    )
    first = postings[0]
    together = all(p.backend is first.backend for p in postings)
    if together:
        with first.backend.coalesce(first.array):
            works = [p.post() for p in postings]
    else:
        # operations of several groups: each group's are posted in a row (in the order
        # its first one comes in the list), and then together as one NCCL group (nccl),
        # so none of them waits for a peer before the others are posted
        backends = list({id(p.backend): p.backend for p in postings}.values())
        order = sorted(range(len(postings)), key=lambda i: backends.index(postings[i].backend))
        posted = {i: postings[i].post() for i in order}
        for backend in backends:
            backend.flush()
        works = [posted[i] for i in range(len(postings))]
    if seconds is not None:
        for work, limit in zip(works, seconds, strict=True):
            work.set_default_timeout(limit)
    return works
