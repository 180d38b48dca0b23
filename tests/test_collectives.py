"""Conformance: every op on every dtype, at every world size, on every CPU backend.

Each test body runs on all ranks of a persistent world (see conftest.World) and
checks its own results against values computed in closed form or with numpy from
the inputs every rank would have. Inputs are small integers, so sums, products and
averages are exact in every dtype and the checks use exact equality. The count that
crosses the ring threshold runs for every dtype under SUM and for every op on one dtype
(`ring_sized`), and broadcasts it from one root; the other cases use small counts.
"""

from __future__ import annotations

import functools
import warnings
from datetime import timedelta

import numpy as np
import pytest

import distcomm as dist
from distcomm.arrays import DTYPES
from distcomm.ops import ReduceOp
from distcomm.work import Future

ALL_DTYPES = [str(d) for d in DTYPES]
INT_DTYPES = [d for d in ALL_DTYPES if d == "bool" or d.startswith(("int", "uint"))]
FLOAT_DTYPES = [d for d in ALL_DTYPES if d.startswith(("float", "complex"))]
REAL_DTYPES = [d for d in ALL_DTYPES if not d.startswith("complex")]
COUNTS = (0, 1, 13, 600_001)  # 600_001 x 1+ bytes crosses the ring threshold (512 KiB)
SMALL_COUNTS = COUNTS[:-1]

_UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}


def valid(op: ReduceOp, dtype: str) -> bool:
    kind = np.dtype(dtype).kind
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        return kind in "biu"
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        return kind != "c"
    if op is ReduceOp.AVG:
        return kind in "fc"
    return True


OP_DTYPES = [(op, d) for op in ReduceOp for d in ALL_DTYPES if valid(op, d)]


def ring_sized(op: ReduceOp, dtype: str) -> bool:
    """Whether the all_reduce case also runs the count that crosses the ring threshold:
    every dtype under SUM (every item size the ring splits), and every other op on one
    dtype (the ring applies the same reduction as the small path, chunk by chunk)."""
    return op is ReduceOp.SUM or dtype == ("int32" if valid(op, "int32") else "float32")


def values(rank: int, count: int, dtype: str, op: ReduceOp = ReduceOp.SUM) -> np.ndarray:
    """Rank `rank`'s input: small integers whose reduction is exact in `dtype`."""
    i = np.arange(count)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return ((i + rank) % 3 == 0) if op is not ReduceOp.PRODUCT else ((i + rank) % 5 != 0)
    if op is ReduceOp.PRODUCT:
        raw = (i + rank) % 3 + 1
    elif op in (ReduceOp.MIN, ReduceOp.MAX):
        raw = (i * 7 + rank * 3) % 11 - (5 if dt.kind in "if" else 0)
    elif op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        raw = (i * 5 + rank * 3) % 64 + rank
    else:
        raw = (rank + 1) * (i % 5 + 1)
    out = raw.astype(dt)
    if dt.kind == "c":
        out = out + 1j * (rank % 2) * (i % 3).astype(dt)
    return out


def expected_reduction(n: int, count: int, dtype: str, op: ReduceOp) -> np.ndarray:
    inputs = [values(r, count, dtype, op) for r in range(n)]
    result = functools.reduce(lambda a, b: _UFUNC[op](a, b), inputs)
    if op is ReduceOp.AVG:
        result = result / np.array(n, dtype=result.dtype)
    return result.astype(dtype)


