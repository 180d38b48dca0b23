"""The chair of a dynamic rendezvous: the one node that folds every node's requests into
the shared state, so that no node contends for it.

Why a chair: when every node rewrote one shared state by compare-and-swap (torch's
design, and ours before), N nodes made N² failed swaps per round, each carrying a state
of N nodes, and heartbeats starved behind joins until live nodes were dropped. Here each
node costs the store O(1) requests per round and per heartbeat period, whatever N:

- a node asks by pushing a `Request` on one queue (one request) and waits for its answer
  under its own key (one blocking wait, one read);
- a node's heartbeat is its own key, set without compare-and-swap; with it, once per
  keep-alive interval, the node reads the chair's key (and takes the chair when it is
  vacant or its holder stopped refreshing it): two requests per interval;
- the chair drains the queue, applies the requests with the pure steps of `state.py`,
  reads every node's heartbeat in one `multi_get` per interval, and writes the state
  (one compare_set) only when a round completes or ends, a node leaves, or, at most once
  per interval, when its membership changed; with the state a small summary (what
  `watch()` reads) and, at completion, every member's answer in one `multi_set`.

Any node can be the chair: the first to find the chair's key vacant takes it, and when the
chair stops refreshing it for keep_alive_interval * keep_alive_max_attempt, another node
takes it over by compare_set, loads the stored state and goes on (a request the old chair
had taken but not written is pushed again by its node: requests are idempotent). Every
write of the state is a compare_set of the bytes the chair last wrote, so a chair that was
replaced while it stalled finds out at its next write and steps down.

The state blob goes through a `slot.StateSlot`: the store key below, or a torch-style
`RendezvousBackend` (its token-CAS is exactly the chair's compare_set; only the chair
calls it, once per write). The store keys, under ``/rdzv/<run_id>/`` (`Keys`): ``state``
(the JSON state, unless a backend keeps it),
``summary``, ``chair`` ("<node id> <wall time>", or empty while vacant), ``closed``,
``requests`` (a queue), ``hb/<node id>`` and ``answer/<node id>/<call>``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...store import Store
from .slot import StateSlot, StoreSlot, peek
from .state import (
    Action,
    Limits,
    RendezvousState,
    apply,
    decide,
    drop_dead,
    leave_round,
    summarize,
    withdraw,
)

__all__ = ["WAKE", "WRITE_GAP", "Chair", "Keys", "Request", "StateConflict", "peek"]

log = logging.getLogger("distcomm.launch.rendezvous")

#: a queue item that only wakes the chair (a node that stops its own chair's thread)
WAKE = b"wake"
#: fewest seconds between two writes of a state whose membership changed (a write that is
#: due anyway, with answers or an acknowledged leave, goes at once)
WRITE_GAP = 0.1


@dataclass(frozen=True)
class Keys:
    """The store keys of one run's rendezvous."""

    run_id: str

    @property
    def root(self) -> str:
        return f"/rdzv/{self.run_id}"

    @property
    def state(self) -> str:
        return f"{self.root}/state"

    @property
    def summary(self) -> str:
        return f"{self.root}/summary"

    @property
    def chair(self) -> str:
        return f"{self.root}/chair"

    @property
    def closed(self) -> str:
        return f"{self.root}/closed"

    @property
    def requests(self) -> str:
        return f"{self.root}/requests"

    def heartbeat(self, node: str) -> str:
        return f"{self.root}/hb/{node}"

    def answer(self, node: str, call: int) -> str:
        return f"{self.root}/answer/{node}/{call}"


@dataclass(frozen=True)
class Request:
    """What a node asks the chair.

    Attributes:
        node: the node's id.
        call: the number of the node's `next_rendezvous` (or `shutdown`) call: the chair
            answers under ``answer/<node>/<call>``.
        op: "join" (a place in a complete round; a member of the complete round ends it)
            or "leave" (shutdown: out of the lists, heartbeat forgotten).
        expired: a join whose join timeout passed: the node leaves the lists unless the
            round completed with it (then it gets its rank after all).
        after: for a join, the round the node last completed (None: none): when that
            round is the current one and complete, the join ends it (a restart). Naming
            the round makes a request pushed twice (after a change of chair) end it once.
    """

    node: str
    call: int
    op: str
    expired: bool = False
    after: int | None = None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "node": self.node,
                "call": self.call,
                "op": self.op,
                "expired": self.expired,
                "after": self.after,
            }
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Request | None:
        """The request, or None for bytes that are not one (skipped, and logged)."""
        try:
            data = json.loads(raw)
            after = data.get("after")
            request = cls(
                str(data["node"]),
                int(data["call"]),
                str(data["op"]),
                bool(data.get("expired", False)),
                None if after is None else int(after),
            )
        except (ValueError, KeyError, TypeError):
            return None
        return request if request.op in ("join", "leave") else None


class StateConflict(Exception):
    """The stored state is not the one this chair last wrote (another chair took over, or a
    node closed the rendezvous)."""


