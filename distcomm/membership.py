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

A newcomer may die at any moment of its joining (a replacement that crashes on start is
the common case), so none is trusted to be there:

- one whose process ended on this host is never proposed;
- a list that names newcomers is only a proposal: each newcomer it names acknowledges it
  in the store, and the final list (a second compare-and-set) keeps those that did
  within a few `settle` periods (at once when every named newcomer acknowledged or is
  known to be gone). A newcomer left out registers again;
- every newcomer an epoch looked at, taken in or not, is behind that epoch's `admitted`
  count, which later epochs never go below: a newcomer that died is looked at once;
- a newcomer dies between its acknowledgement and the end of the connecting: the
  connecting fails on every process (within the re-forming's timeout, which the
  decision carries to the newcomers), the caller re-forms again (`distcomm.recovery`
  without newcomers), and the live newcomers of the failed epoch register again.

Old members are told apart from newcomers, and from their own earlier handles, by their
process (host, pid and a per-process nonce): a handle's process rank and transport
generation may change when the world is re-formed (mpi renumbers the process ranks).

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

__all__ = ["Decision", "close", "current", "decided", "join", "pending", "reform"]

log = logging.getLogger("distcomm.group")


def _p() -> str:
    """The keys' prefix: one namespace per start of the worker group (a restart of
    distcomm-run's group begins the epochs again; its replacements share the count)."""
    return f"distcomm/m/{os.environ.get('DISTCOMM_RESTART_COUNT', '0')}/"


_POLL_S = 0.02  # between looks at the roll: short, the store answers in microseconds
_SAY_EVERY_S = 30.0  # a long wait says so this often
_CLOSED_EVERY_S = 0.5  # a waiting newcomer looks this often whether the job finished
_ACK_LEAST_S = 5.0  # the least time a decision's newcomers have to acknowledge it


def _ack_patience(settle: float) -> float:
    """How long the deciding member waits for the newcomers' acknowledgements."""
    return max(4 * settle, _ACK_LEAST_S)


def _takeover_patience(settle: float) -> float:
    """How long a member waits for a list before deciding it itself."""
    return max(4 * settle, 2.0)


@dataclass
class Decision:
    """An epoch's members: their init handles in rank order, how many newcomer
    registrations had been looked at once it was decided (`admitted`; those taken in are
    `newcomers`, their registration numbers, and the last `len(newcomers)` handles), and
    how long its deciding member waits for the connecting (`connect`, seconds; the
    newcomers wait no longer)."""

    epoch: int
    handles: list[str]
    admitted: int
    newcomers: list[int] = field(default_factory=list)
    connect: float | None = None

    def dump(self) -> str:
        return json.dumps(
            {
                "handles": self.handles,
                "admitted": self.admitted,
                "newcomers": self.newcomers,
                "connect": self.connect,
            }
        )

    @staticmethod
    def load(epoch: int, text: bytes | str) -> Decision:
        data = json.loads(text)
        return Decision(
            epoch, data["handles"], data["admitted"], data["newcomers"], data.get("connect")
        )

    def newcomer_handles(self) -> dict[int, str]:
        """Registration number -> handle of each newcomer it takes in."""
        first = len(self.handles) - len(self.newcomers)
        return dict(zip(self.newcomers, self.handles[first:], strict=True))

    def without(self, dropped: list[int]) -> Decision:
        """This decision less the newcomers (registration numbers) `dropped`."""
        theirs = self.newcomer_handles()
        kept = [k for k in self.newcomers if k not in dropped]
        old = self.handles[: len(self.handles) - len(self.newcomers)]
        return Decision(
            self.epoch, old + [theirs[k] for k in kept], self.admitted, kept, self.connect
        )


def _store() -> Store:
    if state.store is None or state.default is None:
        raise RuntimeError(
            "distcomm.membership: the world is not initialized; call init_process_group"
        )
    return state.store


def pending(admitted: int) -> int:
    """How many newcomers registered beyond the `admitted` ones (one store request)."""
    return max(0, int(_store().add(_p() + "newcomers", 0)) - admitted)


def _who(handle: str) -> str:
    """The process an init handle names, whatever its process rank and generation (they
    change when the world is re-formed): its host, pid and per-process nonce."""
    return handle.split(":", 3)[-1]


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


