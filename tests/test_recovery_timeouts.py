"""The recovery Manager's own collectives are bounded (issue 48, defect 4).

A rank that stops right after its step's collectives (a GC pause, swap, a debugger, a VM
migration: here SIGSTOP) must cost the others the per-operation timeout, as it would have
had it stopped a moment earlier, not the group's 30 minutes: the vote times out, the step
is discarded and the others re-form without it and go on. Once it runs again (SIGCONT) it
finds itself out of the world, joins as a newcomer, is caught up, and every rank ends
with the reference weights bit for bit.

Real processes and signals, coordinated through files (the workers create them:
tests/recovery_job.py); the tests assert results, never durations.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import pytest

from distcomm import _calls
from distcomm.world import state

from .recovery_jobs import jobs, same_weights, wait_for_file

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def job_factory():
    with jobs() as make:
        yield make


class _Group:
    """What op_timeout reads of a group."""

    timeout = timedelta(seconds=60)
    group_name = "probe"


def _records_op_timeouts() -> bool:
    """Whether a call's timeout= is recorded where the Manager's default reads it
    (world.state.last_op_timeout, written by distcomm._calls.op_timeout)."""
    before = getattr(state, "last_op_timeout", None)
    try:
        _calls.op_timeout(7.0, _Group(), "probe")
        return getattr(state, "last_op_timeout", None) == 7.0
    finally:
        if hasattr(state, "last_op_timeout"):
            state.last_op_timeout = before


@pytest.mark.parametrize("bound", ["op_timeout", "the step's timeout"])
def test_a_rank_stopped_after_its_step_is_evicted_by_the_vote_then_comes_back(
    job_factory, tmp_path, bound
):
    """op_timeout: the Manager is given op_timeout=3. the step's timeout: it is not, and
    takes the timeout=3 of the step's all_reduce."""
    if bound == "the step's timeout" and not _records_op_timeouts():
        pytest.skip(
            "distcomm._calls.op_timeout does not record a call's timeout= in "
            "world.state.last_op_timeout yet, which the Manager's default reads"
        )
    frozen, shrunk, back = tmp_path / "frozen", tmp_path / "shrunk", tmp_path / "back"
    env = {
        "STEPS": "40",
        "OP_TIMEOUT": "3",  # the step's all_reduce(timeout=3)
        "SHRUNK": str(shrunk),  # a rank committed a step without rank 2
        "HOLD_UNTIL": str(back),  # from half-way on, wait (voting) for rank 2 to be back
        "REFORM_TIMEOUT": "60",
    }
    if bound == "op_timeout":
        env["MGR_OP_TIMEOUT"] = "3"
    job = job_factory(3, "tcp", **env)
    members = [job.start("member", r) for r in (0, 1)]
    sleeper = job.start("member", 2, FREEZE_AT="5", FROZEN=str(frozen), MARK_BACK=str(back))
    wait_for_file(frozen, 300, "rank 2 stopping itself after step 5's all_reduce", members)
    wait_for_file(shrunk, 300, "ranks 0 and 1 going on without the stopped rank 2", members)
    os.kill(sleeper.pid, signal.SIGCONT)
    results = job.results([*members, sleeper], timeout=600)
    same_weights(results, 40)
    assert sorted(r["rank"] for r in results) == [0, 1, 2], results
    assert all(r["size"] == 3 for r in results), results
    for member in results[:2]:
        assert {2, 3} <= set(member["sizes"]), member  # went on at 2, back to 3
    assert results[2]["reforms"] >= 1, results[2]  # it came back through a re-forming


def test_op_timeout_is_checked_like_an_operations_timeout(solo):
    """op_timeout is a positive number of seconds or a timedelta, at most the group's
    timeout (10 s here): the message names the argument and what to pass."""
    from distcomm.recovery import Manager

    for bad, says in ((60, "longer than the timeout of group"), (0, "positive"), ("3", "number")):
        with pytest.raises((ValueError, TypeError), match=says) as caught:
            Manager(lambda: {}, lambda state: None, op_timeout=bad)
        assert "op_timeout" in str(caught.value)
    mgr = Manager(lambda: {}, lambda state: None, op_timeout=timedelta(seconds=2))
    mgr.start_step()
    assert mgr.should_commit(True) and mgr.step == 1  # the vote, bounded, on one rank
