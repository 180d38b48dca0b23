"""Per-operation timeouts: `timeout=` on the collectives, point-to-point and object functions.

One rank does not call an operation that the others call with `timeout=`: the callers
raise DistTimeoutError naming the operation (and, where the backend can tell, the rank
not heard from), the group is aborted so the late rank's next operation raises too, and
after destroy_process_group and a new init every rank works again. Run on tcp and gloo
(spawned ranks), mpi (an mpiexec job) and nccl (the CUDA stand-in, ranks as threads).

Rank bodies return what they saw and the tests assert on that, never on durations. The
group timeout (60 s) is longer than the harness's deadline, so a rank that waited it out
fails the test. Ranks tell each other "my operation timed out" through files (threads'
events on the stand-in) rather than by sleeping, so load cannot reorder them.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import textwrap
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import distcomm as dist
from distcomm.errors import DistError
from tests.harness import run_ranks
from tests.mpijobs import (  # noqa: F401 - the fixture applies to every test here
    LAUNCHER,
    SKIP_REASON,
    job_env,
    no_mpi_segment_left,
    run,
)

# the stand-in's fixtures (make_cluster uses cuda), used by the nccl tests below
from tests.test_nccl_standin import Rank, cuda, make_cluster  # noqa: F401

pytestmark = pytest.mark.timeout(180)

#: the per-operation timeout the callers pass (seconds)
OP_TIMEOUT = 2.0
#: the groups' own timeout: longer than the harness's deadline (HARNESS)
GROUP_TIMEOUT = 60
HARNESS = 50
SIZES = [2, 3]


def _outcome(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, str]:
    try:
        fn(*args, **kwargs)
    except DistError as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def _names_missing(message: str, late: int) -> bool:
    """Whether `message` names `late` as the rank not heard from (the engine's words)."""
    return bool(re.search(rf"rank\(s\) (\d+, )*{late} (have not called|did not answer)", message))


# -- validation (one rank, in this process) ---------------------------------------------------


def _calls(x: np.ndarray) -> dict[str, Any]:
    """Every function that takes `timeout=`, called validly on a 1-rank group but for the
    timeout (sends need a peer: `_engine_body` checks those)."""
    out = np.zeros_like(x)
    return {
        "broadcast": lambda t: dist.broadcast(x, src=0, timeout=t),
        "all_reduce": lambda t: dist.all_reduce(x, timeout=t),
        "reduce": lambda t: dist.reduce(x, dst=0, timeout=t),
        "all_gather_single": lambda t: dist.all_gather_single(out, x, timeout=t),
        "all_gather": lambda t: dist.all_gather([out], x, timeout=t),
        "gather": lambda t: dist.gather(x, [out], dst=0, timeout=t),
        "scatter": lambda t: dist.scatter(out, [x], src=0, timeout=t),
        "reduce_scatter_single": lambda t: dist.reduce_scatter_single(out, x, timeout=t),
        "reduce_scatter": lambda t: dist.reduce_scatter(out, [x], timeout=t),
        "all_to_all_single": lambda t: dist.all_to_all_single(out, x, timeout=t),
        "all_to_all": lambda t: dist.all_to_all([out], [x], timeout=t),
        "all_reduce_coalesced": lambda t: dist.all_reduce_coalesced([x], timeout=t),
        "all_gather_coalesced": lambda t: dist.all_gather_coalesced([[out]], [x], timeout=t),
        "all_gather_v": lambda t: dist.all_gather_v([out], x, timeout=t),
        "reduce_scatter_v": lambda t: dist.reduce_scatter_v(out, [x], timeout=t),
        "irecv": lambda t: dist.irecv(out, timeout=t),
        "recv": lambda t: dist.recv(out, timeout=t),
        "broadcast_object_list": lambda t: dist.broadcast_object_list([1], src=0, timeout=t),
        "all_gather_object": lambda t: dist.all_gather_object([None], 1, timeout=t),
        "gather_object": lambda t: dist.gather_object(1, [None], dst=0, timeout=t),
        "scatter_object_list": lambda t: dist.scatter_object_list([None], [1], src=0, timeout=t),
        "send_object_list": lambda t: dist.send_object_list([1], dst=0, timeout=t),
        "recv_object_list": lambda t: dist.recv_object_list([None], timeout=t),
    }


BAD = [
    (True, TypeError, r"got True \(bool\)"),
    ("1", TypeError, r"got '1' \(str\)"),
    (-1, ValueError, "positive number of seconds, got -1"),
    (0, ValueError, "positive number of seconds, got 0"),
    (timedelta(0), ValueError, r"got datetime\.timedelta\(0\)"),
    (math.nan, ValueError, "got nan"),
    (11, ValueError, r"timeout=11 \(11 s\) is longer than the timeout of group 'default' \(10 s\)"),
    (timedelta(minutes=1), ValueError, r"\(60 s\) is longer than .* \(10 s\)"),
]


@pytest.mark.parametrize("bad,error,words", BAD, ids=[repr(b[0]) for b in BAD])
def test_a_bad_timeout_is_refused_by_every_function(solo, bad, error, words):
    x = np.ones(3)
    for name, call in _calls(x).items():
        with pytest.raises(error, match=words) as info:
            call(bad)
        message = str(info.value)
        assert message.startswith(f"{name}: timeout"), message
        # what to pass instead
        assert "None for the group's timeout" in message or (
            "pass at most 10 s, or create the group with a longer timeout=" in message
        ), message


def test_the_deprecated_collectives_pass_the_timeout_on(solo):
    x, out = np.ones(2), np.zeros(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ValueError, match=r"^all_gather_single: timeout"):
            dist.all_gather_into_tensor(out, x, timeout=-1)
        with pytest.raises(ValueError, match=r"^reduce_scatter_single: timeout"):
            dist.reduce_scatter_tensor(out, x, timeout=-1)
        assert dist.all_gather_into_tensor(out, x, timeout=5) is None


def test_a_valid_timeout_changes_no_result(solo):
    """Seconds, a float or a timedelta up to the group's timeout; a synchronous call
    returns None, an asynchronous one a Work whose wait() succeeds."""
    x = np.arange(4.0)
    assert dist.all_reduce(x, timeout=10) is None
    assert dist.broadcast(x, src=0, timeout=0.5) is None
    work = dist.all_reduce(x, async_op=True, timeout=timedelta(seconds=3))
    assert isinstance(work, dist.Work) and work.wait() is True
    assert work.result()[0] is x
    pieces = [np.zeros(4)]
    assert dist.all_gather_v(pieces, x, async_op=True, timeout=2).wait() is True
    objects = [None]
    dist.all_gather_object(objects, {"a": 1}, timeout=5)
    assert objects == [{"a": 1}] and x.tolist() == pieces[0].tolist() == [0.0, 1.0, 2.0, 3.0]


# -- tcp and gloo: spawned ranks -------------------------------------------------------------


def _flag(path: str, name: str) -> None:
    Path(f"{path}.{name}").touch()


def _wait_flags(path: str, names: list[str], seconds: float = 30.0) -> None:
    """Wait until every rank named wrote its flag (`_flag`)."""
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(f"{path}.{n}") for n in names):
        if time.monotonic() > deadline:
            raise AssertionError(f"flags {names} did not all appear within {seconds} s")
        time.sleep(0.02)


