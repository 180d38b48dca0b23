"""How an MPI rank ends the job: the callbacks before MPI_Abort, the abort, Ctrl-C, SIGTERM.

`abort` is MPI_Abort after unlinking the MPI library's shared-memory files this process
maps (`unlink_mpi_segments`), which MPI_Finalize would have removed; `call_before_abort`
registers what runs first (the flight recorder's dump), since MPI_Abort skips exit
handlers. `mpiutil`'s abort hook ends a rank through these (`end_interrupted` after
Ctrl-C or SIGTERM), and from the main thread has this module take the two signals over
(`start_watch`) and give them back (`stop_watch`); the watch is this module's. It imports
nothing above it: `mpiutil` and the flight recorder import it, or hand it callbacks.

Ctrl-C: mpiexec forwards SIGINT to every rank, but Python raises KeyboardInterrupt only
between bytecodes of the main thread, so a rank inside a blocking MPI call never sees it,
and a rank that does leaves through MPI_Finalize, which waits for the ranks still inside
MPI: the job hangs. When MPICH's Hydra ends it instead (a rank died of the signal), the
ranks it kills with SIGKILL never unlink the node's ``/dev/shm/mpich_shm_*`` segment (the
last MPI_Finalize on a node does), and mpiexec ORs the ranks' wait statuses, SIGINT (2) |
SIGKILL (9) = 11, which it reports as "Segmentation fault (signal 11)" though no rank
crashed. So `mpiutil.install_abort_hook`, called in the main thread, also takes over SIGINT
(`start_watch`): its handler counts the KeyboardInterrupts the main thread takes, and a
daemon thread reads the signal's wakeup fd (`signal.set_wakeup_fd`), which Python's C-level
handler writes at once whatever the main thread is doing. On Ctrl-C the rank prints one
line, ``[rank R] interrupted (Ctrl-C) in barrier, called at train.py:12`` (where its main
thread was), and unlinks the MPI library's shared-memory files it maps (this job's, as
`unlink_mpi_segments`; the mappings stay valid). A KeyboardInterrupt the main thread takes
is its own: an ``except`` clause runs as usual, and an uncaught one ends the rank through
the hook, as does any exception uncaught within `_INTERRUPT_WINDOW` seconds of Ctrl-C (a
gloo collective that a peer's interruption aborted raises one). A main thread that has not
taken it within `_INTERRUPT_GRACE` seconds is stuck in MPI (or other C code), and the thread
ends the rank. Ending means MPI_Abort with status 130 (128 + SIGINT), not MPI_Finalize: rank
0 calls it one grace after the signal, so that every rank, interrupted alike, has printed
its line before the job goes, and the others a grace later in case rank 0 did not. Hydra's
mpiexec then exits with 130 (after MPICH's own "Abort(130) on node 0 ...: application called
MPI_Abort" line); when ranks merely exit, it kills the ones left with SIGKILL and its status
depends on which it reaps first. Nothing of this is set up when SIGINT already has a handler
other than Python's default, when the wakeup fd is taken (a running asyncio loop) or outside
the main thread; then an uncaught KeyboardInterrupt still ends the job through the hook. A
forked child's hook only passes exceptions on: its MPI is its parent's. Open MPI's mpirun
forwards no SIGINT: it stops the ranks with SIGTERM itself.

SIGTERM (what `timeout` and batch schedulers send first, before SIGKILL): Hydra's mpiexec
forwards it to every rank as SIGTERM, and sends nothing after it. By default a rank dies of
it without MPI_Finalize, so the node's ``/dev/shm/mpich_shm_*`` stays, and Hydra prints its
"BAD TERMINATION ... EXIT CODE: 15" banner and exits with 15. So the same machinery takes
SIGTERM over where it still has its default action and an MPI launcher started the process
(`mpi_launched`), but not distcomm-run or torchrun, whose agent stops its workers with
SIGTERM and reports the signal, nor Open MPI's mpirun, which sends the ranks SIGTERM itself
to end them and removes their shared memory. Its handler, in the main thread, ends the rank
at once (there is no exception to catch), and the thread ends a rank whose main thread is
stuck in MPI. The line is ``[rank R] terminated (SIGTERM) in barrier, called at
train.py:12``, the status 143 (128 + SIGTERM), which Hydra's mpiexec exits with. A SIGTERM
handler installed before (a user's, or SIG_IGN) is left alone, and one installed later is
obeyed, as for SIGINT. The flight recorder's, which `init_process_group` installs on top of
this one, writes its dump and then calls this one; the thread counts any handler defined in
distcomm as one that does, and writes the dump at once (`call_before_abort`, reason
"SIGTERM"), since the recorder's handler cannot run in a main thread stuck in MPI. The first
of SIGINT and SIGTERM (within `_INTERRUPT_WINDOW`) decides the line and the status; one end
runs per process, and a second one waits for it, bounded. Nothing runs on SIGKILL: a job
killed by it keeps its MPI segments.
"""

