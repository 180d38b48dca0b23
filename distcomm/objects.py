"""Object collectives: picklable Python objects moved with the array collectives.

Objects are pickled to uint8 arrays; sizes travel first so every receiver can size
its buffer. Unpickling runs code chosen by the sender: use these only between
processes you trust (set DISTCOMM_AUTH_KEY so no outsider can join the group).

Each takes `timeout=` (seconds or a timedelta, at most the group's timeout): one deadline
for the whole call, which its two or three array operations share; on expiry the group is
aborted and `DistTimeoutError` raised, as for the collectives (`distcomm.collectives`).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from . import collectives as c
from ._calls import op_timeout, rank_arg
from .deadline import Deadline
from .process_group import ProcessGroup
from .world import outside, resolve

__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
]


def _dump(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)


def _load(data: np.ndarray) -> Any:
    return pickle.loads(data.tobytes())


def _deadline(timeout: Any, pg: ProcessGroup, where: str) -> Deadline | None:
    """The deadline of a call given `timeout=` (None: none of its own, the group's timeout
    bounds each operation), checked before any operation is issued."""
    return None if timeout is None else Deadline(op_timeout(timeout, pg, where))


def _padded(obj: Any, pg: ProcessGroup, deadline: Deadline | None) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's pickled size, and this rank's pickle zero-padded to the largest."""
    mine = _dump(obj)
    sizes = np.zeros(pg.size(), dtype=np.int64)
    c.all_gather_single(sizes, np.array([mine.size], dtype=np.int64), group=pg, timeout=deadline)
    padded = np.zeros(int(sizes.max()), dtype=np.uint8)
    padded[: mine.size] = mine
    return sizes, padded


def _check_list(value: Any, where: str, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"{where}: {name} must be a list, got {type(value).__name__}")
    return value


def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_src: int | None = None,
    *,
    timeout: Any = None,
) -> None:
    """Replace `object_list`'s items on every rank with `src`'s (default src: global rank 0).

    Every rank passes a list of the same length.

    Args:
        timeout: seconds or timedelta bounding this call (default: the group's timeout
            bounds each of its operations).
    """
    del device
    if outside(group, "broadcast_object_list"):
        return None
    pg = resolve(group, "broadcast_object_list")
    _check_list(object_list, "broadcast_object_list", "object_list")
    root = rank_arg(pg, src, group_src, "broadcast_object_list", "src", default=0)
    deadline = _deadline(timeout, pg, "broadcast_object_list")
    sizes = np.zeros(len(object_list), dtype=np.int64)
    if pg.rank() == root:
        pieces = [_dump(obj) for obj in object_list]
        sizes[:] = [p.size for p in pieces]
    c.broadcast(sizes, group=pg, group_src=root, timeout=deadline)
    data = (
        np.concatenate(pieces)
        if pg.rank() == root and pieces
        else np.empty(int(sizes.sum()), dtype=np.uint8)
    )
    c.broadcast(data, group=pg, group_src=root, timeout=deadline)
    if pg.rank() != root:
        at = 0
        for i, size in enumerate(sizes):
            object_list[i] = _load(data[at : at + size])
            at += int(size)


