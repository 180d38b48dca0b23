"""Who is in the world: re-forming the default group after a loss or to take newcomers
in, decided through the job's store.

The world goes through numbered epochs: 0 is the job's start; each re-forming decides the
next one's members. Every live member arrives at the epoch's roll (its init handle and
its rank), newcomers register apart (`join`), and once every old member has arrived or is
known to be gone (its process ended on this host, or nothing was heard for `settle`
seconds), the arrival that decides writes the member list with one compare-and-set:
whoever wins, every process reads the same list. That single write per epoch is what
keeps two halves of a job from forming two worlds (no split brain): a process not on the
list cannot talk to the new group (its connections are keyed by the epoch), and it
registers as a newcomer for the next epoch instead. Old members keep their order (the
lowest surviving rank becomes rank 0), newcomers follow in the order they registered.

Keys live under distcomm/m/<restart count>/ in the job's store: the store must outlive
any worker (under distcomm-run it is the agent's). One store request per step on rank 0
(`pending`) is the only cost while nothing changes.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

from .deadline import to_seconds
from .errors import DistError, DistTimeoutError, JobFinishedError
from .handle import GroupHandle
from .reconfigure import NEWCOMER_RANKS, init_handle, parse_handle, reconfigure
from .store import Store
from .world import state

__all__ = ["Decision", "close", "current", "join", "pending", "reform"]

log = logging.getLogger("distcomm.group")


def _p() -> str:
    """The keys' prefix: one namespace per start of the worker group (a restart of
    distcomm-run's group begins the epochs again; its replacements share the count)."""
    return f"distcomm/m/{os.environ.get('DISTCOMM_RESTART_COUNT', '0')}/"


_POLL_S = 0.02  # between looks at the roll: short, the store answers in microseconds
_SAY_EVERY_S = 30.0  # a long wait says so this often
_CLOSED_EVERY_S = 0.5  # a waiting newcomer looks this often whether the job finished


@dataclass
class Decision:
    """An epoch's members: their init handles in rank order, and how many newcomers had
    been admitted once it was decided (they are the last `len(newcomers)` handles)."""

    epoch: int
    handles: list[str]
    admitted: int
    newcomers: list[int] = field(default_factory=list)

    def dump(self) -> str:
        return json.dumps(
            {"handles": self.handles, "admitted": self.admitted, "newcomers": self.newcomers}
        )

    @staticmethod
    def load(epoch: int, text: bytes | str) -> Decision:
        data = json.loads(text)
        return Decision(epoch, data["handles"], data["admitted"], data["newcomers"])


def _store() -> Store:
    if state.store is None or state.default is None:
        raise RuntimeError(
            "distcomm.membership: the world is not initialized; call init_process_group"
        )
    return state.store


def pending(admitted: int) -> int:
    """How many newcomers registered beyond the `admitted` ones (one store request)."""
    return max(0, int(_store().add(_p() + "newcomers", 0)) - admitted)


