"""CuPy arrays on the gloo backend: the group's StagedBackend, against the CUDA stand-in.

Ranks are threads, each with a real GlooBackend (TCP between the threads) over one
HashStore, and a ProcessGroup whose CUDA arrays go through `StagedBackend`. The stand-in
(tests/cuda_standin.py) provides CuPy arrays, streams and host copies; results are
checked against numpy. A GPU run of the same path is in tests/test_gpu_staging.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import distcomm as dist
from distcomm import backends
from distcomm.backends.gloo import GlooBackend
from distcomm.backends.staged import StagedBackend
from distcomm.errors import DistBackendError
from distcomm.gpu import runtime
from distcomm.group import ProcessGroup
from distcomm.ops import ReduceOp
from tests.cuda_standin import CudaStandin
from tests.harness import LOOPBACK_ENV
from tests.test_collectives import expected_reduction, values

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cuda(monkeypatch):
    standin = CudaStandin(device_count=2).install(monkeypatch)
    monkeypatch.setattr(runtime, "_chosen", None)
    for key, value in LOOPBACK_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DISTCOMM_GLOO_TRANSPORT", "tcp")  # threads of one process
    yield standin
    assert not standin.violations, f"misuse of the CUDA stand-in: {standin.violations}"


def run(n: int, fn: Callable[..., Any], cuda: CudaStandin) -> list[Any]:
    """`fn(group, cupy)` on `n` ranks (threads), each with a gloo + staged group."""
    store = dist.HashStore()
    results: dict[int, Any] = {}

    def rank_main(rank: int) -> None:
        gloo = None
        try:
            cuda.cuda.Device(rank % 2).use()
            gloo = GlooBackend(dist.PrefixStore("gloo", store), rank, n, 30.0, group_name="s")
            group = ProcessGroup(
                "s",
                list(range(n)),
                rank,
                {"cpu": gloo, "cuda": StagedBackend(gloo)},
                "gloo",
                30.0,
                rank,
            )
            results[rank] = fn(group, cuda.cupy)
        except BaseException as exc:
            results[rank] = exc
        finally:
            if gloo is not None:
                gloo.shutdown()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for rank in range(n):
        if isinstance(results[rank], BaseException):
            raise AssertionError(f"rank {rank} failed: {results[rank]!r}") from results[rank]
    return [results[r] for r in range(n)]


def _ops(group: ProcessGroup, cp: Any) -> None:
    r, n = group.rank(), group.size()
    for op, dtype in (
        (ReduceOp.SUM, "int32"),
        (ReduceOp.AVG, "float32"),
        (ReduceOp.BXOR, "uint8"),
        (ReduceOp.MAX, "float16"),
    ):
        x = cp.asarray(values(r, 1000, dtype, op))
        dist.all_reduce(x, op, group=group)
        assert np.array_equal(x.get(), expected_reduction(n, 1000, dtype, op)), op
    y = cp.asarray(values(r, 7, "complex128"))
    dist.broadcast(y, src=n - 1, group=group)
    assert np.array_equal(y.get(), values(n - 1, 7, "complex128"))
    z = cp.asarray(values(r, 9, "int64"))
    dist.reduce(z, dst=0, group=group)
    want = expected_reduction(n, 9, "int64", ReduceOp.SUM) if r == 0 else values(r, 9, "int64")
    assert np.array_equal(z.get(), want)
    mine = cp.asarray(values(r, 5, "float64"))
    flat = cp.empty(5 * n, "float64")
    dist.all_gather_single(flat, mine, group=group)
    assert np.array_equal(flat.get(), np.concatenate([values(k, 5, "float64") for k in range(n)]))
    parts = [cp.empty(5, "float64") for _ in range(n)]
    dist.all_gather(parts, mine, group=group)
    assert all(np.array_equal(parts[k].get(), values(k, 5, "float64")) for k in range(n))
    slots = [cp.empty(5, "float64") for _ in range(n)] if r == 1 % n else None
    dist.gather(mine, slots, dst=1 % n, group=group)
    if slots is not None:
        assert all(np.array_equal(slots[k].get(), values(k, 5, "float64")) for k in range(n))
    got = cp.empty(3, "int16")
    pieces = [cp.asarray(values(k + 5, 3, "int16")) for k in range(n)] if r == 0 else None
    dist.scatter(got, pieces, src=0, group=group)
    assert np.array_equal(got.get(), values(r + 5, 3, "int16"))
    out = cp.empty(4, "float32")
    dist.reduce_scatter_single(out, cp.asarray(values(r, 4 * n, "float32")), group=group)
    full = expected_reduction(n, 4 * n, "float32", ReduceOp.SUM)
    assert np.array_equal(out.get(), full[4 * r : 4 * (r + 1)])
    sizes = [[(q + j) % 3 for j in range(n)] for q in range(n)]
    rows = np.concatenate([np.full(sizes[r][j], 10 * r + j) for j in range(n)]).astype("int32")
    received = cp.empty(sum(sizes[q][r] for q in range(n)), "int32")
    dist.all_to_all_single(
        received, cp.asarray(rows), [sizes[q][r] for q in range(n)], sizes[r], group=group
    )
    want = np.concatenate([np.full(sizes[q][r], 10 * q + r) for q in range(n)])
    assert np.array_equal(received.get(), want.astype("int32"))
    dist.barrier(group=group, device_ids=[0])
    numpy_too = np.ones(3)  # the same group's CPU backend
    dist.all_reduce(numpy_too, group=group)
    assert numpy_too.tolist() == [n] * 3


@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_op_stages_cupy_arrays(cuda, solo, n):
    run(n, _ops, cuda)
    copies = {c.name for c in cuda.calls()}
    assert {"copy_to_host_async", "copy_from_host_async"} <= copies


def _mismatch(group: ProcessGroup, cp: Any) -> str:
    x = cp.ones(10 + group.rank(), "float32")  # sizes differ: the CPU op fails
    with pytest.raises(DistBackendError, match="mismatch"):
        dist.all_reduce(x, group=group)
    return "raised"


def test_a_failing_cpu_op_raises_instead_of_being_swallowed(cuda, solo):
    assert run(2, _mismatch, cuda) == ["raised", "raised"]


def _p2p(group: ProcessGroup, cp: Any) -> None:
    with pytest.raises(TypeError, match="gloo backend does not send CuPy arrays"):
        dist.send(cp.ones(2), dst=1 - group.rank(), group=group)


def test_point_to_point_is_refused_clearly(cuda, solo):
    run(2, _p2p, cuda)


def test_groups_wrap_staging_backends_only(cuda, solo):
    record = dist.group.WORLD  # the solo group: tcp, CPU only
    assert set(record._backends) == {"cpu"}
    assert GlooBackend.stages_device_arrays and not backends.Backend.stages_device_arrays
