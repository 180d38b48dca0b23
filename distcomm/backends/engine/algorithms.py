"""Collective algorithms over an `Exchange`: written once, chosen per op by a `Tuning`.

Every function takes flat contiguous numpy arrays and group ranks, posts its receives
before its sends where it can (so payloads land in place), and numbers its messages with
distinct `step`s per collective: `_PHASE` apart for the phases of a composed algorithm,
`_ROUND` apart for the rounds of a phase, one apart for the pieces of a split message.

Algorithms keep the order of reduction of every element fixed and the same on every
rank, so all ranks end with bit-identical results: either one rank computes an element
and the others receive copies (trees, ring, halving-doubling), or partners compute the
same expression with the lower half's operand first (recursive doubling).

Backends call only the dispatch functions (`all_reduce`, `broadcast`, `reduce`,
`all_gather`, `gather`, `scatter`, `reduce_scatter`, `all_to_all`, `barrier`), which pick
an algorithm from a `Tuning`: `Tuning.simple()` for `tcp`, `Tuning.tuned()` for `gloo`,
either one adjusted through DISTCOMM_TUNING (`Tuning.from_env`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from itertools import accumulate

import numpy as np

from ...ops import ReduceOp, finish_average, reduce_into
from .transport.exchange import Exchange
from .tuning import ENV_VAR, NEVER, Tuning

__all__ = [
    "ENV_VAR",
    "NEVER",
    "Tuning",
    "all_gather",
    "all_gather_ring",
    "all_reduce",
    "all_reduce_halving_doubling",
    "all_reduce_recursive_doubling",
    "all_reduce_ring",
    "all_reduce_tree",
    "all_to_all",
    "all_to_all_pairwise",
    "barrier",
    "barrier_dissemination",
    "broadcast",
    "broadcast_binomial",
    "choose_all_reduce",
    "choose_gather",
    "choose_scatter",
    "gather",
    "gather_binomial",
    "gather_flat",
    "reduce",
    "reduce_binomial",
    "reduce_scatter",
    "reduce_scatter_ring",
    "scatter",
    "scatter_binomial",
    "scatter_flat",
]

# step bases that keep the phases of a composed algorithm, and the rounds of a phase, apart
_PHASE = 1 << 48
_ROUND = 1 << 24  # also the most pieces one message is split into


def _bounds(count: int, parts: int) -> list[int]:
    return [count * i // parts for i in range(parts + 1)]


def _pieces(size: int, itemsize: int, piece_bytes: int) -> list[int]:
    """Bounds of the pieces a message of `size` elements is split into (same on both ends)."""
    per = max(1, piece_bytes // itemsize, -(-size // _ROUND)) if piece_bytes else max(size, 1)
    return [*range(0, size, per), size] if size else [0, 0]


def _exchange_reduce(
    ex: Exchange,
    dst: int,
    src: int,
    step: int,
    outgoing: np.ndarray,
    incoming: np.ndarray,
    acc: np.ndarray,
    other: np.ndarray,
    op: ReduceOp,
    piece_bytes: int = 0,
) -> None:
    """Send `outgoing` to `dst` and receive `incoming` from `src`, then acc <- acc (op) other.

    `acc` and `other` are the size of `incoming` (one of them is it). With `piece_bytes`
    the messages go in pieces: every piece's receive is posted first, then piece by piece
    send, wait and reduce, so reducing one piece overlaps the transfer of the next.
    """
    sends = _pieces(outgoing.size, outgoing.itemsize, piece_bytes)
    recvs = _pieces(incoming.size, incoming.itemsize, piece_bytes)
    pending = [
        ex.post(src, step + j, incoming[recvs[j] : recvs[j + 1]]) for j in range(len(recvs) - 1)
    ]
    for j in range(max(len(sends), len(recvs)) - 1):
        if j < len(sends) - 1:
            ex.send(dst, step + j, outgoing[sends[j] : sends[j + 1]])
        if j < len(pending):
            ex.wait(pending[j])
            lo, hi = recvs[j], recvs[j + 1]
            reduce_into(acc[lo:hi], other[lo:hi], op)


# -- trees --------------------------------------------------------------------------------------


def broadcast_binomial(ex: Exchange, buf: np.ndarray, root: int, base: int = 0) -> None:
    """Binomial-tree broadcast of `root`'s `buf`: log2(n) rounds."""
    n, rank = ex.size, ex.rank
    vrank = (rank - root) % n
    mask = 1
    while mask < n:
        if vrank & mask:
            ex.recv((rank - mask) % n, base + mask, buf)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vrank + mask < n:
            ex.send((rank + mask) % n, base + mask, buf)
        mask >>= 1


