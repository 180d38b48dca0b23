"""What only a real GPU shows: CUDA-event Work semantics on nccl, the watchdog's timeout
paths, DISTCOMM_NCCL_BLOCKING_WAIT, split_group and PREMUL_SUM on nccl, teardown that
leaves nothing on the device, and CuPy arrays through gloo and mpi with ranks sharing a GPU.

Every test here skips without CuPy and a GPU (nccl tests: without the nccl backend), and
fails instead when DISTCOMM_TEST_REQUIRE_GPU=1. The nccl checks run one rank each, in a
fresh spawned process, so that an aborted communicator or a CUDA fault stays out of the
next test. A GPU kernel that spins until the host releases it (`Hold`) keeps a stream busy
for as long as a check needs (an operation queued behind a held stream cannot have
completed; a blocking wait cannot return before its operation completed). The abort checks
hold the stream for a fixed 8 s instead, since an abort waits for the device, against
timeouts of 1 and 3 s. The logic without a device is covered by tests/test_nccl_standin.py
(which runs `_split_and_premul` too); tests/gpu_staged_job.py's checks also run on numpy.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import distcomm as dist
from distcomm.backends import get_backend_record
from distcomm.errors import BackendUnavailableError
from distcomm.ops import ReduceOp
from tests import mpijobs
from tests.gpu_staged_job import staged_collectives
from tests.harness import RankPool
from tests.mpijobs import no_mpi_segment_left  # noqa: F401 - autouse: MPI jobs leave no file

REQUIRE = os.environ.get("DISTCOMM_TEST_REQUIRE_GPU") == "1"


def _skip_or_fail(reason: str) -> None:
    if REQUIRE:
        pytest.fail(f"DISTCOMM_TEST_REQUIRE_GPU=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def gpu() -> None:
    """A CUDA device CuPy can use; skip (or fail, DISTCOMM_TEST_REQUIRE_GPU=1) without."""
    from distcomm.gpu import import_cupy

    try:
        import_cupy("this test")
    except BackendUnavailableError as exc:
        _skip_or_fail(str(exc))


@pytest.fixture(scope="module")
def nccl(gpu) -> None:
    """The nccl backend can run; skip (or fail) where it cannot."""
    reason = get_backend_record("nccl").availability()
    if reason:
        _skip_or_fail(f"the nccl backend cannot run here: {reason}")


# -- a kernel that holds a stream until the host lets it go ---------------------------------

_HOLD_SOURCE = r"""
extern "C" __global__ void distcomm_test_hold(volatile int* flag, unsigned long long cap_ns,
                                             int* outcome) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        if (flag[0] != 0) { outcome[0] = 1; return; }
        __nanosleep(10000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < cap_ns);
    outcome[0] = 2;
}
"""


class Hold:
    """A one-thread kernel that keeps a stream busy until `release()` (at most `cap` s).

    Everything it launches is compiled and run once when it is made, so holding a stream
    later loads no module and allocates nothing (either could wait for the device).
    """

    def __init__(self, cp: Any, cap: float = 60.0) -> None:
        self.cp = cp
        self._cap = np.uint64(int(cap * 1e9))
        self._kernel = cp.RawKernel(_HOLD_SOURCE, "distcomm_test_hold")
        self._side = cp.cuda.Stream(non_blocking=True)
        self._flag = cp.zeros(1, dtype=cp.int32)
        self._outcome = cp.zeros(1, dtype=cp.int32)
        with self._side:
            self._flag.fill(1)  # loads the kernel release() uses (lazy loading would wait)
            self._kernel((1,), (1,), (self._flag, self._cap, self._outcome))  # ends at once
            self._flag.fill(0)
            self._outcome.fill(0)
        self._side.synchronize()

    def block(self, stream: Any) -> None:
        """Queue the holding kernel on `stream`."""
        with stream:
            self._kernel((1,), (1,), (self._flag, self._cap, self._outcome))

    def release(self) -> None:
        """Let the kernel end (from any thread)."""
        with self._side:
            self._flag.fill(1)
        self._side.synchronize()

    def outcome(self) -> str:
        """'released', 'ran out' (the cap passed first) or 'running'; read once the held
        stream was synchronised."""
        value = int(self.cp.asnumpy(self._outcome, stream=self._side)[0])
        return {0: "running", 1: "released", 2: "ran out"}[value]


# -- one-rank nccl bodies (each in a fresh process) -------------------------------------------


def _cupy() -> Any:
    import cupy

    return cupy


def _init_nccl(timeout: float, backend: str = "nccl") -> None:
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _warm(cp: Any) -> tuple[Any, Any]:
    """The communicator made, the kernels the bodies use compiled: (array, producer stream)."""
    producer = cp.cuda.Stream(non_blocking=True)
    x = cp.ones(1 << 20, dtype=cp.float32)
    with producer:
        x *= 3
        y = x * 2
        dist.all_reduce(x, async_op=True).wait(timeout=60)
        x.fill(1)
    producer.synchronize()
    del y
    return x, producer


def _held(cp: Any, cap: float = 60.0) -> tuple[Hold, Any, Any]:
    """A Hold, then `_warm`'s array and producer stream, the producer held: (hold, x,
    producer)."""
    hold = Hold(cp, cap=cap)
    x, producer = _warm(cp)
    hold.block(producer)
    return hold, x, producer


def _work_semantics() -> dict[str, Any]:
    cp = _cupy()
    _init_nccl(60)
    try:
        hold, x, producer = _held(cp)
        with producer:
            x *= 3  # a producer kernel behind the held one
            work = dist.all_reduce(x, async_op=True)
            waited = work.wait()  # orders this stream after the op; must not block
            pending = not work.is_completed()  # still held: cannot have completed
            y = x * 2  # a consumer, ordered after the op by wait()
        hold.release()
        finished = work.wait(timeout=60)
        producer.synchronize()
        return {
            "waited": waited,
            "pending_after_wait": pending,
            "finished": finished,
            "completed": work.is_completed(),
            "hold": hold.outcome(),
            "x": sorted(set(cp.asnumpy(x).tolist())),
            "y": sorted(set(cp.asnumpy(y).tolist())),
            "future": work.get_future().wait(60)[0] is x,
        }
    finally:
        dist.destroy_process_group()


def _blocking_wait() -> dict[str, Any]:
    cp = _cupy()
    _init_nccl(60)
    try:
        hold, x, producer = _held(cp)
        with producer:
            work = dist.all_reduce(x, async_op=True)
        releaser = threading.Timer(0.5, hold.release)
        releaser.start()
        waited = work.wait()  # DISTCOMM_NCCL_BLOCKING_WAIT=1: returns once it completed
        completed = work.is_completed()
        releaser.join()
        producer.synchronize()
        return {
            "waited": waited,
            "completed": completed,
            "hold": hold.outcome(),
            "x": sorted(set(cp.asnumpy(x).tolist())),
        }
    finally:
        dist.destroy_process_group()


#: how long the held stream stays busy in the abort tests. The kernel ends by itself: an
#: abort frees the communicator's memory, which may wait for the device to go idle, and a
#: release launched from the host could then queue behind that wait
_HELD_FOR = 8.0


def _raised(fn) -> str:
    """What `fn()` raised, as "Type: message"; "nothing" if it returned."""
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "nothing"


def _wait_timeout_aborts() -> dict[str, Any]:
    cp = _cupy()
    _init_nccl(60)
    hold, x, producer = _held(cp, cap=_HELD_FOR)
    held = cp.cuda.Event(disable_timing=True)
    held.record(producer)  # done once the held kernel ended
    try:
        with producer:
            work = dist.all_reduce(x, async_op=True)
        start = time.monotonic()
        waited = _raised(lambda: work.wait(timeout=1))
        raised_after = time.monotonic() - start
        still_held = not held.done  # the abort, on a thread of its own, waits for it
        later = _raised(lambda: dist.all_reduce(cp.ones(4)))
    finally:
        producer.synchronize()
        dist.destroy_process_group()
    _init_nccl(60)  # a new group works after the aborted one
    try:
        y = cp.arange(5, dtype=cp.float64)
        dist.all_reduce(y)
        return {
            "waited": waited,
            "later": later,
            "hold": hold.outcome(),
            "after": cp.asnumpy(y).tolist(),
            "raised_after_s": round(raised_after, 2),
            "still_held_when_raised": still_held,
        }
    finally:
        dist.destroy_process_group()


def _watchdog_times_out() -> dict[str, Any]:
    cp = _cupy()
    _init_nccl(3)
    hold, x, producer = _held(cp, cap=_HELD_FOR)
    try:
        with producer:
            work = dist.all_reduce(x, async_op=True)
        start = time.monotonic()
        while not work.is_completed() and time.monotonic() - start < 60:
            time.sleep(0.05)  # the watchdog fails it after the group timeout (3 s)
        failed_after = time.monotonic() - start
        waited = _raised(work.wait)
        later = _raised(lambda: dist.all_reduce(cp.ones(4)))
    finally:
        producer.synchronize()
        dist.destroy_process_group()
    return {
        "waited": waited,
        "later": later,
        "hold": hold.outcome(),
        "failed_after_s": round(failed_after, 2),
    }


def _split_and_premul() -> dict[str, Any]:
    cp = _cupy()
    _init_nccl(60, "cpu:gloo,cuda:nccl")
    try:
        sub = dist.split_group(split_ranks=[[0]])
        x = cp.arange(8, dtype=cp.float32)
        dist.all_reduce(x, op=ReduceOp.PREMUL_SUM(0.5), group=sub)
        z = cp.arange(6, dtype=cp.complex64) * (1 + 1j)
        dist.all_reduce(z, op=ReduceOp.PREMUL_SUM(2.0))
        out = cp.empty(4, dtype=cp.float64)
        dist.reduce_scatter_single(
            out, cp.arange(4, dtype=cp.float64), op=ReduceOp.PREMUL_SUM(3.0), group=sub
        )
        h = np.arange(5.0)
        dist.all_reduce(h, op=ReduceOp.PREMUL_SUM(0.5), group=sub)  # the gloo part
        result = {
            "x": cp.asnumpy(x).tolist(),
            "z": cp.asnumpy(z).tolist(),
            "out": cp.asnumpy(out).tolist(),
            "h": h.tolist(),
            "sub": dist.get_world_size(sub),
        }
        dist.destroy_process_group(sub)
        return result
    finally:
        dist.destroy_process_group()


def _one_cycle(cp: Any) -> None:
    _init_nccl(60)
    try:
        x = cp.arange(1 << 20, dtype=cp.float32)
        dist.all_reduce(x)
        dist.broadcast(x, src=0)
        flat = cp.empty(x.shape, dtype=x.dtype)
        dist.all_gather_single(flat, x)
        dist.all_to_all_single(flat, x)
        dist.reduce_scatter_single(flat, x)
        dist.all_reduce(x, op=ReduceOp.AVG)
        dist.barrier()
        dist.all_reduce(x, async_op=True)  # still pending, perhaps, at destroy
    finally:
        dist.destroy_process_group()


def _destroy_leaves_nothing() -> dict[str, Any]:
    cp = _cupy()
    pool = cp.get_default_memory_pool()

    def settled_free() -> int:
        gc.collect()
        pool.free_all_blocks()
        cp.cuda.Device().synchronize()
        return int(cp.cuda.runtime.memGetInfo()[0])

    _one_cycle(cp)  # the first loads NCCL and compiles CuPy's kernels
    before = settled_free()
    for _ in range(3):
        _one_cycle(cp)
    after = settled_free()
    return {
        "freed_less_by": before - after,
        "pool_used": int(pool.used_bytes()),
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("distcomm")),
    }


def _op_timeout_then_reconfigure() -> dict[str, Any]:
    """A per-operation timeout on a held stream aborts the group (hook, is_aborted); the
    world is then re-formed in place: a new NCCL communicator, and the group works."""
    cp = _cupy()
    _init_nccl(60)
    pg = dist.group.WORLD
    heard: list[str] = []
    pg.register_abort_hook(heard.append)
    _hold, x, producer = _held(cp, cap=_HELD_FOR)
    try:
        with producer:
            start = time.monotonic()
            timed_out = _raised(lambda: dist.all_reduce(x, timeout=1))
            raised_after = time.monotonic() - start
        aborted = pg.is_aborted()
        producer.synchronize()
        old_comm = id(pg.backends()["cuda"])
        pg.reconfigure("after-timeout", [pg.get_init_handle()]).wait()
        y = cp.arange(5, dtype=cp.float64)
        dist.all_reduce(y)
        return {
            "timed_out": timed_out,
            "raised_after_s": round(raised_after, 2),
            "aborted": aborted,
            "heard": heard[:1],
            "new_backend": id(pg.backends()["cuda"]) != old_comm,
            "aborted_after": pg.is_aborted(),
            "after": cp.asnumpy(y).tolist(),
        }
    finally:
        producer.synchronize()
        dist.destroy_process_group()


def _abort_from_another_thread() -> dict[str, Any]:
    """ProcessGroup.abort from another thread fails a pending nccl operation at once."""
    cp = _cupy()
    _init_nccl(60)
    pg = dist.group.WORLD
    heard: list[str] = []
    pg.register_abort_hook(heard.append)
    _hold, x, producer = _held(cp, cap=_HELD_FOR)
    try:
        with producer:
            work = dist.all_reduce(x, async_op=True)
        threading.Timer(0.5, pg.abort, args=("stopped by the test",)).start()
        start = time.monotonic()
        waited = _raised(work.synchronize)  # wait() only orders the stream: on the host
        raised_after = time.monotonic() - start
        later = _raised(lambda: dist.all_reduce(cp.ones(4)))
        return {
            "waited": waited,
            "later": later,
            "raised_after_s": round(raised_after, 2),
            "aborted": pg.is_aborted(),
            "heard": heard[:1],
        }
    finally:
        producer.synchronize()
        dist.destroy_process_group()


def _in_fresh_process(fn, env: dict[str, str] | None = None) -> Any:
    pool = RankPool(1, env={"NCCL_SOCKET_IFNAME": "lo", **(env or {})}, start_timeout=120)
    try:
        return pool.run(fn, timeout=180)[0]
    finally:
        pool.close()


def test_wait_orders_the_stream_without_blocking_the_host(nccl):
    got = _in_fresh_process(_work_semantics)
    assert got["waited"] is True
    assert got["pending_after_wait"] is True, "wait() blocked the host until the op ended"
    assert got["finished"] is True and got["completed"] is True
    assert got["hold"] == "released"
    assert got["x"] == [3.0]  # the producer ran before the collective
    assert got["y"] == [6.0]  # the consumer ran after it
    assert got["future"] is True


def test_blocking_wait_flag_blocks_the_host(nccl):
    got = _in_fresh_process(_blocking_wait, env={"DISTCOMM_NCCL_BLOCKING_WAIT": "1"})
    assert got["waited"] is True
    assert got["completed"] is True, "wait() returned before the operation completed"
    assert got["hold"] == "released" and got["x"] == [1.0]


def test_wait_timeout_aborts_and_a_new_group_works(nccl):
    got = _in_fresh_process(_wait_timeout_aborts)
    print(got)  # how long the abort took, for the log
    assert re.match(r"DistTimeoutError: .*all_reduce #\d+ .*aborted", got["waited"]), got
    assert re.match(r"DistTimeoutError: .*aborted", got["later"]), got
    assert got["hold"] == "ran out", got  # the op could not have completed before
    assert got["after"] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_watchdog_fails_an_operation_past_the_group_timeout(nccl):
    got = _in_fresh_process(_watchdog_times_out)
    print(got)  # how long the abort took, for the log
    assert re.match(r"DistTimeoutError: .*did not complete within 3 s", got["waited"]), got
    assert re.match(r"DistTimeoutError: .*aborted", got["later"]), got
    assert got["hold"] == "ran out", got


def test_op_timeout_aborts_and_reconfigure_makes_a_new_communicator(nccl):
    got = _in_fresh_process(_op_timeout_then_reconfigure)
    print(got)  # how long the timeout took, for the log
    assert re.match(r"DistTimeoutError: .*all_reduce", got["timed_out"]), got
    assert got["aborted"] is True and got["heard"], got
    assert got["new_backend"] is True and got["aborted_after"] is False
    assert got["after"] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_abort_from_another_thread_fails_the_pending_op(nccl):
    got = _in_fresh_process(_abort_from_another_thread)
    print(got)
    assert "stopped by the test" in got["waited"], got
    assert got["later"] != "nothing", got
    assert got["aborted"] is True and "stopped by the test" in got["heard"][0], got


def test_split_group_and_premul_sum_on_nccl(nccl):
    got = _in_fresh_process(_split_and_premul)
    assert got["x"] == [k * 0.5 for k in range(8)]
    assert got["z"] == [complex(2 * k, 2 * k) for k in range(6)]
    assert got["out"] == [0.0, 3.0, 6.0, 9.0]
    assert got["h"] == [k * 0.5 for k in range(5)]
    assert got["sub"] == 1


def test_destroy_process_group_leaves_nothing_on_the_device(nccl):
    got = _in_fresh_process(_destroy_leaves_nothing)
    print(got)
    assert got["pool_used"] == 0, f"arrays left allocated after destroy: {got}"
    assert got["threads"] == [], f"threads left after destroy: {got}"
    # three more init/destroy cycles did not take device memory for good
    assert got["freed_less_by"] < 8 << 20, f"device memory not returned: {got}"


# -- CuPy through the CPU backends, ranks sharing the GPU --------------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_cupy_through_gloo(gpu, n):
    pool = RankPool(n, "gloo", init_timeout=120, start_timeout=120)
    try:
        checked = pool.run(staged_collectives, "cupy", timeout=300)
    finally:
        pool.close()
    assert min(checked) > 100, checked


@pytest.mark.parametrize("n", [2, 4])
def test_cupy_through_mpi(gpu, n):
    if mpijobs.LAUNCHER is None:
        pytest.skip(mpijobs.SKIP_REASON)
    command = mpijobs.LAUNCHER.command(
        n, sys.executable, "-m", "tests.gpu_staged_job", "mpi", "cupy"
    )
    done = mpijobs.run(command, timeout=300, merge_output=True)
    assert done.returncode == 0, done.stdout
    assert len(re.findall(r"mpi cupy: \d+ results checked", done.stdout)) == n, done.stdout
