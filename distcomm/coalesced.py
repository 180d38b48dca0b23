"""torch's coalesced collectives: one operation on a list of arrays, through one fused
buffer (all_reduce_coalesced, all_gather_coalesced); `timeout=` as in `distcomm.collectives`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._calls import premultiplied, split_into, timed
from .arrays import adapt, check_same, concatenate, empty
from .ops import ReduceOp, check_reduce_op
from .work import Work
from .world import outside, resolve

if TYPE_CHECKING:
    from .process_group import ProcessGroup

__all__ = ["all_gather_coalesced", "all_reduce_coalesced"]


def _arrays(value: Any, where: str, name: str, writable: bool) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where}: {name} must be a list of arrays, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{where}: {name} is empty; pass at least one array")
    arrays = [adapt(a, where, f"{name}[{i}]", writable=writable) for i, a in enumerate(value)]
    check_same(arrays, where, name)
    return arrays


def all_reduce_coalesced(
    tensors: list[Any],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Any = None,
) -> Work | None:
    """Reduce each array of `tensors` over the group, in place, as one fused all_reduce
    (torch.distributed.all_reduce_coalesced). The arrays share a dtype and a device; their
    shapes may differ, but every rank must pass the same shapes in the same order.

    Args:
        timeout: seconds or timedelta bounding this call alone (see
            `distcomm.collectives`); default: the group's timeout.

    Raises:
        TypeError: `tensors` is not a list of arrays, or their dtypes differ.
        ValueError: the list is empty, the arrays are on different devices, or `op` does
            not apply to the dtype.
    """
    where = "all_reduce_coalesced"
    if outside(group, where):
        return None
    pg = resolve(group, where)
    if timeout is not None:
        return timed(pg, timeout, where, async_op, all_reduce_coalesced, tensors, op, pg, True)
    arrays = _arrays(tensors, where, "tensors", writable=True)
    op = check_reduce_op(op, arrays[0].dtype, where)
    backend = pg.backend_for(arrays[0], where)
    joined = concatenate(arrays, arrays[0])
    entry = pg.recorder.record(where, joined, -1, op)
    plain, joined = premultiplied(op, joined, in_place=True)  # joined is our own copy
    inner = backend.all_reduce(joined, plain, async_op=async_op)
    outputs = list(tensors)
    return pg.recorder.finish(entry, inner.chain(split_into(arrays, joined), outputs), async_op)


def all_gather_coalesced(
    output_tensor_lists: list[list[Any]],
    input_tensor_list: list[Any],
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Any = None,
) -> Work | None:
    """Gather every rank's `input_tensor_list` as one fused all_gather
    (torch.distributed.all_gather_coalesced): `output_tensor_lists[i][j]` receives rank
    i's `input_tensor_list[j]` (i a group rank).

    Args:
        timeout: seconds or timedelta bounding this call alone (see
            `distcomm.collectives`); default: the group's timeout.

    Raises:
        TypeError: a list is not a list of arrays, or dtypes differ.
        ValueError: `output_tensor_lists` does not hold one list per rank of the group,
            each with one array per input and of its size.
    """
    where = "all_gather_coalesced"
    if outside(group, where):
        return None
    pg = resolve(group, where)
    if timeout is not None:
        outputs, inputs = output_tensor_lists, input_tensor_list
        return timed(pg, timeout, where, async_op, all_gather_coalesced, outputs, inputs, pg, True)
    inputs = _arrays(input_tensor_list, where, "input_tensor_list", writable=False)
    n = pg.size()
    if not isinstance(output_tensor_lists, (list, tuple)) or len(output_tensor_lists) != n:
        raise ValueError(
            f"{where}: output_tensor_lists must hold one list per rank of the group ({n})"
        )
    outputs = []
    for i, row in enumerate(output_tensor_lists):
        arrays = _arrays(row, where, f"output_tensor_lists[{i}]", writable=True)
        if [a.size for a in arrays] != [a.size for a in inputs]:
            raise ValueError(
                f"{where}: output_tensor_lists[{i}] must hold arrays of the input arrays' "
                f"sizes {[a.size for a in inputs]}, got {[a.size for a in arrays]}"
            )
        outputs.extend(arrays)
    check_same([inputs[0], *outputs], where, "output_tensor_lists and input_tensor_list")
    backend = pg.backend_for(inputs[0], where)
    joined = concatenate(inputs, inputs[0])
    gathered = empty(n * joined.size, joined)
    entry = pg.recorder.record(where, joined)
    inner = backend.all_gather(gathered, joined, async_op=async_op)
    results = [t for row in output_tensor_lists for t in row]
    return pg.recorder.finish(entry, inner.chain(split_into(outputs, gathered), results), async_op)