def reduce_binomial(
    ex: Exchange, buf: np.ndarray, root: int, op: ReduceOp, base: int = 0, keep_input: bool = True
) -> None:
    """Binomial-tree reduction into `root`'s `buf`.

    Other ranks' `buf` is left unchanged, unless `keep_input` is False (then inner
    tree nodes accumulate in it, saving a copy).
    """
    n, rank = ex.size, ex.rank
    vrank = (rank - root) % n
    acc = buf
    scratch = None
    mask = 1
    while mask < n:
        if vrank & mask:
            ex.send(((vrank & ~mask) + root) % n, base + mask, acc)
            return
        child = vrank | mask
        if child < n:
            if scratch is None:
                scratch = ex.scratch.get(0, buf.size, buf.dtype)
                if keep_input and rank != root:
                    acc = ex.scratch.get(1, buf.size, buf.dtype)
                    acc[...] = buf
            ex.recv((child + root) % n, base + mask, scratch)
            reduce_into(acc, scratch, op)
        mask <<= 1


def _subtree(vrank: int, n: int) -> int:
    """How many ranks the binomial subtree rooted at virtual rank `vrank` spans."""
    return min(vrank & -vrank if vrank else n, n - vrank)


def gather_binomial(ex: Exchange, output: np.ndarray | None, input: np.ndarray, root: int) -> None:
    """Binomial-tree gather: inner ranks forward their subtree's blocks in one message."""
    n, rank, m = ex.size, ex.rank, input.size
    vrank = (rank - root) % n
    span = _subtree(vrank, n)
    if span == 1 and vrank:
        ex.send((rank - (vrank & -vrank)) % n, vrank & -vrank, input)
        return
    # blocks in virtual-rank order: this rank's, then each child's subtree
    staging = output if vrank == 0 and root == 0 else ex.scratch.get(0, span * m, input.dtype)
    pending = []
    mask = 1
    while mask < span:
        count = min(mask, span - mask)
        pending.append(ex.post((rank + mask) % n, mask, staging[mask * m : (mask + count) * m]))
        mask <<= 1
    staging[:m] = input
    for recv in pending:
        ex.wait(recv)
    if vrank:
        ex.send((rank - (vrank & -vrank)) % n, vrank & -vrank, staging[: span * m])
    elif root:  # virtual rank v holds real rank (v + root) % n
        output[root * m :] = staging[: (n - root) * m]
        output[: root * m] = staging[(n - root) * m :]


def scatter_binomial(ex: Exchange, output: np.ndarray, input: np.ndarray | None, root: int) -> None:
    """Binomial-tree scatter: each rank receives its subtree's blocks and passes them down."""
    n, rank, m = ex.size, ex.rank, output.size
    vrank = (rank - root) % n
    span = _subtree(vrank, n)
    if span == 1 and vrank:
        ex.recv((rank - (vrank & -vrank)) % n, vrank & -vrank, output)
        return
    if vrank:
        staging = ex.scratch.get(0, span * m, output.dtype)
        ex.recv((rank - (vrank & -vrank)) % n, vrank & -vrank, staging)
    elif root:  # blocks in virtual-rank order
        staging = ex.scratch.get(0, n * m, output.dtype)
        staging[: (n - root) * m] = input[root * m :]
        staging[(n - root) * m :] = input[: root * m]
    else:
        staging = input
    mask = 1 << max(0, (span - 1).bit_length() - 1)
    while mask:
        if mask < span:
            count = min(mask, span - mask)
            ex.send((rank + mask) % n, mask, staging[mask * m : (mask + count) * m])
        mask >>= 1
    output[...] = staging[:m]


