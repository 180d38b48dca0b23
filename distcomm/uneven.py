"""Uneven collectives (MPI's v-variants): arrays of different sizes per rank in the list
forms of all_gather, gather, scatter and all_to_all, and torchcomms' `all_gather_v` and
`reduce_scatter_v`.

Who knows the sizes decides the route:

- all_gather, all_gather_v and reduce_scatter_v: every rank knows every size (its list
  holds one array per rank), so each rank first tests evenness itself (a size
  comparison per rank, no message) and an even call runs the even op as before;
- gather and scatter: only dst (src) knows the sizes; every other rank knows its own
  alone and cannot tell an even call from an uneven one, so every gather and scatter
  takes the uneven route on every rank;
- all_to_all: the backend's all_to_all already moves one piece per pair of ranks, each
  of its own size (the splits of all_to_all_single); only this rank's piece to itself
  is checked here.

The uneven route is chosen here, once, for every backend:

- a backend with native v-calls runs them (`Backend.all_gather_v`, `gather_v`,
  `scatter_v`, `reduce_scatter_v` return a Work; mpi: Allgatherv, Gatherv, Scatterv,
  Reduce_scatter with recvcounts; tcp and gloo: gather_v and scatter_v, a flat gather
  or scatter over TCP and one copy per piece in shared memory, so an even gather or
  scatter costs what it did before sizes could differ);
- otherwise (they return None: nccl, CuPy arrays staged through host memory, and tcp's
  and gloo's all_gather_v and reduce_scatter_v) all_gather and reduce_scatter pad every
  rank's piece to the largest and run the even op, then copy each piece out (the padding
  is never read); gather and scatter are all_to_all calls whose only non-empty pieces go
  to dst or come from src, the messages nccl's gather and scatter send anyway.

What one rank can see is checked before anything is sent: a list of the wrong length, a
dtype or device that differs, this rank's own piece against its array. The sizes of
other ranks cannot be checked without a message: a count that dst (src) and a rank
disagree on fails in the backend (a mismatch error on tcp, gloo and nccl, MPI's
truncation error); all_gather's and reduce_scatter_v's lists must agree on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._calls import array_list, output_arrays, premultiplied, split_into, timed
from .arrays import adapt, check_same, concatenate, empty, flat
from .ops import ReduceOp, check_reduce_op
from .work import Work
from .world import outside, resolve

if TYPE_CHECKING:
    from .backends.base import Backend
    from .process_group import ProcessGroup

__all__ = [
    "all_gather_list",
    "all_gather_v",
    "check_own_piece",
    "gather_any",
    "reduce_scatter_v",
    "scatter_any",
]


# -- public -----------------------------------------------------------------------------------


def all_gather_v(
    tensor_list: list[Any],
    tensor: Any,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Any = None,
) -> Work | None:
    """Gather every rank's `tensor`, whose size may differ per rank, into `tensor_list`.

    torchcomms' name for what `all_gather` also does: `tensor_list[i]` receives rank i's
    `tensor`, so it has rank i's size, the same on every rank.

    Args:
        tensor_list: one writable array per rank of the group, of `tensor`'s dtype.
        tensor: this rank's contribution; `tensor_list[rank]` has its size.
        timeout: seconds or timedelta bounding this call alone (see
            `distcomm.collectives`).

    Raises:
        ValueError: `tensor_list` has the wrong length, or this rank's slot has not
            `tensor`'s size.
        TypeError: the arrays' dtypes differ.
    """
    if outside(group, "all_gather_v"):
        return None
    pg = resolve(group, "all_gather_v")
    if timeout is not None:
        args = (tensor_list, tensor, pg, True)
        return timed(pg, timeout, "all_gather_v", async_op, all_gather_v, *args)
    return all_gather_list(pg, tensor_list, tensor, async_op, "all_gather_v")


def reduce_scatter_v(
    output: Any,
    input_list: list[Any],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Any = None,
) -> Work | None:
    """Reduce the i-th arrays of every rank's `input_list` into rank i's `output`; the
    size may differ per destination rank.

    Args:
        output: this rank's result; its size is rank `rank`'s.
        input_list: one array per rank: `input_list[i]` is this rank's contribution to
            rank i's result, of rank i's output size (the same on every rank).
        op: the reduction (any `ReduceOp` the dtype takes, `PREMUL_SUM` included).
        timeout: seconds or timedelta bounding this call alone (see
            `distcomm.collectives`).

    Raises:
        ValueError: `input_list` has the wrong length, or `input_list[rank]` has not
            `output`'s size.
        TypeError: the dtypes differ, or `op` does not apply to the dtype.
    """
    where = "reduce_scatter_v"
    if outside(group, where):
        return None
    pg = resolve(group, where)
    if timeout is not None:
        args = (output, input_list, op, pg, True)
        return timed(pg, timeout, where, async_op, reduce_scatter_v, *args)
    out = adapt(output, where, "output", writable=True)
    inputs = [
        adapt(t, where, f"input_list[{i}]", writable=False)
        for i, t in enumerate(array_list(input_list, where, "input_list", pg.size()))
    ]
    check_same([out, *inputs], where, "input_list and output")
    backend = pg.backend_for(out, where)
    op = check_reduce_op(op, out.dtype, where)
    m, me = out.size, pg.rank()
    uneven = not _even(inputs, m)
    if uneven:
        counts = [t.size for t in inputs]
        if counts[me] != m:
            raise ValueError(
                f"{where}: input_list[{me}] has {counts[me]} elements but output has {m}: "
                f"input_list[i] is this rank's part of rank i's result, so input_list[{me}] "
                f"(this rank's own) must have output's size; pass {m} elements there"
            )
    entry = pg.recorder.record(where, out, -1, op)
    plain, joined = premultiplied(op, concatenate(inputs, out), in_place=True)  # our copy
    if not uneven:
        work = backend.reduce_scatter(flat(out), joined, plain, async_op=async_op)
        return pg.recorder.finish(entry, work, async_op, [output])
    work = backend.reduce_scatter_v(flat(out), joined, counts, plain, async_op=async_op)
    if work is None:  # pad every piece to the largest, then keep this rank's part
        width = max(counts)
        padded = _spread(joined, counts, width)
        if m == width:
            work = backend.reduce_scatter(flat(out), padded, plain, async_op=async_op)
        else:
            result = empty(width, out)
            work = backend.reduce_scatter(result, padded, plain, async_op=async_op)
            work = work.chain(split_into([out], result[:m]), [output])
    return pg.recorder.finish(entry, work, async_op, [output])


# -- the list forms, called by collectives.py ------------------------------------------------


def all_gather_list(
    pg: ProcessGroup, tensor_list: Any, tensor: Any, async_op: bool, where: str
) -> Work | None:
    """all_gather (and all_gather_v): every rank's `tensor` into `tensor_list[rank]` on
    every rank; an even call runs the backend's all_gather as it always did."""
    input = adapt(tensor, where, "tensor", writable=False)
    outputs = output_arrays(tensor_list, input, pg.size(), where, "tensor_list")
    backend = pg.backend_for(input, where)
    m = input.size
    if _even(outputs, m):
        gathered = empty(pg.size() * m, input)
        entry = pg.recorder.record(where, input)
        inner = backend.all_gather(gathered, flat(input), async_op=async_op)
        return pg.recorder.finish(
            entry, inner.chain(split_into(outputs, gathered), outputs), async_op
        )
    counts = [o.size for o in outputs]
    me = pg.rank()
    if counts[me] != m:
        raise ValueError(
            f"{where}: tensor_list[{me}] has {counts[me]} elements but tensor has {m}: "
            f"tensor_list[i] receives rank i's tensor, so tensor_list[{me}] (this rank's) "
            f"must have {m}; pass one array of each rank's size"
        )
    entry = pg.recorder.record(where, input)
    gathered = empty(sum(counts), input)
    work = backend.all_gather_v(gathered, flat(input), counts, async_op=async_op)
    if work is not None:
        copy = split_into(outputs, gathered)
    else:  # pad every rank's piece to the largest
        width = max(counts)
        gathered = empty(pg.size() * width, input)
        work = backend.all_gather(gathered, _padded(flat(input), width), async_op=async_op)
        copy = _pieces(outputs, gathered, width)
    return pg.recorder.finish(entry, work.chain(copy, outputs), async_op)


