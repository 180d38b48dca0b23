"""The CUDA stand-in behaving as real CuPy and NCCL do where the nccl backend meets them at
their edges, and the backend's answers.

Each behaviour has a test of the stand-in itself, then a test of the backend that failed
before the backend handled it:

* a sticky CUDA error: CuPy's `Event.done` never raises, only `eventQuery` tells;
* CuPy's communicators are blocking: ncclCommAbort while another thread is inside an
  NCCL call on one is forbidden;
* ncclCommInitRank hangs the healthy ranks when one fails, and NCCL fails only the ranks
  that share a GPU;
* ncclCommDestroy is a collective of the node's ranks, which CuPy also calls when it
  collects a communicator nobody released;
* a thread binds a CUDA context of its current device (a new thread's is 0), and CuPy's
  `with device:` switches back with cudaSetDevice;
* the work queued behind an aborted operation runs afterwards, asynchronously, and
  memory freed meanwhile may be handed out again.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distcomm.errors import DistBackendError, DistTimeoutError
from tests import test_nccl_standin as base
from tests.cuda_standin import CudaStandin, NcclError, StandinError
from tests.test_nccl_standin import AVG, OLD_NCCL, SUM, Rank, _first_op, same

cuda, make_cluster = base.cuda, base.make_cluster  # the fixtures

ROOT = Path(__file__).resolve().parent.parent


def _in_thread(fn: Any, *args: Any, name: str = "t") -> Any:
    """Run `fn(*args)` on a new thread; its result, or raise what it raised."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), f"{name} did not finish"
    if "error" in out:
        raise out["error"]
    return out.get("value")


# -- a sticky CUDA error ----------------------------------------------------------------------


def test_standin_event_done_never_raises_after_a_sticky_error(cuda):
    cp = cuda.cupy
    stream = cp.cuda.Stream()
    cuda.pause(stream)
    with stream:
        x = cp.zeros(4, cp.float32)
    event = cp.cuda.Event()
    event.record(stream)
    assert cuda.runtime.eventQuery(event.ptr) == 600  # cudaErrorNotReady
    cuda.fault(0)
    assert event.done is False  # CuPy's eventQuery(...) == 0: no exception
    assert cuda.runtime.eventQuery(event.ptr) == 700  # the sticky error, as a status
    with pytest.raises(cuda.runtime.CUDARuntimeError, match="cudaErrorIllegalAddress"):
        stream.synchronize()
    with pytest.raises(cuda.runtime.CUDARuntimeError, match="illegal memory access"):
        cp.ones(2)
    del x
    cuda.violations.clear()


def _faulted(me: Rank) -> str:
    _first_op(me)
    if me.rank == 0:
        me.standin.hang([0, 1])
    me.cluster.store.set(f"hung/{me.rank}", "1")
    me.cluster.store.wait(["hung/0"], 10)
    work = me.backend.all_reduce(me.cp.ones(3, me.cp.float32), SUM, async_op=True)
    if me.rank != 0:
        return ""
    me.standin.fault(me.device)
    try:
        work.wait(timeout=4.0)
    except DistBackendError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.timeout(60)
def test_a_sticky_cuda_error_fails_the_group_as_a_cuda_error(cuda, make_cluster):
    """The watchdog reads the event's status: the error is reported as CUDA's at once,
    not as a timeout of the group."""
    cluster = make_cluster(2, timeout=5.0)
    text = cluster.run(_faulted)[0]
    assert text.startswith("DistBackendError"), text
    assert "CUDA failed on GPU 0" in text and "700" in text, text
    assert "restart" in text, text


# -- blocking communicators and ncclCommAbort --------------------------------------------------


def test_standin_abort_while_a_thread_is_inside_a_call_is_a_violation(cuda):
    cp = cuda.cupy
    comms = _two_comms(cuda)
    inside = threading.Event()

    def reduce() -> None:
        cp.cuda.Device(0).use()
        x = cp.ones(2, cp.float32)
        inside.set()
        with pytest.raises(NcclError):  # rank 1 never joins: the abort ends it
            comms[0].allReduce(x.data.ptr, x.data.ptr, 2, 7, 0, 0)

    thread = threading.Thread(target=reduce)
    thread.start()
    inside.wait(10)
    time.sleep(0.2)  # inside the call, waiting for rank 1
    comms[0].abort()
    thread.join(30)
    assert any("ncclCommAbort while another thread is inside" in v for v in cuda.violations)
    comms[1].abort()
    cuda.violations.clear()


def _stuck_in_a_call(me: Rank) -> str:
    _first_op(me)
    if me.rank == 1:  # late: past rank 0's timeout, it comes and completes the call
        time.sleep(3.0)
        me.backend.all_reduce(me.cp.ones(2, me.cp.float32), SUM)
        return ""
    try:
        me.backend.all_reduce(me.cp.ones(2, me.cp.float32), SUM)
    except DistTimeoutError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(60)
