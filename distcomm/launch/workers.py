"""Start a node's worker processes and tear down their process trees.

Where each worker's stdout and stderr go (``--redirects``, ``--tee``, ``--local_ranks_filter``,
the duplicate filters) is `output.py`'s job; this module starts the workers with those
streams, watches them and ends them. A worker's stderr passes through the agent unless it
goes only to its log file, so that the agent keeps its last lines for the failure report
(`stderr_tail`); its stdout does too when it reaches the console, so that the console gets
whole lines from every worker; `poll` notes when it first saw each worker end (`exit_time`).

Every worker gets an error file ``<log_dir>/<local_rank>/error.json`` for `@record`
(``DISTCOMM_ERROR_FILE`` and ``TORCHELASTIC_ERROR_FILE`` in its environment). With no
`log_dir`, as torchrun does without ``--log_dir``, the files go to a new temporary
directory (``distcomm_*`` in the system's temp dir); `close()` removes it again when no
worker wrote anything there, and otherwise logs where it is.

Each worker leads its own session and process group, so a terminal's Ctrl-C reaches only
the agent, which ends the workers through `stop()`. On Linux each worker also gets
PR_SET_PDEATHSIG=SIGKILL: if the agent dies, even by SIGKILL, its workers die with it.
The kernel sends that signal when the *thread* that started the worker ends, so call
`start()` from a thread that lives as long as the workers (the agent's main thread).
With `affinity` (``--numa-binding``), a worker's CPU affinity is set between fork and exec,
before it runs any code, so every thread it starts inherits it.
Grandchildren do not get it: `stop()` reaches them through the process group and psutil.
A grandchild that both made its own session and outlived its worker is out of reach.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import IO, Any

import psutil

from ..deadline import Deadline
from ..procutil import PR_SET_PDEATHSIG, is_gone, load_prctl, wait_gone
from .errors import ERROR_FILE_ENV, TORCH_ERROR_FILE_ENV
from .output import Duplicate, Pump, Std, parse_local_ranks_filter, parse_std
from .tracebacks import StderrTail

__all__ = [
    "Std",
    "WorkerProcesses",
    "parse_local_ranks_filter",
    "parse_std",
]

log = logging.getLogger(__name__)

#: seconds close() waits for the output pumps to reach end-of-file before ending them
PUMP_JOIN_S = 5.0
#: seconds stop() waits for SIGKILLed processes to disappear
KILL_WAIT_S = 10.0


def _child_setup(agent_pid: int, cpus: frozenset[int] | None = None) -> Callable[[], None] | None:
    """The function run in each worker between fork and exec: die with the agent, and
    run on `cpus` when given."""
    prctl = load_prctl()
    if prctl is None and cpus is None:
        return None
    kill = signal.SIGKILL

    def setup() -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, kill, 0, 0, 0)
            if os.getppid() != agent_pid:  # the agent died before prctl took effect
                os.kill(os.getpid(), kill)

    return setup


class WorkerProcesses:
    """One node's workers for one attempt: started together, watched, stopped together.

    Keys of every mapping are local ranks. Use it as a context manager, or call `close()`
    (which also stops workers still running) when done::

        workers = WorkerProcesses(commands, envs, log_dir=".../attempt_0", redirects=...,
                                  tee=..., console_ranks=None, prefixes=...)
        workers.start()
        while None in workers.poll().values(): ...
        workers.close()

    Args:
        commands: local rank -> argv of its worker.
        envs: local rank -> its complete environment. ``DISTCOMM_ERROR_FILE`` and
            ``TORCHELASTIC_ERROR_FILE`` are set (over any given) to `error_file()`.
        log_dir: this attempt's directory for log and error files (created if needed), or
            None for a new temporary directory.
        redirects: local rank -> streams sent only to its log files (missing ranks: NONE).
        tee: local rank -> streams sent to its log files and the console (missing: NONE).
        console_ranks: the local ranks whose output may reach the console; None for all.
        prefixes: local rank -> the text starting each of its console lines ("" or missing:
            the agent copies the worker's stdout and stderr to the console unprefixed, a
            line at a time; teed streams are copied too, and prefixed when a prefix is
            given).
        duplicate_filters: stream ("stdout", "stderr") -> filter strings: the teed lines
            shown on the console that contain one go, prefixed, to
            ``<log_dir>/filtered_<stream>.log`` too (created when the list is not empty).
        affinity: local rank -> the CPUs its worker runs on (missing: left alone).

    Raises:
        ValueError: `commands` is empty, has an empty argv, or its ranks differ from `envs`'.
    """

    def __init__(
        self,
        commands: dict[int, list[str]],
        envs: dict[int, dict[str, str]],
        *,
        log_dir: str | None,
        redirects: dict[int, Std],
        tee: dict[int, Std],
        console_ranks: set[int] | None,
        prefixes: dict[int, str],
        duplicate_filters: dict[str, list[str]] | None = None,
        affinity: dict[int, frozenset[int]] | None = None,
    ) -> None:
        if not commands:
            raise ValueError("WorkerProcesses needs at least one worker command")
        if set(commands) != set(envs):
            raise ValueError(
                f"local ranks of commands {sorted(commands)} and of envs "
                f"{sorted(envs)} differ; give every worker both"
            )
        for local_rank, argv in commands.items():
            if not argv:
                raise ValueError(f"local rank {local_rank}: the worker command is empty")
        self._commands = {lr: [str(arg) for arg in commands[lr]] for lr in sorted(commands)}
        self._envs = {lr: dict(env) for lr, env in envs.items()}
        self._redirects = {lr: Std(redirects.get(lr, Std.NONE)) for lr in self._commands}
        self._tee = {lr: Std(tee.get(lr, Std.NONE)) for lr in self._commands}
        self._console_ranks = None if console_ranks is None else set(console_ranks)
        self._prefixes = {lr: prefixes.get(lr, "") for lr in self._commands}
        self._duplicate_filters = {
            name: list(needles) for name, needles in (duplicate_filters or {}).items() if needles
        }
        unknown = sorted(set(self._duplicate_filters) - {"stdout", "stderr"})
        if unknown:
            raise ValueError(f"duplicate_filters: streams {unknown} are not 'stdout' or 'stderr'")
        self._duplicates: dict[str, Duplicate] = {}
        self._affinity = {lr: frozenset(cpus) for lr, cpus in (affinity or {}).items()}
        self._requested_log_dir = log_dir
        self._log_dir: str | None = None
        self._temp_dir: str | None = None
        self._log_files: dict[int, dict[str, str]] = {}
        self._error_files: dict[int, str] = {}
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._pumps: list[Pump] = []
        self._stderr_pumps: dict[int, Pump] = {}
        self._tails: dict[int, StderrTail] = {}
        self._exit_times: dict[int, float] = {}
        self._wake: tuple[int, int] | None = None
        self._lock = threading.RLock()
        self._started = self._stopped = self._closed = False
        #: set by terminate(): when the stopping signal went out, which, and to whom
        self._terminated: tuple[float, int, list[psutil.Process]] | None = None

    # -- life cycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start every worker, in local-rank order, each in its own session.

        Call it from a thread that outlives the workers (see the module's docstring).

        Raises:
            RuntimeError: it was called before.
            OSError: a worker could not be started (the ones already started are ended).
        """
        with self._lock:
            if self._started:
                raise RuntimeError(
                    "WorkerProcesses.start() was already called; make a new "
                    "WorkerProcesses for another attempt"
                )
            self._started = True
            self._log_dir = self._make_log_dir()
            self._wake = os.pipe()
            try:
                for name, needles in self._duplicate_filters.items():
                    path = os.path.join(self._log_dir, f"filtered_{name}.log")
                    self._duplicates[name] = Duplicate(path, needles)
                for local_rank in self._commands:
                    setup = _child_setup(os.getpid(), self._affinity.get(local_rank))
                    self._start_one(local_rank, setup)
            except BaseException:
                self.close(grace=0.0)
                raise

    def _make_log_dir(self) -> str:
        if self._requested_log_dir is not None:
            os.makedirs(self._requested_log_dir, exist_ok=True)
            return self._requested_log_dir
        self._temp_dir = tempfile.mkdtemp(prefix="distcomm_")
        if any(self._redirects.values()) or any(self._tee.values()):
            log.warning("no --log_dir given: worker logs go to %s", self._temp_dir)
        return self._temp_dir

    def replace(self, local_rank: int, extra_env: Mapping[str, str], subdir: str) -> int:
        """Start a new worker in the slot of `local_rank`, whose worker has ended; the
        others are left alone. Returns the new worker's pid.

        The new worker gets the slot's command, environment (plus `extra_env`), streams,
        console prefix and CPUs; its log and error files go to
        ``<log_dir>/<local_rank>/<subdir>/``, so the ended worker's stay as they were.
        What is left of the ended worker's process group gets SIGKILL (`kill_remains`).
        From now on `poll`, `pids`, `stderr_tail`, `error_file` and `log_files` are the
        new worker's; `stop()` ends it with the others. Call it from the thread that
        called `start()` (see the module's docstring).

        Raises:
            RuntimeError: the workers were not started, are being stopped, or this one
                still runs.
            OSError: the new worker could not be started (the slot keeps the ended one).
        """
        with self._lock:
            if not self._started or self._terminated is not None or self._closed:
                raise RuntimeError(
                    f"local rank {local_rank}: a worker is replaced only while the others run"
                )
            old = self._procs[local_rank]
            if old.poll() is None:
                raise RuntimeError(
                    f"local rank {local_rank}: worker pid {old.pid} still runs; only an "
                    "ended worker is replaced"
                )
            self.kill_remains(local_rank)
            setup = _child_setup(os.getpid(), self._affinity.get(local_rank))
            # the ended worker's records, back in place if the new one cannot start
            kept = [(table, table.pop(local_rank, None)) for table in self._slot_tables()]
            try:
                self._start_one(local_rank, setup, extra_env, subdir)
            except BaseException:
                for table, value in kept:
                    if value is not None:
                        table[local_rank] = value
                raise
            return self._procs[local_rank].pid

    def kill_remains(self, local_rank: int) -> None:
        """SIGKILL what is left of this ended worker's process group (children that may
        still hold its output open); nothing while it runs."""
        with self._lock:
            proc = self._procs[local_rank]
            if proc.poll() is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)  # it led the group: pgid == pid

    def _slot_tables(self) -> list[dict[int, Any]]:
        """The per-slot records of a worker that a replacement gets anew."""
        return [
            self._error_files,
            self._log_files,
            self._tails,
            self._stderr_pumps,
            self._exit_times,
        ]

    def _start_one(
        self,
        local_rank: int,
        setup: Callable[[], None] | None,
        extra_env: Mapping[str, str] | None = None,
        subdir: str = "",
    ) -> None:
        assert self._log_dir is not None and self._wake is not None
        rank_dir = os.path.join(self._log_dir, str(local_rank), subdir)
        os.makedirs(rank_dir, exist_ok=True)
        error_file = os.path.join(rank_dir, "error.json")
        with contextlib.suppress(FileNotFoundError):
            os.remove(error_file)  # a stale one would be read as this attempt's error
        self._error_files[local_rank] = error_file
        env = {**self._envs[local_rank], **(extra_env or {})}
        env[ERROR_FILE_ENV] = env[TORCH_ERROR_FILE_ENV] = error_file

        shown = self._console_ranks is None or local_rank in self._console_ranks
        prefix = self._prefixes[local_rank]
        self._log_files[local_rank] = {}
        targets: dict[str, object] = {}
        pumps: dict[str, tuple[IO[bytes] | None, bool]] = {}  # stream -> (file, to console)
        opened: list[IO[bytes]] = []
        try:
            for name, bit in (("stdout", Std.OUT), ("stderr", Std.ERR)):
                teed = bool(self._tee[local_rank] & bit)
                redirected = bool(self._redirects[local_rank] & bit)
                file = None
                if teed or redirected:
                    path = os.path.join(rank_dir, f"{name}.log")
                    file = open(path, "wb")  # noqa: SIM115 (owned by the worker or a pump)
                    opened.append(file)
                    self._log_files[local_rank][name] = path
                to_console = shown and (teed or not redirected)
                if to_console and (file is not None or prefix):
                    targets[name] = subprocess.PIPE
                    pumps[name] = (file, True)
                elif file is not None:
                    targets[name] = file
                elif name == "stderr" or to_console:
                    # through the agent, which writes whole lines to the console (so lines
                    # of different workers never mix) and keeps stderr's tail
                    targets[name] = subprocess.PIPE
                    pumps[name] = (None, to_console)
                else:
                    targets[name] = subprocess.DEVNULL
            argv = self._commands[local_rank]
            try:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    stdout=targets["stdout"],
                    stderr=targets["stderr"],
                    start_new_session=True,
                    preexec_fn=setup,
                    close_fds=True,
                )
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"local rank {local_rank}: cannot start {shlex.join(argv)}: {exc.strerror}",
                ) from exc
        except BaseException:
            for file in opened:
                file.close()
            raise
        self._procs[local_rank] = proc
        for file in opened:  # the worker holds its own copy; pumps keep theirs
            if all(file is not pump_file for pump_file, _ in pumps.values()):
                file.close()
        for name, (file, to_console) in pumps.items():
            source = proc.stdout if name == "stdout" else proc.stderr
            assert source is not None
            teed = bool(self._tee[local_rank] & (Std.OUT if name == "stdout" else Std.ERR))
            tail = self._tails[local_rank] = StderrTail() if name == "stderr" else None
            pump = Pump(
                source,
                file,
                name if to_console else None,
                prefix,
                self._wake[0],
                f"local rank {local_rank} {name}",
                self._duplicates.get(name) if teed else None,
                tail=tail,
                group_tracebacks=name == "stderr",
            )
            self._pumps.append(pump)
            if name == "stderr":
                self._stderr_pumps[local_rank] = pump
            pump.thread.start()

    def stop(self, grace: float = 30.0, sig: int = signal.SIGTERM) -> None:
        """End every worker's process tree: `sig`, up to `grace` seconds, then SIGKILL.

        `sig` is followed at once by SIGCONT: a stopped (frozen) process would otherwise
        keep `sig` pending and hold the stop up for the whole grace period.

        The signal goes to each worker's process group and to every descendant psutil finds
        under a running worker (which catches those that made their own session). A
        descendant that left the group and whose worker already ended cannot be found.
        Every worker is reaped. Calling it again, or after the workers ended, is harmless.

        Args:
            grace: seconds to wait after `sig` before SIGKILL (after the signal of an
                earlier `terminate()`, when there was one).
            sig: the first signal (SIGKILL skips the wait); not sent again when
                `terminate()` already sent one.
        """
        with self._lock:
            if not self._procs or self._stopped:
                return
            if self._terminated is None:
                self.terminate(sig)
            assert self._terminated is not None
            started, sig, targets = self._terminated
            deadline = Deadline(max(0.0, started + max(grace, 0.0) - time.monotonic()))
            if sig != signal.SIGKILL:
                targets = self._wait(targets, deadline)
                if targets or self._running():
                    log.info(
                        "%d processes of the workers' trees still running %.1f s "
                        "after %s; sending SIGKILL",
                        len(targets) + len(self._running()),
                        grace,
                        signal.Signals(sig).name,
                    )
                    targets = self._tree(targets)
                    self._signal(signal.SIGKILL, targets)
            left = self._wait(targets, Deadline(KILL_WAIT_S))
            for proc in self._procs.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0 if left else KILL_WAIT_S)
            if left or self._running():
                log.warning(
                    "processes %s did not end after SIGKILL (uninterruptible?)",
                    sorted({p.pid for p in left} | {p.pid for p in self._running()}),
                )
            else:
                self._stopped = True

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        """Send `sig` (and SIGCONT) to every worker's process tree now, without waiting.

        A later `stop()` waits for the trees from this moment on (its grace counts from
        here) and sends SIGKILL when the grace is over; `sig` is sent once.
        """
        with self._lock:
            if not self._procs or self._stopped or self._terminated is not None:
                return
            targets = self._tree()
            self._terminated = (time.monotonic(), sig, targets)
            self._signal(sig, targets)

    def close(self, grace: float = 30.0) -> None:
        """Stop workers still running (see `stop`), end the output pumps, close every file.

        Args:
            grace: passed to `stop()` for workers still running.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.stop(grace)
            deadline = time.monotonic() + PUMP_JOIN_S
            for pump in self._pumps:
                pump.thread.join(max(0.0, deadline - time.monotonic()))
            stuck = [pump for pump in self._pumps if pump.thread.is_alive()]
            if stuck and self._wake is not None:
                log.warning(
                    "output of %s still open after its worker ended (a process "
                    "outside the worker's tree holds it); no longer copying it",
                    ", ".join(pump.name for pump in stuck),
                )
                os.write(self._wake[1], b"x")
                for pump in stuck:
                    pump.thread.join(PUMP_JOIN_S)
            if any(pump.thread.is_alive() for pump in self._pumps):
                # blocked writing to our own console; it still polls the wake pipe: keep it
                log.warning("an output pump is blocked writing to the console; leaving it")
            elif self._wake is not None:
                for fd in self._wake:
                    os.close(fd)
                self._wake = None
            for duplicate in self._duplicates.values():
                duplicate.close()
            if self._temp_dir is not None:
                self._remove_temp_dir_if_unused()

    def _remove_temp_dir_if_unused(self) -> None:
        assert self._temp_dir is not None
        for _, _, files in os.walk(self._temp_dir):
            if files:
                log.warning("worker logs and error files kept in %s", self._temp_dir)
                return
        shutil.rmtree(self._temp_dir, ignore_errors=True)

    def __enter__(self) -> WorkerProcesses:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- observation ---------------------------------------------------------------------

    def pids(self) -> dict[int, int]:
        """local rank -> process id of each started worker."""
        return {lr: proc.pid for lr, proc in self._procs.items()}

    def poll(self) -> dict[int, int | None]:
        """local rank -> exit code (None while running; negative: ended by that signal)."""
        if not self._started:
            raise RuntimeError("WorkerProcesses.poll() before start()")
        codes = {lr: proc.poll() for lr, proc in self._procs.items()}
        now = time.time()
        for lr, code in codes.items():
            if code is not None:
                self._exit_times.setdefault(lr, now)
        return codes

    def exit_time(self, local_rank: int) -> float | None:
        """When `poll` first saw this worker ended (`time.time()`), or None."""
        return self._exit_times.get(local_rank)

    def stderr_tail(self, local_rank: int, deadline: float | None = None) -> StderrTail | None:
        """The last lines of this worker's stderr the agent kept; None when its stderr goes
        only to its log file (`log_files`).

        Args:
            deadline: `time.monotonic()` until which to wait for the worker's stderr to
                end (it has ended, but the agent may not have read all of it yet); None:
                do not wait.
        """
        pump = self._stderr_pumps.get(local_rank)
        if pump is not None and deadline is not None:
            pump.thread.join(max(0.0, deadline - time.monotonic()))
        return self._tails.get(local_rank)

    @property
    def log_dir(self) -> str | None:
        """The directory holding the log and error files (None before `start()`)."""
        return self._log_dir

    def error_file(self, local_rank: int) -> str:
        """The error file `@record` writes for this worker ("" before `start()`)."""
        return self._error_files.get(local_rank, "")

    def log_files(self, local_rank: int) -> dict[str, str]:
        """This worker's log files by stream ("stdout", "stderr"); only streams with one."""
        return dict(self._log_files.get(local_rank, {}))

    # -- process trees -------------------------------------------------------------------

    def _running(self) -> list[subprocess.Popen[bytes]]:
        return [proc for proc in self._procs.values() if proc.poll() is None]

    def _tree(self, known: Iterable[psutil.Process] = ()) -> list[psutil.Process]:
        """Every live process of the workers' trees except the workers themselves: the
        descendants of running workers and every member of the workers' process groups."""
        own = os.getpid()
        worker_pids = {proc.pid for proc in self._procs.values()}
        found = {proc.pid: proc for proc in known if not is_gone(proc)}
        for proc in self._running():
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    found.setdefault(child.pid, child)
            except psutil.Error:
                pass
        for proc in psutil.process_iter():
            if proc.pid in found or proc.pid in worker_pids or proc.pid == own:
                continue
            try:
                if os.getpgid(proc.pid) in worker_pids:
                    found[proc.pid] = proc
            except OSError:
                pass
        return [proc for proc in found.values() if proc.pid not in worker_pids]

    def _signal(self, sig: int, targets: list[psutil.Process]) -> None:
        """Send `sig` to every worker's group and to `targets`; a stopping signal other
        than SIGKILL is followed by SIGCONT, so a stopped (SIGSTOP, ^Z, debugger-frozen)
        process acts on it now instead of when the grace period ends in SIGKILL."""
        signals = [sig] if sig in (signal.SIGKILL, signal.SIGCONT) else [sig, signal.SIGCONT]
        for each in signals:
            for proc in self._procs.values():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, each)  # each worker leads its group: pgid == pid
                try:
                    in_group = proc.returncode is None and os.getpgid(proc.pid) == proc.pid
                except OSError:
                    in_group = False
                if not in_group:  # it left its group: reach it directly, once
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(each)  # no-op once reaped
            for target in targets:
                with contextlib.suppress(psutil.Error):
                    target.send_signal(each)  # psutil checks the pid was not reused

    def send_signal(self, sig: int) -> list[int]:
        """Send `sig` to each worker process that still runs (not to its descendants).

        Safe to call from a signal handler: it takes no lock and never raises for a worker
        that has just ended.

        Returns:
            The pids the signal was sent to.
        """
        sent = []
        for proc in list(self._procs.values()):
            if proc.returncode is not None:
                continue
            try:
                os.kill(proc.pid, sig)  # not reaped yet: the pid is still this worker's
            except (ProcessLookupError, PermissionError):
                continue
            sent.append(proc.pid)
        return sent

    def _wait(self, targets: list[psutil.Process], deadline: Deadline) -> list[psutil.Process]:
        """Wait until the workers and `targets` ended or `deadline`; those still alive."""
        return wait_gone(targets, deadline, 0.001, 0.05, also=lambda: bool(self._running()))
