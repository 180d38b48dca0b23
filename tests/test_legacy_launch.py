"""Tests of `python -m distcomm.launch`, the legacy launcher (torch.distributed.launch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.launchjobs import kill_tree, launcher_env, records, script

pytestmark = pytest.mark.timeout(180)

_WORKER = """\
    import json, os, sys
    out = os.path.join(sys.argv[-1], f"rank{os.environ['RANK']}.json")
    with open(out, "w") as fp:
        json.dump({"argv": sys.argv[1:], "local_rank": os.environ.get("LOCAL_RANK")}, fp)
"""


def _legacy(args: list[str], cwd: Path, timeout: float = 120.0) -> subprocess.CompletedProcess:
    env = launcher_env(TMPDIR=str(cwd))
    proc = subprocess.Popen(
        [sys.executable, "-m", "distcomm.launch", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(f"{proc.args} did not finish in {timeout} s:\n{err}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_script_gets_local_rank_argument(tmp_path):
    worker = script(tmp_path / "worker.py", _WORKER)
    res = _legacy(["--nproc-per-node=2", str(worker), "--lr", "0.1", str(tmp_path)], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "distcomm-run" in res.stderr.splitlines()[0]  # the one-line legacy note
    got = {rec["local_rank"]: rec["argv"] for rec in records(tmp_path, "rank*.json")}
    # torch.distributed.launch's place: right after the script, before its own arguments
    assert got == {
        "0": ["--local-rank=0", "--lr", "0.1", str(tmp_path)],
        "1": ["--local-rank=1", "--lr", "0.1", str(tmp_path)],
    }


@pytest.mark.parametrize("flag", ["--use-env", "--use_env"])
def test_use_env_passes_no_argument(tmp_path, flag):
    worker = script(tmp_path / "worker.py", _WORKER)
    res = _legacy(["--nproc_per_node=2", flag, str(worker), str(tmp_path)], tmp_path)
    assert res.returncode == 0, res.stderr
    got = sorted((rec["local_rank"], rec["argv"]) for rec in records(tmp_path, "rank*.json"))
    assert got == [("0", [str(tmp_path)]), ("1", [str(tmp_path)])]


def test_module_gets_local_rank_argument(tmp_path):
    pkg = tmp_path / "legacy_worker_mod"
    pkg.mkdir()
    script(pkg / "__init__.py", "")
    script(pkg / "__main__.py", _WORKER)
    res = _legacy(["--nproc-per-node=1", "-m", "legacy_worker_mod", str(tmp_path)], tmp_path)
    assert res.returncode == 0, res.stderr
    [rec] = records(tmp_path, "rank*.json")
    assert rec["argv"] == ["--local-rank=0", str(tmp_path)]


def test_no_python_needs_use_env(tmp_path):
    res = _legacy(["--no-python", "true"], tmp_path, timeout=60)
    assert res.returncode == 2
    assert "--no-python needs --use-env" in res.stderr


def test_no_python_with_use_env_runs(tmp_path):
    out = tmp_path / "out.txt"
    res = _legacy(
        ["--no-python", "--use-env", "sh", "-c", f'echo "$LOCAL_RANK $#" > {out}'], tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert out.read_text().split() == ["0", "0"]


def test_torch_launch_passes_the_same_argument():
    """torch 2.13's legacy launcher builds the same argv: dashed --local-rank after the script."""
    pytest.importorskip("torch")
    from torch.distributed.launch import parse_args
    from torch.distributed.run import config_from_args

    _, _, argv = config_from_args(parse_args(["--nproc-per-node=2", "w.py", "--lr", "1"]))
    assert argv == ["-u", "w.py", "--local-rank=${local_rank}", "--lr", "1"]
    _, _, argv = config_from_args(parse_args(["--use-env", "w.py", "--lr", "1"]))
    assert argv == ["-u", "w.py", "--lr", "1"]
