"""The dynamic rendezvous's shared state and its steps, as pure functions of the state.

`RendezvousState` is the shared state of a run (one JSON blob in the store, written by
the node that holds the chair: `chair.py`). `decide` says what a joining node does next;
`apply`, `leave_round`, `withdraw` and `drop_dead` change a state in place and say
whether they did; `summarize` is what the other nodes read. Nothing here touches a store,
a clock or a thread: the chair passes the time in. Keep it so: it is what lets the tests
drive every transition, race and failure without a process.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field

__all__ = [
    "Action",
    "Limits",
    "RendezvousState",
    "apply",
    "decide",
    "drop_dead",
    "everyone_back",
    "in_last_call",
    "leave_round",
    "num_waiting",
    "summarize",
    "withdraw",
]


@dataclass
class RendezvousState:
    """The shared state of a run's rendezvous (stored as one JSON blob).

    Attributes:
        round: the current round's number.
        complete: whether the current round has completed (its ranks are given).
        closed: whether the rendezvous is closed for good.
        participants: node id -> rank (-1 while the round is gathering).
        wait_list: nodes that arrived while the round was complete (or full), in order.
        deadline: wall-clock time at which the last call of a gathering round ends, or None.
        last_heartbeats: node id -> the chair's wall-clock time when it last saw the
            node's heartbeat change (or the node ask something).
        previous: the participants of the complete round this gathering round follows
            (empty for a first round, or once complete): when every one of them still
            alive has joined again, the round completes without waiting for its last call.
        pending: node id -> the number of its `next_rendezvous` call, for every node that
            waits for an answer (a rank, or closed): the chair answers under that number.
        applied: how many requests the chairs have folded into this state, all told.
    """

    round: int = 0
    complete: bool = False
    closed: bool = False
    participants: dict[str, int] = field(default_factory=dict)
    wait_list: list[str] = field(default_factory=list)
    deadline: float | None = None
    last_heartbeats: dict[str, float] = field(default_factory=dict)
    previous: list[str] = field(default_factory=list)
    pending: dict[str, int] = field(default_factory=dict)
    applied: int = 0

    def encode(self) -> bytes:
        """The state as the canonical JSON bytes kept in the store."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> RendezvousState:
        """The state from its stored bytes (empty bytes: a fresh state).

        Raises:
            ValueError: the bytes are not a rendezvous state.
        """
        if not raw:
            return cls()
        data = json.loads(raw)
        return cls(
            round=int(data["round"]),
            complete=bool(data["complete"]),
            closed=bool(data["closed"]),
            participants={str(k): int(v) for k, v in data["participants"].items()},
            wait_list=[str(node) for node in data["wait_list"]],
            deadline=None if data["deadline"] is None else float(data["deadline"]),
            last_heartbeats={str(k): float(v) for k, v in data["last_heartbeats"].items()},
            previous=[str(node) for node in data.get("previous", [])],
            pending={str(k): int(v) for k, v in data.get("pending", {}).items()},
            applied=int(data.get("applied", 0)),
        )

    def membership(self) -> tuple[object, ...]:
        """Everything but the heartbeats: what a waiting node watches for changes."""
        return (
            self.round,
            self.complete,
            self.closed,
            sorted(self.participants.items()),
            tuple(self.wait_list),
            self.deadline,
            tuple(self.previous),
        )


@dataclass(frozen=True)
class Limits:
    """The settings the steps need.

    Attributes:
        min_nodes, max_nodes: the size range of a round.
        last_call_timeout: seconds a round with min_nodes keeps gathering.
        dead_after: seconds without a heartbeat after which a node is dropped.
    """

    min_nodes: int
    max_nodes: int
    last_call_timeout: float
    dead_after: float


class Action(enum.Enum):
    """What a joining node does next (`decide`'s answer).

    FINISH: the round is complete with this node in it. WAIT: nothing to write; read the
    state again later. JOIN: become a participant of the gathering round. ENTER_WAIT_LIST:
    wait for the complete (or full) round to end. COMPLETE: end the last call, give the
    ranks. TIMEOUT: leave the lists and raise RendezvousTimeoutError. CLOSED: raise
    RendezvousClosedError.
    """

    FINISH = "finish"
    WAIT = "wait"
    JOIN = "join"
    ENTER_WAIT_LIST = "enter_wait_list"
    COMPLETE = "complete"
    TIMEOUT = "timeout"
    CLOSED = "closed"


def _open_next_round(state: RendezvousState, previous: list[str] | None = None) -> None:
    state.round += 1
    state.complete = False
    state.participants = {}
    state.deadline = None
    state.previous = sorted(previous or [])


def _refresh_deadline(state: RendezvousState, limits: Limits, now: float) -> None:
    """A gathering round's last call runs while it has min_nodes, and only then."""
    if state.complete:
        return
    if len(state.participants) < limits.min_nodes:
        state.deadline = None
    elif state.deadline is None:
        state.deadline = now + limits.last_call_timeout


def _complete_round(state: RendezvousState) -> None:
    state.participants = {node: rank for rank, node in enumerate(sorted(state.participants))}
    state.complete = True
    state.deadline = None
    state.previous = []


def everyone_back(state: RendezvousState, limits: Limits) -> bool:
    """Whether a gathering round that follows a complete one has every node it can expect:
    min_nodes at least, every participant of the previous round that is still alive (has a
    heartbeat) and every node of the wait list. Such a round need not wait for its last
    call: nobody else is known to be coming (a restart, a scale-up, or the survivors of a
    lost node once the dead one is dropped)."""
    if state.complete or not state.previous or len(state.participants) < limits.min_nodes:
        return False
    return not state.wait_list and not _previous_still_coming(state)


