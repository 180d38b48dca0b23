"""The elastic agent: rendezvous, start the local workers, monitor, restart, scale.

One agent runs per node. Each round of the rendezvous gives the node its group rank and
the number of nodes; the agent assigns the workers' ranks (every node runs the same
number of workers), starts them, and watches them every `monitor_interval`. What the
other nodes do comes from a `RoundWatch` reading the rendezvous on its own thread, so a
slow store or a dead link never stops the agent from watching its workers:

- all workers exited 0: wait for the other nodes to finish (exit barrier), close the
  rendezvous, exit 0. The wait ends early when the round fails on another node (handled
  as below), when the rendezvous is closed, or when a node leaves the round (a new round);
- a worker failed (non-zero exit, signal, or killed by an expiration timer), here or on
  another node (the round's failure key in the run's store): record this node's failures
  in the run's store for the other nodes' reports, count one restart for the round (the
  count is the run's, not the node's: every node that sees the failure of round R counts
  it once together) and stop the local workers. Within `max_restarts` every node joins
  the next round; past it the rendezvous is closed and every node prints the report of
  the round's failures, on all nodes, and exits 1. With --on-failure=replace a failed
  worker is first replaced alone while the others run on (`replace.py`), within a budget;
- another node waits to join (scale-up) or this node's round is over (a new round began,
  a node left it): stop the workers and join the next round (not counted as a restart);
- the rendezvous was closed by another node: stop and exit with the run's outcome (1,
  with the failure report, when the run failed).

The signals of `signals_to_handle` (torchrun's --signals_to_handle; SIGTERM, SIGINT,
SIGHUP and SIGQUIT by default) stop the run: every worker's process tree gets the signal
(then SIGKILL after `shutdown_timeout`), the rendezvous is closed and the agent exits
128 + the signal number. SIGUSR1 and SIGUSR2, unless listed there, are passed on to every
worker process and the run goes on (Slurm's ``sbatch --signal=USR1@120``: the workers
checkpoint before the job is pre-empted).

The agent's events (rendezvous done, workers started, failed, restarted, the outcome) go to
the handler `event_log_handler` names (see `events.py`). `AgentConfig` is what the agent
runs (`config.py`); the workers' environment for a round is `worker_env.py`'s, the failed
workers' records `failures.py`'s, the events and the failure report `report.py`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from types import FrameType

from ...config import get as env_var
from ...errors import DistError
from ...net import format_address
from ...store import Store, TCPStore
from ...store.base import publish
from ..errors import ChildFailedError, ProcessFailure
from ..numa import numa_affinity
from ..rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    get_rendezvous_handler,
)
from ..timer import FileTimerServer
from ..workers import WorkerProcesses
from .address import advertised_address, endpoint_address, resolve_ipv4
from .config import (
    DEFAULT_SIGNALS_TO_HANDLE,
    FORWARDED_SIGNALS,
    AgentConfig,
    SignalException,
)
from .failures import observe_failures, wait_for_root_cause
from .replace import Replacer
from .report import AgentEvents, round_report, share_failures, trace_dir
from .round_sync import (
    RDZV_CHECK_INTERVAL,
    check_homogeneous,
    count_restart,
    depart,
    exit_barrier,
)
from .tempdir import inside, make_temp_dir, remove_stale_temp_dirs
from .watch import RoundWatch, RunResult, next_step, slow_store
from .worker_env import worker_specs

__all__ = [
    "DEFAULT_SIGNALS_TO_HANDLE",
    "FORWARDED_SIGNALS",
    "AgentConfig",
    "ElasticAgent",
    "RunResult",
    "SignalException",
    "launch",
]

log = logging.getLogger("distcomm.launch")


def _timer_file() -> str | None:
    """The timers' pipe torchrun's variables ask for: TORCHELASTIC_TIMER_FILE, read only
    with TORCHELASTIC_ENABLE_FILE_TIMER=1 as torch's agent does (a launcher started inside
    a worker inherits the outer run's TORCHELASTIC_TIMER_FILE and must not serve it)."""
    if os.environ.get("TORCHELASTIC_ENABLE_FILE_TIMER") != "1":
        return None
    return os.environ.get("TORCHELASTIC_TIMER_FILE") or None


