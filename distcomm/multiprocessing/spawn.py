"""Start N processes that each run ``fn(i, *args)`` and join them, as torch.multiprocessing.spawn.

`start_processes` starts the processes with a `multiprocessing` start method ("spawn",
"forkserver" or "fork") and returns a `ProcessContext`; `spawn` does the same with
"spawn" and, by default, joins. `ProcessContext.join` waits on the processes' sentinels
(no polling). When one process fails, join stops every other one -- an optional grace
period, then SIGTERM, another grace period (30 s by default), then SIGKILL -- and raises:

- `ProcessRaisedException` when the process raised: its message holds the child's index,
  pid and formatted traceback, which the child wrote to its own error file before it
  exited with status 1;
- `ProcessExitedException` when it exited with a non-zero status of its own (``os._exit(3)``,
  ``sys.exit(3)``) or was killed by a signal (`signal_name`, e.g. "SIGKILL"; `exit_code`
  is then minus the signal number, as `multiprocessing.Process.exitcode` reports it).

A `KeyboardInterrupt` in ``fn`` ends that child quietly with status 0: a terminal's Ctrl-C
sends SIGINT to the whole foreground process group, so the parent gets it as well and
decides what to do. When the parent's wait in ``start_processes(join=True)`` is itself
interrupted (KeyboardInterrupt or any other exception), it stops the children the same
way (SIGTERM, 30 s, SIGKILL) before the exception propagates.

The error files live in one temporary directory per context (``distcomm-spawn-*`` in the
system's temp dir), which the first failing child creates (mode 0700) and the parent
removes once every process has ended and join has read the files (or when the context is
garbage collected or the interpreter exits, for a context never joined to the end).

Children die with their parent. On Linux each child first sets PR_SET_PDEATHSIG=SIGKILL,
then checks that its parent is still there (it exits at once if the parent died before
prctl took effect), so even a SIGKILLed parent leaves no children behind. The kernel sends
that signal when the *thread* that started the child ends, not the process: call
`start_processes` from a thread that lives as long as the children (the main thread).
With "forkserver" the children's parent is the fork server, which does not end with the
caller while children it forked live (they hold its liveness pipe), so instead each such
child runs a daemon thread that waits on the pipe the caller keeps open to it
(`multiprocessing.parent_process().sentinel`) and SIGKILLs the child once the caller has
gone, on any platform. Grandchildren (processes ``fn`` starts) are not covered. Elsewhere
than Linux, "spawn" and "fork" children of a killed parent run on.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import threading
import traceback
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ..deadline import Deadline, to_seconds
from ..errors import DistError
from ..procutil import set_pdeathsig, signal_name

__all__ = [
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "spawn",
    "start_processes",
]

log = logging.getLogger(__name__)

#: seconds join() gives processes between SIGTERM and SIGKILL when no grace_period is given
DEFAULT_TERMINATE_GRACE_S = 30.0
#: seconds join() waits for a SIGKILLed process to be reaped before it gives up on it
KILL_WAIT_S = 30.0

_ERROR_DIR_PREFIX = "distcomm-spawn-"
#: the longest a join blocks before the main thread runs Python again (signals)
_WAIT_SLICE_S = 1.0


class ProcessException(DistError):
    """A process started by `start_processes` failed.

    Args:
        msg: the message.
        error_index: the failed process's index ``i`` (the first argument of ``fn``).
        pid: the failed process's pid.
    """

    def __init__(self, msg: str, error_index: int, pid: int) -> None:
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.pid = pid

    @property
    def error_pid(self) -> int:
        """The failed process's pid (the name of the constructor argument)."""
        return self.pid

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.msg, self.error_index, self.pid)


class ProcessRaisedException(ProcessException):
    """A process failed because ``fn`` raised; the message holds the child's traceback."""

    def __init__(self, msg: str, error_index: int, error_pid: int) -> None:
        super().__init__(msg, error_index, error_pid)


class ProcessExitedException(ProcessException):
    """A process exited with a non-zero status without raising, or was killed by a signal.

    Args:
        msg: the message.
        error_index: the failed process's index.
        error_pid: the failed process's pid.
        exit_code: its exit status; minus the signal number when a signal killed it.
        signal_name: the name of that signal ("SIGKILL"), None when it exited by itself.
    """

    def __init__(
        self,
        msg: str,
        error_index: int,
        error_pid: int,
        exit_code: int,
        signal_name: str | None = None,
    ) -> None:
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.msg, self.error_index, self.pid, self.exit_code, self.signal_name)


