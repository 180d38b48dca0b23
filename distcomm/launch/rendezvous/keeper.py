"""A dynamic-rendezvous node's heartbeat and its turn in the chair, on a thread of its own.

`Keeper` runs on a daemon thread from the node's first join until its shutdown:

- every keep_alive_interval it writes the node's heartbeat key (one set, no
  compare-and-swap), so the chair sees the node alive;
- at once, then every other interval, it reads the chair's key and takes the chair when
  it is vacant or its holder stopped refreshing it for
  ``keep_alive_interval * keep_alive_max_attempt`` (a silent chair is replaced within
  keep_alive_max_attempt + 2 intervals);
- while the node holds the chair, it refreshes the chair's key with each heartbeat and
  runs the chair's passes (`chair.Chair.serve`): on each queued request, at each of the
  chair's deadlines, and with a read of every heartbeat twice per interval, so a dead
  node is seen within half an interval of its time being up.

A failing store never stops the thread (it says so once, and again when the store is
back). The handler (`dynamic.py`) owns the keeper; the rendezvous's decisions stay in the
pure steps of `state.py`, which the chair applies.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from ...deadline import Deadline
from ...errors import DistError, DistStoreTimeoutError
from ...store import Store
from .chair import WAKE, Chair, Keys, StateConflict
from .slot import StateSlot
from .state import Limits, RendezvousState

__all__ = ["Keeper"]

log = logging.getLogger("distcomm.launch.rendezvous")

#: seconds between two reads while the store's host waits for the others to leave:
#: doubles from FIRST up to MOST
_POLL_FIRST = 0.05
_POLL_MOST = 0.5


class Keeper:
    """One node's heartbeat thread and, while it holds it, the chair.

    Args:
        store: the run's store (heartbeats, the chair's key, the request queue).
        keys: the run's store keys.
        limits: the round's limits (``dead_after`` is the heartbeat deadline).
        node_id: this node's id.
        interval: keep_alive_interval, in seconds.
        slot: where the state blob lives (the store's key or a `RendezvousBackend`).
        decode: bytes -> `RendezvousState`, raising a `RendezvousStateError` that names
            the run on a foreign blob.
        where: the rendezvous's name for log lines ("the rendezvous of run 'x' (c10d)").
    """

    def __init__(
        self,
        store: Store,
        keys: Keys,
        limits: Limits,
        node_id: str,
        interval: float,
        slot: StateSlot,
        decode: Callable[[bytes], RendezvousState],
        where: str,
    ) -> None:
        self._store = store
        self._keys = keys
        self._limits = limits
        self.node_id = node_id
        self._interval = interval
        self._slot = slot
        self._decode = decode
        self._where = where
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: the chair, while this node holds it
        self.chair: Chair | None = None
        #: the node last seen in the chair
        self.chair_seen: str | None = None
        self._chair_raw = b""  # the chair key's value this node last wrote
        self._chair_store: Store | None = None  # the chair's connection for blocking waits

    @property
    def running(self) -> bool:
        """Whether the thread was started and not stopped."""
        return self._thread is not None

    def beat(self) -> None:
        """Write this node's heartbeat (its wall-clock time)."""
        self._store.set(self._keys.heartbeat(self.node_id), repr(time.time()))

    def start(self) -> None:
        """Start the thread (the caller writes the first heartbeat, to report its error)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name=f"rdzv-heartbeat-{self.node_id}", daemon=True
            )
            self._thread.start()

    def stop(self, timeout: float) -> None:
        """Stop the thread, waiting for it up to `timeout` seconds; the chair is kept (see
        `step_down`)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            with contextlib.suppress(DistError, OSError):  # wake a chair blocked on the queue
                self._store.queue_push(self._keys.requests, WAKE)
            thread.join(timeout=timeout)

    # -- the chair --------------------------------------------------------------------------

    def _log_dropped(self, nodes: list[str]) -> None:
        for node in nodes:
            log.warning(
                "%s: node %s missed its heartbeats for %.1f s: dropped",
                self._where,
                node,
                self._limits.dead_after,
            )

    def _chair_value(self) -> bytes:
        return f"{self.node_id} {time.time()!r}".encode()

    def look_at_chair(self) -> bool:
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
            self.chair_seen = holder
            if not stale and holder != self.node_id:
                return False
            if self._store.compare_set(self._keys.chair, current, mine) != mine:
                return False
            if holder != self.node_id:
                log.info(
                    "%s: node %s takes the chair from %s (silent for over %.1f s)",
                    self._where,
                    self.node_id,
                    holder,
                    self._limits.dead_after,
                )
        self.chair_seen, self._chair_raw = self.node_id, mine
        if self._chair_store is None:
            self._chair_store = self._store.clone()
        chair = Chair(
            self._store,
            self._chair_store,
            self._keys,
            self._limits,
            self.node_id,
            self._decode,
            self._log_dropped,
            read_every=self._interval / 2,
            slot=self._slot,
        )
        chair.load()
        self.chair = chair
        return True

    def _keep_chair(self) -> bool:
        """Refresh the chair's key; False when another node holds it now."""
        mine = self._chair_value()
        if self._store.compare_set(self._keys.chair, self._chair_raw, mine) != mine:
            return False
        self._chair_raw = mine
        return True

    def step_down(self, vacate: bool) -> None:
        """Give up the chair, if this node holds it; `vacate`: empty the chair's key, so
        that another node takes it at once rather than after the heartbeat deadline."""
        chair, self.chair = self.chair, None
        if chair is None:
            return
        if vacate:
            with contextlib.suppress(DistError, OSError):
                self._store.compare_set(self._keys.chair, self._chair_raw, b"")
        store, self._chair_store = self._chair_store, None
        if store is not None and store is not self._store:
            store.close()

    def serve(self, heartbeats: bool) -> None:
        """One pass of the chair; steps down when another node took the chair."""
        chair = self.chair
        assert chair is not None
        try:
            chair.serve(heartbeats)
        except StateConflict:
            if not self._keep_chair():
                log.info("%s: node %s no longer holds the chair", self._where, self.node_id)
                self.step_down(vacate=False)
                return
            chair.reload()

    def _chair_wait(self, seconds: float) -> None:
        """Block until a request is queued, up to `seconds` (or the stop)."""
        assert self._chair_store is not None
        with contextlib.suppress(DistStoreTimeoutError):
            self._chair_store.wait([self._keys.requests], timedelta(seconds=max(seconds, 0.001)))

    def _loop(self) -> None:
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
                    self.beat()
                    if self.chair is not None and not self._keep_chair():
                        self.step_down(vacate=False)
                # the first look at once (a request may wait), then every other beat: a
                # silent chair is replaced within keep_alive_max_attempt + 2 intervals
                if self.chair is None and (first or (beat and beats % 2 == 0)):
                    self.look_at_chair()
                first = False
                read = now >= next_read
                if read:
                    next_read = now + self._interval / 2
                if self.chair is not None:
                    self.serve(heartbeats=read)
                if failing:
                    log.warning("%s: heartbeats reach the store again", self._where)
                failing = False
            except Exception as exc:  # the thread must go on: the store may come back
                if not failing:
                    log.warning(
                        "%s: heartbeat failed (retrying every %.1f s): %s",
                        self._where,
                        self._interval,
                        exc,
                    )
                failing = True
            left = max(0.0, next_beat - time.monotonic())
            chair = self.chair
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

    # -- the other nodes' heartbeats --------------------------------------------------------

    def others_alive(self, state: RendezvousState) -> int:
        """How many other nodes `state` counts that still beat."""
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

    def wait_for_others_to_leave(
        self, deadline: Deadline, close_timeout: float, read_state: Callable[[], RendezvousState]
    ) -> None:
        """Poll until no other node has a live heartbeat, or `deadline` (the store's host
        keeps serving the nodes that still finish their run). Reads the heartbeats itself:
        the other nodes may all have left or died, and with them every chair.

        Args:
            deadline: close_timeout from the start of the shutdown.
            close_timeout: its length in seconds, for the warning when it passes.
            read_state: the state as the chair last wrote it (which nodes to look for).
        """
        delay, told = _POLL_FIRST, False
        while True:
            others = self.others_alive(read_state())
            if not others:
                return
            if deadline.expired():
                log.warning(
                    "%s: closing the store this node hosts while %d node(s) still "
                    "use it (close_timeout=%g s)",
                    self._where,
                    others,
                    close_timeout,
                )
                return
            if not told:
                log.info(
                    "%s: waiting up to %g s for %d node(s) to leave before closing the "
                    "store this node hosts",
                    self._where,
                    deadline.remaining() or 0.0,
                    others,
                )
                told = True
            delay = deadline.nap(delay, _POLL_MOST)