class _Signal(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class ElasticAgent:
    """Runs one node's part of a launch; `run()` returns the exit status."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        #: after run(): the failures of the run's report (empty unless it failed)
        self.failures: dict[int, ProcessFailure] = {}
        #: after run(): the signal that stopped it, or None
        self.signal: int | None = None
        #: after run(): the error that ended it early (rendezvous, store, bad flag), or None
        self.error: BaseException | None = None
        #: local rank -> global rank of the workers last started here
        self.ranks: dict[int, int] = {}
        self._affinity: dict[int, frozenset[int]] | None = None
        self._events = AgentEvents(config)
        self._replacer = Replacer(config, self._events)  # --on-failure=replace
        self._restarts = 0
        self._handler: RendezvousHandler | None = None
        self._workers: WorkerProcesses | None = None
        self._worker_store: Store | None = None
        self._timer: FileTimerServer | None = None
        self._expired: dict[int, str] = {}
        self._expired_lock = threading.Lock()
        self._last_info: RendezvousInfo | None = None
        self._attempt = 0
        self._tmp = ""
        self._log_root = ""
        self._trace_dir = ""  # DISTCOMM_TRACE_DIR of the latest workers
        self._logs_kept = False  # whether the latest workers' files outlive the agent
        self._auth_key: bytes | None = None  # the job's key, when this agent made one

    # -- the run ------------------------------------------------------------------------------

    def run(self) -> int:
        """Run the job on this node until it succeeds, fails for good or is signalled."""
        config = self.config
        stopping = tuple(config.signals_to_handle)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in stopping}
        for sig in FORWARDED_SIGNALS:
            if sig not in stopping:
                previous[sig] = signal.signal(sig, self._forward_signal)
        remove_stale_temp_dirs()
        self._tmp = make_temp_dir()
        try:
            if config.numa_binding is not None:
                self._affinity, message = numa_affinity(config.numa_binding, config.nproc_per_node)
                if message:
                    print(message, file=sys.stderr, flush=True)
            if config.logs_specs is None and config.log_dir:
                os.makedirs(config.log_dir, exist_ok=True)
                self._log_root = os.path.abspath(
                    tempfile.mkdtemp(prefix=f"{config.run_id}_", dir=config.log_dir)
                )
            else:
                self._log_root = os.path.join(self._tmp, "logs")
            if config.max_nodes == 1 and not env_var("DISTCOMM_AUTH_KEY"):
                # one node: the agent's stores and the workers share a fresh secret, given
                # to the stores as auth_key and to the workers in their environment
                self._auth_key = secrets.token_hex(16).encode()
            self._timer = FileTimerServer(
                _timer_file() or os.path.join(self._tmp, "timer.fifo"),
                config.run_id,
                max_interval=1.0,
                on_expired=self._on_timer_expired,
            )
            self._timer.start()
            self._handler = get_rendezvous_handler(self.config.rdzv_parameters(self._auth_key))
            code = self._invoke_run()
            self._record_agent("SUCCEEDED" if code == 0 else "FAILED")
            return code
        except _Signal as sig:
            log.warning("distcomm-run: got %s: stopping the workers with it", sig)
            self.signal = sig.signum
            self._stop_workers(sig.signum)
            self._close_rendezvous()
            self._record_agent("FAILED", f"signal {sig}")
            return 128 + sig.signum
        except (RendezvousError, DistError, ValueError, OSError) as exc:
            self.error = exc
            print(f"distcomm-run: {exc}", file=sys.stderr, flush=True)
            self._record_agent("FAILED", f"{type(exc).__name__}: {exc}")
            return 1
        finally:
            for sig in stopping:
                signal.signal(sig, signal.SIG_IGN)
            try:
                self._stop_workers()
                self._shutdown()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        for sig in self.config.signals_to_handle:
            signal.signal(sig, signal.SIG_IGN)  # one signal stops the run; cleanup goes on
        raise _Signal(signum)

    def _forward_signal(self, signum: int, frame: FrameType | None) -> None:
        """Pass a SIGUSR1/SIGUSR2 on to every worker process; the run goes on."""
        workers = self._workers
        pids = workers.send_signal(signum) if workers is not None else []
        name = signal.Signals(signum).name
        if pids:
            log.warning(
                "distcomm-run: got %s: passed on to worker(s) %s", name, ", ".join(map(str, pids))
            )
        else:
            log.warning("distcomm-run: got %s while no worker runs: ignored", name)

    def _invoke_run(self) -> int:
        assert self._handler is not None
        handler, c = self._handler, self.config
        while True:
            started = time.monotonic()
            try:
                info = handler.next_rendezvous()
            except RendezvousClosedError:
                return self._closed_outcome()
            self._last_info = info
            self._record_agent(
                "RENDEZVOUS", duration_ms=(time.monotonic() - started) * 1000, info=info
            )
            restarts = int(info.run_store.add("restart_count", 0))
            self._restarts = restarts
            log.info(
                "distcomm-run: round %d: node %d of %d, %d worker(s) each, restart %d of %d",
                info.round,
                info.rank,
                info.world_size,
                c.nproc_per_node,
                restarts,
                c.max_restarts,
            )
            self._start_workers(info, restarts)
            watch = RoundWatch(
                handler,
                info.run_store,
                info.round,
                self._store_description(),
                interval=RDZV_CHECK_INTERVAL,
            )
            watch.start()
            try:
                result = self._monitor(watch)
                if result is RunResult.SUCCEEDED:
                    result = exit_barrier(info, watch, c.exit_barrier_timeout)
            finally:
                watch.stop()
            if result is RunResult.SUCCEEDED:
                self._record_workers(info, "SUCCEEDED", {})
                self._stop_workers()
                # read by check() once closed; a failure recorded first is kept
                info.run_store.compare_set("outcome", b"", b"succeeded")
                self._close_rendezvous()
                depart(info)
                return 0
            if result is RunResult.CLOSED:
                self._stop_workers()
                return self._closed_outcome()
            if result is RunResult.MEMBERSHIP_CHANGED:
                seen = watch.latest()
                log.warning(
                    "distcomm-run: the membership changed (%s): restarting the "
                    "workers in a new round",
                    "a node left this round, or a new one began"
                    if seen is None or seen.view.round_over
                    else f"{seen.view.nodes_waiting} node(s) waiting to join",
                )
                # the other nodes' workers fail once these stop, maybe before their agents
                # see the change: tell them first that the round ends for it
                with contextlib.suppress(DistError, OSError), slow_store("ending the round"):
                    publish(info.run_store, _membership_key(info.round), "1")
                self._stop_workers()
                continue
            code = self._round_failed(info)
            if code is not None:
                return code

    def _ended_for_membership(self, info: RendezvousInfo) -> bool:
        """Whether another node ended this round for a membership change (so a failure of
        this node's workers followed from its workers stopping, and counts as no failure)."""
        with contextlib.suppress(DistError, OSError), slow_store("checking the round"):
            return bool(info.run_store.check([_membership_key(info.round)]))
        return False

    def _round_failed(self, info: RendezvousInfo) -> int | None:
        """Handle a failed round: record, count, stop; the exit status once no restart is
        left, else None (join the next round). A round another node ended for a membership
        change is no failure: its workers' failures followed from that."""
        c = self.config
        failures = self._failures(info)
        if self._workers is not None:
            self._workers.terminate()  # the other workers end while the store is asked
        if self._ended_for_membership(info):
            log.warning(
                "distcomm-run: workers ended while another node restarts this round for a "
                "membership change: restarting the workers in a new round"
            )
            self._stop_workers()
            return None
        self._record_workers(info, "FAILED", failures)
        with slow_store("recording the failure"):
            if failures:
                share_failures(info.run_store, info.round, info.rank, failures)
            count = count_restart(info)
        self._stop_workers()
        if count > c.max_restarts:
            with slow_store("recording the outcome"):
                publish(info.run_store, "report_round", f"{info.round} {info.world_size}")
                publish(info.run_store, "outcome", "failed")  # read by check() once closed
            self._close_rendezvous()
            self._print_report(info.run_store, info.round, info.world_size, failures, info.rank)
            depart(info)
            return 1
        self._record_agent("RESTART", f"restart {count} of {c.max_restarts}", info=info)
        if failures:
            first = ChildFailedError(c.name, failures).get_first_failure()[1]
            log.warning(
                "distcomm-run: worker group failed (rank %d: %s); restart %d of %d",
                first.rank,
                first.message,
                count,
                c.max_restarts,
            )
        else:
            log.warning(
                "distcomm-run: the worker group failed on another node; restart %d of %d",
                count,
                c.max_restarts,
            )
        return None

    def _closed_outcome(self) -> int:
        info = self._last_info
        outcome, report = b"", b""
        if info is not None:
            with contextlib.suppress(DistError, OSError):
                if info.run_store.check(["outcome"]):
                    outcome = info.run_store.get("outcome")
                if outcome == b"failed" and info.run_store.check(["report_round"]):
                    report = info.run_store.get("report_round")
            if report:
                round_text, _, size_text = report.decode().partition(" ")
                with contextlib.suppress(DistError, OSError, ValueError):
                    round_ = int(round_text)
                    self._print_report(
                        info.run_store,
                        round_,
                        int(size_text),
                        {},
                        info.rank if round_ == info.round else None,
                    )
            depart(info)
        if outcome == b"succeeded":
            return 0
        print(
            f"distcomm-run: the rendezvous of run {self.config.run_id!r} was closed "
            f"{'after the run failed on another node' if outcome else 'by another node'}",
            file=sys.stderr,
            flush=True,
        )
        return 1

    # -- failure reports across nodes ---------------------------------------------------------

    def _print_report(
        self,
        run_store: Store,
        round_: int,
        world_size: int,
        local: dict[int, ProcessFailure],
        node: int | None,
    ) -> None:
        """Print the failure report of a round (see `round_report`); keep its failures."""
        c = self.config
        self.failures, text = round_report(
            run_store, round_, world_size, local, node, c.name, c.nproc_per_node, self._trace_dir
        )
        text = "\n".join(filter(None, [text, self._replacer.summary()]))
        print(text, file=sys.stderr, flush=True)
        for failure in self.failures.values():
            if not failure.files_kept:  # its logs go with the temporary directory
                failure.capture_logs()

    # -- events -------------------------------------------------------------------------------

    def _record_agent(
        self,
        state: str,
        raw_error: str | None = None,
        duration_ms: float | None = None,
        info: RendezvousInfo | None = None,
    ) -> None:
        self._events.agent(state, info or self._last_info, self._restarts, raw_error, duration_ms)

    def _record_workers(
        self, info: RendezvousInfo, state: str, failures: dict[int, ProcessFailure]
    ) -> None:
        pids = self._workers.pids() if self._workers is not None else {}
        self._events.workers(info, self._restarts, state, failures, self.ranks, pids)

    # -- one round ----------------------------------------------------------------------------

    def _advertised_host(self) -> str:
        """The IP (or --local_addr) the other nodes reach the workers' store at."""
        c = self.config
        endpoint = endpoint_address(c.rdzv_backend, c.rdzv_endpoint)
        return advertised_address(c.local_addr, c.max_nodes, endpoint)

    def _store_description(self) -> str:
        c = self.config
        if c.rdzv_backend == "static":
            where = format_address(c.master_addr or "127.0.0.1", c.master_port)
            return f"the static rendezvous store at {where}"
        return f"the {c.rdzv_backend} rendezvous store at {c.rdzv_endpoint}"

    def _master(self, info: RendezvousInfo) -> tuple[str, int]:
        """The address of the store the workers use, hosted here when no backend offers one."""
        if info.bootstrap_address is not None:
            return info.bootstrap_address
        if info.rank == 0:
            host = self._advertised_host()
            self._worker_store = TCPStore(
                resolve_ipv4(host),
                0,
                is_master=True,
                wait_for_workers=False,
                auth_key=self._auth_key,
            )
            port = self._worker_store.port  # type: ignore[attr-defined]
            info.store.set("worker_store", f"{port} {host}")
            return host, port
        port_text, _, host = info.store.get("worker_store").decode().partition(" ")
        return host, int(port_text)

    def _start_workers(self, info: RendezvousInfo, restarts: int) -> None:
        c = self.config
        check_homogeneous(info, c.nproc_per_node, c.run_id)
        host, port = self._master(info)
        attempt_dir = None
        if c.logs_specs is not None:
            attempt_dir = c.logs_specs.attempt_dir(c.run_id, self._attempt)
            if attempt_dir is not None:
                # absolute: the report names its files, and a worker may change directory
                attempt_dir = os.path.abspath(attempt_dir)
                self._log_root = os.path.dirname(attempt_dir)
        if attempt_dir is None:
            attempt_dir = os.path.join(self._log_root, f"attempt_{self._attempt}")
        # files in the agent's temporary directory are removed when it exits
        self._logs_kept = not inside(attempt_dir, self._tmp)
        base = dict(os.environ)
        self._trace_dir = env_var("DISTCOMM_TRACE_DIR", base) or trace_dir(
            self._log_root if self._logs_kept else "", c.run_id, self._attempt
        )
        base["DISTCOMM_TRACE_DIR"] = self._trace_dir
        if self._auth_key is not None:
            base["DISTCOMM_AUTH_KEY"] = self._auth_key.decode()
        self._attempt += 1
        self.ranks = {}
        commands, envs, prefixes, self.ranks = worker_specs(
            c, info, restarts, base, (host, port), self._timer.file_path if self._timer else None
        )
        with self._expired_lock:
            self._expired.clear()
        self._workers = WorkerProcesses(
            commands,
            envs,
            log_dir=attempt_dir,
            redirects=c.redirects,
            tee=c.tee,
            console_ranks=c.console_ranks,
            prefixes=prefixes,
            duplicate_filters={
                "stdout": list(c.duplicate_stdout_filters),
                "stderr": list(c.duplicate_stderr_filters),
            },
            affinity=self._affinity,
        )
        self._workers.start()
        self._record_workers(info, "START", {})

    def _monitor(self, watch: RoundWatch) -> RunResult:
        """Watch the workers every monitor_interval; never waits for the store. In replace
        mode a failed worker may be replaced here, the others running on (`replace.py`)."""
        assert self._workers is not None and self._last_info is not None
        info, workers = self._last_info, self._workers
        while True:
            time.sleep(self.config.monitor_interval)
            codes = self._replacer.step(workers, info, self._restarts, self._observe_failures)
            result = next_step(codes, watch.latest())
            if result is not None:
                return result
            watch.check_stall()

    def _failures(self, info: RendezvousInfo) -> dict[int, ProcessFailure]:
        """The failed workers, given a moment for the root cause (`wait_for_root_cause`)."""
        assert self._workers is not None
        return wait_for_root_cause(
            self._workers, lambda: self._observe_failures(info), self.config.monitor_interval
        )

    def _observe_failures(self, info: RendezvousInfo) -> dict[int, ProcessFailure]:
        assert self._workers is not None
        with self._expired_lock:
            expired = dict(self._expired)
        return observe_failures(self._workers, info, self.config, expired, self._logs_kept)

    def _on_timer_expired(self, pid: int, scope: str, expiration_time: float) -> None:
        with self._expired_lock:
            self._expired[pid] = scope
        log.warning(
            "distcomm-run: worker pid %d overstayed expiration timer scope %r: killed", pid, scope
        )

    # -- teardown -----------------------------------------------------------------------------

    def _stop_workers(self, sig: int = signal.SIGTERM) -> None:
        workers, self._workers = self._workers, None
        if workers is not None:
            grace = self.config.shutdown_timeout
            try:
                workers.stop(grace, sig)
            finally:
                workers.close(grace=grace)  # the output pumps and files
        store, self._worker_store = self._worker_store, None
        if store is not None:
            store.close()

    def _close_rendezvous(self) -> None:
        if self._handler is not None:
            with contextlib.suppress(DistError, OSError):
                self._handler.set_closed()

    def _shutdown(self) -> None:
        handler, self._handler = self._handler, None
        if handler is not None:
            with contextlib.suppress(DistError, OSError):
                handler.shutdown()
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


def _membership_key(round_: int) -> str:
    """The run-store key set when a node ends round `round_` for a membership change."""
    return f"membership_change/{round_}"


def launch(config: AgentConfig) -> int:
    """Run `config` on this node with an elastic agent; the exit status for the launcher."""
    setup_logging()
    return ElasticAgent(config).run()


def setup_logging() -> None:
    """Send the agent's log lines to stderr (INFO with DISTCOMM_LAUNCH_VERBOSE=1), once,
    where nothing else would show them: a program that configured logging (a handler on
    the root logger, as `logging.basicConfig` or pytest adds), and then calls
    `elastic_launch`, keeps its configuration for them."""
    if not log.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO if env_var("DISTCOMM_LAUNCH_VERBOSE") else logging.WARNING)
        log.propagate = False