def gather_any(
    pg: ProcessGroup,
    backend: Backend,
    input: Any,
    gather_list: Any,
    root: int,
    async_op: bool,
) -> Work | None:
    """gather, on every rank: `input` into slot `rank` of `root`'s `gather_list`, whose
    arrays have each rank's size (the others do not know them: see the module)."""
    n, me = pg.size(), pg.rank()
    if me != root:
        if gather_list:
            raise ValueError("gather: gather_list must be None (or empty) on ranks other than dst")
        outputs: list[Any] = []
        counts, gathered = None, None
    else:
        if gather_list is None:
            raise ValueError("gather: gather_list is required on dst: one array per rank")
        outputs = output_arrays(gather_list, input, n, "gather", "gather_list")
        counts = [o.size for o in outputs]
        if counts[me] != input.size:
            raise ValueError(
                f"gather: gather_list[{me}] has {counts[me]} elements but tensor has "
                f"{input.size}: gather_list[i] receives rank i's tensor, so gather_list[{me}] "
                f"(dst's own) must have {input.size}; pass one array of each rank's size"
            )
        gathered = empty(sum(counts), input)
    entry = pg.recorder.record("gather", input, root)
    work = backend.gather_v(gathered, flat(input), counts, root, async_op=async_op)
    if work is None:  # an all_to_all whose only non-empty pieces go to dst
        sends = [0] * n
        sends[root] = input.size
        received = gathered if gathered is not None else empty(0, input)
        work = backend.all_to_all(
            received, flat(input), counts or [0] * n, sends, async_op=async_op
        )
    if outputs:
        work = work.chain(split_into(outputs, gathered), outputs)
    return pg.recorder.finish(entry, work, async_op, outputs)