from __future__ import annotations

import fcntl
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
from types import FrameType
from typing import Any, NoReturn

from .deadline import Deadline
from .launcher_env import elastic_launched, mpi_launched

__all__ = [
    "INTERRUPTED_STATUS",
    "TERMINATED_STATUS",
    "abort",
    "active_mpi",
    "call_before_abort",
    "end_interrupted",
    "flush_and_drain",
    "interrupted_recently",
    "mapped_segments",
    "run_before_abort",
    "sigterm_is_ours",
    "start_watch",
    "stop_watch",
    "unlink_mpi_segments",
    "unlink_paths",
]

#: how long `flush_and_drain` waits for mpiexec to read the rank's piped output
_DRAIN_SECONDS = 2.0
#: the exit status of a rank that Ctrl-C ended: a shell's for a process that SIGINT ended
INTERRUPTED_STATUS = 128 + signal.SIGINT
#: the exit status of a rank that SIGTERM ended: a shell's for a process that SIGTERM ended
TERMINATED_STATUS = 128 + signal.SIGTERM
#: the signals that end an MPI rank as described in the module doc: (what the line says,
#: the reason handed to `call_before_abort`'s callbacks)
_ENDINGS = {
    signal.SIGINT: ("interrupted (Ctrl-C)", "interrupt"),
    signal.SIGTERM: ("terminated (SIGTERM)", "SIGTERM"),
}
#: seconds an interrupted rank lives on: the main thread's time to take the
#: KeyboardInterrupt, and the other ranks' time to report theirs before the launcher
#: kills the ones left
_INTERRUPT_GRACE = 1.0
#: seconds after Ctrl-C in which an uncaught exception counts as its consequence (the error
#: of a gloo collective that a peer's interruption aborted, say) and ends the rank alike
_INTERRUPT_WINDOW = 5.0
#: seconds a second end (another thread's) waits for the first one's MPI_Abort
_SECOND_END_WAIT = 3 * _INTERRUPT_GRACE + _DRAIN_SECONDS + 5.0
#: this package's folder: frames inside it are not where the user's code was interrupted
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: the standard library's folder: frames there (a lock's wait, logging) are not either
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep


# -- before the abort, and the abort --------------------------------------------------------

#: what runs before this module ends the job with MPI_Abort, which skips exit handlers
_abort_callbacks: list[Callable[[str], object]] = []


def call_before_abort(callback: Callable[[str], object]) -> None:
    """Call `callback(reason)` before the abort hook ends the job ("abort": an uncaught
    exception; "interrupt": Ctrl-C; "SIGTERM"), e.g. the flight recorder's `dump`, which
    `init_process_group` hands over here (this module sits below the recorder and
    imports nothing above it). A callback registered twice runs once; its errors are
    ignored, since the abort must go on."""
    if callback not in _abort_callbacks:
        _abort_callbacks.append(callback)


def run_before_abort(reason: str) -> None:
    """Run `call_before_abort`'s callbacks with `reason`, ignoring their errors."""
    for callback in list(_abort_callbacks):
        try:
            callback(reason)
        except Exception:
            pass


