"""Collective algorithms over an `Exchange`: written once, chosen per backend by `Tuning`.

Every function takes flat contiguous numpy arrays and group ranks, posts its receives
before its sends (so payloads land in place), and numbers its messages with distinct
`step`s per collective. Algorithms that need an order of reduction keep it the same
on every rank, so all ranks end with bit-identical results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..ops import ReduceOp, reduce_into
from .transport.exchange import Exchange

__all__ = [
    "Tuning",
    "all_gather_ring",
    "all_reduce",
    "all_reduce_ring",
    "all_reduce_tree",
    "all_to_all_pairwise",
    "barrier_dissemination",
    "broadcast_binomial",
    "gather_flat",
    "reduce_binomial",
    "reduce_scatter_ring",
    "scatter_flat",
]

# step bases that keep the phases of a composed algorithm apart
_PHASE = 1 << 32


@dataclass(frozen=True)
class Tuning:
    """When to switch algorithms (bytes).

    Attributes:
        ring_all_reduce_min: all_reduce of at least this many bytes uses the ring
            (reduce-scatter + all-gather); smaller ones reduce to rank 0 and broadcast.
    """

    ring_all_reduce_min: int = 512 * 1024  # measured crossover at 2-4 ranks: 256 KiB-1 MiB


def _bounds(count: int, parts: int) -> list[int]:
    return [count * i // parts for i in range(parts + 1)]


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


def reduce_binomial(ex: Exchange, buf: np.ndarray, root: int, op: ReduceOp,
                    base: int = 0, keep_input: bool = True) -> None:
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


def all_reduce_tree(ex: Exchange, buf: np.ndarray, op: ReduceOp) -> None:
    """Reduce to rank 0, then broadcast: the latency-bound choice for small arrays."""
    reduce_binomial(ex, buf, 0, op, keep_input=False)
    broadcast_binomial(ex, buf, 0, base=_PHASE)


def all_reduce_ring(ex: Exchange, buf: np.ndarray, op: ReduceOp) -> None:
    """Ring reduce-scatter, then ring all-gather: bandwidth-optimal, 2(n-1)/n of the data."""
    n, rank = ex.size, ex.rank
    bounds = _bounds(buf.size, n)
    chunk = [buf[bounds[i]:bounds[i + 1]] for i in range(n)]
    right, left = (rank + 1) % n, (rank - 1) % n
    scratch = ex.scratch.get(0, max(bounds[i + 1] - bounds[i] for i in range(n)), buf.dtype)
    for k in range(n - 1):
        send_i, recv_i = (rank - k) % n, (rank - k - 1) % n
        target = scratch[:chunk[recv_i].size]
        pending = ex.post(left, k, target)
        ex.send(right, k, chunk[send_i])
        ex.wait(pending)
        reduce_into(chunk[recv_i], target, op)
    for k in range(n - 1):
        send_i, recv_i = (rank + 1 - k) % n, (rank - k) % n
        pending = ex.post(left, _PHASE + k, chunk[recv_i])
        ex.send(right, _PHASE + k, chunk[send_i])
        ex.wait(pending)


def all_reduce(ex: Exchange, buf: np.ndarray, op: ReduceOp, tuning: Tuning) -> None:
    """all_reduce in place, choosing tree or ring by size; AVG divides by the group size."""
    if ex.size > 1:
        if buf.nbytes >= tuning.ring_all_reduce_min and buf.size >= ex.size:
            all_reduce_ring(ex, buf, op)
        else:
            all_reduce_tree(ex, buf, op)
    if op is ReduceOp.AVG:
        np.divide(buf, ex.size, out=buf)


def all_gather_ring(ex: Exchange, output: np.ndarray, input: np.ndarray) -> None:
    """Ring all-gather: rank i's `input` lands in slice i of every rank's `output`."""
    n, rank, m = ex.size, ex.rank, input.size
    chunk = [output[i * m:(i + 1) * m] for i in range(n)]
    if chunk[rank].ctypes.data != input.ctypes.data:
        chunk[rank][...] = input
    right, left = (rank + 1) % n, (rank - 1) % n
    for k in range(n - 1):
        send_i, recv_i = (rank - k) % n, (rank - k - 1) % n
        pending = ex.post(left, k, chunk[recv_i])
        ex.send(right, k, chunk[send_i])
        ex.wait(pending)


def gather_flat(ex: Exchange, output: np.ndarray | None, input: np.ndarray, root: int) -> None:
    """Every rank sends to `root`, which receives each into its slice of `output`."""
    if ex.rank != root:
        ex.send(root, 0, input)
        return
    m = input.size
    pending = [ex.post(peer, 0, output[peer * m:(peer + 1) * m])
               for peer in range(ex.size) if peer != root]
    output[root * m:(root + 1) * m] = input
    for recv in pending:
        ex.wait(recv)


def scatter_flat(ex: Exchange, output: np.ndarray, input: np.ndarray | None, root: int) -> None:
    """`root` sends slice i of `input` to rank i."""
    if ex.rank != root:
        ex.recv(root, 0, output)
        return
    m = output.size
    for peer in range(ex.size):
        if peer != root:
            ex.send(peer, 0, input[peer * m:(peer + 1) * m])
    output[...] = input[root * m:(root + 1) * m]


def reduce_scatter_ring(ex: Exchange, output: np.ndarray, input: np.ndarray,
                        op: ReduceOp) -> None:
    """Ring reduce-scatter: rank i ends with the reduction of every rank's slice i.

    `input` is not modified. AVG divides by the group size.
    """
    n, rank, m = ex.size, ex.rank, output.size
    chunk = [input[i * m:(i + 1) * m] for i in range(n)]
    if n == 1:
        output[...] = chunk[0]
    else:
        right, left = (rank + 1) % n, (rank - 1) % n
        buffers = (ex.scratch.get(0, output.size, output.dtype),
                   ex.scratch.get(1, output.size, output.dtype))
        outgoing = chunk[(rank - 1) % n]
        for k in range(n - 1):
            recv_i = (rank - k - 2) % n
            incoming = output if k == n - 2 else buffers[k % 2]
            pending = ex.post(left, k, incoming)
            ex.send(right, k, outgoing)
            ex.wait(pending)
            reduce_into(incoming, chunk[recv_i], op)
            outgoing = incoming
    if op is ReduceOp.AVG:
        np.divide(output, n, out=output)


def all_to_all_pairwise(ex: Exchange, output: np.ndarray, input: np.ndarray,
                        output_splits: Sequence[int], input_splits: Sequence[int]) -> None:
    """Exchange slice j of `input` with every rank j: all receives posted, then all sends."""
    n, rank = ex.size, ex.rank
    out_at = np.concatenate(([0], np.cumsum(output_splits))).astype(int)
    in_at = np.concatenate(([0], np.cumsum(input_splits))).astype(int)
    pending = [ex.post((rank - k) % n, 0, output[out_at[(rank - k) % n]:
                                                  out_at[(rank - k) % n + 1]])
               for k in range(1, n)]
    for k in range(1, n):
        peer = (rank + k) % n
        ex.send(peer, 0, input[in_at[peer]:in_at[peer + 1]])
    output[out_at[rank]:out_at[rank + 1]] = input[in_at[rank]:in_at[rank + 1]]
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
