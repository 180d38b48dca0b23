"""The nccl backend on real GPUs: every op on CuPy arrays, checked against numpy.

Skips (with the reason) where the backend cannot run: no CuPy, no NCCL library or no
GPU; fails instead when DISTCOMM_TEST_REQUIRE_GPU=1. One rank runs in this process;
several ranks run as spawned processes, one GPU each (CUDA_VISIBLE_DEVICES per rank) where
the machine has enough GPUs, else sharing the GPUs, which NCCL may refuse ("duplicate
GPU"): those tests then skip, saying so. The logic without a device is covered by
tests/test_nccl_standin.py and tests/test_gpu.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import distcomm as dist
from distcomm.backends import get_backend_record
from distcomm.errors import DistBackendError, DistTimeoutError
from distcomm.gpu import nccl as nt
from distcomm.ops import ReduceOp
from tests.harness import LOOPBACK_ENV, RankFailure, RankPool
from tests.test_collectives import ALL_DTYPES, OP_DTYPES, check, expected_reduction, values

SPEC = "cpu:gloo,cuda:nccl"
REQUIRE = os.environ.get("DISTCOMM_TEST_REQUIRE_GPU") == "1"
COUNTS = (0, 1, 13, 600_001)


def _unavailable() -> str:
    return get_backend_record("nccl").availability()


@pytest.fixture(scope="module")
def gpus() -> int:
    """The number of GPUs; skip (or fail with DISTCOMM_TEST_REQUIRE_GPU=1) without nccl."""
    reason = _unavailable()
    if reason:
        if REQUIRE:
            pytest.fail(f"DISTCOMM_TEST_REQUIRE_GPU=1 but the nccl backend cannot run: {reason}")
        pytest.skip(f"the nccl backend cannot run here: {reason}")
    from distcomm import gpu

    return gpu.device_count()


def supported(op: ReduceOp, dtype: str) -> bool:
    """Whether NCCL can do `op` on `dtype` (the others must raise TypeError)."""
    try:
        nt.reduction(np.dtype(dtype), op, (2, 32, 0), "t")
    except TypeError:
        return False
    return True


# -- bodies, run on every rank -------------------------------------------------------------------


def _cp():
    import cupy

    return cupy


def _on_gpu(array: np.ndarray):
    return _cp().asarray(array)


def _host(array) -> np.ndarray:
    return _cp().asnumpy(array)


def _all_reduce(op_value: int, dtype: str) -> None:
    op = ReduceOp(op_value)
    r, n = dist.get_rank(), dist.get_world_size()
    if not supported(op, dtype):
        with pytest.raises(TypeError, match="NCCL"):
            dist.all_reduce(_on_gpu(values(r, 4, dtype, op)), op=op)
        return
    for count in COUNTS:
        x = _on_gpu(values(r, count, dtype, op))
        dist.all_reduce(x, op=op)
        check(_host(x), expected_reduction(n, count, dtype, op), f"all_reduce {op} x{count}")
    grid = _on_gpu(values(r, 12, dtype, op).reshape(3, 4))
    work = dist.all_reduce(grid, op, async_op=True)
    assert work.wait() is True
    check(_host(grid), expected_reduction(n, 12, dtype, op).reshape(3, 4), "async 2-D")
    assert work.get_future().wait(60)[0] is grid


def _broadcast_reduce(dtype: str) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    for root in range(n):
        for count in (0, 5, 40_001):
            x = _on_gpu(values(r, count, dtype))
            dist.broadcast(x, src=root)
            check(_host(x), values(root, count, dtype), f"broadcast from {root} x{count}")
            if supported(ReduceOp.SUM, dtype):
                y = _on_gpu(values(r, count, dtype))
                dist.reduce(y, dst=root)
                want = (
                    expected_reduction(n, count, dtype, ReduceOp.SUM)
                    if r == root
                    else values(r, count, dtype)
                )
                check(_host(y), want, f"reduce to {root} x{count}")


def _gathers(dtype: str) -> None:
    cp = _cp()
    r, n = dist.get_rank(), dist.get_world_size()
    for count in (0, 1, 7, 30_000):
        mine = _on_gpu(values(r, count, dtype))
        whole = np.concatenate([values(k, count, dtype) for k in range(n)])
        flat = cp.empty(n * count, dtype=dtype)
        dist.all_gather_single(flat, mine)
        check(_host(flat), whole, f"all_gather_single x{count}")
        out = [cp.empty(count, dtype=dtype) for _ in range(n)]
        dist.all_gather(out, mine)
        for k in range(n):
            check(_host(out[k]), values(k, count, dtype), f"all_gather[{k}] x{count}")
        for root in range(n):
            slots = [cp.empty(count, dtype=dtype) for _ in range(n)] if r == root else None
            dist.gather(mine, slots, dst=root)
            if r == root:
                for k in range(n):
                    check(_host(slots[k]), values(k, count, dtype), f"gather[{k}] to {root}")
            got = cp.empty(count, dtype=dtype)
            parts = [_on_gpu(values(k + 10, count, dtype)) for k in range(n)] if r == root else None
            dist.scatter(got, parts, src=root)
            check(_host(got), values(r + 10, count, dtype), f"scatter from {root} x{count}")


def _reduce_scatter(op_value: int, dtype: str) -> None:
    cp = _cp()
    op = ReduceOp(op_value)
    r, n = dist.get_rank(), dist.get_world_size()
    if not supported(op, dtype):
        with pytest.raises(TypeError, match="NCCL"):
            dist.reduce_scatter_single(cp.empty(1, dtype), _on_gpu(values(r, n, dtype, op)), op)
        return
    for count in (0, 1, 9_001):
        big = values(r, n * count, dtype, op)
        want = expected_reduction(n, n * count, dtype, op)[r * count : (r + 1) * count]
        out = cp.empty(count, dtype)
        dist.reduce_scatter_single(out, _on_gpu(big), op)
        check(_host(out), want, f"reduce_scatter_single {op} x{count}")
        out = cp.empty(count, dtype)
        dist.reduce_scatter(out, [_on_gpu(p) for p in np.split(big, n)], op)
        check(_host(out), want, f"reduce_scatter {op} x{count}")


def _all_to_all(dtype: str) -> None:
    cp = _cp()
    r, n = dist.get_rank(), dist.get_world_size()
    # rank q sends (q + j) % 3 rows of 2 elements to rank j (some zero), tagged by q and j
    sizes = [[(q + j) % 3 for j in range(n)] for q in range(n)]
    rows = [
        np.concatenate([np.full((sizes[q][j], 2), 10 * q + j) for j in range(n)]).astype(dtype)
        for q in range(n)
    ]
    out = cp.empty((sum(sizes[q][r] for q in range(n)), 2), dtype)
    dist.all_to_all_single(out, _on_gpu(rows[r]), [sizes[q][r] for q in range(n)], sizes[r])
    want = np.concatenate([np.full((sizes[q][r], 2), 10 * q + r) for q in range(n)])
    check(_host(out), want.astype(dtype), "all_to_all_single uneven")
    outs = [cp.empty(3, dtype) for _ in range(n)]
    dist.all_to_all(outs, [_on_gpu(values(10 * r + j, 3, dtype)) for j in range(n)])
    for q in range(n):
        check(_host(outs[q]), values(10 * q + r, 3, dtype), f"all_to_all from {q}")


def _point_to_point(dtype: str) -> None:
    cp = _cp()
    r, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        return
    nxt, prv = (r + 1) % n, (r - 1) % n
    got = cp.empty(1000, dtype)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, _on_gpu(values(r, 1000, dtype)), nxt),
            dist.P2POp(dist.irecv, got, prv),
        ]
    )
    for w in works:
        w.wait()
    check(_host(got), values(prv, 1000, dtype), "ring")
    if r == 0:
        dist.send(_on_gpu(values(7, 33, dtype)), dst=1)
    elif r == 1:
        x = cp.empty(33, dtype)
        assert dist.recv(x, src=0) == 0
        check(_host(x), values(7, 33, dtype), "send/recv")
        with pytest.raises(ValueError, match="any source"):
            dist.recv(x)


def _ordering_and_barrier() -> None:
    cp = _cp()
    r, n = dist.get_rank(), dist.get_world_size()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x = cp.arange(1 << 22, dtype=cp.float32)
        x *= r + 1  # a producer still queued on this stream when the collective is issued
        work = dist.all_reduce(x, async_op=True)
        work.wait()  # orders this stream after the collective
        total = float(cp.asnumpy(x[1]))
    assert total == n * (n + 1) / 2
    dist.barrier()
    dist.barrier(device_ids=[cp.cuda.Device().id])  # on nccl
    assert dist.all_reduce(cp.ones(1), async_op=True).wait(timeout=60) is True


def _cpu_and_gpu_in_one_group() -> None:
    cp = _cp()
    n = dist.get_world_size()
    a, b = np.ones(5), cp.ones(5)
    dist.all_reduce(a)
    dist.all_reduce(b)
    assert a.tolist() == [n] * 5 and _host(b).tolist() == [n] * 5
    gathered = [None] * n
    dist.all_gather_object(gathered, dist.get_rank())  # objects go over the CPU backend
    assert gathered == list(range(n))


def _subgroup() -> list[float]:
    cp = _cp()
    r, n = dist.get_rank(), dist.get_world_size()
    evens = dist.new_group([k for k in range(n) if k % 2 == 0])
    x = cp.full(4, float(r + 1))
    if r % 2 == 0:
        dist.all_reduce(x, group=evens)
    dist.destroy_process_group(evens)
    return _host(x).tolist()


def _desync() -> None:
    cp = _cp()
    r = dist.get_rank()
    with pytest.raises(DistBackendError, match="collective mismatch"):
        dist.all_reduce(cp.ones(10 + r, cp.float32))


def _timeout_aborts() -> None:
    cp = _cp()
    dist.all_reduce(cp.ones(4))  # both ranks: the communicator exists
    dist.barrier()
    if dist.get_rank() == 0:
        work = dist.all_reduce(cp.ones(4), async_op=True)  # rank 1 never joins this one
        with pytest.raises(DistTimeoutError, match=r"all_reduce #\d+ .*aborted"):
            work.wait(timeout=3)
        with pytest.raises(DistTimeoutError, match="aborted"):
            dist.all_reduce(cp.ones(4))


# -- worlds -----------------------------------------------------------------------------------


class GpuWorld:
    """`n` spawned ranks on `SPEC`, one GPU each when there are enough GPUs."""

    def __init__(self, n: int, gpus: int, env: dict[str, str] | None = None) -> None:
        self.nprocs = n
        self.shared = gpus < n
        self.refused = ""  # why NCCL refused ranks sharing a GPU, once it did
        self._rank_env = (lambda r: {"CUDA_VISIBLE_DEVICES": str(r)}) if gpus >= n else None
        self._env = {"NCCL_SOCKET_IFNAME": "lo", **(env or {})}
        self.pool = self._start()

    def _start(self) -> RankPool:
        return RankPool(
            self.nprocs, SPEC, env=self._env, rank_env=self._rank_env, init_timeout=120.0
        )

    def run(self, fn, *args, timeout: float = 240.0):
        if self.refused:
            pytest.skip(self.refused)
        if self.pool.broken:  # a failed test took its ranks down: the next one gets new ones
            self.pool = self._start()
        try:
            return self.pool.run(fn, *args, timeout=timeout)
        except RankFailure as exc:
            if self.shared and "use the same GPU" in str(exc):
                # the error's own line (NCCL's words and the ranks named), not a traceback
                said = [
                    line.strip()
                    for line in str(exc).splitlines()
                    if "ncclCommInitRank failed" in line
                ]
                self.refused = (
                    f"NCCL refuses ranks sharing a GPU here: {(said or [str(exc)])[0][:600]}"
                )
                pytest.skip(self.refused)
            raise

    def close(self) -> None:
        self.pool.close()


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"nccl-{n}")
def world(request, gpus):
    w = GpuWorld(request.param, gpus)
    yield w
    w.close()


NCCL_CASES = [(op, d) for op, d in OP_DTYPES]


@pytest.mark.parametrize("op,dtype", NCCL_CASES, ids=[f"{o.name}-{d}" for o, d in NCCL_CASES])
def test_all_reduce(world, op, dtype):
    world.run(_all_reduce, int(op), dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_broadcast_reduce(world, dtype):
    world.run(_broadcast_reduce, dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_gathers(world, dtype):
    world.run(_gathers, dtype)


RS_CASES = [
    (op, d)
    for op, d in OP_DTYPES
    if op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.BXOR)
]


@pytest.mark.parametrize("op,dtype", RS_CASES, ids=[f"{o.name}-{d}" for o, d in RS_CASES])
def test_reduce_scatter(world, op, dtype):
    world.run(_reduce_scatter, int(op), dtype)


@pytest.mark.parametrize("dtype", ["float32", "int8", "complex128", "bool", "uint16"])
def test_all_to_all(world, dtype):
    world.run(_all_to_all, dtype)


@pytest.mark.parametrize("dtype", ["float64", "bool", "int16"])
def test_point_to_point(world, dtype):
    world.run(_point_to_point, dtype)


def test_ordering_and_barrier(world):
    world.run(_ordering_and_barrier)


def test_cpu_and_gpu_in_one_group(world):
    world.run(_cpu_and_gpu_in_one_group)


def test_subgroup(world):
    n = world.nprocs
    results = world.run(_subgroup)
    total = float(sum(k + 1 for k in range(n) if k % 2 == 0))
    for r, got in enumerate(results):
        assert got == [total if r % 2 == 0 else float(r + 1)] * 4


def test_desync_detected_in_detail_mode(gpus):
    w = GpuWorld(2, gpus, env={"DISTCOMM_DEBUG": "DETAIL"})
    try:
        w.run(_desync)
    finally:
        w.close()


def test_wait_timeout_aborts_the_communicator(gpus):
    w = GpuWorld(2, gpus)
    try:
        w.run(_timeout_aborts)
    finally:
        w.close()


def test_one_rank_in_this_process(gpus, monkeypatch):
    for key, value in LOOPBACK_ENV.items():
        monkeypatch.setenv(key, value)
    import cupy

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=60)
    try:
        assert dist.get_backend() == "nccl"
        x = cupy.arange(10, dtype=cupy.float32)
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
        assert cupy.asnumpy(x).tolist() == list(range(10))
        dist.barrier()
        with pytest.raises(ValueError, match="no backend for cpu arrays"):
            dist.all_reduce(np.ones(2))
    finally:
        dist.destroy_process_group()
