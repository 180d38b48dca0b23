"""Where real NCCL is stricter than a naive model, against the CUDA stand-in.

The stand-in (tests/cuda_standin.py) models three such rules, and these tests check both
the model and the nccl backend under it:

* a lone send or receive (outside an NCCL group) blocks its stream until the peer's
  matching operation runs: the backend defers lone sends and receives and posts them
  together as one NCCL group, so rings and crossing exchanges cannot deadlock;
* NCCL launches of one GPU run in the order they were issued there, whatever their
  communicator: the backend issues every group's operations of a GPU under one lock;
* only NCCL's in-place forms may overlap an input with an output: the backend stages
  any other overlapping input in a temporary.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import distcomm as dist
from distcomm.group import ProcessGroup
from distcomm.ops import ReduceOp
from tests.cuda_standin import CudaStandin, NcclError
from tests.harness import wait_until
from tests.test_collectives import values
from tests.test_nccl_standin import Cluster, Rank, clusters, installed_standin, same

pytestmark = pytest.mark.timeout(120)

SUM = ReduceOp.SUM
FLOAT32 = 7  # NCCL's code
#: how long a stand-in wait lasts before it is reported: short, so that a deadlock the
#: old code had fails its test quickly
WAIT = 3.0


@pytest.fixture
def cuda(monkeypatch):
    """The stand-in installed as `cupy` (4 fake GPUs, waits of WAIT s); fails the test on
    misuse."""
    yield from installed_standin(monkeypatch, device_count=4, wait_timeout=WAIT)


@pytest.fixture
def make_cluster(cuda):
    yield from clusters(cuda, timeout=2 * WAIT)


# -- driving the stand-in's NCCL directly ---------------------------------------------------


def _in_threads(standin: CudaStandin, fns: list[Any]) -> list[Any]:
    """Run `fns[r]()` on thread r (on GPU r); their results (or exceptions)."""
    out: list[Any] = [None] * len(fns)

    def body(r: int) -> None:
        standin.cuda.Device(r).use()
        try:
            out[r] = fns[r]()
        except Exception as exc:
            out[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(len(fns))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "a stand-in call did not return"
    return out


def _communicators(standin: CudaStandin, n: int) -> list[Any]:
    """A clique of `n` communicators, rank r on GPU r, with a stream each (`comm.s`)."""
    uid = standin.nccl.get_unique_id()

    def make(r: int) -> Any:
        comm = standin.nccl.NcclCommunicator(n, uid, r)
        comm.s = standin.cuda.Stream(non_blocking=True)
        return comm

    return _in_threads(standin, [lambda r=r: make(r) for r in range(n)])


def _on(standin: CudaStandin, device: int, fn: Any) -> Any:
    with standin.cuda.Device(device):
        return fn()


# -- 5: a lone send or receive waits for its peer -----------------------------------------


def test_standin_lone_send_blocks_its_stream_until_the_peer_receives(cuda):
    a, b = _communicators(cuda, 2)
    cp = cuda.cupy
    x = _on(cuda, 0, lambda: cp.asarray(np.arange(4, dtype=np.float32)))
    y = _on(cuda, 1, lambda: cp.zeros(4, np.float32))
    with cuda.cuda.Device(0):
        a.send(x.data.ptr, 4, FLOAT32, 1, a.s.ptr)
        after_send = a.s.record()
        x[...] = 7  # later work on the stream waits behind the send
        assert not after_send.done, "a lone send completed before its receiver ran"
    with cuda.cuda.Device(1):
        b.recv(y.data.ptr, 4, FLOAT32, 0, b.s.ptr)
        after_recv = b.s.record()
        assert after_recv.done
        same(y.get(stream=b.s), np.arange(4, dtype=np.float32), "received")
    with cuda.cuda.Device(0):
        assert after_send.done
        same(x.get(stream=a.s), np.full(4, 7, np.float32), "the work behind the send ran")


def test_standin_reports_crossing_lone_sends_as_a_deadlock(cuda):
    """Both ranks send, then receive, outside a group: each send waits for a receive that
    is queued behind the other rank's send. Reported after wait_timeout."""
    comms = _communicators(cuda, 2)
    cp = cuda.cupy
    arrays = [_on(cuda, r, lambda: cp.zeros(2, np.float32)) for r in range(2)]
    for r, comm in enumerate(comms):
        with cuda.cuda.Device(r):
            comm.send(arrays[r].data.ptr, 2, FLOAT32, 1 - r, comm.s.ptr)
            comm.recv(arrays[r].data.ptr, 2, FLOAT32, 1 - r, comm.s.ptr)
            assert not comm.s.done
    deadline = time.monotonic() + 4 * WAIT
    while len(cuda.violations) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    found = [v for v in cuda.violations if "lone send" in v and "was not matched" in v]
    assert len(found) == 2, cuda.violations
    for comm in comms:
        with pytest.raises(NcclError):
            comm.check_async_error()
        comm.abort()
    cuda.violations.clear()


