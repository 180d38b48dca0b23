"""The flight recorder: a ring of each group's last operations, and the per-rank dumps.

Every `ProcessGroup` owns a `Recorder` (`DISTCOMM_TRACE_BUFFER` entries, default 2,000;
0 turns it off). `distcomm.collectives` records each operation as it is issued
(`record`) and marks it completed or failed when its Work finishes (`settle`).
Collectives are numbered per group from 0 in issue order, so the same number on every
rank is the same collective; point-to-point operations carry the peer instead.

`dump` writes every group's ring to `DISTCOMM_TRACE_DIR/rank-<R>.json` (a temporary
name, then a rename): on a collective that timed out or failed (the group was aborted),
on SIGTERM and SIGUSR1 (`install_signal_handlers`) and on `distcomm.dump_trace()`. Each
dump replaces the rank's previous one: the latest holds the most recent state of every
entry still in the ring.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import socket
import threading
import time
import traceback
from typing import Any

__all__ = [
    "FORMAT_VERSION",
    "Entry",
    "Recorder",
    "dump",
    "dump_on_failure",
    "dump_trace",
    "install_signal_handlers",
    "trace_file",
]

log = logging.getLogger(__name__)

#: the version of the dump format ("version" in each file)
FORMAT_VERSION = 1

QUEUED, COMPLETED, FAILED = "queued", "completed", "failed"


class Entry:
    """One recorded operation (a reused slot of the ring)."""

    __slots__ = (
        "count",
        "dtype",
        "end_ns",
        "error",
        "id",
        "op",
        "peer",
        "reduce_op",
        "root",
        "seq",
        "stack",
        "start_ns",
        "state",
    )

    def __init__(self) -> None:
        self.id = -1

    def as_dict(self, ranks: list[int]) -> dict[str, Any]:
        """The entry as JSON data; roots and peers as global ranks (`ranks`: the group's)."""
        return {
            "id": self.id,
            "seq": self.seq if self.seq >= 0 else None,
            "op": self.op,
            "dtype": None if self.dtype is None else str(self.dtype),
            "count": self.count,
            "root": ranks[self.root] if 0 <= self.root < len(ranks) else None,
            "reduce_op": None if self.reduce_op is None else str(self.reduce_op),
            "peer": ranks[self.peer] if 0 <= self.peer < len(ranks) else None,
            "state": self.state,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns or None,
            "error": self.error,
            "stack": self.stack,
        }


class Recorder:
    """A ring of a group's last `size` operations (none when `size` is 0).

    Args:
        size: how many entries to keep (DISTCOMM_TRACE_BUFFER).
        stack: also keep the Python stack of each call (DISTCOMM_DEBUG=DETAIL).
    """

    __slots__ = ("_ids", "_ring", "_seqs", "size", "stack")

    def __init__(self, size: int, stack: bool = False) -> None:
        self.size = size
        self.stack = stack
        self._ring: list[Entry] = []  # grows to `size`, then slots are reused
        self._ids = itertools.count()  # next() is atomic under the GIL
        self._seqs = itertools.count()

    def record(
        self,
        op: str,
        array: Any,
        root: int = -1,
        reduce_op: Any = None,
        peer: int = -1,
        collective: bool = True,
    ) -> Entry | None:
        """Note an operation as issued (state "queued"); roots and peers are group ranks."""
        if not self.size:
            return None
        i = next(self._ids)
        if i < self.size:
            entry = Entry()
            self._ring.append(entry)
        else:
            try:
                entry = self._ring[i % self.size]
            except IndexError:  # another thread has not appended its slot yet
                entry = Entry()
        entry.id = i
        entry.seq = next(self._seqs) if collective else -1
        entry.op = op
        if array is None:
            entry.dtype, entry.count = None, 0
        else:
            entry.dtype, entry.count = array.dtype, array.size
        entry.root, entry.reduce_op, entry.peer = root, reduce_op, peer
        entry.state, entry.error, entry.end_ns = QUEUED, None, 0
        entry.stack = "".join(traceback.format_stack()[:-2]) if self.stack else None
        entry.start_ns = time.time_ns()
        return entry

    def entries(self) -> list[Entry]:
        """The entries in the ring, oldest first."""
        return sorted((e for e in list(self._ring) if e.id >= 0), key=lambda e: e.id)


def settle(entry: Entry | None, error: BaseException | None) -> None:
    """Mark `entry` completed, or failed with `error` (which may trigger a dump)."""
    if entry is None:
        return
    entry.end_ns = time.time_ns()
    if error is None:
        entry.state = COMPLETED
        return
    entry.state = FAILED
    entry.error = f"{type(error).__name__}: {error}"
    dump_on_failure(error)


def settle_later(entry: Entry | None, work: Any) -> None:
    """Settle `entry` when the (asynchronous) `work` finishes."""
    if entry is None:
        return
    expected = entry.id

    def done(future: Any) -> None:
        if entry.id == expected:  # the slot was not reused meanwhile
            settle(entry, future._error)

    work.get_future().add_done_callback(done)


# -- dumps ---------------------------------------------------------------------------------

_dump_lock = threading.RLock()
_last_failure_dump = 0.0
#: failed operations closer together than this share one dump (a group abort fails many)
FAILURE_DUMP_INTERVAL_S = 1.0


def _trace_dir() -> str | None:
    return os.environ.get("DISTCOMM_TRACE_DIR") or None  # as config.load() reads it


def trace_file(directory: str, rank: int) -> str:
    """The file rank `rank` writes in `directory`."""
    return os.path.join(directory, f"rank-{rank}.json")


def _snapshot(reason: str) -> tuple[int, dict[str, Any]] | None:
    from ..group import _world

    world = _world.default
    if world is None:
        return None
    groups = []
    for group in list(_world.groups.values()):
        recorder = getattr(group, "_trace", None)
        if not group.is_member or recorder is None:
            continue
        groups.append(
            {
                "name": group.group_name,
                "ranks": list(group.ranks),
                "group_rank": group.rank(),
                "backend": group.name(),
                "buffer": recorder.size,
                "entries": [e.as_dict(group.ranks) for e in recorder.entries()],
            }
        )
    data = {
        "version": FORMAT_VERSION,
        "rank": world.rank(),
        "world_size": world.size(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "reason": reason,
        "time_ns": time.time_ns(),
        "groups": groups,
    }
    return world.rank(), data


def dump(reason: str, directory: str | None = None) -> str | None:
    """Write this rank's recorder to `directory` (default: DISTCOMM_TRACE_DIR).

    Returns:
        The file written, or None when there is no directory or no default group.
    """
    if directory is None:
        directory = _trace_dir()
    if directory is None:
        return None
    with _dump_lock:
        snapshot = _snapshot(reason)
        if snapshot is None:
            return None
        rank, data = snapshot
        os.makedirs(directory, exist_ok=True)
        path = trace_file(directory, rank)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as fp:
                json.dump(data, fp, indent=1)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return path


def dump_on_failure(error: BaseException) -> None:
    """Dump after a failed operation (a timeout or an abort), at most once a second."""
    global _last_failure_dump
    from ..errors import DistTimeoutError

    now = time.monotonic()
    if now - _last_failure_dump < FAILURE_DUMP_INTERVAL_S:
        return
    _last_failure_dump = now
    reason = "timeout" if isinstance(error, DistTimeoutError) else "failure"
    try:
        path = dump(reason)
    except Exception as exc:  # a dump must never hide the error being raised
        log.warning("could not write the flight recorder after a %s: %s", reason, exc)
        return
    if path:
        log.warning("flight recorder written to %s (after a %s)", path, reason)


def dump_trace(directory: str | None = None) -> str:
    """Write this rank's flight recorder now (every group's last operations), as JSON.

    The file is `rank-<R>.json` in `directory` (default: DISTCOMM_TRACE_DIR); it replaces
    the rank's previous dump. Read a run's files with `python -m distcomm.trace DIR`.

    Returns:
        The path of the file written.

    Raises:
        ValueError: neither `directory` nor DISTCOMM_TRACE_DIR is given.
        RuntimeError: distcomm is not initialised.
        OSError: the file could not be written.
    """
    directory = directory or _trace_dir()
    if directory is None:
        raise ValueError("dump_trace: no directory: pass one or set DISTCOMM_TRACE_DIR")
    path = dump("dump_trace", directory)
    if path is None:
        raise RuntimeError(
            "dump_trace: distcomm is not initialised; call distcomm.init_process_group() first"
        )
    return path


# -- signals -------------------------------------------------------------------------------

_previous: dict[int, Any] = {}


def _dump_for_signal(signum: int) -> None:
    name = signal.Signals(signum).name
    try:
        dump(name)
    except Exception as exc:
        log.warning("could not write the flight recorder on %s: %s", name, exc)


def _on_sigterm(signum: int, frame: Any) -> None:
    """Dump, then do what SIGTERM did before: the previous handler, or die by the signal."""
    _dump_for_signal(signum)
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _on_sigusr1(signum: int, frame: Any) -> None:
    """Dump and go on; a handler installed before ours still runs."""
    _dump_for_signal(signum)
    previous = _previous.get(signum)
    if callable(previous):
        previous(signum, frame)


def install_signal_handlers() -> None:
    """Dump on SIGTERM and SIGUSR1 when DISTCOMM_TRACE_DIR is set (main thread only, once).

    SIGTERM then does what it did before (the previous handler, or ends the process by
    the signal); SIGUSR1 dumps and calls the previous Python handler, if any.
    """
    if _trace_dir() is None or _previous:
        return
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, handler in ((signal.SIGTERM, _on_sigterm), (signal.SIGUSR1, _on_sigusr1)):
        current = signal.getsignal(signum)
        if current is handler:
            continue
        _previous[signum] = current
        signal.signal(signum, handler)