def all_reduce_tree(ex: Exchange, buf: np.ndarray, op: ReduceOp) -> None:
    """Reduce to rank 0, then broadcast: binomial trees, 2 log2(n) rounds of whole arrays."""
    reduce_binomial(ex, buf, 0, op, keep_input=False)
    broadcast_binomial(ex, buf, 0, base=_PHASE)


# -- recursive doubling and halving ---------------------------------------------------------


def _fold(ex: Exchange, buf: np.ndarray, op: ReduceOp) -> tuple[int, int, int]:
    """Reduce a non-power-of-two group to the largest power of two p2 <= n.

    The first 2(n - p2) ranks pair up: each odd one sends its array to the even one below,
    which reduces it (even first) and stands for both. Returns (virtual rank among the p2
    that go on, or -1 for a rank that sits out; p2; n - p2). `_unfold` ends it.
    """
    n, rank = ex.size, ex.rank
    p2 = 1 << (n.bit_length() - 1)
    extra = n - p2
    if rank >= 2 * extra:
        return rank - extra, p2, extra
    if rank % 2:
        ex.send(rank - 1, 0, buf)
        return -1, p2, extra
    incoming = ex.scratch.get(0, buf.size, buf.dtype)
    ex.recv(rank + 1, 0, incoming)
    reduce_into(buf, incoming, op)
    return rank // 2, p2, extra


def _unfold(ex: Exchange, buf: np.ndarray, extra: int) -> None:
    """The end of `_fold`: each even rank of a pair hands the result to its odd partner."""
    rank = ex.rank
    if rank < 2 * extra:
        if rank % 2:
            ex.recv(rank - 1, 3 * _PHASE, buf)
        else:
            ex.send(rank + 1, 3 * _PHASE, buf)


def _real(vrank: int, extra: int) -> int:
    return 2 * vrank if vrank < extra else vrank + extra


def all_reduce_recursive_doubling(ex: Exchange, buf: np.ndarray, op: ReduceOp) -> None:
    """Recursive doubling: in round k partners 2^k apart swap whole arrays and reduce.

    Both partners compute (lower half's) op (upper half's), so every rank's result is the
    same expression, bit for bit.
    """
    vrank, p2, extra = _fold(ex, buf, op)
    if vrank >= 0:
        current, spare = buf, ex.scratch.get(1, buf.size, buf.dtype)
        mask = 1
        while mask < p2:
            peer = _real(vrank ^ mask, extra)
            if vrank & mask:  # the partner holds the lower half: theirs (op) mine
                _exchange_reduce(ex, peer, peer, _PHASE + mask, current, spare, spare, current, op)
                current, spare = spare, current
            else:
                _exchange_reduce(ex, peer, peer, _PHASE + mask, current, spare, current, spare, op)
            mask <<= 1
        if current is not buf:
            buf[...] = current
    _unfold(ex, buf, extra)


