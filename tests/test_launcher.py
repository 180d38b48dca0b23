"""distcomm-run end to end: real agents, real workers, real stores (c10d, etcd, file, static)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.etcd_server import etcd_endpoint  # noqa: F401 - fixture
from tests.launchjobs import (
    agent,
    alive,
    finish,
    kill_tree,
    launcher_env,
    records,
    run_launcher,
    script,
    wait_for,
)

pytestmark = pytest.mark.timeout(240)

ENV_NAMES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
             "WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "DISTCOMM_RESTART_COUNT", "DISTCOMM_MAX_RESTARTS", "DISTCOMM_RUN_ID",
             "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
             "OMP_NUM_THREADS", "DISTCOMM_TIMER_FILE", "DISTCOMM_ERROR_FILE")

#: init with no arguments, one all_reduce, a record of the environment per rank
ENV_WORKER = """
    import json, os, sys
    import numpy as np
    import distcomm as dist
    from distcomm.launch.errors import record

    NAMES = {names!r}

    @record
    def main():
        out = sys.argv[1]
        dist.init_process_group()
        rank, size = dist.get_rank(), dist.get_world_size()
        total = np.array([rank], dtype=np.int64)
        dist.all_reduce(total)
        rec = {{name: os.environ.get(name) for name in NAMES}}
        rec.update(rank=rank, size=size, sum=int(total[0]), pid=os.getpid())
        with open(os.path.join(out, f"{{rank}}.json"), "w") as f:
            json.dump(rec, f)
        dist.destroy_process_group()

    main()
