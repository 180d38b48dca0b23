"""Public collective functions: validate, then dispatch to the group's backend.

Signatures, defaults and semantics follow torch.distributed with arrays in place of
tensors. Roots are global ranks (`src`, `dst`) or ranks within the group (`group_src`,
`group_dst`). List-shaped variants are built here on the backend's single-array
primitives. The point-to-point functions live in `distcomm.p2p` and are importable from
here too.

Every collective but the barriers (whose `timeout` is their own) takes a keyword `timeout=`
(seconds or a `datetime.timedelta`, at most the group's timeout; None: the group's), said
here once, that bounds that call alone. The operation is then issued as with
`async_op=True`: a synchronous call waits for it up to `timeout` (on nccl, on the host),
an asynchronous one returns a Work whose `wait()` (on nccl `synchronize()`) waits at most
`timeout`. On expiry the group is aborted (every rank's pending and later operations
fail; on mpi only this rank's) and `DistTimeoutError` names the operation and, on tcp and
gloo, the ranks not heard from; destroy the group and create a new one.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._calls import array_list, premultiplied, rank_arg, same_size, split_into, timed
from .arrays import adapt, check_same, concatenate, empty, flat
from .deadline import to_seconds
from .errors import DistTimeoutError
from .ops import ReduceOp, check_reduce_op
from .p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from .trace.recorder import NO_ARRAY
from .uneven import all_gather_list, check_own_piece, gather_any, scatter_any
from .work import Work
from .world import outside, resolve

if TYPE_CHECKING:
    from .process_group import ProcessGroup

__all__ = [
    "P2POp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "gather",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]

#: tags reserved for monitored_barrier; user tags are >= 0
_BARRIER_ARRIVE_TAG = -1
_BARRIER_RELEASE_TAG = -2


# -- collectives ----------------------------------------------------------------------------


def broadcast(
    tensor: Any,
    src: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
    *,
    timeout: Any = None,
) -> Work | None:
    """Copy `src`'s `tensor` into `tensor` on every rank of the group."""
    if outside(group, "broadcast"):
        return None
    pg = resolve(group, "broadcast")
    if timeout is not None:
        args = (tensor, src, pg, True, group_src)
        return timed(pg, timeout, "broadcast", async_op, broadcast, *args)
    array = adapt(tensor, "broadcast", "tensor", writable=True)
    backend = pg.backend_for(array, "broadcast")
    root = rank_arg(pg, src, group_src, "broadcast", "src")
    return pg.recorder.finish(
        pg.recorder.record("broadcast", array, root),
        backend.broadcast(flat(array), root, async_op=async_op),
        async_op,
        [tensor],
    )


def all_reduce(
    tensor: Any,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Any = None,
) -> Work | None:
    """Reduce `tensor` over the group with `op`; every rank gets the result in place."""
    if outside(group, "all_reduce"):
        return None
    pg = resolve(group, "all_reduce")
    if timeout is not None:
        return timed(pg, timeout, "all_reduce", async_op, all_reduce, tensor, op, pg, True)
    array = adapt(tensor, "all_reduce", "tensor", writable=True)
    backend = pg.backend_for(array, "all_reduce")
    op = check_reduce_op(op, array.dtype, "all_reduce")
    entry = pg.recorder.record("all_reduce", array, -1, op)
    plain, array = premultiplied(op, array, in_place=True)
    return pg.recorder.finish(
        entry,
        backend.all_reduce(flat(array), plain, async_op=async_op),
        async_op,
        [tensor],
    )