def _ring(me: Rank) -> None:
    """isend to the right, irecv from the left, then wait (torch's ring idiom)."""
    b, r, n, cp = me.backend, me.rank, me.size, me.cp
    got = cp.zeros(5, cp.float32)
    sent = b.send(me.array(values(r, 5, "float32")), (r + 1) % n, 0)
    received = b.recv(got, (r - 1) % n, 0)
    assert sent.wait() and received.wait()
    same(got.get(), values((r - 1) % n, 5, "float32"), "ring")


def test_ring_of_lone_sends_and_receives(make_cluster):
    make_cluster(3).run(_ring)


def _crossing(me: Rank) -> None:
    """Both ranks isend to the other, then irecv from it - into the array they send."""
    b, r, cp = me.backend, me.rank, me.cp
    x = me.array(values(r, 6, "float32"))
    other = cp.zeros(3, cp.float32)
    works = [
        b.send(x, 1 - r, 0),
        b.recv(x, 1 - r, 0),  # the send reads x before this receive overwrites it
        b.send(me.array(values(r + 5, 3, "float32")), 1 - r, 0),
        b.recv(other, 1 - r, 0),
    ]
    for work in works:
        assert work.wait() is True
    same(x.get(), values(1 - r, 6, "float32"), "crossing")
    same(other.get(), values(1 - r + 5, 3, "float32"), "crossing, second message")


def test_crossing_lone_sends_and_receives(make_cluster):
    make_cluster(2).run(_crossing)


def _relay(me: Rank) -> None:
    """Rank 1 receives into y and sends y on: the send must send what was received."""
    b, r, cp = me.backend, me.rank, me.cp
    if r == 0:
        b.send(me.array(values(9, 4, "float32")), 1, 0).wait()
    elif r == 1:
        y = cp.zeros(4, cp.float32)
        works = [b.recv(y, 0, 0), b.send(y, 2, 0)]
        for work in works:
            work.wait()
    else:
        z = cp.zeros(4, cp.float32)
        b.recv(z, 1, 0).wait()
        same(z.get(), values(9, 4, "float32"), "relayed")


def test_a_received_array_sent_on_is_what_was_received(make_cluster):
    make_cluster(3).run(_relay)


def _is_completed_posts(me: Rank) -> None:
    b, r, cp = me.backend, me.rank, me.cp
    got = cp.zeros(2, cp.float32)
    works = [b.send(me.array(values(r, 2, "float32")), 1 - r, 0), b.recv(got, 1 - r, 0)]
    deadline = time.monotonic() + 4 * WAIT
    while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(w.is_completed() and w.is_success() for w in works)
    same(got.get(), values(1 - r, 2, "float32"), "polled")


def test_polling_lone_works_posts_them(make_cluster):
    make_cluster(2).run(_is_completed_posts)


