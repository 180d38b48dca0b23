"""torchrun parity of distcomm-run: its flags, the workers' environment, NUMA binding,
duplicated log lines, events, LogsSpecs names and torch's --rdzv-conf keys."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distcomm.launch import events
from distcomm.launch.logs_specs import (
    DefaultLogsSpecs,
    LogsSpecs,
    get_logs_specs_class,
    register_logs_specs,
)
from distcomm.launch.numa import (
    CpuTopology,
    NumaOptions,
    numa_affinity,
    parse_cpu_list,
    read_topology,
    worker_cpus,
)
from distcomm.launch.rendezvous import RendezvousParameters
from distcomm.launch.rendezvous.settings import settings_from_params
from distcomm.launch.run import comma_separated_list, config_from_args, get_args_parser
from distcomm.launch.workers import Std, WorkerProcesses
from tests.launchjobs import launcher_env, run_launcher, script

pytestmark = pytest.mark.timeout(240)

# -- flags ------------------------------------------------------------------------------------


def _option_strings(parser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def test_every_torchrun_flag_is_accepted():
    torch_run = pytest.importorskip("torch.distributed.run")
    missing = _option_strings(torch_run.get_args_parser()) - _option_strings(get_args_parser())
    assert not missing, f"torchrun flags distcomm-run lacks: {sorted(missing)}"


def test_comma_separated_list_as_torchrun():
    assert comma_separated_list("apple,orange") == ["apple", "orange"]
    assert comma_separated_list("a,,b,c") == ["a,b", "c"]
    assert comma_separated_list("") == []


def test_new_flags_reach_the_config(monkeypatch):
    monkeypatch.setenv("PET_EVENT_LOG_HANDLER", "console")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    args = get_args_parser().parse_args(
        [
            "--nproc-per-node=2",
            "--duplicate-stdout-filters=apple,,pie,loss",
            "--numa-binding=exclusive",
            "--virtual-local-rank",
            "--logs-specs=default",
            "x.py",
        ]
    )
    config = config_from_args(args)
    assert config.duplicate_stdout_filters == ["apple,pie", "loss"]
    assert config.duplicate_stderr_filters == []
    assert config.numa_binding == NumaOptions("exclusive")
    assert config.virtual_local_rank and config.event_log_handler == "console"
    assert config.shutdown_timeout == 7.0
    assert isinstance(config.logs_specs, DefaultLogsSpecs)


def test_unknown_logs_specs_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"--logs-specs='nosuch'.*known ones are default"):
        get_logs_specs_class("nosuch")
    res = run_launcher(["--logs-specs=nosuch", "x.py"], tmp_path)
    assert res.returncode == 2 and "known ones are default" in res.stderr


def test_registered_logs_specs_places_the_logs(tmp_path):
    class Flat(LogsSpecs):
        @property
        def root_log_dir(self) -> str:
            return self._root_log_dir or ""

        def attempt_dir(self, run_id: str, attempt: int) -> str | None:
            return os.path.join(self.root_log_dir, f"try{attempt}")

    register_logs_specs("flat-test", Flat)
    args = get_args_parser().parse_args(
        ["--logs-specs=flat-test", f"--log-dir={tmp_path}", "--redirects=3", "x.py"]
    )
    config = config_from_args(args)
    assert isinstance(config.logs_specs, Flat)
    assert config.logs_specs.attempt_dir("r", 2) == os.path.join(str(tmp_path), "try2")
    assert config.logs_specs.redirects(1) == {0: Std.ALL}


# -- the workers' environment -----------------------------------------------------------------

DUMP = """
    import json, os, sys
    with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as f:
        json.dump(dict(os.environ), f)
