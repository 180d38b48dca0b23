"""What every public operation shares: argument checks (ranks, tags, array lists) and
how an issued Work is waited for and settled in the flight recorder; a call's own
`timeout=` (`op_timeout`, `timed`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np

from .arrays import adapt, check_same, flat
from .deadline import Deadline
from .ops import PremulSum, ReduceOp, scaled
from .world import state

if TYPE_CHECKING:
    from .process_group import ProcessGroup
    from .work import Work

__all__ = [
    "MAX_TAG",
    "array_list",
    "check_tag",
    "op_timeout",
    "output_arrays",
    "premultiplied",
    "rank_arg",
    "same_size",
    "split_into",
    "timed",
]

#: user tags are below this (and >= 0: the negative ones are monitored_barrier's)
MAX_TAG = 2**62

#: the least wait of an operation handed a `Deadline` that has passed: a Work's wait(0)
#: would mean "no timeout of its own" (torch's kNoTimeout), not "give up at once"
_LEAST_WAIT = 0.001


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


def output_arrays(arrays: Any, like: Any, n: int, where: str, name: str) -> list[Any]:
    """Validate a list of `n` writable output arrays of `like`'s dtype and device (their
    sizes may differ: the uneven collectives)."""
    outputs = [
        adapt(t, where, f"{name}[{i}]", writable=True)
        for i, t in enumerate(array_list(arrays, where, name, n))
    ]
    check_same([like, *outputs], where, f"{name} and the input array")
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


def op_timeout(timeout: Any, pg: ProcessGroup, where: str) -> float:
    """A call's `timeout=` in seconds: checked to be a positive number of seconds or a
    `datetime.timedelta`, at most the timeout of the group `pg` (which bounds the
    backend's own waits, so a longer one could not be honoured). A `Deadline` is what a
    call made of several operations (the object collectives) hands each of them: the time
    it has left, already checked. A checked number or timedelta is recorded as the
    process's last per-operation timeout (`world.state.last_op_timeout`), which the
    recovery Manager's own collectives take by default.

    Raises:
        TypeError: `timeout` is neither a number (a bool is not one) nor a timedelta.
        ValueError: it is zero, negative or NaN, or longer than the group's timeout.
    """
    if isinstance(timeout, Deadline):
        return max(timeout.remaining() or 0.0, _LEAST_WAIT)
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float, np.integer, np.floating)) and not isinstance(
        timeout, bool
    ):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"{where}: timeout must be a number of seconds or a datetime.timedelta, got "
            f"{timeout!r} ({type(timeout).__name__}); pass e.g. timeout=30 or "
            "timeout=timedelta(seconds=30), or None for the group's timeout"
        )
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(
            f"{where}: timeout must be a positive number of seconds, got {timeout!r}; pass "
            "e.g. timeout=30, or None for the group's timeout"
        )
    limit = pg.timeout.total_seconds()
    if seconds > limit:
        raise ValueError(
            f"{where}: timeout={timeout!r} ({seconds:g} s) is longer than the timeout of "
            f"group '{pg.group_name}' ({limit:g} s), which bounds the backend's own waits, "
            f"so it cannot be honoured; pass at most {limit:g} s, or create the group with "
            "a longer timeout= in init_process_group or new_group"
        )
    state.last_op_timeout = seconds
    return seconds


def timed(
    pg: ProcessGroup,
    timeout: Any,
    where: str,
    async_op: bool,
    issue: Callable[..., Work | None],
    *args: Any,
) -> Work | None:
    """What a public function called with a `timeout` (not None) returns.

    It checks `timeout` (`op_timeout`), then issues the operation with `issue(*args)`
    (the function again, asked for async_op and no timeout, so that the flight recorder
    settles its entry when it completes or its wait expires), and makes `timeout` what the
    Work's `wait()` waits at most. An asynchronous call (`async_op`) gets that Work; a
    synchronous one waits for it here, up to `timeout`, and gets None (a device Work is
    waited on the host: its plain `wait()` would only order the caller's stream).

    Raises:
        DistTimeoutError: a synchronous call did not complete in time; the operation was
            cancelled (a pending receive, on tcp and gloo) or its group aborted.
    """
    seconds = op_timeout(timeout, pg, where)
    work = issue(*args)
    if work is None:  # this rank is not in the group
        return None
    work.set_default_timeout(seconds)
    if async_op:
        return work
    work.wait(seconds)
    return None