def reduce(
    tensor: Any,
    dst: int | None = None,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
    *,
    timeout: Any = None,
) -> Work | None:
    """Reduce `tensor` over the group into `dst`'s `tensor` (default dst: global rank 0)."""
    if outside(group, "reduce"):
        return None
    pg = resolve(group, "reduce")
    if timeout is not None:
        return timed(pg, timeout, "reduce", async_op, reduce, tensor, dst, op, pg, True, group_dst)
    array = adapt(tensor, "reduce", "tensor", writable=True)
    backend = pg.backend_for(array, "reduce")
    root = rank_arg(pg, dst, group_dst, "reduce", "dst", default=0)
    op = check_reduce_op(op, array.dtype, "reduce")
    entry = pg.recorder.record("reduce", array, root, op)
    plain, scaled = premultiplied(op, array, in_place=False)  # non-roots keep their input
    work = backend.reduce(flat(scaled), root, plain, async_op=async_op)
    if scaled is not array and pg.rank() == root:
        work = work.chain(split_into([array], flat(scaled)), [tensor])
    return pg.recorder.finish(entry, work, async_op, [tensor])


def all_gather_single(
    output_tensor: Any,
    input_tensor: Any,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Any = None,
) -> Work | None:
    """Gather every rank's `input_tensor` into `output_tensor` (group size x its elements).

    `output_tensor` is the concatenation (n*k, ...) or the stack (n, k, ...) of the inputs.
    """
    where = "all_gather_single"
    if outside(group, where):
        return None
    pg = resolve(group, where)
    if timeout is not None:
        args = (output_tensor, input_tensor, pg, True)
        return timed(pg, timeout, where, async_op, all_gather_single, *args)
    output = adapt(output_tensor, where, "output_tensor", writable=True)
    input = adapt(input_tensor, where, "input_tensor", writable=False)
    check_same([output, input], where, "output_tensor and input_tensor")
    backend = pg.backend_for(input, where)
    if output.size != pg.size() * input.size:
        raise ValueError(
            f"{where}: output_tensor must have group size x input elements "
            f"({pg.size()} x {input.size} = {pg.size() * input.size}), "
            f"got {output.size}"
        )
    return pg.recorder.finish(
        pg.recorder.record(where, input),
        backend.all_gather(flat(output), flat(input), async_op=async_op),
        async_op,
        [output_tensor],
    )


def all_gather(
    tensor_list: list[Any],
    tensor: Any,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Any = None,
) -> Work | None:
    """Gather every rank's `tensor` into `tensor_list` (one array per rank, in rank order)."""
    if outside(group, "all_gather"):
        return None
    pg = resolve(group, "all_gather")
    if timeout is not None:
        return timed(pg, timeout, "all_gather", async_op, all_gather, tensor_list, tensor, pg, True)
    # sizes may differ per rank (tensor_list[i]: rank i's); an even call runs as before
    return all_gather_list(pg, tensor_list, tensor, async_op, "all_gather")


def gather(
    tensor: Any,
    gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
    *,
    timeout: Any = None,
) -> Work | None:
    """Gather every rank's `tensor` into `dst`'s `gather_list` (default dst: global rank 0)."""
    if outside(group, "gather"):
        return None
    pg = resolve(group, "gather")
    if timeout is not None:
        args = (tensor, gather_list, dst, pg, True, group_dst)
        return timed(pg, timeout, "gather", async_op, gather, *args)
    input = adapt(tensor, "gather", "tensor", writable=False)
    backend = pg.backend_for(input, "gather")
    root = rank_arg(pg, dst, group_dst, "gather", "dst", default=0)
    # sizes may differ per rank, which only dst knows: every rank takes the uneven route
    return gather_any(pg, backend, input, gather_list, root, async_op)


def scatter(
    tensor: Any,
    scatter_list: list[Any] | None = None,
    src: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
    *,
    timeout: Any = None,
) -> Work | None:
    """Give rank i the i-th array of `src`'s `scatter_list` in `tensor` (default src: 0)."""
    if outside(group, "scatter"):
        return None
    pg = resolve(group, "scatter")
    if timeout is not None:
        args = (tensor, scatter_list, src, pg, True, group_src)
        return timed(pg, timeout, "scatter", async_op, scatter, *args)
    output = adapt(tensor, "scatter", "tensor", writable=True)
    backend = pg.backend_for(output, "scatter")
    root = rank_arg(pg, src, group_src, "scatter", "src", default=0)
    # sizes may differ per rank, which only src knows: every rank takes the uneven route
    return scatter_any(pg, backend, tensor, output, scatter_list, root, async_op)


