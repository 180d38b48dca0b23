"""The rooted copies of the shared-memory engine: gather and scatter, even or with a size
per rank (gather_v, scatter_v, whose sizes only the root knows).

`RootedOps` is mixed into `IntraNode` and uses its synchronisation (`_arrive`, `_finish`,
and its counters' `settle` where no completion barrier ends the call) and transfers
(`_fetch`, `_is_inline`). One rule orders the waits: a rank whose array a
peer reads (a non-root's input in gather, the root's in scatter) returns only once the
reader has raised its completion counter, unless its payload went inline into its slot
(then nobody waits). In the even calls every rank knows every size and takes the same
decision from its own; in the v-calls the sizes differ, so the reader decides from the
owner's published inline flag and every rank agrees without knowing the others' sizes.

A v-call's signature leaves the count out, so the sizes are checked here, before any
byte is read: each gather_v sender publishes its size in its slot and the root compares
it with its own slot for that rank; scatter_v's root publishes where every piece starts
and each receiver compares its piece with its array. A mismatch raises on the rank that
sees it, and the abort it causes wakes the ranks waiting for that rank.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from itertools import accumulate

import numpy as np

from ....errors import DistBackendError
from ..protocol import Call

__all__ = ["RootedOps"]

_COUNT = struct.Struct("=q")  # a gather_v sender's size, in its slot's offsets area
_PIECE = struct.Struct("=2q")  # the start and end of one scatter_v piece in the root's


class RootedOps:
    """gather, scatter, gather_v and scatter_v, for `IntraNode`."""

    def gather(self, call: Call, output: np.ndarray | None, input: np.ndarray, root: int) -> None:
        seq = call.seq
        m = input.size
        inline = input.nbytes <= self.inline_max
        self._arrive(call, input.ctypes.data, inline=input if inline else None)
        if self.rank == root:
            assert output is not None
            output[root * m : (root + 1) * m] = input
            for peer in self._others():
                self._fetch(seq, peer, output[peer * m : (peer + 1) * m], 0)
        if inline:
            self._sync.settle(call)
        else:
            self._finish(call, [root] if self.rank != root else ())

    def scatter(self, call: Call, output: np.ndarray, input: np.ndarray | None, root: int) -> None:
        seq = call.seq
        m = output.size
        inline = m * self.size * output.itemsize <= self.inline_max
        if self.rank == root:
            assert input is not None
            self._arrive(call, input.ctypes.data, inline=input if inline else None)
            output[...] = input[root * m : (root + 1) * m]
        else:
            self._arrive(call)
            self._fetch(seq, root, output, self.rank * m * output.itemsize)
        if inline:
            self._sync.settle(call)
        else:
            self._finish(call, self._others() if self.rank == root else ())

    def gather_v(
        self,
        call: Call,
        output: np.ndarray | None,
        input: np.ndarray,
        counts: Sequence[int] | None,
        root: int,
    ) -> None:
        """Rank i's `input` into piece i (counts[i] elements) of `root`'s `output`."""
        seq, rank = call.seq, self.rank
        if rank != root:
            inline = input.nbytes <= self.inline_max
            _COUNT.pack_into(self._mem, self._extra_at[seq & 1][rank], input.size)
            self._arrive(call, input.ctypes.data, inline=input if inline else None)
            if inline:
                self._sync.settle(call)
            else:  # the root reads this rank's array: wait until it has
                self._finish(call, [root])
            return
        self._arrive(call)
        at = [0, *accumulate(counts)]
        output[at[root] : at[root + 1]] = input
        read = False  # whether a peer's array was read (that peer waits for this rank)
        for peer in self._others():
            sent = _COUNT.unpack_from(self._mem, self._extra_at[seq & 1][peer])[0]
            if sent != counts[peer]:
                raise DistBackendError(
                    f"{call.describe}: rank {self.names[peer]} sends {sent} elements, but "
                    f"gather_list[{self.names[peer]}] here has {counts[peer]}; dst's slot "
                    "for each rank must have that rank's tensor's size"
                )
            self._fetch(seq, peer, output[at[peer] : at[peer + 1]], 0)
            read = read or not self._is_inline(seq, peer)
        if read:
            self._finish(call, ())
        else:
            self._sync.settle(call)

    def scatter_v(
        self,
        call: Call,
        output: np.ndarray,
        input: np.ndarray | None,
        counts: Sequence[int] | None,
        root: int,
    ) -> None:
        """Piece i (counts[i] elements) of `root`'s `input` into rank i's `output`."""
        seq, rank = call.seq, self.rank
        if rank == root:
            inline = input.nbytes <= self.inline_max
            at = [0, *accumulate(counts)]
            struct.pack_into(f"={len(at)}q", self._mem, self._extra_at[seq & 1][rank], *at)
            self._arrive(call, input.ctypes.data, inline=input if inline else None)
            output[...] = input[at[root] : at[root + 1]]
            if inline:
                self._sync.settle(call)
            else:  # the peers read this rank's array: wait until they have
                self._finish(call, self._others())
            return
        self._arrive(call)
        start, end = _PIECE.unpack_from(self._mem, self._extra_at[seq & 1][root] + 8 * rank)
        if end - start != output.size:
            raise DistBackendError(
                f"{call.describe}: rank {self.names[root]} sends {end - start} elements to "
                f"this rank, but tensor here has {output.size}; scatter_list[i] on src must "
                "have rank i's tensor's size"
            )
        self._fetch(seq, root, output, start * output.itemsize)
        if self._is_inline(seq, root):
            self._sync.settle(call)
        else:
            self._finish(call, ())
