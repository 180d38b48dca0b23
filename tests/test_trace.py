"""The flight recorder and its analyzer: real ranks in real processes, real trace files."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import distcomm as dist
from distcomm.trace.analyze import analyze, describe_entry, render
from tests.conftest import cpu_backends
from tests.harness import LOOPBACK_ENV
from tests.launchjobs import launcher_env, run_launcher, script
from tests.mpijobs import LAUNCHER as MPI_LAUNCHER
from tests.mpijobs import SKIP_REASON as MPI_SKIP_REASON
from tests.mpijobs import run as mpi_run

pytestmark = pytest.mark.timeout(180)

#: rank 1 skips collective #4 (the second broadcast) and waits to be signalled
HANG_WORKER = """
    import os, sys, time
    import numpy as np
    import distcomm as dist

    backend, rendezvous, rank, ready = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank,
                            world_size=2, timeout=60)
    group = dist.new_group(timeout=3, group_desc="short")  # the start is not timed so
    x = np.arange(4, dtype=np.float32)
    for _ in range(3):
        dist.all_reduce(x, group=group)         # #0, #1, #2
    dist.broadcast(x, src=0, group=group)       # #3
    if rank == 1:
        dist.send(np.ones(2, dtype=np.int64), dst=0, group=group)  # p2p: not numbered
        open(ready, "w").close()
        time.sleep(120)                         # never enters #4; SIGTERM ends it
    else:
        dist.recv(np.empty(2, dtype=np.int64), src=1, group=group)
        try:
            dist.all_reduce(x, group=group)     # #4: times out after 3 s
        except dist.DistTimeoutError:
            open(ready, "w").close()
            time.sleep(120)
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTCOMM_")}
    env.update(LOOPBACK_ENV)
    env["DISTCOMM_TRACE_DIR"] = str(tmp_path / "traces")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _wait(paths: list[Path], procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        for proc in procs:
            if proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"worker ended early ({proc.returncode}):\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"workers did not reach {paths} in {timeout} s")
        time.sleep(0.05)


def _analyzer(directory: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distcomm.trace", str(directory), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("backend", cpu_backends())
def test_rank_that_never_joins_is_named(tmp_path, backend):
    """Rank 0 times out in #4 (and dumps); rank 1, which never entered it, dumps on
    SIGTERM and still dies by SIGTERM; the analyzer names rank 1 and its last op."""
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(HANG_WORKER))
    ready = [tmp_path / f"ready{r}" for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), backend, str(tmp_path / "rdzv"), str(r), str(ready[r])],
            env=_env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        _wait(ready, procs, 60)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(30) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.communicate()
    assert codes == [-signal.SIGTERM, -signal.SIGTERM]  # the exit status SIGTERM gave before

    traces = tmp_path / "traces"
    assert sorted(p.name for p in traces.iterdir()) == ["rank-0.json", "rank-1.json"]
    rank1 = json.loads((traces / "rank-1.json").read_text())
    assert rank1["version"] == 1 and rank1["rank"] == 1 and rank1["world_size"] == 2
    assert rank1["reason"] == "SIGTERM"
    default, group = rank1["groups"]
    assert default["name"] == "default"
    # new_group's barrier of the default group is recorded there: every rank reached it
    assert [(e["seq"], e["op"], e["state"]) for e in default["entries"]] == [
        (0, "new_group", "completed")
    ]
    assert group["name"] == "short" and group["ranks"] == [0, 1]
    ops = [(e["seq"], e["op"], e["state"]) for e in group["entries"]]
    assert ops == [
        (0, "all_reduce", "completed"),
        (1, "all_reduce", "completed"),
        (2, "all_reduce", "completed"),
        (3, "broadcast", "completed"),
        (None, "send", "completed"),
    ]
    assert group["entries"][4]["peer"] == 0
    rank0 = json.loads((traces / "rank-0.json").read_text())
    last = rank0["groups"][1]["entries"][-1]
    assert (last["seq"], last["op"], last["state"]) == (4, "all_reduce", "failed")
    assert "DistTimeoutError" in last["error"]

    result = _analyzer(traces)
    assert result.returncode == 0, result.stderr
    assert (
        "collective #4 all_reduce (float32 x 4, SUM) was entered by rank(s) 0; rank 1 never "
        "entered it: its last op was send to rank 0 (int64 x 2) (completed)"
    ) in result.stdout, result.stdout
    as_json = _analyzer(traces, "--json")
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    short = report["groups"][1]
    assert short["name"] == "short"
    missing = short["first_missing"]
    assert missing["seq"] == 4 and missing["entered"] == [0]
    assert [m["rank"] for m in missing["missing"]] == [1]
    assert short["mismatches"] == []
    assert report["groups"][0]["first_missing"] is None


