"""The dynamic rendezvous: one state machine kept in any Store (the c10d, etcd and file backends).

Every node of a run reads and writes one JSON blob under the key ``/rdzv/<run_id>/state``
(`RendezvousState`). A write is a `compare_set` of the exact bytes read to the new bytes:
when another node wrote in between, the swap fails, returns the current bytes, and the
step is computed again on them (optimistic concurrency; no lock is held in the store).
The steps themselves are pure functions of the state, in `state.py` (`decide`, `apply`,
`leave_round`, `drop_dead`, ...), so they can be driven and tested without a store.

A round goes through these states::

    gathering --(max_nodes joined, or min_nodes joined and the last call ended, or
                 every live node of the previous round and the wait list joined)--> complete
    complete  --(a participant calls next_rendezvous again: restart or scale-up)--> gathering
              (round + 1; the participants and the waiting nodes join it again)
    complete  --(every participant gone: shut down or dead)--> gathering (round + 1)
    any       --(set_closed)--> closed (next_rendezvous raises RendezvousClosedError)

- A node joining a gathering round becomes a participant. Once min_nodes have joined, a
  last-call window of `last_call_timeout` opens (each later arrival restarts it, as in
  torch); the round completes at once when max_nodes have joined, or when a participant
  sees the window over. A round that follows a complete one (a restart, a scale-up, the
  loss of a node) completes as soon as min_nodes have joined and every participant of
  the previous round that is still alive, and every node on the wait list, is back: nobody
  else is expected, so the last call would only delay the restart (torch waits it out).
  Ranks are then given by sorting the node ids.
- A node that arrives while the round is complete (or full) goes on the wait list;
  `num_nodes_waiting()` counts it, so the agents restart and a new round opens. A
  participant that leaves a running round (dropped for missed heartbeats, or shut down)
  ends it for the others too (`watch().round_over`): they restart without it.
- Each handler refreshes its heartbeat every `keep_alive_interval` from a daemon thread,
  from its first `next_rendezvous` until `shutdown`. Each heartbeat and join step drops the nodes
  whose heartbeat is older than ``keep_alive_interval * keep_alive_max_attempt``, so a
  killed node leaves the participants and the wait list within a few intervals. Heartbeats
  and the last-call deadline are wall-clock times, compared across hosts: the hosts'
  clocks must agree to well within that limit (NTP), as torch also assumes.
- Waiting polls: the state is read with a sleep between reads that starts at 50 ms, doubles
  up to 0.5 s, starts again at 50 ms whenever the membership changes, and never oversleeps
  the last-call deadline. A waiting node writes nothing (its heartbeat thread does).

Each completed round gets its own namespace, ``PrefixStore("/rdzv/<run_id>/round_<N>")``,
and the run one for all rounds, ``PrefixStore("/rdzv/<run_id>/run")``; old rounds' keys
are left in place.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ...config import positive_seconds
from ...deadline import Deadline
from ...errors import DistError
from ...store import Store
from .api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
    RoundView,
)
from .settings import check_node_range, settings_from_params
from .state import (
    Action,
    Limits,
    RendezvousState,
    apply,
    decide,
    drop_dead,
    in_last_call,
    leave_round,
    num_waiting,
    withdraw,
)

__all__ = ["DynamicRendezvousHandler", "create_handler"]

log = logging.getLogger("distcomm.launch.rendezvous")

_T = TypeVar("_T")

#: seconds between two reads of the state while waiting: doubles from FIRST up to MOST
_POLL_FIRST = 0.05
_POLL_MOST = 0.5
#: most seconds to back off after a lost compare_set (randomised, so contenders spread)
_CONFLICT_BACKOFF = 0.01

#: node ids of this process's handlers end with this counter, so each is unique
_node_counter = itertools.count()


def _check_seconds(name: str, value: float) -> float:
    return positive_seconds(f"--rdzv_conf {name}", value, text=False)


class DynamicRendezvousHandler(RendezvousHandler):
    """A dynamic (elastic) rendezvous kept in `store` (torch's DynamicRendezvousHandler).

    Args:
        run_id: --rdzv_id; handlers with the same id and store form rounds together.
        store: where the state lives (shared by every node of the run).
        backend_name: c10d, etcd, file, ... (returned by `get_backend`).
        min_nodes, max_nodes: --nnodes=MIN:MAX.
        local_addr: --local_addr: the host part of this node's id (default: the hostname).
        join_timeout: seconds `next_rendezvous` may take.
        last_call_timeout: seconds a round with min_nodes keeps gathering.
        close_timeout: seconds `set_closed` and `shutdown` may take.
        keep_alive_interval: seconds between heartbeats.
        keep_alive_max_attempt: heartbeats missed before a node is dropped.
        bootstrap_address: (host, port) of a TCPStore the backend serves, passed on in
            RendezvousInfo, or None.
        owned_store: a store `shutdown` closes (usually `store` itself), or None.
        hosts_store: this process serves `store` to the other nodes (the c10d host):
            `shutdown` first waits, up to close_timeout, until the other nodes have left
            (shut down or stopped heartbeating), so none loses the store mid-way.

    Raises:
        ValueError: a bad node range or timeout; the message names the flag.
    """

    def __init__(
        self,
        run_id: str,
        store: Store,
        backend_name: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        join_timeout: float = 600.0,
        last_call_timeout: float = 30.0,
        close_timeout: float = 30.0,
        keep_alive_interval: float = 5.0,
        keep_alive_max_attempt: int = 3,
        bootstrap_address: tuple[str, int] | None = None,
        owned_store: Store | None = None,
        *,
        hosts_store: bool = False,
    ) -> None:
        check_node_range(min_nodes, max_nodes)
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"--rdzv_id must be a non-empty string, got {run_id!r}")
        if not isinstance(store, Store):
            raise TypeError(f"the rendezvous needs a distcomm Store, got {type(store).__name__}")
        if (
            isinstance(keep_alive_max_attempt, bool)
            or not isinstance(keep_alive_max_attempt, int)
            or keep_alive_max_attempt < 1
        ):
            raise ValueError(
                f"--rdzv_conf keep_alive_max_attempt={keep_alive_max_attempt!r} "
                "must be a whole number >= 1"
            )
        self._run_id = run_id
        self._store = store
        self._backend = backend_name
        self._join_timeout = _check_seconds("join_timeout", join_timeout)
        self._close_timeout = _check_seconds("close_timeout", close_timeout)
        self._interval = _check_seconds("keep_alive_interval", keep_alive_interval)
        self._limits = Limits(
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            last_call_timeout=_check_seconds("last_call_timeout", last_call_timeout),
            dead_after=self._interval * keep_alive_max_attempt,
        )
        self._bootstrap_address = bootstrap_address
        self._owned_store = owned_store
        self._hosts_store = hosts_store
        self.node_id = f"{local_addr or socket.gethostname()}_{os.getpid()}_{next(_node_counter)}"
        self._key = f"/rdzv/{run_id}/state"
        self._lock = threading.Lock()  # one state transaction of this handler at a time
        self._initialized = False
        self._round: int | None = None  # the round this node last completed
        self._joined_any = False  # whether this handler ever completed a round
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._shut_down: bool | None = None  # None until shutdown, then its result

    @property
    def bootstrap_address(self) -> tuple[str, int] | None:
        """(host, port) of the TCPStore the backend serves (c10d), or None."""
        return self._bootstrap_address

    # -- the store --------------------------------------------------------------------------

    def _where(self) -> str:
        return f"the rendezvous of run {self._run_id!r} ({self._backend})"

    def _store_error(self, what: str, exc: Exception) -> RendezvousConnectionError:
        return RendezvousConnectionError(f"{self._where()}: the store failed during {what}: {exc}")

    def _load(self) -> bytes:
        """The stored state's bytes (created, fresh, by the first handler to look)."""
        if not self._initialized:
            raw = self._store.compare_set(self._key, b"", RendezvousState().encode())
            self._initialized = True
            return raw
        return self._store.get(self._key)

    def _decode(self, raw: bytes) -> RendezvousState:
        try:
            return RendezvousState.decode(raw)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RendezvousError(
                f"{self._where()}: the store key {self._key!r} does not hold a rendezvous state "
                f"({exc}); did another program write it? Use another --rdzv_id"
            ) from exc

    def _read(self, what: str) -> RendezvousState:
        """The current state (a transaction whose step changes nothing)."""
        return self._transact(lambda state: (None, False), Deadline(None), what)[0]

    def _transact(
        self, step: Callable[[RendezvousState], tuple[_T, bool]], deadline: Deadline, what: str
    ) -> tuple[RendezvousState, _T]:
        """Read the state, run `step` on it and, if it changed, compare_set it; again on a
        conflict. Returns the state (as written, or as read when unchanged) and step's result.

        Raises:
            RendezvousConnectionError: the store failed.
            RendezvousTimeoutError: other writers won every compare_set until `deadline`.
        """
        with self._lock:
            try:
                raw = self._load()
                while True:
                    state = self._decode(raw)
                    result, changed = step(state)
                    if not changed:
                        return state, result
                    new = state.encode()
                    current = self._store.compare_set(self._key, raw, new)
                    if current == new:
                        return state, result
                    if deadline.expired():
                        raise RendezvousTimeoutError(
                            f"{self._where()}: {what} could not update the state within "
                            f"{deadline.seconds or 0:.1f} s: other nodes kept changing it"
                        )
                    raw = b"" if current == raw else current  # same bytes back: key missing
                    time.sleep(random.random() * _CONFLICT_BACKOFF)
            except RendezvousError:
                raise
            except (DistError, OSError) as exc:
                raise self._store_error(what, exc) from exc

    # -- heartbeats -------------------------------------------------------------------------

    def _beat(self, state: RendezvousState) -> tuple[None, bool]:
        now = time.time()
        self._log_dropped(drop_dead(state, self.node_id, self._limits, now))
        state.last_heartbeats[self.node_id] = now
        return None, True

    def _log_dropped(self, nodes: list[str]) -> None:
        for node in nodes:
            log.warning(
                "%s: node %s missed its heartbeats for %.1f s: dropped",
                self._where(),
                node,
                self._limits.dead_after,
            )

    def _heartbeat_loop(self) -> None:
        failing = False
        while not self._stop.wait(self._interval):
            started = time.monotonic()
            try:
                self._transact(self._beat, Deadline(self._interval), "a heartbeat")
                if failing:
                    log.warning("%s: heartbeats reach the store again", self._where())
                failing = False
            except Exception as exc:  # the thread must go on: the store may come back
                if not failing:
                    log.warning(
                        "%s: heartbeat failed (retrying every %.1f s): %s",
                        self._where(),
                        self._interval,
                        exc,
                    )
                failing = True
            took = time.monotonic() - started
            if took > self._interval:
                log.warning(
                    "%s: a heartbeat of node %s took %.1f s (the store or the link to "
                    "it is slow or down); the other nodes drop a node whose "
                    "heartbeats stop for %.1f s",
                    self._where(),
                    self.node_id,
                    took,
                    self._limits.dead_after,
                )

    def _start_heartbeats(self) -> None:
        if self._heartbeat is None:
            self._heartbeat = threading.Thread(
                target=self._heartbeat_loop, name=f"rdzv-heartbeat-{self.node_id}", daemon=True
            )
            self._heartbeat.start()

    def _stop_heartbeats(self) -> None:
        self._stop.set()
        thread, self._heartbeat = self._heartbeat, None
        if thread is not None:
            thread.join(timeout=self._close_timeout)

    # -- joining ----------------------------------------------------------------------------

    def _join_step(
        self, state: RendezvousState, leaving: bool, expired: bool
    ) -> tuple[tuple[Action, RendezvousState | None], bool]:
        """One step of joining: (the action, the state before it when timing out), changed."""
        now = time.time()
        changed = leave_round(state, self.node_id) if leaving and not state.closed else False
        dropped = drop_dead(state, self.node_id, self._limits, now)
        self._log_dropped(dropped)
        changed = bool(dropped) or changed
        action = decide(state, self.node_id, self._limits, now, expired)
        before = RendezvousState.decode(state.encode()) if action is Action.TIMEOUT else None
        changed = apply(state, action, self.node_id, self._limits, now) or changed
        if changed:
            state.last_heartbeats[self.node_id] = now
        return (action, before), changed

    def _timeout_error(self, state: RendezvousState) -> RendezvousTimeoutError:
        """The error for a join timeout, `state` as this node last saw it (still in it)."""
        limits = self._limits
        sizes = f"min {limits.min_nodes}, max {limits.max_nodes}"
        if state.complete:
            why = (
                f"round {state.round} is running with {len(state.participants)} node(s) "
                f"({sizes}) and did not end to let this node in"
            )
        else:
            why = (
                f"{len(state.participants)} node(s) joined round {state.round} ({sizes}) "
                f"and {len(state.wait_list)} wait(s)"
            )
        return RendezvousTimeoutError(
            f"{self._where()} did not complete within join_timeout={self._join_timeout:g} s: "
            f"{why}; start the missing nodes with the same --rdzv_id and --rdzv_endpoint, or "
            "raise join_timeout in --rdzv_conf"
        )

    def _info(self, state: RendezvousState) -> RendezvousInfo:
        return RendezvousInfo.for_round(
            self._store,
            self._run_id,
            state.round,
            state.participants[self.node_id],
            len(state.participants),
            self._bootstrap_address,
        )

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and wait until it is complete.

        A participant of the current, complete round ends it (its workers restart or the
        run scales); nodes that arrive while a round runs wait for the next one.

        Raises:
            RendezvousClosedError: the rendezvous was closed.
            RendezvousTimeoutError: the round did not complete within join_timeout.
            RendezvousConnectionError: the store failed.
            RendezvousError: this handler was shut down.
        """
        if self._shut_down is not None:
            raise RendezvousError(f"{self._where()}: this node's handler was shut down")
        deadline = Deadline(self._join_timeout)
        self._start_heartbeats()
        leaving, seen, delay = True, None, _POLL_FIRST
        told: tuple[int, float | None] | None = None  # the last call this node logged
        while True:
            expired = deadline.expired()
            step = functools.partial(self._join_step, leaving=leaving, expired=expired)
            bound = Deadline(self._close_timeout) if expired else deadline
            state, (action, before) = self._transact(step, bound, "joining")
            leaving = False
            if action is Action.FINISH:
                self._round, self._joined_any = state.round, True
                log.info(
                    "%s: round %d complete: node %s is rank %d of %d",
                    self._where(),
                    state.round,
                    self.node_id,
                    state.participants[self.node_id],
                    len(state.participants),
                )
                return self._info(state)
            if action is Action.CLOSED:
                hint = (
                    ""
                    if self._joined_any
                    else (
                        " (if no run with this id is going on, the state is an earlier run's, "
                        "which etcd and file stores keep: use a new --rdzv_id)"
                    )
                )
                self._round = None
                raise RendezvousClosedError(
                    f"{self._where()} is closed: the run is over or was stopped, and no new "
                    f"round will form{hint}"
                )
            if action is Action.TIMEOUT:
                self._round = None
                raise self._timeout_error(before or state)
            membership = state.membership()
            if membership != seen:
                seen, delay = membership, _POLL_FIRST
            last_call = (state.round, state.deadline)
            if told != last_call and in_last_call(state, self.node_id, self._limits):
                told = last_call
                self._log_last_call(state)
            due = None  # the round's own deadline, when this node waits in it
            if state.deadline is not None and self.node_id in state.participants:
                due = max(0.0, state.deadline - time.time()) + 0.01
            delay = deadline.nap(delay, _POLL_MOST, due)

    def _log_last_call(self, state: RendezvousState) -> None:
        limits, joined = self._limits, len(state.participants)
        assert state.deadline is not None
        left = max(0.0, state.deadline - time.time())
        log.warning(
            "%s: %d node(s) joined round %d (--nnodes=%d:%d); waiting up to %s s "
            "(--rdzv_conf last_call_timeout=%g) for more before starting the workers; "
            "pass --nnodes=%d to start at once with these nodes, or a shorter "
            "last_call_timeout",
            self._where(),
            joined,
            state.round,
            limits.min_nodes,
            limits.max_nodes,
            f"{left:.0f}" if left >= 10 else f"{left:.1f}",
            limits.last_call_timeout,
            joined,
        )

    # -- the rest of the contract -----------------------------------------------------------

    def get_backend(self) -> str:
        """The backend's name (c10d, etcd, file, ...)."""
        return self._backend

    def get_run_id(self) -> str:
        """The run id (--rdzv_id)."""
        return self._run_id

    def state(self) -> RendezvousState:
        """A snapshot of the shared state, as stored (for diagnostics and tests).

        Raises:
            RendezvousConnectionError: the store failed.
        """
        return self._read("state")

    def is_closed(self) -> bool:
        """Whether the rendezvous is closed.

        Raises:
            RendezvousConnectionError: the store failed.
        """
        return self._read("is_closed").closed

    def set_closed(self) -> None:
        """Close the rendezvous: every node's next `next_rendezvous` raises
        RendezvousClosedError.

        Raises:
            RendezvousConnectionError: the store failed.
            RendezvousTimeoutError: the state could not be written within close_timeout.
        """

        def close(state: RendezvousState) -> tuple[None, bool]:
            changed = not state.closed
            state.closed = True
            return None, changed

        self._transact(close, Deadline(self._close_timeout), "set_closed")

    def num_nodes_waiting(self) -> int:
        """How many nodes wait for a round to form: the wait list (when a new round could
        take one of them) plus the participants of a gathering round; at least 1 once this
        node's own round is over (a newer round began, this node was dropped from it, or a
        member of it died or left), so that the agent rejoins.

        Raises:
            RendezvousConnectionError: the store failed.
        """
        return self.watch().nodes_waiting

    def watch(self) -> RoundView:
        """Closed, nodes waiting and whether this node's round is over, from one read.

        Raises:
            RendezvousConnectionError: the store failed.
        """
        state = self._read("watch")
        drop_dead(state, self.node_id, self._limits, time.time())  # a copy: nothing written
        count = num_waiting(state, self._limits)
        mine = self._round
        over = mine is not None and (
            state.round != mine
            or self.node_id not in state.participants
            or not all(member in state.last_heartbeats for member in state.participants)
        )
        return RoundView(
            closed=state.closed, nodes_waiting=max(1, count) if over else count, round_over=over
        )

    def shutdown(self) -> bool:
        """Stop the heartbeats, leave the participants and the wait list, close the owned
        store. Does not close the rendezvous for the others.

        Returns whether this node left the state cleanly (False when the store failed;
        the others then drop it once its heartbeats are missed).
        """
        if self._shut_down is not None:
            return self._shut_down
        self._stop_heartbeats()

        def leave(state: RendezvousState) -> tuple[None, bool]:
            changed = withdraw(state, self.node_id, self._limits, time.time())
            if state.last_heartbeats.pop(self.node_id, None) is not None:
                changed = True
            return None, changed

        ok = True
        deadline = Deadline(self._close_timeout)
        try:
            self._transact(leave, deadline, "shutdown")
            if self._hosts_store:
                self._wait_for_others_to_leave(deadline)
        except RendezvousError as exc:
            log.warning("%s: could not leave the rendezvous cleanly: %s", self._where(), exc)
            ok = False
        finally:
            self._round = None
            if self._owned_store is not None:
                self._owned_store.close()
        self._shut_down = ok
        return ok

    def _wait_for_others_to_leave(self, deadline: Deadline) -> None:
        """Poll until no other node has a live heartbeat, or `deadline` (the store's host
        keeps serving the nodes that still finish their run)."""
        delay, told = _POLL_FIRST, False
        while True:
            state = self._read("shutdown")
            drop_dead(state, self.node_id, self._limits, time.time())  # a copy
            others = len(state.last_heartbeats)
            if not others:
                return
            if deadline.expired():
                log.warning(
                    "%s: closing the store this node hosts while %d node(s) still "
                    "use it (close_timeout=%g s)",
                    self._where(),
                    others,
                    self._close_timeout,
                )
                return
            if not told:
                log.info(
                    "%s: waiting up to %g s for %d node(s) to leave before closing the "
                    "store this node hosts",
                    self._where(),
                    deadline.remaining() or 0.0,
                    others,
                )
                told = True
            delay = deadline.nap(delay, _POLL_MOST)

    def __repr__(self) -> str:
        return (
            f"DynamicRendezvousHandler(run_id={self._run_id!r}, backend={self._backend!r}, "
            f"node={self.node_id!r})"
        )


def create_handler(
    store: Store,
    params: RendezvousParameters,
    bootstrap_address: tuple[str, int] | None = None,
    *,
    owned_store: Store | None = None,
    hosts_store: bool = False,
) -> DynamicRendezvousHandler:
    """A DynamicRendezvousHandler for `params` (the --rdzv_conf values checked) over `store`.

    Raises:
        ValueError: a bad parameter; the message names the flag.
    """
    settings = settings_from_params(params)
    return DynamicRendezvousHandler(
        run_id=params.run_id,
        store=store,
        backend_name=params.backend,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        join_timeout=settings.join_timeout,
        last_call_timeout=settings.last_call_timeout,
        close_timeout=settings.close_timeout,
        keep_alive_interval=settings.keep_alive_interval,
        keep_alive_max_attempt=settings.keep_alive_max_attempt,
        bootstrap_address=bootstrap_address,
        owned_store=owned_store,
        hosts_store=hosts_store,
    )
