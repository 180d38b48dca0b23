"""The child processes of the store and rendezvous benchmarks: their entry point and how
they take commands from the parent (both scripts import this module from beside them)."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

from distcomm.net import raise_file_limit
from distcomm.procutil import set_pdeathsig


def child(target: Callable[..., None], conn: Any, *args: Any) -> None:
    """Every child's entry point: dies with the parent, reports its traceback, never
    lingers. `target(conn, *args)` runs with the open-file limit raised (thousands of
    sockets in one process); a failure goes to the parent as ("error", traceback)."""
    set_pdeathsig(signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and kills us
    faulthandler.enable()
    raise_file_limit()
    code = 0
    try:
        target(conn, *args)
    except BaseException:
        code = 1
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    try:
        conn.close()
    except OSError:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: store destructors, thousands of daemon threads


def command(conn: Any, timeout: float) -> Any:
    """The parent's next command; the parent gone or silent for `timeout` ends the child."""
    if not conn.poll(timeout):
        raise TimeoutError(f"no command from the benchmark's parent process for {timeout:.0f} s")
    return conn.recv()