def _signature(state: RendezvousState) -> tuple[object, ...]:
    """What a write must carry: everything but the heartbeats' times."""
    return (state.membership(), sorted(state.last_heartbeats), sorted(state.pending.items()))


class Chair:
    """The chair's work on one store: load the state, then `serve` passes.

    Not thread-safe: one thread (the node's heartbeat thread, or `shutdown`) drives it.

    Args:
        store: the rendezvous store.
        queue_store: a connection to it for the queue's pops (which may wait).
        keys: the run's keys.
        limits: the node range and times.
        node: this node's id.
        decode: bytes -> RendezvousState (raises a RendezvousError for foreign bytes).
        on_dropped: called with the nodes drop_dead removed (for the log line).
        read_every: seconds between two reads of the heartbeats (the caller's schedule).
        slot: where the state blob lives (default: the store key ``keys.state``; a
            `BackendSlot` for a torch-style RendezvousBackend). Only the blob moves:
            the queue, heartbeats, summary and answers stay in `store`.
    """

    def __init__(
        self,
        store: Store,
        queue_store: Store,
        keys: Keys,
        limits: Limits,
        node: str,
        decode: Callable[[bytes], RendezvousState],
        on_dropped: Callable[[list[str]], None],
        read_every: float = 0.0,
        slot: StateSlot | None = None,
    ) -> None:
        self._store = store
        self._slot = slot if slot is not None else StoreSlot(store, keys.state)
        self._queue_store = queue_store
        self._keys = keys
        self._limits = limits
        self._node = node
        self._decode = decode
        self._on_dropped = on_dropped
        self._read_every = read_every
        self._raw = b""
        self.state = RendezvousState()
        self._written: tuple[object, ...] | None = None
        self._unwritten = False  # the state changed since the last write (as of the last pass)
        self._summary: dict[str, object] | None = None
        self._requests: list[Request] = []  # taken from the queue since the last write
        #: node -> the heartbeat value the chair last read (None: not read since it asked)
        self._seen: dict[str, bytes | None] = {}
        self._due_write = False
        self._next_write = 0.0  # monotonic time before which a changed state may wait

    def load(self) -> None:
        """Read the stored state (create a fresh one where there is none)."""
        self._raw = self._slot.swap(b"", RendezvousState().encode())
        self.state = self._decode(self._raw)
        self._written = _signature(self.state)
        self._requests = []
        self._seen = {}
        beats = self.state.last_heartbeats
        others = sorted(set(beats) - {self._node})
        if others:  # a node's own clock, once: when it last beat, as far as it can tell
            now = time.time()
            values = self._store.multi_get([self._keys.heartbeat(node) for node in others])
            for node, value in zip(others, values, strict=True):
                self._seen[node] = value
                try:
                    beats[node] = min(now, float(value))
                except ValueError:
                    beats[node] = now
            self._drop_dead(now)
        self._unwritten = _signature(self.state) != self._written

    # -- one pass -------------------------------------------------------------------------

    def serve(self, heartbeats: bool) -> None:
        """Take every queued request, apply it, settle the round and write what changed.

        Args:
            heartbeats: read every known node's heartbeat and drop the dead (twice per
                keep-alive interval), and write the state if anything changed since the
                last write.

        Raises:
            StateConflict: the stored state changed under this chair; `load` again (when
                the chair is still this node's) or step down.
        """
        taken = self._take()
        now = time.time()
        if heartbeats:
            self._read_heartbeats(now)
            if not self.state.closed and self._store.check([self._keys.closed]):
                raise StateConflict("the rendezvous was closed")
        answers = self._apply(taken, now)
        signature = _signature(self.state)
        self._unwritten = signature != self._written
        if (
            answers
            or self._due_write
            or (self._unwritten and (heartbeats or time.monotonic() >= self._next_write))
        ):
            self._write(signature)
            self._publish(answers)  # the summary never runs ahead of the stored state

    def _take(self) -> list[Request]:
        """Every queued request. The queue's length first, then that many pops that may
        wait (a pop that must not wait gets little time to answer at a busy store, and the
        item it took would be lost with its answer)."""
        taken: list[Request] = []
        store, key = self._queue_store, self._keys.requests
        for _ in range(store.queue_len(key)):
            raw = store.queue_pop(key)
            if raw == WAKE:
                continue
            request = Request.decode(raw)
            if request is None:
                log.warning(
                    "rendezvous %r: skipped a request that is not one: %r",
                    self._keys.run_id,
                    raw[:80],
                )
                continue
            taken.append(request)
            self._requests.append(request)  # kept until written, whatever fails next
        return taken

    def _read_heartbeats(self, now: float) -> None:
        """Read every known node's heartbeat and drop the nodes whose heartbeat has not
        moved for dead_after. A heartbeat counts when the chair sees its value change, at
        the chair's own time less what the node says it is old, up to one period between
        reads: a busy store that delivers heartbeats late does not make live nodes look
        dead, and clocks that disagree shift a drop by one period at most. Only a new
        chair takes a node's time as it is, once (`load`)."""
        state = self.state
        state.last_heartbeats[self._node] = now
        others = sorted(set(state.last_heartbeats) - {self._node})
        if others:
            values = self._store.multi_get([self._keys.heartbeat(node) for node in others])
            for node, value in zip(others, values, strict=True):
                if self._seen.get(node) != value:
                    if node in self._seen:
                        state.last_heartbeats[node] = now - self._credit(value, now)
                    self._seen[node] = value
        self._drop_dead(now)

    def _credit(self, value: bytes, now: float) -> float:
        """How long before this read the node says it beat (the time it wrote), believed
        up to one period between two reads: a clock off by more costs that much at most."""
        try:
            said = now - float(value)
        except ValueError:
            return 0.0
        return min(max(said, 0.0), self._read_every)

    def _drop_dead(self, now: float) -> None:
        dropped = drop_dead(self.state, self._node, self._limits, now)
        for node in dropped:
            self.state.pending.pop(node, None)
            self._seen.pop(node, None)
        if dropped:
            self._on_dropped(dropped)

    def _apply(self, taken: list[Request], now: float) -> dict[str, bytes]:
        """Fold `taken` into the state and settle every pending node; the answers due."""
        state, answers = self.state, {}
        for request in taken:
            state.applied += 1
            if request.op == "leave":
                withdraw(state, request.node, self._limits, now)
                state.last_heartbeats.pop(request.node, None)
                state.pending.pop(request.node, None)
                answers[self._keys.answer(request.node, request.call)] = b'{"left":true}'
                self._due_write = True
                continue
            state.last_heartbeats[request.node] = now
            self._seen.setdefault(request.node, None)  # its next heartbeat read counts
            if not state.closed and request.after == state.round:
                leave_round(state, request.node)
            if request.expired:
                action = decide(state, request.node, self._limits, now, expired=True)
                if action is Action.TIMEOUT:
                    summary = json.dumps({"timeout": summarize(state, self._limits)})
                    apply(state, action, request.node, self._limits, now)
                    state.pending.pop(request.node, None)
                    answers[self._keys.answer(request.node, request.call)] = summary.encode()
                    self._due_write = True
                    continue
            state.pending[request.node] = request.call
        answers.update(self._settle(now))
        return answers

    def _settle(self, now: float) -> dict[str, bytes]:
        """Take every pending node as far as it goes now: join, complete, finish."""
        state, answers = self.state, {}
        moved = True
        while moved:
            moved = False
            for node in list(state.pending):
                action = decide(state, node, self._limits, now, expired=False)
                if action is Action.FINISH:
                    key = self._keys.answer(node, state.pending.pop(node))
                    answers[key] = json.dumps(
                        {
                            "round": state.round,
                            "rank": state.participants[node],
                            "size": len(state.participants),
                        }
                    ).encode()
                elif action is Action.CLOSED:
                    answers[self._keys.answer(node, state.pending.pop(node))] = b'{"closed":true}'
                elif action is not Action.WAIT:
                    apply(state, action, node, self._limits, now)
                    moved = True
        if answers:
            self._due_write = True
        return answers

    # -- writing --------------------------------------------------------------------------

    def _write(self, signature: tuple[object, ...] | None = None) -> None:
        """Write the state (`signature`: its `_signature`, when the caller has it)."""
        new = self.state.encode()
        current = self._slot.swap(self._raw, new)
        if current != new:
            raise StateConflict("another node wrote the state")
        self._raw, self._written = new, signature or _signature(self.state)
        self._requests, self._due_write, self._unwritten = [], False, False
        self._next_write = time.monotonic() + WRITE_GAP

    def _publish(self, answers: dict[str, bytes]) -> None:
        summary = summarize(self.state, self._limits)
        if summary != self._summary:
            self._store.set(self._keys.summary, json.dumps(summary))
            self._summary = summary
        if answers:
            keys = list(answers)
            self._store.multi_set(keys, [answers[key] for key in keys])

    def reload(self) -> None:
        """After a StateConflict while still the chair: load the stored state and apply the
        requests this chair had taken since its last write again (they were not written)."""
        taken, self._requests = self._requests, []
        self.load()
        answers = self._apply(taken, time.time())
        self._requests = taken
        self._write()
        self._summary = None
        self._publish(answers)

    def due(self) -> float | None:
        """Seconds until the chair must make a pass though no request comes (the gathering
        round's last call ends, or a changed state waits to be written), or None."""
        due = None
        if self.state.deadline is not None and not self.state.complete:
            due = max(0.0, self.state.deadline - time.time()) + 0.01
        if self._unwritten:
            gap = max(0.0, self._next_write - time.monotonic())
            due = gap if due is None else min(due, gap)
        return due