def check(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if not np.array_equal(actual, expected):
        bad = np.flatnonzero(actual.reshape(-1) != expected.reshape(-1))[:5]
        raise AssertionError(
            f"{what}: mismatch at {bad.tolist()}: got {actual.reshape(-1)[bad].tolist()}, "
            f"expected {expected.reshape(-1)[bad].tolist()} (rank {dist.get_rank()}/"
            f"{dist.get_world_size()})"
        )


# -- bodies (run on every rank) ----------------------------------------------------------------


def _all_reduce(op_value: int, dtype: str) -> None:
    op = ReduceOp(op_value)
    r, n = dist.get_rank(), dist.get_world_size()
    for count in COUNTS if ring_sized(op, dtype) else SMALL_COUNTS:
        x = values(r, count, dtype, op)
        dist.all_reduce(x, op=op)
        check(x, expected_reduction(n, count, dtype, op), f"all_reduce {op.name} x{count}")
    grid = values(r, 12, dtype, op).reshape(3, 4)
    dist.all_reduce(grid, op)
    check(grid, expected_reduction(n, 12, dtype, op).reshape(3, 4), "all_reduce 2-D")
    scalar = values(r, 1, dtype, op).reshape(())
    dist.all_reduce(scalar, op)
    check(scalar, expected_reduction(n, 1, dtype, op).reshape(()), "all_reduce 0-d")


@pytest.mark.parametrize("op,dtype", OP_DTYPES, ids=[f"{o.name}-{d}" for o, d in OP_DTYPES])
def test_all_reduce(world, op, dtype):
    world.run(_all_reduce, int(op), dtype)


def _all_reduce_async() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    arrays = [np.full(1000 * (k + 1), r + k, dtype=np.int64) for k in range(5)]
    works = [dist.all_reduce(a, async_op=True) for a in arrays]
    for k, (a, w) in enumerate(zip(arrays, works, strict=True)):
        assert w.wait() is True
        assert w.is_completed() and w.is_success() and w.exception() is None
        result = w.get_future().value()
        assert isinstance(result, list) and result[0] is a
        check(a, np.full(a.size, n * k + n * (n - 1) // 2, dtype=np.int64), f"async #{k}")
    # a synchronous op issued after async ones runs after them
    a = np.ones(10, dtype=np.float32)
    w = dist.all_reduce(a, async_op=True)
    b = np.full(10, 2.0, dtype=np.float32)
    dist.all_reduce(b)
    assert w.is_completed()
    check(a, np.full(10, n, dtype=np.float32), "async before sync")
    chained = (
        dist.all_reduce(np.ones(3), async_op=True)
        .get_future()
        .then(lambda fut: float(fut.value()[0].sum()))
    )
    assert chained.wait(30) == 3.0 * n


def test_all_reduce_async(world):
    world.run(_all_reduce_async)


def test_future_timeout_is_a_dist_timeout_error_and_its_state_is_public():
    future = Future()
    assert not future.done() and future.exception() is None
    assert future.wait_done(0.01) is False
    with pytest.raises(dist.DistTimeoutError, match=r"within 0\.01 s") as info:
        future.wait(0.01)
    assert isinstance(info.value, TimeoutError)
    error = ValueError("boom")
    future.set_exception(error)
    assert future.done() and future.wait_done(0) and future.exception() is error
    assert Future.completed([1]).exception() is None


def _broadcast(dtype: str) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    for root in range(n):  # the ring-sized count from the last root only
        for count in COUNTS if root == n - 1 else SMALL_COUNTS:
            x = values(r, count, dtype)
            dist.broadcast(x, src=root)
            check(x, values(root, count, dtype), f"broadcast from {root} x{count}")
    x = values(r, 6, dtype).reshape(2, 3)
    work = dist.broadcast(x, group_src=n - 1, async_op=True)
    work.wait()
    check(x, values(n - 1, 6, dtype).reshape(2, 3), "async broadcast")


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_broadcast(world, dtype):
    world.run(_broadcast, dtype)


def _reduce(op_value: int, dtype: str) -> None:
    op = ReduceOp(op_value)
    r, n = dist.get_rank(), dist.get_world_size()
    for root in range(n):
        for count in (0, 5, 40_001):
            x = values(r, count, dtype, op)
            dist.reduce(x, dst=root, op=op)
            want = (
                expected_reduction(n, count, dtype, op)
                if r == root
                else values(r, count, dtype, op)
            )
            check(x, want, f"reduce {op.name} to {root} x{count}")
    x = values(r, 4, dtype, op)
    dist.reduce(x, op=op)  # dst defaults to global rank 0
    if r == 0:
        check(x, expected_reduction(n, 4, dtype, op), "reduce default dst")


REDUCE_CASES = [
    (op, d)
    for op, d in OP_DTYPES
    if op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.BXOR)
]


@pytest.mark.parametrize("op,dtype", REDUCE_CASES, ids=[f"{o.name}-{d}" for o, d in REDUCE_CASES])
def test_reduce(world, op, dtype):
    world.run(_reduce, int(op), dtype)


def _all_gather(dtype: str) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    for count in (0, 1, 7, 30_000):
        mine = values(r, count, dtype)
        out = [np.empty(count, dtype=dtype) for _ in range(n)]
        dist.all_gather(out, mine)
        for k in range(n):
            check(out[k], values(k, count, dtype), f"all_gather[{k}] x{count}")
        flat = np.empty(n * count, dtype=dtype)
        dist.all_gather_single(flat, mine)
        check(
            flat, np.concatenate([values(k, count, dtype) for k in range(n)]), "all_gather_single"
        )
    mine = values(r, 6, dtype).reshape(2, 3)
    stacked = np.empty((n, 2, 3), dtype=dtype)
    dist.all_gather_single(stacked, mine, async_op=True).wait()
    check(stacked, np.stack([values(k, 6, dtype).reshape(2, 3) for k in range(n)]), "stacked")
    out = [np.empty((2, 3), dtype=dtype) for _ in range(n)]
    dist.all_gather(out, mine, async_op=True).wait()
    for k in range(n):
        check(out[k], values(k, 6, dtype).reshape(2, 3), "async all_gather")


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_all_gather(world, dtype):
    world.run(_all_gather, dtype)


def _gather_scatter(dtype: str) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    for root in range(n):
        for count in (0, 3, 20_000):
            mine = values(r, count, dtype)
            slots = [np.empty(count, dtype=dtype) for _ in range(n)] if r == root else None
            dist.gather(mine, slots, dst=root)
            if r == root:
                for k in range(n):
                    check(slots[k], values(k, count, dtype), f"gather[{k}] to {root}")
            out = np.empty(count, dtype=dtype)
            parts = [values(k + 10, count, dtype) for k in range(n)] if r == root else None
            dist.scatter(out, parts, src=root)
            check(out, values(r + 10, count, dtype), f"scatter from {root}")
    slots = [np.empty(2, dtype=dtype) for _ in range(n)] if r == 0 else None
    work = dist.gather(values(r, 2, dtype), slots, async_op=True)
    work.wait()
    if r == 0:
        for k in range(n):
            check(slots[k], values(k, 2, dtype), "async gather")


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_gather_scatter(world, dtype):
    world.run(_gather_scatter, dtype)


def _reduce_scatter(op_value: int, dtype: str) -> None:
    op = ReduceOp(op_value)
    r, n = dist.get_rank(), dist.get_world_size()
    for count in (0, 1, 9, 20_000):
        full = values(r, n * count, dtype, op)
        before = full.copy()
        out = np.empty(count, dtype=dtype)
        dist.reduce_scatter_single(out, full, op=op)
        want = expected_reduction(n, n * count, dtype, op)[r * count : (r + 1) * count]
        check(out, want, f"reduce_scatter_single {op.name} x{count}")
        check(full, before, "reduce_scatter_single input untouched")
        out2 = np.empty(count, dtype=dtype)
        dist.reduce_scatter(out2, [full[k * count : (k + 1) * count] for k in range(n)], op=op)
        check(out2, want, f"reduce_scatter {op.name} x{count}")


RS_CASES = [
    (op, d)
    for op, d in OP_DTYPES
    if op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BOR)
]


@pytest.mark.parametrize("op,dtype", RS_CASES, ids=[f"{o.name}-{d}" for o, d in RS_CASES])
def test_reduce_scatter(world, op, dtype):
    world.run(_reduce_scatter, int(op), dtype)


def _all_to_all(dtype: str) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    # equal splits along dim 0 of a 2-D array
    rows = 2 * n
    inp = values(r, rows * 3, dtype).reshape(rows, 3)
    out = np.empty_like(inp)
    dist.all_to_all_single(out, inp)
    for k in range(n):
        theirs = values(k, rows * 3, dtype).reshape(rows, 3)
        check(out[2 * k : 2 * k + 2], theirs[2 * r : 2 * r + 2], f"all_to_all_single from {k}")
    # uneven splits: rank r sends (r + j) % 3 rows to rank j
    in_splits = [(r + j) % 3 for j in range(n)]
    out_splits = [(k + r) % 3 for k in range(n)]
    inp = values(r + 100, sum(in_splits) * 2, dtype).reshape(-1, 2)
    out = np.empty((sum(out_splits), 2), dtype=dtype)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    at = 0
    for k in range(n):
        theirs = values(k + 100, sum((k + j) % 3 for j in range(n)) * 2, dtype).reshape(-1, 2)
        start = sum((k + j) % 3 for j in range(r))
        piece = theirs[start : start + out_splits[k]]
        check(out[at : at + out_splits[k]], piece, f"uneven all_to_all_single from {k}")
        at += out_splits[k]
    # list form with differently sized pieces
    send = [values(r * n + j, j + 1, dtype) for j in range(n)]
    recv = [np.empty(r + 1, dtype=dtype) for _ in range(n)]
    dist.all_to_all(recv, send)
    for k in range(n):
        check(recv[k], values(k * n + r, r + 1, dtype), f"all_to_all from {k}")
    work = dist.all_to_all(recv, send, async_op=True)
    work.wait()


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint64", "float16", "float64", "complex128"])
def test_all_to_all(world, dtype):
    world.run(_all_to_all, dtype)


def _barriers() -> None:
    n = dist.get_world_size()
    for _ in range(3):
        dist.barrier()
    dist.barrier(async_op=True).wait()
    dist.monitored_barrier(timeout=30)
    dist.monitored_barrier(timeout=30, wait_all_ranks=True)
    return n


def test_barriers(world):
    assert world.run(_barriers) == [world.size] * world.size


def _point_to_point(dtype: str) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    for count in (0, 1, 50_000):
        # both sides post the receive first, then send: must not deadlock
        buf = np.empty(count, dtype=dtype)
        work = dist.irecv(buf, src=left, tag=7)
        dist.send(values(r, count, dtype), dst=right, tag=7)
        work.wait()
        check(buf, values(left, count, dtype), f"irecv x{count}")
        assert work.source_rank() == left
    # messages with different tags are matched by tag, same tag in order
    if r == 0:
        for k in range(3):
            dist.send(np.full(2, k, dtype=dtype), dst=1, tag=1)
        dist.send(np.full(2, 9, dtype=dtype), dst=1, tag=2)
    elif r == 1:
        late = np.empty(2, dtype=dtype)
        assert dist.recv(late, src=0, tag=2) == 0
        check(late, np.full(2, 9, dtype=dtype), "tag 2")
        for k in range(3):
            got = np.empty(2, dtype=dtype)
            dist.recv(got, src=0, tag=1)
            check(got, np.full(2, k, dtype=dtype), f"tag 1 #{k}")
    # any-source: rank 0 hears from every other rank, in whatever order they arrive
    if r == 0:
        heard = set()
        for _ in range(n - 1):
            got = np.empty(3, dtype=dtype)
            sender = dist.recv(got, tag=5)
            check(got, values(sender, 3, dtype), f"any-source from {sender}")
            heard.add(sender)
        assert heard == set(range(1, n))
    else:
        dist.send(values(r, 3, dtype), dst=0, tag=5)
    # batch_isend_irecv ring exchange
    out = np.empty(4, dtype=dtype)
    ops = [dist.P2POp(dist.isend, values(r, 4, dtype), right), dist.P2POp(dist.irecv, out, left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    check(out, values(left, 4, dtype), "batch_isend_irecv")
    dist.barrier()


@pytest.mark.parametrize("dtype", ["bool", "int16", "uint32", "float32", "complex64"])
def test_point_to_point(world, dtype):
    world.run(_point_to_point, dtype)


class _Opaque:
    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Opaque) and other.value == self.value


def _objects() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    payload = {"rank": r, "blob": "x" * (r * 1000), "obj": _Opaque(r), "arr": np.arange(r)}
    gathered = [None] * n
    dist.all_gather_object(gathered, payload)
    for k, item in enumerate(gathered):
        assert item["rank"] == k and item["obj"] == _Opaque(k) and len(item["blob"]) == k * 1000
    objects = [1, "two", {"three": 3}] if r == n - 1 else [None, None, None]
    dist.broadcast_object_list(objects, src=n - 1)
    assert objects == [1, "two", {"three": 3}]
    slots = [None] * n if r == 0 else None
    dist.gather_object(("from", r), slots, dst=0)
    if r == 0:
        assert slots == [("from", k) for k in range(n)]
    out = [None]
    dist.scatter_object_list(out, [f"item {k}" * (k + 1) for k in range(n)] if r == 0 else None)
    assert out == [f"item {r}" * (r + 1)]
    if n > 1:
        if r == 0:
            dist.send_object_list([{"a": 1}, [2, 3]], dst=1)
        elif r == 1:
            got = [None, None]
            assert dist.recv_object_list(got) == 0
            assert got == [{"a": 1}, [2, 3]]
    dist.barrier()


def test_object_collectives(world):
    world.run(_objects)


def _subgroups() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    evens = [k for k in range(n) if k % 2 == 0]
    group = dist.new_group(ranks=list(reversed(evens)))
    try:
        if r in evens:
            assert dist.get_process_group_ranks(group) == evens
            assert dist.get_rank(group) == evens.index(r)
            assert dist.get_world_size(group) == len(evens)
            assert dist.get_global_rank(group, dist.get_rank(group)) == r
            assert dist.get_group_rank(group, r) == evens.index(r)
            x = np.full(5, r + 1, dtype=np.int32)
            dist.all_reduce(x, group=group)
            check(x, np.full(5, sum(k + 1 for k in evens), dtype=np.int32), "subgroup sum")
            y = np.full(3, r, dtype=np.float64)
            dist.broadcast(y, src=evens[-1], group=group)  # src is a global rank
            check(y, np.full(3, evens[-1], dtype=np.float64), "subgroup broadcast")
            z = np.full(3, r, dtype=np.float64)
            dist.broadcast(z, group=group, group_src=0)
            check(z, np.zeros(3), "subgroup group_src")
            objs = [None] * len(evens)
            dist.all_gather_object(objs, r, group=group)
            assert objs == evens
        else:  # as in torch: a handle that makes every collective a no-op, with a warning
            assert group == dist.GroupMember.NON_GROUP_MEMBER
            assert dist.get_rank(group) == -1
            assert dist.get_world_size(group) == -1
            x, objs = np.arange(3.0), ["kept"]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert dist.all_reduce(x, group=group) is None
                assert dist.all_reduce(x, group=group, async_op=True) is None  # warned once
                assert dist.broadcast(x, src=evens[0], group=group) is None
                assert dist.broadcast_object_list(objs, src=evens[0], group=group) is None
                assert dist.recv(x, src=evens[0], group=group) == -1
                assert dist.barrier(group=group) is None
            check(x, np.arange(3.0), "a non-member's array")
            assert objs == ["kept"]
            assert [str(w.message) for w in caught] == [
                f"Running {op} on global rank {r} which does not belong to the given group."
                for op in ("all_reduce", "broadcast", "broadcast_object_list", "irecv", "barrier")
            ]
            dist.destroy_process_group(group)  # nothing to destroy here: a no-op
        # sort_ranks=False: the group ranks follow the order given
        backwards = dist.new_group(list(reversed(range(n))), sort_ranks=False)
        assert dist.get_rank(backwards) == n - 1 - r
        assert dist.get_process_group_ranks(backwards) == list(reversed(range(n)))
        b = np.full(2, r, dtype=np.int64)
        dist.broadcast(b, group=backwards, group_src=0)  # group rank 0: global rank n - 1
        check(b, np.full(2, n - 1, dtype=np.int64), "unsorted group's group_src")
        dist.destroy_process_group(backwards)
        # the world still works while the subgroup exists
        w = np.ones(2)
        dist.all_reduce(w)
        check(w, np.full(2, float(n)), "world after subgroup")
    finally:
        if r in evens:
            dist.destroy_process_group(group)
    dist.barrier()


def test_subgroups(world):
    world.run(_subgroups)


def _many_subgroups() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    current, every = dist.new_subgroups(group_size=1)
    assert len(every) == n and every[r] is current and dist.get_world_size(current) == 1
    assert [dist.get_rank(g) for g in every] == [0 if k == r else -1 for k in range(n)]
    pairs = [[k, k + 1] for k in range(0, n - 1, 2)]
    if pairs:
        current, every = dist.new_subgroups_by_enumeration(pairs)
        if r < 2 * len(pairs):
            assert every[r // 2] is current
            x = np.full(3, r, dtype=np.int64)
            dist.all_reduce(x, group=current)
            check(x, np.full(3, 2 * (r - r % 2) + 1, dtype=np.int64), "pair sum")
        else:
            assert current is None  # the odd rank out
    for bad, text in (((n + 1,), "must not exceed"), ((0,), "positive")):
        try:
            dist.new_subgroups(*bad)
        except ValueError as exc:
            assert text in str(exc), exc
        else:
            raise AssertionError(f"new_subgroups{bad} did not raise")
    try:
        dist.new_subgroups_by_enumeration([[0], [0]])
    except ValueError as exc:
        assert "rank 0 appears in both subgroup [0] and [0]" in str(exc), exc
    else:
        raise AssertionError("overlapping subgroups were accepted")
    dist.barrier()


def test_new_subgroups(world):
    world.run(_many_subgroups)


def _coalesced(dtype: str) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    shapes = [(3,), (2, 4), (0,), ()]
    arrays = [values(r, int(np.prod(s)), dtype).reshape(s) for s in shapes]
    assert dist.all_reduce_coalesced(arrays) is None
    for s, a in zip(shapes, arrays, strict=True):
        check(
            a,
            expected_reduction(n, int(np.prod(s)), dtype, ReduceOp.SUM).reshape(s),
            f"all_reduce_coalesced {s}",
        )
    inputs = [values(r, 5, dtype), values(r + 7, 6, dtype).reshape(2, 3)]
    outputs = [[np.empty(5, dtype), np.empty((2, 3), dtype)] for _ in range(n)]
    work = dist.all_gather_coalesced(outputs, inputs, async_op=True)
    work.wait()
    for k in range(n):
        check(outputs[k][0], values(k, 5, dtype), f"all_gather_coalesced[{k}][0]")
        check(outputs[k][1], values(k + 7, 6, dtype).reshape(2, 3), f"[{k}][1]")
    try:
        dist.all_reduce_coalesced([np.ones(2, np.float32), np.ones(2, np.float64)])
    except TypeError as exc:
        assert "dtype" in str(exc), exc
    else:
        raise AssertionError("mixed dtypes were accepted")


@pytest.mark.parametrize("dtype", ["int32", "float64", "complex64"])
def test_coalesced(world, dtype):
    world.run(_coalesced, dtype)


def _premul_sum(dtype: str) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    dt = np.dtype(dtype)
    factor = 0.5 if dt.kind == "f" else 0.5 - 0.25j
    op = ReduceOp.PREMUL_SUM(factor)
    scaled = [(k + 1) * (np.arange(6) % 5 + 1).astype(dt) * dt.type(factor) for k in range(n)]
    total = functools.reduce(np.add, scaled)

    x = ((r + 1) * (np.arange(6) % 5 + 1)).astype(dt)
    dist.all_reduce(x, op=op)
    check(x, total, "all_reduce PREMUL_SUM")

    mine = ((r + 1) * (np.arange(6) % 5 + 1)).astype(dt)
    kept = mine.copy()
    dist.reduce(mine, dst=0, op=op)
    check(mine, total if r == 0 else kept, "reduce PREMUL_SUM (dst the sum, others unchanged)")

    big = np.concatenate([((r + 1) * (np.arange(6) % 5 + 1)).astype(dt)] * n)
    before = big.copy()
    out = np.empty(6, dtype=dt)
    dist.reduce_scatter_single(out, big, op=op)
    check(out, total, "reduce_scatter_single PREMUL_SUM")
    check(big, before, "reduce_scatter_single keeps its input")
    pieces = [((r + 1) * (np.arange(6) % 5 + 1)).astype(dt) for _ in range(n)]
    dist.reduce_scatter(out, pieces, op=op)
    check(out, total, "reduce_scatter PREMUL_SUM")
    check(pieces[0], before[:6], "reduce_scatter keeps its inputs")

    parts = [((r + 1) * (np.arange(6) % 5 + 1)).astype(dt)[:k] for k in (2, 6)]
    dist.all_reduce_coalesced(parts, op=op)
    check(parts[0], total[:2], "all_reduce_coalesced PREMUL_SUM")
    check(parts[1], total, "all_reduce_coalesced PREMUL_SUM")

    work = dist.all_reduce(x, op=ReduceOp.PREMUL_SUM(np.array([2.0])), async_op=True)
    work.wait()
    check(x, total * dt.type(2 * n), "async all_reduce PREMUL_SUM with an array factor")

    for bad_op, bad_array, words in [
        (ReduceOp.PREMUL_SUM, x, "needs its factor"),
        (ReduceOp.PREMUL_SUM(2.0), np.ones(2, dtype=np.int32), "floating or complex"),
    ]:
        try:
            dist.all_reduce(bad_array, op=bad_op)
        except TypeError as exc:
            assert words in str(exc), exc
        else:
            raise AssertionError(f"all_reduce accepted {bad_op!r} on {bad_array.dtype}")


@pytest.mark.parametrize("dtype", ["float64", "complex128"])
def test_premul_sum(world, dtype):
    world.run(_premul_sum, dtype)


def test_premul_sum_factor_must_be_a_number():
    for bad in ("2", None, True, np.ones(2)):
        with pytest.raises((TypeError, ValueError), match="PREMUL_SUM"):
            ReduceOp.PREMUL_SUM(bad)
    assert str(ReduceOp.PREMUL_SUM(0.5)) == "PREMUL_SUM(0.5)"
    assert len(list(ReduceOp)) == 8 and dist.supports_complex(ReduceOp.PREMUL_SUM(1.0))


def _split_groups() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        splits = [[0]]
    elif n == 2:
        splits = [[1, 0]]  # one group of both, given unsorted
    else:
        splits = [list(range(n // 2)), list(range(n // 2, n - 1))]  # the last rank: none
    mine = next((sorted(s) for s in splits if r in s), None)
    group = dist.split_group(split_ranks=splits)
    if mine is None:
        assert group is None, group
    else:
        assert dist.get_process_group_ranks(group) == mine, group
        x = np.full(3, r + 1, dtype=np.int64)
        dist.all_reduce(x, group=group)
        check(x, np.full(3, sum(k + 1 for k in mine), dtype=np.int64), "all_reduce in a split")
        dist.destroy_process_group(group)
    # a split of a subgroup whose group ranks run backwards: group rank 0 is global n-1
    backwards = dist.new_group(list(reversed(range(n))), sort_ranks=False)
    last = dist.split_group(backwards, [[0]], group_desc="last")
    if r == n - 1:
        assert dist.get_process_group_ranks(last) == [n - 1] and last.group_name == "last"
        y = np.ones(2)
        dist.all_reduce(y, group=last)
        check(y, np.ones(2), "all_reduce in a split of a subgroup")
        dist.destroy_process_group(last)
    else:
        assert last is None
    for bad, words in [
        ([], "split_ranks must list"),
        ([[0], [0]], "must not overlap"),
        ([[n]], "out of range"),
        ([[]], "is empty"),
        ("01", "list of lists"),
    ]:
        try:
            dist.split_group(split_ranks=bad)
        except (TypeError, ValueError) as exc:
            assert words in str(exc), exc
        else:
            raise AssertionError(f"split_group accepted {bad!r}")
    dist.destroy_process_group(backwards)
    dist.barrier()


def test_split_group(world):
    world.run(_split_groups)


def _group_methods() -> None:
    """torch's method API of a group: both overloads of each, roots as group ranks."""
    from distcomm.group_methods import AllgatherOptions

    r, n = dist.get_rank(), dist.get_world_size()
    pg = dist.group.WORLD
    total = n * (n - 1) / 2
    x = np.full(3, float(r))
    pg.allreduce([x]).wait()
    check(x, np.full(3, total), "pg.allreduce([x])")
    x = np.full(3, float(r + 1))
    pg.allreduce(x, dist.ReduceOp.MAX, timedelta(seconds=60)).wait()
    check(x, np.full(3, float(n)), "pg.allreduce(x, op, timeout)")
    parts = [np.full(2, float(r)), np.full(1, float(r))]
    pg.allreduce_coalesced(parts, dist.AllreduceCoalescedOptions()).wait()
    check(parts[1], np.full(1, total), "pg.allreduce_coalesced")
    root = n - 1
    b = np.full(2, float(r))
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    pg.broadcast([b], opts).wait()
    check(b, np.full(2, float(root)), "pg.broadcast([b], opts)")
    b = np.full(2, float(r))
    pg.broadcast(b, 0).wait()
    check(b, np.zeros(2), "pg.broadcast(b, root)")
    red = np.full(2, float(r))
    ropts = dist.ReduceOptions()
    ropts.rootRank, ropts.reduceOp = root, dist.ReduceOp.SUM
    pg.reduce([red], ropts).wait()
    if r == root:
        check(red, np.full(2, total), "pg.reduce on the root")
    outs = [np.empty(2) for _ in range(n)]
    pg.allgather([outs], [np.full(2, float(r))], AllgatherOptions()).wait()
    check(np.stack(outs), np.repeat(np.arange(n, dtype=float), 2).reshape(n, 2), "allgather")
    flat = np.empty(2 * n)
    pg.all_gather_single(flat, np.full(2, float(r))).wait()
    check(flat, np.repeat(np.arange(n, dtype=float), 2), "pg.all_gather_single")
    gathered = [np.empty(1) for _ in range(n)] if r == 0 else []
    pg.gather([gathered], [np.full(1, float(r))], dist.GatherOptions()).wait()
    if r == 0:
        check(np.concatenate(gathered), np.arange(n, dtype=float), "pg.gather")
    got = np.empty(1)
    pg.scatter(got, [np.full(1, float(k)) for k in range(n)] if r == 0 else [], 0).wait()
    check(got, np.full(1, float(r)), "pg.scatter(out, inputs, root)")
    rs = np.empty(1)
    pg.reduce_scatter(
        [rs], [[np.full(1, float(k)) for k in range(n)]], dist.ReduceScatterOptions()
    ).wait()
    check(rs, np.full(1, float(n * r)), "pg.reduce_scatter")
    rss = np.empty(1)
    pg.reduce_scatter_single(rss, np.arange(n, dtype=float)).wait()
    check(rss, np.full(1, float(n * r)), "pg.reduce_scatter_single")
    a2a = [np.empty(1) for _ in range(n)]
    pg.alltoall(
        a2a, [np.full(1, float(r * n + k)) for k in range(n)], dist.AllToAllOptions()
    ).wait()
    check(np.concatenate(a2a), np.array([float(k * n + r) for k in range(n)]), "pg.alltoall")
    base = np.empty(n)
    pg.alltoall_base(base, np.array([float(r * n + k) for k in range(n)]), [], []).wait()
    check(base, np.array([float(k * n + r) for k in range(n)]), "pg.alltoall_base")
    pg.barrier(dist.BarrierOptions()).wait()
    pg.barrier().wait()
    if n > 1:
        peer = (r + 1) % n
        sent = pg.send([np.full(2, float(r))], peer, 7)
        into = np.empty(2)
        pg.recv([into], (r - 1) % n, 7).wait()
        sent.wait()
        check(into, np.full(2, float((r - 1) % n)), "pg.send/recv")
    try:
        pg.allreduce([x, x])
    except ValueError as exc:
        assert "one array" in str(exc), exc
    else:
        raise AssertionError("pg.allreduce took two arrays")


def test_group_methods(world):
    world.run(_group_methods)


def _local_groups() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    members = [0, 1] if n > 1 else [0]
    local = None
    if r in members:  # only the members call it
        local = dist.new_group(members, use_local_synchronization=True)
        again = dist.new_group(members, use_local_synchronization=True)  # same ranks again
        x = np.full(2, r + 1, dtype=np.int64)
        dist.all_reduce(x, group=again)
        check(x, np.full(2, sum(k + 1 for k in members), dtype=np.int64), "second local")
        dist.destroy_process_group(again)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert (
                dist.new_group(members, use_local_synchronization=True)
                == dist.GroupMember.NON_GROUP_MEMBER
            )
    everyone = dist.new_group()  # every rank: they still agree which group this is
    y = np.full(2, r, dtype=np.int64)
    dist.all_reduce(y, group=everyone)
    check(y, np.full(2, n * (n - 1) // 2, dtype=np.int64), "global after local")
    if local is not None:
        z = np.ones(3)
        dist.all_reduce(z, group=local)
        check(z, np.full(3, float(len(members))), "local group")
        dist.destroy_process_group(local)
    dist.destroy_process_group(everyone)
    dist.barrier()


def test_new_group_with_local_synchronization(world):
    world.run(_local_groups)


class _DLPackOnly:
    """Exposes a numpy array through the DLPack protocol only (like a CPU torch tensor)."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def _dlpack() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    base = np.full(4, r + 1, dtype=np.float32)
    wrapped = _DLPackOnly(base)
    if np.from_dlpack(wrapped).flags.writeable:
        dist.all_reduce(wrapped)
        check(base, np.full(4, n * (n + 1) / 2, dtype=np.float32), "all_reduce via DLPack")
    out = np.empty(4 * n, dtype=np.float32)
    dist.all_gather_single(out, _DLPackOnly(np.full(4, r, dtype=np.float32)))
    check(out, np.repeat(np.arange(n, dtype=np.float32), 4), "DLPack input")


def test_dlpack_arrays(world):
    world.run(_dlpack)