def _alive_here(handle: str) -> bool | None:
    """Whether the process of `handle` still runs: True/False on this host, None (cannot
    tell) on another."""
    parsed = parse_handle(handle, "membership")
    if parsed.host != socket.gethostname():
        return None
    try:
        os.kill(parsed.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{parsed.pid}/stat", "rb") as stat:  # a zombie has ended
            return stat.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def reform(
    group: GroupHandle,
    members: list[str],
    admitted: int,
    settle: float = 1.0,
    timeout: float | timedelta | None = None,
) -> Decision:
    """Re-form the default group `group` (whose epoch's members are `members`, this
    process among them) with the members still alive and the newcomers registered so far;
    every live member calls it. Returns the new epoch's decision, once this process is in
    the new group.

    Args:
        members: the current epoch's init handles, in rank order.
        admitted: how many newcomers had been admitted by the current epoch.
        settle: seconds without a new arrival after which members not heard from (on
            another host, where their process cannot be looked at) are left out.
        timeout: bound of the whole re-forming (default: the group's timeout).

    Raises:
        DistTimeoutError: no decision within `timeout`.
    """
    store = _store()
    seconds = to_seconds(timeout) or group.timeout.total_seconds()
    end = time.monotonic() + seconds
    mine = init_handle(group)
    epoch = state.epoch + 1
    decision = _roll(store, epoch, mine, members, admitted, settle, end)
    if mine not in decision.handles:
        # decided without this process (it came late): it is a newcomer of a later epoch
        log.warning(
            "epoch %d was decided without this process (it arrived late); joining as a newcomer",
            epoch,
        )
        return join(group, timeout=max(1.0, end - time.monotonic()))
    try:
        _enter(group, decision, seconds)
    except DistError:
        # a member of the list was lost meanwhile: this epoch is spent, the next roll
        # (the caller's retry) leaves it out
        state.epoch = decision.epoch
        raise
    return decision


def _roll(
    store: Store,
    epoch: int,
    mine: str,
    members: list[str],
    admitted: int,
    settle: float,
    end: float,
) -> Decision:
    """Arrive at `epoch`'s roll and return its decision. The first arrival decides; the
    others wait for the list without asking the store in a loop, and take over deciding
    if nothing comes for a few `settle` periods (the first arrival may have died)."""
    base = f"{_p()}e/{epoch}/"
    slot = store.add(base + "n", 1) - 1
    store.set(base + f"a/{slot}", mine)
    if slot > 0:
        patience = max(4 * settle, 2.0)
        while time.monotonic() < end:
            try:
                store.wait([base + "list"], timedelta(seconds=patience))
                return Decision.load(epoch, store.get(base + "list"))
            except TimeoutError:
                log.warning(
                    "re-forming the world (epoch %d): no member list after %.1f s; "
                    "deciding it here",
                    epoch,
                    patience,
                )
                break
    arrived: list[str] = []
    seen, changed, said = 0, time.monotonic(), time.monotonic()
    while True:
        if store.check([base + "list"]):
            return Decision.load(epoch, store.get(base + "list"))
        now = time.monotonic()
        if now > end:
            raise DistTimeoutError(
                f"re-forming the world (epoch {epoch}): no member list within the "
                f"timeout; {len(arrived)} of {len(members)} members arrived"
            )
        count = int(store.add(base + "n", 0))
        if count != seen:
            seen, changed = count, now
        arrived += _arrivals(store, base, len(arrived), count)
        missing = [h for h in members if h not in arrived]
        gone = [h for h in missing if _alive_here(h) is False]
        if len(missing) == len(gone) or now - changed >= settle:
            proposal = _propose(store, epoch, members, set(arrived), admitted)
            store.compare_set(base + "list", "", proposal.dump())
            decision = Decision.load(epoch, store.get(base + "list"))
            if decision.dump() == proposal.dump():  # this one's: tell the newcomers
                for k in decision.newcomers:
                    store.set(f"{_p()}nc/{k}/epoch", str(epoch))
            return decision
        if now - said > _SAY_EVERY_S:
            said = now
            log.warning(
                "re-forming the world (epoch %d): still waiting for %d member(s) that "
                "neither arrived nor ended",
                epoch,
                len(missing) - len(gone),
            )
        time.sleep(_POLL_S)


def _arrivals(store: Store, base: str, first: int, count: int) -> list[str]:
    """The handles of arrivals first..count-1 whose slot is written, in order (a slot
    counted but not yet written ends the list: the next look takes it)."""
    found = []
    for i in range(first, count):
        key = base + f"a/{i}"
        if not store.check([key]):
            break
        found.append(store.get(key).decode())
    return found


def _propose(
    store: Store, epoch: int, members: list[str], arrived: set[str], admitted: int
) -> Decision:
    """The member list this process would decide: the old members that arrived, in their
    old order, then the newcomers registered (those whose handle is readable)."""
    kept = [h for h in members if h in arrived]
    extra = [h for h in arrived if h not in members]  # an earlier epoch's late-comers
    registered = int(store.add(_p() + "newcomers", 0))
    newcomers: list[int] = []
    handles: list[str] = []
    for k in range(admitted, registered):
        key = f"{_p()}nc/{k}"
        if not store.check([key]):
            break  # registered but not written yet: the next epoch takes it
        newcomers.append(k)
        handles.append(store.get(key).decode())
    return Decision(epoch, kept + sorted(extra) + handles, admitted + len(newcomers), newcomers)


def join(group: GroupHandle, timeout: float | timedelta | None = None) -> Decision:
    """Register this process as a newcomer and wait until a re-forming takes it in (the
    members re-form when their loop next asks, `distcomm.recovery`); returns the epoch's
    decision once this process is in the group.

    Raises:
        DistTimeoutError: not taken in within `timeout` (default: the group's timeout).
    """
    store = _store()
    seconds = to_seconds(timeout) or group.timeout.total_seconds()
    end = time.monotonic() + seconds
    k = store.add(_p() + "newcomers", 1) - 1
    if state.process_rank is None:
        state.process_rank = NEWCOMER_RANKS + k
    store.set(f"{_p()}nc/{k}", init_handle(group))
    key = f"{_p()}nc/{k}/epoch"
    log.info("registered as newcomer %d; waiting for the members to take it in", k)
    said = time.monotonic()
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise DistTimeoutError(
                f"joining the job: the members did not take this process in within "
                f"{seconds:.0f} s (newcomer {k}); their loop takes newcomers in between "
                "steps (distcomm.recovery.Manager), or call distcomm.membership.reform"
            )
        try:  # a short wait, then a look whether the job finished meanwhile
            store.wait([key], timedelta(seconds=min(_CLOSED_EVERY_S, left)))
            break
        except TimeoutError:
            if store.check([_p() + "closed"]):
                raise JobFinishedError(
                    f"joining the job: it finished before its members took this process "
                    f"in (newcomer {k}); nothing is left to do"
                ) from None
            if time.monotonic() - said > _SAY_EVERY_S:
                said = time.monotonic()
                log.warning("newcomer %d: still waiting to be taken in (%.0f s left)", k, left)
    epoch = int(store.get(key))
    decision = Decision.load(epoch, store.get(f"{_p()}e/{epoch}/list"))
    _enter(group, decision, seconds)
    return decision


def close() -> None:
    """Mark the job finished: newcomers still waiting to join, and later ones, get
    `JobFinishedError` instead of waiting (a member calls it when its loop ended)."""
    _store().set(_p() + "closed", "1")


_last: list[Decision] = []  # the decision this process last entered


def current() -> Decision | None:
    """The decision of the epoch this process is in, where it entered one (None at the
    job's start or after destroy_process_group)."""
    if _last and _last[0].epoch == state.epoch and state.epoch > 0:
        return _last[0]
    return None


def _enter(group: GroupHandle, decision: Decision, seconds: float) -> None:
    reconfigure(group, f"m{decision.epoch}", decision.handles, timeout=seconds)
    state.epoch = decision.epoch
    _last[:] = [decision]
