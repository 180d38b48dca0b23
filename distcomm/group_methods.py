"""torch's ProcessGroup method API: `pg.allreduce([x], opts)` and the option structs.

Code written against torch's C++ layer calls collectives as methods of a group, with
an options object or with positional root/op/timeout (both of torch's overloads), and
gets a `Work` back (always asynchronous). Each method calls the function of the same
operation in `distcomm.collectives` on this group, so it validates, records and
dispatches exactly as `dist.all_reduce(..., group=pg, async_op=True)` does. Those
functions know only the group's state below them (`handle.GroupHandle`); this mix-in
sits above them, and `process_group.ProcessGroup` joins the two. Roots are
group ranks, as in torch's methods. A tensor list holds one array (torch's list is one
tensor per device, and a process drives one device).

An option's `timeout` (default: none, the group's) bounds the returned Work's `wait()`;
when it expires the group is aborted, as for any collective timeout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .coalesced import all_reduce_coalesced
from .collectives import (
    all_gather,
    all_gather_single,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    irecv,
    isend,
    monitored_barrier,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    scatter,
)
from .ops import ReduceOp

__all__ = [
    "AllToAllOptions",
    "AllgatherOptions",
    "AllreduceCoalescedOptions",
    "AllreduceOptions",
    "BarrierOptions",
    "BroadcastOptions",
    "GatherOptions",
    "GroupMethods",
    "ReduceOptions",
    "ReduceScatterOptions",
    "ScatterOptions",
]

#: torch's kNoTimeout: an option without a timeout of its own
_NO_TIMEOUT = timedelta(milliseconds=-1)


@dataclass
class _Options:  # the fields have torch's names (camelCase)
    timeout: timedelta = _NO_TIMEOUT
    asyncOp: bool = True


@dataclass
class AllreduceOptions(_Options):
    reduceOp: Any = ReduceOp.SUM


@dataclass
class AllreduceCoalescedOptions(AllreduceOptions):
    pass


@dataclass
class BroadcastOptions(_Options):
    rootRank: int = 0
    rootTensor: int = 0


@dataclass
class ReduceOptions(_Options):
    reduceOp: Any = ReduceOp.SUM
    rootRank: int = 0
    rootTensor: int = 0


@dataclass
class AllgatherOptions(_Options):
    pass


@dataclass
class GatherOptions(_Options):
    rootRank: int = 0


@dataclass
class ScatterOptions(_Options):
    rootRank: int = 0


@dataclass
class ReduceScatterOptions(_Options):
    reduceOp: Any = ReduceOp.SUM


@dataclass
class AllToAllOptions(_Options):
    pass


@dataclass
class BarrierOptions(_Options):
    device_ids: list[int] = field(default_factory=list)
    device: Any = None


def _one(arrays: Any, where: str, name: str) -> Any:
    """The array of a one-element list (torch's per-device list), or the array itself."""
    if isinstance(arrays, (list, tuple)):
        if len(arrays) != 1:
            raise ValueError(
                f"ProcessGroup.{where}: {name} must hold one array (one per "
                f"device, and a process drives one), got {len(arrays)}"
            )
        return arrays[0]
    return arrays


def _timed(work: Any, timeout: Any) -> Any:
    """`work`, its wait() bounded by `timeout` when that is a timeout of its own."""
    if timeout is None:
        return work
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if seconds > 0:
        work.set_default_timeout(seconds)
    return work


class GroupMethods:
    """The collectives as methods of `ProcessGroup` (torch's overloads: options object, or
    positional root/op and timeout). Every method returns a `Work`."""

    def allreduce(self, tensors: Any, opts: Any = None, timeout: Any = None) -> Any:
        op = (
            opts.reduceOp
            if isinstance(opts, AllreduceOptions)
            else (ReduceOp.SUM if opts is None else opts)
        )
        timeout = opts.timeout if isinstance(opts, AllreduceOptions) else timeout
        return _timed(all_reduce(_one(tensors, "allreduce", "tensors"), op, self, True), timeout)

    def allreduce_coalesced(
        self, tensors: list[Any], opts: AllreduceCoalescedOptions | None = None
    ) -> Any:
        opts = opts or AllreduceCoalescedOptions()
        return _timed(all_reduce_coalesced(list(tensors), opts.reduceOp, self, True), opts.timeout)

    def broadcast(self, tensors: Any, opts: Any = None, timeout: Any = None) -> Any:
        root = opts.rootRank if isinstance(opts, BroadcastOptions) else (opts or 0)
        timeout = opts.timeout if isinstance(opts, BroadcastOptions) else timeout
        return _timed(
            broadcast(
                _one(tensors, "broadcast", "tensors"), group=self, async_op=True, group_src=root
            ),
            timeout,
        )

    def reduce(
        self, tensors: Any, opts: Any = None, op: Any = ReduceOp.SUM, timeout: Any = None
    ) -> Any:
        if isinstance(opts, ReduceOptions):
            root, op, timeout = opts.rootRank, opts.reduceOp, opts.timeout
        else:
            root = opts or 0
        return _timed(
            reduce(
                _one(tensors, "reduce", "tensors"), op=op, group=self, async_op=True, group_dst=root
            ),
            timeout,
        )

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        timeout = opts.timeout if isinstance(opts, AllgatherOptions) else opts
        outputs = output_tensors
        if outputs and isinstance(outputs[0], (list, tuple)):  # [[one per rank]]
            outputs = _one(outputs, "allgather", "output_tensors")
        return _timed(
            all_gather(
                list(outputs), _one(input_tensors, "allgather", "input_tensors"), self, True
            ),
            timeout,
        )

    def all_gather_single(
        self, output: Any, input: Any, opts: AllgatherOptions | None = None
    ) -> Any:
        opts = opts or AllgatherOptions()
        return _timed(all_gather_single(output, input, self, True), opts.timeout)

    def gather(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None
    ) -> Any:
        if isinstance(opts, GatherOptions):
            root, timeout = opts.rootRank, opts.timeout
        else:
            root = opts or 0
        outputs = output_tensors
        if outputs and isinstance(outputs[0], (list, tuple)):
            outputs = _one(outputs, "gather", "output_tensors")
        return _timed(
            gather(
                _one(input_tensors, "gather", "input_tensors"),
                list(outputs) if self.rank() == root else None,
                group=self,
                async_op=True,
                group_dst=root,
            ),
            timeout,
        )

    def scatter(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None
    ) -> Any:
        if isinstance(opts, ScatterOptions):
            root, timeout = opts.rootRank, opts.timeout
        else:
            root = opts or 0
        inputs = input_tensors
        if inputs and isinstance(inputs[0], (list, tuple)):
            inputs = _one(inputs, "scatter", "input_tensors")
        return _timed(
            scatter(
                _one(output_tensors, "scatter", "output_tensors"),
                list(inputs) if self.rank() == root else None,
                group=self,
                async_op=True,
                group_src=root,
            ),
            timeout,
        )

    def reduce_scatter(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None
    ) -> Any:
        if isinstance(opts, ReduceScatterOptions):
            op, timeout = opts.reduceOp, opts.timeout
        else:
            op = ReduceOp.SUM if opts is None else opts
        inputs = input_tensors
        if inputs and isinstance(inputs[0], (list, tuple)):
            inputs = _one(inputs, "reduce_scatter", "input_tensors")
        return _timed(
            reduce_scatter(
                _one(output_tensors, "reduce_scatter", "output_tensors"),
                list(inputs),
                op,
                self,
                True,
            ),
            timeout,
        )

    def reduce_scatter_single(
        self, outputTensor: Any, inputTensor: Any, opts: ReduceScatterOptions | None = None
    ) -> Any:
        opts = opts or ReduceScatterOptions()
        return _timed(
            reduce_scatter_single(outputTensor, inputTensor, opts.reduceOp, self, True),
            opts.timeout,
        )

    def alltoall(
        self,
        output_tensors: list[Any],
        input_tensors: list[Any],
        opts: AllToAllOptions | None = None,
    ) -> Any:
        opts = opts or AllToAllOptions()
        return _timed(
            all_to_all(list(output_tensors), list(input_tensors), self, True), opts.timeout
        )

    def alltoall_base(
        self,
        output: Any,
        input: Any,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Any:
        timeout = opts.timeout if isinstance(opts, AllToAllOptions) else opts
        return _timed(
            all_to_all_single(
                output,
                input,
                list(output_split_sizes) or None,
                list(input_split_sizes) or None,
                self,
                True,
            ),
            timeout,
        )

    def barrier(self, opts: Any = None) -> Any:
        if isinstance(opts, BarrierOptions):
            work = barrier(self, True, opts.device_ids or None)
            return _timed(work, opts.timeout)
        return _timed(barrier(self, True), opts)

    def send(self, tensors: Any, dstRank: int, tag: int = 0) -> Any:
        return isend(_one(tensors, "send", "tensors"), group=self, tag=tag, group_dst=dstRank)

    def recv(self, tensors: Any, srcRank: int, tag: int = 0) -> Any:
        return irecv(_one(tensors, "recv", "tensors"), group=self, tag=tag, group_src=srcRank)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> Any:
        return irecv(_one(tensors, "recv_anysource", "tensors"), group=self, tag=tag)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        monitored_barrier(self, timeout, wait_all_ranks)