# ---------------------------------------------------------------------------- the child


def _watch_parent(sentinel: int) -> None:
    """Block until the parent's end of `sentinel` closes, then SIGKILL this process."""
    multiprocessing.connection.wait([sentinel])
    os.kill(os.getpid(), signal.SIGKILL)


def _die_with_parent(parent_pid: int, via_fork_server: bool) -> None:
    """Make sure this process ends when its parent does; end it now if the parent has."""
    if via_fork_server:
        # The death signal would follow the fork server, which outlives the caller while
        # we hold its liveness pipe; watch the pipe the caller keeps open to us instead.
        parent = multiprocessing.parent_process()
        if parent is not None and parent.sentinel is not None:
            threading.Thread(
                target=_watch_parent,
                args=(parent.sentinel,),
                name="distcomm-spawn-parent-watch",
                daemon=True,
            ).start()
        return
    if set_pdeathsig(signal.SIGKILL) and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)  # the parent died before prctl took effect


def _make_private_dir(path: str) -> None:
    """Create directory `path` (mode 0700), or accept it if we already own it."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError as exc:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise FileExistsError(f"{path} exists and is not a directory of ours") from exc


def _write_error_file(path: str, text: str) -> None:
    """Write `text` to `path` whole (through a rename), or to stderr if that fails."""
    partial = f"{path}.{os.getpid()}.partial"
    try:
        _make_private_dir(os.path.dirname(path))
        with open(partial, "w", encoding="utf-8", errors="backslashreplace") as f:
            f.write(text)
        os.replace(partial, path)
    except OSError as exc:
        sys.stderr.write(f"{text}\n(could not write the error file {path}: {exc})\n")


def _wrap(
    fn: Callable[..., Any],
    i: int,
    args: tuple[Any, ...],
    error_file: str,
    parent_pid: int,
    via_fork_server: bool,
) -> None:
    """The target of every child: die with the parent, run ``fn(i, *args)``, report errors."""
    _die_with_parent(parent_pid, via_fork_server)
    try:
        fn(i, *args)
    except KeyboardInterrupt:
        pass  # SIGINT reached the whole foreground process group: the parent handles it
    except Exception:
        _write_error_file(error_file, traceback.format_exc())
        sys.exit(1)


# --------------------------------------------------------------------------- the parent


def _remove_dir(path: str, owner_pid: int) -> None:
    """Remove the error directory, but only from the process that made it (not a fork)."""
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)


class ProcessContext:
    """The processes started by one `start_processes` call.

    Args:
        processes: the started processes; process ``i`` runs ``fn(i, *args)``.
        error_files: per process, the path its child writes its traceback to if ``fn``
            raises (the file does not exist otherwise).
        error_dir: a directory to remove once every process has ended (or when the context
            is garbage collected); `start_processes` passes the one holding `error_files`.

    Attributes:
        processes: as given.
        error_files: as given.
        sentinels: ``{process.sentinel: index}`` of the processes not joined yet.
    """

    def __init__(
        self,
        processes: Sequence[BaseProcess],
        error_files: Sequence[str],
        *,
        error_dir: str | None = None,
    ) -> None:
        if len(processes) != len(error_files):
            raise ValueError(
                f"got {len(processes)} processes but {len(error_files)} error "
                f"files; give one error file per process"
            )
        self.processes = list(processes)
        self.error_files = list(error_files)
        self.sentinels = {p.sentinel: i for i, p in enumerate(self.processes)}
        self._failure: ProcessException | None = None
        self._cleanup = (
            weakref.finalize(self, _remove_dir, error_dir, os.getpid())
            if error_dir is not None
            else None
        )

    def pids(self) -> list[int]:
        """The processes' pids, in index order."""
        return [int(p.pid) for p in self.processes]

    def join(
        self, timeout: float | timedelta | None = None, grace_period: float | None = None
    ) -> bool:
        """Wait until processes exit; on the first failure stop the others and raise.

        As torch's: one call waits until at least one more process has exited (or
        `timeout` passes), so call it in a loop (``while not ctx.join(): pass``) to wait
        for all. Waiting blocks on the processes' sentinels; nothing polls.

        Args:
            timeout: most seconds (or a timedelta) to wait; None waits until a process
                exits, 0 only looks.
            grace_period: after a failure, seconds the others get to exit by themselves,
                and again between SIGTERM and SIGKILL. None sends SIGTERM at once and
                waits `DEFAULT_TERMINATE_GRACE_S` before SIGKILL.

        Returns:
            True when every process has exited with status 0, False while some still run.

        Raises:
            ProcessRaisedException: a process's ``fn`` raised (again on every later call).
            ProcessExitedException: a process exited non-zero or was killed by a signal.
        """
        wait_s = to_seconds(timeout)
        if self._failure is not None:
            raise self._failure
        if not self.sentinels:
            return True
        # in slices: a SIGINT (Ctrl-C) the kernel hands to another thread of this process is
        # raised by the main thread only when it runs Python again, at the next slice
        deadline = Deadline(wait_s)
        while True:
            ready = multiprocessing.connection.wait(
                list(self.sentinels), timeout=deadline.slice(_WAIT_SLICE_S)
            )
            if ready or deadline.expired():
                break
        error_index = None
        for sentinel in ready:
            index = self.sentinels.pop(sentinel)
            process = self.processes[index]
            process.join()  # it has exited: this only reaps it
            if process.exitcode != 0:
                error_index = index
                break
        if error_index is None:
            if self.sentinels:
                return False
            self._remove_error_dir()
            return True
        self._stop_all(grace_period)
        self._failure = self._failure_of(error_index)
        self._remove_error_dir()
        raise self._failure

    def _failure_of(self, index: int) -> ProcessException:
        """The exception that reports process `index`'s failure (read before cleanup)."""
        process = self.processes[index]
        pid = int(process.pid)
        code = process.exitcode
        try:
            with open(self.error_files[index], encoding="utf-8") as f:
                trace = f.read()
        except FileNotFoundError:
            trace = None
        if trace is not None:
            msg = f"\n\n-- Process {index} terminated with the following error (pid {pid}):\n"
            return ProcessRaisedException(msg + trace, index, pid)
        if code is not None and code < 0:
            name = signal_name(-code, f"<Unknown signal {-code}>")
            return ProcessExitedException(
                f"process {index} terminated with signal {name} (pid {pid})",
                index,
                pid,
                code,
                signal_name=name,
            )
        return ProcessExitedException(
            f"process {index} terminated with exit code {code} (pid {pid})",
            index,
            pid,
            code if code is not None else -1,
        )

    def _wait_all_exited(self, seconds: float) -> None:
        """Block until every process has exited or `seconds` have passed."""
        deadline = Deadline(seconds)
        while True:
            pending = [p.sentinel for p in self.processes if p.exitcode is None]
            if not pending or deadline.expired():
                return
            multiprocessing.connection.wait(pending, timeout=deadline.remaining())

    def _stop_all(self, grace_period: float | None) -> None:
        """End every process still running: grace period, SIGTERM, grace period, SIGKILL."""
        if grace_period is not None:
            self._wait_all_exited(grace_period)
        for p in self.processes:
            if p.exitcode is None:
                log.warning("Terminating process %s via signal SIGTERM", p.pid)
                p.terminate()
        self._wait_all_exited(DEFAULT_TERMINATE_GRACE_S if grace_period is None else grace_period)
        for p in self.processes:
            if p.exitcode is None:
                log.warning("Process %s did not exit after SIGTERM; sending SIGKILL", p.pid)
                p.kill()
            p.join(KILL_WAIT_S)
            if p.exitcode is None:
                log.error("process %s is still there %.0f s after SIGKILL", p.pid, KILL_WAIT_S)
        self.sentinels.clear()

    def _remove_error_dir(self) -> None:
        if self._cleanup is not None:
            self._cleanup()


