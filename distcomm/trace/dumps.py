"""The flight recorder's dumps: every group's ring written to one file per rank.

`dump` writes every group's ring (`Recorder.as_dicts`) to
`DISTCOMM_TRACE_DIR/rank-<R>.json` (a temporary name, then a rename): on a collective
that timed out or failed (`dump_on_failure`, which the recorder calls when it settles an
operation as failed; failures close together share one dump), at an exit with an
operation unfinished, on SIGTERM and SIGUSR1 (`install_signal_handlers`) and on
`distcomm.dump_trace()`. Each dump replaces the rank's previous one.

It is handed the groups it dumps (`install_signal_handlers(groups)`, called by
`init_process_group` with a callable over the world state): it imports nothing of the
group layer, nor the recorder (it reads each group's `recorder` as it finds it).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import config

__all__ = [
    "FORMAT_VERSION",
    "Groups",
    "dump",
    "dump_on_failure",
    "dump_trace",
    "install_signal_handlers",
    "trace_file",
]

log = logging.getLogger("distcomm.trace.recorder")  # the name users filter on, as before

#: the version of the dump format ("version" in each file)
FORMAT_VERSION = 1

_dump_lock = threading.RLock()
_last_failure_dump = 0.0
#: failed operations closer together than this share one dump (a group abort fails many)
FAILURE_DUMP_INTERVAL_S = 1.0


def _trace_dir() -> str | None:
    return config.get("DISTCOMM_TRACE_DIR")


def trace_file(directory: str, rank: int) -> str:
    """The file rank `rank` writes in `directory`."""
    return os.path.join(directory, f"rank-{rank}.json")


#: returns (the default group, or None when there is none; every group of the process)
Groups = Callable[[], tuple[Any, list[Any]]]
#: the groups `dump` writes, handed over by `install_signal_handlers`
_groups: Groups = lambda: (None, [])  # noqa: E731  (none before init_process_group)


def _snapshot(reason: str) -> tuple[int, dict[str, Any]] | None:
    world, members = _groups()
    if world is None:
        return None
    groups = []
    for group in members:
        recorder = getattr(group, "recorder", None)
        if not group.is_member or recorder is None:
            continue
        groups.append(
            {
                "name": group.group_name,
                "ranks": list(group.ranks),
                "group_rank": group.rank(),
                "backend": group.name(),
                "buffer": recorder.size,
                "entries": recorder.as_dicts(group.ranks),
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


def _dump_at_exit() -> None:
    """At exit, dump when an operation did not complete: the process is ending after a
    failure (whose dump, in a backend thread, may not have been written yet)."""
    if not _dump_lock.acquire(timeout=10.0):
        return
    try:
        _, groups = _groups()
        recorders = [getattr(g, "recorder", None) for g in groups]
        if not any(r is not None and r.unfinished() for r in recorders):
            return
        dump("exit")
    except Exception as exc:
        log.warning("could not write the flight recorder at exit: %s", exc)
    finally:
        _dump_lock.release()


# -- signals -------------------------------------------------------------------------------

_previous: dict[int, Any] = {}
_installed = False


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


def install_signal_handlers(groups: Groups | None = None) -> None:
    """Dump on SIGTERM and SIGUSR1 when DISTCOMM_TRACE_DIR is set (main thread only, once),
    and at exit when an operation did not complete.

    SIGTERM then does what it did before (the previous handler, or ends the process by
    the signal); SIGUSR1 dumps and calls the previous Python handler, if any.

    Args:
        groups: from now on, what every dump writes (`init_process_group` hands a
            callable over the world state); None keeps the one handed before.
    """
    global _installed, _groups
    if groups is not None:
        _groups = groups
    if _trace_dir() is None or _installed:
        return
    _installed = True
    atexit.register(_dump_at_exit)
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, handler in ((signal.SIGTERM, _on_sigterm), (signal.SIGUSR1, _on_sigusr1)):
        current = signal.getsignal(signum)
        if current is handler:
            continue
        _previous[signum] = current
        signal.signal(signum, handler)