def _epoch_key(epoch: int, name: str) -> str:
    return f"{_p()}e/{epoch}/{name}"


def decided(epoch: int) -> Decision | None:
    """Epoch `epoch`'s decision as far as it got (its final list, else the proposal the
    roll decided), or None where no list was decided: which processes that epoch's
    re-forming tried to connect (one store request or two)."""
    store = _store()
    for name in ("final", "list"):
        key = _epoch_key(epoch, name)
        if store.check([key]):
            return Decision.load(epoch, store.get(key))
    return None


def reform(
    group: GroupHandle,
    members: list[str],
    admitted: int,
    settle: float = 1.0,
    timeout: float | timedelta | None = None,
    newcomers: bool = True,
) -> Decision:
    """Re-form the default group `group` (whose epoch's members are `members`, this
    process among them) with the members still alive and the newcomers registered so far;
    every live member calls it. Returns the new epoch's decision, once this process is in
    the new group.

    Args:
        members: the current epoch's init handles, in rank order.
        admitted: how many newcomer registrations the current epoch had looked at (an
            older count is raised to the last decided epoch's).
        settle: seconds without a new arrival after which members not heard from (on
            another host, where their process cannot be looked at) are left out; a
            newcomer named in the list has a few times that (at least 5 s) to
            acknowledge it.
        timeout: bound of the whole re-forming (default: the group's timeout).
        newcomers: whether to take the registered newcomers in (False: the members that
            are left only, as after an attempt a newcomer made fail).

    Raises:
        DistTimeoutError: no decision within `timeout`, or a process of the list did not
            connect in time (the epoch is spent; the next call leaves out whoever did not
            come).
        DistError: the connecting failed otherwise.
    """
    store = _store()
    seconds = to_seconds(timeout) or group.timeout.total_seconds()
    end = time.monotonic() + seconds
    mine = init_handle(group)
    epoch = state.epoch + 1
    before = decided(epoch - 1) if epoch > 1 else None
    if before is not None:  # a newcomer looked at once is never looked at again
        admitted = max(admitted, before.admitted)
    roll = _Roll(store, epoch, settle, end, seconds)
    decision = roll.decide(mine, members, admitted, newcomers)
    if decision.newcomers:
        decision = roll.final(decision)
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
        # a process of the list was lost meanwhile, or never connected: this epoch is
        # spent, the next roll (the caller's retry) leaves it out
        state.epoch = decision.epoch
        raise
    return decision