#: shared-memory files MPI libraries keep linked until MPI_Finalize (MPICH's node segment
#: and its second one with several VCIs, Open MPI 5's and 4's)
_MPI_SEGMENT_PREFIXES = ("mpich_shm_", "mpich_vci_", "sm_segment.", "vader_segment.")


def mapped_segments(prefixes: tuple[str, ...]) -> list[str]:
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


def unlink_paths(paths: list[str]) -> list[str]:
    """Unlink each of `paths` that can be; returns those removed."""
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
    return unlink_paths(mapped_segments(_MPI_SEGMENT_PREFIXES))


def abort(mpi: Any, code: int = 1) -> None:
    """MPI.COMM_WORLD.Abort(code), after removing the shared-memory files it would leak."""
    unlink_mpi_segments()
    mpi.COMM_WORLD.Abort(code)


def flush_and_drain() -> None:
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


# -- Ctrl-C and SIGTERM ---------------------------------------------------------------------


def active_mpi() -> Any:
    """mpi4py's MPI module while MPI is initialised and not finalised; else None."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            return mpi
    except Exception:  # a broken or stand-in MPI module
        pass
    return None


class _Interrupted:
    """What this process knows of Ctrl-C and SIGTERM: when the first came and which it was,
    whether it said so, and whether a thread is ending the rank."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.since: float | None = None  # monotonic time of the first SIGINT or SIGTERM seen
        self.signum = signal.SIGINT  # which one that was
        self.reported = False
        self.ending = False
        self.written = False  # whether `call_before_abort`'s callbacks ran

    def start(self, signum: int = signal.SIGINT) -> float:
        """The time of the first interrupt; now, and `signum` its signal, if this is the
        first, or the one before came `_INTERRUPT_WINDOW` seconds ago or more and nothing
        is ending the rank (a KeyboardInterrupt the main thread caught and went on)."""
        with self.lock:
            now = time.monotonic()
            if self.since is None or (not self.ending and now - self.since >= _INTERRUPT_WINDOW):
                self.since, self.signum = now, signum
                self.reported = self.written = False
            return self.since

    def write(self) -> None:
        """Run `call_before_abort`'s callbacks (the flight recorder's dump), once."""
        with self.lock:
            if self.written:
                return
            self.written = True
        run_before_abort(_ENDINGS[self.signum][1])

    def claim_end(self) -> bool:
        """Whether the caller is the first to end the rank (then it must)."""
        with self.lock:
            first, self.ending = not self.ending, True
            return first

    def recent(self) -> bool:
        """Whether Ctrl-C came less than `_INTERRUPT_WINDOW` seconds ago."""
        since = self.since
        return since is not None and time.monotonic() - since < _INTERRUPT_WINDOW

    def report(self, mpi: Any, stack: Iterable[tuple[FrameType, int]]) -> None:
        """Print ``[rank R] interrupted (Ctrl-C) ...`` (or ``terminated (SIGTERM)``) to
        stderr, once per process; `stack`: the main thread's (frame, line) pairs, innermost
        first."""
        with self.lock:
            if self.reported:
                return
            self.reported = True
        said = _ENDINGS[self.signum][0]
        stream = sys.stderr or sys.__stderr__
        try:
            stream.write(f"[rank {_world_rank(mpi)}] {said}{_where(stack)}\n")
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
            if path != __file__:  # this module's signal handlers are no call of the user's
                called = frame.f_code.co_name
        elif not where.startswith(_STDLIB_DIR) or "-packages" + os.sep in where:
            place = f"{path}:{line}"
            return f" in {called}, called at {place}" if called else f" at {place}"
    return ""


