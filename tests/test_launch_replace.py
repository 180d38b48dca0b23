"""distcomm-run --on-failure=replace: a failed worker is replaced alone, the others run on.

Real agents and real workers (`tests.launchjobs`), plus `WorkerProcesses.replace` and the
agent's decision (`replaceable`) on their own. The default mode (one failure restarts
every worker) is covered by test_launcher.py's restart tests.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from distcomm.launch.agent.replace import check_on_failure, replaceable
from distcomm.launch.run import config_from_args, get_args_parser, launch_config_from_args
from distcomm.launch.workers import WorkerProcesses
from tests import processes
from tests.launchjobs import alive, launcher_env, run_launcher, script, wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def no_process_left():
    """Fail a test that leaves a process it started running (and kill it)."""
    with processes.no_process_left():
        yield


#: every start appends a line to starts_<local rank>; local rank 1 dies by SIGKILL unless
#: it is a replacement (argv[2] "once") or always ("always"); a replacement records its
#: environment and exits 0; the others wait for that record ("once") or sleep ("always")
WORKER = """
    import json, os, signal, sys, time
    from pathlib import Path

    out, mode = Path(sys.argv[1]), sys.argv[2]
    local_rank = os.environ["LOCAL_RANK"]
    replacement = os.environ.get("DISTCOMM_REPLACEMENT")
    start = {
        "pid": os.getpid(),
        "rank": os.environ["RANK"],
        "restart": os.environ["DISTCOMM_RESTART_COUNT"],
        "replacement": replacement,
        "replaced_pid": os.environ.get("DISTCOMM_REPLACED_PID"),
    }
    with open(out / f"starts_{local_rank}", "a") as fp:
        fp.write(json.dumps(start) + "\\n")
    print(f"started local rank {local_rank} replacement {replacement}", flush=True)
    if local_rank == "1" and (replacement is None or mode == "always"):
        os.kill(os.getpid(), signal.SIGKILL)
    if replacement is not None:
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "DISTCOMM_USE_AGENT_STORE", "DISTCOMM_STORE_PREFIX", "DISTCOMM_RUN_ID",
                 "DISTCOMM_REPLACEMENT", "DISTCOMM_REPLACED_PID")
        record = {name: os.environ.get(name) for name in names}
        (out / "replacement.part").write_text(json.dumps(record))
        os.replace(out / "replacement.part", out / "replacement.json")
        sys.exit(0)
    if mode == "always":
        time.sleep(300)  # until the agent stops it
    deadline = time.monotonic() + 120
    while not (out / "replacement.json").exists():
        if time.monotonic() > deadline:
            sys.exit(f"local rank {local_rank}: no replacement's record after 120 s")
        time.sleep(0.05)
    (out / f"env_{local_rank}.json").write_text(json.dumps(
        {name: os.environ.get(name) for name in
         ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DISTCOMM_USE_AGENT_STORE",
          "DISTCOMM_STORE_PREFIX", "DISTCOMM_RUN_ID", "DISTCOMM_REPLACEMENT",
          "DISTCOMM_REPLACED_PID")}))
