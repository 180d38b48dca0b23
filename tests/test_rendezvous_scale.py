"""The dynamic rendezvous at scale: hundreds of nodes form one round, and the survivors of
a killed node form the next.

A node is a rendezvous handler without workers, made as the launcher makes it
(get_rendezvous_handler), whose next_rendezvous() runs in a thread of its own; the nodes
are spread over spawned processes. The simulation is benchmarks/rendezvous.py's (one
implementation for the benchmark and these tests). The tests check results and counts
only (ranks, world sizes, round numbers, store requests), never a duration.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

from tests import processes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import rendezvous as simulation  # benchmarks/: the simulated nodes

#: Short heartbeats, so that a killed node is dropped within seconds.
KEEP_ALIVE = {"keep_alive": 0.5, "max_attempts": 4}
#: The processes multiprocessing keeps for the whole session.
SESSION_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


@pytest.fixture(autouse=True)
def no_process_left():
    """Fail a test that leaves a node process or a store's host running (and kill it)."""
    with processes.no_process_left(SESSION_HELPERS):
        yield


def assert_one_round(infos, size):
    """Ranks 0..size-1 exactly once, world size `size` and one round number on every node;
    returns the round number."""
    ranks = Counter(rank for rank, _, _ in infos)
    assert sorted(ranks) == list(range(size)), f"ranks given: {sorted(ranks)}"
    assert set(ranks.values()) == {1}, {rank: n for rank, n in ranks.items() if n > 1}
    assert {world for _, world, _ in infos} == {size}
    rounds = {number for _, _, number in infos}
    assert len(rounds) == 1, f"round numbers seen: {sorted(rounds)}"
    assert simulation.check_round(infos, size) is None
    return rounds.pop()


@pytest.mark.timeout(420)
def test_256_nodes_form_one_round_with_every_rank_once():
    scenario = simulation.Scenario("c10d", 256, processes=8, timeout=240, window=0, **KEEP_ALIVE)
    assert scenario.shares() == [32] * 8

    result = simulation.simulate(scenario)

    assert result.status == "ok", result.error
    assert result.completed == 256
    assert_one_round(result.infos, 256)
    assert result.requests_per_node >= 1  # counted at the stores, in every node process
    assert result.state_keys >= 1  # the state is in the store, under the run's id


@pytest.mark.timeout(300)
def test_survivors_of_a_killed_node_form_the_next_round():
    scenario = simulation.Scenario(
        "c10d", 16, processes=3, timeout=120, window=1, kill=True, **KEEP_ALIVE
    )
    assert scenario.shares() == [5, 5, 5, 1]  # the node to kill alone in the last process

    result = simulation.simulate(scenario)

    assert result.status == "ok", result.error
    first = assert_one_round(result.infos, 16)
    assert result.round == first
    assert result.round_over_in_window == 0  # no live node was dropped before the kill
    assert result.recovery_status == "ok", result.recovery_error
    assert result.recovered == 15
    second = assert_one_round(result.recovery_infos, 15)
    assert second > first
    assert result.recovery_round == second


def test_check_round_names_what_is_wrong():
    assert simulation.check_round([(0, 2, 1), (1, 2, 1)], 2) is None
    problem = simulation.check_round([(0, 3, 1), (0, 3, 1), (1, 3, 2)], 3)
    assert "ranks missing: 2" in problem
    assert "ranks given more than once: 0" in problem
    assert "round numbers seen" in problem
    assert "world sizes seen" not in problem
    assert "world sizes seen" in simulation.check_round([(0, 2, 0), (1, 3, 0)], 2)
