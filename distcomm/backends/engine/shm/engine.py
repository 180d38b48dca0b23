"""Collectives among the ranks of one host: single-copy algorithms over shared memory.

Every collective starts with one synchronisation: each rank writes its signature and
the addresses of its arrays (or, for small payloads, the payload itself) into its slot
of the shared segment, raises its arrival counter, and waits for every peer's. Then every
rank checks every peer's signature, so a mismatch is reported by all ranks at once.

Small payloads (up to `inline_max` bytes) are read from the peers' slots; every rank
reduces them itself, in rank order, so all ranks end bit-identical. Larger ones move by
cross-memory reads between the ranks' own arrays: for the reductions each rank owns a
contiguous slice, reads that slice of every peer's input, reduces it chunk by chunk
(chunks stay in cache) into its own memory, and once every owner is done each rank reads
the other owners' reduced slices. The ranks whose memory others read then wait at a
completion barrier before returning.

A rank only ever reads a peer's memory; it writes only its own. A rank that gives up on
the group (its wait timed out, the group was aborted here or elsewhere) marks the segment
before its caller gets its arrays back, and every rank checks that mark after each wait
and after its last read: a collective whose check passed read every peer's arrays while
they were still held for it, and one that finds the mark fails. So a rank frozen inside
a collective (SIGSTOP, swap, a debugger) and woken after the others evicted it can
neither write into the memory they have reused nor return success.

Slots come in two generations (by sequence parity). A rank reuses a slot two collectives
later, after every peer has arrived at the collective in between, that is after every
peer has finished reading it.

The small-message path allocates nothing per call: the slots' offsets, the counters and
the payload views are computed when the group is made, metadata is packed with `struct`
straight into the segment, and signatures are compared as bytes (decoded only for the
error message). The counters, the waits on them and the abandon mark are `counters`'.
"""

from __future__ import annotations

import logging
import struct
import sys
import threading
from collections.abc import Sequence

import numpy as np

from ....errors import DistBackendError
from ....ops import UFUNCS, ReduceOp, average_into, quiet, reduce_into
from ....parallel import parallel_for
from ..protocol import Call, Signature, mismatch_message
from ..scratch import ScratchPool
from .counters import Counters, FailureWatch
from .primitives import Segment, cma_read
from .rooted import RootedOps

__all__ = ["IntraNode"]

log = logging.getLogger(__name__)

_AVG = ReduceOp.AVG  # a module global: faster to reach than the enum's attribute
_META = 64  # per-slot header: op, dtype, redop, root, count, in, out, flags (int64)
_META_FORMAT = struct.Struct("=8q")
_SIGNATURE_BYTES = 5 * 8  # the first five fields: the collective's Signature
_IN, _OUT, _FLAGS = 5, 6, 7
_INLINE = 1
_FLAGS_LOW_BYTE = 8 * _FLAGS + (0 if sys.byteorder == "little" else 7)
#: reads of at least this many bytes are split over the intra-op threads
_THREADED_MIN = 4 * 1024 * 1024


