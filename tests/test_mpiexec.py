"""MPI launch: the store bootstrap over MPI, environment detection, abort on error and the
default thread count under a real mpiexec (MPICH, Open MPI 4 or 5: DISTCOMM_TEST_MPIEXEC, see
tests/mpijobs.py), plus the same logic in process with a stand-in for mpi4py."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import NoReturn

import psutil
import pytest

from distcomm import mpi_end, mpiutil, parallel
from distcomm.bootstrap.stores import join
from distcomm.errors import DistNetworkError
from distcomm.rendezvous import rendezvous
from distcomm.store import TCPStore
from tests.mpijobs import (  # noqa: F401 - the fixture applies to every test here
    LAUNCHER,
    SKIP_REASON,
    job_env,
    no_mpi_segment_left,
    run,
)
from tests.processes import free_port

#: hard limit of one mpiexec run, in seconds
RUN_TIMEOUT = 120

needs_mpiexec = pytest.mark.skipif(LAUNCHER is None, reason=f"needs mpiexec: {SKIP_REASON}")


def _mpiexec(
    n: int,
    script: Path,
    *args: str,
    env: dict[str, str] | None = None,
    bind: str | None = None,
    timeout: float = RUN_TIMEOUT,
) -> tuple[int, str, float]:
    """Run `script` on `n` ranks: (exit status, stdout + stderr, seconds taken)."""
    command = LAUNCHER.command(n, sys.executable, str(script), *args, bind=bind)
    done = run(command, cwd=script.parent, env=env, timeout=timeout, merge_output=True)
    return done.returncode, done.stdout, done.seconds


def _results(folder: Path) -> dict[int, dict]:
    """What the ranks reported (each writes result-RANK.json into its working folder)."""
    found = {}
    for path in folder.glob("result-*.json"):
        result = json.loads(path.read_text())
        found[result["rank"]] = result
    return found


#: the scripts' report(): one file per rank, since ranks' output lines may interleave; written
#: whole (a temporary name, then a rename), since a test may signal the job once it appears
REPORT = """
    import json as _json
    import os as _os

    def report(result):
        name = f"result-{result['rank']}.json"
        with open(name + ".tmp", "w") as out:
            _json.dump(result, out)
        _os.replace(name + ".tmp", name)
"""


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(REPORT) + textwrap.dedent(body))
    return path


# -- init_process_group("gloo"/"tcp") under mpiexec, no MASTER_ADDR ---------------------------

INIT_SCRIPT = """
    import sys
    import numpy as np
    import distcomm as dist

    dist.init_process_group(sys.argv[1], timeout=60)
    x = np.full(8, dist.get_rank() + 1, dtype=np.int64)
    dist.all_reduce(x)
    dist.barrier()
    report({"rank": dist.get_rank(), "size": dist.get_world_size(),
            "backend": dist.get_backend(), "sum": x.tolist()})
    dist.destroy_process_group()
"""


@needs_mpiexec
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("backend", ["gloo", "tcp"])
def test_init_without_master_addr(tmp_path: Path, backend: str, n: int) -> None:
    status, output, _ = _mpiexec(n, _script(tmp_path, "init.py", INIT_SCRIPT), backend)
    assert status == 0, output
    results = _results(tmp_path)
    assert sorted(results) == list(range(n)), output
    for result in results.values():
        assert result["size"] == n
        assert result["backend"] == backend
        assert result["sum"] == [n * (n + 1) // 2] * 8


# -- what the ranks detect, and the rendezvous itself --------------------------------------

DETECT_SCRIPT = """
    from distcomm.rendezvous import detect_environment, rendezvous

    info = detect_environment()
    result = rendezvous(timeout=60)   # imports mpi4py: MPI is initialised from here on
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    store = result.store
    store.set(f"hello/{result.rank}", str(comm.Get_rank()))
    seen = [store.get(f"hello/{r}").decode() for r in range(result.world_size)]
    comm.Barrier()                    # everyone has read before rank 0 stops serving
    store.close()
    report({
        "rank": comm.Get_rank(), "size": comm.Get_size(), "local_rank": local.Get_rank(),
        "local_size": local.Get_size(),
        "detected": [info.rank, info.world_size, info.local_rank, info.local_world_size],
        "launcher": info.launcher,
        "rendezvous": [result.rank, result.world_size, result.local_rank,
                       result.local_world_size],
        "source": result.source, "master": [result.master_addr, result.master_port],
        "seen": seen})
"""


@needs_mpiexec
@pytest.mark.parametrize("n", [3, 4])
def test_detection_and_rendezvous_match_mpi(tmp_path: Path, n: int) -> None:
    status, output, _ = _mpiexec(n, _script(tmp_path, "detect.py", DETECT_SCRIPT))
    assert status == 0, output
    results = _results(tmp_path)
    assert sorted(results) == list(range(n)), output
    ports = set()
    for rank, result in results.items():
        assert result["size"] == n
        # rank, size and local size as MPI has them; the local rank is the launcher's, which
        # need not follow Split_type's order (Open MPI 5 numbers ranks 0-3 as 0, 2, 1, 3)
        detected = result["detected"]
        assert [detected[0], detected[1], detected[3]] == [rank, n, result["local_size"]]
        assert result["rendezvous"] == detected
        assert result["launcher"] in ("MPICH", "Open MPI", "PMIx")
        assert result["source"] == f"{result['launcher']} (store address bootstrapped over MPI)"
        assert result["master"][0] == "127.0.0.1"  # DISTCOMM_SOCKET_IFNAME=lo
        ports.add(result["master"][1])
        assert result["seen"] == [str(r) for r in range(n)]
    assert len(ports) == 1 and ports.pop() > 0
    local_ranks = sorted(result["detected"][2] for result in results.values())
    assert local_ranks == sorted(result["local_rank"] for result in results.values()), results


HOST_FAILS_SCRIPT = """
    import os, socket
    from mpi4py import MPI
    from distcomm.rendezvous import rendezvous

    comm = MPI.COMM_WORLD
    taken = socket.socket()  # MASTER_PORT is in use: rank 0 cannot listen there
    if comm.Get_rank() == 0:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
    os.environ["MASTER_PORT"] = str(comm.bcast(taken.getsockname()[1]))
    try:
        rendezvous(timeout=30).store.close()
        outcome = "no error"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    taken.close()
    report({"rank": comm.Get_rank(), "outcome": outcome})