def test_an_abort_waits_for_the_call_inside_nccl(cuda, make_cluster):
    """A call that blocks inside NCCL past the timeout fails the group, but the abort
    waits until the call returned (no thread is inside NCCL when it runs)."""
    cluster = make_cluster(2, timeout=1.0)
    text = cluster.run(_stuck_in_a_call)[0]
    assert "NCCL did not return within 1 s" in text, text
    assert "aborted once that call returns" in text, text
    deadline = time.monotonic() + 10
    while not cuda.calls("abort", rank=0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cuda.calls("abort", rank=0)


# -- initialisation ---------------------------------------------------------------------------


def test_standin_init_hangs_the_healthy_ranks_when_one_fails(cuda):
    uid = cuda.nccl.get_unique_id()
    cuda.fail_init(1)
    out: dict[int, BaseException] = {}

    def join(rank: int) -> None:
        cuda.cupy.cuda.Device(rank).use()
        try:
            cuda.nccl.NcclCommunicator(2, uid, rank)
        except BaseException as exc:
            out[rank] = exc

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    threads[1].join(30)
    assert "injected by the test" in str(out[1])
    threads[0].join(0.5)
    assert threads[0].is_alive() and cuda.hung_inits == 1  # rank 0 hangs, as in NCCL
    cuda.end_hung_inits()
    threads[0].join(30)
    assert "hung" in str(out[0]) and cuda.init_hangs_timed_out == 0


def test_standin_duplicate_gpu_fails_only_the_sharing_ranks(cuda):
    uid = cuda.nccl.get_unique_id()
    out: dict[int, BaseException] = {}

    def join(rank: int, device: int) -> None:
        cuda.cupy.cuda.Device(device).use()
        try:
            cuda.nccl.NcclCommunicator(3, uid, rank)
        except BaseException as exc:
            out[rank] = exc

    threads = [threading.Thread(target=join, args=(r, d)) for r, d in ((0, 0), (1, 0), (2, 2))]
    for t in threads:
        t.start()
    for t in threads[:2]:
        t.join(30)
    assert all("Duplicate GPU" in str(out[r]) for r in (0, 1))
    threads[2].join(0.5)
    assert threads[2].is_alive()  # NCCL <= 2.29: the third rank hangs
    cuda.end_hung_inits()
    threads[2].join(30)


# -- destroying communicators ------------------------------------------------------------------


def _two_comms(cuda: CudaStandin) -> dict[int, Any]:
    uid = cuda.nccl.get_unique_id()
    comms: dict[int, Any] = {}

    def join(rank: int) -> None:
        cuda.cupy.cuda.Device(rank).use()
        comms[rank] = cuda.nccl.NcclCommunicator(2, uid, rank)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return comms


def test_standin_destroy_is_a_collective_of_the_nodes_ranks(cuda):
    comms = _two_comms(cuda)
    done = threading.Event()

    def destroy() -> None:
        comms[0].destroy()
        done.set()

    thread = threading.Thread(target=destroy)
    thread.start()
    assert not done.wait(0.3)  # waits for rank 1
    comms[1].destroy()
    thread.join(30)
    assert done.is_set() and not cuda.violations
    comms = _two_comms(cuda)
    comms[1].abort()
    comms[0].destroy()  # after a peer's abort: would hang
    assert any("after ranks [1] aborted" in v for v in cuda.violations)
    cuda.violations.clear()


def _peer_failed(me: Rank) -> None:
    _first_op(me)
    if me.rank == 1:
        me.backend.abort("this rank gave up")  # rank 0 has nothing pending: sees nothing


@pytest.mark.timeout(60)
def test_shutdown_after_a_peers_abort_does_not_destroy(cuda, make_cluster):
    cluster = make_cluster(2)
    cluster.run(_peer_failed)
    deadline = time.monotonic() + 10
    while not cuda.calls("abort", rank=1) and time.monotonic() < deadline:
        time.sleep(0.01)
    cluster.run(lambda me: me.backend.shutdown())
    assert not cuda.calls("destroy")
    assert all(c.aborted for c in cuda.communicators())


_EXIT_SCRIPT = """
import atexit, sys, threading
sys.path.insert(0, {root!r})
from tests.cuda_standin import CudaStandin
standin = CudaStandin(device_count=2)
sys.modules.update(standin.modules())

def report():  # registered first: runs after distcomm's exit hooks
    print("unreleased", len(standin.unreleased()), "violations", standin.violations)

atexit.register(report)
import distcomm as dist
from distcomm.backends.nccl import NcclBackend

store = dist.HashStore()
backends = [NcclBackend(dist.PrefixStore("n", store), r, 2, 30.0, "g") for r in (0, 1)]

def run(r):
    standin.cuda.Device(r).use()
    x = standin.cupy.ones(2, standin.cupy.float32)
    backends[r].all_reduce(x, dist.ReduceOp.SUM).wait()

threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
[t.start() for t in threads]
[t.join(30) for t in threads]
print("reduced")
# no destroy_process_group: CuPy would destroy the communicators when collected
"""


@pytest.mark.timeout(120)
def test_communicators_never_destroyed_are_aborted_at_exit(tmp_path):
    script = tmp_path / "leave.py"
    script.write_text(textwrap.dedent(_EXIT_SCRIPT.format(root=str(ROOT))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTCOMM_")}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "reduced" in done.stdout, done.stdout
    assert "unreleased 0 violations []" in done.stdout, done.stdout + done.stderr


# -- CUDA contexts per thread ----------------------------------------------------------------


def test_standin_with_device_on_a_new_thread_makes_a_context_on_gpu_0(cuda):
    def switch_back() -> None:
        with cuda.cupy.cuda.Device(2):
            cuda.cupy.cuda.Event()

    _in_thread(switch_back)
    assert any("a CUDA context on GPU 0" in v for v in cuda.violations)
    cuda.violations.clear()

    def stay() -> None:
        cuda.cupy.cuda.Device(2).use()
        cuda.cupy.cuda.Event()

    _in_thread(stay)
    assert not cuda.violations
    assert _in_thread(lambda: cuda.driver.ctxGetCurrent()) == 0  # a new thread has none


def _from_another_thread(me: Rank) -> list[bool]:
    x = me.cp.ones(3, me.cp.float32)
    work = me.backend.all_reduce(x, SUM, async_op=True)
    seen = [_in_thread(work.is_completed, name=f"poll-{me.rank}")]
    _in_thread(work.wait, name=f"wait-{me.rank}")
    work.wait()
    seen.append(_in_thread(work.is_completed, name=f"poll2-{me.rank}"))
    same(x.get(), np.full(3, float(me.size), np.float32), "all_reduce")
    return seen


@pytest.mark.timeout(60)
def test_works_waited_on_other_threads_make_no_context_elsewhere(cuda, make_cluster):
    """wait() and is_completed() on threads that never chose a device make no CUDA
    context on GPU 0 (CuPy's `with device:` switched back with cudaSetDevice(0))."""
    seen = make_cluster(2, devices=[2, 3]).run(_from_another_thread)
    assert all(s[-1] for s in seen), seen


# -- asynchronous work after an abort --------------------------------------------------------


def test_standin_work_behind_an_abort_runs_later(cuda):
    comms = _two_comms(cuda)
    cp = cuda.cupy
    cuda.hang([0])
    cp.cuda.Device(0).use()
    stream = cp.cuda.Stream()
    x = cp.ones(4, cp.float32)
    comms[0].allReduce(x.data.ptr, x.data.ptr, 4, 7, 0, stream.ptr)
    with stream:
        x /= 2
    comms[0].abort()
    queued = [q for q in cuda._queues.values() if q.lagging]
    assert len(queued) == 1  # the division has not run yet
    del x  # its memory goes back to CuPy's pool while the GPU may still touch it
    cuda.settle()
    assert any("freed meanwhile" in v for v in cuda.violations)
    comms[1].abort()
    cuda.violations.clear()


def _average_then_abort(me: Rank) -> None:
    _first_op(me)
    me.standin.hang()
    # a local array, dropped by the caller: only the Work keeps it (no exception raised
    # here holds this frame: the watchdog fails the group at its timeout)
    me.backend.all_reduce(me.cp.full(4, 2.0, me.cp.float32), AVG, async_op=True)
    deadline = time.monotonic() + 20
    while me.backend._watch.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(me.backend._watch.failure, DistTimeoutError)


@pytest.mark.timeout(60)
def test_arrays_of_failed_ops_outlive_the_work_queued_behind_them(cuda, make_cluster):
    """NCCL 2.9 has no ncclAvg: AVG is a sum, then a division queued on the group's
    stream. After the abort that division still runs: its array must not be freed before
    the stream ran it."""
    cuda.nccl_version = OLD_NCCL
    cluster = make_cluster(2, timeout=1.0)
    cluster.run(_average_then_abort)
    cluster.shutdown()
    gc.collect()  # the failed Works' arrays, if shutdown let go of them
    cuda.settle()
    assert not [v for v in cuda.violations if "freed meanwhile" in v], cuda.violations


def test_standin_stream_waits_fail_on_a_sticky_error(cuda):
    cp = cuda.cupy
    stream = cp.cuda.Stream()
    cuda.pause(stream)
    cuda.fault(0)
    with pytest.raises((cuda.runtime.CUDARuntimeError, StandinError)):
        stream.synchronize()
    cuda.violations.clear()