def reduce_scatter_single(
    output: Any,
    input: Any,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Any = None,
) -> Work | None:
    """Reduce `input` (group size x output elements) over the group; rank i gets slice i."""
    where = "reduce_scatter_single"
    if outside(group, where):
        return None
    pg = resolve(group, where)
    if timeout is not None:
        args = (output, input, op, pg, True)
        return timed(pg, timeout, where, async_op, reduce_scatter_single, *args)
    out = adapt(output, where, "output", writable=True)
    inp = adapt(input, where, "input", writable=False)
    check_same([out, inp], where, "output and input")
    backend = pg.backend_for(inp, where)
    op = check_reduce_op(op, inp.dtype, where)
    if inp.size != pg.size() * out.size:
        raise ValueError(
            f"{where}: input must have group size x output elements "
            f"({pg.size()} x {out.size} = {pg.size() * out.size}), "
            f"got {inp.size}"
        )
    entry = pg.recorder.record(where, out, -1, op)
    plain, inp = premultiplied(op, inp, in_place=False)
    return pg.recorder.finish(
        entry,
        backend.reduce_scatter(flat(out), flat(inp), plain, async_op=async_op),
        async_op,
        [output],
    )


def reduce_scatter(
    output: Any,
    input_list: list[Any],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Any = None,
) -> Work | None:
    """Reduce the i-th arrays of every rank's `input_list` into rank i's `output`."""
    if outside(group, "reduce_scatter"):
        return None
    pg = resolve(group, "reduce_scatter")
    if timeout is not None:
        args = (output, input_list, op, pg, True)
        return timed(pg, timeout, "reduce_scatter", async_op, reduce_scatter, *args)
    out = adapt(output, "reduce_scatter", "output", writable=True)
    inputs = [
        adapt(t, "reduce_scatter", f"input_list[{i}]", writable=False)
        for i, t in enumerate(array_list(input_list, "reduce_scatter", "input_list", pg.size()))
    ]
    check_same([out, *inputs], "reduce_scatter", "input_list and output")
    same_size(inputs, out.size, "reduce_scatter", "input_list")
    backend = pg.backend_for(out, "reduce_scatter")
    op = check_reduce_op(op, out.dtype, "reduce_scatter")
    joined = concatenate(inputs, out)
    entry = pg.recorder.record("reduce_scatter", out, -1, op)
    plain, joined = premultiplied(op, joined, in_place=True)  # joined is our own copy
    return pg.recorder.finish(
        entry,
        backend.reduce_scatter(flat(out), joined, plain, async_op=async_op),
        async_op,
        [output],
    )


def all_gather_into_tensor(
    output_tensor: Any,
    input_tensor: Any,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Any = None,
) -> Work | None:
    """Deprecated (as in torch 2.13): use `all_gather_single`, which it calls."""
    warnings.warn(
        "distcomm.all_gather_into_tensor is deprecated; use distcomm.all_gather_single instead",
        FutureWarning,
        stacklevel=2,
    )
    return all_gather_single(output_tensor, input_tensor, group, async_op, timeout=timeout)


def reduce_scatter_tensor(
    output: Any,
    input: Any,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Any = None,
) -> Work | None:
    """Deprecated (as in torch 2.13): use `reduce_scatter_single`, which it calls."""
    warnings.warn(
        "distcomm.reduce_scatter_tensor is deprecated; use distcomm.reduce_scatter_single instead",
        FutureWarning,
        stacklevel=2,
    )
    return reduce_scatter_single(output, input, op, group, async_op, timeout=timeout)