"""


@needs_mpiexec
def test_every_rank_raises_when_rank0_cannot_host(tmp_path: Path) -> None:
    # the port is taken inside the job: an Open MPI 5 job has a network namespace of its own
    status, output, _ = _mpiexec(2, _script(tmp_path, "fails.py", HOST_FAILS_SCRIPT))
    assert status == 0, output
    results = _results(tmp_path)
    assert sorted(results) == [0, 1], output
    assert results[0]["outcome"].startswith("DistNetworkError: [rank 0/2]")
    assert "hosting the store at 127.0.0.1:" in results[0]["outcome"]
    assert results[1]["outcome"].startswith("DistNetworkError: [rank 1/2]")
    assert "rank 0 could not host the store" in results[1]["outcome"]


TIMEOUT_SCRIPT = """
    import os, time
    from mpi4py import MPI
    from distcomm.rendezvous import rendezvous

    if MPI.COMM_WORLD.Get_rank() == 0:
        start = time.monotonic()
        try:
            rendezvous(timeout=2).store.close()
            outcome = "no error"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        report({"rank": 0, "outcome": outcome, "seconds": time.monotonic() - start})
    else:  # never joins the rendezvous; leaves once rank 0 has reported
        for _ in range(600):
            if os.path.exists("result-0.json"):
                break
            time.sleep(0.1)
"""


@needs_mpiexec
def test_bootstrap_times_out_when_a_rank_never_comes(tmp_path: Path) -> None:
    status, output, _ = _mpiexec(2, _script(tmp_path, "late.py", TIMEOUT_SCRIPT))
    assert status == 0, output
    result = _results(tmp_path)[0]
    assert result["outcome"].startswith("DistTimeoutError: [rank 0/2] env:// rendezvous"), output
    assert "not every one of the 2 processes" in result["outcome"]
    assert 1.5 < result["seconds"] < 60


# -- abort on an uncaught exception -------------------------------------------------------

ABORT_SCRIPT = """
    import sys
    from distcomm import mpiutil

    installed = mpiutil.install_abort_hook()
    assert installed and mpiutil.install_abort_hook()  # idempotent
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    print(f"rank {comm.Get_rank()} ready", flush=True)
    if comm.Get_rank() == 1:
        raise RuntimeError("rank one failed on purpose")
    comm.Barrier()  # ranks 0 and 2 would wait here forever
    print("barrier passed: unexpected", flush=True)
"""


@needs_mpiexec
def test_uncaught_exception_aborts_the_job(tmp_path: Path) -> None:
    status, output, seconds = _mpiexec(3, _script(tmp_path, "abort.py", ABORT_SCRIPT))
    assert status != 0, output
    assert seconds < RUN_TIMEOUT / 2, output
    assert "[rank 1] Traceback (most recent call last):" in output
    assert "[rank 1] RuntimeError: rank one failed on purpose" in output
    assert "MPI.COMM_WORLD.Abort(1)" in output
    assert "barrier passed" not in output


RAISE_AFTER_INIT_SCRIPT = """
    import sys
    import numpy as np
    import distcomm as dist

    dist.init_process_group(sys.argv[1], timeout=600)  # far beyond the test's deadline
    x = np.ones(4)
    dist.all_reduce(x)
    print(f"rank {dist.get_rank()} ready", flush=True)
    if dist.get_rank() == 1:
        raise RuntimeError("rank one failed on purpose")
    dist.barrier()  # rank 0 would wait here for the group timeout
    print("barrier passed: unexpected", flush=True)
"""


@needs_mpiexec
@pytest.mark.parametrize("backend", ["gloo", "tcp"])
def test_uncaught_exception_after_a_bootstrapped_init_aborts_the_job(
    tmp_path: Path, backend: str
) -> None:
    """The store bootstrap over MPI loads MPI, so it installs the abort hook too: the
    raising rank would otherwise wait in MPI_Finalize and rank 0 for the group timeout."""
    script = _script(tmp_path, "raise.py", RAISE_AFTER_INIT_SCRIPT)
    traces = tmp_path / "traces"
    status, output, _ = _mpiexec(
        2, script, backend, timeout=90, env=job_env(DISTCOMM_TRACE_DIR=str(traces))
    )
    assert status != 0, output
    assert "rank 1 ready" in output, output  # rank 0's line may be cut by the abort
    assert "[rank 1] RuntimeError: rank one failed on purpose" in output, output
    assert "MPI.COMM_WORLD.Abort(1)" in output, output
    assert "barrier passed" not in output, output
    # the aborting rank wrote its flight recorder first (Abort skips exit handlers)
    trace = json.loads((traces / "rank-1.json").read_text())
    assert trace["reason"] == "abort", trace["reason"]
    assert [e["op"] for e in trace["groups"][0]["entries"]] == ["all_reduce"]


# -- Ctrl-C ----------------------------------------------------------------------------------

INTERRUPT_SCRIPT = """
    import os, sys, time
    import numpy as np
    import distcomm as dist

    dist.init_process_group(sys.argv[1], timeout=600)  # far beyond the test's deadline
    rank = dist.get_rank()
    x = np.ones(1024, dtype=np.float32)
    dist.all_reduce(x)  # every rank is in, MPI's shared memory made
    with open("/proc/self/maps") as maps:
        paths = {line.split(None, 5)[5].strip() for line in maps if "/dev/shm/" in line}
    segments = {path: os.stat(path).st_ino for path in paths
                if not path.endswith("(deleted)") and os.path.exists(path)}
    report({"rank": rank, "segments": segments})
    if sys.argv[2] == "collectives":  # inside MPI most of the time, on mpi
        while True:
            dist.all_reduce(x)
            dist.barrier()
    elif rank == 0:  # in Python
        time.sleep(600)
    else:  # waits for a message that never comes
        dist.recv(x, src=0)
