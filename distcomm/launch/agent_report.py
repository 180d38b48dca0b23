"""What the elastic agent tells: its events in torch's layout, and a round's failure report."""

from __future__ import annotations

import json
import logging
import socket
import time

from ..errors import DistError
from ..store import Store
from .agent_config import AgentConfig
from .errors import ChildFailedError, ProcessFailure, gather_failures, trace_hint
from .events import Event, EventSource, record
from .rendezvous import RendezvousInfo
from .watch import slow_store

__all__ = ["AgentEvents", "round_report"]

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