"""


def _starts(out: Path, local_rank: int) -> list[dict]:
    path = out / f"starts_{local_rank}"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _all_pids(out: Path, nproc: int) -> list[int]:
    return [start["pid"] for lr in range(nproc) for start in _starts(out, lr)]


def test_a_killed_worker_is_replaced_and_the_others_run_on(tmp_path):
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    worker = script(tmp_path / "worker.py", WORKER)
    # an agent started inside a replacement: its own workers are no replacements
    env = launcher_env(DISTCOMM_REPLACEMENT="7", DISTCOMM_REPLACED_PID="1")
    res = run_launcher(
        [
            "--standalone",
            "--nproc-per-node=3",
            "--on-failure=replace",
            "--tee=3",
            f"--log-dir={logs}",
            str(worker),
            str(out),
            "once",
        ],
        tmp_path,
        env=env,
        timeout=180,
    )
    try:
        assert res.returncode == 0, res.stderr
        survivors = {lr: _starts(out, lr) for lr in (0, 2)}
        assert all(len(starts) == 1 for starts in survivors.values()), survivors
        assert all(s[0]["replacement"] is None for s in survivors.values()), survivors
        dead, new = _starts(out, 1)  # started twice: the worker, then its replacement
        assert dead["replacement"] is None and dead["replaced_pid"] is None
        assert new["replacement"] == "1" and new["replaced_pid"] == str(dead["pid"])
        assert new["rank"] == dead["rank"] == "1" and new["restart"] == dead["restart"] == "0"

        seen = json.loads((out / "replacement.json").read_text())
        assert seen["DISTCOMM_REPLACEMENT"] == "1"
        assert seen["DISTCOMM_REPLACED_PID"] == str(dead["pid"])
        assert (seen["RANK"], seen["LOCAL_RANK"], seen["WORLD_SIZE"]) == ("1", "1", "3")
        peer = json.loads((out / "env_0.json").read_text())
        for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DISTCOMM_USE_AGENT_STORE"):
            assert seen[name] == peer[name], name  # the same group, the same agent store
        for name in ("DISTCOMM_STORE_PREFIX", "DISTCOMM_RUN_ID"):
            assert seen[name] == peer[name], name
        for lr in (0, 2):
            record = json.loads((out / f"env_{lr}.json").read_text())
            assert record["DISTCOMM_REPLACEMENT"] is None, record
            assert record["DISTCOMM_REPLACED_PID"] is None, record

        # the agent named the dead worker; its output went through the same machinery
        said = f"worker local rank 1 (rank 1, pid {dead['pid']}) failed: signal SIGKILL"
        assert said in res.stderr, res.stderr
        assert "[default1]:started local rank 1 replacement 1" in res.stdout, res.stdout
        (attempt,) = logs.glob("*/attempt_0")
        assert "replacement None" in (attempt / "1" / "stdout.log").read_text()
        replaced = attempt / "1" / "replacement_1" / "stdout.log"
        assert "started local rank 1 replacement 1" in replaced.read_text()
        assert not list(logs.glob("*/attempt_1"))  # no restart
        assert alive(_all_pids(out, 3)) == []
    finally:
        assert alive(_all_pids(out, 3)) == []


@pytest.mark.parametrize("max_restarts", [0, 1])
def test_replacements_used_up_fall_back_to_the_restart_policy(tmp_path, max_restarts):
    """Local rank 1 always dies: once replaced, then its replacement's failure restarts
    every worker while --max-restarts allows, and past it fails the run with the report."""
    out = tmp_path / "out"
    out.mkdir()
    worker = script(tmp_path / "worker.py", WORKER)
    res = run_launcher(
        [
            "--standalone",
            "--nproc-per-node=3",
            "--on_failure=replace",
            "--max_replacements=1",
            f"--max-restarts={max_restarts}",
            "--shutdown-timeout=10",
            str(worker),
            str(out),
            "always",
        ],
        tmp_path,
        timeout=180,
    )
    try:
        assert res.returncode == 1, res.stderr
        starts = _starts(out, 1)
        assert [s["replacement"] for s in starts] == [None, "1"] + [None] * max_restarts
        # round 0: the worker and its one replacement; then one start per restart
        assert [s["restart"] for s in starts] == ["0", "0"] + [
            str(r + 1) for r in range(max_restarts)
        ]
        assert starts[1]["replaced_pid"] == str(starts[0]["pid"])
        for lr in (0, 2):  # the survivors run on a replacement, restart with the group
            assert [s["restart"] for s in _starts(out, lr)] == [
                str(r) for r in range(max_restarts + 1)
            ]
        err = res.stderr
        assert "FAILED" in err and "Root Cause" in err, err
        root = err[err.index("Root Cause") :]
        assert "rank      : 1 (local_rank: 1)" in root and "SIGKILL" in root, root
        assert f"pid       : {starts[-1]['pid']}" in root, root
        assert "replaced (--on_failure=replace)" in err and str(starts[0]["pid"]) in err
    finally:
        assert alive(_all_pids(out, 3)) == []


# -- flags -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--on-failure", "foo"], {}, "invalid choice: 'foo'"),
        (["--max-replacements", "-1"], {}, "--max_replacements must be a whole number >= 0"),
        (["--max_replacements=two"], {}, "invalid int value: 'two'"),
        ([], {"DISTCOMM_ON_FAILURE": "foo"}, "--on_failure='foo' is not one of restart, replace"),
        ([], {"PET_MAX_REPLACEMENTS": "-3"}, "--max_replacements must be a whole number"),
    ],
)
def test_bad_values_are_refused_with_the_flag_named(tmp_path, args, env, message):
    res = run_launcher([*args, "x.py"], tmp_path, env=launcher_env(**env), timeout=60)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_flags_spellings_environment_and_defaults(monkeypatch):
    for name in ("DISTCOMM_ON_FAILURE", "DISTCOMM_MAX_REPLACEMENTS", "PET_ON_FAILURE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("PET_MAX_REPLACEMENTS", raising=False)
    parse = get_args_parser().parse_args
    default = config_from_args(parse(["x.py"]))
    assert (default.on_failure, default.max_replacements) == ("restart", 3)
    for flags in (
        ["--on-failure=replace", "--max-replacements=5"],
        ["--on_failure", "replace", "--max_replacements", "5"],
    ):
        config = config_from_args(parse([*flags, "x.py"]))
        assert (config.on_failure, config.max_replacements) == ("replace", 5)
    monkeypatch.setenv("PET_ON_FAILURE", "replace")
    monkeypatch.setenv("DISTCOMM_MAX_REPLACEMENTS", "0")
    config = config_from_args(get_args_parser().parse_args(["x.py"]))
    assert (config.on_failure, config.max_replacements) == ("replace", 0)
    config = config_from_args(get_args_parser().parse_args(["--on-failure=restart", "x.py"]))
    assert config.on_failure == "restart"  # the command line wins
    # torch's LaunchConfig has no field for the mode: refused, not dropped
    with pytest.raises(ValueError, match="--on_failure=replace has no LaunchConfig field"):
        launch_config_from_args(get_args_parser().parse_args(["x.py"]))


def test_help_describes_the_mode(tmp_path):
    res = run_launcher(["--help"], tmp_path, timeout=60)
    assert res.returncode == 0
    text = " ".join(res.stdout.split())
    assert "--on-failure {restart,replace}" in text and "--max-replacements" in text
    assert "DISTCOMM_REPLACEMENT" in text and "DISTCOMM_REPLACED_PID" in text


def test_check_on_failure():
    assert check_on_failure("replace", "2") == ("replace", 2)
    assert check_on_failure("restart", 0) == ("restart", 0)
    names = ("LaunchConfig.on_failure", "LaunchConfig.max_replacements")
    with pytest.raises(ValueError, match=r"^LaunchConfig.on_failure='Replace' is not one of"):
        check_on_failure("Replace", 1, names)
    for bad in (-1, "1.5", True, None):
        with pytest.raises(ValueError, match="--max_replacements must be a whole number"):
            check_on_failure("replace", bad)


# -- the decision, and WorkerProcesses.replace -------------------------------------------------


def test_replaceable_decides_from_exit_codes_and_what_is_left():
    assert replaceable({0: None, 1: -9, 2: None}, 3) == [1]
    assert replaceable({0: None, 1: 1, 2: 0}, 1) == [1]  # another still runs
    assert replaceable({0: 2, 1: -9, 2: None}, 2) == [0, 1]
    assert replaceable({0: 2, 1: -9, 2: None}, 1) == []  # more failures than left: restart
    assert replaceable({0: None, 1: -9}, 0) == []  # none left: restart
    assert replaceable({0: 0, 1: -9}, 3) == []  # no other worker runs: restart
    assert replaceable({0: -9}, 3) == []
    assert replaceable({0: None, 1: None}, 3) == []
    assert replaceable({0: 0, 1: 0}, 3) == []


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_worker_processes_replace_one_slot(tmp_path):
    """The replacement gets the slot's environment plus the extra variables and files of its
    own; the dead worker's orphan child is killed; stop() ends and reaps everyone."""
    child_file = tmp_path / "child"
    dying = textwrap.dedent(
        f"""
        import os, subprocess, sys
        if os.environ.get("EXTRA") is None:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            open({str(child_file)!r}, "w").write(str(child.pid))
            sys.exit(3)
        print("replacement", os.environ["SLOT"], os.environ["EXTRA"], flush=True)
        """
    )
    sleeper = "import time; time.sleep(120)"
    workers = WorkerProcesses(
        {0: [sys.executable, "-c", sleeper], 1: [sys.executable, "-c", dying]},
        {lr: {**os.environ, "SLOT": str(lr)} for lr in (0, 1)},
        log_dir=str(tmp_path / "logs"),
        redirects={1: 3},  # type: ignore[dict-item]
        tee={},
        console_ranks=None,
        prefixes={},
    )
    with workers:
        workers.start()
        first = workers.pids()
        _wait(lambda: workers.poll()[1] == 3, 30, "local rank 1 to exit 3")
        orphan = int(child_file.read_text())
        assert alive([orphan]) == [orphan]
        with pytest.raises(RuntimeError, match="still runs"):
            workers.replace(0, {}, "replacement_1")
        pid = workers.replace(1, {"EXTRA": "x"}, "replacement_1")
        assert workers.pids() == {0: first[0], 1: pid} and pid != first[1]
        wait_for(lambda: not alive([orphan]), 30, "the dead worker's child to be killed")
        _wait(lambda: workers.poll()[1] == 0, 30, "the replacement to exit 0")
        assert workers.poll()[0] is None and workers.exit_time(0) is None
        rank_dir = tmp_path / "logs" / "1"
        assert workers.log_files(1)["stdout"] == str(rank_dir / "replacement_1" / "stdout.log")
        assert workers.error_file(1) == str(rank_dir / "replacement_1" / "error.json")
        assert (rank_dir / "replacement_1" / "stdout.log").read_text() == "replacement 1 x\n"
        assert (rank_dir / "stdout.log").read_text() == ""  # the dead worker's, kept
        workers.stop(grace=5)
        assert workers.poll()[0] == -signal.SIGTERM
        with pytest.raises(RuntimeError, match="only while the others run"):
            workers.replace(1, {}, "replacement_2")
    assert alive([first[0], first[1], pid, orphan]) == []