def _left_unwaited(me: Rank) -> Any:
    b, r, cp = me.backend, me.rank, me.cp
    b.all_reduce(cp.ones(1, cp.float32), SUM).wait()
    if r == 0:
        work = b.send(me.array(values(3, 2, "float32")), 1, 0)  # never waited on
        b.shutdown()  # posts it, then waits for it a while
        return work
    got = cp.zeros(2, cp.float32)
    b.recv(got, 0, 0).wait(timeout=3 * WAIT)
    same(got.get(), values(3, 2, "float32"), "sent before the group was destroyed")
    return None


def test_a_lone_send_never_waited_on_is_posted_when_the_group_is_destroyed(make_cluster):
    work, _ = make_cluster(2).run(_left_unwaited)
    assert work.is_completed() and work.is_success()


def _two_groups_crossing(me: Rank, other: Cluster) -> None:
    """One batch_isend_irecv with a crossing exchange in each of two groups."""
    r, cp = me.rank, me.cp
    g = me.group()
    h = ProcessGroup("h", [0, 1], r, {"cuda": other.backends[r]}, "nccl", other.timeout, r)
    got = [cp.zeros(3, cp.float32) for _ in range(2)]
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, me.array(values(r, 3, "float32")), 1 - r, group=g),
            dist.P2POp(dist.irecv, got[0], 1 - r, group=g),
            dist.P2POp(dist.isend, me.array(values(r + 7, 3, "float32")), 1 - r, group=h),
            dist.P2POp(dist.irecv, got[1], 1 - r, group=h),
        ]
    )
    for work in works:
        assert work.wait() is True
    same(got[0].get(), values(1 - r, 3, "float32"), "group g")
    same(got[1].get(), values(1 - r + 7, 3, "float32"), "group h")


def test_batch_across_two_groups_posts_one_nccl_group_per_group(solo, cuda, make_cluster):
    first, second = make_cluster(2), make_cluster(2)
    first.run(_two_groups_crossing, second)
    assert len(cuda.calls("groupStart")) == 4  # a group per process group and rank


# -- 7: NCCL launches of one GPU run in the order they were issued ------------------------


def _two_cliques(cuda: CudaStandin) -> tuple[list[Any], list[Any]]:
    return _communicators(cuda, 2), _communicators(cuda, 2)


def test_standin_runs_launches_of_one_gpu_in_issue_order(cuda):
    """Rank 0's allReduce on communicator B, issued after its lone send on A, starts only
    once that send completed (when rank 1 receives)."""
    (a0, a1), (b0, b1) = _two_cliques(cuda)
    cp = cuda.cupy
    x = _on(cuda, 0, lambda: cp.ones(2, np.float32))
    xs = [_on(cuda, r, lambda: cp.ones(3, np.float32)) for r in range(2)]
    with cuda.cuda.Device(0):
        a0.send(x.data.ptr, 2, FLOAT32, 1, a0.s.ptr)
        b0.allReduce(xs[0].data.ptr, xs[0].data.ptr, 3, FLOAT32, 0, b0.s.ptr)
        reduced = b0.s.record()
        assert not reduced.done, "an allReduce started before an earlier launch of its GPU"
    y = _on(cuda, 1, lambda: cp.zeros(2, np.float32))

    def rank1() -> None:
        a1.recv(y.data.ptr, 2, FLOAT32, 0, a1.s.ptr)
        b1.allReduce(xs[1].data.ptr, xs[1].data.ptr, 3, FLOAT32, 0, b1.s.ptr)

    _in_threads(cuda, [lambda: None, rank1])
    with cuda.cuda.Device(0):
        reduced.synchronize()
        same(xs[0].get(stream=b0.s), np.full(3, 2, np.float32), "allReduce on B")