def all_reduce_halving_doubling(ex: Exchange, buf: np.ndarray, op: ReduceOp) -> None:
    """Rabenseifner: reduce-scatter by recursive halving, all-gather by recursive doubling.

    The array is cut into p2 blocks; in each halving round partners swap halves of the
    blocks they still hold and keep reducing one half, until virtual rank v holds block v
    fully reduced; doubling rounds then swap ever larger runs of finished blocks.
    """
    vrank, p2, extra = _fold(ex, buf, op)
    if vrank >= 0 and p2 > 1:
        bounds = _bounds(buf.size, p2)
        half = p2 // 2
        incoming = ex.scratch.get(1, max(bounds[half], buf.size - bounds[half]), buf.dtype)
        lo, hi = 0, p2
        mask = half
        while mask:  # halving: keep the half of [lo, hi) on this rank's side
            peer = _real(vrank ^ mask, extra)
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if vrank & mask else ((lo, mid), (mid, hi))
            kept = buf[bounds[keep[0]] : bounds[keep[1]]]
            target = incoming[: kept.size]
            _exchange_reduce(
                ex,
                peer,
                peer,
                _PHASE + mask,
                buf[bounds[give[0]] : bounds[give[1]]],
                target,
                kept,
                target,
                op,
            )
            lo, hi = keep
            mask >>= 1
        mask = 1
        while mask < p2:  # doubling: the partner holds the run of blocks next to ours
            peer = _real(vrank ^ mask, extra)
            theirs = (lo - mask, lo) if vrank & mask else (hi, hi + mask)
            pending = ex.post(peer, 2 * _PHASE + mask, buf[bounds[theirs[0]] : bounds[theirs[1]]])
            ex.send(peer, 2 * _PHASE + mask, buf[bounds[lo] : bounds[hi]])
            ex.wait(pending)
            lo, hi = min(lo, theirs[0]), max(hi, theirs[1])
            mask <<= 1
    _unfold(ex, buf, extra)


# -- rings --------------------------------------------------------------------------------------


def _ring_reduce_scatter(
    ex: Exchange,
    chunks: Sequence[np.ndarray],
    out: np.ndarray | None,
    op: ReduceOp,
    piece_bytes: int,
) -> None:
    """Ring reduce-scatter: rank r ends with the reduction of every rank's `chunks[r]`.

    The result goes to `out`, leaving `chunks` unchanged, or (`out` None) into chunks[r].
    Partial reductions travel right; each rank reduces its own chunk into what arrives.
    """
    n, rank = ex.size, ex.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    largest = max(c.size for c in chunks)
    partials = (
        ex.scratch.get(0, largest, chunks[0].dtype),
        ex.scratch.get(1, largest, chunks[0].dtype),
    )
    outgoing = chunks[left]
    for k in range(n - 1):
        i = (rank - k - 2) % n
        if k == n - 2 and out is not None:
            incoming, acc, other = out, out, chunks[i]
        elif k == n - 2:
            incoming = partials[k % 2][: chunks[i].size]
            acc, other = chunks[i], incoming
        else:
            incoming = acc = partials[k % 2][: chunks[i].size]
            other = chunks[i]
        _exchange_reduce(
            ex, right, left, k * _ROUND, outgoing, incoming, acc, other, op, piece_bytes
        )
        outgoing = incoming


def _ring_all_gather(ex: Exchange, chunks: Sequence[np.ndarray], base: int) -> None:
    """Ring all-gather: rank r holds `chunks[r]`; after n-1 steps every rank holds all."""
    n, rank = ex.size, ex.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    for k in range(n - 1):
        pending = ex.post(left, base + k, chunks[(rank - k - 1) % n])
        ex.send(right, base + k, chunks[(rank - k) % n])
        ex.wait(pending)


def all_reduce_ring(ex: Exchange, buf: np.ndarray, op: ReduceOp, piece_bytes: int = 0) -> None:
    """Ring reduce-scatter, then ring all-gather: bandwidth-optimal, 2(n-1)/n of the data.

    Needs at least one element per rank; `piece_bytes` pipelines the reduce-scatter.
    """
    bounds = _bounds(buf.size, ex.size)
    chunks = [buf[bounds[i] : bounds[i + 1]] for i in range(ex.size)]
    _ring_reduce_scatter(ex, chunks, None, op, piece_bytes)
    _ring_all_gather(ex, chunks, _PHASE)


def all_gather_ring(ex: Exchange, output: np.ndarray, input: np.ndarray) -> None:
    """Ring all-gather: rank i's `input` lands in slice i of every rank's `output`."""
    n, rank, m = ex.size, ex.rank, input.size
    chunks = [output[i * m : (i + 1) * m] for i in range(n)]
    if chunks[rank].ctypes.data != input.ctypes.data:
        chunks[rank][...] = input
    _ring_all_gather(ex, chunks, 0)


