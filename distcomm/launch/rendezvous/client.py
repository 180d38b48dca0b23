"""A dynamic-rendezvous node's side of the chair: ask it through the store, wait for its
answer, and read what it last wrote (the state blob and its small summary).

Every request goes on one queue, and its answer comes back under a key of the asking node
(`chair.Keys.answer`), so a node costs the store O(1) requests per round whatever the
number of nodes: one push, one blocking wait (on a connection of its own, so that the
heartbeat thread never queues behind it), one read. Requests are idempotent: a request is
pushed again when the chair changed since it was pushed, or after a chair's lifetime
without an answer (a chair that died holding it lost it).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from datetime import timedelta

from ...deadline import Deadline
from ...errors import DistStoreTimeoutError
from ...store import Store
from .api import RendezvousError, RendezvousStateError, RendezvousTimeoutError
from .chair import Keys, Request, peek
from .slot import StateSlot
from .state import Limits, RendezvousState, summarize

__all__ = ["ChairClient"]

log = logging.getLogger("distcomm.launch.rendezvous")


class ChairClient:
    """What one node asks the chair, and what it reads of the shared state.

    Args:
        store: the run's store.
        keys: the run's store keys.
        slot: where the state blob lives (the store's key or a `RendezvousBackend`).
        limits: the round's limits (``dead_after``: how long a chair may stay silent).
        interval: keep_alive_interval, in seconds.
        where: the rendezvous's name for messages ("the rendezvous of run 'x' (c10d)").
        chair_seen: the node this node last saw in the chair (the `keeper.Keeper` reads
            the chair's key), or None.
    """

    def __init__(
        self,
        store: Store,
        keys: Keys,
        slot: StateSlot,
        limits: Limits,
        interval: float,
        where: str,
        chair_seen: Callable[[], str | None],
    ) -> None:
        self._store = store
        self._keys = keys
        self._slot = slot
        self._limits = limits
        self._interval = interval
        self._where = where
        self._chair_seen = chair_seen
        self._asked_chair: str | None = None  # the chair seen when a request was last pushed
        self._wait_store: Store | None = None  # this node's connection for blocking waits

    # -- reading the state ------------------------------------------------------------------

    def decode(self, raw: bytes) -> RendezvousState:
        """`raw` as a state (a fresh one when empty).

        Raises:
            RendezvousStateError: `raw` is not a distcomm rendezvous state.
        """
        try:
            return RendezvousState.decode(raw)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RendezvousStateError(
                f"{self._where}: {self._slot.describe()} does not hold a distcomm "
                f"rendezvous state ({exc}); did another program write it? Use another --rdzv_id"
            ) from exc

    def stored_state(self) -> RendezvousState:
        """The state as the chair last wrote it (a fresh one before any wrote it)."""
        return self.decode(self._slot.read())

    def summary(self) -> dict[str, object]:
        """The chair's summary of the state (a fresh state's before any chair wrote one)."""
        raw = peek(self._store, self._keys.summary)
        if raw:
            try:
                return dict(json.loads(raw))
            except ValueError:
                pass
        return summarize(self.stored_state(), self._limits)

    def look_for_last_call(self) -> None:
        """Log a warning when the round waits out its last call (how many nodes joined, how
        long the wait still is, how to shorten it), from one read of the summary; a join
        calls it once it has waited a moment."""
        seen = self.summary()
        if not seen.get("last_call") or seen.get("deadline") is None:
            return
        limits, joined = self._limits, seen.get("joined")
        left = max(0.0, float(seen["deadline"]) - time.time())  # type: ignore[arg-type]
        log.warning(
            "%s: %d node(s) joined round %d (--nnodes=%d:%d); waiting up to %s s "
            "(--rdzv_conf last_call_timeout=%g) for more before starting the workers; "
            "pass --nnodes=%d to start at once with these nodes, or a shorter "
            "last_call_timeout",
            self._where,
            joined,
            seen.get("round"),
            limits.min_nodes,
            limits.max_nodes,
            f"{left:.0f}" if left >= 10 else f"{left:.1f}",
            limits.last_call_timeout,
            joined,
        )

    def write_closed(self, deadline: Deadline) -> None:
        """Mark the rendezvous closed: its ``closed`` key, then the state and its summary
        (the one write of the state by a node that may not hold the chair: a compare-and-
        swap retried until it holds, so the chair's next write keeps it).

        Raises:
            RendezvousTimeoutError: the state kept changing until `deadline`.
        """
        self._store.set(self._keys.closed, b"1")
        raw = self._slot.read()
        while True:
            state = self.decode(raw)
            if state.closed:
                break
            state.closed = True
            new = state.encode()
            current = self._slot.swap(raw, new)
            if current == new:
                break
            if deadline.expired():
                raise RendezvousTimeoutError(
                    f"{self._where}: set_closed could not update the state within "
                    f"{deadline.seconds:.1f} s: other nodes kept changing it"
                )
            raw = b"" if current == raw else current
        self._store.set(self._keys.summary, json.dumps(summarize(state, self._limits)))

    # -- asking the chair -------------------------------------------------------------------

    def waiter(self) -> Store:
        """A second connection to the store for this node's blocking waits (the heartbeat
        thread must not queue behind them)."""
        if self._wait_store is None:
            self._wait_store = self._store.clone()
        return self._wait_store

    def close(self) -> None:
        """Close the connection of the blocking waits, if one was made."""
        store, self._wait_store = self._wait_store, None
        if store is not None:
            store.close()

    def ask(self, request: Request) -> None:
        """Push `request` on the chair's queue.

        Raises:
            RendezvousError: the store has no queues.
        """
        try:
            self._store.queue_push(self._keys.requests, request.encode())
        except NotImplementedError as exc:
            raise RendezvousError(
                f"{self._where}: the dynamic rendezvous asks its chair through a queue, and "
                f"{type(self._store).__name__} has none ({exc}); use a distcomm store "
                "(TCPStore, FileStore, EtcdStore), which all have queues"
            ) from exc
        self._asked_chair = self._chair_seen()

    def await_answer(
        self,
        request: Request,
        deadline: Deadline,
        first: float | None = None,
        on_first: Callable[[], None] | None = None,
    ) -> dict[str, object] | None:
        """Wait for the chair's answer to `request` until `deadline`; None when none came.

        The request is pushed again when the chair changed since it was pushed, and every
        time the node waited a chair's lifetime (a request taken by a chair that died
        before writing it is lost): requests are idempotent.

        Args:
            request: the request pushed with `ask`.
            deadline: when to give up.
            first: seconds of the first wait (default: a chair's lifetime).
            on_first: called once after the first wait, in place of a second push.

        Raises:
            RendezvousError: the answer's key holds something no chair wrote.
        """
        key = self._keys.answer(request.node, request.call)
        step = first if first is not None else self._limits.dead_after + self._interval
        while True:
            try:
                self.waiter().wait([key], timedelta(seconds=max(deadline.slice(step), 0.001)))
                break
            except DistStoreTimeoutError:
                pass
            if deadline.expired():
                return None
            if on_first is not None:
                on_first()
                on_first = None
            elif self._asked_chair != self._chair_seen() or step >= self._limits.dead_after:
                self.ask(request)
            step = self._limits.dead_after + self._interval
        try:
            return dict(json.loads(self._store.get(key)))
        except ValueError as exc:
            raise RendezvousError(f"{self._where}: a foreign answer under {key!r}") from exc
