"""Uneven collectives: arrays of a different size per rank in all_gather, gather, scatter
and all_to_all, and all_gather_v and reduce_scatter_v.

Every body runs on all ranks of a persistent world (conftest's `world`: every CPU backend
and variant at world sizes 1-4) and checks its results against numpy's, from inputs every
rank can compute; the size patterns include zero-size pieces, an even one and one large
piece. The same module runs under mpiexec at 1-4 processes for the mpi backend
(`test_under_mpiexec`, through tests/mpi_world.py), and on the nccl backend over the CuPy
and NCCL stand-in (tests/cuda_standin.py, ranks as threads). Argument errors are checked
in a 1-rank group in the test process.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import distcomm as dist
from distcomm.ops import ReduceOp
from tests.conftest import UNDER_MPIEXEC
from tests.harness import run_ranks
from tests.mpijobs import (  # noqa: F401 - the fixture applies to every test here
    LAUNCHER,
    SKIP_REASON,
    job_env,
    no_mpi_segment_left,
    run,
)
from tests.test_collectives import check, expected_reduction, valid, values
from tests.test_nccl_standin import Rank, cuda, make_cluster, same  # noqa: F401 - fixtures

DTYPES = ["float32", "int64", "bool", "float16", "complex128", "uint8"]
#: reduce_scatter_v: SUM on every dtype above, each other op on one dtype it takes
RSV_CASES = [(ReduceOp.SUM, d) for d in DTYPES] + [
    (op, "float64" if op is ReduceOp.AVG else "int32")
    for op in ReduceOp
    if op is not ReduceOp.SUM and valid(op, "int32" if op is not ReduceOp.AVG else "float64")
]
#: runs in the test process (a 1-rank group, the stand-in, the mpiexec launcher): not in
#: the ranks of an mpiexec job, which run only the world tests
local = pytest.mark.skipif(UNDER_MPIEXEC, reason="runs in the test process, not under mpiexec")


def patterns(n: int) -> list[list[int]]:
    """Element counts per rank: zero-size pieces, even ones, one large piece (past the
    inline and ring thresholds of the CPU engine)."""
    return [
        [(3 * k) % 4 for k in range(n)],
        [(3 * k + 1) % 4 for k in range(n)],
        [5] * n,
        [0] * n,
        [40_000 if k == n - 1 else k for k in range(n)],
    ]


# -- bodies, run on every rank ------------------------------------------------------------------


def _all_gather(dtype: str) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    for sizes in patterns(n):
        for fn in (dist.all_gather, dist.all_gather_v):
            mine = values(r, sizes[r], dtype)
            out = [np.empty(s, dtype=dtype) for s in sizes]
            assert fn(out, mine) is None
            for k in range(n):
                check(out[k], values(k, sizes[k], dtype), f"{fn.__name__}[{k}] of {sizes}")
    # shaped slots, asynchronously: rank k contributes k + 1 rows of 2
    mine = values(r, 2 * (r + 1), dtype).reshape(r + 1, 2)
    out = [np.empty((k + 1, 2), dtype=dtype) for k in range(n)]
    work = dist.all_gather_v(out, mine, async_op=True)
    assert work.wait() is True
    assert all(a is b for a, b in zip(work.get_future().value(), out, strict=True))
    for k in range(n):
        check(out[k], values(k, 2 * (k + 1), dtype).reshape(k + 1, 2), f"async all_gather_v[{k}]")


def _gather_scatter(dtype: str) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    for sizes in patterns(n):
        for root in range(n):
            slots = [np.empty(s, dtype=dtype) for s in sizes] if r == root else None
            dist.gather(values(r + root, sizes[r], dtype), slots, dst=root)
            if r == root:
                for k in range(n):
                    check(slots[k], values(k + root, sizes[k], dtype), f"gather[{k}] of {sizes}")
            out = np.empty(sizes[r], dtype=dtype)
            parts = [values(k + 2 * root, s, dtype) for k, s in enumerate(sizes)]
            dist.scatter(out, parts if r == root else None, src=root)
            check(out, values(r + 2 * root, sizes[r], dtype), f"scatter from {root} of {sizes}")
    # both asynchronously, issued before either is waited for, and group ranks as roots
    sizes, root = [k % 3 for k in range(n)], n - 1
    slots = [np.empty(s, dtype=dtype) for s in sizes] if r == root else []
    gathered = dist.gather(values(r, sizes[r], dtype), slots, group_dst=root, async_op=True)
    out = np.empty((sizes[r], 1), dtype=dtype)
    parts = [values(k + 5, s, dtype).reshape(s, 1) for k, s in enumerate(sizes)]
    scattered = dist.scatter(out, parts if r == root else None, group_src=root, async_op=True)
    assert scattered.wait() is True and gathered.wait() is True
    check(out, values(r + 5, sizes[r], dtype).reshape(-1, 1), "async scatter")
    if r == root:
        for k in range(n):
            check(slots[k], values(k, sizes[k], dtype), f"async gather[{k}]")


def _reduce_scatter_v(op_value: int, dtype: str) -> None:
    op = ReduceOp(op_value)
    r, n = dist.get_rank(), dist.get_world_size()
    for sizes in patterns(n):
        inputs = [values(r, s, dtype, op) for s in sizes]
        kept = [a.copy() for a in inputs]
        out = np.empty(sizes[r], dtype=dtype)
        dist.reduce_scatter_v(out, inputs, op=op)
        check(out, expected_reduction(n, sizes[r], dtype, op), f"{op.name} of {sizes}")
        for a, b in zip(inputs, kept, strict=True):
            check(a, b, "reduce_scatter_v leaves its inputs alone")
    sizes = [k + 1 for k in range(n)]
    out = np.empty(sizes[r], dtype=dtype)
    work = dist.reduce_scatter_v(out, [values(r, s, dtype, op) for s in sizes], op, async_op=True)
    work.wait()
    check(out, expected_reduction(n, sizes[r], dtype, op), f"async {op.name}")


def _premul_sum() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    sizes = [2 * k + 1 for k in range(n)]
    out = np.empty(sizes[r], dtype=np.float64)
    inputs = [np.full(s, r + 1.0) for s in sizes]
    dist.reduce_scatter_v(out, inputs, op=ReduceOp.PREMUL_SUM(0.5))
    check(out, np.full(sizes[r], 0.5 * n * (n + 1) / 2), "reduce_scatter_v PREMUL_SUM")
    check(inputs[0], np.full(sizes[0], r + 1.0), "PREMUL_SUM leaves its input alone")


def _all_to_all(dtype: str) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    for big in (0, 30_000):
        # rank q sends (q + j) % 3 elements to rank j (plus `big` to the last rank)
        def count(q: int, j: int, big: int = big) -> int:
            return (q + j) % 3 + (big if j == n - 1 else 0)

        sends = [values(r * n + j, count(r, j), dtype) for j in range(n)]
        recvs = [np.empty(count(j, r), dtype=dtype) for j in range(n)]
        dist.all_to_all(recvs, sends)
        for j in range(n):
            check(recvs[j], values(j * n + r, count(j, r), dtype), f"all_to_all from {j}")
    recvs = [np.empty(j + r + 1, dtype=dtype) for j in range(n)]
    sends = [values(r + j, r + j + 1, dtype) for j in range(n)]
    dist.all_to_all(recvs, sends, async_op=True).wait()
    for j in range(n):
        check(recvs[j], values(j + r, j + r + 1, dtype), f"async all_to_all from {j}")


# -- every CPU backend (and mpi, under mpiexec) ---------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather(world, dtype):
    world.run(_all_gather, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_scatter(world, dtype):
    world.run(_gather_scatter, dtype)


@pytest.mark.parametrize("op,dtype", RSV_CASES, ids=[f"{o.name}-{d}" for o, d in RSV_CASES])
def test_reduce_scatter_v(world, op, dtype):
    world.run(_reduce_scatter_v, int(op), dtype)


def test_reduce_scatter_v_premul_sum(world):
    world.run(_premul_sum)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_to_all(world, dtype):
    world.run(_all_to_all, dtype)


@local
@pytest.mark.timeout(400)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_under_mpiexec(n):
    """This module's world tests on the mpi backend: MPI's v-calls."""
    if LAUNCHER is None:
        pytest.skip(f"the mpi backend tests need mpi4py and mpiexec: {SKIP_REASON}")
    argv = [sys.executable, "-m", "tests.mpi_world", __file__, "-q", "-x", "-p", "no:cacheprovider"]
    done = run(LAUNCHER.command(n, *argv), env=job_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    assert " passed" in done.stdout and "failed" not in done.stdout, done.stdout[-3000:]


# -- sizes that dst (src) and a rank disagree on ----------------------------------------------


def _disagree(op: str, m: int, theirs: int) -> tuple[str, str]:
    """dst (src) 0 expects `m` elements of every rank; rank 1 passes `theirs`."""
    r, n = dist.get_rank(), dist.get_world_size()
    mine = theirs if r == 1 else m
    try:
        if op == "gather":
            slots = [np.empty(m, dtype=np.float32) for _ in range(n)] if r == 0 else None
            dist.gather(np.ones(mine, dtype=np.float32), slots, dst=0)
        else:
            parts = [np.ones(m, dtype=np.float32)] * n if r == 0 else None
            dist.scatter(np.empty(mine, dtype=np.float32), parts, src=0)
        dist.barrier()  # the failure aborts the group: every rank hears of it here at the latest
    except dist.DistError as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


@local
@pytest.mark.timeout(120)
@pytest.mark.parametrize("m,theirs", [(5, 6), (40_000, 39_999)], ids=["inline", "large"])
@pytest.mark.parametrize("op", ["gather", "scatter"])
@pytest.mark.parametrize("backend", ["tcp", "gloo"])
def test_sizes_that_disagree_fail_on_every_rank(backend, op, m, theirs):
    """The sizes are not in the collective's signature (only dst or src knows them all):
    the rank that sees a piece of the wrong size (dst in gather, the receiver in scatter)
    raises a mismatch naming both sizes, before any byte lands, and the others fail too
    instead of hanging (gloo: its shared-memory path, inline and single-copy pieces)."""
    results = run_ranks(_disagree, 3, op, m, theirs, backend=backend, timeout=40, init_timeout=60)
    sees, peer = (0, 1) if op == "gather" else (1, 0)
    kind, message = results[sees]
    assert kind == "DistBackendError", results
    assert all(w in message for w in (str(m), str(theirs), f"rank {peer}")), results
    assert all(kind != "ok" for kind, _ in results), results


# -- what one rank can check, before anything is sent -----------------------------------------


@local
@pytest.mark.parametrize(
    "call,error,words",
    [
        (
            lambda: dist.all_gather([np.empty(2), np.empty(2)], np.ones(2)),
            ValueError,
            ["tensor_list", "one array per rank", "(1)", "got 2"],
        ),
        (
            lambda: dist.all_gather_v([np.empty(3, np.float32)], np.ones(2)),
            TypeError,
            ["tensor_list", "mixes dtypes", "float32", "float64"],
        ),
        (
            lambda: dist.all_gather([np.empty(3)], np.ones(2)),
            ValueError,
            ["tensor_list[0] has 3 elements but tensor has 2", "must have 2"],
        ),
        (
            lambda: dist.all_gather_v([np.empty(0)], np.ones(1)),
            ValueError,
            ["tensor_list[0] has 0 elements but tensor has 1"],
        ),
        (
            lambda: dist.gather(np.ones(2), [np.empty(4)]),
            ValueError,
            ["gather_list[0] has 4 elements but tensor has 2", "dst's own", "must have 2"],
        ),
        (
            lambda: dist.gather(np.ones(2), [np.empty(2), np.empty(1)]),
            ValueError,
            ["gather_list", "one array per rank"],
        ),
        (
            lambda: dist.gather(np.ones(2), [np.empty(2, np.int32)]),
            TypeError,
            ["gather_list", "mixes dtypes"],
        ),
        (
            lambda: dist.scatter(np.empty(2), [np.ones(3)]),
            ValueError,
            ["scatter_list[0] has 3 elements but tensor has 2", "src's own", "must have 2"],
        ),
        (
            lambda: dist.scatter(np.empty(2), None),
            ValueError,
            ["scatter_list is required on src"],
        ),
        (
            lambda: dist.all_to_all([np.empty(2)], [np.ones(3)]),
            ValueError,
            ["input_tensor_list[0] has 3 elements but output_tensor_list[0] has 2", "itself"],
        ),
        (
            lambda: dist.reduce_scatter_v(np.empty(2), [np.ones(3)]),
            ValueError,
            ["input_list[0] has 3 elements but output has 2", "pass 2 elements"],
        ),
        (
            lambda: dist.reduce_scatter_v(np.empty(2), [np.ones(2), np.ones(2)]),
            ValueError,
            ["input_list", "one array per rank"],
        ),
        (
            lambda: dist.reduce_scatter_v(np.empty(2), [np.ones(2, np.float32)]),
            TypeError,
            ["input_list and output", "mixes dtypes"],
        ),
        (
            lambda: dist.reduce_scatter_v(np.empty(2), [np.ones(2)], op=ReduceOp.BAND),
            TypeError,
            ["reduce_scatter_v", "BAND"],
        ),
    ],
)
def test_bad_arguments_say_what_to_pass(solo, call, error, words):
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert all(w in message for w in words), message


@local
def test_one_rank_takes_every_size(solo):
    out = [np.empty((2, 3))]
    dist.all_gather_v(out, np.arange(6.0).reshape(2, 3))
    check(out[0], np.arange(6.0).reshape(2, 3), "all_gather_v of one rank")
    result = np.empty(4, dtype=np.int16)
    dist.reduce_scatter_v(result, [np.arange(4, dtype=np.int16)], op=ReduceOp.MAX)
    check(result, np.arange(4, dtype=np.int16), "reduce_scatter_v of one rank")


# -- nccl, on the CuPy and NCCL stand-in ------------------------------------------------------


def _standin(me: Rank, dtype: str) -> None:
    r, n, cp = me.rank, me.size, me.cp
    pg = me.group()
    rdtype = "float32" if dtype in ("int16", "complex64") else dtype  # one NCCL reduces
    for sizes in [*patterns(n)[:4], [7 if k == n - 1 else k for k in range(n)]]:
        out = [cp.empty(s, dtype) for s in sizes]
        dist.all_gather(out, me.array(values(r, sizes[r], dtype)), group=pg)
        for k in range(n):
            same(out[k].get(), values(k, sizes[k], dtype), f"all_gather[{k}] of {sizes}")
        out = [cp.empty(s, dtype) for s in sizes]
        dist.all_gather_v(out, me.array(values(r + 1, sizes[r], dtype)), group=pg)
        for k in range(n):
            same(out[k].get(), values(k + 1, sizes[k], dtype), f"all_gather_v[{k}] of {sizes}")
        for root in range(n):
            slots = [cp.empty(s, dtype) for s in sizes] if r == root else None
            dist.gather(me.array(values(r + root, sizes[r], dtype)), slots, dst=root, group=pg)
            if r == root:
                for k in range(n):
                    same(slots[k].get(), values(k + root, sizes[k], dtype), f"gather[{k}]")
            got = cp.empty(sizes[r], dtype)
            parts = [me.array(values(k + 3, s, dtype)) for k, s in enumerate(sizes)]
            dist.scatter(got, parts if r == root else None, src=root, group=pg)
            same(got.get(), values(r + 3, sizes[r], dtype), f"scatter from {root} of {sizes}")
        result = cp.empty(sizes[r], rdtype)
        inputs = [me.array(values(r, s, rdtype)) for s in sizes]
        dist.reduce_scatter_v(result, inputs, group=pg)
        same(result.get(), expected_reduction(n, sizes[r], rdtype, ReduceOp.SUM), "rs_v")
    # asynchronous, and all_to_all with a zero-size piece between some pairs
    sends = [me.array(values(r * n + j, (r + j) % 3, dtype)) for j in range(n)]
    recvs = [cp.empty((j + r) % 3, dtype) for j in range(n)]
    work = dist.all_to_all(recvs, sends, group=pg, async_op=True)
    sizes = [k + 1 for k in range(n)]
    result = cp.empty(sizes[r], rdtype)
    inputs = [me.array(values(r, s, rdtype)) for s in sizes]
    reduced = dist.reduce_scatter_v(result, inputs, group=pg, async_op=True)
    assert work.wait() is True and reduced.wait() is True
    for j in range(n):
        same(recvs[j].get(), values(j * n + r, (j + r) % 3, dtype), f"all_to_all from {j}")
    same(result.get(), expected_reduction(n, sizes[r], rdtype, ReduceOp.SUM), "async rs_v")


@local
@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", ["float32", "int16", "bool", "complex64", "float16"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_nccl_standin(solo, make_cluster, size, dtype):  # noqa: F811 - the fixture imported above
    make_cluster(size).run(_standin, dtype, timeout=150)


def _standin_gather_moves_only_its_pieces(me: Rank) -> list[tuple[str, int | None, int]]:
    r, n, cp = me.rank, me.size, me.cp
    sizes = [k + 1 for k in range(n)]
    slots = [cp.empty(s, "float32") for s in sizes] if r == 0 else None
    mark = me.mark()
    dist.gather(me.array(values(r, sizes[r], "float32")), slots, dst=0, group=me.group())
    return [(c.name, c.args.get("peer"), c.args.get("count")) for c in me.calls_since(mark)]


@local
@pytest.mark.timeout(60)
def test_nccl_gather_sends_each_piece_once(solo, make_cluster):  # noqa: F811
    """nccl runs an uneven gather as the even one ran: one send per rank to dst, no empty
    messages between the others."""
    calls = make_cluster(3).run(_standin_gather_moves_only_its_pieces)
    sends = [[c for c in seen if c[0] in ("send", "recv")] for seen in calls]
    assert sends[0] == [("recv", 1, 2), ("recv", 2, 3)], sends[0]
    assert sends[1] == [("send", 0, 2)] and sends[2] == [("send", 0, 3)], sends
