"""distcomm.run behaves as torch.distributed.run (torch's test/distributed/launcher/test_run.py).

The Python API raises (`ChildFailedError` for a failed job, `ValueError` for a bad flag
value, argparse's `SystemExit(2)` for an unknown or mistyped flag); the command
(``python -m distcomm.run``) reports and exits with a status. Jobs run 1-2 real workers.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

import distcomm.run as launch
from distcomm.launch import api, flag_values
from distcomm.launch.api import LaunchConfig, elastic_launch
from distcomm.launch.errors import ChildFailedError
from tests.launchjobs import agent_here, run_launcher, script
from tests.processes import free_port

pytestmark = pytest.mark.timeout(240)

#: what torch's bin/test_script.py reads in every worker (TEST_SENTINEL_PARENT: inherited)
TORCH_WORKER_ENV = [
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "OMP_NUM_THREADS",
    "TEST_SENTINEL_PARENT",
    "TORCHELASTIC_ERROR_FILE",
]

ENV_SCRIPT = f"""
import json, os, sys
names = {TORCH_WORKER_ENV!r}
with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as fp:
    json.dump({{name: os.environ.get(name) for name in names}}, fp)
"""

FAILING_SCRIPT = """
import os
from distcomm.launch.errors import record

@record
def main():
    if os.environ["RANK"] == "1":
        raise RuntimeError("raising since rank 1 was told to fail")

main()
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    """The agent runs in this process: the launcher tests' environment and temp dir."""
    agent_here(monkeypatch, tmp_path, TEST_SENTINEL_PARENT="FOOBAR")


def _out(tmp_path):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return out


# cause 3: main() and run() raise as torch's; the command reports and exits with a status


def test_main_returns_none_and_workers_see_torchs_environment(tmp_path):
    out = _out(tmp_path)
    body = script(tmp_path / "env.py", ENV_SCRIPT)
    port = free_port()
    args = ["--nnodes=1", "--nproc-per-node=2", "--master-addr=localhost", f"--master-port={port}"]
    assert launch.main([*args, "--node-rank=0", str(body), str(out)]) is None
    seen = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(seen) == ["0", "1"]
    for rank, env in seen.items():
        assert [name for name in TORCH_WORKER_ENV if env[name] is None] == [], rank
        assert env["RANK"] == rank and env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_PORT"] == str(port) and env["TEST_SENTINEL_PARENT"] == "FOOBAR"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"


def test_main_raises_child_failed_error_and_records_it(tmp_path, monkeypatch):
    """torch's main is @record: under an outer launcher the root cause reaches its file."""
    bad = script(tmp_path / "bad.py", FAILING_SCRIPT)
    outer = tmp_path / "outer_error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(outer))
    with pytest.raises(ChildFailedError) as info:
        launch.main(["--nproc-per-node=2", "--max-restarts=0", "--monitor-interval=0.1", str(bad)])
    rank, failure = info.value.get_first_failure()
    assert set(info.value.failures) == {1} and rank == 1
    assert "told to fail" in failure.message
    assert "told to fail" in json.loads(outer.read_text())["message"]["message"]


def test_an_exception_of_the_agent_reaches_the_caller_unchanged(tmp_path, monkeypatch):
    class AgentBroke(Exception):
        pass

    def broken_run(self):
        raise AgentBroke("the agent broke")

    monkeypatch.setattr(api.ElasticAgent, "run", broken_run)
    good = script(tmp_path / "good.py", "pass")
    with pytest.raises(AgentBroke, match="the agent broke"):
        launch.main(["--nproc-per-node=1", str(good)])


def test_bad_flag_values_raise_value_error_and_argparse_errors_exit_2(tmp_path, monkeypatch):
    good = str(script(tmp_path / "good.py", "pass"))
    cases = [
        (["--no-python", "--module"], "--no_python and -m/--module"),
        (["--nproc-per-node=unknown"], "--nproc_per_node='unknown'"),
        (["--logs-specs=DOESNOT_EXIST"], "DOESNOT_EXIST"),
        (["--nnodes=2:20:30"], "--nnodes='2:20:30'"),
        (["--rdzv-conf=join_timeout="], "join_timeout"),
    ]
    for flags, named in cases:
        with pytest.raises(ValueError, match=named):
            launch.main([*flags, good])
    monkeypatch.setenv("PET_NO_PYTHON", "1")
    monkeypatch.setenv("PET_MODULE", "1")
    with pytest.raises(ValueError, match="--module"):
        launch.main([good])
    monkeypatch.delenv("PET_NO_PYTHON")
    monkeypatch.delenv("PET_MODULE")
    for flags in (["--max-restarts=x"], ["--no-such-flag"], []):
        with pytest.raises(SystemExit) as info:
            launch.main([*flags, good] if flags else [])
        assert info.value.code == 2


def test_parse_min_max_nnodes_is_torchs():
    assert launch.parse_min_max_nnodes("1") == (1, 1)
    assert launch.parse_min_max_nnodes("2:20") == (2, 20)
    for bad in ("2:20:30", "x", "1:y"):
        with pytest.raises(RuntimeError):  # torch's type for a malformed value
            launch.parse_min_max_nnodes(bad)
        with pytest.raises(ValueError):  # ours, as for every bad flag value
            launch.parse_min_max_nnodes(bad)