def end_interrupted(
    mpi: Any, stack: Iterable[tuple[FrameType, int]], signum: int = signal.SIGINT
) -> NoReturn:
    """End the job after Ctrl-C or SIGTERM (the first that came; `signum` if none did
    before): report it, unlink the MPI library's shared memory, write the flight recorder,
    and once the grace has passed call MPI_Abort(128 + that signal).

    Rank 0 aborts one grace after the interrupt, the others a grace later in case it did
    not (its main thread kept the KeyboardInterrupt, say): one abort usually ends the job.
    Only the first caller of the process does this; a second one (another thread) waits
    `_SECOND_END_WAIT` seconds for its abort, then exits with the status.
    """
    if threading.current_thread() is threading.main_thread():
        ignored = [signal.SIGINT]
        if _watch is not None and _watch.owns(signal.SIGTERM):
            ignored.append(signal.SIGTERM)
        for number in ignored:
            try:  # a second Ctrl-C must not raise inside this, nor a SIGTERM come back in
                signal.signal(number, signal.SIG_IGN)
            except (ValueError, OSError):
                pass
    since = _interrupted.start(signum)
    status = 128 + _interrupted.signum
    if not _interrupted.claim_end():
        time.sleep(_SECOND_END_WAIT)
        os._exit(status)
    _interrupted.report(mpi, stack)
    unlink_mpi_segments()
    _interrupted.write()
    graces = 1 if _world_rank(mpi) == 0 else 2
    left = since + graces * _INTERRUPT_GRACE - time.monotonic()
    if left > 0:  # meanwhile every rank, interrupted alike, reports
        time.sleep(left)
    flush_and_drain()
    abort(mpi, status)
    os._exit(status)  # not reached unless MPI_Abort returned


def _world_rank(mpi: Any) -> Any:
    try:
        return mpi.COMM_WORLD.Get_rank()
    except Exception:
        return "?"


class _InterruptWatch:
    """The SIGINT and SIGTERM handlers and the thread that reads their wakeup fd (module
    doc)."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)  # set_wakeup_fd's requirement
        self.taken = 0  # signals the main thread took: KeyboardInterrupts raised, SIGTERMs
        self.stopped = False
        self.signals: tuple[int, ...] = ()  # those taken over, once installed
        # the objects signal.getsignal returns (a bound method is made anew on each access)
        self.handlers: dict[int, Callable[[int, FrameType | None], None]] = {
            signal.SIGINT: self._on_sigint,
            signal.SIGTERM: self._on_sigterm,
        }
        self.thread = threading.Thread(
            target=self._watch, daemon=True, name="distcomm-mpi-interrupt"
        )

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        """Python's default SIGINT handler, counted: runs in the main thread."""
        _interrupted.start(signal.SIGINT)
        self.taken += 1
        raise KeyboardInterrupt

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """End the rank (module doc); with MPI not running, or once this watch is removed
        (a handler that called the one it replaced may still call this one), do what
        SIGTERM did before: end the process by the signal. Runs in the main thread."""
        if _interrupted.ending:  # a second SIGTERM, through a handler put on top of ours
            return
        mpi = active_mpi() if not self.stopped else None
        if mpi is None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        _interrupted.start(signal.SIGTERM)
        self.taken += 1
        # called, so SIGTERM reaches us: whatever handler is on top, none comes back in
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        end_interrupted(mpi, traceback.walk_stack(frame), signal.SIGTERM)

    def owns(self, signum: int) -> bool:
        """Whether `signum` is still ours: its handler is ours, or one that distcomm put on
        top of ours (the flight recorder's SIGTERM handler), which calls ours in turn."""
        if signum not in self.signals:
            return False
        current = signal.getsignal(signum)
        if current is self.handlers[signum]:
            return True
        module = getattr(current, "__module__", None) or ""
        return module.startswith(__package__ + ".")

    def install(self, *, sigterm: bool = True) -> bool:
        """From the main thread: become the handler of SIGINT (where it has Python's default
        handler) and, when `sigterm`, of SIGTERM (where it has the default action), and the
        wakeup fd; start the thread. False (nothing changed) when neither signal is free or
        the wakeup fd is taken."""
        wanted = []
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            wanted.append(signal.SIGINT)
        if sigterm and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            wanted.append(signal.SIGTERM)
        if not wanted:
            return False
        previous = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        if previous != -1:  # someone else's, an event loop's: theirs to keep
            signal.set_wakeup_fd(previous)
            return False
        for signum in wanted:
            signal.signal(signum, self.handlers[signum])
        self.signals = tuple(wanted)
        self.thread.start()
        return True

    def remove(self, *, thread: bool = True) -> None:
        """From the main thread: restore what `install` replaced, where still ours, stop the
        thread (when `thread`: a forked child has none) and close the pipe."""
        self.stopped = True
        for signum in self.signals:
            if signal.getsignal(signum) is self.handlers[signum]:
                signal.signal(signum, _DEFAULTS[signum])
        current = signal.set_wakeup_fd(-1)
        if current not in (-1, self.write_fd):  # replaced since: put that one back
            signal.set_wakeup_fd(current)
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
            came = [signum for signum in self.signals if signum in data and self.owns(signum)]
            if not came:
                continue
            mpi = active_mpi()
            if mpi is None:  # before MPI_Init or after MPI_Finalize: Python's own handling
                taken = self.taken
                continue
            _interrupted.start(came[0])
            main = sys._current_frames().get(threading.main_thread().ident or -1)
            stack = list(traceback.walk_stack(main)) if main is not None else []
            _interrupted.report(mpi, stack)
            unlink_mpi_segments()
            if came[0] == signal.SIGTERM:  # the recorder's handler may not run: dump now,
                _interrupted.write()  # not a grace later, when rank 0 may have aborted
            deadline = time.monotonic() + _INTERRUPT_GRACE
            while self.taken == taken and time.monotonic() < deadline:
                time.sleep(0.01)
            if self.taken != taken:  # the main thread has it: an except clause, or the hook
                taken = self.taken
                continue
            end_interrupted(mpi, stack, came[0])  # stuck in MPI (or other C code)


