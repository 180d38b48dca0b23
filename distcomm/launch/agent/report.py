"""What the elastic agent tells: its events in torch's layout, and a round's failure report.

`share_failures` and `gather_failures` pass a round's failures between the nodes' agents
through the run's store, so that every node reports every node's failures; `trace_dir`
and `trace_hint` say where the workers' flight-recorder traces go.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time

from ...errors import DistError
from ...store import Store
from ..errors import ChildFailedError, ProcessFailure
from ..events import Event, EventSource, record
from ..rendezvous import RendezvousInfo
from .config import AgentConfig
from .tempdir import TRACE_PREFIX
from .watch import slow_store

__all__ = [
    "AgentEvents",
    "gather_failures",
    "round_report",
    "share_failures",
    "trace_dir",
    "trace_hint",
]

log = logging.getLogger("distcomm.launch")


class AgentEvents:
    """Builds the agent's events (torch's ``torchelastic.worker.status.<state>``) and sends
    them to the handler `config.event_log_handler` names."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self._started_at = time.monotonic()

    def event(
        self,
        state: str,
        source: EventSource,
        info: RendezvousInfo | None,
        restarts: int,
        raw_error: str | None = None,
        duration_ms: float | None = None,
        worker: dict[str, object] | None = None,
    ) -> Event:
        """torch's event layout: ``torchelastic.worker.status.<state>`` and its metadata."""
        c = self.config
        md: dict[str, object] = {
            "group_world_size": info.world_size if info else None,
            "entry_point": c.name,
        }
        md.update(worker or {})
        return Event(
            f"torchelastic.worker.status.{state}",
            source,
            metadata={
                "run_id": c.run_id,
                "global_rank": (worker or {}).get("global_rank"),
                "group_rank": info.rank if info else None,
                "worker_id": (worker or {}).get("worker_pid"),
                "role": c.role,
                "hostname": socket.getfqdn(),
                "state": state,
                "total_run_time": int(time.monotonic() - self._started_at),
                "rdzv_backend": c.rdzv_backend,
                "raw_error": raw_error,
                "metadata": json.dumps(md),
                "agent_restarts": restarts,
                "duration_ms": duration_ms,
            },
        )

    def agent(
        self,
        state: str,
        info: RendezvousInfo | None,
        restarts: int,
        raw_error: str | None = None,
        duration_ms: float | None = None,
    ) -> None:
        """Record an event of the agent itself (RENDEZVOUS, RESTART, SUCCEEDED, FAILED)."""
        record(
            self.event(state, EventSource.AGENT, info, restarts, raw_error, duration_ms),
            self.config.event_log_handler,
        )

    def workers(
        self,
        info: RendezvousInfo,
        restarts: int,
        state: str,
        failures: dict[int, ProcessFailure],
        ranks: dict[int, int],
        pids: dict[int, int],
    ) -> None:
        """One event per local worker (`ranks`: local rank -> global rank): `state` for those
        in `failures` (all when it is SUCCEEDED or START), TERMINATED for the others of a
        failed group."""
        for local_rank, rank in sorted(ranks.items()):
            failure = failures.get(rank)
            each = state if state in ("SUCCEEDED", "START") or failure else "TERMINATED"
            worker = {
                "local_rank": local_rank,
                "global_rank": rank,
                "role_rank": rank,
                "exit_code": failure.exitcode if failure else None,
                "worker_pid": pids.get(local_rank),
            }
            raw = failure.message if failure else None
            record(
                self.event(each, EventSource.WORKER, info, restarts, raw, worker=worker),
                self.config.event_log_handler,
            )

    def replaced(
        self,
        info: RendezvousInfo | None,
        restarts: int,
        failure: ProcessFailure,
        number: int,
        pid: int,
    ) -> None:
        """Two worker events for a replacement (--on-failure=replace): FAILED for the dead
        worker (``replaced_by_pid`` in its metadata), START for the replacement (``replacement``:
        its number in the slot, ``replaced_pid``)."""
        rank = failure.rank
        ranks = {"local_rank": failure.local_rank, "global_rank": rank, "role_rank": rank}
        dead = {**ranks, "exit_code": failure.exitcode, "worker_pid": failure.pid}
        dead["replaced_by_pid"] = pid
        new = {**ranks, "exit_code": None, "worker_pid": pid, "replacement": number}
        new["replaced_pid"] = failure.pid
        for state, worker, raw in (("FAILED", dead, failure.message), ("START", new, None)):
            record(
                self.event(state, EventSource.WORKER, info, restarts, raw, worker=worker),
                self.config.event_log_handler,
            )