"""


def _interrupt_when_ready(
    folder: Path, n: int, target: str, signum: int = signal.SIGINT
) -> Callable[[int], None]:
    """What `run` does while the job runs: once every rank has reported (all of them have
    made a collective and go on into their loop), `signum` to mpiexec alone (which forwards
    it) or to its whole process group, as a terminal's Ctrl-C, or `timeout`'s SIGTERM."""

    def interrupt(pid: int) -> None:
        deadline = time.monotonic() + RUN_TIMEOUT
        while len(list(folder.glob("result-*.json"))) < n:
            if time.monotonic() > deadline:
                return  # the run's own timeout reports the job
            time.sleep(0.05)
        if target == "group":
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)

    return interrupt


@needs_mpiexec
@pytest.mark.parametrize("target", ["mpiexec", "group"])
@pytest.mark.parametrize("waiting", ["collectives", "recv"])
@pytest.mark.parametrize("n", [2, 4])
def test_ctrl_c_ends_every_rank_cleanly(tmp_path: Path, n: int, waiting: str, target: str) -> None:
    """Ctrl-C ends the job at once, nothing reports a crash (MPICH's mpiexec once reported
    SIGINT | SIGKILL = 11 as a segmentation fault), and the MPI library's shared memory is
    gone (ranks killed by Hydra never unlinked MPICH's). Under MPICH, which forwards SIGINT
    to the ranks, every rank says so in one line and the job ends with status 130; Open MPI
    4 and 5 forward none: their launcher ends the ranks itself (SIGCONT, then SIGTERM)."""
    _interrupt_job(tmp_path, n, "mpi", waiting, target)


@needs_mpiexec
def test_ctrl_c_ends_a_gloo_job_bootstrapped_over_mpi(tmp_path: Path) -> None:
    """The same with gloo, where MPI only shared the store's address: a rank whose
    collective a peer's interruption aborted raises an error, not KeyboardInterrupt, which
    ends it as interrupted too (no traceback, no MPI_Abort(1))."""
    _interrupt_job(tmp_path, 4, "gloo", "collectives", "mpiexec")


def _interrupt_job(
    tmp_path: Path,
    n: int,
    backend: str,
    waiting: str,
    target: str,
    signum: int = signal.SIGINT,
    env: dict[str, str] | None = None,
) -> None:
    """Run INTERRUPT_SCRIPT on `n` ranks, send `signum` once they are ready, check that
    the job ended as that signal ends it."""
    script = _script(tmp_path, "interrupted.py", INTERRUPT_SCRIPT)
    command = LAUNCHER.command(n, sys.executable, str(script), backend, waiting)
    done = run(
        command,
        cwd=tmp_path,
        env=env,
        timeout=RUN_TIMEOUT,
        merge_output=True,
        during=_interrupt_when_ready(tmp_path, n, target, signum),
    )
    output = done.stdout
    results = _results(tmp_path)
    assert sorted(results) == list(range(n)), output
    assert "Segmentation fault" not in output and "signal 11" not in output, output
    assert "Traceback" not in output, output
    if LAUNCHER.kind == "mpich":
        said = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated (SIGTERM)"
        for rank in range(n):
            assert output.count(f"[rank {rank}] {said}") == 1, output
        assert "BAD TERMINATION" not in output, output  # Hydra's banner: a rank died of it
        assert done.returncode == 128 + signum, output  # MPI_Abort's code
    else:
        assert done.returncode != 0, output
    left = [
        path
        for result in results.values()
        for path, inode in result["segments"].items()
        if os.path.exists(path) and os.stat(path).st_ino == inode
    ]
    assert not left, f"left in /dev/shm: {left}\n{output}"


# -- SIGTERM (timeout, schedulers) -----------------------------------------------------------


@needs_mpiexec
@pytest.mark.parametrize(
    ("n", "waiting", "target"),
    [
        (2, "collectives", "mpiexec"),
        (2, "collectives", "group"),
        (2, "recv", "mpiexec"),
        (2, "recv", "group"),
        (4, "collectives", "mpiexec"),
    ],
)
def test_sigterm_ends_every_rank_cleanly(tmp_path: Path, n: int, waiting: str, target: str) -> None:
    """SIGTERM to mpiexec (which forwards it to the ranks) or to its process group (as
    `timeout` sends it) ends the job as Ctrl-C does: under MPICH every rank says so in one
    line, no rank dies of the signal (Hydra's "BAD TERMINATION" banner and status 15, the
    node's mpich_shm_* left behind), and the job ends with status 143 (128 + SIGTERM)."""
    _interrupt_job(tmp_path, n, "mpi", waiting, target, signal.SIGTERM)


@needs_mpiexec
def test_sigterm_ends_a_gloo_job_bootstrapped_over_mpi(tmp_path: Path) -> None:
    _interrupt_job(tmp_path, 2, "gloo", "collectives", "mpiexec", signal.SIGTERM)


@needs_mpiexec
def test_sigterm_writes_the_flight_recorder_then_ends_cleanly(tmp_path: Path) -> None:
    """With DISTCOMM_TRACE_DIR the flight recorder's SIGTERM handler sits on top of the
    abort hook's: every rank writes its dump (reason SIGTERM), then ends as above."""
    traces = tmp_path / "traces"
    _interrupt_job(
        tmp_path,
        2,
        "mpi",
        "collectives",
        "mpiexec",
        signal.SIGTERM,
        env=job_env(DISTCOMM_TRACE_DIR=str(traces)),
    )
    for rank in range(2):
        trace = json.loads((traces / f"rank-{rank}.json").read_text())
        assert trace["reason"] == "SIGTERM", trace["reason"]
        assert "all_reduce" in [e["op"] for e in trace["groups"][0]["entries"]]


OWN_SIGTERM_SCRIPT = """
    import signal, sys
    import numpy as np
    import distcomm as dist

    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))  # before init
    dist.init_process_group("mpi", timeout=600)
    rank = dist.get_rank()
    report({"rank": rank, "segments": {}})
    while True:  # every rank stops at the same step: the first where one saw SIGTERM
        flag = np.array([len(stop)], dtype=np.int64)
        dist.all_reduce(flag)
        if flag[0]:
            break
    print(f"[rank {rank}] my handler saw SIGTERM", flush=True)
    dist.destroy_process_group()
"""


@needs_mpiexec
def test_sigterm_handler_installed_before_init_is_left_alone(tmp_path: Path) -> None:
    """A rank that handles SIGTERM itself keeps doing so: it stops when it chooses, with
    its own status, and MPI_Finalize removes MPI's shared memory (the fixture checks)."""
    script = _script(tmp_path, "own.py", OWN_SIGTERM_SCRIPT)
    command = LAUNCHER.command(2, sys.executable, str(script))
    done = run(
        command,
        cwd=tmp_path,
        timeout=RUN_TIMEOUT,
        merge_output=True,
        during=_interrupt_when_ready(tmp_path, 2, "mpiexec", signal.SIGTERM),
    )
    output = done.stdout
    for rank in range(2):
        assert f"[rank {rank}] my handler saw SIGTERM" in output, output
    assert "terminated (SIGTERM)" not in output, output
    if LAUNCHER.kind == "mpich":  # Hydra forwards SIGTERM and waits for the ranks
        assert done.returncode == 0, output


# -- the default intra-op thread count of ranks ---------------------------------------------

THREADS_SCRIPT = """
    import os
    from distcomm import parallel

    rank = next(int(os.environ[name]) for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK")
                if name in os.environ)
    report({"rank": rank, "mask": sorted(os.sched_getaffinity(0)),
            "threads": parallel.get_num_threads()})
"""

#: physical cores and logical CPUs of this host
CORES = psutil.cpu_count(logical=False) or psutil.cpu_count(logical=True) or 1
CPUS = psutil.cpu_count(logical=True) or 1


def _thread_env() -> dict[str, str]:
    """The job environment without the thread variables: the default applies."""
    env = job_env()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    return env


@needs_mpiexec
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to pin 2 ranks")
def test_ranks_pinned_to_a_core_each_use_one_thread(tmp_path: Path) -> None:
    status, output, _ = _mpiexec(
        2, _script(tmp_path, "threads.py", THREADS_SCRIPT), env=_thread_env(), bind="core"
    )
    assert status == 0, output
    results = _results(tmp_path)
    assert sorted(results) == [0, 1], output
    masks = [tuple(results[r]["mask"]) for r in (0, 1)]
    assert all(len(mask) == 1 for mask in masks) and masks[0] != masks[1], masks  # pinned
    assert [results[r]["threads"] for r in (0, 1)] == [1, 1], results


@needs_mpiexec
@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < len(parallel._allowed_cpus() or ()),
    reason="this test process is pinned to some CPUs (taskset?): its ranks would be too",
)
def test_unpinned_ranks_split_the_cores(tmp_path: Path) -> None:
    status, output, _ = _mpiexec(
        2, _script(tmp_path, "threads.py", THREADS_SCRIPT), env=_thread_env(), bind="none"
    )
    assert status == 0, output
    results = _results(tmp_path)
    assert sorted(results) == [0, 1], output
    for result in results.values():
        assert result["mask"] == sorted(os.sched_getaffinity(0)), results  # not pinned
        expected = max(1, len(result["mask"]) * CORES // CPUS // 2)
        assert result["threads"] == expected, results


@needs_mpiexec
def test_explicit_thread_count_wins_over_pinning(tmp_path: Path) -> None:
    env = {**_thread_env(), "OMP_NUM_THREADS": "3"}
    status, output, _ = _mpiexec(
        2, _script(tmp_path, "threads.py", THREADS_SCRIPT), env=env, bind="core"
    )
    assert status == 0, output
    assert [r["threads"] for r in _results(tmp_path).values()] == [3, 3], output


@pytest.mark.parametrize(
    ("layout", "node", "expected"),
    [("2(x3),1", "1", 2), ("2(x3),1", "3", 1), ("4", "0", 4), ("bad", "0", None)],
)
def test_slurm_step_layout_gives_the_local_ranks(monkeypatch, layout, node, expected) -> None:
    # srun's variables as a step's task sees them (no Slurm here to start a real step)
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", layout)
    monkeypatch.setenv("SLURM_NODEID", node)
    if expected is None:  # malformed: ignored, with a warning
        with pytest.warns(RuntimeWarning, match="SLURM_STEP_TASKS_PER_NODE='bad'"):
            assert parallel._local_ranks() == 1
    else:
        assert parallel._local_ranks() == expected


# -- the abort hook in process (mpi4py stands in or stays unloaded) --------------------------


class _Aborted(Exception):
    pass


def _fake_mpi(rank: int, calls: list) -> SimpleNamespace:
    def abort(code: int) -> None:
        calls.append(("abort", code))
        raise _Aborted

    world = SimpleNamespace(Get_rank=lambda: rank, Abort=abort)
    return SimpleNamespace(
        COMM_WORLD=world, Is_initialized=lambda: True, Is_finalized=lambda: False
    )


@pytest.fixture
def hook_env(monkeypatch):
    """A clean slate: mpi4py counts as installed, the variable unset, no hook afterwards."""
    monkeypatch.setattr(mpiutil, "is_mpi4py_available", lambda: True)
    monkeypatch.delenv("DISTCOMM_MPI_ABORT_ON_EXCEPTION", raising=False)
    calls: list = []
    monkeypatch.setattr(sys, "excepthook", lambda *exc: calls.append(("previous", exc[0])))
    yield calls
    mpiutil.remove_abort_hook()


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_abort_hook_switched_off(hook_env, monkeypatch, value: str) -> None:
    monkeypatch.setenv("DISTCOMM_MPI_ABORT_ON_EXCEPTION", value)
    before = sys.excepthook
    assert mpiutil.install_abort_hook() is False
    assert sys.excepthook is before
    assert mpiutil.remove_abort_hook() is False


def test_abort_hook_rejects_a_bad_value(hook_env, monkeypatch) -> None:
    monkeypatch.setenv("DISTCOMM_MPI_ABORT_ON_EXCEPTION", "maybe")
    with pytest.raises(ValueError, match="DISTCOMM_MPI_ABORT_ON_EXCEPTION='maybe'"):
        mpiutil.install_abort_hook()


def test_abort_hook_needs_mpi4py(hook_env, monkeypatch) -> None:
    monkeypatch.setattr(mpiutil, "is_mpi4py_available", lambda: False)
    assert mpiutil.install_abort_hook() is False


def test_abort_hook_install_is_idempotent_and_removable(hook_env) -> None:
    previous = sys.excepthook
    assert mpiutil.install_abort_hook() is True
    hook = sys.excepthook
    assert hook is not previous
    assert mpiutil.install_abort_hook() is True
    assert sys.excepthook is hook
    assert mpiutil.remove_abort_hook() is True
    assert sys.excepthook is previous
    assert mpiutil.remove_abort_hook() is False


def test_abort_hook_without_mpi_only_chains(hook_env, monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    mpiutil.install_abort_hook()
    sys.excepthook(ValueError, ValueError("boom"), None)
    assert hook_env == [("previous", ValueError)]


def test_abort_hook_reports_chains_and_aborts(hook_env, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _fake_mpi(2, hook_env))
    mpiutil.install_abort_hook()
    try:
        raise ValueError("boom")
    except ValueError as exc:
        error = exc
    with pytest.raises(_Aborted):
        sys.excepthook(ValueError, error, error.__traceback__)
    assert hook_env == [("previous", ValueError), ("abort", 1)]
    err = capsys.readouterr().err
    assert "[rank 2] Traceback (most recent call last):" in err
    assert "[rank 2] ValueError: boom" in err
    assert all(line.startswith("[rank 2] ") for line in err.splitlines())


@pytest.fixture
def interrupt_env(hook_env, monkeypatch):
    """hook_env, plus: a fresh record of Ctrl-C, no grace, nothing unlinked, and SIGINT's
    handler and wakeup fd as they were afterwards (the hook ignores a second Ctrl-C)."""
    monkeypatch.setattr(mpi_end, "_interrupted", mpi_end._Interrupted())
    monkeypatch.setattr(mpi_end, "_INTERRUPT_GRACE", 0.0)
    monkeypatch.setattr(mpi_end, "unlink_mpi_segments", lambda: hook_env.append(("unlink",)))
    handler = signal.getsignal(signal.SIGINT)
    yield hook_env
    mpiutil.remove_abort_hook()
    signal.signal(signal.SIGINT, handler)


def _interrupted_here() -> tuple[BaseException, int]:
    """A KeyboardInterrupt raised in this file, and the line it was raised at."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as exc:
        return exc, exc.__traceback__.tb_lineno


def test_abort_hook_reports_keyboard_interrupt_once_and_aborts_130(
    interrupt_env, monkeypatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _fake_mpi(1, interrupt_env))
    mpiutil.install_abort_hook()
    exc, line = _interrupted_here()
    with pytest.raises(_Aborted):
        sys.excepthook(KeyboardInterrupt, exc, exc.__traceback__)
    assert interrupt_env == [
        ("previous", KeyboardInterrupt),  # another hook than Python's: it is called too
        ("unlink",),
        ("unlink",),
        ("abort", mpiutil.INTERRUPTED_STATUS),
    ]
    err = capsys.readouterr().err
    assert err == f"[rank 1] interrupted (Ctrl-C) at {__file__}:{line}\n"  # no traceback
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # a second Ctrl-C waits


def test_abort_hook_ends_an_interrupted_rank_even_if_the_previous_hook_fails(
    interrupt_env, monkeypatch
) -> None:
    def failing(*exc_info):
        raise RuntimeError("a broken hook")

    monkeypatch.setattr(sys, "excepthook", failing)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _fake_mpi(0, interrupt_env))
    mpiutil.install_abort_hook()
    with pytest.raises(_Aborted):
        sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert interrupt_env[-1] == ("abort", 130)


@pytest.mark.parametrize(("ago", "code"), [(1.0, 130), (60.0, 1)])
def test_abort_hook_takes_an_error_soon_after_ctrl_c_for_its_consequence(
    interrupt_env, monkeypatch, capsys, ago: float, code: int
) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _fake_mpi(2, interrupt_env))
    mpiutil.install_abort_hook()
    mpi_end._interrupted.since = time.monotonic() - ago
    with pytest.raises(_Aborted):
        sys.excepthook(ValueError, ValueError("a peer aborted the group"), None)
    assert interrupt_env[-1] == ("abort", code)
    err = capsys.readouterr().err
    if code == 130:
        assert err == "[rank 2] interrupted (Ctrl-C)\n"
    else:
        assert "[rank 2] ValueError: a peer aborted the group" in err


def test_abort_hook_passes_keyboard_interrupt_on_without_mpi(interrupt_env, monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    mpiutil.install_abort_hook()
    sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert interrupt_env == [("previous", KeyboardInterrupt)]


def test_abort_hook_in_a_forked_child_only_chains(interrupt_env, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _fake_mpi(0, interrupt_env))
    mpiutil.install_abort_hook()
    monkeypatch.setattr(sys.excepthook, "pid", os.getpid() + 1)  # as seen from a child
    sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)
    sys.excepthook(ValueError, ValueError("x"), None)
    assert interrupt_env == [("previous", KeyboardInterrupt), ("previous", ValueError)]


def _wakeup_fd() -> int:
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    return fd


def test_ctrl_c_watch_installed_and_removed(interrupt_env) -> None:
    assert mpiutil.install_abort_hook() is True
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert _wakeup_fd() != -1
    assert mpiutil.install_abort_hook() is True  # the same watch
    threads = [t for t in threading.enumerate() if t.name == "distcomm-mpi-interrupt"]
    assert len(threads) == 1
    assert mpiutil.remove_abort_hook() is True
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert _wakeup_fd() == -1
    threads[0].join(timeout=5)
    assert not threads[0].is_alive()


def test_ctrl_c_watch_leaves_a_handler_of_the_users_alone(interrupt_env) -> None:
    def mine(signum, frame):
        pass

    signal.signal(signal.SIGINT, mine)
    assert mpiutil.install_abort_hook() is True  # the excepthook only
    assert signal.getsignal(signal.SIGINT) is mine
    assert _wakeup_fd() == -1


def test_ctrl_c_watch_leaves_a_taken_wakeup_fd_alone(interrupt_env) -> None:
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd)
    try:
        assert mpiutil.install_abort_hook() is True
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert _wakeup_fd() == write_fd
    finally:
        signal.set_wakeup_fd(-1)
        os.close(read_fd)
        os.close(write_fd)


def _wait_for(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_ctrl_c_watch_ends_a_rank_whose_main_thread_does_not_take_it(
    interrupt_env, monkeypatch, capsys
) -> None:
    """Only the wakeup byte arrives, as when the main thread is inside a blocking MPI call
    (Python's handler never runs): the thread reports, unlinks and aborts with 130."""
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _fake_mpi(3, interrupt_env))
    monkeypatch.setattr(mpi_end, "abort", lambda mpi, code: interrupt_env.append(("abort", code)))
    monkeypatch.setattr(os, "_exit", lambda code: interrupt_env.append(("exit", code)))
    mpiutil.install_abort_hook()
    os.write(mpi_end._watch.write_fd, bytes([signal.SIGINT]))  # what the C handler writes
    assert _wait_for(lambda: ("exit", 130) in interrupt_env), interrupt_env
    assert interrupt_env == [("unlink",), ("unlink",), ("abort", 130), ("exit", 130)]
    err = capsys.readouterr().err
    assert err.startswith("[rank 3] interrupted (Ctrl-C) at ") and err.count("\n") == 1, err


def test_ctrl_c_watch_leaves_a_taken_keyboard_interrupt_to_the_main_thread(
    interrupt_env, monkeypatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _fake_mpi(0, interrupt_env))
    monkeypatch.setattr(mpi_end, "_INTERRUPT_GRACE", 0.2)
    monkeypatch.setattr(mpi_end, "abort", lambda mpi, code: interrupt_env.append(("abort", code)))
    mpiutil.install_abort_hook()
    with pytest.raises(KeyboardInterrupt):  # what an except clause of the user's catches
        signal.raise_signal(signal.SIGINT)
    assert _wait_for(lambda: ("unlink",) in interrupt_env), interrupt_env
    time.sleep(0.6)  # three graces: no abort comes
    assert interrupt_env == [("unlink",)]
    assert capsys.readouterr().err.startswith("[rank 0] interrupted (Ctrl-C) at ")


@pytest.fixture
def sigterm_env(interrupt_env, monkeypatch):
    """interrupt_env in a process an MPI launcher started (Hydra's PMI_RANK), not under
    distcomm-run; callbacks before an abort recorded as ("before", reason); SIGTERM's
    handler as it was afterwards (ending sets it to SIG_IGN)."""
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(mpi_end, "_abort_callbacks", [])
    mpiutil.call_before_abort(lambda reason: interrupt_env.append(("before", reason)))
    handler = signal.getsignal(signal.SIGTERM)
    assert handler is signal.SIG_DFL, handler  # what these tests start from
    yield interrupt_env
    mpiutil.remove_abort_hook()
    signal.signal(signal.SIGTERM, handler)


def test_sigterm_watch_installed_under_an_mpi_launcher_and_removed(sigterm_env) -> None:
    assert mpiutil.install_abort_hook() is True
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert mpiutil.remove_abort_hook() is True
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert _wakeup_fd() == -1


@pytest.mark.parametrize(
    "env",
    [{"PMI_RANK": None}, {"TORCHELASTIC_RUN_ID": "run"}, {"OMPI_COMM_WORLD_SIZE": "2"}],
    ids=["no-mpi-launcher", "distcomm-run", "open-mpi"],
)
def test_sigterm_keeps_its_default_where_no_mpich_style_launcher_runs(
    sigterm_env, monkeypatch, env
) -> None:
    """A singleton, a worker of distcomm-run (whose agent stops workers with SIGTERM and
    reports the signal) and a rank of Open MPI's mpirun (which ends its ranks with SIGTERM
    itself) keep SIGTERM's default; Ctrl-C is still taken over."""
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, value)
    assert mpiutil.install_abort_hook() is True
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler


@pytest.mark.parametrize("theirs", ["handler", "ignored"])
def test_sigterm_watch_leaves_a_handler_of_the_users_alone(sigterm_env, theirs: str) -> None:
    def mine(signum, frame):
        pass

    handler = mine if theirs == "handler" else signal.SIG_IGN
    signal.signal(signal.SIGTERM, handler)
    assert mpiutil.install_abort_hook() is True
    assert signal.getsignal(signal.SIGTERM) is handler
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # still ours
    assert mpi_end._watch is not None and not mpi_end._watch.owns(signal.SIGTERM)
    assert mpiutil.remove_abort_hook() is True
    assert signal.getsignal(signal.SIGTERM) is handler


def test_sigterm_watch_owns_the_flight_recorders_handler_on_top_not_a_users(
    sigterm_env,
) -> None:
    """A handler put on top later is obeyed, unless distcomm put it there: the flight
    recorder's dumps, then calls the one it replaced (ours)."""
    from distcomm.trace import dumps

    mpiutil.install_abort_hook()
    assert mpi_end._watch.owns(signal.SIGTERM)
    signal.signal(signal.SIGTERM, dumps._on_sigterm)
    assert mpi_end._watch.owns(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    assert not mpi_end._watch.owns(signal.SIGTERM)


def test_sigterm_watch_ends_a_rank_whose_main_thread_does_not_take_it(
    sigterm_env, monkeypatch, capsys
) -> None:
    """Only the wakeup byte arrives, as when the main thread is inside a blocking MPI call:
    the thread reports, unlinks, dumps (reason SIGTERM) and aborts with 143."""
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _fake_mpi(3, sigterm_env))
    monkeypatch.setattr(mpi_end, "abort", lambda mpi, code: sigterm_env.append(("abort", code)))
    monkeypatch.setattr(os, "_exit", lambda code: sigterm_env.append(("exit", code)))
    mpiutil.install_abort_hook()
    os.write(mpi_end._watch.write_fd, bytes([signal.SIGTERM]))  # what the C handler writes
    assert _wait_for(lambda: ("exit", 143) in sigterm_env), sigterm_env
    assert sigterm_env == [
        ("unlink",),
        ("before", "SIGTERM"),  # at once, not a grace later: rank 0 may abort by then
        ("unlink",),
        ("abort", mpiutil.TERMINATED_STATUS),
        ("exit", 143),
    ]
    err = capsys.readouterr().err
    assert err.startswith("[rank 3] terminated (SIGTERM) at ") and err.count("\n") == 1, err


def test_sigterm_in_the_main_thread_ends_the_rank(sigterm_env, monkeypatch, capsys) -> None:
    """The handler itself ends the rank: there is no exception to catch. A handler put on
    top that calls the one it replaced (as the flight recorder's does) runs first."""
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _fake_mpi(1, sigterm_env))
    monkeypatch.setattr(mpi_end, "abort", lambda mpi, code: sigterm_env.append(("abort", code)))
    monkeypatch.setattr(os, "_exit", lambda code: sigterm_env.append(("exit", code)))
    mpiutil.install_abort_hook()
    ours = signal.getsignal(signal.SIGTERM)

    def on_top(signum, frame):
        sigterm_env.append(("on top",))
        ours(signum, frame)

    signal.signal(signal.SIGTERM, on_top)
    line = sys._getframe().f_lineno + 1
    signal.raise_signal(signal.SIGTERM)
    assert sigterm_env[0] == ("on top",), sigterm_env
    assert sigterm_env[-3:] == [("before", "SIGTERM"), ("abort", 143), ("exit", 143)]
    assert capsys.readouterr().err == f"[rank 1] terminated (SIGTERM) at {__file__}:{line}\n"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # nothing comes back in


def test_the_first_of_sigterm_and_ctrl_c_decides_the_status(
    sigterm_env, monkeypatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _fake_mpi(0, sigterm_env))
    mpiutil.install_abort_hook()
    mpi_end._interrupted.start(signal.SIGTERM)
    mpi_end._interrupted.start(signal.SIGINT)
    with pytest.raises(_Aborted):
        sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert sigterm_env == [
        ("previous", KeyboardInterrupt),
        ("unlink",),
        ("before", "SIGTERM"),
        ("unlink",),
        ("abort", 143),
    ]
    assert capsys.readouterr().err == "[rank 0] terminated (SIGTERM)\n"


def test_a_ctrl_c_caught_long_ago_does_not_decide_a_later_sigterm(
    sigterm_env, monkeypatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _fake_mpi(2, sigterm_env))
    monkeypatch.setattr(mpi_end, "abort", lambda mpi, code: sigterm_env.append(("abort", code)))
    monkeypatch.setattr(os, "_exit", lambda code: sigterm_env.append(("exit", code)))
    mpiutil.install_abort_hook()
    mpi_end._interrupted.start(signal.SIGINT)  # reported, then caught by the user's code
    mpi_end._interrupted.since -= 60
    mpi_end._interrupted.reported = True
    signal.raise_signal(signal.SIGTERM)
    assert sigterm_env[-2:] == [("abort", 143), ("exit", 143)]
    assert capsys.readouterr().err.startswith("[rank 2] terminated (SIGTERM) at ")


def test_a_second_end_waits_for_the_first(sigterm_env, monkeypatch, capsys) -> None:
    """Two threads ending the rank at once: the second only waits for the first's abort
    (bounded), then exits with the same status."""
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _fake_mpi(0, sigterm_env))
    monkeypatch.setattr(mpi_end, "_SECOND_END_WAIT", 0.0)
    monkeypatch.setattr(os, "_exit", lambda code: sigterm_env.append(("exit", code)))

    def second_exit(code: int) -> NoReturn:
        sigterm_env.append(("exit", code))
        raise SystemExit(code)  # what os._exit does not return from

    monkeypatch.setattr(os, "_exit", second_exit)
    assert mpi_end._interrupted.claim_end() is True  # the first
    with pytest.raises(SystemExit):
        mpi_end.end_interrupted(sys.modules["mpi4py.MPI"], [], signal.SIGTERM)
    assert sigterm_env == [("exit", 143)]  # no report, no dump, no abort of its own
    assert capsys.readouterr().err == ""