SIGNAL_WORKER = """
    import os, signal, sys
    import numpy as np
    import distcomm as dist

    seen = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))  # the user's own
    dist.init_process_group("tcp", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
    x = np.zeros(3, dtype=np.int32)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    dist.broadcast(x, src=0)
    os.kill(os.getpid(), signal.SIGUSR1)
    print("seen", seen, flush=True)
    dist.barrier()
    print("dumped", dist.dump_trace(), flush=True)
    dist.destroy_process_group()
"""


def test_sigusr1_dumps_and_keeps_the_users_handler(tmp_path):
    """SIGUSR1 writes the trace, calls the handler installed before, and the run goes on;
    dump_trace() writes it again with the ops since."""
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(SIGNAL_WORKER))
    env = _env(tmp_path, DISTCOMM_DEBUG="DETAIL")
    result = subprocess.run(
        [sys.executable, str(worker), str(tmp_path / "rdzv")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    path = tmp_path / "traces" / "rank-0.json"
    assert f"seen [{int(signal.SIGUSR1)}]" in result.stdout
    assert f"dumped {path}" in result.stdout
    data = json.loads(path.read_text())
    assert data["reason"] == "dump_trace" and data["pid"] > 0 and data["host"]
    entries = data["groups"][0]["entries"]
    assert [(e["seq"], e["op"]) for e in entries] == [
        (0, "all_reduce"),
        (1, "broadcast"),
        (2, "barrier"),
    ]
    assert entries[0]["reduce_op"] == "MAX" and entries[0]["dtype"] == "int32"
    assert entries[1]["root"] == 0
    assert "worker.py" in entries[0]["stack"]  # DISTCOMM_DEBUG=DETAIL keeps the stack
    assert not list((tmp_path / "traces").glob("*.tmp"))


def test_ring_keeps_the_last_ops(solo, tmp_path, monkeypatch):
    """DISTCOMM_TRACE_BUFFER bounds the ring; the dump holds the newest ops in order."""
    monkeypatch.setenv("DISTCOMM_TRACE_BUFFER", "5")
    group = dist.new_group([0])
    x = np.zeros(2, dtype=np.float64)
    for _ in range(12):
        dist.all_reduce(x, group=group)
    work = dist.broadcast(x, src=0, group=group, async_op=True)
    work.wait()
    path = dist.dump_trace(str(tmp_path))
    data = json.loads(Path(path).read_text())
    by_name = {g["name"]: g for g in data["groups"]}
    ring = by_name[group.group_name]["entries"]
    assert [e["seq"] for e in ring] == [8, 9, 10, 11, 12]
    assert [e["state"] for e in ring] == ["completed"] * 5
    assert ring[-1]["op"] == "broadcast"
    assert by_name["default"]["entries"] == []
    report = analyze(str(tmp_path))
    assert "nothing looks wrong" in render(report)


def test_record_comm_names_the_operations_of_its_block(solo, tmp_path):
    x = np.zeros(2)
    dist.all_reduce(x)
    with dist.record_comm("FSDP::all_gather (layer1)"):
        dist.all_reduce(x)
        dist.broadcast(x, src=0)
    dist.barrier()
    with pytest.raises(TypeError, match="str"), dist.record_comm(3):
        pass
    data = json.loads(Path(dist.dump_trace(str(tmp_path))).read_text())
    ring = {g["name"]: g for g in data["groups"]}["default"]["entries"]
    assert [e["profiling_name"] for e in ring] == [
        None,
        "FSDP::all_gather (layer1)",
        "FSDP::all_gather (layer1)",
        None,
    ]
    assert "'FSDP::all_gather (layer1)'" in describe_entry(ring[1])


def test_buffer_zero_records_nothing(solo, tmp_path, monkeypatch):
    monkeypatch.setenv("DISTCOMM_TRACE_BUFFER", "0")
    group = dist.new_group([0])
    dist.all_reduce(np.zeros(1), group=group)
    data = json.loads(Path(dist.dump_trace(str(tmp_path))).read_text())
    assert all(g["entries"] == [] for g in data["groups"])


def test_dump_trace_needs_a_directory(solo, monkeypatch):
    monkeypatch.delenv("DISTCOMM_TRACE_DIR", raising=False)
    with pytest.raises(ValueError, match="DISTCOMM_TRACE_DIR"):
        dist.dump_trace()


def _trace(rank: int, entries: list[dict]) -> dict:
    full = []
    for i, e in enumerate(entries):
        base = dict(
            id=i,
            seq=None,
            op="all_reduce",
            dtype="float32",
            count=4,
            root=None,
            reduce_op="SUM",
            peer=None,
            state="completed",
            start_ns=1,
            end_ns=2,
            error=None,
            stack=None,
        )
        base.update(e)
        full.append(base)
    return {
        "version": 1,
        "rank": rank,
        "world_size": 3,
        "host": "h",
        "pid": 1,
        "reason": "SIGTERM",
        "time_ns": 0,
        "groups": [{"name": "default", "ranks": [0, 1, 2], "entries": full}],
    }


def test_analyzer_reports_mismatches_and_missing_traces(tmp_path):
    """Same sequence number, different signature; a member without a file."""
    (tmp_path / "rank-0.json").write_text(
        json.dumps(
            _trace(0, [{"seq": 0}, {"seq": 1, "op": "broadcast", "root": 0, "reduce_op": None}])
        )
    )
    (tmp_path / "rank-1.json").write_text(
        json.dumps(
            _trace(
                1,
                [
                    {"seq": 0, "count": 8},
                    {"seq": 1, "op": "broadcast", "root": 1, "reduce_op": None},
                ],
            )
        )
    )
    (tmp_path / "rank-7.json").write_text("{not json")
    result = _analyzer(tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert (
        "collective #0 does not match: ranks 0 called #0 all_reduce (float32 x 4, SUM); "
        "ranks 1 called #0 all_reduce (float32 x 8, SUM)"
    ) in out, out
    assert "root 0" in out and "root 1" in out
    assert "no trace from rank(s) 2" in out
    assert "rank-7.json could not be read" in out


def test_analyzer_exit_2_when_nothing_readable(tmp_path):
    result = _analyzer(tmp_path)
    assert result.returncode == 2
    assert "no readable flight-recorder trace" in result.stderr
    assert _analyzer(tmp_path / "missing").returncode == 2


#: under distcomm-run: rank 1 never enters the second all_reduce; rank 0 times out
LAUNCHED_WORKER = """
    import os, time
    import numpy as np
    import distcomm as dist

    dist.init_process_group(os.environ["BACKEND"], timeout=60)
    x = np.ones(2, dtype=np.int64)
    dist.all_reduce(x)                # #0
    if dist.get_rank() == 1:
        time.sleep(120)               # the agent's SIGTERM ends it (and it dumps)
    dist.all_reduce(x, async_op=True).wait(timeout=3)  # #1: rank 0 times out, fails
"""


@pytest.mark.parametrize("log_dir", [False, True], ids=["temp-dir", "log-dir"])
def test_launcher_report_names_the_trace_directory(tmp_path, log_dir):
    """distcomm-run gives its workers a DISTCOMM_TRACE_DIR that outlives the run (under
    --log_dir, else in the temporary directory), and its failure report names it."""
    worker = script(tmp_path / "hang.py", LAUNCHED_WORKER)
    args = ["--standalone", "--nproc_per_node=2"]
    if log_dir:
        args.append(f"--log_dir={tmp_path / 'logs'}")
    env = launcher_env(BACKEND=cpu_backends()[0])
    result = run_launcher([*args, str(worker)], tmp_path, env=env, timeout=120)
    assert result.returncode == 1, result.stderr
    found = re.search(r"python -m distcomm\.trace (\S+)", result.stderr)
    assert found, result.stderr
    directory = Path(found[1])
    if log_dir:
        assert directory.is_relative_to(tmp_path / "logs")
    else:
        assert directory.name == "attempt_0"
        assert directory.parent.name.startswith("distcomm-traces-")
        assert directory.is_relative_to(tmp_path)  # the agent's TMPDIR
    assert sorted(p.name for p in directory.iterdir()) == ["rank-0.json", "rank-1.json"]
    analysis = _analyzer(directory)
    assert analysis.returncode == 0, analysis.stderr
    assert (
        "collective #1 all_reduce (int64 x 2, SUM) was entered by rank(s) 0; rank 1 never "
        "entered it: its last op was #0 all_reduce (int64 x 2, SUM) (completed)" in analysis.stdout
    )


def test_the_launcher_keeps_a_bounded_number_of_trace_folders(tmp_path, monkeypatch):
    """Runs without --log_dir keep their traces in the temporary directory; an agent's
    start removes this user's folders of ended agents beyond the newest TRACE_DIRS_KEPT,
    never one of a running agent or anything else there."""
    import tempfile

    from distcomm.launch.agent.tempdir import TRACE_DIRS_KEPT, TRACE_PREFIX, prune_trace_dirs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(ended.stdout)
    folders = []
    for i in range(TRACE_DIRS_KEPT + 5):
        folder = tmp_path / f"{TRACE_PREFIX}run-{i}-{dead_pid}"
        (folder / "attempt_0").mkdir(parents=True)
        (folder / "attempt_0" / "rank-0.json").write_text("{}")
        os.utime(folder, (1_000_000 + i, 1_000_000 + i))  # folder i is the i-th newest last
        folders.append(folder)
    running = tmp_path / f"{TRACE_PREFIX}oldest-{os.getpid()}"  # this process: running
    running.mkdir()
    os.utime(running, (1, 1))
    other = tmp_path / "distcomm-traces-not-ours"  # no pid: not an agent's folder
    other.mkdir()

    removed = prune_trace_dirs()

    assert sorted(removed) == sorted(str(f) for f in folders[:5])
    assert [f.exists() for f in folders] == [False] * 5 + [True] * TRACE_DIRS_KEPT
    assert running.exists() and other.exists()
    assert prune_trace_dirs() == []


MPI_WORKER = """
    import sys
    import numpy as np
    import distcomm as dist

    dist.init_process_group("mpi")
    rank = dist.get_rank()
    x = np.full(3, rank, dtype=np.int64)
    dist.all_reduce(x)
    dist.broadcast(x, src=1)
    if rank == 0:
        dist.send(x, dst=1)
    else:
        dist.recv(x, src=0)
    dist.barrier()
    dist.dump_trace(sys.argv[1])
    dist.destroy_process_group()
"""


@pytest.mark.skipif(MPI_LAUNCHER is None, reason=f"needs mpiexec: {MPI_SKIP_REASON}")
def test_mpi_backend_records_and_dumps(tmp_path):
    """Under mpiexec with the mpi backend every rank records the same collectives, and the
    analyzer finds nothing wrong."""
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(MPI_WORKER))
    traces = tmp_path / "traces"
    command = MPI_LAUNCHER.command(2, sys.executable, str(worker), str(traces))
    done = mpi_run(command, cwd=tmp_path, timeout=120, merge_output=True)
    assert done.returncode == 0, done.stdout
    for rank, p2p in ((0, ("send", 1)), (1, ("recv", 0))):
        entries = json.loads((traces / f"rank-{rank}.json").read_text())["groups"][0]["entries"]
        assert [(e["seq"], e["op"]) for e in entries] == [
            (0, "all_reduce"),
            (1, "broadcast"),
            (None, p2p[0]),
            (2, "barrier"),
        ]
        assert entries[2]["peer"] == p2p[1]
        assert {e["state"] for e in entries} == {"completed"}
    result = _analyzer(traces)
    assert result.returncode == 0, result.stderr
    assert "nothing looks wrong" in result.stdout, result.stdout


def test_states_queued_started_completed_failed():
    """The oldest unfinished collective is started, those after it queued; the same for
    sends and receives, apart."""
    from distcomm.trace.recorder import NO_ARRAY, Recorder

    rec = Recorder(8)
    x = np.zeros(3, dtype=np.float32)
    ids = [
        rec.record("all_reduce", x),
        rec.record("broadcast", x, 0),
        rec.record("barrier", NO_ARRAY),
    ]
    sends = [rec.record_p2p("send", x, 1), rec.record_p2p("recv", x, 1)]
    rec.settle(ids[0])
    rec.settle(sends[0], RuntimeError("peer gone"))
    states = {(e["op"], e["seq"]): e["state"] for e in rec.as_dicts([0, 1])}
    assert states == {
        ("all_reduce", 0): "completed",
        ("broadcast", 1): "started",
        ("barrier", 2): "queued",
        ("send", None): "failed",
        ("recv", None): "started",
    }
    assert [e["peer"] for e in rec.as_dicts([0, 1]) if e["seq"] is None] == [1, 1]