def _previous_still_coming(state: RendezvousState) -> bool:
    """Whether a participant of the previous round that is still alive (has a heartbeat)
    has not joined the current round yet."""
    return any(
        node in state.last_heartbeats and node not in state.participants for node in state.previous
    )


def in_last_call(state: RendezvousState, node: str, limits: Limits) -> bool:
    """Whether `node` waits in a gathering round only for its last call to end: min_nodes
    have joined it, `node` among them, fewer than max_nodes, and no live node of the
    previous round is still to come back (the round completes when it does)."""
    if state.complete or state.deadline is None or node not in state.participants:
        return False
    return len(state.participants) < limits.max_nodes and not _previous_still_coming(state)


def leave_round(state: RendezvousState, node: str) -> bool:
    """A participant of a complete round asks for the next one: the round is over.

    Returns whether the state changed (a new, empty round opened).
    """
    if state.complete and node in state.participants:
        _open_next_round(state, list(state.participants))
        return True
    return False


def _members_gone(state: RendezvousState) -> bool:
    """Whether a complete round has no live member left (none keeps a heartbeat)."""
    return state.complete and not any(n in state.last_heartbeats for n in state.participants)


def withdraw(state: RendezvousState, node: str, limits: Limits, now: float) -> bool:
    """Take `node` out of the wait list and out of the round.

    A gathering round loses the participant (and ends its last call if it drops below
    min_nodes). A complete round keeps it: its ranks and world size were handed out, and
    every member must read the same ones however late it looks; the member loses its
    heartbeat instead, and once no member has one the next round opens, so waiting nodes
    can form it. Returns whether the state changed.
    """
    changed = False
    if node in state.wait_list:
        state.wait_list.remove(node)
        changed = True
    if node not in state.participants:
        return changed
    if state.complete:
        if state.last_heartbeats.pop(node, None) is not None:
            changed = True
        if _members_gone(state):
            _open_next_round(state)
            changed = True
        return changed
    del state.participants[node]
    _refresh_deadline(state, limits, now)
    return True


def drop_dead(state: RendezvousState, node: str, limits: Limits, now: float) -> list[str]:
    """Withdraw every node but `node` whose last heartbeat is older than `limits.dead_after`
    (and forget the heartbeat).

    Returns the nodes dropped now (empty: the state did not change).
    """
    known = set(state.participants) | set(state.wait_list) | set(state.last_heartbeats)
    dropped = []
    for other in sorted(known - {node}):
        if now - state.last_heartbeats.get(other, float("-inf")) <= limits.dead_after:
            continue
        changed = withdraw(state, other, limits, now)
        if state.last_heartbeats.pop(other, None) is not None or changed:
            dropped.append(other)
    return dropped


def decide(state: RendezvousState, node: str, limits: Limits, now: float, expired: bool) -> Action:
    """The next action of `node`, which wants to be in a complete round.

    Args:
        expired: whether the node's join timeout has passed.
    """
    if state.closed:
        return Action.CLOSED
    member = node in state.participants
    if state.complete and member:
        return Action.FINISH
    if expired:
        return Action.TIMEOUT
    if state.complete or len(state.participants) >= limits.max_nodes:
        return Action.WAIT if node in state.wait_list else Action.ENTER_WAIT_LIST
    if not member:
        return Action.JOIN
    if (
        len(state.participants) >= limits.min_nodes
        and state.deadline is not None
        and now >= state.deadline
    ) or everyone_back(state, limits):
        return Action.COMPLETE
    return Action.WAIT


def apply(state: RendezvousState, action: Action, node: str, limits: Limits, now: float) -> bool:
    """Carry out `action` for `node` on `state`; returns whether the state changed."""
    if action is Action.JOIN:
        if node in state.wait_list:
            state.wait_list.remove(node)
        state.participants[node] = -1
        state.last_heartbeats[node] = now
        if len(state.participants) >= limits.max_nodes or everyone_back(state, limits):
            _complete_round(state)
        elif len(state.participants) >= limits.min_nodes:
            state.deadline = now + limits.last_call_timeout  # each arrival restarts it
        return True
    if action is Action.ENTER_WAIT_LIST:
        state.wait_list.append(node)
        state.last_heartbeats[node] = now
        return True
    if action is Action.COMPLETE:
        _complete_round(state)
        return True
    if action is Action.TIMEOUT:
        return withdraw(state, node, limits, now)
    return False


def num_waiting(state: RendezvousState, limits: Limits) -> int:
    """Nodes waiting for a round to form: the wait list (when a new round could take
    one of them beside the complete round's live members), plus the participants of a
    gathering round."""
    if state.complete:
        live = sum(1 for member in state.participants if member in state.last_heartbeats)
        return len(state.wait_list) if live < limits.max_nodes else 0
    return len(state.participants) + len(state.wait_list)


def summarize(state: RendezvousState, limits: Limits) -> dict[str, object]:
    """What a node that is not the chair reads of the state (a few dozen bytes, whatever
    the number of nodes): the round, whether it is complete or closed, how many nodes
    joined it and wait for the next, its last call, and whether a member of the complete
    round is lost (its heartbeats stopped, or it shut down)."""
    lost = state.complete and not all(m in state.last_heartbeats for m in state.participants)
    return {
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "joined": len(state.participants),
        "listed": len(state.wait_list),
        "waiting": num_waiting(state, limits),
        "deadline": state.deadline,
        "last_call": state.deadline is not None
        and not state.complete
        and len(state.participants) < limits.max_nodes
        and not _previous_still_coming(state),
        "lost": lost,
        "live": len(state.last_heartbeats),
    }
