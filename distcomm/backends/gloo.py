"""The `gloo` backend: the fast CPU path.

The same engine as `tcp` (TCP mesh, mailbox, algorithms) with the tuned algorithm
table. When every rank of the group shares this host, collectives run over shared
memory instead (`intranode.py`: one synchronisation per collective and single-copy
transfers between the ranks' arrays). When the group spans hosts, all_reduce, reduce,
broadcast and barrier are hierarchical: shared memory within each host, TCP between one
rank per host; the other collectives use TCP between all ranks. Point-to-point messages
and the failure signals always use the TCP connections. `DISTCOMM_GLOO_TRANSPORT=tcp`
forces TCP for everything.

CuPy arrays are staged through pinned host memory (copied in, reduced on the CPU,
copied back), as the original gloo did for CUDA tensors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..deadline import Deadline
from ..gpu.staging import is_cupy_array
from ..ops import ReduceOp
from ..store.base import Store
from ..work import Work
from . import algorithms as algo
from .intranode import HostLayout, IntraNode, same_host_setup
from .protocol import OP_CODES, Signature
from .tcp import TcpBackend
from .transport.exchange import Exchange, diagnose

__all__ = ["GlooBackend", "transport_mode"]

log = logging.getLogger(__name__)

_MODES = ("auto", "tcp")
#: the scratch slot of a reduce's host representative (the algorithms use slots 0 and 1)
_HOST_COPY_SLOT = 8


def transport_mode(environ: Any = os.environ) -> str:
    """DISTCOMM_GLOO_TRANSPORT: "auto" (shared memory on one host, default) or "tcp".

    Raises:
        ValueError: another value.
    """
    mode = environ.get("DISTCOMM_GLOO_TRANSPORT", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(
            f"DISTCOMM_GLOO_TRANSPORT={mode!r} is not valid: use 'auto' (shared memory between "
            "ranks on one host, TCP otherwise) or 'tcp' (TCP for everything)"
        )
    return mode


class GlooBackend(TcpBackend):
    """Fast CPU backend: tuned algorithms, shared memory within a host, TCP across hosts."""

    name = "gloo"
    devices = ("cpu", "cuda")
    stages_device_arrays = True
    tuning_preset = algo.Tuning.tuned()

    def __init__(
        self, store: Store, rank: int, size: int, timeout: float, group_name: str = ""
    ) -> None:
        mode = transport_mode()
        super().__init__(store, rank, size, timeout, group_name)
        self._layout: HostLayout | None = None
        self._engine: IntraNode | None = None  # this host's, when it has other ranks
        self._local_seq = 0  # the engine's own count (across hosts not every op uses it)
        if size > 1:
            try:
                self._setup_engine(store, mode)
            except BaseException:
                super().shutdown()
                raise

    def _setup_engine(self, store: Store, mode: str) -> None:
        outcome = same_host_setup(store, self.rank, self.size, Deadline(self.timeout), mode)
        if isinstance(outcome, str):
            log.info("%s: collectives over TCP: %s", self.describe("setup"), outcome)
            return
        self._layout = layout = outcome
        if layout.segment is not None:
            self._engine = IntraNode(
                layout.segment,
                layout.pids,
                layout.local.index(self.rank),
                len(layout.local),
                layout.local,
                self.size,
                self._transport.mailbox,
                inline_max=self.tuning.shm_inline_max,
                chunk=self.tuning.shm_chunk,
            )
        log.info(
            "%s: collectives over %s (hosts: %s)",
            self.describe("setup"),
            self.transport,
            layout.hosts,
        )

    @property
    def transport(self) -> str:
        """How this group's collectives travel: "shm" (one host), "shm+tcp" (shared memory
        within each host, TCP between them) or "tcp"."""
        if self._layout is None:
            return "tcp"
        return "shm" if len(self._layout.hosts) == 1 else "shm+tcp"

    def _on_one_host(self) -> bool:
        return self._layout is not None and len(self._layout.hosts) == 1

    def _across_hosts(self) -> bool:
        return self._layout is not None and len(self._layout.hosts) > 1

    # -- running collectives in shared memory ------------------------------------------------

    def _shm(
        self,
        op: str,
        signature: Signature,
        body: Callable[[int, str, Deadline], None],
        outputs: list[Any],
        async_op: bool,
    ) -> Work:
        """Run `body(seq, describe, deadline)` as collective `seq` of the group."""

        def run(seq: int, describe: str, deadline: Deadline) -> None:
            if not self._across_hosts():
                if self._engine is not None:
                    self._engine.begin(describe, deadline)
                body(seq, describe, deadline)
                return
            # Every rank records the group collective it is in, also those that only take
            # part in this host's steps: a late collective is then explained the same way
            # wherever it times out, by the peers' answers to a progress query (a stopped
            # rank does not answer, one that has not called it says where it is), in the
            # group's ranks and collective numbers rather than this host's steps.
            mailbox = self._transport.mailbox
            mailbox.begin_collective(seq, signature)
            if self._engine is not None:
                self._engine.begin(describe, deadline, lambda: diagnose(self._transport, seq))
            body(seq, describe, deadline)
            mailbox.finish_collective(seq, signature)

        def why(seq: int) -> str:
            if self._on_one_host():
                assert self._engine is not None
                return self._engine.diagnose(seq)
            return diagnose(self._transport, seq)

        return self._run_collective(op, signature, run, outputs, async_op, why)

    def _local(
        self,
        op: str,
        signature: Signature,
        body: Callable[[IntraNode, int, Signature], None],
        outputs: list[Any],
        async_op: bool,
    ) -> Work:
        """A collective of a group on one host: entirely in shared memory."""
        engine = self._engine
        assert engine is not None
        return self._shm(
            op, signature, lambda seq, d, dl: body(engine, seq, signature), outputs, async_op
        )

    # -- groups across hosts: shared memory within each, TCP between one rank of each ----

    def _host_step(self, step: Callable[[IntraNode, int], None]) -> None:
        """Run `step(engine, local_seq)` among this host's ranks (nothing if alone)."""
        if self._engine is not None:
            seq = self._local_seq
            self._local_seq += 1
            step(self._engine, seq)

    def _reps(self, root: int | None = None) -> list[int]:
        """One rank per host: `root` on its host, the lowest rank on the others."""
        assert self._layout is not None
        return [root if root in members else members[0] for members in self._layout.hosts]

    def _my_rep(self, reps: list[int]) -> int:
        assert self._layout is not None
        return next(r for r in reps if r in self._layout.local)

    def _between_hosts(
        self,
        seq: int,
        signature: Signature,
        describe: str,
        deadline: Deadline,
        reps: list[int],
        step: Callable[[Exchange], None],
    ) -> None:
        """Run `step` over TCP among `reps` (this rank takes part only if it is one)."""
        if self.rank in reps:
            self._exchange(seq, signature, describe, deadline, step, reps)

    def _hier_all_reduce(
        self, array: Any, op: ReduceOp, signature: Signature, async_op: bool
    ) -> Work:
        plain = ReduceOp.SUM if op is ReduceOp.AVG else op
        reps = self._reps()

        def body(seq: int, describe: str, deadline: Deadline) -> None:
            self._host_step(lambda e, s: e.reduce(s, signature, array, 0, plain))
            self._between_hosts(
                seq,
                signature,
                describe,
                deadline,
                reps,
                lambda ex: algo.all_reduce(ex, array, plain, self.tuning),
            )
            self._host_step(lambda e, s: e.broadcast(s, signature, array, 0))
            if op is ReduceOp.AVG:
                np.divide(array, self.size, out=array)

        return self._shm("all_reduce", signature, body, [array], async_op)

    def _hier_broadcast(self, array: Any, root: int, signature: Signature, async_op: bool) -> Work:
        reps = self._reps(root)
        assert self._layout is not None
        mine = self._layout.local.index(self._my_rep(reps))

        def body(seq: int, describe: str, deadline: Deadline) -> None:
            self._between_hosts(
                seq,
                signature,
                describe,
                deadline,
                reps,
                lambda ex: algo.broadcast(ex, array, reps.index(root), self.tuning),
            )
            self._host_step(lambda e, s: e.broadcast(s, signature, array, mine))

        return self._shm("broadcast", signature, body, [array], async_op)

    def _hier_reduce(
        self, array: Any, root: int, op: ReduceOp, signature: Signature, async_op: bool
    ) -> Work:
        plain = ReduceOp.SUM if op is ReduceOp.AVG else op
        reps = self._reps(root)
        assert self._layout is not None
        rep = self._my_rep(reps)
        mine = self._layout.local.index(rep)

        def body(seq: int, describe: str, deadline: Deadline) -> None:
            target = array
            if self.rank == rep and rep != root:  # a non-root input must stay unchanged
                target = self._scratch.get(_HOST_COPY_SLOT, array.size, array.dtype)
                target[...] = array
            self._host_step(lambda e, s: e.reduce(s, signature, target, mine, plain))
            self._between_hosts(
                seq,
                signature,
                describe,
                deadline,
                reps,
                lambda ex: algo.reduce(ex, target, reps.index(root), plain, self.tuning),
            )
            if op is ReduceOp.AVG and self.rank == root:
                np.divide(array, self.size, out=array)

        return self._shm("reduce", signature, body, [array], async_op)

    def _hier_barrier(self, signature: Signature, async_op: bool) -> Work:
        reps = self._reps()

        def body(seq: int, describe: str, deadline: Deadline) -> None:
            self._host_step(lambda e, s: e.barrier(s, signature))
            self._between_hosts(
                seq, signature, describe, deadline, reps, lambda ex: algo.barrier(ex, self.tuning)
            )
            self._host_step(lambda e, s: e.barrier(s, signature))

        return self._shm("barrier", signature, body, [], async_op)

    # -- the op set ------------------------------------------------------------------------

    def broadcast(self, array: Any, root: int, *, async_op: bool = False) -> Work:
        signature = Signature.of("broadcast", array, root=root)
        if self._across_hosts():
            return self._hier_broadcast(array, root, signature, async_op)
        if not self._on_one_host():
            return super().broadcast(array, root, async_op=async_op)
        return self._local(
            "broadcast",
            signature,
            lambda e, s, g: e.broadcast(s, g, array, root),
            [array],
            async_op,
        )

    def all_reduce(self, array: Any, op: ReduceOp, *, async_op: bool = False) -> Work:
        signature = Signature.of("all_reduce", array, op)
        if self._across_hosts():
            return self._hier_all_reduce(array, op, signature, async_op)
        if not self._on_one_host():
            return super().all_reduce(array, op, async_op=async_op)
        return self._local(
            "all_reduce",
            signature,
            lambda e, s, g: e.all_reduce(s, g, array, op),
            [array],
            async_op,
        )

    def reduce(self, array: Any, root: int, op: ReduceOp, *, async_op: bool = False) -> Work:
        signature = Signature.of("reduce", array, op, root)
        if self._across_hosts():
            return self._hier_reduce(array, root, op, signature, async_op)
        if not self._on_one_host():
            return super().reduce(array, root, op, async_op=async_op)
        return self._local(
            "reduce", signature, lambda e, s, g: e.reduce(s, g, array, root, op), [array], async_op
        )

    def all_gather(self, output: Any, input: Any, *, async_op: bool = False) -> Work:
        if not self._on_one_host():
            return super().all_gather(output, input, async_op=async_op)
        return self._local(
            "all_gather",
            Signature.of("all_gather", input),
            lambda e, s, g: e.all_gather(s, g, output, input),
            [output],
            async_op,
        )

    def gather(self, output: Any | None, input: Any, root: int, *, async_op: bool = False) -> Work:
        if not self._on_one_host():
            return super().gather(output, input, root, async_op=async_op)
        return self._local(
            "gather",
            Signature.of("gather", input, root=root),
            lambda e, s, g: e.gather(s, g, output, input, root),
            [output] if output is not None else [],
            async_op,
        )

    def scatter(self, output: Any, input: Any | None, root: int, *, async_op: bool = False) -> Work:
        if not self._on_one_host():
            return super().scatter(output, input, root, async_op=async_op)
        return self._local(
            "scatter",
            Signature.of("scatter", output, root=root),
            lambda e, s, g: e.scatter(s, g, output, input, root),
            [output],
            async_op,
        )

    def reduce_scatter(
        self, output: Any, input: Any, op: ReduceOp, *, async_op: bool = False
    ) -> Work:
        if not self._on_one_host():
            return super().reduce_scatter(output, input, op, async_op=async_op)
        return self._local(
            "reduce_scatter",
            Signature.of("reduce_scatter", output, op),
            lambda e, s, g: e.reduce_scatter(s, g, output, input, op),
            [output],
            async_op,
        )

    def all_to_all(
        self,
        output: Any,
        input: Any,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        *,
        async_op: bool = False,
    ) -> Work:
        if not self._on_one_host():
            return super().all_to_all(output, input, output_splits, input_splits, async_op=async_op)
        return self._local(
            "all_to_all",
            Signature.of("all_to_all", input, count=-1),
            lambda e, s, g: e.all_to_all(s, g, output, input, output_splits, input_splits),
            [output],
            async_op,
        )

    def barrier(self, *, async_op: bool = False) -> Work:
        signature = Signature(OP_CODES["barrier"])
        if self._across_hosts():
            return self._hier_barrier(signature, async_op)
        if not self._on_one_host():
            return super().barrier(async_op=async_op)
        return self._local("barrier", signature, lambda e, s, g: e.barrier(s, g), [], async_op)

    def send(self, array: Any, dst: int, tag: int) -> Work:
        self._host_only(array, "send")
        return super().send(array, dst, tag)

    def recv(self, array: Any, src: int | None, tag: int) -> Work:
        self._host_only(array, "recv")
        return super().recv(array, src, tag)

    def _host_only(self, array: Any, op: str) -> None:
        if is_cupy_array(array):
            raise TypeError(
                f"{self.describe(op)}: the gloo backend does not {op} CuPy arrays; copy the "
                "array to the host (array.get()) or use a group with the nccl backend"
            )

    # -- lifecycle -------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        super().shutdown()
        if self._engine is not None:
            self._engine.close()