def _init(backend: str, path: str, round_: int) -> None:
    dist.init_process_group(
        backend,
        init_method=f"file://{path}-{round_}",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=GROUP_TIMEOUT,
    )


def _last_state(op: str) -> str:
    pg = dist.group.WORLD
    entries = [e for e in pg.recorder.as_dicts(pg.ranks) if e["op"] == op]
    return entries[-1]["state"]


def _engine_body(backend: str, path: str, count: int) -> dict[str, Any]:
    """The late rank calls each abandoned collective only once the callers gave up on it
    (they arrived at it in shared memory on gloo): it must fail, whatever path its arrays
    take (`count` elements: inline in the segment, or read from the peers' memory)."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    late = size - 1
    callers = [r for r in range(size) if r != late]
    seen: dict[str, Any] = {}
    # round 0: a synchronous all_reduce with a timeout, which the late rank does not call
    _init(backend, path, 0)
    if rank != late:
        seen["sync"] = _outcome(dist.all_reduce, np.ones(count), timeout=OP_TIMEOUT)
        seen["recorded"] = _last_state("all_reduce")
        _flag(path, f"{rank}-sync")
    else:
        _wait_flags(path, [f"{r}-sync" for r in callers])
    seen["next"] = _outcome(dist.all_reduce, np.ones(count))  # the group is aborted everywhere
    dist.destroy_process_group()
    # round 1: after a new init the ranks work again; then an asynchronous all_reduce
    _init(backend, path, 1)
    x = np.full(3, rank + 1.0)
    dist.all_reduce(x, timeout=timedelta(seconds=30))
    seen["sum"] = float(x[0])
    if rank != late:
        work = dist.all_reduce(np.ones(count), async_op=True, timeout=OP_TIMEOUT)
        seen["async"] = _outcome(work.wait)
        _flag(path, f"{rank}-async")
    else:
        _wait_flags(path, [f"{r}-async" for r in callers])
        seen["async_late"] = _outcome(dist.all_reduce, np.ones(count))
    seen["async_next"] = _outcome(dist.barrier)
    dist.destroy_process_group()
    # round 2: point-to-point; rank 0 waits for a message the late rank never sends
    _init(backend, path, 2)
    if rank == 0:
        for bad, words in ((0, "positive"), (GROUP_TIMEOUT + 1, "longer")):
            for fn in (dist.send, dist.isend):
                try:
                    fn(np.ones(1), dst=1, timeout=bad)
                except ValueError as exc:
                    assert str(exc).startswith(f"{fn.__name__}: timeout") and words in str(exc)
                else:
                    raise AssertionError(f"{fn.__name__}(timeout={bad}) was accepted")
        dist.send(np.arange(3.0), dst=1, tag=1, timeout=30)
        dist.isend(np.arange(2.0), dst=1, tag=2, timeout=30).wait()
        seen["recv"] = _outcome(dist.recv, np.zeros(3), src=late, tag=3, timeout=OP_TIMEOUT)
        batch = [dist.P2POp(dist.irecv, np.zeros(1), late, tag=4)]
        seen["batch"] = _outcome(dist.batch_isend_irecv(batch, timeout=OP_TIMEOUT)[0].wait)
        _flag(path, "0-recv")
    if rank == 1:
        got, more = np.zeros(3), np.zeros(2)
        seen["sender"] = dist.recv(got, src=0, tag=1, timeout=30)
        dist.irecv(more, src=0, tag=2, timeout=30).wait()
        seen["got"] = got.tolist() + more.tolist()
    _wait_flags(path, ["0-recv"])  # nobody leaves before rank 0's receive gave up
    dist.destroy_process_group()
    return seen


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(
    "backend,count",
    [("tcp", 4), ("gloo", 4), ("gloo", 64 * 1024)],
    ids=["tcp", "gloo-inline", "gloo-read"],
)
def test_a_timeout_aborts_the_group_names_the_missing_rank_and_a_new_group_works(
    tmp_path, backend, count, size
):
    results = run_ranks(_engine_body, size, backend, str(tmp_path / "rdzv"), count, timeout=HARNESS)
    late = size - 1
    for rank, seen in enumerate(results):
        if rank != late:
            for key in ("sync", "async"):
                kind, message = seen[key]
                assert kind == "DistTimeoutError", (rank, key, results)
                assert "all_reduce" in message and _names_missing(message, late), (rank, results)
            assert seen["recorded"] == "failed", results
        # the late rank's next operation (and every other rank's) finds the group aborted
        for key in ("next", "async_next", *(("async_late",) if rank == late else ())):
            kind, message = seen[key]
            assert kind == "DistTimeoutError" and "aborted" in message, (rank, key, results)
            assert _names_missing(message, late), (rank, key, results)
        assert seen["sum"] == size * (size + 1) / 2, results
    kind, message = results[0]["recv"]
    assert kind == "DistTimeoutError" and f"recv from rank {late} (tag 3)" in message, results
    kind, message = results[0]["batch"]  # batch_isend_irecv's Works wait at most its timeout
    assert kind == "DistTimeoutError" and f"recv from rank {late} (tag 4)" in message, results
    assert results[1]["sender"] == 0 and results[1]["got"] == [0.0, 1.0, 2.0, 0.0, 1.0], results


def _slow_read_body(path: str) -> dict[str, Any]:
    """Rank 0's collective is still copying from its peer's memory (a read slowed down
    here) when its `Work.wait(timeout)` expires: the wait returns only once the aborted
    collective has left the arrays, so the Work is completed when the error arrives."""
    from distcomm.backends.engine.shm import engine

    rank = int(os.environ["RANK"])
    _init("gloo", path, 0)
    x = np.ones(64 * 1024)
    if rank == 0:
        real_read = engine.cma_read

        def slow_read(*args: Any) -> None:
            time.sleep(3 * OP_TIMEOUT)  # past the wait's timeout, inside the collective
            real_read(*args)

        engine.cma_read = slow_read
    work = dist.all_reduce(x, async_op=True)
    kind, _ = _outcome(work.wait, OP_TIMEOUT)
    seen = {"kind": kind, "completed": work.is_completed()}
    _flag(path, f"{rank}-slow")
    _wait_flags(path, ["0-slow", "1-slow"])
    dist.destroy_process_group()
    return seen


def test_a_timed_out_wait_returns_once_the_collective_left_the_arrays(tmp_path):
    results = run_ranks(_slow_read_body, 2, str(tmp_path / "rdzv"), timeout=HARNESS)
    assert results[0] == {"kind": "DistTimeoutError", "completed": True}, results
    assert results[1]["kind"] != "ok", results


# -- mpi: an mpiexec job -------------------------------------------------------------------

_MPI_JOB = """
import json, os, sys, time
import numpy as np
import distcomm as dist