def test_removed_abort_hook_under_another_only_chains(hook_env, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _fake_mpi(0, hook_env))
    mpiutil.install_abort_hook()
    ours = sys.excepthook
    sys.excepthook = lambda *exc: ours(*exc)  # someone wraps it
    assert mpiutil.remove_abort_hook() is True
    sys.excepthook(ValueError, ValueError("x"), None)
    assert hook_env == [("previous", ValueError)]


# -- the bootstrap's decisions in process (a one-process stand-in for MPI.COMM_WORLD) -------


class _FakeComm:
    """MPI.COMM_WORLD of a job of one process, with what the bootstrap calls."""

    def __init__(self, size: int = 1) -> None:
        self.size = size

    def Get_size(self) -> int:
        return self.size

    def Get_rank(self) -> int:
        return 0

    def Ibarrier(self):
        return SimpleNamespace(Test=lambda: True)

    def Split_type(self, kind):
        return SimpleNamespace(Get_size=lambda: self.size, Free=lambda: None)

    def allgather(self, value):
        return [value]

    def bcast(self, value, root=0):
        return value


def _use_fake_mpi(monkeypatch, size: int = 1) -> None:
    fake = SimpleNamespace(
        COMM_WORLD=_FakeComm(size),
        COMM_TYPE_SHARED=1,
        Get_library_version=lambda: "Fake MPI 1.0\nmore",
    )
    monkeypatch.setattr(mpiutil, "is_mpi4py_available", lambda: True)
    monkeypatch.setattr(mpiutil, "load_mpi", lambda: fake)