def _check_arguments(fn: Any, args: Any, nprocs: Any, start_method: Any) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be callable as fn(i, *args), got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            f"args must be a tuple of the arguments that follow the process "
            f"index, got {type(args).__name__}; write args=(x,) for one argument"
        )
    if not isinstance(nprocs, int) or isinstance(nprocs, bool):
        raise TypeError(f"nprocs must be an int, got {type(nprocs).__name__}")
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    methods = multiprocessing.get_all_start_methods()
    if start_method not in methods:
        raise ValueError(
            f"start_method={start_method!r} is not a multiprocessing start "
            f"method on this platform; choose one of "
            f"{', '.join(map(repr, methods))}"
        )
    if start_method != "fork":
        try:
            ForkingPickler.dumps(fn)
        except Exception as exc:
            raise TypeError(
                f"fn={fn!r} cannot be pickled ({type(exc).__name__}: {exc}), and "
                f"start_method={start_method!r} sends it to each child by pickle; define it "
                f"at module level (not a lambda, closure or local function), or use "
                f"start_method='fork'"
            ) from exc


def _stop_started(processes: list[BaseProcess]) -> None:
    """Kill processes that started before a later one failed to start."""
    for p in processes:
        p.kill()
    for p in processes:
        p.join(KILL_WAIT_S)


