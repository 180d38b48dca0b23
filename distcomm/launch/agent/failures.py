"""What the agent reads about a round's failed workers: one `ProcessFailure` per failed
worker (exit code or signal, error file, stderr tail, log files), and a short wait for the
failure that caused the others.

The agent (`elastic.py`) decides what a failure means for the run; this module only turns
the state of the local `WorkerProcesses` into the failure records the report prints.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping

from ..errors import ProcessFailure
from ..rendezvous import RendezvousInfo
from ..workers import WorkerProcesses
from .config import AgentConfig

__all__ = [
    "PEER_FAILURE_WAIT_S",
    "STDERR_END_WAIT_S",
    "observe_failures",
    "wait_for_root_cause",
]

log = logging.getLogger("distcomm.launch")

#: seconds the agent waits for a failed worker's stderr to end before it reads its tail
STDERR_END_WAIT_S = 2.0
#: seconds the agent waits, while a peer caused every failure seen, for the failure that
#: caused them: a worker still running then is usually about to end with it
PEER_FAILURE_WAIT_S = 3.0

Failures = dict[int, ProcessFailure]


def observe_failures(
    workers: WorkerProcesses,
    info: RendezvousInfo,
    config: AgentConfig,
    expired: Mapping[int, str],
    files_kept: bool,
) -> Failures:
    """The failed workers of this node now, by global rank.

    Args:
        workers: this node's workers of the round.
        info: the round (this node's rank gives the workers' global ranks).
        config: the agent's configuration (workers per node, role).
        expired: pid -> scope of the workers an expiration timer killed.
        files_kept: whether the workers' log files outlive the agent (the report says so).

    Returns:
        global rank -> `ProcessFailure` for each worker that exited non-zero or by a
        signal; a worker whose error file no error handler wrote is reported by its exit.
    """
    host = socket.gethostname()
    codes, pids = workers.poll(), workers.pids()
    stderr_end = time.monotonic() + STDERR_END_WAIT_S
    failures = {}
    for local_rank, code in sorted(codes.items()):
        if code in (None, 0):
            continue
        rank = info.rank * config.nproc_per_node + local_rank
        pid = pids[local_rank]
        reason = ""
        if pid in expired:
            reason = f"expiration timer scope {expired[pid]!r} expired; the worker was killed"
        tail = workers.stderr_tail(local_rank, stderr_end)
        fields = {
            "local_rank": local_rank,
            "rank": rank,
            "pid": pid,
            "exitcode": code,
            "host": host,
            "role": config.role,
            "log_files": workers.log_files(local_rank),
            "reason": reason,
            # the error file's time, when it has one; else when the worker said why
            "timestamp": (tail and tail.failure_time()) or workers.exit_time(local_rank),
            "files_kept": files_kept,
            "stderr_tail": None if tail is None else tail.lines(),
        }
        try:
            failures[rank] = ProcessFailure(error_file=workers.error_file(local_rank), **fields)
        except ValueError as exc:  # a file no error handler wrote: report the exit
            log.warning("distcomm-run: %s", exc)
            fields["reason"] = "; ".join(filter(None, [reason, str(exc)]))
            failures[rank] = ProcessFailure(error_file="", **fields)
    return failures


def wait_for_root_cause(
    workers: WorkerProcesses, observe: Callable[[], Failures], interval: float
) -> Failures:
    """`observe()`'s failures; while a peer caused every one of them and other workers
    still run, observed again every `interval` until those end or PEER_FAILURE_WAIT_S
    passes (the worker whose failure caused them may be ending now: then it is in the
    report, as the root cause)."""
    failures = observe()
    deadline = time.monotonic() + PEER_FAILURE_WAIT_S
    while (
        failures
        and all(failure.peer_ranks is not None for failure in failures.values())
        and None in workers.poll().values()
        and time.monotonic() < deadline
    ):
        time.sleep(interval)
        failures = observe()
    return failures