def test_the_command_reports_and_exits_with_a_status(tmp_path):
    bad = script(tmp_path / "bad.py", "raise SystemExit(3)")
    res = run_launcher(["--nproc-per-node=1", str(bad)], tmp_path)
    assert res.returncode != 0
    assert "bad.py FAILED" in res.stderr and "exitcode  : 3" in res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    res = run_launcher(["--nproc-per-node=unknown", str(bad)], tmp_path)
    assert res.returncode == 2
    assert (
        "error: Unsupported nproc_per_node value: unknown. --nproc_per_node='unknown'" in res.stderr
    )
    assert "Traceback" not in res.stderr, res.stderr


def test_quoted_rdzv_conf_and_an_elastic_range_run(tmp_path):
    """torch's test passes --rdzv-conf='...' in an argument list, quotes and all."""
    assert flag_values.parse_rdzv_conf("'join_timeout=5,last_call_timeout=1'") == {
        "join_timeout": "5",
        "last_call_timeout": "1",
    }
    out = _out(tmp_path)
    body = script(tmp_path / "env.py", ENV_SCRIPT)
    launch.main(
        [
            "--nnodes=1:2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=localhost:{free_port()}",
            "--rdzv-conf='join_timeout=20,last_call_timeout=1,timeout=20'",
            "--rdzv-id=port-run",
            str(body),
            str(out),
        ]
    )
    assert sorted(p.stem for p in out.glob("*.json")) == ["0"]


# the rest of torch.distributed.run's public functions


def test_helpers_match_torchs(tmp_path, monkeypatch):
    args = launch.parse_args(["--nproc-per-node=2", "train.py"])
    assert launch.get_use_env(args) is True
    args.use_env = False  # the legacy launcher's flag
    assert launch.get_use_env(args) is False
    assert launch.get_rdzv_endpoint(args) == "127.0.0.1:0"  # one node: a free port
    args = launch.parse_args(["--nnodes=2", "--master-addr=head", "--master-port=1234", "t.py"])
    assert launch.get_rdzv_endpoint(args) == "head:1234"
    args = launch.parse_args(["--rdzv-backend=c10d", "--rdzv-endpoint=h:5", "t.py"])
    assert launch.get_rdzv_endpoint(args) == "h:5"
    assert launch.determine_local_world_size("3") == 3
    assert launch.determine_local_world_size("cpu") == os.cpu_count()
    monkeypatch.setattr(flag_values, "_gpu_count", lambda: 0)
    assert launch.determine_local_world_size("auto") == os.cpu_count()

    target = script(tmp_path / "argv.py", "import sys; RESULT = list(sys.argv)")
    monkeypatch.setattr(sys, "argv", ["pytest"])
    launch.run_script_path(str(target), "--a", "1")
    assert sys.argv == [str(target), "--a", "1"]


def test_config_from_args_is_torchs_triple_for_elastic_launch(tmp_path):
    out = _out(tmp_path)
    body = script(tmp_path / "env.py", ENV_SCRIPT)
    args = launch.parse_args(["--nproc-per-node=1", "--max-restarts=0", str(body), str(out)])
    config, entrypoint, entry_args = launch.config_from_args(args)
    assert isinstance(config, LaunchConfig) and config.nproc_per_node == 1
    assert config.rdzv_backend == "static" and config.rdzv_configs["rank"] == 0
    assert (entrypoint, entry_args) == (sys.executable, ["-u", str(body), str(out)])
    assert elastic_launch(config, entrypoint)(*entry_args) == {0: None}
    assert sorted(p.stem for p in out.glob("*.json")) == ["0"]

    run_path = launch.parse_args(["--run-path", "--nproc-per-node=1", str(body), str(out)])
    config, entrypoint, entry_args = launch.config_from_args(run_path)
    assert entrypoint is launch.run_script_path and entry_args == [str(body), str(out)]
    no_python = launch.parse_args(["--no-python", "--nproc-per-node=1", "prog", "x"])
    assert launch.config_from_args(no_python)[1:] == ("prog", ["x"])
    legacy = launch.parse_args(["--nproc-per-node=1", "t.py", "x"])
    legacy.use_env = False
    assert launch.config_from_args(legacy)[2] == ["-u", "t.py", "--local-rank=${local_rank}", "x"]


# cause 11: our fuller messages carry torch's key phrase


def test_flag_messages_carry_torchs_key_phrases(monkeypatch):
    def message(fn, *args):
        with pytest.raises(ValueError) as info:
            fn(*args)
        return str(info.value)

    text = message(launch.parse_min_max_nnodes, "2:20:30")
    assert 'not in "MIN:MAX" format' in text and "1:4" in text
    text = message(launch.parse_min_max_nnodes, "4:2")
    assert "min_nodes must be > 0 and <= max_nodes" in text and "nnodes='4:2'" in text
    text = message(launch.determine_local_world_size, "unknown")
    assert "unsupported nproc_per_node value" in text.lower() and "'auto'" in text
    monkeypatch.setattr(flag_values, "_gpu_count", lambda: 0)
    text = message(launch.determine_local_world_size, "gpu")
    assert "cuda is not available" in text.lower() and "'cpu'" in text
    args = launch.parse_args(["--no-python", "--module", "t.py"])
    assert "at the same time" in message(launch.config_from_args, args)
    args = launch.parse_args(["--max-restarts=-1", "t.py"])
    assert "max_restarts must be >= 0" in message(launch.config_from_args, args)