def test_standin_reports_launches_issued_in_another_order_on_another_rank(cuda):
    """Rank 0 issues A then B, rank 1 B then A, each from one thread per communicator:
    on a GPU they deadlock (before NCCL 2.26); the stand-in reports it."""
    (a0, a1), (b0, b1) = _two_cliques(cuda)
    cp = cuda.cupy
    xs = [_on(cuda, r, lambda: cp.ones(2, np.float32)) for r in range(2)]

    def reduce_on(comm: Any, r: int) -> None:
        with cuda.cuda.Device(r):
            try:
                comm.allReduce(xs[r].data.ptr, xs[r].data.ptr, 2, FLOAT32, 0, comm.s.ptr)
            except NcclError:  # the one that timed out
                pass

    first = [
        threading.Thread(target=reduce_on, args=(a0, 0)),
        threading.Thread(target=reduce_on, args=(b1, 1)),
    ]
    for thread in first:
        thread.start()

    def posted(comm: Any) -> bool:
        """Whether `comm`'s allReduce holds its GPU's turn (posted, waiting for its peer)."""
        with cuda.nccl_cond:
            return any(comm.rank in slot["posts"] for slot in comm.clique.colls.values())

    wait_until(lambda: posted(a0) and posted(b1), "the first launches to be on their GPUs")
    second = [
        threading.Thread(target=reduce_on, args=(b0, 0)),
        threading.Thread(target=reduce_on, args=(a1, 1)),
    ]
    for thread in second:
        thread.start()
    for thread in first + second:
        thread.join(6 * WAIT)
    deadline = time.monotonic() + 4 * WAIT
    while not cuda.violations and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any("timed out waiting for ranks" in v for v in cuda.violations), cuda.violations
    for comm in (a0, a1, b0, b1):
        comm.abort()
    cuda.violations.clear()


def _threads_of_two_groups(me: Rank, other: Cluster) -> None:
    """Rank 0: one thread posts a batch on group A while another issues an all_reduce on
    group B in the middle of it. Rank 1: the batch, then the all_reduce, in one thread.
    The batch must reach the GPU before the all_reduce on rank 0 too."""
    a, b, r, cp = me.backend, other.backends[me.rank], me.rank, me.cp
    a.barrier().wait()
    b.barrier().wait()  # both communicators exist
    x = me.array(values(r, 4, "float32"))
    got = cp.zeros(4, cp.float32)
    z = me.array(values(r, 3, "float32"))

    def batch(midway: Any = None) -> list[Any]:
        with a.coalesce(x):
            works = [a.send(x, 1 - r, 0), a.recv(got, 1 - r, 0)]
            if midway is not None:
                midway()
        return works

    def reduce() -> None:
        b.all_reduce(z, SUM).wait()

    if r == 1:
        works = batch()
        reduce()
    else:
        started = threading.Event()
        reducer = threading.Thread(target=lambda: (started.wait(), reduce()), name="reducer")
        reducer.start()

        def midway() -> None:
            started.set()
            deadline = time.monotonic() + 1.0  # the other thread tries to issue meanwhile
            while not me.standin.calls("allReduce", thread="reducer") and (
                time.monotonic() < deadline
            ):
                time.sleep(0.01)

        works = batch(midway)
        reducer.join(6 * WAIT)
    for work in works:
        assert work.wait() is True
    same(got.get(), values(1 - r, 4, "float32"), "batch on A")
    same(z.get(), values(0, 3, "float32") + values(1, 3, "float32"), "all_reduce on B")


def test_groups_of_one_gpu_issue_in_one_order_across_threads(make_cluster):
    first, second = make_cluster(2), make_cluster(2)
    first.run(_threads_of_two_groups, second)


# -- 8: only NCCL's in-place forms may overlap ---------------------------------------------