def _splits(splits: Sequence[int] | None, array: Any, n: int, where: str, name: str) -> list[int]:
    """Row split sizes along dim 0 as element counts."""
    if array.ndim == 0:
        arg = name.split("_")[0]
        raise ValueError(
            f"{where}: {arg} is a 0-d array, but {where} splits along dim 0, "
            "which it lacks (torch refuses 0-d tensors here too); pass "
            f"{arg}.reshape(1), or swap 0-d arrays with all_to_all and lists "
            "of them"
        )
    rows = array.shape[0]
    per_row = array.size // rows if rows else int(np.prod(array.shape[1:], dtype=np.int64))
    if splits is None or len(splits) == 0:
        if rows % n:
            raise ValueError(
                f"{where}: dim 0 of {name.split('_')[0]} ({rows}) is not "
                f"divisible by the group size {n}; pass {name}"
            )
        return [rows // n * per_row] * n
    values = list(splits)
    if len(values) != n or any(
        isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0 for v in values
    ):
        raise ValueError(
            f"{where}: {name} must hold {n} non-negative ints (one per rank), got {values}"
        )
    if sum(values) != rows:
        raise ValueError(
            f"{where}: {name} {values} sum to {sum(values)}, but dim 0 of "
            f"{name.split('_')[0]} is {rows}"
        )
    return [int(v) * per_row for v in values]


def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Any = None,
) -> Work | None:
    """Split `input` along dim 0, send piece j to rank j, and concatenate what arrives."""
    where = "all_to_all_single"
    if outside(group, where):
        return None
    pg = resolve(group, where)
    if timeout is not None:
        args = (output, input, output_split_sizes, input_split_sizes, pg, True)
        return timed(pg, timeout, where, async_op, all_to_all_single, *args)
    out = adapt(output, where, "output", writable=True)
    inp = adapt(input, where, "input", writable=False)
    check_same([out, inp], where, "output and input")
    backend = pg.backend_for(inp, where)
    n = pg.size()
    out_splits = _splits(output_split_sizes, out, n, where, "output_split_sizes")
    in_splits = _splits(input_split_sizes, inp, n, where, "input_split_sizes")
    return pg.recorder.finish(
        pg.recorder.record(where, inp),
        backend.all_to_all(flat(out), flat(inp), out_splits, in_splits, async_op=async_op),
        async_op,
        [output],
    )


def all_to_all(
    output_tensor_list: list[Any],
    input_tensor_list: list[Any],
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Any = None,
) -> Work | None:
    """Send `input_tensor_list[j]` to rank j; receive rank j's into `output_tensor_list[j]`."""
    if outside(group, "all_to_all"):
        return None
    pg = resolve(group, "all_to_all")
    if timeout is not None:
        args = (output_tensor_list, input_tensor_list, pg, True)
        return timed(pg, timeout, "all_to_all", async_op, all_to_all, *args)
    n = pg.size()
    outputs = [
        adapt(t, "all_to_all", f"output_tensor_list[{i}]", writable=True)
        for i, t in enumerate(array_list(output_tensor_list, "all_to_all", "output_tensor_list", n))
    ]
    inputs = [
        adapt(t, "all_to_all", f"input_tensor_list[{i}]", writable=False)
        for i, t in enumerate(array_list(input_tensor_list, "all_to_all", "input_tensor_list", n))
    ]
    check_same([*outputs, *inputs], "all_to_all", "output_tensor_list and input_tensor_list")
    check_own_piece(outputs, inputs, pg.rank())  # the other pieces' sizes may differ
    backend = pg.backend_for(inputs[0], "all_to_all")
    joined = concatenate(inputs, inputs[0])
    received = empty(sum(t.size for t in outputs), inputs[0])
    entry = pg.recorder.record("all_to_all", inputs[0])
    inner = backend.all_to_all(
        received, joined, [t.size for t in outputs], [t.size for t in inputs], async_op=async_op
    )
    return pg.recorder.finish(entry, inner.chain(split_into(outputs, received), outputs), async_op)