def _no_mpi_import(monkeypatch) -> None:
    def refuse():
        raise AssertionError("the rendezvous imported mpi4py where it must not")

    monkeypatch.setattr(mpiutil, "is_mpi4py_available", lambda: True)
    monkeypatch.setattr(mpiutil, "load_mpi", refuse)


MPICH_ONE = {"PMI_RANK": "0", "PMI_SIZE": "1", "DISTCOMM_SOCKET_IFNAME": "lo"}


def test_bootstrap_one_process(monkeypatch) -> None:
    _use_fake_mpi(monkeypatch)
    result = rendezvous(environ=MPICH_ONE, timeout=10)
    try:
        assert isinstance(result.store, TCPStore)
        assert result.source == "MPICH (store address bootstrapped over MPI)"
        assert (result.rank, result.world_size, result.master_addr) == (0, 1, "127.0.0.1")
        assert result.master_port == result.store.port > 0
        assert result.store.add("n", 1) == 1
    finally:
        result.store.close()


def test_bootstrap_keeps_master_port(monkeypatch) -> None:
    _use_fake_mpi(monkeypatch)
    port = free_port()
    result = rendezvous("env://", environ={**MPICH_ONE, "MASTER_PORT": str(port)}, timeout=10)
    try:
        assert (result.master_addr, result.master_port) == ("127.0.0.1", port)
        assert result.source.endswith("(store address bootstrapped over MPI)")
    finally:
        result.store.close()