def reduce_scatter_ring(
    ex: Exchange, output: np.ndarray, input: np.ndarray, op: ReduceOp, piece_bytes: int = 0
) -> None:
    """Ring reduce-scatter: rank i ends with the reduction of every rank's slice i.

    `input` is not modified; `piece_bytes` pipelines each step.
    """
    n, m = ex.size, output.size
    chunks = [input[i * m : (i + 1) * m] for i in range(n)]
    if n == 1:
        output[...] = chunks[0]
    else:
        _ring_reduce_scatter(ex, chunks, output, op, piece_bytes)


# -- flat and pairwise --------------------------------------------------------------------------


def _starts(counts: Sequence[int] | None, size: int, n: int) -> list[int]:
    """Where each rank's piece begins in the root's array, then its end: counts[i]
    elements for rank i, or `size` each when `counts` is None (the even call)."""
    if counts is None:
        return [size * i for i in range(n + 1)]
    return [0, *accumulate(counts)]


def gather_flat(
    ex: Exchange,
    output: np.ndarray | None,
    input: np.ndarray,
    root: int,
    counts: Sequence[int] | None = None,
) -> None:
    """Every rank sends to `root`, which receives each into its slice of `output`: rank
    i's is counts[i] elements (gather_v; root only) or `input.size` long. A sender of
    another size fails the root's receive (the transport checks each payload's size)."""
    if ex.rank != root:
        ex.send(root, 0, input)
        return
    at = _starts(counts, input.size, ex.size)
    pending = [
        ex.post(peer, 0, output[at[peer] : at[peer + 1]]) for peer in range(ex.size) if peer != root
    ]
    output[at[root] : at[root + 1]] = input
    for recv in pending:
        ex.wait(recv)


def scatter_flat(
    ex: Exchange,
    output: np.ndarray,
    input: np.ndarray | None,
    root: int,
    counts: Sequence[int] | None = None,
) -> None:
    """`root` sends slice i of `input` to rank i: counts[i] elements (scatter_v; root
    only) or `output.size`. A receiver of another size fails its receive."""
    if ex.rank != root:
        ex.recv(root, 0, output)
        return
    at = _starts(counts, output.size, ex.size)
    for peer in range(ex.size):
        if peer != root:
            ex.send(peer, 0, input[at[peer] : at[peer + 1]])
    output[...] = input[at[root] : at[root + 1]]


def all_to_all_pairwise(
    ex: Exchange,
    output: np.ndarray,
    input: np.ndarray,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
) -> None:
    """Exchange slice j of `input` with every rank j: all receives posted, then all sends."""
    n, rank = ex.size, ex.rank
    out_at = np.concatenate(([0], np.cumsum(output_splits))).astype(int)
    in_at = np.concatenate(([0], np.cumsum(input_splits))).astype(int)
    pending = [
        ex.post((rank - k) % n, 0, output[out_at[(rank - k) % n] : out_at[(rank - k) % n + 1]])
        for k in range(1, n)
    ]
    for k in range(1, n):
        peer = (rank + k) % n
        ex.send(peer, 0, input[in_at[peer] : in_at[peer + 1]])
    output[out_at[rank] : out_at[rank + 1]] = input[in_at[rank] : in_at[rank + 1]]
    for recv in pending:
        ex.wait(recv)


def barrier_dissemination(ex: Exchange) -> None:
    """Dissemination barrier: ceil(log2 n) rounds of empty messages."""
    n, rank = ex.size, ex.rank
    empty = np.empty(0, dtype=np.uint8)
    distance = 1
    while distance < n:
        pending = ex.post((rank - distance) % n, distance, empty)
        ex.send((rank + distance) % n, distance, empty)
        ex.wait(pending)
        distance <<= 1


# -- dispatch: what the backends call -----------------------------------------------------------


