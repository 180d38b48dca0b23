"""The dynamic rendezvous: one state machine kept in any Store (the c10d, etcd and file backends).

The shared state is one JSON blob under ``/rdzv/<run_id>/state`` (`RendezvousState`), and
its steps are pure functions of it, in `state.py` (`decide`, `apply`, `leave_round`,
`drop_dead`, ...), so they can be driven and tested without a store. One node at a time,
the chair (`chair.py`), applies them: every other node asks through a queue and reads
its answer under a key of its own. A node costs the store O(1) requests per round and
per heartbeat period, whatever the number of nodes (torch's design, where every node
rewrites the blob by compare-and-swap, costs O(N) each and starves heartbeats past a few
hundred nodes). The handler here is the imperative shell over three rooms, with their costs:

- `client.py`, what the node asks the chair and reads: joining is one push of the
  request, one blocking wait for the answer (a second one when the round takes longer
  than keep_alive_interval * keep_alive_max_attempt), one read; `watch()` /
  `num_nodes_waiting()` (and the warning of a join that waits out a last call) one read
  of the chair's summary, a few dozen bytes;
- `keeper.py`, the node's heartbeat thread: each keep_alive_interval one write of the
  node's heartbeat key and, every other interval, one read of the chair's key (taking the
  chair when it is vacant or its holder went silent);
- `chair.py`, the chair: two reads of every heartbeat per interval (`multi_get`), its
  queue, and a write of the state only when a round completes or ends, a node leaves or
  times out, or the membership changed (at most every 0.1 s).

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
- Each handler writes its heartbeat every `keep_alive_interval` from a daemon thread
  (`keeper.py`), from its first `next_rendezvous` until `shutdown`; that thread also does
  the chair's work while the node holds the chair. The chair drops a node whose heartbeat
  has not changed for ``keep_alive_interval * keep_alive_max_attempt`` (its own clock: the
  hosts' clocks are compared only when a new chair takes over, from the times nodes wrote),
  so a killed node leaves the participants and the wait list within a few intervals. The
  last-call deadline is the chair's wall-clock time.

The state blob may instead live in a torch-style `RendezvousBackend`
(`DynamicRendezvousHandler.from_backend`, `create_handler(store, backend, params)`): the
chair reads and writes it through the backend's token-CAS (`slot.BackendSlot`), while
requests, heartbeats, the summary and answers still go through `store`, so the costs above
are unchanged and the backend sees O(1) calls per change, from one node. The functions that
build a handler from `RendezvousParameters` are in `dynamic_rendezvous.py`, torch's module;
the checks of the handler's arguments, and its `HandlerSettings`, in `settings.py`.

Each completed round gets its own namespace, ``PrefixStore("/rdzv/<run_id>/round_<N>")``,
and the run one for all rounds, ``PrefixStore("/rdzv/<run_id>/run")``; old rounds' keys,
heartbeats and answers are left in place.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from ... import config
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
    RendezvousTimeout,
    RendezvousTimeoutError,
    RoundView,
)
from .chair import Keys, Request
from .client import ChairClient
from .keeper import Keeper
from .settings import HandlerSettings, check_max_attempt, check_run, check_seconds
from .slot import BackendSlot, StateSlot, StoreSlot
from .state import Limits, RendezvousState

__all__ = ["DynamicRendezvousHandler", "HandlerSettings"]

log = logging.getLogger("distcomm.launch.rendezvous")

_T = TypeVar("_T")

#: seconds a join waits for its answer before it looks whether the round waits out a
#: last call (to say so)
_FIRST_LOOK = 0.25

#: node ids of this process's handlers end with this counter, so each is unique
_node_counter = itertools.count()


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
        check_run(run_id, min_nodes, max_nodes, nodes="nodes")  # torch's handler's sentences
        if not isinstance(store, Store):
            raise TypeError(f"the rendezvous needs a distcomm Store, got {type(store).__name__}")
        if state_backend is not None and not isinstance(state_backend, RendezvousBackend):
            raise TypeError(
                f"the rendezvous state backend must be a RendezvousBackend (get_state, "
                f"set_state, name), got {type(state_backend).__name__}"
            )
        self._run_id = run_id
        self._store = store
        self._backend = backend_name
        self._join_timeout = check_seconds("join_timeout", join_timeout)
        self._close_timeout = check_seconds("close_timeout", close_timeout)
        self._interval = check_seconds("keep_alive_interval", keep_alive_interval)
        self._max_attempts = check_max_attempt(keep_alive_max_attempt)
        self._limits = Limits(
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            last_call_timeout=check_seconds("last_call_timeout", last_call_timeout),
            dead_after=self._interval * self._max_attempts,
        )
        self._share_store = not config.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
        self._timeout: RendezvousTimeout | None = None  # the one from_backend was given
        self._bootstrap_address = bootstrap_address
        self._owned_store = owned_store
        self._hosts_store = hosts_store
        self.node_id = f"{local_addr or socket.gethostname()}_{os.getpid()}_{next(_node_counter)}"
        self._keys = Keys(run_id)
        self._slot: StateSlot = (
            StoreSlot(store, self._keys.state)
            if state_backend is None
            else BackendSlot(state_backend)
        )
        # what this node asks the chair and reads of the state; its heartbeat thread
        self._client = ChairClient(
            store,
            self._keys,
            self._slot,
            self._limits,
            self._interval,
            self._where(),
            lambda: self._keeper.chair_seen,
        )
        self._keeper = Keeper(
            store,
            self._keys,
            self._limits,
            self.node_id,
            self._interval,
            self._slot,
            self._client.decode,
            self._where(),
        )
        self._round: int | None = None  # the round this node last completed
        self._joined_any = False  # whether this handler ever completed a round
        self._calls = 0  # requests this node made: each is answered under its number
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
        return HandlerSettings(
            self._run_id,
            limits.min_nodes,
            limits.max_nodes,
            timeout,
            timedelta(seconds=self._interval),
            self._max_attempts,
        )

    @property
    def bootstrap_address(self) -> tuple[str, int] | None:
        """(host, port) of the TCPStore the backend serves (c10d), or None."""
        return self._bootstrap_address

    # -- the store --------------------------------------------------------------------------

    def _where(self) -> str:
        return f"the rendezvous of run {self._run_id!r} ({self._backend})"

    def _store_error(self, what: str, exc: Exception) -> RendezvousConnectionError:
        return RendezvousConnectionError(f"{self._where()}: the store failed during {what}: {exc}")

    def _guarded(self, what: str, call: Callable[[], _T]) -> _T:
        try:
            return call()
        except RendezvousError:
            raise
        except (DistError, OSError) as exc:
            raise self._store_error(what, exc) from exc

    def _start_keeper(self) -> None:
        """Write the first heartbeat (before any request: the chair reads it), then start
        the heartbeat thread, once."""
        if not self._keeper.running:
            self._guarded("a heartbeat", self._keeper.beat)
            self._keeper.start()

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
        self._guarded("joining", lambda: self._client.ask(request))
        answer = self._guarded(
            "joining",
            lambda: self._client.await_answer(
                request, deadline, first=_FIRST_LOOK, on_first=self._client.look_for_last_call
            ),
        )
        if answer is None:  # the join timeout: leave, unless the round completed meanwhile
            seen = self._guarded("joining", self._client.summary)
            expired = Request(self.node_id, self._calls, "join", expired=True)
            self._guarded("joining", lambda: self._client.ask(expired))
            answer = self._guarded(
                "joining", lambda: self._client.await_answer(expired, Deadline(self._close_timeout))
            )
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
        log.info(
            "%s: round %d complete: node %s is rank %d of %d",
            self._where(),
            round_,
            self.node_id,
            rank,
            size,
        )
        return RendezvousInfo.for_round(
            self._store,
            self._run_id,
            round_,
            rank,
            size,
            self._bootstrap_address if self.use_agent_store else None,
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
        return self._guarded("state", self._client.stored_state)

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
        self._guarded("set_closed", lambda: self._client.write_closed(deadline))

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
        seen = self._guarded("watch", self._client.summary)
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
        self._keeper.stop(self._close_timeout)
        ok = True
        deadline = Deadline(self._close_timeout)
        try:
            self._guarded("shutdown", lambda: self._leave(deadline))
            if self._hosts_store:
                self._guarded(
                    "shutdown",
                    lambda: self._keeper.wait_for_others_to_leave(
                        deadline, self._close_timeout, self._client.stored_state
                    ),
                )
        except RendezvousError as exc:
            log.warning("%s: could not leave the rendezvous cleanly: %s", self._where(), exc)
            ok = False
        finally:
            self._keeper.step_down(vacate=True)
            self._round = None
            self._client.close()
            if self._owned_store is not None:
                self._owned_store.close()
        self._shut_down = ok
        return ok

    def _leave(self, deadline: Deadline) -> None:
        """Ask to leave and wait for the answer: from this node's own chair, when it holds
        it; from another chair; or, when there is none (or it is silent), as the chair."""
        if not self._keeper.running and self._calls == 0:
            return  # never joined: nothing of this node is in the state
        self._calls += 1
        request = Request(self.node_id, self._calls, "leave")
        self._client.ask(request)
        key = self._keys.answer(request.node, request.call)
        while True:
            if self._keeper.chair is not None:
                self._keeper.serve(heartbeats=False)
            if self._store.check([key]):
                self._keeper.step_down(vacate=True)  # the others elect a chair among themselves
                return
            if self._keeper.chair is None and self._keeper.look_at_chair():
                continue
            if deadline.expired():
                raise RendezvousTimeoutError(
                    f"{self._where()}: no chair answered this node's leave within "
                    f"close_timeout={self._close_timeout:g} s"
                )
            with contextlib.suppress(DistStoreTimeoutError):
                self._client.waiter().wait(
                    [key], timedelta(seconds=max(deadline.slice(self._interval), 0.001))
                )

    def __repr__(self) -> str:
        return (
            f"DynamicRendezvousHandler(run_id={self._run_id!r}, backend={self._backend!r}, "
            f"node={self.node_id!r})"
        )
