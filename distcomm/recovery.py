"""A training loop that survives lost workers without restarting the others: per-step
commit, re-forming the world, and catching newcomers up from a survivor.

`Manager` wraps a loop's steps. At the end of each step every rank votes, with one
all_reduce, whether it finished the step; the step is committed only when every rank did,
else every rank discards it. A failed vote (a rank was lost, the group aborted) marks the
world for re-forming, which the next `start_step` does (`distcomm.membership`: the live
members, plus any newcomer that registered, decided once through the job's store). After
each re-forming every rank compares its committed step count: the lowest rank holding the
highest count sends its state (`state_dict()`) to the others, which load it
(`load_state_dict`), so a newcomer, and any rank that missed the last commit, continues
from the same committed state as the rest, bit for bit.

Under `distcomm-run --on-failure=replace` the agent starts a replacement for a worker that
died; the replacement's `init_process_group()` registers it and returns once the members
took it in, which they do at the step after rank 0 sees it registered (the vote carries
that news). The job's store must outlive the workers (distcomm-run's agent store does).
A replacement that crashes while joining (at start, after registering, after a re-forming
named it, while connecting) never takes the members down: it is left out, and the live
ones are taken in later (`distcomm.membership`).

The Manager's own collectives (the vote, the catch-up) are bounded by `op_timeout`, by
default the `timeout=` the loop's own operations were last called with: a rank that stops
after its step's collectives (a GC pause, swap, a debugger, a VM migration) costs the
others that long, not the group's timeout; they discard the step and re-form without it,
and once it runs again it finds itself out of the world and joins as a newcomer.

This is torchft's idea on one job, with the store as the quorum's arbiter; see the
recovery page of the docs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np

from . import membership
from ._calls import op_timeout as check_op_timeout
from .collectives import all_reduce, broadcast
from .errors import DistError, JobFinishedError
from .objects import all_gather_object, broadcast_object_list
from .world import default_group, state

__all__ = ["JobFinishedError", "Manager"]

log = logging.getLogger("distcomm.recovery")

#: re-forming attempts before start_step gives up (a member may be lost while connecting)
_ATTEMPTS = 3
#: the default bound of one re-forming's connecting, where the group's is longer: a member
#: lost between the roll and the connecting is found out this soon
_REFORM_TIMEOUT_S = 120.0


class Manager:
    """Per-step commit and re-forming for a loop on the default group.

    Args:
        state_dict: returns the state a newcomer needs, a dict of numpy arrays and
            picklable values (weights, optimizer state); called on the rank that sends.
        load_state_dict: loads such a dict (arrays arrive as new numpy arrays).
        settle: seconds without news after which members on other hosts that did not
            come to a re-forming are left out (on this host an ended process is seen at
            once); a newcomer named by a re-forming has a few times that (at least 5 s)
            to acknowledge it, else it is left out and registers again.
        reform_timeout: bound of one re-forming attempt, the roll and the connecting
            (default: the group's timeout, at most 120 s). A process lost while connecting
            fails the attempt, and the next one leaves it out (3 failed attempts, then
            `start_step` raises; an attempt that a newcomer made fail is followed by one
            without newcomers, which is not counted).
        op_timeout: bound of each of the Manager's own collectives (the vote in
            `should_commit`, the catch-up after a re-forming), seconds or a timedelta, at
            most the group's timeout. Default: the `timeout=` of the last operation this
            process called with one (the step's own collectives), else the group's
            timeout. A vote that times out fails like a lost rank: the step is discarded
            and the world re-formed without the ranks that did not vote.
        step: the committed step count to start from (a loop resumed from a checkpoint).

    Use::

        mgr = Manager(state_dict, load_state_dict)
        while mgr.step < steps:
            mgr.start_step()                 # re-forms and catches up when needed
            try:
                ...                          # the step's collectives
                ok = True
            except dist.DistError:
                ok = False
            if mgr.should_commit(ok):        # every rank finished it: apply the update
                ...
    """

    def __init__(
        self,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        *,
        settle: float = 1.0,
        reform_timeout: float | timedelta | None = None,
        op_timeout: float | timedelta | None = None,
        step: int = 0,
    ) -> None:
        if not callable(state_dict) or not callable(load_state_dict):
            raise TypeError(
                "Manager: state_dict and load_state_dict must be callables (a function "
                "returning the state as a dict, and one loading such a dict)"
            )
        if isinstance(settle, bool) or not isinstance(settle, (int, float)) or settle <= 0:
            raise ValueError(
                f"Manager: settle must be a positive number of seconds, got {settle!r}"
            )
        self._pg = default_group("Manager")
        self._state_dict, self._load = state_dict, load_state_dict
        self._settle = float(settle)
        if reform_timeout is None:
            reform_timeout = min(self._pg.timeout.total_seconds(), _REFORM_TIMEOUT_S)
        self._reform_timeout = reform_timeout
        #: the bound the caller gave the Manager's own collectives (None: see _op_seconds)
        self._op_timeout = (
            None
            if op_timeout is None
            else check_op_timeout(op_timeout, self._pg, "Manager op_timeout")
        )
        #: the number of committed steps
        self.step = int(step)
        #: re-formings this process took part in, and steps discarded
        self.reforms = 0
        self.discarded = 0
        last = membership.current()
        if state.joined and last is not None:
            self._members, self._admitted = list(last.handles), last.admitted
            self._catch_up = True  # the members send the state at their next start_step
            self._fresh = True  # no state of the job's yet
        else:
            handles: list[Any] = [None] * self._pg.size()
            all_gather_object(handles, self._pg.get_init_handle(), timeout=self._op_seconds())
            self._members, self._admitted = handles, 0
            self._catch_up = False
            self._fresh = False
        self._reform = False
        self._grow = False

    # -- the loop ------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank in the current world."""
        return self._pg.rank()

    @property
    def world_size(self) -> int:
        """The current world's size."""
        return self._pg.size()

    def _op_seconds(self) -> float | None:
        """The bound of one of the Manager's collectives: `op_timeout`, else the last
        per-operation timeout this process used (at most the group's), else None (the
        group's timeout)."""
        if self._op_timeout is not None:
            return self._op_timeout
        last = state.last_op_timeout
        if last is None:
            return None
        return min(last, self._pg.timeout.total_seconds())

    def start_step(self) -> None:
        """Begin a step: re-form the world if the last vote failed or newcomers wait,
        then, after any re-forming (or in a newcomer), bring every rank to the highest
        committed state. A catch-up that fails (a rank lost or frozen meanwhile) re-forms
        again, up to 3 times.

        Raises:
            DistError: the world could not be re-formed or caught up (the last error).
        """
        failures = 0
        while True:
            if self._reform or self._grow or self._pg.is_aborted():
                decision = self._reform_world()
                self._members, self._admitted = list(decision.handles), decision.admitted
                self._reform = self._grow = False
                self.reforms += 1
                self._catch_up = True
                log.warning(
                    "re-formed the world at epoch %d: %d ranks, this one rank %d (step %d)",
                    decision.epoch,
                    self._pg.size(),
                    self._pg.rank(),
                    self.step,
                )
            if not self._catch_up:
                return
            try:
                self._sync()
            except DistError as exc:
                failures += 1
                if failures >= _ATTEMPTS:
                    raise
                log.warning(
                    "catching up after re-forming the world failed (%s); re-forming again", exc
                )
                self._reform = True
                continue
            self._catch_up = False
            return

    def _reform_world(self) -> membership.Decision:
        """Re-form the world; a process lost while connecting fails the attempt, and the
        next epoch's roll leaves it out. An attempt that named newcomers and failed is
        followed by one without them (they register again and come at a later step), so
        replacements that crash while joining never use up the attempts; 3 other failed
        attempts raise the last error."""
        newcomers, failures = True, 0
        while True:
            before = state.epoch
            try:
                return membership.reform(
                    self._pg,
                    self._members,
                    self._admitted,
                    self._settle,
                    self._reform_timeout,
                    newcomers=newcomers,
                )
            except DistError as exc:
                tried = membership.decided(state.epoch) if state.epoch > before else None
                if newcomers and tried is not None and tried.newcomers:
                    log.warning(
                        "re-forming the world with newcomer(s) %s failed (%s); re-forming "
                        "without newcomers (the live ones register again)",
                        tried.newcomers,
                        exc,
                    )
                    newcomers = False
                    continue
                failures += 1
                if failures >= _ATTEMPTS:
                    raise
                log.warning("re-forming the world failed (attempt %d): %s", failures, exc)

    def should_commit(self, ok: bool = True) -> bool:
        """End a step: vote whether every rank finished it (`ok`: this one did). True on
        every rank when all did (the caller applies the step); False on every rank that
        can still vote otherwise, and the step is to be done again. A vote that fails (a
        rank was lost, or did not vote within the Manager's `op_timeout`) returns False
        and marks the world for re-forming."""
        news = 0
        if self._pg.rank() == 0:
            try:
                news = membership.pending(self._admitted)
            except Exception as exc:  # the store is unreachable: the vote still runs
                log.warning("could not ask the store for newcomers: %s", exc)
        vote = np.array([0 if ok else 1, news], dtype=np.int64)
        try:
            all_reduce(vote, group=self._pg, timeout=self._op_seconds())
        except DistError as exc:
            log.warning("step %d discarded: the vote failed: %s", self.step, exc)
            self._reform = True
            self.discarded += 1
            return False
        if vote[1] > 0:
            self._grow = True
        if vote[0] > 0:
            self.discarded += 1
            self._reform = self._pg.is_aborted()
            return False
        self.step += 1
        return True

    def close(self) -> None:
        """End the loop: a newcomer still waiting to join (a replacement that came too
        late) gets `JobFinishedError` instead of waiting out its timeout. Every rank may
        call it; leaving the `with` block of the Manager calls it."""
        try:
            membership.close()
        except Exception as exc:  # the store is gone: nobody can be waiting on it
            log.debug("could not mark the job finished: %s", exc)

    def __enter__(self) -> Manager:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        if kind is None:  # the loop ended; an exception is a failure the agent handles
            self.close()

    # -- catching up ---------------------------------------------------------------------------

    def _sync(self) -> None:
        """Every rank to the state of the lowest rank with the most committed steps; each
        collective bounded by `_op_seconds()`.

        Raises:
            DistError: a collective failed or timed out (nothing was loaded then).
        """
        timeout = self._op_seconds()
        steps: list[Any] = [None] * self._pg.size()
        all_gather_object(steps, -1 if self._fresh else self.step, group=self._pg, timeout=timeout)
        best = max(steps)
        if all(s == best for s in steps):
            return
        src = steps.index(best)
        me = self._pg.rank()
        layout: list[Any] = [None]
        arrays: dict[str, np.ndarray] = {}
        if me == src:
            current = self._state_dict()
            if not isinstance(current, dict):
                raise TypeError(f"Manager: state_dict() must return a dict, got {current!r}")
            arrays = {k: np.ascontiguousarray(v) for k, v in current.items() if _is_array(v)}
            others = {k: v for k, v in current.items() if not _is_array(v)}
            shapes = {k: (a.shape, a.dtype.str) for k, a in arrays.items()}
            layout[0] = (self.step, shapes, others)
        broadcast_object_list(layout, group_src=src, group=self._pg, timeout=timeout)
        step, shapes, others = layout[0]
        for key in sorted(shapes):
            shape, dtype = shapes[key]
            buf = arrays[key] if me == src else np.empty(shape, dtype=np.dtype(dtype))
            broadcast(buf, group_src=src, group=self._pg, timeout=timeout)
            arrays[key] = buf
        if me != src:
            self._load({**others, **arrays})
            self.step = step
        self._fresh = False
        log.info("caught up from rank %d at step %d", src, step)


def _is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray)