path = sys.argv[1]
dist.init_process_group("mpi", timeout={group})
rank, size = dist.get_rank(), dist.get_world_size()
late = size - 1
seen = {{}}

def outcome(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except dist.DistError as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""

def flag(name):
    open(f"{{path}}.{{name}}", "w").close()

def wait_flags(names):
    while not all(os.path.exists(f"{{path}}.{{n}}") for n in names):
        time.sleep(0.02)

callers = [r for r in range(size) if r != late]
x = np.ones(4)
if rank != late:
    seen["sync"] = outcome(dist.all_reduce, x, timeout={op})
    seen["next"] = outcome(dist.barrier)
    flag(f"{{rank}}-sync")
    wait_flags(["late-sync"])
else:
    wait_flags([f"{{r}}-sync" for r in callers])
    # MPI cannot withdraw the callers' all_reduce: this one completes it
    seen["next"] = outcome(dist.all_reduce, x)
    flag("late-sync")
dist.destroy_process_group()
dist.init_process_group("mpi", timeout={group})
y = np.full(2, rank + 1.0)
dist.all_reduce(y, timeout=30)
seen["sum"] = float(y[0])
if rank != late:
    work = dist.all_reduce(np.ones(4), async_op=True, timeout={op})
    seen["async"] = outcome(work.wait)
    flag(f"{{rank}}-async")
    wait_flags(["late-async"])
else:
    wait_flags([f"{{r}}-async" for r in callers])
    dist.all_reduce(np.ones(4))
    flag("late-async")
dist.destroy_process_group()
with open(f"{{path}}.{{rank}}.json", "w") as out:
    json.dump(seen, out)
"""


def _mpi_job(folder: Path, size: int) -> list[dict[str, Any]]:
    """What each rank of an mpiexec job of `size` ranks saw."""
    if LAUNCHER is None:
        pytest.skip(f"the mpi backend tests need mpi4py and mpiexec: {SKIP_REASON}")
    script = folder / "job.py"
    script.write_text(textwrap.dedent(_MPI_JOB.format(group=GROUP_TIMEOUT, op=OP_TIMEOUT)))
    path = str(folder / "seen")
    done = run(
        LAUNCHER.command(size, sys.executable, str(script), path),
        env=job_env(DISTCOMM_MPI_ABORT_ON_EXCEPTION="0"),
        timeout=HARNESS + 30,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return [json.loads(Path(f"{path}.{r}.json").read_text()) for r in range(size)]


@pytest.mark.parametrize("size", SIZES)
def test_mpi_callers_time_out_and_a_new_group_works(tmp_path, size):
    results = _mpi_job(tmp_path, size)
    late = size - 1
    for rank, seen in enumerate(results):
        if rank != late:
            for key in ("sync", "async"):
                kind, message = seen[key]
                assert kind == "DistTimeoutError", (rank, key, results)
                assert "all_reduce on 'mpi'" in message and "cannot be cancelled" in message
            kind, message = seen["next"]  # this rank's group is unusable
            assert kind == "DistBackendError" and "unusable" in message, results
        assert seen["sum"] == size * (size + 1) / 2, results


@pytest.mark.xfail(
    strict=True,
    reason="the mpi backend cannot tell which rank has not called (MPI has no way to ask), "
    "and cannot tell the late rank: its next collective completes the one the callers "
    "abandoned",
)
def test_mpi_names_the_missing_rank_and_aborts_the_late_rank(tmp_path):
    results = _mpi_job(tmp_path, 3)
    late = 2
    assert all(_names_missing(results[r]["sync"][1], late) for r in range(late)), results
    assert results[late]["next"][0] != "ok", results


# -- nccl: the CUDA stand-in, ranks as threads ------------------------------------------------


def _nccl_first(me: Rank) -> None:
    dist.all_reduce(me.cp.ones(2, me.cp.float32), group=me.group(), timeout=20)


def _nccl_late(me: Rank, timed_out: threading.Barrier, asynchronous: bool) -> tuple:
    """The callers' all_reduce never completes (the stand-in hangs it, as NCCL would wait
    for the rank that did not call); the late rank calls its next operation once they
    timed out."""
    pg, x = me.group(), me.cp.ones(4, me.cp.float32)
    late = me.size - 1
    if me.rank != late:
        if asynchronous:
            work = dist.all_reduce(x, group=pg, async_op=True, timeout=OP_TIMEOUT)
            seen = _outcome(work.synchronize)  # a device Work's wait() only orders streams
        else:
            seen = _outcome(dist.all_reduce, x, group=pg, timeout=OP_TIMEOUT)
        timed_out.wait(30)
        return seen, _outcome(dist.all_reduce, x, group=pg)
    timed_out.wait(30)
    # the abort notice reaches this rank's watchdog while it waits
    return _outcome(dist.all_reduce, x, group=pg, timeout=30), None


def _nccl_works(me: Rank) -> float:
    pg = me.group()
    x = me.cp.full(3, me.rank + 1.0, me.cp.float32)
    dist.all_reduce(x, group=pg, timeout=20)
    got = me.cp.zeros(2, me.cp.float32)
    if me.rank == 0:
        dist.send(me.cp.full(2, 5.0, me.cp.float32), dst=1, group=pg, timeout=20)
    elif me.rank == 1:
        dist.recv(got, src=0, group=pg, timeout=20)
    return float(x.get()[0]) + float(got.get()[0])


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("size", SIZES)
def test_nccl_timeout_aborts_and_a_new_group_works(solo, make_cluster, size, asynchronous):  # noqa: F811
    cluster = make_cluster(size, timeout=GROUP_TIMEOUT)
    cluster.run(_nccl_first)
    standin = cluster.standin
    standin.hang()
    callers = threading.Barrier(size)
    results = cluster.run(_nccl_late, callers, asynchronous, timeout=HARNESS)
    late = size - 1
    for rank, (seen, after) in enumerate(results):
        if rank == late:
            kind, message = seen
            assert kind in ("DistBackendError", "DistTimeoutError"), results
            assert "aborted" in message and "all_reduce" in message, results
            continue
        # this rank's own timeout, or (size 3) the abort notice of a caller whose expired first
        kind, message = seen
        assert re.search(r"all_reduce #\d+ on 'nccl'", message) and "aborted" in message, results
        assert kind == "DistTimeoutError" or "another rank aborted" in message, results
        assert f"within {OP_TIMEOUT:g} s" in message, results
        assert after[0] != "ok" and "aborted" in after[1], results
    standin.unhang()
    cluster = make_cluster(size, timeout=GROUP_TIMEOUT)
    sums = cluster.run(_nccl_works)
    total = size * (size + 1) / 2
    assert sums == [total, total + 5.0] + [total] * (size - 2), sums


def test_nccl_names_the_missing_rank(solo, make_cluster):  # noqa: F811
    cluster = make_cluster(2, timeout=GROUP_TIMEOUT)
    cluster.run(_nccl_first)
    cluster.standin.hang()
    results = cluster.run(_nccl_late, threading.Barrier(2), False, timeout=HARNESS)
    assert _names_missing(results[0][0][1], 1), results
