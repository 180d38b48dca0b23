"""The dynamic rendezvous: one state machine kept in any Store (the c10d, etcd and file backends).

The shared state is one JSON blob under ``/rdzv/<run_id>/state`` (`RendezvousState`), and
its steps are pure functions of it, in `state.py` (`decide`, `apply`, `leave_round`,
`drop_dead`, ...), so they can be driven and tested without a store. One node at a time,
the chair (`chair.py`), applies them: every other node asks through a queue and reads
its answer under a key of its own. A node costs the store O(1) requests per round and
per heartbeat period, whatever the number of nodes (torch's design, where every node
rewrites the blob by compare-and-swap, costs O(N) each and starves heartbeats past a few
hundred nodes):

- joining: one push of the request, one blocking wait for the answer (a second one when
  the round takes longer than keep_alive_interval * keep_alive_max_attempt), one read;
- each keep_alive_interval: one write of the node's heartbeat key and, every other
  interval, one read of the chair's key (taking the chair when it is vacant or its
  holder went silent);
- `watch()` / `num_nodes_waiting()`: one read of the chair's summary, a few dozen bytes;
- the chair: two reads of every heartbeat per interval (`multi_get`), its queue, and a
  write of the state only when a round completes or ends, a node leaves or times out,
  or the membership changed (at most every 0.1 s).

A round goes through these states::

    gathering --(max_nodes joined, or min_nodes joined and the last call ended, or
                 every live node of the previous round and the wait list joined)--> complete
    complete  --(a participant calls next_rendezvous again: restart or scale-up)--> gathering
              (round + 1; the participants and the waiting nodes join it again)
    complete  --(every participant gone: shut down or dead)--> gathering (round + 1)
    any       --(set_closed)--> closed (next_rendezvous raises RendezvousClosedError)

- A node joining a gathering round becomes a participant. Once min_nodes have joined, a
  last-call window of `last_call_timeout` opens (each later arrival restarts it, as in
  torch); the round completes at once when max_nodes have joined, or when the window is
  over. A round that follows a complete one (a restart, a scale-up, the loss of a node)
  completes as soon as min_nodes have joined and every participant of the previous round
  that is still alive, and every node on the wait list, is back: nobody else is
  expected, so the last call would only delay the restart (torch waits it out). Ranks
  are then given by sorting the node ids, and the round's size is fixed: a member lost
  from a complete round (dropped for missed heartbeats, or shut down) keeps its rank in
  the stored state and ends the round for everyone (`watch().round_over`); the others
  restart without it. A complete round never shrinks.
- A node that arrives while the round is complete (or full) goes on the wait list;
  `num_nodes_waiting()` counts it, so the agents restart and a new round opens.
- Each handler writes its heartbeat every `keep_alive_interval` from a daemon thread, from
  its first `next_rendezvous` until `shutdown`; that thread also does the chair's work
  while the node holds the chair. The chair drops a node whose heartbeat has not changed
  for ``keep_alive_interval * keep_alive_max_attempt`` (its own clock: the hosts' clocks
  are compared only when a new chair takes over, from the times nodes wrote), so a killed
  node leaves the participants and the wait list within a few intervals. The last-call
  deadline is the chair's wall-clock time.

The state blob may instead live in a torch-style `RendezvousBackend`
(`DynamicRendezvousHandler.from_backend`, `create_handler(store, backend, params)`): the
chair reads and writes it through the backend's token-CAS (`slot.BackendSlot`), while
requests, heartbeats, the summary and answers still go through `store`, so the costs above
are unchanged and the backend sees O(1) calls per change, from one node.

Each completed round gets its own namespace, ``PrefixStore("/rdzv/<run_id>/round_<N>")``,
and the run one for all rounds, ``PrefixStore("/rdzv/<run_id>/run")``; old rounds' keys,
heartbeats and answers are left in place.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

from ... import config
from ...config import positive_seconds
from ...deadline import Deadline
from ...errors import DistError, DistStoreTimeoutError
from ...store import Store
from .api import (
    RendezvousBackend,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeout,
    RendezvousTimeoutError,
    RoundView,
    check_node_counts,
)
from .chair import WAKE, Chair, Keys, Request, StateConflict, peek
from .settings import settings_from_params
from .slot import BackendSlot, StateSlot, StoreSlot
from .state import Limits, RendezvousState, summarize

__all__ = [
    "DynamicRendezvousHandler",
    "HandlerSettings",
    "create_handler",
    "create_store_handler",
]

log = logging.getLogger("distcomm.launch.rendezvous")

_T = TypeVar("_T")

#: seconds between two reads while the store's host waits for the others to leave:
#: doubles from FIRST up to MOST
_POLL_FIRST = 0.05
_POLL_MOST = 0.5
#: seconds a join waits for its answer before it looks whether the round waits out a
#: last call (to say so)
_FIRST_LOOK = 0.25

#: node ids of this process's handlers end with this counter, so each is unique
_node_counter = itertools.count()


def _check_seconds(name: str, value: float) -> float:
    return positive_seconds(f"--rdzv_conf {name}", value, text=False)


@dataclass(frozen=True)
class HandlerSettings:
    """A dynamic handler's settings (torch's handler has them as ``settings``)."""

    run_id: str
    min_nodes: int
    max_nodes: int
    timeout: RendezvousTimeout
    keep_alive_interval: timedelta
    keep_alive_max_attempt: int


class DynamicRendezvousHandler(RendezvousHandler):
    """A dynamic (elastic) rendezvous kept in `store` (torch's DynamicRendezvousHandler).

    Args:
        run_id: --rdzv_id; handlers with the same id and store form rounds together.
        store: where the state lives (shared by every node of the run); it needs queues
            (`queue_push`, `queue_pop`, `queue_len`), which every distcomm store has.
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
        state_backend: a torch-style `RendezvousBackend` that keeps the state blob in
            place of the store key ``/rdzv/<run_id>/state`` (see `from_backend`), or None.

    Raises:
        ValueError: a bad node range or timeout; the message names the flag.
        TypeError: `store` is not a distcomm Store, or `state_backend` not a
            RendezvousBackend.
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
        state_backend: RendezvousBackend | None = None,
    ) -> None:
        check_node_counts(min_nodes, max_nodes)
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
        if state_backend is not None and not isinstance(state_backend, RendezvousBackend):
            raise TypeError(
                f"the rendezvous state backend must be a RendezvousBackend (get_state, "
                f"set_state, name), got {type(state_backend).__name__}"
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
        self._max_attempts = keep_alive_max_attempt
        self._share_store = not config.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
        self._timeout: RendezvousTimeout | None = None  # the one from_backend was given
        self._bootstrap_address = bootstrap_address
        self._owned_store = owned_store
        self._hosts_store = hosts_store
        self.node_id = f"{local_addr or socket.gethostname()}_{os.getpid()}_{next(_node_counter)}"
        self._keys = Keys(run_id)
        self._slot: StateSlot = (StoreSlot(store, self._keys.state) if state_backend is None
                                 else BackendSlot(state_backend))
        self._round: int | None = None  # the round this node last completed
        self._joined_any = False  # whether this handler ever completed a round
        self._calls = 0  # requests this node made: each is answered under its number
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None  # heartbeats and the chair's passes
        self._chair: Chair | None = None  # while this node holds the chair
        self._chair_raw = b""  # the chair key's value this node last wrote
        self._chair_store: Store | None = None  # the chair's connection for blocking waits
        self._chair_seen: str | None = None  # the node last seen in the chair
        self._asked_chair: str | None = None  # ... when this node last pushed a request
        self._wait_store: Store | None = None  # this node's connection for blocking waits
        self._shut_down: bool | None = None  # None until shutdown, then its result

    @classmethod
    def from_backend(
        cls,
        run_id: str,
        store: Store,
        backend: RendezvousBackend,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        timeout: RendezvousTimeout | None = None,
        keep_alive_interval: float = 5,
        keep_alive_max_attempt: int = 3,
        *,
        owned_store: Store | None = None,
    ) -> DynamicRendezvousHandler:
        """A handler whose state blob a torch-style `RendezvousBackend` keeps (torch's
        `from_backend`, same arguments).

        The node holding the chair reads and writes the blob through `backend`
        (`get_state` when it takes the chair, one `set_state` with the token of its last
        write per change); requests, heartbeats and answers go through `store`, as with
        distcomm's own backends, so each node still costs O(1) store requests per round and
        the backend O(1) calls per change, whatever the number of nodes. `store` must be a
        distcomm Store (it needs queues); `get_backend()` is `backend.name`. `owned_store`
        (distcomm's addition): a store `shutdown` closes, as for the built-in backends.

        Raises:
            ValueError: a bad node range or timeout.
            TypeError: `store` or `backend` is of the wrong kind.
        """
        timeout = timeout if timeout is not None else RendezvousTimeout()
        if not isinstance(timeout, RendezvousTimeout):
            raise TypeError(f"timeout must be a RendezvousTimeout, got {type(timeout).__name__}")
        if not isinstance(backend, RendezvousBackend):
            raise TypeError(
                f"backend must be a RendezvousBackend (get_state, set_state, name), got "
                f"{type(backend).__name__}"
            )
        handler = cls(
            run_id=run_id,
            store=store,
            backend_name=backend.name,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            local_addr=local_addr,
            join_timeout=timeout.join.total_seconds(),
            last_call_timeout=timeout.last_call.total_seconds(),
            close_timeout=timeout.close.total_seconds(),
            keep_alive_interval=keep_alive_interval,
            keep_alive_max_attempt=keep_alive_max_attempt,
            owned_store=owned_store,
            state_backend=backend,
        )
        handler._timeout = timeout
        return handler

    @property
    def use_agent_store(self) -> bool:
        """Whether the workers are given the rendezvous's own TCPStore (where the backend
        serves one) as their store: True unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as in
        torch; then the agent hosts another store for them."""
        return self._share_store

    @property
    def settings(self) -> HandlerSettings:
        """What this handler was made with, as torch's handler's ``settings``: run_id,
        min_nodes, max_nodes, timeout (the `RendezvousTimeout` given to `from_backend`, or
        one of this handler's timeouts), keep_alive_interval (a timedelta) and
        keep_alive_max_attempt."""
        limits = self._limits
        timeout = self._timeout or RendezvousTimeout(
            join=timedelta(seconds=self._join_timeout),
            last_call=timedelta(seconds=limits.last_call_timeout),
            close=timedelta(seconds=self._close_timeout),
        )
        return HandlerSettings(self._run_id, limits.min_nodes, limits.max_nodes, timeout,
                               timedelta(seconds=self._interval), self._max_attempts)

    @property
    def bootstrap_address(self) -> tuple[str, int] | None:
        """(host, port) of the TCPStore the backend serves (c10d), or None."""
        return self._bootstrap_address

    # -- the store --------------------------------------------------------------------------

    def _where(self) -> str:
        return f"the rendezvous of run {self._run_id!r} ({self._backend})"

    def _store_error(self, what: str, exc: Exception) -> RendezvousConnectionError:
        return RendezvousConnectionError(f"{self._where()}: the store failed during {what}: {exc}")

    def _decode(self, raw: bytes) -> RendezvousState:
        try:
            return RendezvousState.decode(raw)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RendezvousStateError(
                f"{self._where()}: {self._slot.describe()} does not hold a distcomm "
                f"rendezvous state ({exc}); did another program write it? Use another --rdzv_id"
            ) from exc

    def _stored_state(self) -> RendezvousState:
        """The state as the chair last wrote it (a fresh one before any wrote it)."""
        return self._decode(self._slot.read())

    def _summary(self) -> dict[str, object]:
        """The chair's summary of the state (a fresh state's before any chair wrote one)."""
        raw = peek(self._store, self._keys.summary)
        if raw:
            try:
                return dict(json.loads(raw))
            except ValueError:
                pass
        return summarize(self._stored_state(), self._limits)

    def _waiter(self) -> Store:
        """A second connection to the store for this node's blocking waits (the heartbeat
        thread must not queue behind them)."""
        if self._wait_store is None:
            self._wait_store = self._store.clone()
        return self._wait_store

    def _guarded(self, what: str, call: Callable[[], _T]) -> _T:
        try:
            return call()
        except RendezvousError:
            raise
        except (DistError, OSError) as exc:
            raise self._store_error(what, exc) from exc

    # -- heartbeats and the chair -----------------------------------------------------------

    def _beat(self) -> None:
        self._store.set(self._keys.heartbeat(self.node_id), repr(time.time()))

    def _log_dropped(self, nodes: list[str]) -> None:
        for node in nodes:
            log.warning(
                "%s: node %s missed its heartbeats for %.1f s: dropped",
                self._where(),
                node,
                self._limits.dead_after,
            )

    def _chair_value(self) -> bytes:
        return f"{self.node_id} {time.time()!r}".encode()

    def _look_at_chair(self) -> bool:
        """Read the chair's key and take the chair when it is vacant, its holder stopped
        refreshing it, or it names this node (whose chair failed on a store error); returns
        whether this node holds it now."""
        mine = self._chair_value()
        current = self._store.compare_set(self._keys.chair, b"", mine)  # vacant: taken
        if current != mine:
            holder, _, stamp = current.decode(errors="replace").partition(" ")
            try:
                stale = time.time() - float(stamp) > self._limits.dead_after
            except ValueError:
                stale = True
            self._chair_seen = holder
            if not stale and holder != self.node_id:
                return False
            if self._store.compare_set(self._keys.chair, current, mine) != mine:
                return False
            if holder != self.node_id:
                log.info("%s: node %s takes the chair from %s (silent for over %.1f s)",
                         self._where(), self.node_id, holder, self._limits.dead_after)
        self._chair_seen, self._chair_raw = self.node_id, mine
        if self._chair_store is None:
            self._chair_store = self._store.clone()
        chair = Chair(self._store, self._chair_store, self._keys, self._limits, self.node_id,
                      self._decode, self._log_dropped, read_every=self._interval / 2,
                      slot=self._slot)
        chair.load()
        self._chair = chair
        return True

    def _keep_chair(self) -> bool:
        """Refresh the chair's key; False when another node holds it now."""
        mine = self._chair_value()
        if self._store.compare_set(self._keys.chair, self._chair_raw, mine) != mine:
            return False
        self._chair_raw = mine
        return True

    def _step_down(self, vacate: bool) -> None:
        chair, self._chair = self._chair, None
        if chair is None:
            return
        if vacate:
            with contextlib.suppress(DistError, OSError):
                self._store.compare_set(self._keys.chair, self._chair_raw, b"")
        store, self._chair_store = self._chair_store, None
        if store is not None and store is not self._store:
            store.close()

    def _serve(self, heartbeats: bool) -> None:
        """One pass of the chair; steps down when another node took the chair."""
        chair = self._chair
        assert chair is not None
        try:
            chair.serve(heartbeats)
        except StateConflict:
            if not self._keep_chair():
                log.info("%s: node %s no longer holds the chair", self._where(), self.node_id)
                self._step_down(vacate=False)
                return
            chair.reload()

    def _chair_wait(self, seconds: float) -> None:
        """Block until a request is queued, up to `seconds` (or the stop)."""
        assert self._chair_store is not None
        with contextlib.suppress(DistStoreTimeoutError):
            self._chair_store.wait([self._keys.requests], timedelta(seconds=max(seconds, 0.001)))

    def _keeper_loop(self) -> None:
        """The node's heartbeat every keep_alive_interval and, while this node holds the
        chair, the chair's passes: on each request, at each deadline, and with a read of
        every heartbeat twice per interval (so a dead node is seen within half an
        interval of its time being up)."""
        failing, first, beats = False, True, 0
        next_beat = next_read = time.monotonic() + self._interval
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                beat = now >= next_beat
                if beat:
                    next_beat, beats = now + self._interval, beats + 1
                    self._beat()
                    if self._chair is not None and not self._keep_chair():
                        self._step_down(vacate=False)
                # the first look at once (a request may wait), then every other beat: a
                # silent chair is replaced within keep_alive_max_attempt + 2 intervals
                if self._chair is None and (first or (beat and beats % 2 == 0)):
                    self._look_at_chair()
                first = False
                read = now >= next_read
                if read:
                    next_read = now + self._interval / 2
                if self._chair is not None:
                    self._serve(heartbeats=read)
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
            left = max(0.0, next_beat - time.monotonic())
            chair = self._chair
            if chair is None or failing:
                self._stop.wait(left)
                continue
            left = min(left, max(0.0, next_read - time.monotonic()))
            due = chair.due()
            if due is not None:
                left = min(left, due)
            try:
                self._chair_wait(left)
            except Exception:  # the next pass says what failed
                self._stop.wait(min(left, 0.05))

    def _start_keeper(self) -> None:
        if self._keeper is None:
            self._guarded("a heartbeat", self._beat)  # before any request: the chair reads it
            self._keeper = threading.Thread(
                target=self._keeper_loop, name=f"rdzv-heartbeat-{self.node_id}", daemon=True
            )
            self._keeper.start()

    def _stop_keeper(self) -> None:
        self._stop.set()
        thread, self._keeper = self._keeper, None
        if thread is not None:
            with contextlib.suppress(DistError, OSError):  # wake a chair blocked on the queue
                self._store.queue_push(self._keys.requests, WAKE)
            thread.join(timeout=self._close_timeout)

    # -- asking the chair -------------------------------------------------------------------

    def _ask(self, request: Request) -> None:
        try:
            self._store.queue_push(self._keys.requests, request.encode())
        except NotImplementedError as exc:
            raise RendezvousError(
                f"{self._where()}: the dynamic rendezvous asks its chair through a queue, and "
                f"{type(self._store).__name__} has none ({exc}); use a distcomm store "
                "(TCPStore, FileStore, EtcdStore), which all have queues"
            ) from exc
        self._asked_chair = self._chair_seen

    def _await(
        self, request: Request, deadline: Deadline, first: float | None = None,
        on_first: Callable[[], None] | None = None,
    ) -> dict[str, object] | None:
        """Wait for the chair's answer to `request` until `deadline`; None when none came.

        The request is pushed again when the chair changed since it was pushed, and every
        time the node waited a chair's lifetime (a request taken by a chair that died
        before writing it is lost): requests are idempotent.
        """
        key = self._keys.answer(request.node, request.call)
        step = first if first is not None else self._limits.dead_after + self._interval
        while True:
            try:
                self._waiter().wait([key], timedelta(seconds=max(deadline.slice(step), 0.001)))
                break
            except DistStoreTimeoutError:
                pass
            if deadline.expired():
                return None
            if on_first is not None:
                on_first()
                on_first = None
            elif self._asked_chair != self._chair_seen or step >= self._limits.dead_after:
                self._ask(request)
            step = self._limits.dead_after + self._interval
        try:
            return dict(json.loads(self._store.get(key)))
        except ValueError as exc:
            raise RendezvousError(f"{self._where()}: a foreign answer under {key!r}") from exc

    # -- joining ----------------------------------------------------------------------------

    def _timeout_error(self, seen: dict[str, object]) -> RendezvousTimeoutError:
        """The error for a join timeout, `seen` the summary of the state before it left."""
        limits = self._limits
        sizes = f"min {limits.min_nodes}, max {limits.max_nodes}"
        if seen.get("complete"):
            why = (
                f"round {seen.get('round')} is running with {seen.get('joined')} node(s) "
                f"({sizes}) and did not end to let this node in"
            )
        else:
            why = (
                f"{seen.get('joined')} node(s) joined round {seen.get('round')} ({sizes}) "
                f"and {seen.get('listed')} wait(s)"
            )
        return RendezvousTimeoutError(
            f"{self._where()} did not complete within join_timeout={self._join_timeout:g} s: "
            f"{why}; start the missing nodes with the same --rdzv_id and --rdzv_endpoint, or "
            "raise join_timeout in --rdzv_conf"
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
        self._start_keeper()
        self._calls += 1
        request = Request(self.node_id, self._calls, "join", after=self._round)
        self._guarded("joining", lambda: self._ask(request))
        answer = self._guarded("joining", lambda: self._await(
            request, deadline, first=_FIRST_LOOK, on_first=self._look_for_last_call))
        if answer is None:  # the join timeout: leave, unless the round completed meanwhile
            seen = self._guarded("joining", self._summary)
            expired = Request(self.node_id, self._calls, "join", expired=True)
            self._guarded("joining", lambda: self._ask(expired))
            answer = self._guarded(
                "joining", lambda: self._await(expired, Deadline(self._close_timeout)))
            if answer is None or "timeout" in answer:
                self._round = None
                told = answer.get("timeout") if answer else None
                raise self._timeout_error(told if isinstance(told, dict) else seen)
        if answer.get("closed"):
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
        round_, rank, size = int(answer["round"]), int(answer["rank"]), int(answer["size"])
        self._round, self._joined_any = round_, True
        log.info("%s: round %d complete: node %s is rank %d of %d",
                 self._where(), round_, self.node_id, rank, size)
        return RendezvousInfo.for_round(
            self._store, self._run_id, round_, rank, size,
            self._bootstrap_address if self.use_agent_store else None)

    def _look_for_last_call(self) -> None:
        """Once a join has waited a moment: say so when the round waits out its last call."""
        seen = self._summary()
        if not seen.get("last_call") or seen.get("deadline") is None:
            return
        limits, joined = self._limits, seen.get("joined")
        left = max(0.0, float(seen["deadline"]) - time.time())  # type: ignore[arg-type]
        log.warning(
            "%s: %d node(s) joined round %d (--nnodes=%d:%d); waiting up to %s s "
            "(--rdzv_conf last_call_timeout=%g) for more before starting the workers; "
            "pass --nnodes=%d to start at once with these nodes, or a shorter "
            "last_call_timeout",
            self._where(),
            joined,
            seen.get("round"),
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
        """A snapshot of the shared state, as the chair last wrote it (for diagnostics and
        tests; the heartbeats' times are those of that write).

        Raises:
            RendezvousConnectionError: the store failed.
        """
        return self._guarded("state", self._stored_state)

    def is_closed(self) -> bool:
        """Whether the rendezvous is closed.

        Raises:
            RendezvousConnectionError: the store failed.
        """
        return self._guarded("is_closed", lambda: self._store.check([self._keys.closed]))

    def set_closed(self) -> None:
        """Close the rendezvous: every node's next `next_rendezvous` raises
        RendezvousClosedError.

        Raises:
            RendezvousConnectionError: the store failed.
            RendezvousTimeoutError: the state could not be written within close_timeout.
        """
        deadline = Deadline(self._close_timeout)

        def close() -> None:
            self._store.set(self._keys.closed, b"1")
            raw = self._slot.read()
            while True:
                state = self._decode(raw)
                if state.closed:
                    break
                state.closed = True
                new = state.encode()
                current = self._slot.swap(raw, new)
                if current == new:
                    break
                if deadline.expired():
                    raise RendezvousTimeoutError(
                        f"{self._where()}: set_closed could not update the state within "
                        f"{self._close_timeout:.1f} s: other nodes kept changing it"
                    )
                raw = b"" if current == raw else current
            self._store.set(self._keys.summary, json.dumps(summarize(state, self._limits)))

        self._guarded("set_closed", close)

    def num_nodes_waiting(self) -> int:
        """How many nodes wait for a round to form: the wait list (when a new round could
        take one of them) plus the participants of a gathering round; at least 1 once this
        node's own round is over (a newer round began, or a member of it died or left), so
        that the agent rejoins.

        Raises:
            RendezvousConnectionError: the store failed.
        """
        return self.watch().nodes_waiting

    def watch(self) -> RoundView:
        """Closed, nodes waiting and whether this node's round is over, from one read of
        the chair's summary (a few dozen bytes whatever the number of nodes).

        Raises:
            RendezvousConnectionError: the store failed.
        """
        seen = self._guarded("watch", self._summary)
        count = int(seen.get("waiting", 0))  # type: ignore[call-overload]
        mine = self._round
        over = mine is not None and (seen.get("round") != mine or bool(seen.get("lost")))
        return RoundView(
            closed=bool(seen.get("closed")),
            nodes_waiting=max(1, count) if over else count,
            round_over=over,
        )

    def shutdown(self) -> bool:
        """Stop the heartbeats, leave the participants and the wait list, give up the chair
        if this node holds it, close the owned store. Does not close the rendezvous for the
        others.

        Returns whether this node left the state cleanly (False when the store failed;
        the others then drop it once its heartbeats are missed).
        """
        if self._shut_down is not None:
            return self._shut_down
        self._stop_keeper()
        ok = True
        deadline = Deadline(self._close_timeout)
        try:
            self._guarded("shutdown", lambda: self._leave(deadline))
            if self._hosts_store:
                self._guarded("shutdown", lambda: self._wait_for_others_to_leave(deadline))
        except RendezvousError as exc:
            log.warning("%s: could not leave the rendezvous cleanly: %s", self._where(), exc)
            ok = False
        finally:
            self._step_down(vacate=True)
            self._round = None
            if self._wait_store is not None:
                self._wait_store.close()
            if self._owned_store is not None:
                self._owned_store.close()
        self._shut_down = ok
        return ok

    def _leave(self, deadline: Deadline) -> None:
        """Ask to leave and wait for the answer: from this node's own chair, when it holds
        it; from another chair; or, when there is none (or it is silent), as the chair."""
        if self._keeper is None and self._calls == 0:
            return  # never joined: nothing of this node is in the state
        self._calls += 1
        request = Request(self.node_id, self._calls, "leave")
        self._ask(request)
        key = self._keys.answer(request.node, request.call)
        while True:
            if self._chair is not None:
                self._serve(heartbeats=False)
            if self._store.check([key]):
                self._step_down(vacate=True)  # the others elect a chair among themselves
                return
            if self._chair is None and self._look_at_chair():
                continue
            if deadline.expired():
                raise RendezvousTimeoutError(
                    f"{self._where()}: no chair answered this node's leave within "
                    f"close_timeout={self._close_timeout:g} s"
                )
            with contextlib.suppress(DistStoreTimeoutError):
                self._waiter().wait([key], timedelta(seconds=max(
                    deadline.slice(self._interval), 0.001)))

    def _wait_for_others_to_leave(self, deadline: Deadline) -> None:
        """Poll until no other node has a live heartbeat, or `deadline` (the store's host
        keeps serving the nodes that still finish their run). Reads the heartbeats itself:
        the other nodes may all have left or died, and with them every chair."""
        delay, told = _POLL_FIRST, False
        while True:
            others = self._others_alive()
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

    def _others_alive(self) -> int:
        """How many other nodes the stored state counts that still beat."""
        state = self._stored_state()
        others = sorted(set(state.last_heartbeats) - {self.node_id})
        if not others:
            return 0
        beats = self._store.multi_get([self._keys.heartbeat(node) for node in others])
        now = time.time()
        alive = 0
        for beat in beats:
            try:
                alive += now - float(beat) <= self._limits.dead_after
            except ValueError:
                continue
        return alive

    def __repr__(self) -> str:
        return (
            f"DynamicRendezvousHandler(run_id={self._run_id!r}, backend={self._backend!r}, "
            f"node={self.node_id!r})"
        )


def create_store_handler(
    store: Store,
    params: RendezvousParameters,
    bootstrap_address: tuple[str, int] | None = None,
    *,
    owned_store: Store | None = None,
    hosts_store: bool = False,
) -> DynamicRendezvousHandler:
    """A DynamicRendezvousHandler for `params` (the --rdzv_conf values checked) whose state
    lives in `store` itself (distcomm's c10d, etcd and file backends).

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


def create_handler(
    store: Store, backend: RendezvousBackend, params: RendezvousParameters,
    *, owned_store: Store | None = None,
) -> DynamicRendezvousHandler:
    """A handler for `params` whose state `backend` keeps (torch's `create_handler`):
    the options join_timeout, last_call_timeout, close_timeout, heartbeat_timeout,
    keep_alive_interval and keep_alive_max_attempt are read from `params` (other keys
    are the backend's and pass unread); see `DynamicRendezvousHandler.from_backend`.
    `owned_store` (distcomm's addition): a store the handler's `shutdown` closes.

    Raises:
        ValueError: a bad parameter; the message names the option.
        TypeError: `store` or `backend` is of the wrong kind.
    """
    settings = settings_from_params(params, known_keys_only=False)
    heartbeat = params.get("heartbeat_timeout")
    return DynamicRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        RendezvousTimeout(
            timedelta(seconds=settings.join_timeout),
            timedelta(seconds=settings.last_call_timeout),
            timedelta(seconds=settings.close_timeout),
            None if heartbeat is None else timedelta(
                seconds=params.get_as_float("heartbeat_timeout", 5.0)),
        ),
        keep_alive_interval=settings.keep_alive_interval,
        keep_alive_max_attempt=settings.keep_alive_max_attempt,
        owned_store=owned_store,
    )
