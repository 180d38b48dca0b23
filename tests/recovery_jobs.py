"""What the multi-process recovery tests share: a job of tests/recovery_job.py workers
around a store the test hosts (as distcomm-run's agent hosts it, so it outlives any
worker), its fixture (nothing left running afterwards), and the checks of its results."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from distcomm.store import TCPStore

from .processes import no_process_left

__all__ = ["JOB", "Job", "jobs", "same_weights", "wait_for_file", "wait_for_newcomers"]

JOB = str(Path(__file__).with_name("recovery_job.py"))


class Job:
    """Workers of tests/recovery_job.py around a store this test hosts."""

    def __init__(self, world_size: int, backend: str, **env: str) -> None:
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.store.port),
            "WORLD_SIZE": str(world_size),
            "DISTCOMM_USE_AGENT_STORE": "1",
            "BACKEND": backend,
            "PYTHONUNBUFFERED": "1",
            **env,
        }
        self.procs: list[subprocess.Popen] = []

    def start(self, scenario: str, rank: int, **env: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, JOB, scenario],
            env={**self.env, "RANK": str(rank), **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        return proc

    def results(self, procs: list[subprocess.Popen], timeout: float = 180.0) -> list[dict]:
        found = []
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, (
                f"worker failed ({proc.returncode}):\n{err[-3000:]}"
            )
            found.append(json.loads(lines[-1][7:]))
        return found

    def registered(self) -> int:
        """How many newcomers registered in the job's store so far (membership's count)."""
        return int(self.store.add("distcomm/m/0/newcomers", 0))

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        self.store.close()


@contextlib.contextmanager
def jobs() -> Iterator[Callable[..., Job]]:
    """A maker of Jobs (`make(world_size, backend, **env)`) whose workers are all ended
    when the block ends; fails when one is left running (a test's `job_factory`)."""
    made: list[Job] = []

    def make(world_size: int, backend: str, **env: str) -> Job:
        made.append(Job(world_size, backend, **env))
        return made[-1]

    with no_process_left():
        try:
            yield make
        finally:
            for job in made:
                job.close()


def same_weights(results: list[dict], steps: int) -> None:
    """Every worker ran `steps` steps and holds the reference weights, bit for bit."""
    expected = [steps * (steps + 1) / 2] * 4  # the sum of every step's (step + 1)
    for result in results:
        assert result["steps"] == steps
        assert result["w"] == expected, result


def _wait(done: Callable[[], bool], timeout: float, what: str, watched: list) -> None:
    """Wait until `done()`; fail saying `what` did not happen when it is not within
    `timeout` s, or when one of `watched` (processes) ended first (with its output)."""
    deadline = time.monotonic() + timeout
    while not done():
        for proc in watched:
            if proc.poll() is not None:
                _, err = proc.communicate()
                pytest.fail(f"{what}: a worker ended first ({proc.returncode}):\n{err[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.05)


def wait_for_file(path: Path, timeout: float, what: str, watched: list[subprocess.Popen]) -> None:
    """Wait until a worker creates `path`; fail saying `what` did not happen when it does
    not within `timeout` s, or when one of `watched` ended first (with its output)."""
    _wait(path.exists, timeout, what, watched)


def wait_for_newcomers(
    job: Job, count: int, timeout: float, what: str, watched: list[subprocess.Popen]
) -> None:
    """Wait until `count` newcomers registered in `job`'s store; fail saying `what` did not
    happen when they did not within `timeout` s, or when one of `watched` ended first."""
    _wait(lambda: job.registered() >= count, timeout, what, watched)
