"""distcomm-run end to end: real agents, real workers, real stores (c10d, etcd, file, static)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from distcomm.launch.errors import NOT_KEPT
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
from tests.processes import free_port

pytestmark = pytest.mark.timeout(240)

ENV_NAMES = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "DISTCOMM_RESTART_COUNT",
    "DISTCOMM_MAX_RESTARTS",
    "DISTCOMM_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_TIMER_FILE",
    "TORCHELASTIC_ERROR_FILE",
    "GROUP_WORLD_SIZE",
    "OMP_NUM_THREADS",
    "DISTCOMM_TIMER_FILE",
    "DISTCOMM_ERROR_FILE",
)

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
    record = out / f"w{size}_r{rank}.json"  # written whole: the test polls these
    record.with_suffix(".part").write_text(json.dumps(
        {"rank": rank, "size": size, "pid": os.getpid(),
         "restart": os.environ["DISTCOMM_RESTART_COUNT"]}))
    os.replace(record.with_suffix(".part"), record)
    while True:
        flag = np.array([1 if stop.exists() else 0], dtype=np.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag[0]:
            break
        time.sleep(0.2)
    dist.destroy_process_group()
"""


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
        assert int(r["GROUP_WORLD_SIZE"]) == nnodes
        assert r["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert r["TORCHELASTIC_TIMER_FILE"] == (r["DISTCOMM_TIMER_FILE"] or None)
        assert r["TORCHELASTIC_ERROR_FILE"] == r["DISTCOMM_ERROR_FILE"]
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
    res = run_launcher(
        [
            "--standalone",
            f"--nproc_per_node={nproc}",
            "--max_restarts=2",
            str(_env_worker(tmp_path)),
            str(out),
        ],
        tmp_path,
    )
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
        res = run_launcher(
            ["--nproc_per_node=2", "--rdzv_id=static-run", str(_env_worker(tmp_path)), str(out)],
            tmp_path,
        )
    assert res.returncode == 0, res.stderr
    recs = records(out)
    _check_env(recs, 1, 2, run_id="static-run")
    assert {r["MASTER_PORT"] for r in recs} != {"29500"}


def test_omp_num_threads_is_kept_when_set(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    res = run_launcher(
        ["--standalone", "--nproc_per_node=2", str(_env_worker(tmp_path)), str(out)],
        tmp_path,
        env=launcher_env(OMP_NUM_THREADS="3"),
    )
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
    res = run_launcher(
        ["--nproc-per-node", "2", str(_env_worker(tmp_path)), str(out)], tmp_path, env=env
    )
    assert res.returncode == 0, res.stderr
    assert len(records(out)) == 2


def test_torchrun_pet_variables_are_read(monkeypatch):
    """torchrun's PET_<FLAG> variables set flags as DISTCOMM_<FLAG> do; ours win over
    them, and the command line over both."""
    from distcomm.launch.run import parse_args

    for name in list(os.environ):
        if name.startswith(("DISTCOMM_", "PET_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PET_NPROC_PER_NODE", "2")
    monkeypatch.setenv("PET_STANDALONE", "1")
    monkeypatch.setenv("PET_MAX_RESTARTS", "3")
    args = parse_args(["train.py"])
    assert (args.nproc_per_node, args.standalone, int(args.max_restarts)) == ("2", True, 3)
    monkeypatch.setenv("DISTCOMM_NPROC_PER_NODE", "4")
    assert parse_args(["train.py"]).nproc_per_node == "4"
    assert parse_args(["--nproc-per-node=1", "train.py"]).nproc_per_node == "1"
    monkeypatch.setenv("PET_STANDALONE", "maybe")
    with pytest.raises(ValueError, match="PET_STANDALONE='maybe' is not a boolean"):
        parse_args(["train.py"])


def test_quickstart_main_job(tmp_path):
    res = run_launcher(
        ["--standalone", "--nproc_per_node=4", "-m", "distcomm.examples.quickstart"], tmp_path
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "4 rank(s)" in res.stdout and res.stdout.rstrip().endswith("OK")


def test_no_python_and_run_path(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    worker = _env_worker(tmp_path)
    res = run_launcher(
        ["--standalone", "--nproc_per_node=2", "--run_path", str(worker), str(out)], tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert len(records(out)) == 2
    marker = tmp_path / "marker"
    res = run_launcher(
        [
            "--standalone",
            "--nproc_per_node=2",
            "--no_python",
            "sh",
            "-c",
            f'echo "$RANK" >> {marker}',
        ],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert sorted(marker.read_text().split()) == ["0", "1"]


@pytest.mark.parametrize(
    "args, message",
    [
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
    ],
)
def test_bad_flags_are_named(tmp_path, args, message):
    res = run_launcher(args, tmp_path, timeout=60)
    assert res.returncode != 0
    assert message in res.stderr, res.stderr


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("DISTCOMM_START_METHOD", "bogus", "--start_method"),
        ("DISTCOMM_NPROC_PER_NODE", "-2", "--nproc_per_node"),
        ("DISTCOMM_STANDALONE", "maybe", "DISTCOMM_STANDALONE"),
    ],
)
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
    res = run_launcher(
        [
            "--standalone",
            "--nproc_per_node=3",
            "--max_restarts=2",
            str(worker),
            str(out),
            str(tmp_path / "ckpt"),
            "once",
        ],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    recs = records(out)
    assert sorted((r["restart"], r["rank"]) for r in recs) == [
        ("0", 0),
        ("0", 1),
        ("0", 2),
        ("1", 0),
        ("1", 1),
        ("1", 2),
    ]
    assert all(r["restart"] == r["torch"] for r in recs)


def test_max_restarts_exhausted_reports_root_cause(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    worker = script(tmp_path / "restart.py", RESTART_WORKER)
    res = run_launcher(
        [
            "--standalone",
            "--nproc_per_node=2",
            "--max_restarts=1",
            str(worker),
            str(out),
            str(tmp_path / "ckpt"),
            "always",
        ],
        tmp_path,
    )
    assert res.returncode == 1
    assert sorted(r["restart"] for r in records(out)) == ["0", "0", "1", "1"]
    err = res.stderr
    assert "FAILED" in err and "Root Cause" in err
    assert "ValueError: boom from rank 1 at restart 1" in err
    assert "exit code 1" in err or "exitcode" in err
    root = err[err.index("Root Cause") :]
    assert "rank" in root and "1" in root and "boom from rank 1" in root


def test_signal_death_is_named(tmp_path):
    worker = script(
        tmp_path / "die.py",
        """
        import os, signal
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
    """,
    )
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
    res = run_launcher(
        ["--standalone", "--nproc_per_node=2", "--tee=3", f"--log_dir={logs}", str(worker)],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    for rank in (0, 1):  # torchrun's prefix: role name and local rank
        assert f"[default{rank}]:hello from {rank}" in res.stdout
        assert f"[default{rank}]:oops from {rank}" in res.stderr
        assert f"hello from {rank}" in _log(logs, rank, "stdout")
        assert f"oops from {rank}" in _log(logs, rank, "stderr")


def test_redirects_keep_output_off_the_console(tmp_path):
    worker = script(tmp_path / "p.py", PRINT_WORKER)
    logs = tmp_path / "logs"
    res = run_launcher(
        ["--standalone", "--nproc_per_node=2", "-r", "0:1,1:3", f"--log_dir={logs}", str(worker)],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert "hello from" not in res.stdout
    assert "oops from 0" in res.stderr and "oops from 1" not in res.stderr
    assert "hello from 0" in _log(logs, 0, "stdout")
    assert "oops from 1" in _log(logs, 1, "stderr")


def test_local_ranks_filter(tmp_path):
    worker = script(tmp_path / "p.py", PRINT_WORKER)
    res = run_launcher(
        ["--standalone", "--nproc_per_node=3", "--local_ranks_filter=1", str(worker)], tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert "hello from 1" in res.stdout
    assert "hello from 0" not in res.stdout and "hello from 2" not in res.stdout


# -- signals and timers ---------------------------------------------------------------------------


def test_sigterm_to_agent_leaves_no_orphans(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    worker = script(
        tmp_path / "hang.py",
        """
        import os, subprocess, sys, time
        from pathlib import Path
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        Path(sys.argv[1], os.environ["RANK"]).write_text(f"{os.getpid()} {child.pid}")
        time.sleep(300)
    """,
    )
    proc = agent(
        ["--standalone", "--nproc_per_node=2", "--shutdown_timeout=5", str(worker), str(pids)],
        tmp_path,
    )
    try:
        wait_for(lambda: len(list(pids.iterdir())) == 2, 60, "both workers to start")
        wait_for(
            lambda: all(len(p.read_text().split()) == 2 for p in pids.iterdir()),
            30,
            "the pid files",
        )
        tree = [int(x) for p in pids.iterdir() for x in p.read_text().split()]
        assert len(alive(tree)) == 4
        proc.send_signal(signal.SIGTERM)
        code, _, err = finish(proc, 60)
        assert code == 128 + signal.SIGTERM, err
        wait_for(lambda: not alive(tree), 30, "the worker trees to be gone")
    finally:
        kill_tree(proc.pid)


def test_expiration_timer_kills_a_stuck_worker(tmp_path):
    worker = script(
        tmp_path / "stuck.py",
        """
        import os, time
        import distcomm as dist
        from distcomm.launch import timer

        dist.init_process_group()
        if dist.get_rank() == 1:
            with timer.expires(after=1.0, scope="stuck-step"):
                time.sleep(120)
        dist.barrier()
        dist.destroy_process_group()
    """,
    )
    res = run_launcher(["--standalone", "--nproc_per_node=2", str(worker)], tmp_path)
    assert res.returncode == 1
    assert "stuck-step" in res.stderr and "SIGKILL" in res.stderr


def test_expiration_timer_released_in_time(tmp_path):
    worker = script(
        tmp_path / "quick.py",
        """
        from distcomm.launch import timer
        with timer.expires(after=60.0):
            pass
    """,
    )
    res = run_launcher(["--standalone", "--nproc_per_node=2", str(worker)], tmp_path)
    assert res.returncode == 0, res.stderr


# -- several nodes ----------------------------------------------------------------------------


def _nodes(
    tmp_path: Path,
    backend: str,
    endpoint: str,
    nnodes: str,
    count: int,
    worker: Path,
    *worker_args: str,
    extra: tuple[str, ...] = (),
    local_addr: str | None = "127.0.0.1",
    log: Path | None = None,
    run_id: str = "job-7",
) -> list:
    addr = [f"--local_addr={local_addr}"] if local_addr else []
    return [
        agent(
            [
                f"--nnodes={nnodes}",
                "--nproc_per_node=2",
                f"--rdzv_backend={backend}",
                f"--rdzv_endpoint={endpoint}",
                f"--rdzv_id={run_id}",
                *addr,
                *extra,
                str(worker),
                *worker_args,
            ],
            tmp_path,
            log=None if log is None else log.with_suffix(f".{i}.log"),
        )
        for i in range(count)
    ]


def _two_nodes(
    tmp_path: Path,
    backend: str,
    endpoint: str,
    local_addr: str | None = "127.0.0.1",
    run_id: str = "job-7",
) -> list[dict]:
    out = tmp_path / "out"
    out.mkdir()
    procs = _nodes(
        tmp_path,
        backend,
        endpoint,
        "2",
        2,
        _env_worker(tmp_path),
        str(out),
        local_addr=local_addr,
        run_id=run_id,
    )
    try:
        for proc in procs:
            code, _, err = finish(proc)
            assert code == 0, err
        recs = records(out)
        _check_env(recs, 2, 2, run_id=run_id)
        return recs
    finally:
        for proc in procs:
            kill_tree(proc.pid)


def test_two_nodes_c10d(tmp_path):
    _two_nodes(tmp_path, "c10d", f"127.0.0.1:{free_port()}")


def test_two_nodes_file(tmp_path):
    _two_nodes(tmp_path, "file", str(tmp_path / "rdzv.store"))


def test_two_nodes_etcd(tmp_path, etcd_endpoint):  # noqa: F811 - fixture
    _two_nodes(tmp_path, "etcd", etcd_endpoint)


def test_etcd_advertises_the_ip_that_routes_to_the_endpoint(tmp_path, etcd_endpoint):  # noqa: F811
    """Without --local_addr, node 0 advertises the workers' store at an IP, the source
    address of its route to the etcd endpoint (here 127.0.0.1), not its host name."""
    recs = _two_nodes(
        tmp_path,
        "etcd",
        etcd_endpoint,
        local_addr=None,
        run_id=f"job-ip-{os.getpid()}-{tmp_path.name}",
    )
    assert {r["MASTER_ADDR"] for r in recs} == {"127.0.0.1"}


def test_two_nodes_static(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    worker = _env_worker(tmp_path)
    procs = [
        agent(
            [
                "--nnodes=2",
                f"--node_rank={rank}",
                "--nproc_per_node=2",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                str(worker),
                str(out),
            ],
            tmp_path,
        )
        for rank in (1, 0)
    ]
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


#: a short last call; a node is dropped after 6 missed heartbeats (3 s), beyond what a
#: loaded machine stalls a live agent's keep-alive thread
FAST_RDZV = "--rdzv_conf=last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=6"
#: a last call far longer than any wait of the tests: a round that waited for it would fail
LONG_LAST_CALL = (
    "--rdzv_conf=last_call_timeout=600,keep_alive_interval=0.5,keep_alive_max_attempt=6"
)


def test_elastic_range_says_it_waits_for_the_last_call(tmp_path):
    """--nnodes=1:4 with one node: the agent says, when it starts waiting, that it waits
    last_call_timeout for more nodes and how to start at once; then the job runs."""
    out = tmp_path / "out"
    out.mkdir()
    worker = _env_worker(tmp_path)
    (proc,) = _nodes(
        tmp_path,
        "c10d",
        f"127.0.0.1:{free_port()}",
        "1:4",
        1,
        worker,
        str(out),
        extra=("--rdzv_conf=last_call_timeout=1",),
        run_id="lonely",
    )
    try:
        code, _, err = finish(proc)
    finally:
        kill_tree(proc.pid)
    assert code == 0, err
    _check_env(records(out), 1, 2, run_id="lonely")
    (line,) = [line for line in err.splitlines() if "last_call_timeout" in line]
    assert "rendezvous of run 'lonely' (c10d): 1 node(s) joined round 0 (--nnodes=1:4)" in line
    assert re.search(r"waiting up to [\d.]+ s \(--rdzv_conf last_call_timeout=1\) for more", line)
    assert "pass --nnodes=1 to start at once" in line


def _with_agent_logs(tmp_path: Path, exc: AssertionError) -> AssertionError:
    """`exc` with the end of every agent log under `tmp_path` (what each node saw)."""
    logs = "".join(
        f"\n== {path.name}\n{path.read_text(errors='replace')[-6000:]}"
        for path in sorted(tmp_path.glob("*.log"))
    )
    return AssertionError(f"{exc}{logs}")


def test_scale_up_third_node_joins(tmp_path):
    out, stop = tmp_path / "out", tmp_path / "stop"
    out.mkdir()
    worker = script(tmp_path / "elastic.py", ELASTIC_WORKER)
    endpoint = f"127.0.0.1:{free_port()}"
    args = (worker, str(out), str(stop))
    procs = _nodes(
        tmp_path, "c10d", endpoint, "2:3", 2, *args, extra=(FAST_RDZV,), log=tmp_path / "node"
    )
    try:
        wait_for(lambda: _sizes(out).get(4) == {0, 1, 2, 3}, 90, "a 2-node group")
        procs += _nodes(
            tmp_path, "c10d", endpoint, "2:3", 1, *args, extra=(FAST_RDZV,), log=tmp_path / "third"
        )
        wait_for(lambda: _sizes(out).get(6) == set(range(6)), 90, "a 3-node group")
        stop.write_text("")
        for proc in procs:
            code, _, err = finish(proc)
            assert code == 0, err
        # a membership change is not a failure: the restart count stays 0
        assert {r["restart"] for r in records(out)} == {"0"}
    except AssertionError as exc:
        raise _with_agent_logs(tmp_path, exc) from None
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
    """kill -9 of an agent mid-run: the survivors form a round of 2 as soon as the dead node
    is dropped, without waiting for the last call (600 s, beyond every wait here)."""
    out, stop = tmp_path / "out", tmp_path / "stop"
    out.mkdir()
    worker = script(tmp_path / "elastic.py", ELASTIC_WORKER)
    port = free_port()
    procs = _nodes(
        tmp_path,
        "c10d",
        f"127.0.0.1:{port}",
        "2:3",
        3,
        worker,
        str(out),
        str(stop),
        extra=(LONG_LAST_CALL, "--max_restarts=3"),
        log=tmp_path / "node",
    )
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
    except AssertionError as exc:
        raise _with_agent_logs(tmp_path, exc) from None
    finally:
        for proc in procs:
            kill_tree(proc.pid)


def test_agent_records_error_file_json(tmp_path):
    """@record writes torch's error-file layout, which the agent reads back."""
    worker = script(
        tmp_path / "bad.py",
        """
        from distcomm.launch.errors import record

        @record
        def main():
            raise KeyError("missing-thing")

        main()
    """,
    )
    logs = tmp_path / "logs"
    res = run_launcher(
        ["--standalone", "--nproc_per_node=1", f"--log_dir={logs}", str(worker)], tmp_path
    )
    assert res.returncode == 1
    (error_file,) = logs.glob("*/attempt_0/0/error.json")
    data = json.loads(error_file.read_text())
    assert "missing-thing" in data["message"]["message"]
    assert "Traceback" in data["message"]["extraInfo"]["py_callstack"]
    assert "missing-thing" in res.stderr


#: a decorated worker that raises, and one that fails without recording anything
RECORDED_FAILURE = """
    from distcomm.launch.errors import record

    @record
    def main():
        raise ValueError("bad input 42")

    main()
"""
UNRECORDED_FAILURE = """
    raise ValueError("bad input 43")
"""


def _failure_report(stderr: str, name: str) -> str:
    """The agent's failure report in `stderr`: from its top rule to its bottom rule."""
    start = stderr.index(f"{name} FAILED\n")
    start = stderr.rfind("\n", 0, start - 1) + 1  # the top rule
    end = stderr.index("Root Cause (first observed failure):", start)
    end = stderr.index("=" * 20, end)
    return stderr[start : stderr.index("\n", end)]


def _named_paths(report: str) -> list[str]:
    """The file paths the report names: its error_file, stdout and stderr rows and the
    log its stderr tail comes from."""
    rows = re.findall(r"^  (?:error_file|stdout|stderr)\s*: (.*)$", report, re.M)
    tails = re.findall(
        r"\(no recorded traceback; (?:last \d+ lines of|the last one in) (.*)\)$", report, re.M
    )
    return [value for value in rows + tails if not value.startswith("<") and value != "its stderr"]


@pytest.mark.parametrize(
    "worker, flags",
    [
        (RECORDED_FAILURE, []),
        (RECORDED_FAILURE, ["--log_dir=logs"]),
        (RECORDED_FAILURE, ["--log_dir=logs", "--redirects=3"]),
        (UNRECORDED_FAILURE, []),
        (UNRECORDED_FAILURE, ["--redirects=3"]),
    ],
    ids=[
        "recorded",
        "recorded-log-dir",
        "recorded-log-dir-redirects",
        "unrecorded",
        "unrecorded-redirects",
    ],
)
def test_failure_report_names_only_files_that_outlive_the_launcher(tmp_path, worker, flags):
    """The report of a failed run: the recorded exception for a decorated worker, the
    traceback on its stderr for one that wrote no error file (no @record hint either way),
    and only paths that still exist once distcomm-run has exited (those under --log_dir);
    the agent leaves nothing else in the directories the test gave it."""
    path = script(tmp_path / "fails.py", worker)
    res = run_launcher(["--standalone", "--nproc_per_node=1", *flags, path.name], tmp_path)
    assert res.returncode == 1, res.stderr
    report = _failure_report(res.stderr, path.name)
    kept = any(flag.startswith("--log_dir") for flag in flags)
    redirected = any(flag.startswith("--redirects") for flag in flags)
    recorded = worker is RECORDED_FAILURE
    if recorded:
        assert "message   : ValueError: bad input 42" in report
        assert 'raise ValueError("bad input 42")' in report  # the recorded traceback
        assert "@record" not in report
    else:  # the traceback at the end of its stderr (log)
        assert "message   : ValueError: bad input 43" in report
        assert 'raise ValueError("bad input 43")' in report
        assert "@record" not in report
    assert ("error_file: <N/A>" in report) is not recorded
    assert (NOT_KEPT in report) is ((recorded or redirected) and not kept)
    named = _named_paths(report)
    # error_file when recorded; stdout, stderr and the stderr tail's source when redirected
    expected = recorded + (2 + (not recorded)) * redirected if kept else 0
    assert len(named) == expected, report
    for name in named:
        assert os.path.isfile(name), f"the report names {name}, gone after exit:\n{report}"
    if kept and recorded:
        (error_file,) = (tmp_path / "logs").glob("*/attempt_0/0/error.json")
        assert f"error_file: {error_file}" in report
        data = json.loads(error_file.read_text())
        assert data["message"]["message"] == "ValueError: bad input 42"
    # the agent's temporary directory (TMPDIR is tmp_path) is gone; --log_dir's remains
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["fails.py", *(["logs"] if kept else [])]
    )


# -- a failure on one node ends the run on every node ---------------------------------------------

#: node 0's workers succeed at once; the other node's fail once node 0's are done
LATE_FAILURE_WORKER = """
    import os, sys, time
    from pathlib import Path
    from distcomm.launch.errors import record

    out = Path(sys.argv[1])
    rank, node = int(os.environ["RANK"]), int(os.environ["GROUP_RANK"])
    attempt = os.environ["DISTCOMM_RESTART_COUNT"]

    @record
    def main():
        (out / f"start_r{rank}_a{attempt}").write_text(str(os.getppid()))
        if node == 0:
            (out / f"done_r{rank}_a{attempt}").write_text("")
            return
        deadline = time.monotonic() + 60
        while (len(list(out.glob(f"done_r*_a{attempt}"))) < 2
               or len(list(out.glob(f"start_r*_a{attempt}"))) < 4):  # every worker is up
            if time.monotonic() > deadline:
                raise TimeoutError("node 0's workers never finished")
            time.sleep(0.05)
        time.sleep(1.0)  # node 0's agent waits at its exit barrier by now
        raise RuntimeError(f"boom on rank {rank} at restart {attempt}, after node 0 succeeded")

    main()
"""


@pytest.mark.parametrize(
    "backend, max_restarts", [("c10d", 0), ("c10d", 1), ("static", 1), ("file", 0)]
)
def test_failure_after_another_node_succeeded_fails_every_node(tmp_path, backend, max_restarts):
    """The node whose workers succeeded leaves its exit barrier when the other node's fail:
    every node exits 1 with the report of the failure (its root cause) instead of waiting
    out the 300 s barrier and exiting 0; with a restart left, both nodes run again."""
    out = tmp_path / "out"
    out.mkdir()
    worker = script(tmp_path / "late.py", LATE_FAILURE_WORKER)
    restarts = f"--max_restarts={max_restarts}"
    if backend == "static":
        port = free_port()
        procs = [
            agent(
                [
                    "--nnodes=2",
                    f"--node_rank={rank}",
                    "--nproc_per_node=2",
                    restarts,
                    "--master_addr=127.0.0.1",
                    f"--master_port={port}",
                    str(worker),
                    str(out),
                ],
                tmp_path,
            )
            for rank in (1, 0)
        ]
    else:
        endpoint = f"127.0.0.1:{free_port()}" if backend == "c10d" else str(tmp_path / "rdzv")
        procs = _nodes(tmp_path, backend, endpoint, "2", 2, worker, str(out), extra=(restarts,))
    try:
        results = {proc.pid: finish(proc, 150) for proc in procs}
    finally:
        for proc in procs:
            kill_tree(proc.pid)
    assert [code for code, _, _ in results.values()] == [1, 1], results
    node0 = int((out / "start_r0_a0").read_text())  # the agent whose workers succeeded
    for pid, (_, _, err) in results.items():
        assert "Root Cause" in err and "boom on rank" in err, err
        assert f"at restart {max_restarts}, after node 0 succeeded" in err, err
        if pid == node0:
            assert "did not fail; the run failed on node(s) 1" in err, err
    starts = sorted(p.name for p in out.glob("start_*"))
    attempts = [f"_a{n}" for n in range(max_restarts + 1)]
    assert starts == sorted(f"start_r{r}{a}" for r in range(4) for a in attempts)


# -- signals: --signals_to_handle, SIGUSR1/SIGUSR2 passed on ------------------------------------

USR1_WORKER = """
    import os, signal, sys, time
    from pathlib import Path

    out, rank = Path(sys.argv[1]), os.environ["RANK"]
    got = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    (out / f"ready_{rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    (out / f"checkpoint_{rank}").write_text(",".join(map(str, got)))
    sys.exit(0 if got else 1)
"""


@pytest.mark.parametrize("listed", [False, True], ids=["passed-on", "listed-to-stop"])
def test_sigusr1_reaches_the_workers(tmp_path, listed):
    """SIGUSR1 to the agent (Slurm's sbatch --signal=USR1@T) reaches every worker's
    handler. By default the run goes on (here: the workers checkpoint and end, the agent
    exits 0); listed in --signals_to_handle it stops the run, as in torchrun (128+10)."""
    out = tmp_path / "out"
    out.mkdir()
    worker = script(tmp_path / "usr1.py", USR1_WORKER)
    args = ["--standalone", "--nproc_per_node=2"]
    if listed:
        args.append("--signals_to_handle=SIGTERM,SIGINT,SIGUSR1")
    proc = agent([*args, str(worker), str(out)], tmp_path)
    try:
        wait_for(lambda: len(list(out.glob("ready_*"))) == 2, 60, "both workers to start")
        proc.send_signal(signal.SIGUSR1)
        code, _, err = finish(proc, 60)
    finally:
        kill_tree(proc.pid)
    assert code == (128 + signal.SIGUSR1 if listed else 0), err
    for rank in (0, 1):
        assert (out / f"checkpoint_{rank}").read_text() == str(int(signal.SIGUSR1))


@pytest.mark.parametrize(
    "value, message", [("SIGBOGUS", "is not a signal name"), ("SIGKILL", "cannot be handled")]
)
def test_bad_signals_to_handle_are_named(tmp_path, value, message):
    res = run_launcher(
        ["--standalone", f"--signals_to_handle={value}", "x.py"], tmp_path, timeout=60
    )
    assert res.returncode == 2
    assert "--signals_to_handle" in res.stderr and message in res.stderr, res.stderr


def test_parse_signals_and_agent_decisions():
    from distcomm.launch.agent.watch import Observation, RunResult, barrier_step, next_step
    from distcomm.launch.rendezvous import RoundView
    from distcomm.launch.run import parse_signals

    assert parse_signals("SIGTERM, usr1,SIGTERM") == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals("") == ()
    running, quiet = {0: None, 1: None}, Observation(RoundView(), failed=False)
    assert next_step({0: 0, 1: None}, None) is None
    assert next_step({0: 1, 1: None}, None) is RunResult.FAILED
    assert next_step({0: 0, 1: 0}, quiet) is RunResult.SUCCEEDED
    assert next_step(running, quiet) is None
    assert next_step(running, Observation(RoundView(), failed=True)) is RunResult.FAILED
    assert next_step(running, Observation(RoundView(closed=True), False)) is RunResult.CLOSED
    waiting = Observation(RoundView(nodes_waiting=1), False)
    assert next_step(running, waiting) is RunResult.MEMBERSHIP_CHANGED
    # at the exit barrier, nodes waiting to join do not end the wait; the rest does
    assert barrier_step(waiting) is None and barrier_step(None) is None
    over = Observation(RoundView(nodes_waiting=1, round_over=True), False)
    assert barrier_step(over) is RunResult.MEMBERSHIP_CHANGED
    assert barrier_step(Observation(RoundView(round_over=True), True)) is RunResult.FAILED
    assert barrier_step(Observation(RoundView(closed=True), False)) is RunResult.CLOSED


def test_advertised_address_rules():
    import ipaddress

    from distcomm.launch.agent.address import advertised_address, default_route_address

    assert advertised_address("node7.example", 4, ("127.0.0.1", 2379)) == "node7.example"
    assert advertised_address(None, 1, None) == "127.0.0.1"
    assert advertised_address(None, 4, ("127.0.0.1", 2379)) == "127.0.0.1"
    assert advertised_address(None, 4, ("localhost", 2379)) == "127.0.0.1"
    ipaddress.ip_address(advertised_address(None, 4, None))  # an IP, whatever the host
    default = default_route_address()
    assert default is None or ipaddress.ip_address(default)


#: run inside a new network namespace (root): a veth pair, the default route through it
NETNS_DRIVER = """
    import subprocess, sys
    for cmd in ("ip link set lo up", "ip link add dc0 type veth peer name dc1",
                "ip addr add 10.23.0.1/24 dev dc0", "ip link set dc0 up", "ip link set dc1 up",
                "ip route add default via 10.23.0.2 dev dc0"):
        subprocess.run(cmd.split(), check=True)
    agents = [subprocess.Popen([sys.executable, "-m", "distcomm.run", *sys.argv[1:]])
              for _ in range(2)]
    sys.exit(max(agent.wait(timeout=120) for agent in agents))
"""


def test_file_rendezvous_advertises_the_default_route_address(tmp_path):
    """file rendezvous without --local_addr: node 0 advertises the IPv4 address of the
    default route's interface (in a private network namespace: 10.23.0.1), not a name."""
    probe = subprocess.run(
        ["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.strip()}")
    out = tmp_path / "out"
    out.mkdir()
    driver = script(tmp_path / "netns_driver.py", NETNS_DRIVER)
    proc = subprocess.Popen(
        [
            "unshare",
            "-n",
            sys.executable,
            str(driver),
            "--nnodes=2",
            "--nproc_per_node=2",
            "--rdzv_backend=file",
            f"--rdzv_endpoint={tmp_path / 'rdzv'}",
            "--rdzv_id=job-ns",
            str(_env_worker(tmp_path)),
            str(out),
        ],
        cwd=tmp_path,
        env=launcher_env(TMPDIR=str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        code, _, err = finish(proc, 150)
    finally:
        kill_tree(proc.pid)
    assert code == 0, err
    recs = records(out)
    _check_env(recs, 2, 2, run_id="job-ns")
    assert {r["MASTER_ADDR"] for r in recs} == {"10.23.0.1"}


# -- the store stalls: the agent still watches its workers ------------------------------------

#: sleeps until the trigger names its agent; then its local rank 0 fails
TRIGGERED_WORKER = """
    import os, sys, time
    from pathlib import Path

    out = Path(sys.argv[1])
    trigger = out / "trigger"
    (out / f"ready_{os.environ['RANK']}").write_text(f"{os.getppid()} {os.getpid()}")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if trigger.exists() and trigger.read_text() == str(os.getppid()):
            if os.environ["LOCAL_RANK"] == "0":
                raise SystemExit(f"rank {os.environ['RANK']} failed as told")
        time.sleep(0.05)
"""


def test_agent_watches_its_workers_while_the_store_does_not_answer(tmp_path):
    """The agent hosting the c10d store is frozen (SIGSTOP): the other agent's store calls
    get no answer, as over a dead link. It says so, and still acts on its worker's failure:
    the failed worker's sibling is stopped while the store is silent. Once the store is
    back, both agents end with the failure (exit 1)."""
    out = tmp_path / "out"
    out.mkdir()
    worker = script(tmp_path / "triggered.py", TRIGGERED_WORKER)
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    host = _nodes(tmp_path, "c10d", endpoint, "2", 1, worker, str(out), log=tmp_path / "host")[0]
    procs = [host]
    try:

        def listening() -> bool:
            conns = psutil.Process(host.pid).net_connections(kind="tcp")
            return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)

        wait_for(listening, 60, "the store's host to listen")
        other = _nodes(
            tmp_path, "c10d", endpoint, "2", 1, worker, str(out), log=tmp_path / "other"
        )[0]
        procs.append(other)
        wait_for(lambda: len(list(out.glob("ready_*"))) == 4, 60, "all four workers")
        mine = [tuple(map(int, p.read_text().split())) for p in out.glob("ready_*")]
        siblings = [pid for agent_pid, pid in mine if agent_pid == other.pid]
        assert len(siblings) == 2
        log = other.log_path
        host.send_signal(signal.SIGSTOP)
        try:
            wait_for(
                lambda: "has not answered for" in log.read_text(),
                60,
                "the agent to report the silent store",
            )
            (out / "trigger").write_text(str(other.pid))
            wait_for(
                lambda: not alive(siblings),
                60,
                "the agent to stop its workers while the store is silent",
            )
            assert other.poll() is None  # still waiting for the store to record the failure
        finally:
            host.send_signal(signal.SIGCONT)
        results = [finish(proc, 120) for proc in procs]
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
            kill_tree(proc.pid)
    assert [code for code, _, _ in results] == [1, 1], results
    for _, _, err in results:  # both print the report of the other agent's failed worker
        assert "Root Cause" in err and "ended with exit code 1" in err, err
    assert "failed as told" in results[1][2]  # the worker's own output
    # the late answer, once it came (the watch's read was pending when the agent said so)
    assert re.search(r"rendezvous store at \S+ took [\d.]+ s to answer", results[1][2])


@pytest.mark.parametrize("backend", ["tcp", "gloo"])
def test_explicit_tcp_init_method_wins_over_the_agent_store(tmp_path, backend):
    """A script that passes its own tcp:// init_method and rank= (the README's first
    example) hosts that store on rank 0 under distcomm-run instead of waiting for it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    worker = script(
        tmp_path / "own_init.py",
        f"""
        import os
        from datetime import timedelta
        import numpy as np
        import distcomm as dist

        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(
            "{backend}",
            init_method="tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=600),
        )
        x = np.ones(4)
        dist.all_reduce(x)
        print(f"rank {{rank}} sum {{x[0]:.0f}}", flush=True)
        dist.destroy_process_group()
        """,
    )
    res = run_launcher(["--standalone", "--nproc_per_node=2", str(worker)], tmp_path, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rank 0 sum 2" in res.stdout and "rank 1 sum 2" in res.stdout, res.stdout
