"""--on-failure=replace: a failed worker is replaced in place while the others run on.

In the default mode (``restart``) one failed worker stops every worker of the node and the
group restarts (`elastic.py`, within --max-restarts). With ``replace`` the agent starts a
new worker in the dead one's slot instead, with the dead one's environment (the same RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, the same agent store) plus
``DISTCOMM_REPLACEMENT=<k>`` (the slot's k-th replacement of the run) and
``DISTCOMM_REPLACED_PID=<the dead worker's pid>``; the other workers are left alone and no
rendezvous is redone: the replacement must join the running group itself.

The division of labour: `replaceable` decides, as a pure function of the workers' exit
codes and the replacements left, which slots to replace now; `Replacer` keeps the count
over the run and does it (records the dead worker's failure, starts the replacement
through `WorkerProcesses.replace`, logs both). A failure it does not take (none left, more
failures than replacements left, or no other worker of the node still running) stays in
the exit codes, and the agent's restart policy handles it as in the default mode.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping

from ..errors import ProcessFailure, exit_description
from ..rendezvous import RendezvousInfo
from ..workers import WorkerProcesses
from .config import AgentConfig
from .report import AgentEvents

__all__ = [
    "DEFAULT_MAX_REPLACEMENTS",
    "ON_FAILURE_MODES",
    "REPLACED_PID_ENV",
    "REPLACEMENT_ENV",
    "Replacer",
    "check_on_failure",
    "replaceable",
]

log = logging.getLogger("distcomm.launch")

#: --on-failure's values: restart the node's workers (torchrun's way), or replace the dead one
ON_FAILURE_MODES = ("restart", "replace")
#: --max-replacements's default: replacements this node starts over the whole run
DEFAULT_MAX_REPLACEMENTS = 3
#: set in a replacement only: which replacement of its slot it is (1 for the first)
REPLACEMENT_ENV = "DISTCOMM_REPLACEMENT"
#: set in a replacement only: the pid of the worker it replaces
REPLACED_PID_ENV = "DISTCOMM_REPLACED_PID"
#: the variables that make a worker a replacement; a worker started normally has neither
REPLACEMENT_VARS = (REPLACEMENT_ENV, REPLACED_PID_ENV)


def check_on_failure(
    on_failure: object,
    max_replacements: object,
    names: tuple[str, str] = ("--on_failure", "--max_replacements"),
) -> tuple[str, int]:
    """The checked values of --on-failure and --max-replacements.

    Args:
        on_failure, max_replacements: the values as given (a variable's text, or an int).
        names: how the message names the two (the flags, or LaunchConfig's fields).

    Raises:
        ValueError: `on_failure` is not a mode of ON_FAILURE_MODES, or `max_replacements`
            is not a whole number >= 0.
    """
    if on_failure not in ON_FAILURE_MODES:
        raise ValueError(
            f"{names[0]}={on_failure!r} is not one of {', '.join(ON_FAILURE_MODES)}: restart "
            "stops and restarts every worker of the node, replace starts a new worker in the "
            "failed one's place"
        )
    count = -1
    if not isinstance(max_replacements, bool):
        with contextlib.suppress(ValueError, TypeError):
            count = int(str(max_replacements).strip())
    if count < 0:
        raise ValueError(
            f"{names[1]} must be a whole number >= 0 (replacements this node starts over the "
            f"run; 0: a failure restarts the workers as in restart mode), got {max_replacements!r}"
        )
    return str(on_failure), count


def replaceable(codes: Mapping[int, int | None], left: int) -> list[int]:
    """The local ranks whose workers to replace now; [] leaves any failure to the restart
    policy.

    Args:
        codes: local rank -> exit code of each worker slot (None while running).
        left: the replacements still allowed.

    Returns:
        Every failed slot (a non-zero exit or a signal), in order, when another worker of
        the node still runs and `left` covers them all; else [].
    """
    failed = sorted(lr for lr, code in codes.items() if code not in (None, 0))
    running = any(code is None for code in codes.values())
    if not failed or not running or len(failed) > left:
        return []
    return failed


class Replacer:
    """Replaces failed workers while their peers run (--on-failure=replace); in restart
    mode `step` changes nothing.

    Args:
        config: the agent's configuration (`on_failure`, `max_replacements`).
        events: where each replacement is recorded (a FAILED and a START worker event).
    """

    def __init__(self, config: AgentConfig, events: AgentEvents) -> None:
        self.enabled = config.on_failure == "replace"
        self.limit = config.max_replacements
        #: the failures of the workers replaced so far, in order
        self.replaced: list[ProcessFailure] = []
        self._slots: dict[int, int] = {}  # local rank -> replacements started in that slot
        self._nproc = config.nproc_per_node
        self._events = events

    @property
    def left(self) -> int:
        """Replacements still allowed."""
        return max(0, self.limit - len(self.replaced)) if self.enabled else 0

    def step(
        self,
        workers: WorkerProcesses,
        info: RendezvousInfo,
        restarts: int,
        observe: Callable[[RendezvousInfo], dict[int, ProcessFailure]],
    ) -> dict[int, int | None]:
        """The workers' exit codes (`workers.poll()`), after replacing the failed ones when
        `replaceable` says so (a replaced slot runs again).

        Args:
            workers: the node's workers of the round.
            info: the round, and `restarts` the run's restart count, for the events.
            observe: the failed workers' records now, by global rank (`observe_failures`),
                given the round.
        """
        codes = workers.poll()
        slots = replaceable(codes, self.left) if self.enabled else []
        if not slots:
            return codes
        for local_rank in slots:  # first, so that no child holds the dead one's stderr
            workers.kill_remains(local_rank)
        failures = {failure.local_rank: failure for failure in observe(info).values()}
        pids = workers.pids()
        for local_rank in slots:
            rank = info.rank * self._nproc + local_rank
            failure = failures.get(local_rank) or ProcessFailure(
                local_rank, pids[local_rank], codes[local_rank], rank=rank
            )
            number = self._slots.get(local_rank, 0) + 1
            try:
                pid = workers.replace(
                    local_rank,
                    {REPLACEMENT_ENV: str(number), REPLACED_PID_ENV: str(failure.pid)},
                    f"replacement_{number}",
                )
            except (OSError, RuntimeError) as exc:  # left failed: the restart policy takes it
                log.warning(
                    "distcomm-run: worker local rank %d (rank %d) failed and cannot be "
                    "replaced (%s)",
                    local_rank,
                    failure.rank,
                    exc,
                )
                return workers.poll()
            self._slots[local_rank] = number
            self.replaced.append(failure)
            log.warning(
                "distcomm-run: worker local rank %d (rank %d, pid %d) failed: %s; replaced by "
                "pid %d (DISTCOMM_REPLACEMENT=%d; %d of %d replacements used on this node), "
                "the other workers run on",
                local_rank,
                failure.rank,
                failure.pid,
                _cause(failure),
                pid,
                number,
                len(self.replaced),
                self.limit,
            )
            self._events.replaced(info, restarts, failure, number, pid)
        return workers.poll()

    def summary(self) -> str:
        """A line for the failure report naming the workers replaced earlier ("": none)."""
        if not self.replaced:
            return ""
        each = "; ".join(
            f"rank {f.rank} (local rank {f.local_rank}, pid {f.pid}): {_cause(f)}"
            for f in self.replaced
        )
        return (
            f"distcomm-run: {len(self.replaced)} worker(s) of this node failed earlier and "
            f"were replaced (--on_failure=replace): {each}"
        )


def _cause(failure: ProcessFailure) -> str:
    """The exit status, and the recorded error when there is one."""
    status = exit_description(failure.exitcode)
    message = failure.message
    return status if message.startswith(f"process {failure.pid} ") else f"{status}, {message}"