def test_standin_refuses_overlaps_other_than_the_in_place_forms(cuda):
    (comm,) = _communicators(cuda, 1)
    cp = cuda.cupy
    with cuda.cuda.Device(0):
        buf = cp.zeros(8, np.float32)
        at = buf.data.ptr
        comm.allGather(at, at, 4, FLOAT32, comm.s.ptr)  # rank 0's in-place form
        comm.allReduce(at, at, 8, FLOAT32, 0, comm.s.ptr)
        with pytest.raises(NcclError, match="in-place form"):
            comm.allGather(at + 4, at, 4, FLOAT32, comm.s.ptr)
        with pytest.raises(NcclError, match="in-place form"):
            comm.reduceScatter(at, at + 8, 4, FLOAT32, 0, comm.s.ptr)
        with pytest.raises(NcclError, match="in-place form"):
            comm.allReduce(at, at + 4, 4, FLOAT32, 0, comm.s.ptr)
        cuda.nccl.groupStart()
        comm.send(at, 4, FLOAT32, 0, comm.s.ptr)
        comm.recv(at + 8, 4, FLOAT32, 0, comm.s.ptr)
        with pytest.raises(NcclError, match="overlaps"):
            cuda.nccl.groupEnd()
    assert len(cuda.violations) == 4, cuda.violations
    cuda.violations.clear()
    comm.abort()


def _overlapping(me: Rank, which: str) -> None:
    b, r, n, cp = me.backend, me.rank, me.size, me.cp
    if which == "all_to_all":  # into its own input
        x = me.array(np.concatenate([values(r * n + k, 2, "float32") for k in range(n)]))
        b.all_to_all(x, x, [2] * n, [2] * n).wait()
        expected = np.concatenate([values(k * n + r, 2, "float32") for k in range(n)])
        same(x.get(), expected, "all_to_all(x, x)")
    elif which == "all_gather":  # the input is the first piece of the output on every rank
        out = cp.zeros(3 * n, cp.float32)
        out[0:3] = me.array(values(r, 3, "float32"))
        b.all_gather(out, out[0:3]).wait()
        wanted = np.concatenate([values(k, 3, "float32") for k in range(n)])
        same(out.get(), wanted, "all_gather")
    elif which == "reduce_scatter":  # the output is the first piece of the input everywhere
        full = me.array(values(r, 2 * n, "float32"))
        b.reduce_scatter(full[0:2], full, SUM).wait()
        total = sum(values(k, 2 * n, "float32") for k in range(n))
        same(full[0:2].get(), total[2 * r : 2 * r + 2], "reduce_scatter")
    elif which == "scatter":  # from rank 0, whose output there is rank 1's piece of the input
        parts = me.array(np.concatenate([values(k + 20, 2, "float32") for k in range(n)]))
        mine = parts[2:4] if r == 0 else cp.zeros(2, cp.float32)
        b.scatter(mine, parts if r == 0 else None, 0).wait()
        same(mine.get(), values(r + 20, 2, "float32"), "scatter")
    else:  # gather to rank 0, whose input there overlaps two pieces of the output
        gathered = me.array(np.zeros(2 * n + 1, np.float32))
        gathered[1:3] = me.array(values(20, 2, "float32"))
        source = gathered[1:3] if r == 0 else me.array(values(r + 20, 2, "float32"))
        b.gather(gathered[0 : 2 * n] if r == 0 else None, source, 0).wait()
        if r == 0:
            wanted = np.concatenate([values(k + 20, 2, "float32") for k in range(n)])
            same(gathered.get()[0 : 2 * n], wanted, "gather")


@pytest.mark.parametrize(
    "which", ["all_to_all", "all_gather", "reduce_scatter", "scatter", "gather"]
)
def test_overlapping_inputs_and_outputs(make_cluster, which):
    make_cluster(2).run(_overlapping, which)


def _batch_swap(me: Rank) -> None:
    """A batch that sends x and receives into x: the send goes from before the batch."""
    r = me.rank
    pg = me.group()
    x = me.array(values(r, 5, "float32"))
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.irecv, x, 1 - r, group=pg),
            dist.P2POp(dist.isend, x, 1 - r, group=pg),
        ]
    )
    for work in works:
        assert work.wait() is True
    same(x.get(), values(1 - r, 5, "float32"), "swapped")


def test_a_batch_sending_and_receiving_one_array(solo, make_cluster):
    make_cluster(2).run(_batch_swap)