def barrier(
    group: ProcessGroup | None = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
    timeout: Any = None,
) -> Work | None:
    """Block until every rank of the group has entered the barrier.

    With `device_ids` (torch's NCCL form, e.g. `[local_rank]`) the group's GPU backend
    (nccl) runs it when the group has one; it then also waits for the GPU. `timeout`
    (seconds or timedelta) bounds the wait of a synchronous barrier instead of the group's
    timeout; as for `Work.wait(timeout)`, expiry aborts the group.
    """
    if outside(group, "barrier"):
        return None
    pg = resolve(group, "barrier")
    seconds = to_seconds(timeout, name="barrier timeout")
    entry = pg.recorder.record("barrier", NO_ARRAY)
    if device_ids:
        backend = pg.default_backend("barrier", "cuda")
        work = backend.barrier_on(int(device_ids[0]), async_op=async_op or bool(seconds))
    else:
        backend = pg.default_backend("barrier")
        work = backend.barrier(async_op=async_op or bool(seconds))
    if async_op or not seconds:
        return pg.recorder.finish(entry, work, async_op)
    try:
        work.wait(seconds)
    except BaseException as exc:
        pg.recorder.settle(entry, exc)
        raise
    pg.recorder.settle(entry)
    return None


def monitored_barrier(
    group: ProcessGroup | None = None, timeout: Any = None, wait_all_ranks: bool = False
) -> None:
    """A barrier that names the ranks that did not arrive within `timeout`.

    Group rank 0 waits for every other rank, then releases them. When ranks are
    missing it aborts the group, so every rank raises at once with its report; the
    other ranks wait a little past `timeout` (2 s or 10 %) to receive that report.

    Args:
        timeout: seconds or timedelta (default: the group's timeout).
        wait_all_ranks: report every missing rank instead of the first one.

    Raises:
        DistTimeoutError: some rank did not arrive in time; the message names them.
    """
    from .deadline import Deadline

    if outside(group, "monitored_barrier"):
        return None
    pg = resolve(group, "monitored_barrier")
    backend = pg.default_backend("monitored_barrier")
    if "cpu" not in backend.devices:
        raise ValueError(
            f"monitored_barrier: group '{pg.group_name}' has no CPU backend (its backend is "
            f"'{pg.name()}'), and the barrier's messages are host arrays; create the group "
            "with one, e.g. backend='cpu:gloo,cuda:nccl'"
        )
    deadline = Deadline.of(timeout if timeout is not None else pg.timeout)
    if pg.size() == 1:
        return
    entry = pg.recorder.record("monitored_barrier", NO_ARRAY)
    try:
        _monitored_barrier(pg, backend, deadline, wait_all_ranks)
    except BaseException as exc:
        pg.recorder.settle(entry, exc)
        raise
    pg.recorder.settle(entry)


def _monitored_barrier(pg: ProcessGroup, backend: Any, deadline: Any, wait_all_ranks: bool) -> None:
    token = np.empty(0, dtype=np.uint8)
    if pg.rank() != 0:
        backend.send(token, 0, _BARRIER_ARRIVE_TAG).wait(deadline.remaining())
        # wait a little past the timeout, so rank 0's verdict (which names the missing
        # ranks and aborts the group) arrives here before this rank gives up on its own
        grace = (deadline.remaining() or 0.0) + max(2.0, 0.1 * (deadline.seconds or 0.0))
        release = backend.recv(token, 0, _BARRIER_RELEASE_TAG)
        try:
            release.wait(grace)
        except DistTimeoutError as exc:
            raise DistTimeoutError(
                f"monitored_barrier on group '{pg.group_name}': group rank 0 (global rank "
                f"{pg.ranks[0]}) did not release this rank within {grace:.1f} s; is it alive "
                "and in the barrier?"
            ) from exc
        return
    arrivals = {
        peer: backend.recv(token, peer, _BARRIER_ARRIVE_TAG) for peer in range(1, pg.size())
    }
    missing = []
    for peer, work in arrivals.items():
        try:
            work.wait(max(deadline.remaining() or 0.0, 0.001))
        except DistTimeoutError:
            missing.append(pg.ranks[peer])
            if not wait_all_ranks:
                break
    if missing:
        message = (
            f"monitored_barrier on group '{pg.group_name}': rank(s) "
            f"{', '.join(map(str, missing))} did not arrive within "
            f"{deadline.seconds:.1f} s"
        )
        backend.abort(message)
        raise DistTimeoutError(message)
    for peer in range(1, pg.size()):
        backend.send(token, peer, _BARRIER_RELEASE_TAG).wait(deadline.remaining())
