"""The Python launch API (torch's launcher.api) and distcomm.run's run(args)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import pytest

from distcomm.launch.api import LaunchConfig, elastic_launch, launch_agent
from distcomm.launch.errors import ChildFailedError
from distcomm.launch.logs_specs import DefaultLogsSpecs
from distcomm.run import get_args_parser, run
from tests.launchjobs import agent_here, script

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    """The agent runs in this process: the launcher tests' environment and temp dir."""
    agent_here(monkeypatch, tmp_path)


def _config(**kwargs: object) -> LaunchConfig:
    options: dict[str, object] = {
        "min_nodes": 1,
        "max_nodes": 1,
        "nproc_per_node": 2,
        "rdzv_backend": "c10d",
        "rdzv_endpoint": "localhost:0",
        "max_restarts": 0,
        "monitor_interval": 0.05,
    }
    options.update(kwargs)
    return LaunchConfig(**options)  # type: ignore[arg-type]


def times_ten(offset: int) -> int:
    return int(os.environ["RANK"]) * 10 + offset


def fail_on_rank_one() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank one refuses")


def fail_first_attempt() -> str:
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise RuntimeError("first attempt fails")
    return f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}"


def job_key() -> str:
    return os.environ.get("DISTCOMM_AUTH_KEY", "")


def test_a_one_node_job_has_its_own_key_and_leaves_this_environment_alone():
    assert "DISTCOMM_AUTH_KEY" not in os.environ
    first = elastic_launch(_config(), job_key)()
    second = elastic_launch(_config(rdzv_backend="static", rdzv_endpoint="localhost:0"), job_key)()
    assert first[0] and first[0] == first[1], first
    assert second[0] and second[0] == second[1] and second[0] != first[0], second
    assert "DISTCOMM_AUTH_KEY" not in os.environ


def test_function_results_by_global_rank():
    assert elastic_launch(_config(), times_ten)(0) == {0: 0, 1: 10}
    assert launch_agent(_config(nproc_per_node=3), times_ten, [1]) == {0: 1, 1: 11, 2: 21}


def test_elastic_launch_leaves_a_configured_logging_alone(caplog):
    """A program whose logging is configured (here pytest's handler on the root logger)
    still gets the launcher's records after an in-process launch: the agent adds its own
    stderr handler, which stops propagation, only where nothing else would show them."""
    assert elastic_launch(_config(), times_ten)(1) == {0: 1, 1: 11}
    logging.getLogger("distcomm.launch.workers").warning("still heard after the launch")
    assert "still heard after the launch" in caplog.text


def test_raising_function_gives_child_failed_error_naming_the_rank():
    with pytest.raises(ChildFailedError) as info:
        elastic_launch(_config(), fail_on_rank_one)()
    error = info.value
    assert set(error.failures) == {1}
    rank, failure = error.get_first_failure()
    assert rank == 1 and "ValueError: rank one refuses" in failure.message
    assert "fail_on_rank_one" in error.format_msg()


