"""Process helpers shared by the launcher and the multiprocessing module (Linux prctl)."""

from __future__ import annotations

import ctypes
import signal
import sys
from collections.abc import Callable

__all__ = ["PR_SET_PDEATHSIG", "load_prctl", "set_pdeathsig", "signal_name"]

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
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                      ctypes.c_ulong]
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