def all_gather_object(
    object_list: list[Any], obj: Any, group: ProcessGroup | None = None, *, timeout: Any = None
) -> None:
    """Fill `object_list` (one slot per rank) with every rank's `obj`, in rank order.

    Args:
        timeout: seconds or timedelta bounding this call (default: the group's timeout
            bounds each of its operations).
    """
    if outside(group, "all_gather_object"):
        return None
    pg = resolve(group, "all_gather_object")
    _check_list(object_list, "all_gather_object", "object_list")
    n = pg.size()
    if len(object_list) != n:
        raise ValueError(
            f"all_gather_object: object_list must have one slot per rank ({n}), "
            f"got {len(object_list)}"
        )
    deadline = _deadline(timeout, pg, "all_gather_object")
    sizes, padded = _padded(obj, pg, deadline)
    width = padded.size
    gathered = np.empty(n * width, dtype=np.uint8)
    c.all_gather_single(gathered, padded, group=pg, timeout=deadline)
    for i in range(n):
        object_list[i] = _load(gathered[i * width : i * width + sizes[i]])


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    group_dst: int | None = None,
    *,
    timeout: Any = None,
) -> None:
    """Collect every rank's `obj` into `dst`'s `object_gather_list` (default dst: rank 0).

    Args:
        timeout: seconds or timedelta bounding this call (default: the group's timeout
            bounds each of its operations).
    """
    if outside(group, "gather_object"):
        return None
    pg = resolve(group, "gather_object")
    root = rank_arg(pg, dst, group_dst, "gather_object", "dst", default=0)
    n = pg.size()
    if pg.rank() == root:
        if (
            object_gather_list is None
            or len(_check_list(object_gather_list, "gather_object", "object_gather_list")) != n
        ):
            raise ValueError(
                f"gather_object: object_gather_list must be a list with one slot "
                f"per rank ({n}) on dst"
            )
    elif object_gather_list is not None:
        raise ValueError("gather_object: object_gather_list must be None on ranks other than dst")
    deadline = _deadline(timeout, pg, "gather_object")
    sizes, padded = _padded(obj, pg, deadline)
    slots = (
        [np.empty(padded.size, dtype=np.uint8) for _ in range(n)] if (pg.rank() == root) else None
    )
    c.gather(padded, slots, group=pg, group_dst=root, timeout=deadline)
    if slots is not None:
        for i in range(n):
            object_gather_list[i] = _load(slots[i][: sizes[i]])


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: ProcessGroup | None = None,
    group_src: int | None = None,
    *,
    timeout: Any = None,
) -> None:
    """Give rank i item i of `src`'s input list, in `scatter_object_output_list[0]`.

    Args:
        timeout: seconds or timedelta bounding this call (default: the group's timeout
            bounds each of its operations).
    """
    if outside(group, "scatter_object_list"):
        return None
    pg = resolve(group, "scatter_object_list")
    out = _check_list(
        scatter_object_output_list, "scatter_object_list", "scatter_object_output_list"
    )
    if not out:
        raise ValueError(
            "scatter_object_list: scatter_object_output_list must have at least "
            "one slot (the result goes in slot 0)"
        )
    root = rank_arg(pg, src, group_src, "scatter_object_list", "src", default=0)
    deadline = _deadline(timeout, pg, "scatter_object_list")
    n = pg.size()
    sizes = np.zeros(n, dtype=np.int64)
    pieces: list[np.ndarray] = []
    if pg.rank() == root:
        items = (
            _check_list(
                scatter_object_input_list, "scatter_object_list", "scatter_object_input_list"
            )
            if (scatter_object_input_list is not None)
            else None
        )
        if items is None or len(items) != n:
            raise ValueError(
                f"scatter_object_list: scatter_object_input_list must hold one "
                f"object per rank ({n}) on src"
            )
        pieces = [_dump(obj) for obj in items]
        sizes[:] = [p.size for p in pieces]
    c.broadcast(sizes, group=pg, group_src=root, timeout=deadline)
    width = int(sizes.max())
    slots = None
    if pg.rank() == root:
        slots = [np.zeros(width, dtype=np.uint8) for _ in range(n)]
        for slot, piece in zip(slots, pieces, strict=True):
            slot[: piece.size] = piece
    mine = np.empty(width, dtype=np.uint8)
    c.scatter(mine, slots, group=pg, group_src=root, timeout=deadline)
    out[0] = _load(mine[: sizes[pg.rank()]])


def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_dst: int | None = None,
    use_batch: bool = False,
    *,
    timeout: Any = None,
) -> None:
    """Send the objects of `object_list` to `dst` (received with `recv_object_list`).

    `use_batch` (torch's: post the two messages as one batch) is accepted; the sizes and
    the data go out in order either way.

    Args:
        timeout: seconds or timedelta bounding this call (default: the group's timeout
            bounds each of its operations).
    """
    del device, use_batch
    if outside(group, "send_object_list"):
        return None
    pg = resolve(group, "send_object_list")
    _check_list(object_list, "send_object_list", "object_list")
    deadline = _deadline(timeout, pg, "send_object_list")
    pieces = [_dump(obj) for obj in object_list]
    sizes = np.array([p.size for p in pieces], dtype=np.int64)
    c.send(sizes, dst, group=pg, group_dst=group_dst, timeout=deadline)
    data = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.uint8)
    c.send(data, dst, group=pg, group_dst=group_dst, timeout=deadline)


def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_src: int | None = None,
    use_batch: bool = False,
    *,
    timeout: Any = None,
) -> int:
    """Receive objects into `object_list` (same length as the sender's); returns the sender.

    With `src` None, the first sender of a matching list is received from. `use_batch` is
    accepted as in `send_object_list`.

    Args:
        timeout: seconds or timedelta bounding this call (default: the group's timeout
            bounds each of its operations).
    """
    del device, use_batch
    if outside(group, "recv_object_list"):
        return -1
    pg = resolve(group, "recv_object_list")
    _check_list(object_list, "recv_object_list", "object_list")
    deadline = _deadline(timeout, pg, "recv_object_list")
    sizes = np.zeros(len(object_list), dtype=np.int64)
    sender = c.recv(sizes, src, group=pg, group_src=group_src, timeout=deadline)
    data = np.empty(int(sizes.sum()), dtype=np.uint8)
    c.recv(data, sender, group=pg, timeout=deadline)
    at = 0
    for i, size in enumerate(sizes):
        object_list[i] = _load(data[at : at + size])
        at += int(size)
    return sender
