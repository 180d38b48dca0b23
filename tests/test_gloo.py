"""The gloo backend's own behaviour: which transport it picks, its shared-memory path under
threads and failures, and that nothing is left in /dev/shm or mapped afterwards.

The conformance suite (test_collectives.py) already runs every op on gloo twice: on its
shared-memory path and with DISTCOMM_GLOO_TRANSPORT=tcp.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

import distcomm as dist
from distcomm import parallel
from distcomm.multiprocessing.shm.protocol import NAME_PREFIX
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(180)


def _backend():
    return dist.group.WORLD._backends["cpu"]


def _segments_mapped() -> int:
    with open("/proc/self/maps") as maps:
        return sum("distcomm-gloo" in line for line in maps)


_SHM = "/dev/shm/"


def _shm_held() -> dict:
    """What this process holds in shared memory now: the inodes of the /dev/shm files it
    maps or has open, and whether it maps the gloo segment (a memfd, which has no name).

    Inodes, not names: a named semaphore is mapped under the temporary name it was made
    with (glibc links it to its real name, then removes the first). A leak check compares
    these, taken in the ranks, with /dev/shm afterwards, so files of other programs on
    the host (an MPI job, another test run) are never judged."""
    inodes, gloo = set(), False
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6:
                gloo = gloo or "distcomm-gloo" in fields[5]
                if fields[5].startswith(_SHM):
                    inodes.add(int(fields[4]))
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(_SHM):
                inodes.add(os.fstat(int(fd)).st_ino)
        except OSError:  # the descriptor listdir itself used, closed since
            continue
    return {"pid": os.getpid(), "inodes": sorted(inodes), "gloo": gloo}


def _merge(*held: dict) -> dict:
    """One process's `_shm_held` snapshots taken at different times, as one."""
    inodes = {inode for h in held for inode in h["inodes"]}
    return {"pid": held[0]["pid"], "inodes": sorted(inodes), "gloo": any(h["gloo"] for h in held)}


def _left_behind(reports: list[dict]) -> list[str]:
    """What the processes of `reports` left in /dev/shm: a file one of them mapped or held
    open (its inode), or a distcomm segment named with one of their pids."""
    if not os.path.isdir(_SHM):
        return []
    inodes = {inode for report in reports for inode in report["inodes"]}
    prefixes = tuple(f"{NAME_PREFIX}{report['pid']}_" for report in reports)
    with os.scandir(_SHM) as entries:
        return sorted(
            entry.name
            for entry in entries
            if entry.inode() in inodes or entry.name.startswith(prefixes)
        )


def _nothing_left_behind(reports: list[dict], timeout: float = 15.0) -> list[str]:
    """`_left_behind(reports)` once empty, or what is still there after `timeout` s (a
    dead process's files may be removed by a cleaner that runs after it)."""
    end = time.monotonic() + timeout
    while (left := _left_behind(reports)) and time.monotonic() < end:
        time.sleep(0.1)
    return left


def _check_ops() -> str:
    """A few ops of every shape; returns the group's transport."""
    r, n = dist.get_rank(), dist.get_world_size()
    for count in (3, 300_000):
        x = np.full(count, r + 1.0)
        dist.all_reduce(x)
        assert (x == n * (n + 1) / 2).all()
        out = np.empty(count * n, np.int32)
        dist.all_gather_single(out, np.full(count, r, np.int32))
        assert (out.reshape(n, count) == np.arange(n)[:, None]).all()
        y = np.arange(count * n, dtype=np.float32)
        z = np.empty(count, np.float32)
        dist.reduce_scatter_single(z, y)
        assert (z == n * np.arange(r * count, (r + 1) * count, dtype=np.float32)).all()
    return _backend().transport


def test_one_host_uses_shared_memory():
    assert run_ranks(_check_ops, 3, backend="gloo", timeout=60) == ["shm"] * 3


def test_transport_tcp_forced_by_environment():
    results = run_ranks(
        _check_ops, 2, backend="gloo", timeout=60, env={"DISTCOMM_GLOO_TRANSPORT": "tcp"}
    )
    assert results == ["tcp"] * 2


def test_ranks_on_two_hosts_share_memory_within_each():
    hosts = {0: "host-a", 1: "host-b", 2: "host-a", 3: "host-b"}
    results = run_ranks(
        _check_ops, 4, backend="gloo", timeout=90, rank_env=lambda r: {"DISTCOMM_HOST_ID": hosts[r]}
    )
    assert results == ["shm+tcp"] * 4


def test_one_rank_per_host_uses_tcp():
    results = run_ranks(
        _check_ops,
        2,
        backend="gloo",
        timeout=90,
        rank_env=lambda r: {"DISTCOMM_HOST_ID": f"host-{r}"},
    )
    assert results == ["tcp"] * 2


