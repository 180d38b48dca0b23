"""MPI glue below the backends: load mpi4py on demand, bounded waits, abort on uncaught errors.

Importing this module never imports mpi4py; `load_mpi` does, and that initialises MPI, so
it is called only where MPI is wanted (the store bootstrap of `rendezvous` under mpiexec).

`install_abort_hook` is the equivalent of ``python -m mpi4py script.py``: an uncaught
exception in the main thread prints its traceback, each line prefixed ``[rank R]``, and calls
``MPI.COMM_WORLD.Abort(1)``, so `mpiexec` ends the whole job with a non-zero status instead
of the other ranks waiting forever. Like mpi4py's run mode it covers the main thread only:
an uncaught exception in another thread ends only that thread (Python's default), since
aborting the job for a helper thread's error would turn recoverable failures into job
failures. KeyboardInterrupt is passed to the previous hook unchanged (mpiexec forwards
Ctrl-C to every rank). SystemExit never reaches `sys.excepthook`, so unlike mpi4py's run
mode ``sys.exit(n)`` does not abort.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import stat
import struct
import sys
import termios
import threading
import time
import traceback
from types import ModuleType, TracebackType
from typing import Any

from . import config
from .deadline import Deadline
from .errors import DistTimeoutError

__all__ = [
    "INSTALL_HINT",
    "abort",
    "install_abort_hook",
    "is_mpi4py_available",
    "load_mpi",
    "remove_abort_hook",
    "unlink_mpi_segments",
    "wait_all",
]

#: What to install for MPI support.
INSTALL_HINT = "pip install distcomm[mpi]"

_POLL_FIRST = 0.0005
_POLL_MOST = 0.05
#: how long the abort hook waits for mpiexec to read the rank's piped output
_DRAIN_SECONDS = 2.0


def is_mpi4py_available() -> bool:
    """Whether mpi4py is installed; does not import it (importing initialises MPI)."""
    try:
        return importlib.util.find_spec("mpi4py") is not None
    except (ImportError, ValueError):
        return False


def load_mpi() -> ModuleType:
    """mpi4py's MPI module; the first call imports it, which initialises MPI.

    Raises:
        ImportError: mpi4py is missing or cannot load its MPI library; says what to do.
    """
    try:
        from mpi4py import MPI
    except ImportError as exc:
        if not is_mpi4py_available():
            raise ImportError(f"mpi4py is not installed: {INSTALL_HINT}") from exc
        raise ImportError(f"mpi4py is installed but cannot be imported: {exc}") from exc
    except (OSError, RuntimeError) as exc:
        raise ImportError(f"mpi4py cannot load its MPI library: {exc}") from exc
    return MPI


def wait_all(comm: Any, deadline: Deadline, what: str) -> None:
    """Return once every rank of `comm` has called this, polling a non-blocking barrier.

    Args:
        comm: an mpi4py communicator.
        deadline: when to give up.
        what: who waits in which step, for the message ("[rank 1/4] env:// rendezvous").

    Raises:
        DistTimeoutError: not every rank arrived before the deadline.
    """
    request = comm.Ibarrier()
    delay = _POLL_FIRST
    while not request.Test():
        if deadline.expired():
            raise DistTimeoutError(
                f"{what}: not every one of the {comm.Get_size()} processes of the MPI "
                f"communicator arrived within {deadline.seconds:.1f} s; did every process "
                f"call init_process_group?"
            )
        time.sleep(deadline.slice(delay))
        delay = min(delay * 2, _POLL_MOST)


# -- abort on an uncaught exception -----------------------------------------------------------


class _AbortHook:
    """sys.excepthook that reports the exception with the rank, then aborts MPI.COMM_WORLD."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.active = True

    def __call__(
        self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        mpi = sys.modules.get("mpi4py.MPI")
        if (
            not self.active
            or issubclass(exc_type, KeyboardInterrupt)
            or mpi is None
            or not mpi.Is_initialized()
            or mpi.Is_finalized()
        ):
            self.previous(exc_type, exc, tb)
            return
        try:
            rank = mpi.COMM_WORLD.Get_rank()
            text = "".join(traceback.format_exception(exc_type, exc, tb)).rstrip("\n")
            lines = [f"[rank {rank}] {line}" for line in text.split("\n")]
            lines.append(
                f"[rank {rank}] uncaught {exc_type.__name__}: calling "
                "MPI.COMM_WORLD.Abort(1) to end the job "
                "(DISTCOMM_MPI_ABORT_ON_EXCEPTION=0 turns this off)"
            )
            stream = sys.stderr or sys.__stderr__
            if stream is not None:
                stream.write("\n".join(lines) + "\n")
            if self.previous is not sys.__excepthook__:  # the default would print it again
                self.previous(exc_type, exc, tb)
        except Exception:
            pass
        finally:
            _flush_and_drain()
            abort(mpi)


#: shared-memory files MPI libraries keep linked until MPI_Finalize (MPICH, Open MPI)
_MPI_SEGMENT_PREFIXES = ("mpich_shm_", "vader_segment.", "sm_segment.")


def unlink_mpi_segments() -> list[str]:
    """Unlink the MPI library's /dev/shm files that this process maps; returns their paths.

    MPI_Abort skips MPI_Finalize, which would remove them; mappings stay valid, so the
    other ranks are unaffected until they exit too.
    """
    removed = []
    try:
        with open("/proc/self/maps") as maps:
            paths = {
                line.split(None, 5)[5].strip()
                for line in maps
                if line.count(" ") >= 5 and "/dev/shm/" in line
            }
    except (OSError, IndexError):
        return removed
    for path in sorted(paths):
        name = path.rsplit("/", 1)[-1]
        if path.endswith("(deleted)") or not name.startswith(_MPI_SEGMENT_PREFIXES):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def abort(mpi: Any, code: int = 1) -> None:
    """MPI.COMM_WORLD.Abort(code), after removing the shared-memory files it would leak."""
    unlink_mpi_segments()
    mpi.COMM_WORLD.Abort(code)


def _flush_and_drain() -> None:
    """Flush stdout and stderr; where they are pipes (mpiexec reads them), wait a moment
    for the reader to take what they hold, since an abort stops it from reading further."""
    fds = []
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
            fds.append(stream.fileno())
        except Exception:
            pass
    deadline = Deadline(_DRAIN_SECONDS)
    for fd in fds:
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                continue
            while not deadline.expired():
                unread = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
                if unread == 0:
                    break
                time.sleep(0.005)
        except OSError:
            pass


_hook_lock = threading.Lock()
_installed: _AbortHook | None = None  # the hook in place, for remove_abort_hook


def install_abort_hook() -> bool:
    """Make an uncaught exception in the main thread abort the MPI job (see the module doc).

    Reads DISTCOMM_MPI_ABORT_ON_EXCEPTION (default 1). Does not import mpi4py: the hook
    aborts only when mpi4py.MPI is loaded and MPI is initialised and not finalised;
    otherwise, and for KeyboardInterrupt, it just calls the previous hook. Calling it
    again while installed changes nothing.

    Returns:
        Whether the hook is installed: False when the variable is 0 or mpi4py is missing.

    Raises:
        ValueError: DISTCOMM_MPI_ABORT_ON_EXCEPTION is not a boolean.
    """
    global _installed
    if not config.load().mpi_abort_on_exception or not is_mpi4py_available():
        return False
    with _hook_lock:
        if _installed is None:
            _installed = _AbortHook(sys.excepthook)
            sys.excepthook = _installed
    return True


def remove_abort_hook() -> bool:
    """Undo `install_abort_hook`: restore the previous hook (or, when another hook was
    installed on top since, switch ours off so it only passes exceptions on).

    Returns:
        Whether a hook was installed.
    """
    global _installed
    with _hook_lock:
        hook, _installed = _installed, None
        if hook is None:
            return False
        hook.active = False
        if sys.excepthook is hook:
            sys.excepthook = hook.previous
    return True
