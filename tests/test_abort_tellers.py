"""Evicting a stopped rank waits for no thread blocked on it.

Three gloo ranks on one host talk through shared memory, so they hold no TCP connection
to each other: a rank that aborts the group tells the others by dialling them, each in a
short-lived thread (a teller), and a teller dialling a stopped process blocks until its
dial's deadline. Rank 2 stops itself (SIGSTOP); ranks 0 and 1 time out (`timeout=`),
re-form without it (`get_init_handle` and `reconfigure`) and all_reduce in the new group.
The re-forming shuts the old group down, and must not join the tellers still dialling
rank 2: they keep running on the connections the new group uses, and deliver once rank 2
is continued.

The test asserts what happened, never how long it took: the survivors make the dial's
deadline longer than the test (a teller blocked on the stopped rank stays blocked until
the test continues it) and record every join of a teller made while re-forming (such a
join returns at once, so the old behaviour fails here instead of hanging). Rank 2 is
continued once both survivors re-formed, and must then be told of the abort.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .processes import no_process_left
from .test_timeout_peers import (
    LATE,
    OP_TIMEOUT,
    SIZE,
    WAIT_S,
    Job,
    flag,
    stop_here,
    told_of_abort,
)
from .test_timeout_peers import wait_flag as wait_for

pytestmark = pytest.mark.timeout(240)

#: the survivors' dial deadline for tellers: longer than the whole test
TELL_DIAL_S = 600.0


def _tellers_to(rank: int) -> list[threading.Thread]:
    """The live threads passing an abort on to group rank `rank` (`distcomm-abort-<me>-<rank>`)."""
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith("distcomm-abort-") and t.name.endswith(f"-{rank}") and t.is_alive()
    ]


def _await_teller(rank: int) -> list[str]:
    """The names of the tellers dialling group rank `rank`, once there is one: this rank's
    own abort starts one (the rank is its child in the tree the news spreads over), maybe
    just after the timeout reached the caller (from the thread running the collective)."""
    deadline = time.monotonic() + WAIT_S
    while not _tellers_to(rank):
        if time.monotonic() > deadline:
            raise AssertionError(f"no thread passed the abort on to rank {rank}")
        time.sleep(0.01)
    return sorted(t.name for t in _tellers_to(rank))


def _reform(pg: Any, store: Any, rank: int) -> list[str]:
    """Re-form the world as ranks 0 and 1; the names of the teller threads it joined."""
    joined: list[str] = []
    join = threading.Thread.join

    def spy(thread: threading.Thread, timeout: float | None = None) -> None:
        if thread.name.startswith("distcomm-abort-"):
            joined.append(thread.name)
            return  # recorded: the test fails on it rather than wait out the dial
        join(thread, timeout)

    store.set(f"tellers/handle/{rank}", pg.get_init_handle())
    handles = [store.get(f"tellers/handle/{r}").decode() for r in range(SIZE) if r != LATE]
    threading.Thread.join = spy  # type: ignore[method-assign]
    try:
        pg.reconfigure("without-the-stopped-rank", handles).wait()
    finally:
        threading.Thread.join = join  # type: ignore[method-assign]
    return joined


def _worker() -> None:
    import distcomm as dist
    from distcomm.backends.engine.transport import tcp
    from distcomm.world import state

    dist.init_process_group("gloo", timeout=60)
    rank = dist.get_rank()
    pg = dist.group.WORLD
    x = np.ones(4)
    dist.all_reduce(x)  # every rank is there
    seen: dict[str, Any] = {"rank": rank, "sum": float(x[0]), "path": pg._backends["cpu"].transport}
    if rank == LATE:
        stop_here(rank)  # continued once the others re-formed without it
        told_of_abort(pg)  # by the tellers nobody waited for
        seen["told"] = pg._backends["cpu"]._transport.mailbox.failure.message
    else:
        tcp._TELL_DIAL_S = TELL_DIAL_S  # a teller blocked on the stopped rank stays so
        wait_for(f"stopped-{LATE}")
        try:
            dist.all_reduce(np.ones(4), timeout=OP_TIMEOUT)
        except dist.DistTimeoutError as exc:
            seen["error"] = str(exc)
        seen["before"] = _await_teller(LATE)
        old = pg._backends["cpu"]
        seen["joined"] = _reform(pg, state.store, rank)
        seen["after"] = sorted(t.name for t in _tellers_to(LATE))
        seen["old_closed"] = old._closed
        y = np.full(2, rank + 1.0)
        dist.all_reduce(y)  # the new group works
        seen["new_sum"], seen["new_size"] = float(y[0]), dist.get_world_size()
        flag(f"reformed-{rank}")
        wait_for("continued")
        for teller in _tellers_to(LATE):  # the news reaches the continued rank
            teller.join(60)
        seen["left"] = sorted(t.name for t in _tellers_to(LATE))
    dist.destroy_process_group()
    print("RESULT " + json.dumps(seen), flush=True)


def test_reforming_without_a_stopped_rank_does_not_wait_for_its_tellers(tmp_path: Path):
    with no_process_left(), Job(tmp_path, "tests.test_abort_tellers") as job:
        job.start([{} for _ in range(SIZE)])
        job.stop_seen(LATE)
        for rank in range(SIZE):
            if rank != LATE:
                job.wait_flag(f"reformed-{rank}")
        job.cont(LATE)
        (job.flags / "continued").touch()
        results = job.results()
    for seen in results:
        assert seen["sum"] == SIZE and seen["path"] == "shm", results
    for rank in range(SIZE):
        if rank == LATE:
            continue
        seen = results[rank]
        assert "error" in seen, seen  # its all_reduce with the stopped rank timed out
        # a teller was dialling the stopped rank (shared memory: no connection to it) ...
        assert seen["before"], seen
        # ... the re-forming shut the old group down without joining it ...
        assert seen["old_closed"], seen
        assert seen["joined"] == [], seen
        assert seen["after"] == seen["before"], seen
        assert seen["new_size"] == SIZE - 1 and seen["new_sum"] == 3.0, seen
        # ... and it delivered once the rank was continued
        assert seen["left"] == [], seen
    assert "aborted" in results[LATE]["told"], results[LATE]


if __name__ == "__main__":
    _worker()