def test_command_entrypoint(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    code = "import os, sys; open(os.path.join(sys.argv[1], sys.argv[2]), 'w').close()"
    result = elastic_launch(_config(), sys.executable)("-c", code, str(out), "w${local_rank}")
    assert result == {0: None, 1: None}
    assert sorted(p.name for p in out.iterdir()) == ["w0", "w1"]
    with pytest.raises(ChildFailedError) as info:
        elastic_launch(_config(), sys.executable)("-c", "raise SystemExit(3)")
    assert {f.exitcode for f in info.value.failures.values()} == {3}


def test_max_restarts_retries_the_group():
    assert elastic_launch(_config(max_restarts=1), fail_first_attempt)() == {
        0: "attempt 1",
        1: "attempt 1",
    }
    with pytest.raises(ChildFailedError):
        elastic_launch(_config(max_restarts=0), fail_first_attempt)()


def test_tee_and_log_dir_through_logs_specs(tmp_path, capfd):
    logs = tmp_path / "logs"
    specs = DefaultLogsSpecs(log_dir=str(logs), tee={0: 1})
    code = "print('line from', __import__('os').environ['RANK'])"
    elastic_launch(_config(logs_specs=specs), sys.executable)("-c", code)
    out = capfd.readouterr().out
    assert "[default_role0]:line from 0" in out  # LaunchConfig's role is torch's default_role
    (log,) = logs.glob("*/attempt_0/0/stdout.log")
    assert log.read_text() == "line from 0\n"


def test_bad_configs_are_named():
    with pytest.raises(ValueError, match="nproc_per_node"):
        launch_agent(_config(nproc_per_node=0), times_ten, [0])
    with pytest.raises(ValueError, match="min_nodes"):
        launch_agent(_config(min_nodes=2, max_nodes=1), times_ten, [0])
    with pytest.raises(ValueError, match=r"known ones are .*console.*null"):
        launch_agent(_config(event_log_handler="nosuch"), times_ten, [0])
    with pytest.raises(ValueError, match="shutdown_timeout"):
        _config(shutdown_timeout=-1)
    with pytest.raises(ValueError, match="needs rdzv_endpoint='HOST:PORT'"):
        launch_agent(_config(rdzv_backend="static", rdzv_endpoint=""), times_ten, [0])
    with pytest.raises(TypeError, match="pickled"):
        launch_agent(_config(), lambda: None, [])


def test_static_backend_and_rdzv_timeout():
    config = _config(rdzv_backend="static", rdzv_endpoint="127.0.0.1:0", rdzv_timeout=30)
    assert config.rdzv_configs["timeout"] == 30
    assert elastic_launch(config, times_ten)(5) == {0: 5, 1: 15}
    assert _config().rdzv_configs["timeout"] == 900  # torch's default, added as torch does


def test_launch_config_matches_torch():
    api = pytest.importorskip("torch.distributed.launcher.api")
    ours = {f.name: f for f in dataclasses.fields(LaunchConfig)}
    theirs = {f.name: f for f in dataclasses.fields(api.LaunchConfig)}
    assert list(ours) == list(theirs)
    for name, field in theirs.items():
        if field.default is not dataclasses.MISSING:
            assert ours[name].default == field.default, name
        elif field.default_factory is not dataclasses.MISSING:
            assert ours[name].default_factory() == field.default_factory(), name


def test_run_args_succeeds_and_raises_like_torch(tmp_path):
    good = script(tmp_path / "good.py", "import os; assert os.environ['WORLD_SIZE'] == '2'")
    bad = script(
        tmp_path / "bad.py",
        """
        import os
        from distcomm.launch.errors import record

        @record
        def main():
            if os.environ["RANK"] == "0":
                raise KeyError("rank zero broke")

        main()
        """,
    )
    assert run(get_args_parser().parse_args(["--nproc-per-node=2", str(good)])) is None
    with pytest.raises(ChildFailedError) as info:
        run(get_args_parser().parse_args(["--nproc-per-node=2", str(bad)]))
    assert set(info.value.failures) == {0}
    assert "rank zero broke" in info.value.get_first_failure()[1].message


def test_run_args_error_keeps_the_stderr_tail_of_removed_logs(tmp_path):
    """ChildFailedError is raised after the agent removed its temporary directory: the
    report still has the tail of the worker's stderr log and names none of its files."""
    bad = script(tmp_path / "bad.py", "raise SystemExit('stopped: no data in shard 3')")
    with pytest.raises(ChildFailedError) as info:
        run(get_args_parser().parse_args(["--nproc-per-node=1", "--redirects=2", str(bad)]))
    (failure,) = info.value.failures.values()
    assert not failure.files_kept and not os.path.exists(failure.log_files["stderr"])
    text = str(info.value)
    assert "stopped: no data in shard 3" in text
    assert failure.log_files["stderr"] not in text and "error_file: <N/A>" in text
