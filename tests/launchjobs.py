"""Helpers for launcher tests: run distcomm-run agents as real processes, write worker scripts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from tests.harness import LOOPBACK_ENV

REPO = Path(__file__).resolve().parent.parent


def launcher_env(**extra: str) -> dict[str, str]:
    """The environment an agent runs with in the tests: loopback only, no inherited job."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DISTCOMM_", "TORCHELASTIC_", "PET_"))
        and k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "OMP_NUM_THREADS",
        )
    }
    env.update(
        {k: v for k, v in LOOPBACK_ENV.items() if k not in ("MASTER_ADDR", "OMP_NUM_THREADS")}
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def agent(
    args: list[str],
    cwd: Path,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    **popen: object,
) -> subprocess.Popen:
    """Start `python -m distcomm.run ARGS` (an agent) without waiting for it.

    Its temporary files go under `cwd` (TMPDIR), so an agent a test kills with SIGKILL
    leaves nothing in the system's /tmp. With `log`, its stdout and stderr go to that
    file, which a test can read while the agent runs (`finish` returns it as stderr).
    """
    env = dict(env or launcher_env())
    env.setdefault("TMPDIR", str(cwd))
    command = [sys.executable, "-m", "distcomm.run", *args]
    if log is None:
        return subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **popen,
        )  # type: ignore[call-overload]
    with open(log, "ab") as sink:
        proc = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT, **popen
        )  # type: ignore[call-overload]
    proc.log_path = log  # type: ignore[attr-defined]
    return proc


def agent_here(monkeypatch, tmp_path: Path, **extra: str) -> None:
    """For a test whose agent runs in its own process: the launcher tests' environment
    (`launcher_env(**extra)`, nothing else) and `tmp_path` as the temporary directory."""
    import tempfile

    wanted = launcher_env(**extra)
    for name in list(os.environ):
        if name not in wanted:
            monkeypatch.delenv(name)
    for name, value in wanted.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def run_launcher(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 120.0
) -> subprocess.CompletedProcess:
    """Run one agent to the end; its exit status and output (the agent is killed on timeout)."""
    proc = agent(args, cwd, env)
    code, out, err = finish(proc, timeout)
    return subprocess.CompletedProcess(proc.args, code, out, err)


def finish(proc: subprocess.Popen, timeout: float = 120.0) -> tuple[int, str, str]:
    """Wait for an agent started with `agent`; (status, stdout, stderr)."""
    log = getattr(proc, "log_path", None)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        if log is not None:
            out, err = "", log.read_text(errors="replace")
        raise AssertionError(
            f"agent {proc.args} did not finish in {timeout} s:\nstdout:\n{out}\nstderr:\n{err}"
        ) from None
    if log is not None:
        out, err = "", log.read_text(errors="replace")
    return proc.returncode, out, err


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (test cleanup)."""
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def script(path: Path, body: str) -> Path:
    """Write a worker script (dedented) and return its path."""
    path.write_text(textwrap.dedent(body))
    return path


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1) -> None:
    """Poll `predicate` until it is true; AssertionError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def records(directory: Path, pattern: str = "*.json") -> list[dict]:
    """Every JSON record the workers wrote into `directory`."""
    return [json.loads(p.read_text()) for p in sorted(directory.glob(pattern))]


def alive(pids: list[int]) -> list[int]:
    """The pids of `pids` that still run (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out