def scatter_any(
    pg: ProcessGroup,
    backend: Backend,
    tensor: Any,
    output: Any,
    scatter_list: Any,
    root: int,
    async_op: bool,
) -> Work | None:
    """scatter, on every rank: `root`'s `scatter_list[rank]` into `output` (the caller's
    `tensor`, adapted), whose size may differ per rank."""
    n, me = pg.size(), pg.rank()
    if me != root:
        if scatter_list:
            raise ValueError(
                "scatter: scatter_list must be None (or empty) on ranks other than src"
            )
        joined, counts = None, None
    else:
        if scatter_list is None:
            raise ValueError("scatter: scatter_list is required on src: one array per rank")
        inputs = [
            adapt(t, "scatter", f"scatter_list[{i}]", writable=False)
            for i, t in enumerate(array_list(scatter_list, "scatter", "scatter_list", n))
        ]
        check_same([output, *inputs], "scatter", "scatter_list and tensor")
        counts = [t.size for t in inputs]
        if counts[me] != output.size:
            raise ValueError(
                f"scatter: scatter_list[{me}] has {counts[me]} elements but tensor has "
                f"{output.size}: scatter_list[i] goes to rank i's tensor, so scatter_list[{me}] "
                f"(src's own) must have {output.size}; pass one array of each rank's size"
            )
        joined = concatenate(inputs, output)
    entry = pg.recorder.record("scatter", output, root)
    work = backend.scatter_v(flat(output), joined, counts, root, async_op=async_op)
    if work is None:  # an all_to_all whose only non-empty pieces come from src
        receives = [0] * n
        receives[root] = output.size
        sent = joined if joined is not None else empty(0, output)
        work = backend.all_to_all(
            flat(output), sent, receives, counts or [0] * n, async_op=async_op
        )
    return pg.recorder.finish(entry, work, async_op, [tensor])


def check_own_piece(outputs: list[Any], inputs: list[Any], rank: int) -> None:
    """all_to_all: this rank's piece to itself has one size in both lists."""
    sent, received = inputs[rank].size, outputs[rank].size
    if sent != received:
        raise ValueError(
            f"all_to_all: input_tensor_list[{rank}] has {sent} elements but "
            f"output_tensor_list[{rank}] has {received}: this rank sends input_tensor_list"
            f"[{rank}] to itself, into output_tensor_list[{rank}], so pass arrays of one size "
            "there (the other pieces may differ)"
        )


# -- helpers ------------------------------------------------------------------------------------


def _even(arrays: list[Any], size: int) -> bool:
    """Whether every one of `arrays` has `size` elements (the even case, tested first)."""
    for array in arrays:  # noqa: SIM110 (a loop: all() over a generator costs more)
        if array.size != size:
            return False
    return True


def _padded(array: Any, width: int) -> Any:
    """`array` (flat) in a buffer of `width` elements; the tail is left as it is."""
    if array.size == width:
        return array
    padded = empty(width, array)
    padded[: array.size] = array
    return padded


def _spread(joined: Any, counts: list[int], width: int) -> Any:
    """The consecutive pieces of `joined` (counts[i] elements each), each at the start
    of a slot of `width` elements, zeros after it."""
    padded = empty(len(counts) * width, joined)
    padded.fill(0)
    at = 0
    for i, count in enumerate(counts):
        padded[i * width : i * width + count] = joined[at : at + count]
        at += count
    return padded


def _pieces(outputs: list[Any], gathered: Any, width: int) -> Callable[[], None]:
    """A finalizer copying the start of each `width`-element slot into `outputs[i]`."""

    def copy_out() -> None:
        for i, out in enumerate(outputs):
            flat(out)[...] = gathered[i * width : i * width + out.size]

    return copy_out