@pytest.mark.parametrize(
    ("init_method", "extra", "source"),
    [
        (None, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}"}, "MPICH"),
        ("tcp://127.0.0.1:{port}", {}, "tcp://127.0.0.1:{port}"),
    ],
)
def test_no_bootstrap_when_the_address_is_given(monkeypatch, init_method, extra, source) -> None:
    _no_mpi_import(monkeypatch)
    port = str(free_port())
    env = {**MPICH_ONE, **{key: value.format(port=port) for key, value in extra.items()}}
    url = None if init_method is None else init_method.format(port=port)
    result = rendezvous(url, environ=env, timeout=10)
    try:
        assert result.source == source.format(port=port)
        assert result.master_port == int(port)
    finally:
        result.store.close()


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "0", "WORLD_SIZE": "1", "PMI_RANK": "0", "PMI_SIZE": "1"},  # torch style wins
        {"PMI_RANK": "0", "PMI_SIZE": "1", "DISTCOMM_USE_AGENT_STORE": "1"},
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
    ],
)
def test_no_bootstrap_without_an_mpi_launcher(monkeypatch, env) -> None:
    _no_mpi_import(monkeypatch)
    with pytest.raises(ValueError, match="cannot determine the store address") as info:
        rendezvous(environ=env, timeout=1)
    assert "mpi4py" not in str(info.value)