"""

#: one record per (world size, rank) while it runs; leaves together once STOP exists
ELASTIC_WORKER = """
    import json, os, sys, time
    from pathlib import Path
    import numpy as np
    import distcomm as dist

    out, stop = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    (out / f"w{size}_r{rank}.json").write_text(json.dumps(
        {"rank": rank, "size": size, "pid": os.getpid(),
         "restart": os.environ["DISTCOMM_RESTART_COUNT"]}))
    while True:
        flag = np.array([1 if stop.exists() else 0], dtype=np.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag[0]:
            break
        time.sleep(0.2)
    dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_worker(tmp_path: Path) -> Path:
    return script(tmp_path / "env_worker.py", ENV_WORKER.format(names=ENV_NAMES))


def _check_env(recs: list[dict], nnodes: int, nproc: int, run_id: str | None = None) -> None:
    world = nnodes * nproc
    assert sorted(r["rank"] for r in recs) == list(range(world))
    for r in recs:
        assert r["size"] == world and r["sum"] == world * (world - 1) // 2
        assert int(r["RANK"]) == r["rank"] == int(r["ROLE_RANK"])
        assert int(r["WORLD_SIZE"]) == int(r["ROLE_WORLD_SIZE"]) == world
        assert int(r["LOCAL_WORLD_SIZE"]) == nproc
        assert int(r["LOCAL_RANK"]) == r["rank"] % nproc
        assert int(r["GROUP_RANK"]) == r["rank"] // nproc
        assert r["ROLE_NAME"] == "default"
        assert r["DISTCOMM_RESTART_COUNT"] == r["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert r["DISTCOMM_MAX_RESTARTS"] == r["TORCHELASTIC_MAX_RESTARTS"]
        assert r["DISTCOMM_RUN_ID"] == r["TORCHELASTIC_RUN_ID"]
        if run_id is not None:
            assert r["DISTCOMM_RUN_ID"] == run_id
        assert r["MASTER_ADDR"] and int(r["MASTER_PORT"]) > 0
        assert int(r["OMP_NUM_THREADS"]) >= 1
        assert r["DISTCOMM_TIMER_FILE"] and r["DISTCOMM_ERROR_FILE"]
    assert len({r["MASTER_PORT"] for r in recs}) == 1


# -- one node -----------------------------------------------------------------------------------

@pytest.mark.parametrize("nproc", [1, 2, 3, 4])
def test_single_node_environment(tmp_path, nproc):
    out = tmp_path / "out"
    out.mkdir()
    res = run_launcher(["--standalone", f"--nproc_per_node={nproc}", "--max_restarts=2",
                        str(_env_worker(tmp_path)), str(out)], tmp_path)
    assert res.returncode == 0, res.stderr
    recs = records(out)
    _check_env(recs, 1, nproc)
    assert {r["DISTCOMM_MAX_RESTARTS"] for r in recs} == {"2"}
    cores = psutil.cpu_count(logical=False) or os.cpu_count()
    assert {r["OMP_NUM_THREADS"] for r in recs} == {str(max(1, cores // nproc))}


def test_static_default_backend_picks_a_free_port(tmp_path):
    """No --standalone, no port: static rendezvous on a free port even with 29500 taken."""
    out = tmp_path / "out"
    out.mkdir()
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            busy.bind(("127.0.0.1", 29500))
            busy.listen()
        except OSError:
            pass  # something else holds it already: the point stands
        res = run_launcher(["--nproc_per_node=2", "--rdzv_id=static-run",
                            str(_env_worker(tmp_path)), str(out)], tmp_path)
    assert res.returncode == 0, res.stderr
    recs = records(out)
    _check_env(recs, 1, 2, run_id="static-run")
    assert {r["MASTER_PORT"] for r in recs} != {"29500"}


def test_omp_num_threads_is_kept_when_set(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    res = run_launcher(["--standalone", "--nproc_per_node=2", str(_env_worker(tmp_path)),
                        str(out)], tmp_path, env=launcher_env(OMP_NUM_THREADS="3"))
    assert res.returncode == 0, res.stderr
    assert {r["OMP_NUM_THREADS"] for r in records(out)} == {"3"}


def test_flags_from_environment_and_precedence(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = launcher_env(DISTCOMM_NPROC_PER_NODE="3", DISTCOMM_STANDALONE="1")
    res = run_launcher([str(_env_worker(tmp_path)), str(out)], tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert len(records(out)) == 3
    for f in out.iterdir():
        f.unlink()
    res = run_launcher(["--nproc-per-node", "2", str(_env_worker(tmp_path)), str(out)],
                       tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert len(records(out)) == 2


def test_quickstart_main_job(tmp_path):
    res = run_launcher(["--standalone", "--nproc_per_node=4", "-m",
                        "distcomm.examples.quickstart"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "4 rank(s)" in res.stdout and res.stdout.rstrip().endswith("OK")


def test_no_python_and_run_path(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    worker = _env_worker(tmp_path)
    res = run_launcher(["--standalone", "--nproc_per_node=2", "--run_path", str(worker),
                        str(out)], tmp_path)
    assert res.returncode == 0, res.stderr
    assert len(records(out)) == 2
    marker = tmp_path / "marker"
    res = run_launcher(["--standalone", "--nproc_per_node=2", "--no_python", "sh", "-c",
                        f'echo "$RANK" >> {marker}'], tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(marker.read_text().split()) == ["0", "1"]


@pytest.mark.parametrize("args, message", [
    (["--nnodes=3:2", "x.py"], "--nnodes"),
    (["--nnodes=0", "x.py"], "--nnodes"),
    (["--nproc_per_node=zero", "x.py"], "--nproc_per_node"),
    (["--standalone", "--nnodes=2", "x.py"], "--standalone"),
    (["--rdzv_backend=zookeeper", "x.py"], "--rdzv_backend"),
    (["--rdzv_backend=c10d", "--nnodes=2", "x.py"], "--rdzv_endpoint"),
    (["--rdzv_backend=file", "x.py"], "--rdzv_endpoint"),
    (["--nnodes=2", "x.py"], "--node_rank"),
    (["--nnodes=1:2", "x.py"], "static"),
    (["--no_python", "-m", "x"], "--no_python"),
    (["--run_path", "relative.py"], "absolute"),
    (["--max_restarts=-1", "x.py"], "--max_restarts"),
    (["--monitor_interval=0", "x.py"], "--monitor_interval"),
    (["-r", "9", "x.py"], "--redirects"),
    (["--tee", "0:1,7:2", "x.py"], "--tee"),
    (["--local_ranks_filter=5", "x.py"], "--local_ranks_filter"),
    (["--standalone", "--rdzv_conf=bogus=1", "x.py"], "bogus"),
])
def test_bad_flags_are_named(tmp_path, args, message):
    res = run_launcher(args, tmp_path, timeout=60)
    assert res.returncode != 0
    assert message in res.stderr, res.stderr


@pytest.mark.parametrize("name, value, message", [
    ("DISTCOMM_START_METHOD", "bogus", "--start_method"),
    ("DISTCOMM_NPROC_PER_NODE", "-2", "--nproc_per_node"),
    ("DISTCOMM_STANDALONE", "maybe", "DISTCOMM_STANDALONE"),
])
def test_bad_flags_from_environment_are_named(tmp_path, name, value, message):
    res = run_launcher(["x.py"], tmp_path, env=launcher_env(**{name: value}), timeout=60)
    assert res.returncode == 2
    assert message in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_stale_temp_dirs_of_dead_agents_are_removed(tmp_path):
    """An agent killed with SIGKILL cannot clean up; the next agent removes what it left."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"distcomm-run-{dead.pid}-x1y2"
    (stale / "logs").mkdir(parents=True)
    live = tmp_path / f"distcomm-run-{os.getpid()}-keep"
    live.mkdir()
    res = run_launcher(["--standalone", "--no_python", "true"], tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    assert not stale.exists() and live.exists()


def test_help_states_environment_precedence(tmp_path):
    res = run_launcher(["--help"], tmp_path, timeout=60)
    assert res.returncode == 0
    assert "DISTCOMM_NPROC_PER_NODE" in res.stdout and "--rdzv-endpoint" in res.stdout


# -- failures and restarts ----------------------------------------------------------------------

RESTART_WORKER = """
    import json, os, sys
    from pathlib import Path
    import distcomm as dist
    from distcomm.launch.errors import record

    @record
    def main():
        out, ckpt = Path(sys.argv[1]), Path(sys.argv[2])
        dist.init_process_group()
        rank = dist.get_rank()
        restart = os.environ["DISTCOMM_RESTART_COUNT"]
        (out / f"r{restart}_{rank}.json").write_text(json.dumps(
            {"rank": rank, "restart": restart, "torch": os.environ["TORCHELASTIC_RESTART_COUNT"]}))
        dist.barrier()
        if rank == 1 and (not ckpt.exists() or sys.argv[3] == "always"):
            ckpt.write_text("failed once")
            raise ValueError(f"boom from rank {rank} at restart {restart}")
        dist.barrier()
        dist.destroy_process_group()

    main()
"""


def test_worker_fails_once_then_restart_succeeds(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    worker = script(tmp_path / "restart.py", RESTART_WORKER)
    res = run_launcher(["--standalone", "--nproc_per_node=3", "--max_restarts=2", str(worker),
                        str(out), str(tmp_path / "ckpt"), "once"], tmp_path)
    assert res.returncode == 0, res.stderr
    recs = records(out)
    assert sorted((r["restart"], r["rank"]) for r in recs) == [
        ("0", 0), ("0", 1), ("0", 2), ("1", 0), ("1", 1), ("1", 2)]
    assert all(r["restart"] == r["torch"] for r in recs)


def test_max_restarts_exhausted_reports_root_cause(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    worker = script(tmp_path / "restart.py", RESTART_WORKER)
    res = run_launcher(["--standalone", "--nproc_per_node=2", "--max_restarts=1", str(worker),
                        str(out), str(tmp_path / "ckpt"), "always"], tmp_path)
    assert res.returncode == 1
    assert sorted(r["restart"] for r in records(out)) == ["0", "0", "1", "1"]
    err = res.stderr
    assert "FAILED" in err and "Root Cause" in err
    assert "ValueError: boom from rank 1 at restart 1" in err
    assert "exit code 1" in err or "exitcode" in err
    root = err[err.index("Root Cause"):]
    assert "rank" in root and "1" in root and "boom from rank 1" in root


def test_signal_death_is_named(tmp_path):
    worker = script(tmp_path / "die.py", """
        import os, signal
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    res = run_launcher(["--standalone", "--nproc_per_node=2", str(worker)], tmp_path)
    assert res.returncode == 1
    assert "SIGKILL" in res.stderr


# -- output: --tee, --redirects, --log_dir, --local_ranks_filter ----------------------------------

PRINT_WORKER = """
    import os, sys
    print(f"hello from {os.environ['RANK']}", flush=True)
    print(f"oops from {os.environ['RANK']}", file=sys.stderr, flush=True)
"""


def _log(log_dir: Path, local_rank: int, stream: str) -> str:
    (path,) = log_dir.glob(f"*/attempt_0/{local_rank}/{stream}.log")
    return path.read_text()


def test_tee_prefixes_console_and_writes_log_dir(tmp_path):
    worker = script(tmp_path / "p.py", PRINT_WORKER)
    logs = tmp_path / "logs"
    res = run_launcher(["--standalone", "--nproc_per_node=2", "--tee=3", f"--log_dir={logs}",
                        str(worker)], tmp_path)
    assert res.returncode == 0, res.stderr
    for rank in (0, 1):
        assert f"[{rank}]:hello from {rank}" in res.stdout
        assert f"[{rank}]:oops from {rank}" in res.stderr
        assert f"hello from {rank}" in _log(logs, rank, "stdout")
        assert f"oops from {rank}" in _log(logs, rank, "stderr")


def test_redirects_keep_output_off_the_console(tmp_path):
    worker = script(tmp_path / "p.py", PRINT_WORKER)
    logs = tmp_path / "logs"
    res = run_launcher(["--standalone", "--nproc_per_node=2", "-r", "0:1,1:3",
                        f"--log_dir={logs}", str(worker)], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "hello from" not in res.stdout
    assert "oops from 0" in res.stderr and "oops from 1" not in res.stderr
    assert "hello from 0" in _log(logs, 0, "stdout")
    assert "oops from 1" in _log(logs, 1, "stderr")


def test_local_ranks_filter(tmp_path):
    worker = script(tmp_path / "p.py", PRINT_WORKER)
    res = run_launcher(["--standalone", "--nproc_per_node=3", "--local_ranks_filter=1",
                        str(worker)], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "hello from 1" in res.stdout
    assert "hello from 0" not in res.stdout and "hello from 2" not in res.stdout


# -- signals and timers ---------------------------------------------------------------------------

def test_sigterm_to_agent_leaves_no_orphans(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    worker = script(tmp_path / "hang.py", """
        import os, subprocess, sys, time
        from pathlib import Path
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        Path(sys.argv[1], os.environ["RANK"]).write_text(f"{os.getpid()} {child.pid}")
        time.sleep(300)
    """)
    proc = agent(["--standalone", "--nproc_per_node=2", "--shutdown_timeout=5", str(worker),
                  str(pids)], tmp_path)
    try:
        wait_for(lambda: len(list(pids.iterdir())) == 2, 60, "both workers to start")
        wait_for(lambda: all(len(p.read_text().split()) == 2 for p in pids.iterdir()), 30,
                 "the pid files")
        tree = [int(x) for p in pids.iterdir() for x in p.read_text().split()]
        assert len(alive(tree)) == 4
        proc.send_signal(signal.SIGTERM)
        code, _, err = finish(proc, 60)
        assert code == 128 + signal.SIGTERM, err
        wait_for(lambda: not alive(tree), 30, "the worker trees to be gone")
    finally:
        kill_tree(proc.pid)


def test_expiration_timer_kills_a_stuck_worker(tmp_path):
    worker = script(tmp_path / "stuck.py", """
        import os, time
        import distcomm as dist
        from distcomm.launch import timer

        dist.init_process_group()
        if dist.get_rank() == 1:
            with timer.expires(after=1.0, scope="stuck-step"):
                time.sleep(120)
        dist.barrier()
        dist.destroy_process_group()
    """)
    res = run_launcher(["--standalone", "--nproc_per_node=2", str(worker)], tmp_path)
    assert res.returncode == 1
    assert "stuck-step" in res.stderr and "SIGKILL" in res.stderr


def test_expiration_timer_released_in_time(tmp_path):
    worker = script(tmp_path / "quick.py", """
        from distcomm.launch import timer
        with timer.expires(after=60.0):
            pass
    """)
    res = run_launcher(["--standalone", "--nproc_per_node=2", str(worker)], tmp_path)
    assert res.returncode == 0, res.stderr


# -- several nodes ----------------------------------------------------------------------------

def _nodes(tmp_path: Path, backend: str, endpoint: str, nnodes: str, count: int,
           worker: Path, *worker_args: str, extra: tuple[str, ...] = ()) -> list:
    return [agent([f"--nnodes={nnodes}", "--nproc_per_node=2", f"--rdzv_backend={backend}",
                   f"--rdzv_endpoint={endpoint}", "--rdzv_id=job-7", "--local_addr=127.0.0.1",
                   *extra, str(worker), *worker_args], tmp_path)
            for _ in range(count)]


def _two_nodes(tmp_path: Path, backend: str, endpoint: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    procs = _nodes(tmp_path, backend, endpoint, "2", 2, _env_worker(tmp_path), str(out))
    try:
        for proc in procs:
            code, _, err = finish(proc)
            assert code == 0, err
        _check_env(records(out), 2, 2, run_id="job-7")
    finally:
        for proc in procs:
            kill_tree(proc.pid)


def test_two_nodes_c10d(tmp_path):
    _two_nodes(tmp_path, "c10d", f"127.0.0.1:{_free_port()}")


def test_two_nodes_file(tmp_path):
    _two_nodes(tmp_path, "file", str(tmp_path / "rdzv.store"))


def test_two_nodes_etcd(tmp_path, etcd_endpoint):  # noqa: F811 - fixture
    _two_nodes(tmp_path, "etcd", etcd_endpoint)


def test_two_nodes_static(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    worker = _env_worker(tmp_path)
    procs = [agent(["--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=2",
                    "--master_addr=127.0.0.1", f"--master_port={port}", str(worker), str(out)],
                   tmp_path) for rank in (1, 0)]
    try:
        for proc in procs:
            code, _, err = finish(proc)
            assert code == 0, err
        _check_env(records(out), 2, 2)
    finally:
        for proc in procs:
            kill_tree(proc.pid)


def _sizes(out: Path) -> dict[int, set[int]]:
    sizes: dict[int, set[int]] = {}
    for rec in records(out):
        sizes.setdefault(rec["size"], set()).add(rec["rank"])
    return sizes


FAST_RDZV = "--rdzv_conf=last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=3"


def test_scale_up_third_node_joins(tmp_path):
    out, stop = tmp_path / "out", tmp_path / "stop"
    out.mkdir()
    worker = script(tmp_path / "elastic.py", ELASTIC_WORKER)
    endpoint = f"127.0.0.1:{_free_port()}"
    procs = _nodes(tmp_path, "c10d", endpoint, "2:3", 2, worker, str(out), str(stop),
                   extra=(FAST_RDZV,))
    try:
        wait_for(lambda: _sizes(out).get(4) == {0, 1, 2, 3}, 90, "a 2-node group")
        procs += _nodes(tmp_path, "c10d", endpoint, "2:3", 1, worker, str(out), str(stop),
                        extra=(FAST_RDZV,))
        wait_for(lambda: _sizes(out).get(6) == set(range(6)), 90, "a 3-node group")
        stop.write_text("")
        for proc in procs:
            code, _, err = finish(proc)
            assert code == 0, err
        # a membership change is not a failure: the restart count stays 0
        assert {r["restart"] for r in records(out)} == {"0"}
    finally:
        for proc in procs:
            kill_tree(proc.pid)


def _store_host(procs: list, port: int) -> int:
    for i, proc in enumerate(procs):
        try:
            conns = psutil.Process(proc.pid).net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns):
            return i
    raise AssertionError(f"no agent listens on port {port}")


def test_scale_down_killed_node_leaves(tmp_path):
    out, stop = tmp_path / "out", tmp_path / "stop"
    out.mkdir()
    worker = script(tmp_path / "elastic.py", ELASTIC_WORKER)
    port = _free_port()
    procs = _nodes(tmp_path, "c10d", f"127.0.0.1:{port}", "2:3", 3, worker, str(out), str(stop),
                   extra=(FAST_RDZV, "--max_restarts=3"))
    try:
        wait_for(lambda: _sizes(out).get(6) == set(range(6)), 90, "a 3-node group")
        host = _store_host(procs, port)
        victim = procs[(host + 1) % 3]
        workers = [c.pid for c in psutil.Process(victim.pid).children()]
        victim.kill()
        victim.wait(30)
        wait_for(lambda: not alive(workers), 30, "the killed node's workers to die with it")
        wait_for(lambda: _sizes(out).get(4) == {0, 1, 2, 3}, 120, "a 2-node group")
        stop.write_text("")
        for proc in procs:
            if proc is not victim:
                code, _, err = finish(proc)
                assert code == 0, err
    finally:
        for proc in procs:
            kill_tree(proc.pid)


def test_agent_records_error_file_json(tmp_path):
    """@record writes torch's error-file layout, which the agent reads back."""
    worker = script(tmp_path / "bad.py", """
        from distcomm.launch.errors import record

        @record
        def main():
            raise KeyError("missing-thing")

        main()
    """)
    logs = tmp_path / "logs"
    res = run_launcher(["--standalone", "--nproc_per_node=1", f"--log_dir={logs}",
                        str(worker)], tmp_path)
    assert res.returncode == 1
    (error_file,) = logs.glob("*/attempt_0/0/error.json")
    data = json.loads(error_file.read_text())
    assert "missing-thing" in data["message"]["message"]
    assert "Traceback" in data["message"]["extraInfo"]["py_callstack"]
    assert "missing-thing" in res.stderr