class _Roll:
    """One epoch's roll in the store: arriving, deciding the list, and (when it names
    newcomers) the final list of those that acknowledged it."""

    def __init__(self, store: Store, epoch: int, settle: float, end: float, connect: float):
        self.store, self.epoch, self.settle, self.end = store, epoch, settle, end
        self.connect = connect
        self.base = _epoch_key(epoch, "")
        self.decider = False  # whether this process's proposal became the list

    def _load(self, name: str) -> Decision:
        return Decision.load(self.epoch, self.store.get(self.base + name))

    def decide(self, mine: str, members: list[str], admitted: int, newcomers: bool) -> Decision:
        """Arrive at the roll and return its list. The first arrival decides; the others
        wait for the list without asking the store in a loop, and take over deciding if
        nothing comes for a few `settle` periods (the first arrival may have died)."""
        store, base, epoch = self.store, self.base, self.epoch
        slot = store.add(base + "n", 1) - 1
        store.set(base + f"a/{slot}", mine)
        if slot > 0:
            patience = _takeover_patience(self.settle)
            if time.monotonic() < self.end:
                try:
                    store.wait([base + "list"], timedelta(seconds=patience))
                    return self._load("list")
                except TimeoutError:
                    log.warning(
                        "re-forming the world (epoch %d): no member list after %.1f s; "
                        "deciding it here",
                        epoch,
                        patience,
                    )
        arrived: list[str] = []
        seen, changed, said = 0, time.monotonic(), time.monotonic()
        while True:
            if store.check([base + "list"]):
                return self._load("list")
            now = time.monotonic()
            if now > self.end:
                raise DistTimeoutError(
                    f"re-forming the world (epoch {epoch}): no member list within the "
                    f"timeout; {len(arrived)} of {len(members)} members arrived. Look at "
                    "the missing members' output, or give the re-forming a longer timeout"
                )
            count = int(store.add(base + "n", 0))
            if count != seen:
                seen, changed = count, now
            arrived += _arrivals(store, base, len(arrived), count)
            here = {_who(h) for h in arrived}
            missing = [h for h in members if _who(h) not in here]
            gone = [h for h in missing if _alive_here(h) is False]
            if len(missing) == len(gone) or now - changed >= self.settle:
                proposal = self._propose(members, arrived, admitted, newcomers)
                store.compare_set(base + "list", "", proposal.dump())
                decision = self._load("list")
                if decision.dump() == proposal.dump():  # this one's: tell the newcomers
                    self.decider = True
                    for k in decision.newcomers:
                        store.set(f"{_p()}nc/{k}/epoch", str(epoch))
                return decision
            if now - said > _SAY_EVERY_S:
                said = now
                log.warning(
                    "re-forming the world (epoch %d): still waiting for %d member(s) that "
                    "neither arrived nor ended (up to %.0f s more)",
                    epoch,
                    len(missing) - len(gone),
                    self.end - now,
                )
            time.sleep(_POLL_S)

    def _propose(
        self, members: list[str], arrived: list[str], admitted: int, newcomers: bool
    ) -> Decision:
        """The list this process would decide: the old members that arrived, in their old
        order, then processes of an earlier epoch that arrived late, then the newcomers
        registered (those whose handle is written and whose process has not ended)."""
        by_who: dict[str, str] = {}
        for handle in arrived:  # as each arrived: its handle now
            by_who.setdefault(_who(handle), handle)
        old = {_who(h) for h in members}
        handles = [by_who[_who(h)] for h in members if _who(h) in by_who]
        handles += sorted(h for w, h in by_who.items() if w not in old)
        taken = {_who(h) for h in handles}
        pranks = {parse_handle(h, "membership").prank for h in handles}
        taken_in: list[int] = []
        looked = admitted
        registered = int(self.store.add(_p() + "newcomers", 0)) if newcomers else admitted
        for k in range(admitted, registered):
            key = f"{_p()}nc/{k}"
            if not self.store.check([key]):
                break  # registered but not written yet: the next epoch takes it
            looked = k + 1
            handle = self.store.get(key).decode()
            prank = parse_handle(handle, "membership").prank
            if _who(handle) in taken or prank in pranks:
                continue  # already in (a late member that also registered)
            if _alive_here(handle) is False:
                log.warning(
                    "re-forming the world (epoch %d): newcomer %d (pid %d) has ended; "
                    "leaving it out",
                    self.epoch,
                    k,
                    parse_handle(handle, "membership").pid,
                )
                continue
            taken_in.append(k)
            handles.append(handle)
            taken.add(_who(handle))
            pranks.add(prank)
        return Decision(self.epoch, handles, looked, taken_in, self.connect)

    def final(self, listed: Decision) -> Decision:
        """The final list of an epoch whose list names newcomers: those that acknowledged
        it in time. The member whose list it is waits for the acknowledgements (not for
        a newcomer whose process ended here) and writes it; the others wait for it, and
        write it themselves if it does not come (that member may have died)."""
        store, key = self.store, self.base + "final"
        patience = _ack_patience(self.settle)
        if not self.decider:
            wait = min(patience + _takeover_patience(self.settle), self.end - time.monotonic())
            try:
                store.wait([key], timedelta(seconds=max(wait, 0.1)))
                return self._load("final")
            except TimeoutError:
                log.warning(
                    "re-forming the world (epoch %d): no final member list after %.1f s; "
                    "writing it here",
                    self.epoch,
                    wait,
                )
        handles = listed.newcomer_handles()
        until = min(self.end, time.monotonic() + patience)
        while True:
            if store.check([key]):
                return self._load("final")
            acked = [k for k in listed.newcomers if store.check([self.base + f"ack/{k}"])]
            waiting = [
                k
                for k in listed.newcomers
                if k not in acked and _alive_here(handles[k]) is not False
            ]
            if not waiting or not self.decider or time.monotonic() > until:
                break
            time.sleep(_POLL_S)
        # out: those that did not acknowledge, and those that did but ended here since
        dropped = [
            k for k in listed.newcomers if k not in acked or _alive_here(handles[k]) is False
        ]
        if dropped:
            log.warning(
                "re-forming the world (epoch %d): newcomer(s) %s ended or did not "
                "acknowledge the member list within %.1f s; leaving them out (a live one "
                "registers again)",
                self.epoch,
                dropped,
                patience,
            )
        proposal = listed.without(dropped)
        store.compare_set(key, "", proposal.dump())
        decision = self._load("final")
        if decision.dump() == proposal.dump():  # tell every newcomer named, in or out
            for k in listed.newcomers:
                store.set(f"{_p()}nc/{k}/epoch", str(self.epoch))
        return decision


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


