"""distcomm.parallel: thread settings, fork/wait, parallel_info, parallel_for, threaded reductions.

Defaults and the once-only inter-op setting are read per process, so those tests run a
fresh Python with a controlled environment; the rest run here and restore the settings.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import psutil
import pytest

from distcomm import ops, parallel
from distcomm.ops import ReduceOp, check_reduce_op, reduce_into

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LOCAL_WORLD_SIZE")
CORES = psutil.cpu_count(logical=False) or psutil.cpu_count(logical=True) or 1


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter whose thread variables are exactly `env`."""
    base = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env},
        timeout=60,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def blas_pools() -> list[dict]:
    from threadpoolctl import threadpool_info

    return threadpool_info()


@pytest.fixture(autouse=True)
def restore_threads():
    """Every test leaves the intra-op count and the BLAS limits as it found them."""
    with parallel.threads(parallel.get_num_threads()):
        yield


# -- defaults -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, CORES),
        ({"OMP_NUM_THREADS": "3"}, 3),
        ({"MKL_NUM_THREADS": "5"}, 5),
        ({"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "5"}, 5),  # torch: MKL_NUM_THREADS wins
        ({"OMP_NUM_THREADS": "4,2"}, 4),  # OpenMP's nested list: the outer level
        ({"OMP_NUM_THREADS": "3", "LOCAL_WORLD_SIZE": "2"}, 3),  # explicit beats the division
        ({"LOCAL_WORLD_SIZE": "2"}, max(1, CORES // 2)),
        ({"LOCAL_WORLD_SIZE": str(CORES * 4)}, 1),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else str(v),
)
def test_default_intraop_threads(env, expected):
    proc = run_python("from distcomm import parallel; print(parallel.get_num_threads())", **env)
    assert int(proc.stdout) == expected
    assert "Warning" not in proc.stderr


@pytest.mark.parametrize(
    ("env", "bad", "expected"),
    [
        ({"OMP_NUM_THREADS": "lots"}, "OMP_NUM_THREADS='lots'", CORES),
        ({"OMP_NUM_THREADS": "0"}, "OMP_NUM_THREADS='0'", CORES),
        ({"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "-2"}, "MKL_NUM_THREADS='-2'", 3),
        ({"LOCAL_WORLD_SIZE": "x"}, "LOCAL_WORLD_SIZE='x'", CORES),
    ],
)
def test_invalid_thread_variables_warn_and_fall_back(env, bad, expected):
    proc = run_python("from distcomm import parallel; print(parallel.get_num_threads())", **env)
    assert int(proc.stdout) == expected
    assert "RuntimeWarning" in proc.stderr and bad in proc.stderr


def test_default_interop_threads_are_the_cores():
    proc = run_python(
        "from distcomm import parallel; print(parallel.get_num_interop_threads())",
        OMP_NUM_THREADS="1",
        LOCAL_WORLD_SIZE="4",
    )
    assert int(proc.stdout) == CORES


# -- intra-op settings --------------------------------------------------------------------


def test_set_get_round_trip():
    for n in (1, 3, 2, np.int64(5)):
        parallel.set_num_threads(n)
        assert parallel.get_num_threads() == n
        assert type(parallel.get_num_threads()) is int


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (0, ValueError),
        (-1, ValueError),
        (2.0, TypeError),
        ("2", TypeError),
        (True, TypeError),
        (None, TypeError),
    ],
)
def test_bad_counts_are_rejected(value, error):
    before = parallel.get_num_threads()
    for call in (parallel.set_num_threads, parallel.threads, parallel.set_num_interop_threads):
        with pytest.raises(error, match=r"\bn must be"):
            if call is parallel.threads:
                with call(value):
                    pass
            else:
                call(value)
    assert parallel.get_num_threads() == before


def test_set_num_threads_limits_the_blas_pools():
    pools = blas_pools()
    if not pools:
        pytest.skip("threadpoolctl finds no BLAS/OpenMP pool in this numpy")
    for n in (1, 2):
        parallel.set_num_threads(n)
        assert [p["num_threads"] for p in blas_pools()] == [n] * len(pools)


def test_threads_restores_count_and_blas_on_exit_and_on_error():
    parallel.set_num_threads(2)
    before = [p["num_threads"] for p in blas_pools()]
    with parallel.threads(1):
        assert parallel.get_num_threads() == 1
        assert all(p["num_threads"] == 1 for p in blas_pools())
        with parallel.threads(3):
            assert parallel.get_num_threads() == 3
        assert parallel.get_num_threads() == 1
    assert parallel.get_num_threads() == 2
    assert [p["num_threads"] for p in blas_pools()] == before
    with pytest.raises(KeyError), parallel.threads(1):
        raise KeyError("boom")
    assert parallel.get_num_threads() == 2
    assert [p["num_threads"] for p in blas_pools()] == before


# -- inter-op pool, fork and wait ---------------------------------------------------------


def test_interop_threads_settable_once_before_use():
    code = """
from distcomm import parallel
parallel.set_num_interop_threads(3)
assert parallel.get_num_interop_threads() == 3
try:
    parallel.set_num_interop_threads(2)
except RuntimeError as exc:
    print(exc)
assert parallel.get_num_interop_threads() == 3
"""
    message = run_python(code).stdout
    assert "only once" in message and "already called" in message and "size 3" in message


def test_interop_threads_fixed_by_first_fork():
    code = """
from distcomm import parallel
assert parallel.wait(parallel.fork(lambda: 7)) == 7
try:
    parallel.set_num_interop_threads(2)
except RuntimeError as exc:
    print(exc)
"""
    message = run_python(code).stdout
    assert "fork() already started the inter-op pool" in message
    assert "before any fork()" in message


def test_fork_wait_result_and_arguments():
    future = parallel.fork(lambda a, b=0: (a + b, threading.current_thread().name), 2, b=3)
    value, name = parallel.wait(future)
    assert value == 5 and name.startswith("distcomm-interop-")
    assert future.done()
    futures = [parallel.fork(pow, i, 2) for i in range(20)]
    assert [parallel.wait(f) for f in futures] == [i * i for i in range(20)]


def test_fork_propagates_the_exception():
    def fail():
        raise ValueError("from the forked call")

    future = parallel.fork(fail)
    with pytest.raises(ValueError, match="from the forked call"):
        parallel.wait(future)
    assert parallel.wait(parallel.fork(int, "4")) == 4  # the pool survives


def test_forked_calls_run_concurrently():
    if parallel.get_num_interop_threads() < 2:
        pytest.skip("one inter-op thread")
    barrier = threading.Barrier(2, timeout=30)
    futures = [parallel.fork(barrier.wait) for _ in range(2)]
    assert sorted(parallel.wait(f) for f in futures) == [0, 1]


# -- parallel_info --------------------------------------------------------------------------


def test_parallel_info(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    parallel.set_num_threads(3)
    info = parallel.parallel_info()
    assert "get_num_threads() : 3" in info
    assert f"get_num_interop_threads() : {parallel.get_num_interop_threads()}" in info
    assert "OMP_NUM_THREADS : 7" in info and "MKL_NUM_THREADS : [not set]" in info
    assert "LOCAL_WORLD_SIZE :" in info
    assert (
        f"{psutil.cpu_count(logical=False)} physical, {psutil.cpu_count(logical=True)} logical"
    ) in info
    if hasattr(os, "sched_getaffinity"):
        assert f"CPU affinity : {len(os.sched_getaffinity(0))} CPUs" in info
    for pool in blas_pools():
        assert pool["filepath"] in info
        assert f"num_threads {pool['num_threads']}" in info
    assert info.endswith("\n") and len(info.splitlines()) >= 9


# -- parallel_for ---------------------------------------------------------------------------


def run_pieces(count: int, min_chunk: int) -> list[tuple[int, int]]:
    calls = []
    lock = threading.Lock()

    def fn(start: int, stop: int) -> None:
        with lock:
            calls.append((start, stop))

    parallel.parallel_for(count, fn, min_chunk=min_chunk)
    return sorted(calls)


@pytest.mark.parametrize("nthreads", [1, 2, 3, 7])
@pytest.mark.parametrize(
    ("count", "min_chunk"),
    [
        (0, 1),
        (1, 1),
        (5, 1),
        (17, 2),
        (101, 3),
        (1001, 7),
        (9999, 1000),
        (50, 100),
    ],
)
def test_parallel_for_covers_every_index_once(nthreads, count, min_chunk):
    parallel.set_num_threads(nthreads)
    pieces = run_pieces(count, min_chunk)
    assert pieces[0][0] == 0 and pieces[-1][1] == count
    assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))  # contiguous, no overlap
    assert len(pieces) == max(1, min(nthreads, count // min_chunk))
    if len(pieces) > 1:
        assert all(stop - start >= min_chunk for start, stop in pieces)


def test_parallel_for_runs_on_named_daemon_threads():
    parallel.set_num_threads(3)
    names = set()
    release = threading.Barrier(3, timeout=30)  # only passes with 3 pieces running at once

    def fn(start: int, stop: int) -> None:
        names.add(threading.current_thread().name)
        release.wait()

    parallel.parallel_for(3, fn, min_chunk=1)
    workers = [t for t in threading.enumerate() if t.name.startswith("distcomm-intraop-")]
    assert len(names) == 3 and threading.current_thread().name in names
    assert all(
        name.startswith("distcomm-intraop-") for name in names - {threading.current_thread().name}
    )
    assert len(workers) >= 2 and all(t.daemon for t in workers)


def test_parallel_for_pool_shrinks_with_set_num_threads():
    parallel.set_num_threads(4)
    run_pieces(100, 1)
    parallel.set_num_threads(2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # stopped threads exit once they read their sentinel
        alive = [t for t in threading.enumerate() if t.name.startswith("distcomm-intraop-")]
        if len(alive) == 1:
            break
        time.sleep(0.01)
    assert len(alive) == 1
    assert run_pieces(100, 1) == [(0, 50), (50, 100)]


def test_parallel_for_raises_the_first_error_after_every_piece_ran():
    parallel.set_num_threads(4)
    ran = []

    def fn(start: int, stop: int) -> None:
        ran.append(start)
        if start > 0:
            raise ValueError(f"piece at {start}")

    with pytest.raises(ValueError, match="piece at 25"):
        parallel.parallel_for(100, fn, min_chunk=1)
    assert sorted(ran) == [0, 25, 50, 75]
    assert run_pieces(100, 1) == [(0, 25), (25, 50), (50, 75), (75, 100)]  # still works


def test_parallel_for_nested_call_runs_inline():
    parallel.set_num_threads(3)
    seen = np.zeros(300, dtype=np.int64)

    def inner(start: int, stop: int) -> None:
        seen[start:stop] += 1

    def outer(start: int, stop: int) -> None:
        parallel.parallel_for(stop - start, lambda a, b: inner(start + a, start + b), min_chunk=1)

    parallel.parallel_for(300, outer, min_chunk=1)
    assert (seen == 1).all()


def test_parallel_for_from_several_threads_at_once():
    parallel.set_num_threads(3)
    results = {}

    def caller(k: int) -> None:
        for _ in range(20):
            results[k] = run_pieces(1000 + k, 1)

    callers = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(60)
    assert sorted(results) == [0, 1, 2, 3]
    for k, pieces in results.items():
        assert len(pieces) == 3 and pieces[0][0] == 0 and pieces[-1][1] == 1000 + k


def test_parallel_for_bad_arguments():
    with pytest.raises(ValueError, match="count >= 0"):
        parallel.parallel_for(-1, lambda a, b: None, min_chunk=1)
    with pytest.raises(ValueError, match="min_chunk >= 1"):
        parallel.parallel_for(10, lambda a, b: None, min_chunk=0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_parallel_for_and_fork_work_in_a_forked_child():
    parallel.set_num_threads(2)
    run_pieces(10, 1)
    parallel.wait(parallel.fork(int))  # both pools exist in the parent
    with warnings.catch_warnings():  # 3.12+: "this process is multi-threaded" (as intended)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: the parent's threads are gone, new ones must start
        code = 1
        try:
            ok = run_pieces(10, 1) == [(0, 5), (5, 10)]
            ok = ok and parallel.wait(parallel.fork(lambda: 3)) == 3
            code = 0 if ok else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in parallel_for or fork")
    assert os.waitstatus_to_exitcode(done[1]) == 0


# -- threaded reduce_into -----------------------------------------------------------------


def operands(dtype: np.dtype, count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype.kind == "b":
        return rng.integers(0, 2, count).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
    values = rng.standard_normal(count * (2 if dtype.kind == "c" else 1)) * 3
    return values.view(np.complex128).astype(dtype) if dtype.kind == "c" else values.astype(dtype)


DTYPES = ["float32", "float64", "float16", "int32", "int64", "uint8", "bool", "complex64"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_threaded_reduce_into_equals_numpy(dtype, monkeypatch):
    dtype = np.dtype(dtype)
    splits = []

    def spy(count, fn, *, min_chunk):
        splits.append(count)
        parallel.parallel_for(count, fn, min_chunk=min_chunk)

    monkeypatch.setattr(ops, "parallel_for", spy)
    count = ops.PARALLEL_REDUCE_BYTES // dtype.itemsize * 2 + 7
    a, b = operands(dtype, count, 1), operands(dtype, count, 2)
    tested = 0
    for op in ReduceOp:
        try:
            check_reduce_op(op, dtype, "test")
        except TypeError:
            continue
        expected = ops.UFUNCS[op](a, b)
        for nthreads in (2, 3):
            parallel.set_num_threads(nthreads)
            acc = a.copy()
            with np.errstate(all="ignore"):
                reduce_into(acc, b, op)
            assert acc.tobytes() == expected.tobytes(), (op, nthreads)
            tested += 1
    assert tested and splits == [count] * tested


def test_reduce_into_small_or_strided_stays_one_call(monkeypatch):
    monkeypatch.setattr(ops, "parallel_for", lambda *a, **k: pytest.fail("split"))
    parallel.set_num_threads(2)
    small = np.ones(ops.PARALLEL_REDUCE_BYTES // 4 - 1, np.float32)
    reduce_into(small, small.copy(), ReduceOp.SUM)
    assert (small == 2).all()
    big = np.ones(ops.PARALLEL_REDUCE_BYTES // 2, np.float32)
    strided = big[::2]
    reduce_into(strided, np.ones_like(strided), ReduceOp.SUM)
    assert (big[::2] == 2).all() and (big[1::2] == 1).all()


def test_threaded_reduce_into_multidimensional():
    parallel.set_num_threads(2)
    a = operands(np.dtype(np.float32), ops.PARALLEL_REDUCE_BYTES // 4 * 2, 3).reshape(-1, 8)
    b = operands(np.dtype(np.float32), a.size, 4).reshape(a.shape)
    expected = a * b
    reduce_into(a, b, ReduceOp.PRODUCT)
    assert a.tobytes() == expected.tobytes()
