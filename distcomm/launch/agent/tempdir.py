"""The agent's temporary directory (the timer's pipe, the workers' logs without --log_dir),
and the removal of those that agents killed by SIGKILL left behind; the bound on the
flight-recorder folders that runs without --log_dir keep in the temporary directory."""

from __future__ import annotations

import os
import shutil
import tempfile

import psutil

__all__ = [
    "TEMP_PREFIX",
    "TRACE_DIRS_KEPT",
    "TRACE_PREFIX",
    "inside",
    "make_temp_dir",
    "prune_trace_dirs",
    "remove_stale_temp_dirs",
]

#: the agent's temporary directory is PREFIX<pid>-xxxx under the system's temporary root
TEMP_PREFIX = "distcomm-run-"
#: the workers' flight-recorder folder of a run without --log_dir is PREFIX<run id>-<pid>
#: under the system's temporary root: it outlives the run, for the failure report to name
TRACE_PREFIX = "distcomm-traces-"
#: how many of those folders, of agents that have ended, are kept: the newest
TRACE_DIRS_KEPT = 10


def make_temp_dir() -> str:
    """A new temporary directory for this agent, named after its pid."""
    return tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-")


def remove_stale_temp_dirs() -> None:
    """Remove the temporary directories of agents that died without cleaning up (SIGKILL):
    those of this user whose pid no longer runs; and bound the flight-recorder folders of
    ended runs (`prune_trace_dirs`)."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    prune_trace_dirs(names=names)
    for name in names:
        pid_text, sep, _ = name[len(TEMP_PREFIX) :].partition("-")
        if not (name.startswith(TEMP_PREFIX) and sep and pid_text.isdigit()):
            continue
        path = os.path.join(root, name)
        try:
            if os.stat(path).st_uid != os.getuid() or psutil.pid_exists(int(pid_text)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)


def inside(path: str, directory: str) -> bool:
    """Whether `path` is `directory` or under it (False when `directory` is empty)."""
    if not directory:
        return False
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


def prune_trace_dirs(keep: int = TRACE_DIRS_KEPT, names: list[str] | None = None) -> list[str]:
    """Remove this user's flight-recorder folders in the temporary directory beyond the
    newest `keep` (by modification time) of agents that no longer run; the paths removed.

    A failed run's folder stays for the user to read (its failure report names it); this
    bounds how many pile up. A folder of an agent that still runs is never removed.
    `names`: the temporary directory's listing, where the caller has it already.
    """
    root = tempfile.gettempdir()
    if names is None:
        try:
            names = os.listdir(root)
        except OSError:
            return []
    ended: list[tuple[float, str]] = []
    for name in names:
        pid_text = name.rpartition("-")[2]
        if not (name.startswith(TRACE_PREFIX) and pid_text.isdigit()):
            continue
        path = os.path.join(root, name)
        try:
            info = os.stat(path)
            if info.st_uid != os.getuid() or psutil.pid_exists(int(pid_text)):
                continue
        except OSError:
            continue
        ended.append((info.st_mtime, path))
    ended.sort(reverse=True)
    removed = [path for _, path in ended[max(keep, 0) :]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