def _u8(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


def _bounds(count: int, parts: int) -> list[int]:
    return [count * i // parts for i in range(parts + 1)]


class IntraNode(RootedOps):
    """Collectives among all ranks of a group that share one host.

    Args:
        segment, pids: from `same_host_setup`.
        rank, size: this rank's index among the host's ranks, and their number.
        names: the group ranks of the host's ranks (for messages); group_size: the group's.
        watch: reports the group's failures (the TCP mailbox); they interrupt waits here.
        inline_max: payloads up to this many bytes travel inline in the segment.
        chunk: bytes reduced per step of a large reduction.
    """

    def __init__(
        self,
        segment: Segment,
        pids: list[int],
        rank: int,
        size: int,
        names: list[int],
        group_size: int,
        watch: FailureWatch,
        inline_max: int,
        chunk: int,
    ) -> None:
        self.rank, self.size = rank, size
        self.names, self.group_size = names, group_size
        self.inline_max, self.chunk = min(inline_max, self.INLINE_MAX), chunk
        self._segment, self._pids, self._watch = segment, pids, watch
        # the layout, fixed by the group size, and views of it made once
        self._slots_at = self.slots_offset(size)
        self._header = self._header_bytes(size)
        self._stride = self._header + self.INLINE_MAX
        self._mem = memoryview(segment.bytes)  # the whole segment, bytes
        self._sync = Counters(segment, rank, size, names, watch)
        self._slot_at = [[self._slot_offset(g, r) for r in range(size)] for g in (0, 1)]
        # each slot's area after the metadata: all_to_all's offsets, gather_v's sizes
        self._extra_at = [[at + _META for at in slots] for slots in self._slot_at]
        self._payloads = [
            [segment.bytes[at + self._header : at + self._header + self.INLINE_MAX] for at in slots]
            for slots in self._slot_at
        ]
        self._typed: dict[np.dtype, list[list[np.ndarray]]] = {}  # _payloads as a dtype
        self._local = threading.local()
        self._pool = ScratchPool()  # a non-root owner's partial result in `reduce`

    # -- layout ----------------------------------------------------------------------------

    #: how `GlooBackend.transport` names this path
    name = "shm"
    #: the most `inline_max` may be (every slot has room for it)
    INLINE_MAX = 64 * 1024

    @staticmethod
    def _header_bytes(size: int) -> int:
        return -(-(_META + 8 * (size + 1)) // 64) * 64

    @staticmethod
    def slots_offset(size: int) -> int:
        return -(-Counters.area_bytes(size) // 4096) * 4096

    @classmethod
    def segment_bytes(cls, size: int) -> int:
        return cls.slots_offset(size) + 2 * size * (cls._header_bytes(size) + cls.INLINE_MAX)

    def _slot_offset(self, generation: int, rank: int) -> int:
        return self._slots_at + (generation * self.size + rank) * self._stride

    def _meta(self, seq: int, rank: int) -> np.ndarray:
        at = self._slot_at[seq & 1][rank]
        return self._segment.bytes[at : at + _META].view(np.int64)

    def _offsets(self, seq: int, rank: int) -> np.ndarray:
        at = self._slot_at[seq & 1][rank] + _META
        return self._segment.bytes[at : at + 8 * (self.size + 1)].view(np.int64)

    def _inline_views(self, seq: int, dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's inline payload area for collective `seq`, as `dtype` arrays."""
        views = self._typed.get(dtype)
        if views is None:
            views = self._typed[dtype] = [[p.view(dtype) for p in g] for g in self._payloads]
        return views[seq & 1]

    # -- synchronisation -------------------------------------------------------------------

    def _arrive(
        self,
        call: Call,
        in_addr: int = 0,
        out_addr: int = 0,
        inline: np.ndarray | None = None,
        offsets: Sequence[int] | None = None,
    ) -> None:
        """Publish this rank's part of the collective, wait for every peer's, compare.

        `inline`: the payload the peers read from this rank's slot, if any.
        """
        seq, signature, rank, mem = call.seq, call.signature, self.rank, self._mem
        slots = self._slot_at[seq & 1]
        at = slots[rank]
        _META_FORMAT.pack_into(
            mem,
            at,
            signature.op,
            signature.dtype,
            signature.redop,
            signature.root,
            signature.count,
            in_addr,
            out_addr,
            _INLINE if inline is not None else 0,
        )
        if inline is not None:
            self._inline_views(seq, inline.dtype)[rank][: inline.size] = inline
        if offsets is not None:
            self._offsets(seq, rank)[:] = offsets
        sync = self._sync
        sync.set(sync.arrive_at[rank], seq + 1)
        mine = mem[at : at + _SIGNATURE_BYTES]
        for peer in range(self.size):
            if peer != rank:
                sync.wait(call, sync.arrive_at[peer], seq + 1, peer, "arrive")
        for peer in range(self.size):
            theirs_at = slots[peer]
            if peer != rank and mem[theirs_at : theirs_at + _SIGNATURE_BYTES] != mine:
                theirs = Signature(*(int(v) for v in self._meta(seq, peer)[:5]))
                if theirs != signature:
                    raise DistBackendError(
                        mismatch_message(
                            self.names[self.rank],
                            self.group_size,
                            seq,
                            signature,
                            self.names[peer],
                            theirs,
                        )
                    )

    def _finish(self, call: Call, wait_for: Sequence[int]) -> None:
        """Mark this rank done with the collective's arrays; wait until `wait_for` are too;
        then `Counters.settle`."""
        seq, sync = call.seq, self._sync
        sync.set(sync.finish_at[self.rank], seq + 1)
        for peer in wait_for:
            if peer != self.rank:
                sync.wait(call, sync.finish_at[peer], seq + 1, peer, "finish")
        sync.settle(call)

    def _reduced(self, call: Call) -> None:
        """Say this rank's slice of a reduction is reduced (and that it reads no peer's
        input any more)."""
        sync = self._sync
        sync.set(sync.reduced_at[self.rank], call.seq + 1)

    def _gather_reduced(self, call: Call, buf: np.ndarray, bounds: list[int]) -> None:
        """Read every other owner's reduced slice into `buf`, each once its owner said it
        is reduced: that owner has read this rank's input too, so its part of `buf` may
        be overwritten (a slow owner holds up only its own slice)."""
        seq, sync = call.seq, self._sync
        for peer in self._others():
            sync.wait(call, sync.reduced_at[peer], seq + 1, peer, "reduced")
            self._fetch(seq, peer, buf[bounds[peer] : bounds[peer + 1]], 0, _OUT)

    def diagnose(self, seq: int) -> str:
        """Why collective `seq` has not completed: the peers that have not reached it."""
        return self._sync.diagnose(seq)

    def _others(self) -> list[int]:
        return [p for p in range(self.size) if p != self.rank]

    # -- data movement ---------------------------------------------------------------------

    def _is_inline(self, seq: int, peer: int) -> bool:
        return bool(self._mem[self._slot_at[seq & 1][peer] + _FLAGS_LOW_BYTE] & _INLINE)

    def _fetch(self, seq: int, peer: int, dst: np.ndarray, offset: int, field: int = _IN) -> None:
        """Copy `dst.nbytes` bytes of `peer`'s published input (`field` _OUT: the array it
        published as its output), from byte `offset`, to `dst`."""
        nbytes = dst.nbytes
        if not nbytes:
            return
        if field == _IN and self._is_inline(seq, peer):
            start = offset // dst.itemsize
            dst[...] = self._inline_views(seq, dst.dtype)[peer][start : start + dst.size]
            return
        pid, src, base = self._pids[peer], int(self._meta(seq, peer)[field]) + offset, _u8(dst)
        if nbytes < _THREADED_MIN:
            cma_read(pid, base.ctypes.data, src, nbytes)
        else:
            parallel_for(
                nbytes,
                lambda a, b: cma_read(pid, base.ctypes.data + a, src + a, b - a),
                min_chunk=_THREADED_MIN // 2,
            )

    def _scratch(self, nbytes: int) -> np.ndarray:
        """This thread's chunk buffer (the intra-op threads reduce side by side)."""
        pool = getattr(self._local, "pool", None)
        if pool is None:
            pool = self._local.pool = ScratchPool()
        return pool.get(0, nbytes, np.uint8)

    def _owner_reduce(
        self, seq: int, acc: np.ndarray, own: np.ndarray, base: int, op: ReduceOp, divide: bool
    ) -> None:
        """acc <- own (op) every peer's input from byte `base` on (`acc` is this rank's own
        memory, the same length as `own`; nothing is written anywhere else)."""
        isz = acc.itemsize
        step = max(1, self.chunk // isz)
        peers = self._others()
        pids = self._pids
        sources = {p: int(self._meta(seq, p)[_IN]) + base for p in peers}

        def run(start: int, stop: int) -> None:
            scratch = self._scratch(min(step, stop - start) * isz).view(acc.dtype)
            for lo in range(start, stop, step):
                hi = min(lo + step, stop)
                part = acc[lo:hi]
                if part.ctypes.data != own.ctypes.data + lo * isz:
                    part[...] = own[lo:hi]
                incoming = scratch[: hi - lo]
                for p in peers:
                    cma_read(pids[p], incoming.ctypes.data, sources[p] + lo * isz, incoming.nbytes)
                    reduce_into(part, incoming, op)
                if divide:
                    average_into(part, self.size)

        if acc.nbytes < _THREADED_MIN:
            if acc.size:
                run(0, acc.size)
        else:
            parallel_for(acc.size, run, min_chunk=max(step, _THREADED_MIN // 2 // isz))

    def _reduce_inline(
        self, seq: int, out: np.ndarray, start: int, op: ReduceOp, divide: bool
    ) -> None:
        """out <- every rank's inline payload from element `start`, reduced in rank order
        (and divided by the group size if `divide`)."""
        views, stop = self._inline_views(seq, out.dtype), start + out.size
        if self.size == 1:
            out[...] = views[0][start:stop]
            return
        run, ufunc = quiet.run, UFUNCS[op]  # numpy's warnings off (see ops.quiet)
        run(ufunc, views[0][start:stop], views[1][start:stop], out=out)
        for peer in range(2, self.size):
            run(ufunc, out, views[peer][start:stop], out=out)
        if divide:
            average_into(out, self.size)

    # -- the collectives -------------------------------------------------------------------

    def all_reduce(self, call: Call, buf: np.ndarray, op: ReduceOp) -> None:
        self._reduction(call, buf, op, None)

    def reduce(self, call: Call, buf: np.ndarray, root: int, op: ReduceOp) -> None:
        self._reduction(call, buf, op, root)

    def _reduction(self, call: Call, buf: np.ndarray, op: ReduceOp, root: int | None) -> None:
        """Reduce every rank's `buf` into `root`'s (None: into every rank's).

        Each rank reduces its own slice of every rank's input into its own memory (its
        `buf`, or scratch on a non-root, whose input stays as it was) and publishes where;
        once every owner has, the ranks that get the result read the others' slices.
        """
        seq = call.seq
        avg = op is _AVG
        gets_result = root is None or self.rank == root
        if buf.nbytes <= self.inline_max:
            self._arrive(call, inline=buf)
            if gets_result:
                self._reduce_inline(seq, buf, 0, op, avg)
            self._sync.settle(call)
            return
        bounds = _bounds(buf.size, self.size)
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        acc = buf[lo:hi] if gets_result else self._pool.get(0, hi - lo, buf.dtype)
        self._arrive(call, buf.ctypes.data, acc.ctypes.data)  # output: the reduced slice
        self._owner_reduce(seq, acc, buf[lo:hi], lo * buf.itemsize, op, avg)
        if not gets_result:  # root reads the slice: keep it (and the input) until it has
            self._reduced(call)
            self._finish(call, [root])
            return
        self._reduced(call)
        self._gather_reduced(call, buf, bounds)
        # this rank's slice is read until the peers have finished (a root's by nobody)
        self._finish(call, range(self.size) if root is None else ())

    def broadcast(self, call: Call, buf: np.ndarray, root: int) -> None:
        seq = call.seq
        is_root = self.rank == root
        if buf.nbytes <= self.inline_max:
            self._arrive(call, inline=buf if is_root else None)
            if not is_root:
                self._fetch(seq, root, buf, 0)
            self._sync.settle(call)
            return
        self._arrive(call, buf.ctypes.data if is_root else 0)
        if not is_root:
            self._fetch(seq, root, buf, 0)
        self._finish(call, self._others() if is_root else ())

    def all_gather(self, call: Call, output: np.ndarray, input: np.ndarray) -> None:
        seq = call.seq
        m = input.size
        inline = input.nbytes <= self.inline_max
        self._arrive(call, input.ctypes.data, inline=input if inline else None)
        mine = output[self.rank * m : (self.rank + 1) * m]
        if mine.ctypes.data != input.ctypes.data:
            mine[...] = input
        for peer in self._others():
            self._fetch(seq, peer, output[peer * m : (peer + 1) * m], 0)
        if inline:
            self._sync.settle(call)
        else:
            self._finish(call, range(self.size))

    def reduce_scatter(
        self, call: Call, output: np.ndarray, input: np.ndarray, op: ReduceOp
    ) -> None:
        seq = call.seq
        m, r = output.size, self.rank
        avg = op is _AVG
        if input.nbytes <= self.inline_max:
            self._arrive(call, inline=input)
            self._reduce_inline(seq, output, r * m, op, avg)
            self._sync.settle(call)
            return
        self._arrive(call, input.ctypes.data)
        self._owner_reduce(
            seq, output, input[r * m : (r + 1) * m], r * m * output.itemsize, op, avg
        )
        self._finish(call, range(self.size))

    def all_to_all(
        self,
        call: Call,
        output: np.ndarray,
        input: np.ndarray,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
    ) -> None:
        seq = call.seq
        offsets = np.concatenate(([0], np.cumsum(input_splits, dtype=np.int64)))
        inline = input.nbytes <= self.inline_max
        self._arrive(call, input.ctypes.data, inline=input if inline else None, offsets=offsets)
        out_at = np.concatenate(([0], np.cumsum(output_splits, dtype=np.int64)))
        isz = output.itemsize
        for peer in range(self.size):
            theirs = self._offsets(seq, peer)
            start, count = int(theirs[self.rank]), int(theirs[self.rank + 1] - theirs[self.rank])
            expected = int(out_at[peer + 1] - out_at[peer])
            if count != expected:
                raise DistBackendError(
                    f"[rank {self.names[self.rank]}/{self.group_size}] all_to_all #{seq}: rank "
                    f"{self.names[peer]} sends "
                    f"{count} elements to this rank, but output_split_sizes[{peer}] here is "
                    f"{expected}; every rank's input split for rank j must equal rank j's "
                    "output split for it"
                )
            target = output[out_at[peer] : out_at[peer + 1]]
            if peer == self.rank:
                target[...] = input[start : start + count]
            else:
                self._fetch(seq, peer, target, start * isz)
        if all(self._is_inline(seq, peer) for peer in range(self.size)):
            self._sync.settle(call)
        else:
            self._finish(call, range(self.size))

    def barrier(self, call: Call) -> None:
        self._arrive(call)
        self._sync.settle(call)

    # -- lifecycle -------------------------------------------------------------------------

    def release_views(self) -> None:
        """Let go of every view of the segment (they keep it mapped)."""
        self._sync.release()
        self._mem.release()
        self._payloads, self._typed = [], {}

    def close(self) -> None:
        """Leave: say so in the segment (peers waiting for this rank fail at once, naming
        it), then unmap it."""
        self._sync.leave()
        self.release_views()
        self._segment.close()