def start_processes(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> ProcessContext | None:
    """Start `nprocs` processes that each run ``fn(i, *args)``, ``i`` in ``0..nprocs-1``.

    Args:
        fn: the function each process runs, with its index first. "spawn" and "forkserver"
            pickle it (by reference): it must be a module-level function.
        args: the arguments after the index; picklable unless `start_method` is "fork".
        nprocs: how many processes to start.
        join: wait for all of them (and return None) rather than return the context.
        daemon: start daemonic processes (`multiprocessing.Process.daemon`).
        start_method: "spawn", "forkserver" or "fork" (what this platform offers).

    Returns:
        None when `join` is true, else the `ProcessContext` of the running processes.

    Raises:
        TypeError: `fn` is not callable or cannot be pickled, `args` is not a tuple or
            cannot be pickled, `nprocs` is not an int.
        ValueError: `nprocs` < 1, or an unknown `start_method`.
        ProcessRaisedException: (with `join`) a process's ``fn`` raised.
        ProcessExitedException: (with `join`) a process exited non-zero or was killed.
    """
    _check_arguments(fn, args, nprocs, start_method)
    mp = multiprocessing.get_context(start_method)
    # Only a failing child creates the directory: a parent that is killed before it can
    # clean up then leaves nothing behind unless a child had failed.
    error_dir = os.path.join(
        tempfile.gettempdir(), f"{_ERROR_DIR_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    )
    error_files = [os.path.join(error_dir, f"error-{i}.txt") for i in range(nprocs)]
    parent_pid = os.getpid()
    processes: list[BaseProcess] = []
    try:
        for i in range(nprocs):
            process = mp.Process(
                target=_wrap,
                daemon=daemon,
                args=(fn, i, tuple(args), error_files[i], parent_pid, start_method == "forkserver"),
            )
            try:
                process.start()
            except Exception as exc:
                if (
                    start_method != "fork"
                    and i == 0
                    and isinstance(exc, (TypeError, AttributeError, pickle.PicklingError))
                ):
                    raise TypeError(
                        f"args cannot be pickled ({type(exc).__name__}: {exc}), and "
                        f"start_method={start_method!r} sends them to each child by pickle; "
                        f"pass picklable arguments or use start_method='fork'"
                    ) from exc
                raise
            processes.append(process)
    except BaseException:
        _stop_started(processes)
        _remove_dir(error_dir, parent_pid)
        raise
    context = ProcessContext(processes, error_files, error_dir=error_dir)
    if not join:
        return context
    try:
        while not context.join():
            pass
    except ProcessException:
        raise
    except BaseException:  # KeyboardInterrupt, SystemExit from a signal handler, ...
        context._stop_all(None)
        context._remove_error_dir()
        raise
    return None


def spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> ProcessContext | None:
    """Start `nprocs` processes running ``fn(i, *args)``: `start_processes`, under torch's name.

    Args:
        fn: the function each process runs, index first; module-level unless "fork".
        args: the arguments after the index.
        nprocs: how many processes to start.
        join: wait for all of them (and return None) rather than return the context.
        daemon: start daemonic processes.
        start_method: "spawn" by default; "forkserver" and "fork" are passed through.

    Returns:
        None when `join` is true, else the `ProcessContext`.

    Raises:
        TypeError, ValueError, ProcessRaisedException, ProcessExitedException: as
            `start_processes`.
    """
    return start_processes(fn, args, nprocs, join, daemon, start_method)