def join(group: GroupHandle, timeout: float | timedelta | None = None) -> Decision:
    """Register this process as a newcomer and wait until a re-forming takes it in (the
    members re-form when their loop next asks, `distcomm.recovery`); returns the epoch's
    decision once this process is in the group.

    A re-forming that names it waits for its acknowledgement, which it gives at once;
    when it is left out all the same (it was too slow) or the connecting fails (another
    process of the list never came), it registers again, until `timeout`.

    Raises:
        DistTimeoutError: not taken in within `timeout` (default: the group's timeout).
        JobFinishedError: the members finished their loop first.
    """
    store = _store()
    seconds = to_seconds(timeout) or group.timeout.total_seconds()
    end = time.monotonic() + seconds
    while True:
        k = store.add(_p() + "newcomers", 1) - 1
        if state.process_rank is None:
            state.process_rank = NEWCOMER_RANKS + k
        store.set(f"{_p()}nc/{k}", init_handle(group))
        log.info("registered as newcomer %d; waiting for the members to take it in", k)
        decision = _taken_in(store, k, end, seconds)
        if decision is None:
            log.warning(
                "newcomer %d: the members left it out (it did not acknowledge their list "
                "in time); registering again",
                k,
            )
            continue
        left = end - time.monotonic()
        connect = min(decision.connect or left, left)
        try:
            _enter(group, decision, max(connect, 1.0))
        except DistError as exc:
            if time.monotonic() >= end:
                raise
            log.warning(
                "newcomer %d: connecting to epoch %d failed (%s); registering again",
                k,
                decision.epoch,
                exc,
            )
            continue
        state.joined = True
        return decision


def _taken_in(store: Store, k: int, end: float, seconds: float) -> Decision | None:
    """Wait until a list names newcomer `k`, acknowledge it, and return the final list
    when `k` is in it (None when it was left out)."""
    _await(store, f"{_p()}nc/{k}/epoch", k, end, seconds, "to be taken in")
    epoch = int(store.get(f"{_p()}nc/{k}/epoch"))
    listed = Decision.load(epoch, store.get(_epoch_key(epoch, "list")))
    if k not in listed.newcomers:
        return None
    store.set(_epoch_key(epoch, f"ack/{k}"), "1")
    _await(store, _epoch_key(epoch, "final"), k, end, seconds, "for the final member list")
    final = Decision.load(epoch, store.get(_epoch_key(epoch, "final")))
    return final if k in final.newcomers else None


def _await(store: Store, key: str, k: int, end: float, seconds: float, what: str) -> None:
    """Wait for `key` as newcomer `k`, looking whether the job finished meanwhile."""
    said = time.monotonic()
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise DistTimeoutError(
                f"joining the job: the members did not take this process in within "
                f"{seconds:.0f} s (newcomer {k}); their loop takes newcomers in between "
                "steps (distcomm.recovery.Manager), or call distcomm.membership.reform. "
                "Give init_process_group a longer timeout if they are busy that long"
            )
        try:  # a short wait, then a look whether the job finished meanwhile
            store.wait([key], timedelta(seconds=min(_CLOSED_EVERY_S, left)))
            return
        except TimeoutError:
            if store.check([_p() + "closed"]):
                raise JobFinishedError(
                    f"joining the job: it finished before its members took this process "
                    f"in (newcomer {k}); nothing is left to do"
                ) from None
            if time.monotonic() - said > _SAY_EVERY_S:
                said = time.monotonic()
                log.warning("newcomer %d: still waiting %s (%.0f s left)", k, what, left)


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