def choose_all_reduce(
    tuning: Tuning, array: np.ndarray, size: int
) -> Callable[[Exchange, np.ndarray, ReduceOp], None]:
    """The all_reduce algorithm `tuning` picks for `array` in a group of `size` ranks."""
    nbytes, count = array.nbytes, array.size
    if size > 1 and nbytes >= tuning.all_reduce_ring_min and count >= size:
        return partial(all_reduce_ring, piece_bytes=tuning.ring_chunk)
    if (
        size > 1
        and nbytes >= tuning.all_reduce_halving_doubling_min
        and count >= 1 << (size.bit_length() - 1)
    ):
        return all_reduce_halving_doubling
    if nbytes >= tuning.all_reduce_doubling_min:
        return all_reduce_recursive_doubling
    return all_reduce_tree


def _tree_gather(tuning: Tuning, block: np.ndarray, size: int) -> bool:
    return size >= tuning.gather_tree_min_ranks and block.nbytes < tuning.gather_flat_min


def choose_gather(tuning: Tuning, block: np.ndarray, size: int) -> Callable[..., None]:
    """The gather algorithm for blocks like `block` (every rank's input) among `size` ranks."""
    return gather_binomial if _tree_gather(tuning, block, size) else gather_flat


def choose_scatter(tuning: Tuning, block: np.ndarray, size: int) -> Callable[..., None]:
    """The scatter algorithm for blocks like `block` (every rank's output) among `size`."""
    return scatter_binomial if _tree_gather(tuning, block, size) else scatter_flat


def all_reduce(ex: Exchange, buf: np.ndarray, op: ReduceOp, tuning: Tuning) -> None:
    """all_reduce in place; AVG divides by the group size."""
    if ex.size > 1:
        choose_all_reduce(tuning, buf, ex.size)(ex, buf, op)
    finish_average(buf, op, ex.size)


def broadcast(ex: Exchange, buf: np.ndarray, root: int, tuning: Tuning) -> None:
    """Broadcast `root`'s `buf` (binomial tree)."""
    broadcast_binomial(ex, buf, root)


def reduce(ex: Exchange, buf: np.ndarray, root: int, op: ReduceOp, tuning: Tuning) -> None:
    """Reduce into `root`'s `buf` (binomial tree); other ranks' `buf` is left unchanged."""
    reduce_binomial(ex, buf, root, op)
    if ex.rank == root:
        finish_average(buf, op, ex.size)


def all_gather(ex: Exchange, output: np.ndarray, input: np.ndarray, tuning: Tuning) -> None:
    """Rank i's `input` into slice i of every rank's `output` (ring)."""
    all_gather_ring(ex, output, input)


def gather(
    ex: Exchange, output: np.ndarray | None, input: np.ndarray, root: int, tuning: Tuning
) -> None:
    """Rank i's `input` into slice i of `root`'s `output` (None elsewhere)."""
    choose_gather(tuning, input, ex.size)(ex, output, input, root)


def scatter(
    ex: Exchange, output: np.ndarray, input: np.ndarray | None, root: int, tuning: Tuning
) -> None:
    """Slice i of `root`'s `input` (None elsewhere) into rank i's `output`."""
    choose_scatter(tuning, output, ex.size)(ex, output, input, root)


def reduce_scatter(
    ex: Exchange, output: np.ndarray, input: np.ndarray, op: ReduceOp, tuning: Tuning
) -> None:
    """Rank i's `output` <- the reduction of slice i of every rank's `input` (ring).

    `input` is not modified; AVG divides by the group size.
    """
    reduce_scatter_ring(ex, output, input, op, tuning.ring_chunk)
    finish_average(output, op, ex.size)


def all_to_all(
    ex: Exchange,
    output: np.ndarray,
    input: np.ndarray,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    tuning: Tuning,
) -> None:
    """Slice j of `input` to rank j, slice i of `output` from rank i (pairwise)."""
    all_to_all_pairwise(ex, output, input, output_splits, input_splits)


def barrier(ex: Exchange, tuning: Tuning) -> None:
    """Return once every rank has entered (dissemination)."""
    barrier_dissemination(ex)