def test_missing_mpi4py_says_what_to_do(monkeypatch) -> None:
    monkeypatch.setattr(mpiutil, "is_mpi4py_available", lambda: False)
    env = {"PMI_RANK": "1", "PMI_SIZE": "2"}
    with pytest.raises(ValueError) as info:
        rendezvous(environ=env)
    message = str(info.value)
    for words in (
        "cannot determine the store address",
        "SLURM_JOB_NODELIST",
        "under MPICH (PMI_RANK)",
        "mpi4py is not installed",
        "pip install distcomm[mpi]",
        "set MASTER_ADDR and MASTER_PORT",
    ):
        assert words in message
    with pytest.raises(ValueError) as info:
        rendezvous(environ={**env, "MASTER_ADDR": "127.0.0.1"})
    assert str(info.value).startswith("cannot determine the store port")
    assert "pip install distcomm[mpi]" in str(info.value)


def test_foreign_mpi_library_is_named(monkeypatch) -> None:
    _use_fake_mpi(monkeypatch, size=1)
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    with pytest.raises(ValueError) as info:
        rendezvous(environ=env)
    message = str(info.value)
    for words in (
        "under Open MPI (OMPI_COMM_WORLD_RANK)",
        "MPI.COMM_WORLD has 1 process(es)",
        "world size 2 (from OMPI_COMM_WORLD_SIZE (Open MPI))",
        "Fake MPI 1.0",
        "set MASTER_ADDR and MASTER_PORT",
    ):
        assert words in message


