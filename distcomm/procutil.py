"""Process helpers shared by the launcher and the multiprocessing module: Linux prctl,
signal names, and telling when a process (tree) has gone and ending it."""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
from collections.abc import Callable, Iterable

import psutil

from .deadline import Deadline

__all__ = [
    "PR_SET_PDEATHSIG",
    "is_gone",
    "kill_process_tree",
    "load_prctl",
    "set_pdeathsig",
    "signal_name",
    "wait_gone",
]

log = logging.getLogger(__name__)

#: Seconds to wait for a SIGKILLed process to disappear before reporting it survived.
KILL_WAIT_S = 10.0

PR_SET_PDEATHSIG = 1


def load_prctl() -> Callable[..., int] | None:
    """libc's prctl on Linux, typed and ready to call (also between fork and exec); None
    elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def set_pdeathsig(signum: int) -> bool:
    """Ask the kernel to send `signum` when the parent THREAD ends; False where unsupported."""
    prctl = load_prctl()
    return prctl is not None and prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0


def signal_name(signum: int, default: str = "") -> str:
    """The name of signal `signum` ("SIGKILL"), or `default` for a number that names none."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return default


def is_gone(proc: psutil.Process) -> bool:
    """Whether a process has ended: it no longer exists, its pid was reused, or it is a
    zombie (its parent has not reaped it yet).

    Never waits for the process. A process this one may not inspect counts as running.
    """
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:
        return False


def wait_gone(
    procs: Iterable[psutil.Process],
    deadline: Deadline,
    first: float = 0.001,
    most: float = 0.05,
    also: Callable[[], bool] | None = None,
) -> list[psutil.Process]:
    """Poll until every process of `procs` is gone (and `also()`, when given, is False) or
    `deadline` passes, backing off from `first` to `most` seconds between polls.

    Returns:
        The processes still running.
    """
    left = list(procs)
    delay = first
    while True:
        left = [proc for proc in left if not is_gone(proc)]
        if (not left and (also is None or not also())) or deadline.expired():
            return left
        delay = deadline.nap(delay, most)


def _send(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)  # psutil checks the pid was not reused
    except psutil.NoSuchProcess:
        pass
    except psutil.AccessDenied:
        log.warning("not allowed to send %s to pid %d", signal_name(sig, str(sig)), proc.pid)


def kill_process_tree(proc: psutil.Process, sig: int = signal.SIGKILL, grace: float = 5.0) -> bool:
    """Signal a process's descendants, then the process; True once the process has ended.

    With a signal other than SIGKILL, whatever is still alive `grace` seconds later
    (the process or any descendant found at the start) gets SIGKILL.
    """
    if is_gone(proc):
        return True
    try:
        tree = [*proc.children(recursive=True), proc]
    except psutil.NoSuchProcess:
        return True
    for member in tree:
        _send(member, sig)
    if sig != signal.SIGKILL:
        wait_gone([proc], Deadline(grace), 0.005, 0.1)
        survivors = [member for member in tree if not is_gone(member)]
        if survivors:
            log.warning(
                "pid(s) %s still alive %s s after %s; sending SIGKILL",
                ", ".join(str(p.pid) for p in survivors),
                grace,
                signal_name(sig, str(sig)),
            )
        for member in survivors:
            _send(member, signal.SIGKILL)
    return not wait_gone([proc], Deadline(KILL_WAIT_S), 0.005, 0.1)
