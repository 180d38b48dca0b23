"""What the agents of a round agree on through its store: equal worker counts, the run's
restart count, the exit barrier and leaving together."""

from __future__ import annotations

import contextlib
import logging

from ...deadline import Deadline
from ...errors import DistError, DistStoreTimeoutError
from ...store.base import publish
from ..rendezvous import RendezvousError, RendezvousInfo
from .watch import RoundWatch, RunResult, barrier_step, failed_round_key, slow_store

__all__ = [
    "DEPARTURE_TIMEOUT",
    "RDZV_CHECK_INTERVAL",
    "check_homogeneous",
    "count_restart",
    "depart",
    "exit_barrier",
]

log = logging.getLogger("distcomm.launch")

#: seconds the nodes of a finished run wait for each other to stop using the stores
DEPARTURE_TIMEOUT = 10.0
#: seconds between checks of the rendezvous while workers run
RDZV_CHECK_INTERVAL = 0.5


def check_homogeneous(info: RendezvousInfo, nproc: int, run_id: str) -> None:
    """Share this node's number of workers; raise unless every node of the round has the
    same.

    Raises:
        RendezvousError: the nodes start different numbers of workers.
    """
    info.store.set(f"nproc/{info.rank}", str(nproc))
    values = info.store.multi_get([f"nproc/{rank}" for rank in range(info.world_size)])
    counts = {rank: int(value) for rank, value in enumerate(values)}
    if len(set(counts.values())) > 1:
        raise RendezvousError(
            f"the nodes of run {run_id!r} start different numbers of workers "
            f"(node rank: --nproc_per_node): "
            f"{', '.join(f'{r}: {n}' for r, n in sorted(counts.items()))}; every node must "
            f"pass the same --nproc_per_node"
        )


def count_restart(info: RendezvousInfo) -> int:
    """Count round `info.round`'s failure once for the run; the run's restart count."""
    store, key = info.run_store, f"restart_count_after_round_{info.round}"
    if int(store.add(failed_round_key(info.round), 1)) == 1:
        count = int(store.add("restart_count", 1))
        store.set(key, str(count))
        return count
    return int(store.get(key))


def exit_barrier(info: RendezvousInfo, watch: RoundWatch, timeout: float) -> RunResult:
    """Wait until every node's workers are done, so no node's store leaves early.

    Returns SUCCEEDED once all are (or after `timeout` seconds, as torch does), or
    what `barrier_step` says ends the wait: the round failed on another node, the
    rendezvous was closed, a node left the round.
    """
    store = info.store
    with slow_store("the exit barrier"):
        if int(store.add("finished", 1)) == info.world_size:
            publish(store, "all_finished", "1")
            return RunResult.SUCCEEDED
    deadline = Deadline(timeout)
    while not deadline.expired():
        try:
            store.wait(["all_finished"], timeout=deadline.slice(RDZV_CHECK_INTERVAL))
            return RunResult.SUCCEEDED
        except DistStoreTimeoutError:
            pass
        result = barrier_step(watch.latest())
        if result is not None:
            return RunResult.SUCCEEDED if store.check(["all_finished"]) else result
        watch.check_stall()
    log.warning(
        "distcomm-run: not every node finished within %.0f s of this one; leaving",
        timeout,
    )
    return RunResult.SUCCEEDED


def depart(info: RendezvousInfo) -> None:
    """Leave together: a node that serves the store must not go while others use it.

    Every node of the last round counts itself out, then waits (up to
    DEPARTURE_TIMEOUT: a node that died never counts) until all have.
    """
    with contextlib.suppress(DistError, OSError):
        store = info.store
        if int(store.add("departed", 1)) >= info.world_size:
            store.set("all_departed", "1")
            return
        with contextlib.suppress(DistError):
            store.wait(["all_departed"], timeout=DEPARTURE_TIMEOUT)