def round_report(
    run_store: Store,
    round_: int,
    world_size: int,
    local: dict[int, ProcessFailure],
    node: int | None,
    name: str,
    nproc_per_node: int,
    trace_dir: str,
) -> tuple[dict[int, ProcessFailure], str]:
    """The failure report of a round: every node's failed workers, root cause first.

    Args:
        run_store: the run's store, where every node shared its failures.
        local: this node's failures (also read from the store when it shared them).
        node: this node's rank in that round, or None when it was not in it.
        name: the entrypoint's name, for the report's title.
        nproc_per_node: the workers per node (a rank's node is rank // nproc_per_node).
        trace_dir: the workers' trace directory, named in a hint ("" for none).

    Returns:
        The round's failures by global rank, and the report's text.
    """
    failures: dict[int, ProcessFailure] = {}
    try:
        with slow_store("reading the other nodes' failures"):
            failures = gather_failures(run_store, round_, world_size)
    except (DistError, OSError) as exc:
        log.warning(
            "distcomm-run: the other nodes' failures cannot be read (%s); the "
            "report shows this node's only",
            exc,
        )
    failures.update(local)
    lines = []
    if failures:
        lines.append(ChildFailedError(name, failures).format_msg())
    else:
        lines.append(
            f"distcomm-run: the run failed in round {round_} on another node, "
            "which recorded no worker failure (see that node's output)"
        )
    nodes = sorted({failure.rank // nproc_per_node for failure in failures.values()})
    if node is not None and node not in nodes:
        lines.append(
            f"distcomm-run: the workers of this node (node {node} of round "
            f"{round_}) did not fail; the run failed on node(s) "
            f"{', '.join(map(str, nodes)) or 'unknown'}"
        )
    if trace_dir:
        lines.append(trace_hint(trace_dir))
    return failures, "\n".join(lines)


def trace_dir(log_root: str, run_id: str, attempt: int) -> str:
    """The DISTCOMM_TRACE_DIR the agent gives an attempt's workers when none is set.

    Under the agent's --log_dir directory (`<log_root>/traces/attempt_<k>`) when there is
    one; else `distcomm-traces-<run id>-<agent pid>/attempt_<k>` in the temporary
    directory, which outlives the run (the agent's own temporary directory does not; the
    newest TRACE_DIRS_KEPT of those of ended agents are kept: `prune_trace_dirs`).
    Nothing is created until a worker writes a trace.
    """
    if log_root:
        root = os.path.join(log_root, "traces")
    else:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in run_id)
        root = os.path.join(tempfile.gettempdir(), f"{TRACE_PREFIX}{safe}-{os.getpid()}")
    return os.path.join(root, f"attempt_{attempt}")


def trace_hint(directory: str) -> str:
    """The failure report's line naming the workers' flight-recorder traces."""
    if os.path.isdir(directory) and any(n.endswith(".json") for n in os.listdir(directory)):
        return (
            f"distcomm-run: flight-recorder traces of this node's workers: {directory}\n"
            f"  see which collective each rank was in: python -m distcomm.trace {directory}"
        )
    return (
        "distcomm-run: no worker of this node wrote a flight-recorder trace (a worker "
        "writes one into DISTCOMM_TRACE_DIR on a collective timeout or failure, SIGTERM or "
        "SIGUSR1)"
    )


def _failures_key(round_: int, node: int) -> str:
    return f"failures/round_{round_}/node_{node}"


def share_failures(
    store: Store, round_: int, node: int, failures: dict[int, ProcessFailure]
) -> None:
    """Put node `node`'s failures of round `round_` in the run's `store` for the other
    nodes' reports (`gather_failures`).

    Raises:
        DistError: the store failed.
    """
    records = [failure.to_record() for _, failure in sorted(failures.items())]
    store.set(_failures_key(round_, node), json.dumps(records))


def gather_failures(store: Store, round_: int, world_size: int) -> dict[int, ProcessFailure]:
    """Every failure the `world_size` nodes of round `round_` shared, by global rank.

    A node whose record is missing (it did not fail, or has not written yet) adds nothing;
    an unreadable record is left out with a warning.

    Raises:
        DistError: the store failed.
    """
    failures: dict[int, ProcessFailure] = {}
    for node in range(world_size):
        key = _failures_key(round_, node)
        if not store.check([key]):
            continue
        try:
            for data in json.loads(store.get(key)):
                failure = ProcessFailure.from_record(data)
                failures[failure.rank] = failure
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning(
                "the failures node %d shared for round %d are unreadable (%s); the "
                "report leaves them out",
                node,
                round_,
                exc,
            )
    return failures