#: what `remove` puts back: Python's own SIGINT handler, SIGTERM's default action
_DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}


_watch: _InterruptWatch | None = None  # the signal watch in place, for `stop_watch`


def _forget_watch_in_child() -> None:
    """After fork: the child's Ctrl-C and SIGTERM are its own; the wakeup pipe is the
    parent's."""
    global _watch
    watch, _watch = _watch, None
    if watch is not None:
        try:
            watch.remove(thread=False)
        except (ValueError, OSError):  # forked from another thread than the main one
            pass


os.register_at_fork(after_in_child=_forget_watch_in_child)


def sigterm_is_ours() -> bool:
    """Whether the abort hook takes SIGTERM over (`start_watch`'s `sigterm`): an MPI
    launcher started this process, not distcomm-run or torchrun (whose agent stops
    workers with SIGTERM and reports the signal), and not Open MPI's mpirun (which stops
    the ranks with SIGTERM itself and removes their shared memory): its variables are
    unset and mpi4py's library, if loaded, is not Open MPI."""
    if not mpi_launched() or elastic_launched() or "OMPI_COMM_WORLD_SIZE" in os.environ:
        return False
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        return mpi is None or not mpi.Get_library_version().startswith("Open MPI")
    except Exception:  # a stand-in MPI module
        return True


def start_watch(*, sigterm: bool) -> bool:
    """From the main thread: take SIGINT over where it has Python's default handler and,
    when `sigterm`, SIGTERM where it has the default action, with the wakeup fd and the
    thread that reads it (module doc), and keep the watch until `stop_watch`.

    Returns:
        Whether a watch is in place (True when one already was); False, with nothing
        changed, outside the main thread, when neither signal is free or when the wakeup
        fd is taken.
    """
    global _watch
    if _watch is not None:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    watch = _InterruptWatch()
    try:
        installed = watch.install(sigterm=sigterm)
    except (ValueError, OSError):
        installed = False
    if installed:
        _watch = watch
    else:
        watch.close()
    return installed


def stop_watch() -> None:
    """From the main thread: give back what `start_watch` took, SIGINT's and SIGTERM's
    defaults and the wakeup fd where they are still ours, and stop its thread; elsewhere,
    or with no watch in place, nothing."""
    global _watch
    if _watch is not None and threading.current_thread() is threading.main_thread():
        _watch.remove()
        _watch = None


def interrupted_recently() -> bool:
    """Whether Ctrl-C or SIGTERM came less than `_INTERRUPT_WINDOW` seconds ago: an
    uncaught exception now is taken for its consequence (module doc)."""
    return _interrupted.recent()