def test_one_rank_declining_shared_memory_makes_all_use_tcp():
    results = run_ranks(
        _check_ops,
        3,
        backend="gloo",
        timeout=60,
        rank_env=lambda r: {"DISTCOMM_GLOO_TRANSPORT": "tcp" if r == 1 else ""},
    )
    assert results == ["tcp"] * 3


def _bad_mode() -> str:
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=10)
    except ValueError as exc:
        return str(exc)
    dist.destroy_process_group()
    return "no error"


def test_invalid_transport_setting_is_a_clear_error():
    results = run_ranks(
        _bad_mode, 1, backend=None, timeout=30, env={"DISTCOMM_GLOO_TRANSPORT": "shmem"}
    )
    assert "DISTCOMM_GLOO_TRANSPORT='shmem'" in results[0] and "'tcp'" in results[0]


def _threaded(threads: int) -> list[bool]:
    r, n = dist.get_rank(), dist.get_world_size()
    checks = []
    with parallel.threads(threads):
        count = 3_000_001  # 24 MB of float64: split over the threads
        x = np.arange(count, dtype=np.float64) * (r + 1)
        dist.all_reduce(x)
        checks.append(bool((x == np.arange(count) * (n * (n + 1) / 2)).all()))
        y = np.arange(count, dtype=np.float64) if r == 0 else np.zeros(count)
        dist.broadcast(y, src=0)
        checks.append(bool((y == np.arange(count)).all()))
        m = np.full(count, r, np.int64)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        checks.append(bool((m == n - 1).all()))
        w = [dist.all_reduce(np.full(count // 3, float(r)), async_op=True) for _ in range(3)]
        for work in w:
            work.wait()
            checks.append(bool((work.result()[0] == n * (n - 1) / 2).all()))
    return checks


@pytest.mark.parametrize("threads", [1, 2])
def test_large_collectives_split_over_threads(threads):
    for checks in run_ranks(_threaded, 2, threads, backend="gloo", timeout=120):
        assert all(checks), checks


def _bad_splits() -> tuple[str, str]:
    r = dist.get_rank()
    inp = np.arange(40_000, dtype=np.float64)
    out = np.zeros(40_000)
    splits = [20_000, 20_000] if r == 0 else [10_000, 30_000]
    try:
        dist.all_to_all_single(
            out, inp, output_split_sizes=[20_000, 20_000], input_split_sizes=splits
        )
        dist.barrier()
    except dist.DistError as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def test_inconsistent_all_to_all_splits_are_reported():
    results = run_ranks(_bad_splits, 2, backend="gloo", timeout=60)
    assert all(kind == "DistBackendError" for kind, _ in results), results
    assert any("output_split_sizes" in message for _, message in results), results


def _mapped_then_destroyed(path: str) -> tuple[int, int, dict]:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{path}",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=60,
    )
    sub = dist.new_group([0, 1])
    x = np.ones(200_000)
    dist.all_reduce(x)
    if dist.get_rank() < 2:
        dist.all_reduce(x, group=sub)
    during, held = _segments_mapped(), _shm_held()
    dist.destroy_process_group()
    return during, _segments_mapped(), held


def test_destroy_unmaps_every_segment(tmp_path):
    results = run_ranks(_mapped_then_destroyed, 3, str(tmp_path / "rdzv"), timeout=60)
    assert [during for during, _, _ in results] == [2, 2, 1], results
    assert [after for _, after, _ in results] == [0, 0, 0], results
    left = _nothing_left_behind([held for _, _, held in results])
    assert not left, left


def _raise_or_die(how: str, report_dir: str) -> None:
    """Fails mid-job (every rank raises, or rank 1 is killed); each rank first writes what
    it holds in shared memory (`_shm_held`) to `report_dir`, the killed one just before."""
    held = []

    def record() -> None:
        held.append(_shm_held())
        with open(os.path.join(report_dir, f"rank-{dist.get_rank()}.json"), "w") as f:
            json.dump(_merge(*held), f)

    x = np.ones(500_000)
    try:
        try:  # a survivor may still be finishing this one when the killed rank dies
            dist.all_reduce(x)
        except dist.DistNetworkError:
            return
        record()
        if how == "raise":  # a mismatch: every rank raises out of the collective, mid-job
            if dist.get_rank() == 1:
                dist.broadcast(x, src=0)
            else:
                dist.all_reduce(x)
            return
        if dist.get_rank() == 1:
            record()
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            dist.all_reduce(x)
        except dist.DistNetworkError:
            pass
    finally:
        record()


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_nothing_left_in_dev_shm_after_exception_or_kill(how, tmp_path):
    outcomes = run_ranks(
        _raise_or_die,
        3,
        how,
        str(tmp_path),
        backend="gloo",
        timeout=60,
        check=False,
        may_die={1},
    )
    if how == "raise":
        assert all("DistBackendError" in o.error for o in outcomes), outcomes
    else:
        assert outcomes[0].ok and outcomes[2].ok, [o.describe() for o in outcomes]
        assert outcomes[1].exitcode == -signal.SIGKILL, outcomes[1]
    reports = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank-*.json"))]
    assert len(reports) == 3, reports
    assert any(report["gloo"] for report in reports), reports  # the shared-memory path ran
    left = _nothing_left_behind(reports)
    assert not left, left


# -- groups across (pretend) hosts: the hierarchical path fails as loudly as the others --------


def _two_host_failure(case: str) -> tuple[str, str]:
    r = dist.get_rank()
    x = np.ones(300_000)
    try:
        # inside the try: a survivor may still be finishing this one when rank 3 dies
        dist.all_reduce(x)
        if case == "mismatch":
            if r == 3:
                dist.broadcast(x, src=0)
            else:
                dist.all_reduce(x)
            dist.barrier()
        else:
            if r == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            for _ in range(3):
                dist.all_reduce(x)
    except dist.DistError as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


@pytest.mark.parametrize(
    "case,kind,words",
    [
        ("mismatch", "DistBackendError", "mismatch"),
        ("kill", "DistNetworkError", "rank 3"),
    ],
)
def test_failures_across_hosts_reach_every_rank(case, kind, words):
    outcomes = run_ranks(
        _two_host_failure,
        4,
        case,
        backend="gloo",
        timeout=60,
        may_die={3},
        rank_env=lambda r: {"DISTCOMM_HOST_ID": f"h{r % 2}"},
    )
    for rank, result in enumerate(outcomes):
        if case == "kill" and rank == 3:
            continue
        assert result[0] == kind, outcomes
    assert any(words in message for _, message in outcomes if message), outcomes


def _leave_at_different_times() -> tuple[str, float]:
    """The last collective of a job, with the ranks arriving and leaving at different times.

    Hosts h0 = ranks {0, 2} and h1 = {1, 3}: rank 1, h1's representative, comes late, so
    its host-mate rank 3 still waits for it in h1's step while rank 0 (index 0 on h0,
    like rank 1 on h1) has finished and left the group.
    """
    r = dist.get_rank()
    x = np.full(4, 7.0) if r == 0 else np.zeros(4)
    if r == 1:
        time.sleep(1.5)
    try:
        dist.broadcast(x, src=0)
    except dist.DistError as exc:
        return type(exc).__name__, str(exc)
    finally:
        dist.destroy_process_group()
    return "ok", float(x.sum())


def test_ranks_leaving_at_different_times_across_hosts():
    # each rank destroys its own group: nothing left for the harness to tear down
    results = run_ranks(
        _leave_at_different_times,
        4,
        backend="gloo",
        timeout=60,
        rank_env=lambda r: {"DISTCOMM_HOST_ID": f"h{r % 2}"},
    )
    assert results == [("ok", 28.0)] * 4, results


def _frozen_rank(frozen: int, resume_after: float) -> tuple[str, str]:
    """Three all_reduces; `frozen` stops itself (SIGSTOP) before the third, a helper
    process resumes it later."""
    x = np.ones(1000)
    try:
        for i in range(3):
            if i == 2 and dist.get_rank() == frozen:
                subprocess.Popen(["sh", "-c", f"sleep {resume_after}; kill -CONT {os.getpid()}"])
                os.kill(os.getpid(), signal.SIGSTOP)
            dist.all_reduce(x)
    except dist.DistError as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def test_timeout_across_hosts_names_the_stopped_rank():
    # rank 3 shares host h1 with rank 1, which stands for h1 between hosts: its stop holds
    # up rank 1 in h1's step, ranks 0 and 2 between hosts and on h0
    results = run_ranks(
        _frozen_rank,
        4,
        3,
        8.0,
        backend="gloo",
        timeout=90,
        init_timeout=3,
        rank_env=lambda r: {"DISTCOMM_HOST_ID": f"h{r % 2}"},
    )
    for rank in (0, 1, 2):
        kind, message = results[rank]
        assert kind == "DistTimeoutError", results
        assert "all_reduce on 'gloo' (group 'default') #2" in message, results
        assert "rank(s) 3 did not answer" in message, results
        for other in (0, 1, 2):
            assert f"rank(s) {other} " not in message, results
        assert "collective #4" not in message, results  # h1's own step count
    assert results[3][0] != "ok" and "aborted" in results[3][1], results


# -- the shared-memory engine's wake-ups --------------------------------------------------------


class _NoFailures:
    """The engine's FailureWatch (the TCP mailbox's place): nothing fails until a test
    sets `failure`, which `fail` reports to the listeners as the mailbox does."""

    def __init__(self) -> None:
        self.failure = None
        self.listeners: list = []

    def failed(self, rank: int):
        return self.failure

    def add_listener(self, callback) -> None:
        self.listeners.append(callback)

    def note_late(self, seq: int, ranks: tuple) -> None:
        pass

    def fail(self, failure) -> None:
        self.failure = failure
        for callback in self.listeners:
            callback()


def _two_engines():
    from distcomm.backends.engine.shm.engine import IntraNode
    from distcomm.backends.engine.shm.primitives import Segment

    segment = Segment(IntraNode.segment_bytes(2))
    pids = [os.getpid()] * 2
    engines = [
        IntraNode(segment, pids, rank, 2, [0, 1], 2, _NoFailures(), 4096, 1 << 20)
        for rank in (0, 1)
    ]
    return segment, engines


def test_a_rank_that_gives_up_fails_the_peers_collective_however_far_it_got(monkeypatch):
    """The abandon mark: once rank 0 gives up on the group (its abort listener), rank 1
    fails a wait whose counter was already reached and the last look of a collective
    (`settle`), with rank 0's failure once its watch has it. A group destroyed normally
    (GroupDestroyedError) and a peer that merely left leave no mark."""
    from distcomm.backends.engine.protocol import Failure
    from distcomm.backends.engine.shm import counters
    from distcomm.errors import DistBackendError, DistNetworkError, GroupDestroyedError

    monkeypatch.setattr(counters, "_CAUSE_GRACE_S", 0.0)  # no TCP news to wait for here
    segment, (zero, one) = _two_engines()
    sync0, sync1 = zero._sync, one._sync
    try:
        zero._watch.fail(Failure(GroupDestroyedError, "the process group was destroyed"))
        one._sync.settle(_call(0))  # no mark: a normal destroy
        sync0.set(sync0.arrive_at[0], 1)
        zero._watch.failure = None
        zero._watch.fail(Failure(DistNetworkError, "rank 0 lost a peer"))
        assert sync1.words[sync1.abandon_at] == 1  # rank 0's group rank + 1
        with pytest.raises(DistBackendError, match="rank 0 timed out, aborted the group"):
            sync1.wait(_call(0), sync0.arrive_at[0], 1, 0, "arrive")  # reached, yet fails
        with pytest.raises(DistBackendError, match="its arrays hold no valid result"):
            sync1.settle(_call(0))
        one._watch.failure = Failure(DistNetworkError, "rank 0 lost a peer")
        with pytest.raises(DistNetworkError, match="rank 0 lost a peer"):  # the cause
            sync1.settle(_call(0))
    finally:
        zero.release_views()
        one.release_views()
        segment.close()


def _call(seq: int):
    from distcomm.backends.engine.protocol import Call, Signature
    from distcomm.deadline import Deadline

    return Call(seq, Signature.of("barrier"), f"barrier #{seq}", Deadline(60))


def test_a_counter_raise_wakes_only_when_a_peer_sleeps(monkeypatch):
    """No futex_wake system call while nobody sleeps; a sleeping peer raises its flag
    first, is woken, and lowers it again."""
    import threading

    from distcomm.backends.engine.shm import counters

    wakes: list[int] = []
    real_wake = counters.futex_wake
    monkeypatch.setattr(
        counters, "futex_wake", lambda address: (wakes.append(address), real_wake(address))
    )
    monkeypatch.setattr(counters, "_SLICE", 120.0)  # a sleep ends by a wake-up, not a timeout
    segment, (zero, one) = _two_engines()
    sync0, sync1 = zero._sync, one._sync
    try:
        arrive = sync0.arrive_at[0]
        sync0.set(arrive, 1)  # nobody waits: no system call
        assert wakes == []
        sync1.wait(_call(0), arrive, 1, 0, "arrive")  # reached already: returns at once
        done = threading.Event()

        def wait_for_two() -> None:
            sync1.wait(_call(1), arrive, 2, 0, "arrive")
            done.set()

        waiter = threading.Thread(target=wait_for_two, daemon=True)
        waiter.start()
        deadline = time.monotonic() + 60
        while not sync1.flags[1] and time.monotonic() < deadline:  # polls, yields, sleeps
            time.sleep(0.001)
        assert sync1.flags[1] == 1, "the waiting rank never said it sleeps"
        sync0.set(arrive, 2)
        waiter.join(60)
        assert done.is_set() and not waiter.is_alive()
        assert wakes == [segment.address + 4 * arrive]
        assert sync1.flags[1] == 0  # lowered after the wake-up
        sync0.set(arrive, 3)  # nobody sleeps any more: no system call
        assert len(wakes) == 1
    finally:
        zero.release_views()
        one.release_views()
        segment.close()
