"""The agent's temporary directory (the timer's pipe, the workers' logs without --log_dir),
and the removal of those that agents killed by SIGKILL left behind."""

from __future__ import annotations

import os
import shutil
import tempfile

import psutil

__all__ = ["TEMP_PREFIX", "inside", "make_temp_dir", "remove_stale_temp_dirs"]

#: the agent's temporary directory is PREFIX<pid>-xxxx under the system's temporary root
TEMP_PREFIX = "distcomm-run-"


def make_temp_dir() -> str:
    """A new temporary directory for this agent, named after its pid."""
    return tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-")


def remove_stale_temp_dirs() -> None:
    """Remove the temporary directories of agents that died without cleaning up (SIGKILL):
    those of this user whose pid no longer runs."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
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