def test_foreign_mpi_library_falls_back_to_slurm(monkeypatch, caplog) -> None:
    _use_fake_mpi(monkeypatch, size=1)
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10)
    # rank 0 joins its store in a thread: the lone rank 1 waits for it
    rank0 = threading.Thread(target=join, args=(server, 0, 2, 10.0, 0.0, "rank 0"), daemon=True)
    rank0.start()
    try:
        env = {
            "PMI_RANK": "1",
            "PMI_SIZE": "2",
            "SLURM_JOB_NODELIST": "127.0.0.1",
            "MASTER_PORT": str(server.port),
        }
        with caplog.at_level("WARNING", logger="distcomm.rendezvous"):
            result = rendezvous(environ=env, timeout=10)
        result.store.close()
        assert result.source == "MPICH"
        assert (result.master_addr, result.master_port) == ("127.0.0.1", server.port)
        assert "not bootstrapping the store over MPI" in caplog.text
    finally:
        rank0.join(10)
        server.close()


def test_rank0_failure_reaches_the_other_ranks(monkeypatch) -> None:
    _use_fake_mpi(monkeypatch)
    comm = mpiutil.load_mpi().COMM_WORLD
    comm.bcast = lambda value, root=0: ("error", "DistNetworkError: cannot listen")
    comm.Get_rank = lambda: 1
    comm.allgather = lambda value: [0, value]
    comm.size = 2
    with pytest.raises(
        DistNetworkError, match="rank 0 could not host the store: DistNetworkError: cannot listen"
    ):
        rendezvous(environ={"PMI_RANK": "1", "PMI_SIZE": "2"}, timeout=5)