"""


def test_worker_environment_has_every_name_torchrun_sets(tmp_path):
    pytest.importorskip("torch")
    worker = script(tmp_path / "dump.py", DUMP)
    env = launcher_env(TMPDIR=str(tmp_path))  # torchrun leaves its temporary directory
    seen = {}
    for name, module in (("torch", "torch.distributed.run"), ("ours", "distcomm.run")):
        out = tmp_path / name
        out.mkdir()
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                module,
                "--standalone",
                "--nproc-per-node=2",
                str(worker),
                str(out),
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        seen[name] = [json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)]
    for torch_env, our_env in zip(seen["torch"], seen["ours"], strict=True):
        missing = sorted(set(torch_env) - set(our_env))
        assert not missing, f"torchrun's workers get {missing}; ours do not"
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "ROLE_RANK"):
            assert torch_env[name] == our_env[name], name
        assert our_env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def test_virtual_local_rank(tmp_path):
    worker = script(tmp_path / "dump.py", DUMP)
    out = tmp_path / "out"
    out.mkdir()
    env = launcher_env(CUDA_VISIBLE_DEVICES="3,5")
    res = run_launcher(
        ["--standalone", "--nproc-per-node=2", "--virtual-local-rank", str(worker), str(out)],
        tmp_path,
        env,
    )
    assert res.returncode == 0, res.stderr
    seen = [json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert [e["LOCAL_RANK"] for e in seen] == ["0", "0"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in seen] == ["3", "5"]
    res = run_launcher(
        ["--standalone", "--nproc-per-node=3", "--virtual-local-rank", str(worker), str(out)],
        tmp_path,
        env,
    )
    assert res.returncode == 1 and "local rank 2 has no device in CUDA_VISIBLE_DEVICES" in (
        res.stderr
    )


# -- NUMA binding -----------------------------------------------------------------------------


def _fake_sysfs(root: Path) -> Path:
    """8 CPUs: NUMA node 0 = 0-3 (L3 caches 0-1 and 2-3), node 1 = 4-7 (one L3), one
    socket, hyperthread pairs (0,1) (2,3) (4,5) (6,7); node 2 has memory only."""
    for node, cpus in ((0, "0-3"), (1, "4-7"), (2, "")):
        (root / "node" / f"node{node}").mkdir(parents=True)
        (root / "node" / f"node{node}" / "cpulist").write_text(cpus + "\n")
    for cpu in range(8):
        topo = root / "cpu" / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        pair = cpu - cpu % 2
        (topo / "thread_siblings_list").write_text(f"{pair}-{pair + 1}\n")
        (topo / "physical_package_id").write_text("0\n")
        l3 = "0-1" if cpu < 2 else "2-3" if cpu < 4 else "4-7"
        for index, (kind, level, shared) in enumerate(
            (("Data", 1, str(cpu)), ("Instruction", 1, str(cpu)), ("Unified", 3, l3))
        ):
            cache = root / "cpu" / f"cpu{cpu}" / "cache" / f"index{index}"
            cache.mkdir(parents=True)
            (cache / "type").write_text(kind + "\n")
            (cache / "level").write_text(f"{level}\n")
            (cache / "shared_cpu_list").write_text(shared + "\n")
    return root


def _sets(result: dict[int, frozenset[int]]) -> dict[int, set[int]]:
    return {rank: set(cpus) for rank, cpus in result.items()}


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("") == frozenset()
    with pytest.raises(ValueError, match="CPU list"):
        parse_cpu_list("0-x")


def test_numa_cpu_sets_from_a_fake_sysfs(tmp_path):
    topology = read_topology(range(8), str(_fake_sysfs(tmp_path)))
    assert _sets(topology.nodes) == {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}
    assert _sets(worker_cpus("node", 4, topology)) == {
        0: {0, 1, 2, 3},
        1: {0, 1, 2, 3},
        2: {4, 5, 6, 7},
        3: {4, 5, 6, 7},
    }
    assert all(cpus == set(range(8)) for cpus in _sets(worker_cpus("socket", 4, topology)).values())
    assert _sets(worker_cpus("exclusive", 4, topology)) == {
        0: {0, 1},
        1: {2, 3},
        2: {4, 5},
        3: {6, 7},
    }
    assert _sets(worker_cpus("exclusive", 2, topology)) == {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}
    assert _sets(worker_cpus("core-complex", 4, topology)) == {
        0: {0, 1},
        1: {2, 3},
        2: {4, 5, 6, 7},
        3: {4, 5, 6, 7},
    }
    with pytest.raises(ValueError, match=r"NUMA node 0 has 2 physical core.*3 workers"):
        worker_cpus("exclusive", 6, topology)


def test_numa_binding_uses_only_allowed_cpus_and_skips_flat_machines(tmp_path):
    root = str(_fake_sysfs(tmp_path))
    sets, message = numa_affinity("node", 2, root, allowed={0, 1, 4, 5})
    assert sets is not None and _sets(sets) == {0: {0, 1}, 1: {4, 5}} and message == ""
    sets, message = numa_affinity("node", 2, root, allowed={0, 1, 2})  # one node: flat
    assert sets is None and "flat" in message and "left alone" in message
    flat = CpuTopology(
        nodes={0: frozenset({0, 1})}, socket={0: 0, 1: 0}, core={0: 0, 1: 1}, cache={0: 0, 1: 0}
    )
    assert _sets(worker_cpus("exclusive", 2, flat)) == {0: {0}, 1: {1}}
    with pytest.raises(ValueError, match="not one of node, socket, exclusive, core-complex"):
        NumaOptions("nodes")


def test_numa_binding_flag_on_this_machine(tmp_path):
    worker = script(
        tmp_path / "w.py",
        "import os; print(f'cpus {sorted(os.sched_getaffinity(0))}', flush=True)",
    )
    res = run_launcher(
        ["--standalone", "--nproc-per-node=2", "--numa-binding=node", str(worker)], tmp_path
    )
    assert res.returncode == 0, res.stderr
    allowed = sorted(os.sched_getaffinity(0))
    if len(read_topology(allowed).nodes) == 1:
        assert "topology is flat" in res.stderr
        assert res.stdout.count(f"cpus {allowed}") == 2


# -- duplicated log lines ---------------------------------------------------------------------


def test_duplicate_filters_copy_matching_teed_lines(tmp_path, capfdbinary):
    code = (
        "print('apple 1'); print('banana'); print('apple, pie'); import sys; "
        "print('apple on stderr', file=sys.stderr)"
    )
    workers = WorkerProcesses(
        {lr: [sys.executable, "-c", code] for lr in (0, 1)},
        {lr: dict(os.environ) for lr in (0, 1)},
        log_dir=str(tmp_path),
        redirects={},
        tee={0: Std.ALL, 1: Std.ERR},
        console_ranks=None,
        prefixes={0: "[default0]:", 1: "[default1]:"},
        duplicate_filters={"stdout": ["apple, pie", "1"], "stderr": []},
    )
    with workers:
        workers.start()
        for _ in range(600):
            if None not in workers.poll().values():
                break
            __import__("time").sleep(0.05)
    lines = (tmp_path / "filtered_stdout.log").read_text().splitlines()
    assert lines == ["[default0]:apple 1", "[default0]:apple, pie"]  # rank 1's stdout: not teed
    assert not (tmp_path / "filtered_stderr.log").exists()  # an empty filter list: no file


def test_duplicate_filters_flag_writes_torchruns_file(tmp_path):
    worker = script(tmp_path / "w.py", "print('loss 1.5'); print('step 2')")
    logs = tmp_path / "logs"
    res = run_launcher(
        [
            "--standalone",
            "--nproc-per-node=2",
            "--tee=1",
            f"--log-dir={logs}",
            "--duplicate-stdout-filters=loss",
            str(worker),
        ],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    (path,) = logs.glob("*/attempt_0/filtered_stdout.log")
    assert sorted(path.read_text().splitlines()) == ["[default0]:loss 1.5", "[default1]:loss 1.5"]


# -- events -----------------------------------------------------------------------------------


def test_console_events_and_null_drops_them(tmp_path):
    worker = script(tmp_path / "w.py", "pass")
    res = run_launcher(
        ["--standalone", "--nproc-per-node=2", "--event-log-handler=console", str(worker)],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    found = [json.loads(line) for line in res.stderr.splitlines() if line.startswith('{"name"')]
    names = [(e["name"].rsplit(".", 1)[1], e["source"]) for e in found]
    assert names.count(("START", "WORKER")) == 2 and names.count(("SUCCEEDED", "WORKER")) == 2
    assert ("RENDEZVOUS", "AGENT") in names and names[-1] == ("SUCCEEDED", "AGENT")
    res = run_launcher(["--standalone", str(worker)], tmp_path)
    assert res.returncode == 0 and "torchelastic.worker.status" not in res.stderr
    res = run_launcher(["--standalone", "--event-log-handler=nosuch", str(worker)], tmp_path)
    assert res.returncode == 2 and "known ones are console, dynamic_rendezvous, null" in res.stderr


def test_registered_event_handler_receives_failures_and_restarts():
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    events.register_event_handler("keep-test", Keep)
    events.record(
        events.Event("torchelastic.worker.status.RESTART", events.EventSource.AGENT), "keep-test"
    )
    (event,) = [json.loads(text) for text in seen]
    assert event["source"] == "AGENT" and event["timestamp"] > 0
    with pytest.raises(ValueError, match="already registered"):
        events.register_event_handler("keep-test", logging.NullHandler)


# -- --rdzv-conf ------------------------------------------------------------------------------


def _params(backend: str = "c10d", **config: str) -> RendezvousParameters:
    return RendezvousParameters(backend, "localhost:0", "run", 1, 1, config=config)


def test_rdzv_conf_accepts_torchs_keys():
    settings = settings_from_params(
        _params(heartbeat_timeout="5", use_libuv="1", store_type="TCP", timeout="900")
    )
    assert settings.store_type == "tcp" and settings.join_timeout == 600.0  # c10d ignores it
    assert settings_from_params(_params("static", timeout="42")).join_timeout == 42.0
    assert (
        settings_from_params(_params("etcd", timeout="42", etcd_prefix="/p/")).etcd_prefix == "/p"
    )
    assert settings_from_params(_params("static", timeout="42", join_timeout="7")).join_timeout == 7


@pytest.mark.parametrize(
    "config, message",
    [
        ({"heartbeat_timout": "5"}, r"unknown key.*heartbeat_timout.*heartbeat_timeout"),
        ({"store_type": "redis"}, "store_type='redis' is not one of tcp, file"),
        ({"protocol": "https"}, "TLS to etcd is not supported"),
        ({"ssl_cert": "/c.pem"}, "ssl_cert: TLS"),
        ({"rank": "-1"}, "rank='-1' must be a node rank"),
        ({"timeout": "soon"}, "timeout='soon' must be a positive number"),
    ],
)
def test_rdzv_conf_errors_name_the_key(config, message):
    with pytest.raises(ValueError, match=message):
        settings_from_params(_params("static", **config))


def test_c10d_store_type_file_is_the_file_backend(tmp_path):
    worker = script(tmp_path / "w.py", "import os; print('rank', os.environ['RANK'])")
    res = run_launcher(
        [
            "--nnodes=1",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={tmp_path / 'rdzv'}",
            "--rdzv-conf=store_type=file",
            str(worker),
        ],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "rdzv").exists()


def test_agent_reads_torchruns_timer_file_only_when_enabled(monkeypatch, tmp_path):
    from distcomm.launch.agent.elastic import _timer_file

    monkeypatch.setenv("TORCHELASTIC_TIMER_FILE", str(tmp_path / "timer"))
    monkeypatch.delenv("TORCHELASTIC_ENABLE_FILE_TIMER", raising=False)
    assert _timer_file() is None  # e.g. inherited by a launcher inside a worker
    monkeypatch.setenv("TORCHELASTIC_ENABLE_FILE_TIMER", "1")
    assert _timer_file() == str(tmp_path / "timer")
