"""The ways a CPU group's collectives travel, each one object with the same op set.

A `tcp` or `gloo` backend picks its path once, when the group is made, and its runner
calls the path for every collective (`Runner.collective`): each op takes the `Call`
(sequence number, signature, description, deadline) and the arrays, moves the bytes and
returns once this rank's part is done; `diagnose(seq)` says why collective `seq` is late.

- `TcpPath`: the algorithms of `algorithms.py` over TCP (the fabric), among all ranks.
- `shm.IntraNode` (the gloo backend's when every rank shares one host): the same op set
  over shared memory.
- `HierPath` (gloo's when the group spans hosts and some share one): all_reduce, reduce,
  broadcast and barrier run in shared memory within each host and over TCP between one
  rank per host; the other ops (gather_v and scatter_v too) take the TCP path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...ops import ReduceOp, finish_average, reduces_as
from . import algorithms as algo
from .protocol import Call
from .scratch import ScratchPool
from .shm import HostLayout, IntraNode
from .transport.exchange import Exchange, SubExchange, diagnose
from .transport.tcp import TcpTransport

__all__ = ["HierPath", "TcpPath"]

#: the scratch slot of a reduce's host representative (the algorithms use slots 0 and 1)
_HOST_COPY_SLOT = 8


class TcpPath:
    """Every collective over TCP with the algorithms `tuning` picks."""

    name = "tcp"

    def __init__(self, transport: TcpTransport, tuning: algo.Tuning, scratch: ScratchPool) -> None:
        self.transport, self.tuning, self.scratch = transport, tuning, scratch
        self._open: Exchange | None = None  # the running collective's (see close_call)

    def open(self, call: Call, ranks: list[int] | None = None) -> Exchange:
        """Begin `call` among `ranks` (default: the whole group): record it in the mailbox,
        so that early and late messages are checked against it, and announce its signature."""
        if ranks is None:
            ex = Exchange(
                self.transport, call.seq, call.signature, call.deadline, call.describe, self.scratch
            )
        else:
            ex = SubExchange(
                self.transport,
                call.seq,
                call.signature,
                call.deadline,
                call.describe,
                self.scratch,
                ranks,
            )
        self.transport.mailbox.begin_collective(call.seq, call.signature)
        ex.announce()
        self._open = ex
        return ex

    def close_call(self, call: Call) -> None:
        """End `call`: its signature goes out if no message took it along yet; messages
        still queued for it are a mismatch."""
        ex, self._open = self._open, None
        if ex is not None and ex.seq == call.seq:
            ex.flush()
        self.transport.mailbox.finish_collective(call.seq, call.signature)

    def diagnose(self, seq: int) -> str:
        return diagnose(self.transport, seq)

    def broadcast(self, call: Call, array: Any, root: int) -> None:
        algo.broadcast(self.open(call), array, root, self.tuning)
        self.close_call(call)

    def all_reduce(self, call: Call, array: Any, op: ReduceOp) -> None:
        algo.all_reduce(self.open(call), array, op, self.tuning)
        self.close_call(call)

    def reduce(self, call: Call, array: Any, root: int, op: ReduceOp) -> None:
        algo.reduce(self.open(call), array, root, op, self.tuning)
        self.close_call(call)

    def all_gather(self, call: Call, output: Any, input: Any) -> None:
        algo.all_gather(self.open(call), output, input, self.tuning)
        self.close_call(call)

    def gather(self, call: Call, output: Any | None, input: Any, root: int) -> None:
        algo.gather(self.open(call), output, input, root, self.tuning)
        self.close_call(call)

    def scatter(self, call: Call, output: Any, input: Any | None, root: int) -> None:
        algo.scatter(self.open(call), output, input, root, self.tuning)
        self.close_call(call)

    # gather_v and scatter_v are always flat, whatever `tuning` picks for gather and
    # scatter: a binomial tree's inner ranks forward their subtree's pieces, whose sizes
    # only the root knows. `counts` is the root's (None elsewhere).

    def gather_v(
        self, call: Call, output: Any | None, input: Any, counts: Sequence[int] | None, root: int
    ) -> None:
        algo.gather_flat(self.open(call), output, input, root, counts)
        self.close_call(call)

    def scatter_v(
        self, call: Call, output: Any, input: Any | None, counts: Sequence[int] | None, root: int
    ) -> None:
        algo.scatter_flat(self.open(call), output, input, root, counts)
        self.close_call(call)

    def reduce_scatter(self, call: Call, output: Any, input: Any, op: ReduceOp) -> None:
        algo.reduce_scatter(self.open(call), output, input, op, self.tuning)
        self.close_call(call)

    def all_to_all(
        self,
        call: Call,
        output: Any,
        input: Any,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
    ) -> None:
        algo.all_to_all(self.open(call), output, input, output_splits, input_splits, self.tuning)
        self.close_call(call)

    def barrier(self, call: Call) -> None:
        algo.barrier(self.open(call), self.tuning)
        self.close_call(call)

    def close(self) -> None:
        """Nothing of its own to release: the backend closes the transport."""


class HierPath:
    """A group spanning hosts: shared memory within each host, TCP between them.

    all_reduce, reduce, broadcast and barrier are hierarchical: this host's ranks combine
    in shared memory, one rank per host (its representative) runs the TCP algorithm among
    the representatives, and the host's ranks share the result. The other ops run over
    TCP among all ranks (`tcp`).

    The engine numbers its own steps (`_host_seq`): a hierarchical all_reduce is two
    engine steps, and the ops over TCP none, while the engine's slots are reused by
    alternating consecutive numbers.

    Args:
        tcp: the group's TCP path.
        engine: this host's engine; None when this rank is alone on its host.
        layout: which ranks share which host.
        rank, size: this rank's group rank and the group's size.
    """

    name = "shm+tcp"

    def __init__(
        self, tcp: TcpPath, engine: IntraNode | None, layout: HostLayout, rank: int, size: int
    ) -> None:
        self.tcp, self.engine, self.layout = tcp, engine, layout
        self.rank, self.size = rank, size
        self._host_seq = 0
        # the ops without a hierarchical algorithm
        self.all_gather = tcp.all_gather
        self.gather = tcp.gather
        self.scatter = tcp.scatter
        self.gather_v = tcp.gather_v
        self.scatter_v = tcp.scatter_v
        self.reduce_scatter = tcp.reduce_scatter
        self.all_to_all = tcp.all_to_all
        self.diagnose = tcp.diagnose

    # -- the two levels ----------------------------------------------------------------------

    def _begin(self, call: Call) -> Call:
        """Record the group collective `call` in the mailbox, also on ranks that take part
        only in this host's steps: a late collective is then explained the same way
        wherever it times out, by the peers' answers to a progress query, in the group's
        ranks and collective numbers rather than this host's steps. Returns the call as
        this host's engine steps see it."""
        self.tcp.transport.mailbox.begin_collective(call.seq, call.signature)
        return call._replace(explain=lambda: self.tcp.diagnose(call.seq))

    def _host_call(self, call: Call) -> Call | None:
        """The engine's next step of `call`; None when this rank is alone on its host."""
        if self.engine is None:
            return None
        seq = self._host_seq
        self._host_seq += 1
        return call._replace(seq=seq)

    def _reps(self, root: int | None = None) -> list[int]:
        """One rank per host: `root` on its host, the lowest rank on the others."""
        return [root if root in members else members[0] for members in self.layout.hosts]

    def _my_rep(self, reps: list[int]) -> int:
        return next(r for r in reps if r in self.layout.local)

    def _between_hosts(self, call: Call, reps: list[int]) -> Exchange | None:
        """Begin `call`'s TCP step among `reps`; None if this rank is not one of them."""
        return self.tcp.open(call, reps) if self.rank in reps else None

    # -- the hierarchical ops ----------------------------------------------------------------

    def all_reduce(self, call: Call, array: Any, op: ReduceOp) -> None:
        plain = reduces_as(op)
        reps = self._reps()
        host = self._begin(call)
        step = self._host_call(host)
        if step is not None:
            self.engine.reduce(step, array, 0, plain)
        ex = self._between_hosts(call, reps)
        if ex is not None:
            algo.all_reduce(ex, array, plain, self.tcp.tuning)
            self.tcp.close_call(call)
        step = self._host_call(host)
        if step is not None:
            self.engine.broadcast(step, array, 0)
        finish_average(array, op, self.size)
        self.tcp.close_call(call)

    def broadcast(self, call: Call, array: Any, root: int) -> None:
        reps = self._reps(root)
        mine = self.layout.local.index(self._my_rep(reps))
        host = self._begin(call)
        ex = self._between_hosts(call, reps)
        if ex is not None:
            algo.broadcast(ex, array, reps.index(root), self.tcp.tuning)
            self.tcp.close_call(call)
        step = self._host_call(host)
        if step is not None:
            self.engine.broadcast(step, array, mine)
        self.tcp.close_call(call)

    def reduce(self, call: Call, array: Any, root: int, op: ReduceOp) -> None:
        plain = reduces_as(op)
        reps = self._reps(root)
        rep = self._my_rep(reps)
        mine = self.layout.local.index(rep)
        host = self._begin(call)
        target = array
        if self.rank == rep and rep != root:  # a non-root input must stay unchanged
            target = self.tcp.scratch.get(_HOST_COPY_SLOT, array.size, array.dtype)
            target[...] = array
        step = self._host_call(host)
        if step is not None:
            self.engine.reduce(step, target, mine, plain)
        ex = self._between_hosts(call, reps)
        if ex is not None:
            algo.reduce(ex, target, reps.index(root), plain, self.tcp.tuning)
            self.tcp.close_call(call)
        if self.rank == root:
            finish_average(array, op, self.size)
        self.tcp.close_call(call)

    def barrier(self, call: Call) -> None:
        reps = self._reps()
        host = self._begin(call)
        step = self._host_call(host)
        if step is not None:
            self.engine.barrier(step)
        ex = self._between_hosts(call, reps)
        if ex is not None:
            algo.barrier(ex, self.tcp.tuning)
            self.tcp.close_call(call)
        step = self._host_call(host)
        if step is not None:
            self.engine.barrier(step)
        self.tcp.close_call(call)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
