"""What every public operation shares: argument checks (ranks, tags, array lists) and
how an issued Work is waited for and settled in the flight recorder."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .arrays import adapt, check_same, flat
from .ops import PremulSum, ReduceOp, scaled

if TYPE_CHECKING:
    from .process_group import ProcessGroup

__all__ = [
    "MAX_TAG",
    "array_list",
    "check_tag",
    "output_list",
    "premultiplied",
    "rank_arg",
    "same_size",
    "split_into",
]

#: user tags are below this (and >= 0: the negative ones are monitored_barrier's)
MAX_TAG = 2**62


def rank_arg(
    group: ProcessGroup,
    global_rank: int | None,
    group_rank: int | None,
    where: str,
    name: str,
    default: int | None = None,
) -> int:
    """The group rank meant by `name` (a global rank) or `group_name` (a group rank)."""
    if group_rank is None and type(global_rank) is int:  # the common case, checked first
        ranks = group.ranks
        if (
            len(ranks) > global_rank >= 0
            and ranks[global_rank] == global_rank
            and ranks[-1] == len(ranks) - 1
        ):
            return global_rank  # a group of ranks 0..n-1 (the world): global == group rank
    if global_rank is not None and group_rank is not None:
        raise ValueError(
            f"{where}: pass {name} (a global rank) or group_{name} (a rank "
            "within the group), not both"
        )
    if global_rank is None and group_rank is None:
        if default is None:
            raise ValueError(
                f"{where}: {name} is required: pass {name} (a global rank) or "
                f"group_{name} (a rank within the group)"
            )
        global_rank = default
    value = group_rank if group_rank is not None else global_rank
    label = f"group_{name}" if group_rank is not None else name
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: {label} must be an int, got {value!r}")
    value = int(value)
    if group_rank is not None:
        if not 0 <= value < group.size():
            raise ValueError(
                f"{where}: group_{name}={value} is out of range for group "
                f"'{group.group_name}' of size {group.size()}"
            )
        return value
    ranks = group.ranks
    if value not in ranks:
        raise ValueError(
            f"{where}: {name}={value} is not a member of group "
            f"'{group.group_name}' (members: {ranks})"
        )
    return ranks.index(value)


def check_tag(tag: int, where: str) -> int:
    """`tag` as an int, checked to be a user tag (0 <= tag < MAX_TAG)."""
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not (0 <= tag < MAX_TAG):
        raise ValueError(f"{where}: tag must be an int from 0 to 2**62 - 1, got {tag!r}")
    return int(tag)


def array_list(value: Any, where: str, name: str, length: int) -> list[Any]:
    """`value` as a list, checked to be a list or tuple of `length` items (one a rank)."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where}: {name} must be a list of arrays, got {type(value).__name__}")
    if len(value) != length:
        raise ValueError(
            f"{where}: {name} must hold one array per rank of the group "
            f"({length}), got {len(value)}"
        )
    return list(value)


def same_size(arrays: Sequence[Any], size: int, where: str, name: str) -> None:
    """Check that every one of `arrays` has `size` elements (the input array's)."""
    for i, array in enumerate(arrays):
        if array.size != size:
            raise ValueError(
                f"{where}: {name}[{i}] has {array.size} elements but must have "
                f"{size}, like the input array"
            )


def output_list(arrays: Any, input: Any, n: int, where: str, name: str) -> list[Any]:
    """Validate a list of `n` writable output arrays shaped like `input` (same dtype, size)."""
    outputs = [
        adapt(t, where, f"{name}[{i}]", writable=True)
        for i, t in enumerate(array_list(arrays, where, name, n))
    ]
    check_same([input, *outputs], where, f"{name} and the input array")
    same_size(outputs, input.size, where, name)
    return outputs


def split_into(outputs: list[Any], joined: np.ndarray) -> Callable[[], None]:
    """A finalizer copying consecutive pieces of `joined` into each of `outputs`."""

    def copy_out() -> None:
        at = 0
        for out in outputs:
            flat(out)[...] = joined[at : at + out.size]
            at += out.size

    return copy_out


def premultiplied(op: ReduceOp | PremulSum, array: Any, in_place: bool) -> tuple[ReduceOp, Any]:
    """The (op, array) a backend runs: for `ReduceOp.PREMUL_SUM(f)`, SUM over `array` x f
    (scaled in place, or a scaled copy when the array is an input the caller keeps; an
    overflow gives inf without a warning); any other op and the array unchanged."""
    if not isinstance(op, PremulSum):
        return op, array
    return ReduceOp.SUM, scaled(array, op.factor, in_place)
