"""The `mpi` backend's uneven collectives: MPI's v-calls (a mixin of `mpi.MpiBackend`).

`distcomm.uneven` asks a backend for them and, where it has none, runs them on the even
op set; MPI has them all: `Allgatherv`, `Gatherv` and `Scatterv` take one count per rank
(the root's only, for the last two: the other ranks pass their own buffer), and
`Reduce_scatter` takes every rank's result count (`recvcounts`). Each runs as the even
ops do, through the backend's `_run` (in issue order, under the watchdog).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

from ..ops import ReduceOp
from ..work import Work

__all__ = ["MpiUneven"]


class MpiUneven:
    """MPI's v-calls on the backend's communicator (a mixin of `mpi.MpiBackend`, whose
    `_comm`, `_buf`, `_op`, `_averaged` and `_run` it uses)."""

    rank: int
    _comm: Any
    _buf: Callable[[Any], list[Any]]
    _op: Callable[[ReduceOp, Any], Any]
    _averaged: Callable[[ReduceOp, Any], Callable[[], None] | None]
    _run: Callable[..., Work]

    def _counted(self, array: Any, counts: Sequence[int]) -> list[Any]:
        """`array` as an MPI vector buffer: [array, (counts, displacements), datatype]."""
        sizes = [int(c) for c in counts]
        return [array, (sizes, list(accumulate(sizes[:-1], initial=0))), self._buf(array)[1]]

    def all_gather_v(
        self, output: Any, input: Any, counts: Sequence[int], *, async_op: bool = False
    ) -> Work:
        comm, send, recv = self._comm, self._buf(input), self._counted(output, counts)
        return self._run("all_gather_v", lambda: comm.Allgatherv(send, recv), [output], async_op)

    def gather_v(
        self,
        output: Any | None,
        input: Any,
        counts: Sequence[int] | None,
        root: int,
        *,
        async_op: bool = False,
    ) -> Work:
        comm, send = self._comm, self._buf(input)
        recv = self._counted(output, counts) if self.rank == root else None  # type: ignore[arg-type]
        outputs = [output] if output is not None else []
        return self._run("gather_v", lambda: comm.Gatherv(send, recv, root), outputs, async_op)

    def scatter_v(
        self,
        output: Any,
        input: Any | None,
        counts: Sequence[int] | None,
        root: int,
        *,
        async_op: bool = False,
    ) -> Work:
        comm, recv = self._comm, self._buf(output)
        send = self._counted(input, counts) if self.rank == root else None  # type: ignore[arg-type]
        return self._run("scatter_v", lambda: comm.Scatterv(send, recv, root), [output], async_op)

    def reduce_scatter_v(
        self,
        output: Any,
        input: Any,
        counts: Sequence[int],
        op: ReduceOp,
        *,
        async_op: bool = False,
    ) -> Work:
        comm, send, recv = self._comm, self._buf(input), self._buf(output)
        mop, sizes = self._op(op, output.dtype), [int(c) for c in counts]
        return self._run(
            "reduce_scatter_v",
            lambda: comm.Reduce_scatter(send, recv, sizes, mop),
            [output],
            async_op,
            self._averaged(op, output),
        )
