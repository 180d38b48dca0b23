"""Replacements that die while joining never take the survivors down (issue 48, defect 2).

Slot 2 of four SIGKILLs itself; the three survivors go on, and from half-way on they keep
voting every step down (tests/recovery_job.py's HOLD_UNTIL) until the replacement that
lives is in the world, so they keep taking newcomers in without finishing. Replacements
SIGKILL themselves at each stage of joining (before registering, right after, once a
member list named them, after acknowledging it, while connecting), or are SIGKILLed by
this test after random delays (a crash loop); then a live one is started. Every survivor
must end, with the live one, at 4 ranks and with the reference weights bit for bit.

Real processes and signals; the workers are coordinated through files and the job's store,
and the tests assert results (weights, sizes, ranks, exit signals), never durations.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from .recovery_jobs import jobs, same_weights, wait_for_file

pytestmark = pytest.mark.timeout(900)

STEPS = "40"
#: one re-forming attempt's bound in the workers: generous (two cores, other tests), and
#: what an attempt costs when a replacement dies while connecting
REFORM_TIMEOUT = "30"


@pytest.fixture
def job_factory():
    with jobs() as make:
        yield make


def _survivors_after_losing_slot_2(job_factory, tmp_path):
    """Four workers of which slot 2 SIGKILLs itself at step 5; returns (job, survivors,
    the file the live replacement creates once it is in)."""
    back = tmp_path / "replacement-in"
    job = job_factory(
        4,
        "tcp",
        STEPS=STEPS,
        STOP_FILE=str(tmp_path / "victim-died"),
        HOLD_UNTIL=str(back),
        REFORM_TIMEOUT=REFORM_TIMEOUT,
        SHRUNK=str(tmp_path / "shrunk"),
    )
    survivors = [job.start("member", r) for r in (0, 1, 3)]
    victim = job.start("victim", 2, VICTIM="1")
    assert victim.wait(180) == -signal.SIGKILL
    return job, survivors, back


def _the_live_one_is_taken_in(job, survivors, back) -> None:
    # it comes once the survivors went on at 3 (else their re-forming could take it in
    # before they ever commit a step at 3)
    shrunk = Path(job.env["SHRUNK"])
    wait_for_file(shrunk, 300, "the survivors committing a step at 3", survivors)
    live = job.start("newcomer", 2, MARK_BACK=str(back))
    results = job.results([*survivors, live], timeout=600)
    same_weights(results, int(STEPS))
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3], results
    assert all(r["size"] == 4 for r in results), results
    assert results[-1]["rank"] == 3  # the replacement comes after the members
    for survivor in results[:3]:
        assert {3, 4} <= set(survivor["sizes"]), survivor  # went on at 3, back to 4


STAGES = ["before-registering", "registered", "named", "acknowledged", "connecting"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_replacement_killed_while_joining_is_left_out(job_factory, tmp_path, stage):
    job, survivors, back = _survivors_after_losing_slot_2(job_factory, tmp_path)
    doomed = job.start("newcomer", 2, DIE_AT=stage)
    assert doomed.wait(600) == -signal.SIGKILL, doomed.communicate()[1][-3000:]
    _the_live_one_is_taken_in(job, survivors, back)


@pytest.mark.parametrize("stage", ["registered", "named"])
def test_a_replacement_on_another_host_that_never_answers_is_left_out(job_factory, tmp_path, stage):
    """Its init handle names another host, so the members cannot see that its process
    ended: it is left out because it does not acknowledge the list that names it."""
    job, survivors, back = _survivors_after_losing_slot_2(job_factory, tmp_path)
    doomed = job.start("newcomer", 2, DIE_AT=stage, ELSEWHERE="1")
    assert doomed.wait(600) == -signal.SIGKILL, doomed.communicate()[1][-3000:]
    _the_live_one_is_taken_in(job, survivors, back)


def test_a_crash_loop_of_replacements_never_takes_the_survivors_down(job_factory, tmp_path):
    """Four rounds of one or two replacements SIGKILLed after random delays: some from
    their start (before or while they register), most from their registering on (while
    they wait, while a list names them, while they connect, once they are in); then one
    that lives."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    job, survivors, back = _survivors_after_losing_slot_2(job_factory, tmp_path)
    for _ in range(4):
        count = job.registered()
        doomed = [job.start("newcomer", 2) for _ in range(rng.choice((1, 1, 2)))]
        if rng.random() < 0.25:
            time.sleep(rng.uniform(0.0, 1.5))  # from its start
        else:
            deadline = time.monotonic() + 120
            while job.registered() <= count:  # from its registering
                assert time.monotonic() < deadline, f"seed {seed}: no replacement registered"
                assert all(p.poll() is None for p in doomed), f"seed {seed}: one ended"
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.4))
        for proc in doomed:
            proc.kill()
            time.sleep(rng.uniform(0.0, 0.2))
        for proc in doomed:
            assert proc.wait(60) == -signal.SIGKILL, f"seed {seed}"
        for proc in survivors:
            assert proc.poll() is None, f"seed {seed}: a survivor ended ({proc.returncode})"
    try:
        _the_live_one_is_taken_in(job, survivors, back)
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}: {exc}") from exc
