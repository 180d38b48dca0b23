"""The stall inspector: say while it happens that an operation is waiting for late ranks.

One daemon thread per process (`start` in `init_process_group`, `stop` when the default
group is destroyed) reads every group's flight recorder once a tick. When a group's
oldest running collective, or send or receive, has run for `DISTCOMM_STALL_WARN_S`
seconds (default 30; 0 turns the inspector off), it logs one warning naming the
operation, its sequence number, the group, the ranks that have not entered it and what
each of them is doing now; then again at twice the age each time (30, 60, 120 s ...)
until the operation completes or times out. Nothing is raised: the operation goes on.

What the other ranks are doing comes from the job's store: every rank's inspector
publishes, every `DISTCOMM_STALL_WARN_S / 2` seconds, one small key per group with its
newest operation there (`distcomm/stall/<group>/<rank>`), on a connection of its own
(`Store.clone`), so it is never stuck behind a store wait of the main thread. A rank
whose key has not changed for a while "has not answered" (it is gone, or its Python
thread is blocked). Without a shared store (mpi started from MPI.COMM_WORLD) only this
rank's own operation is named. A rank deletes its keys when their group is destroyed, and
all of them when the inspector stops (best effort, with a short timeout: the store may be
gone), so a store that outlives the job keeps none.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from ..store import HashStore, Store

__all__ = ["StallInspector", "start", "stop"]

log = logging.getLogger(__name__)

_NS = 1_000_000_000
#: the longest a tick waits, in seconds
_TICK_MOST = 1.0
#: the timeout of the inspector's own store connection, in seconds
_STORE_TIMEOUT = 5.0
#: the timeout of each delete of this rank's progress keys when the inspector stops
_DELETE_TIMEOUT = 1.0
#: seconds the inspector's thread gets to end its tick before `stop` goes on without it
_STOP_GRACE = 1.0


def _describe_op(op: tuple[Any, ...], ranks: list[int], p2p: bool) -> str:
    i, name, dtype, count, root, reduce_op, _ = op
    if p2p:
        who = "any rank" if root < 0 else f"rank {ranks[root]}"
        direction = "to" if name == "send" else "from"
        shape = f" ({dtype}, {count} elements)" if dtype is not None else ""
        return f"{name} {direction} {who}{shape}"
    parts = []
    if dtype is not None:
        parts.append(f"{dtype}, {count} element{'s' if count != 1 else ''}")
    if 0 <= root < len(ranks):
        parts.append(f"root rank {ranks[root]}")
    if reduce_op is not None:
        parts.append(str(reduce_op))
    return f"#{i} {name}" + (f" ({', '.join(parts)})" if parts else "")


class _GroupState:
    __slots__ = ("cursor", "last_publish", "p2p_cursor", "warn_at")

    def __init__(self) -> None:
        self.cursor = 0
        self.p2p_cursor = 0
        self.last_publish = -float("inf")  # the first tick publishes
        self.warn_at: dict[int, float] = {}  # operation id -> the age of its next warning


class StallInspector:
    """The inspector thread (see the module docstring).

    Args:
        warn_s: seconds before the first warning about an operation (> 0).
        store: a connection to the job's shared store of its own, or None.
        groups: returns the groups to inspect (every ProcessGroup of the process).
        owns_store: close `store` in `stop` (not when it is the job's store itself).
    """

    def __init__(
        self, warn_s: float, store: Store | None, groups: Any, owns_store: bool = True
    ) -> None:
        self.warn_s = warn_s
        self._owns_store = owns_store
        self.period = max(warn_s / 2, 0.5)  # how often a rank publishes its progress
        self.tick = max(0.05, min(_TICK_MOST, warn_s / 4))
        self._store = store
        self._groups = groups
        self._state: dict[int, _GroupState] = {}
        self._published: dict[int, str] = {}  # group id -> the progress key set for it
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, daemon=True, name="distcomm-stall-inspector"
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, delete the progress keys this rank published, and close the
        store connection.

        The keys go only once the thread has stopped (it ends within a tick unless it is
        in a store request), each with a short timeout, and not at all once one delete
        fails: the store may be gone. If the thread is still in a request, closing its
        connection wakes it, and it is waited for up to 5 s more.
        """
        self._stop.set()
        me = threading.current_thread()
        if self._thread.is_alive() and self._thread is not me:
            self._thread.join(self.tick + _STOP_GRACE)
        store = self._store
        if store is not None and (not self._thread.is_alive() or self._thread is me):
            if self._owns_store:  # a connection of its own: a short timeout bounds each delete
                try:
                    store.set_timeout(_DELETE_TIMEOUT)
                except Exception:
                    pass
            self._unpublish(store, list(self._published))
        self._store = None
        if store is not None and self._owns_store:
            try:
                store.close()
            except Exception:
                pass
        if self._thread.is_alive() and self._thread is not me:
            self._thread.join(5.0)

    def _unpublish(self, store: Store, groups: list[int]) -> None:
        """Delete the progress keys of `groups` (ids) from the store, best effort."""
        for group_id in groups:
            key = self._published.pop(group_id, None)
            if key is None:
                continue
            try:
                store.delete_key(key)
            except Exception as exc:  # the store is gone or stuck: leave the rest
                log.debug("stall inspector: could not delete %r: %r", key, exc)
                self._published.clear()
                return

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            try:
                self.inspect()
            except Exception as exc:  # the inspector must never take the job down
                log.debug("stall inspector: %r", exc)

    def inspect(self) -> None:
        """One tick: publish this rank's progress when due, warn about long waits."""
        now = time.monotonic()
        live = set()
        for group in list(self._groups()):
            recorder = getattr(group, "recorder", None)
            if recorder is None or not recorder.size or not group.is_member:
                continue
            live.add(id(group))
            state = self._state.get(id(group))
            if state is None:
                state = self._state[id(group)] = _GroupState()
            self._inspect(group, recorder, state, now)
        gone = [key for key in self._state if key not in live]
        for key in gone:
            del self._state[key]
        if gone and self._store is not None:  # destroyed groups: their keys go too
            self._unpublish(self._store, gone)

    def _inspect(self, group: Any, recorder: Any, state: _GroupState, now: float) -> None:
        now_ns = int(now * _NS)
        op, state.cursor = recorder.oldest_running(state.cursor, False, now_ns)
        p2p, state.p2p_cursor = recorder.oldest_running(state.p2p_cursor, True, now_ns)
        due = []
        for entry, is_p2p in ((op, False), (p2p, True)):
            if entry is None:
                continue
            age = (now_ns - entry[6]) / _NS
            first = state.warn_at.setdefault(entry[0], self.warn_s)
            if age >= first:
                following = first * 2
                while following <= age:
                    following *= 2
                due.append((entry, is_p2p, age))
                state.warn_at[entry[0]] = following
        running = {e[0] for e in (op, p2p) if e is not None}
        for key in [key for key in state.warn_at if key not in running]:
            del state.warn_at[key]
        if self._store is not None and (due or now - state.last_publish >= self.period):
            state.last_publish = now
            self._publish(group, recorder, now_ns)
        for entry, is_p2p, age in due:
            self._warn(group, entry, is_p2p, age, state.warn_at[entry[0]])

    # -- the shared progress keys ------------------------------------------------------

    @staticmethod
    def _key(group: Any, group_rank: int) -> str:
        return f"distcomm/stall/{group.store_key}/{group_rank}"

    def _publish(self, group: Any, recorder: Any, now_ns: int) -> None:
        to_wall = time.time() - now_ns / _NS
        status: dict[str, Any] = {"t": time.time()}
        for field in ("c", "p"):
            newest = recorder.newest(field == "p")
            if newest is not None:
                entry, running, end = newest
                since = (entry[6] if running else now_ns if end is None else end) / _NS + to_wall
                peer = entry[4]
                status[field] = [
                    entry[0],
                    entry[1],
                    running,
                    since,
                    group.ranks[peer] if field == "p" and peer >= 0 else None,
                ]
        key = self._key(group, group.rank())
        try:
            self._store.set(key, json.dumps(status))
            self._published[id(group)] = key
        except Exception as exc:
            log.debug("stall inspector: could not publish progress: %r", exc)

    def _statuses(self, group: Any) -> dict[int, dict[str, Any]] | None:
        """Each group rank's published progress (missing ranks left out), or None when
        there is no shared store or it could not be read."""
        store = self._store
        if store is None:
            return None
        out = {}
        try:
            for r in range(group.size()):
                key = self._key(group, r)
                if store.check([key]):
                    out[r] = json.loads(store.get(key))
        except Exception as exc:
            log.debug("stall inspector: could not read progress: %r", exc)
            return None
        return out

    # -- the warning ---------------------------------------------------------------------

    def _doing(self, status: dict[str, Any] | None, now: float, want: int | None, name: str) -> str:
        """What a rank is doing, from its published progress, in words."""
        if status is None:
            return "has not reported to the store (not started, or stuck before its first report)"
        stale = now - status["t"]
        newest = status.get("c")
        if newest is None:
            text = "has run no collective on this group yet"
        else:
            seq, op, running, since = newest[0], newest[1], newest[2], newest[3]
            ago = max(0.0, now - since)
            if running:
                text = f"is at #{seq} {op} (for {ago:.0f} s)"
                if want is not None and seq == want and op != name:
                    text += f", not {name}: the ranks called different collectives"
            else:
                text = f"completed #{seq} {op} {ago:.0f} s ago and has not entered #{seq + 1}"
        if stale > 2 * self.period + 2:
            text = f"has not answered for {stale:.0f} s (last heard: it {text})"
        return text

    def _warn(
        self, group: Any, op: tuple[Any, ...], p2p: bool, age: float, next_age: float
    ) -> None:
        me = group.ranks[group.rank()]
        what = _describe_op(op, group.ranks, p2p)
        statuses = self._statuses(group)
        now = time.time()
        if statuses is None:
            others = "what the other ranks are doing is not known here (no shared store)"
        elif p2p:
            peer = op[4]
            if peer < 0:
                others = "it waits for any rank"
            else:
                status = statuses.get(peer)
                match = "send to" if op[1] == "recv" else "recv from"
                other = status.get("p") if status else None
                if other and other[2] and other[1] == match.split()[0] and other[4] == me:
                    others = (
                        f"rank {group.ranks[peer]} is in the matching {match} rank {me} "
                        f"(for {max(0.0, now - other[3]):.0f} s)"
                    )
                else:
                    others = (
                        f"rank {group.ranks[peer]} has not posted the matching {match} "
                        f"rank {me}; it " + self._doing(status, now, None, "")
                    )
        else:
            seq, name = op[0], op[1]
            late, stale = [], []
            for r in range(group.size()):
                if r == group.rank():
                    continue
                status = statuses.get(r)
                newest = status.get("c") if status else None
                if newest is None or newest[0] < seq or (newest[0] == seq and newest[1] != name):
                    late.append(f"rank {group.ranks[r]} {self._doing(status, now, seq, name)}")
                elif now - status["t"] > 2 * self.period + 2:
                    stale.append(f"rank {group.ranks[r]} {self._doing(status, now, seq, name)}")
            if late:
                others = (
                    "not entered by: "
                    + "; ".join(late[:16])
                    + (f"; and {len(late) - 16} more" if len(late) > 16 else "")
                )
            elif stale:
                others = "every rank entered it, but: " + "; ".join(stale[:16])
            else:
                others = (
                    "every rank has entered it: the ranks may wait on each other "
                    "for another reason (the network, a mismatched send and receive)"
                )
        timeout = group.timeout.total_seconds()
        log.warning(
            "stall: rank %d has waited %.0f s in %s of group '%s' (backend %s; it times out after "
            "%.0f s); %s. The operation goes on; next report at %.0f s "
            "(DISTCOMM_STALL_WARN_S=0 turns these warnings off)",
            me,
            age,
            what,
            group.group_name,
            group.name(),
            timeout,
            others,
            next_age,
        )


# -- the process's inspector ---------------------------------------------------------------

_inspector: StallInspector | None = None
_lock = threading.Lock()


def start(warn_s: float, store: Store | None, groups: Any) -> None:
    """Start the process's inspector (after `init_process_group`); nothing when `warn_s`
    is 0. `store` is the job's store: the inspector talks to a clone of it."""
    global _inspector
    if warn_s <= 0:
        return
    side = None
    if store is not None and not isinstance(store, HashStore):
        try:
            side = store.clone()
            if side is not store:  # a connection of its own: never stuck for long on it
                side.set_timeout(_STORE_TIMEOUT)
        except Exception as exc:
            log.debug("stall inspector: no second connection to the store: %r", exc)
    inspector = StallInspector(warn_s, side, groups, owns_store=side is not store)
    with _lock:
        previous, _inspector = _inspector, inspector
    if previous is not None:
        previous.stop()
    inspector.inspect()  # the first report of this rank, before any operation can hang
    inspector.start()


def stop() -> None:
    """Stop the process's inspector (when the default group is destroyed)."""
    global _inspector
    with _lock:
        inspector, _inspector = _inspector, None
    if inspector is not None:
        inspector.stop()
