"""The elastic agent: rendezvous, start the local workers, monitor, restart, scale.

One agent runs per node. Each round of the rendezvous gives the node its group rank and
the number of nodes; the agent assigns the workers' ranks (every node runs the same
number of workers), starts them, and watches them every `monitor_interval`:

- all workers exited 0: wait for the other nodes to finish (exit barrier), close the
  rendezvous, exit 0;
- a worker failed (non-zero exit, signal, or killed by an expiration timer): stop the
  local workers and count one restart for the round in the run's store (the count is the
  run's, not the node's: every node that sees the failure of round R counts it once
  together). Within `max_restarts` every node joins the next round; past it the
  rendezvous is closed and every node prints its failures and exits 1;
- another node waits to join (scale-up) or a new round has begun without this node: stop
  the workers and join the next round, which does not count as a restart;
- the rendezvous was closed by another node: stop and exit with the run's outcome.

SIGTERM, SIGINT, SIGHUP and SIGQUIT stop every worker's process tree (SIGTERM, then
SIGKILL after `shutdown_timeout`), close the rendezvous and exit 128 + the signal number.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import secrets
import shutil
import signal
import socket
import string
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from types import FrameType

import psutil

from ..errors import DistError
from ..parallel import physical_cores
from ..store import Store, TCPStore
from ..store.base import publish
from .errors import ChildFailedError, ProcessFailure
from .rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    get_rendezvous_handler,
)
from .timer import FileTimerServer
from .workers import Std, WorkerProcesses

__all__ = ["LaunchConfig", "RunResult", "launch"]

log = logging.getLogger("distcomm.launch")

#: seconds an agent whose workers succeeded waits for the other nodes' workers (torch: 300)
EXIT_BARRIER_TIMEOUT = 300.0
#: seconds the nodes of a finished run wait for each other to stop using the stores
DEPARTURE_TIMEOUT = 10.0
#: seconds between checks of the rendezvous while workers run
RDZV_CHECK_INTERVAL = 0.5
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
DEFAULT_PREFIX_TEMPLATE = "[${rank}]:"


@dataclass
class LaunchConfig:
    """What distcomm-run's flags ask for (see `run.py` for each flag's meaning)."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    command: list[str]
    name: str = "worker"
    run_id: str = "none"
    role: str = "default"
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_configs: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_dir: str | None = None
    redirects: dict[int, Std] = field(default_factory=dict)
    tee: dict[int, Std] = field(default_factory=dict)
    console_ranks: set[int] | None = None
    log_line_prefix_template: str | None = None
    local_addr: str | None = None
    node_rank: int = -1
    master_addr: str | None = "127.0.0.1"
    master_port: int = 0
    shutdown_timeout: float = 30.0
    exit_barrier_timeout: float = EXIT_BARRIER_TIMEOUT


class RunResult(enum.Enum):
    """How one round of workers ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    MEMBERSHIP_CHANGED = "membership changed"
    CLOSED = "closed"


class _Signal(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: the agent's temporary directory (timer pipe, logs without --log_dir): PREFIX<pid>-xxxx
TEMP_PREFIX = "distcomm-run-"


def _remove_stale_temp_dirs() -> None:
    """Remove the temporary directories of agents that died without cleaning up (SIGKILL)."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        pid_text, sep, _ = name[len(TEMP_PREFIX):].partition("-")
        if not (name.startswith(TEMP_PREFIX) and sep and pid_text.isdigit()):
            continue
        path = os.path.join(root, name)
        try:
            if os.stat(path).st_uid != os.getuid() or psutil.pid_exists(int(pid_text)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)


def _resolve_ipv4(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return host


class ElasticAgent:
    """Runs one node's part of a launch; `run()` returns the exit status."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
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
    # -- the run ------------------------------------------------------------------------------

    def run(self) -> int:
        """Run the job on this node until it succeeds, fails for good or is signalled."""
        config = self.config
        previous = {sig: signal.signal(sig, self._on_signal) for sig in HANDLED_SIGNALS}
        _remove_stale_temp_dirs()
        self._tmp = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-")
        try:
            if config.log_dir:
                os.makedirs(config.log_dir, exist_ok=True)
                self._log_root = tempfile.mkdtemp(prefix=f"{config.run_id}_", dir=config.log_dir)
            else:
                self._log_root = os.path.join(self._tmp, "logs")
            if config.max_nodes == 1 and not os.environ.get("DISTCOMM_AUTH_KEY"):
                # one node: the agent's store and the workers share a fresh secret
                os.environ["DISTCOMM_AUTH_KEY"] = secrets.token_hex(16)
            self._timer = FileTimerServer(os.path.join(self._tmp, "timer.fifo"), config.run_id,
                                          max_interval=1.0,
                                          on_expired=self._on_timer_expired)
            self._timer.start()
            self._handler = get_rendezvous_handler(self._rdzv_parameters())
            return self._invoke_run()
        except _Signal as sig:
            log.warning("distcomm-run: got %s: stopping the workers", sig)
            self._stop_workers()
            self._close_rendezvous()
            return 128 + sig.signum
        except (RendezvousError, DistError, ValueError, OSError) as exc:
            print(f"distcomm-run: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            for sig in HANDLED_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            try:
                self._stop_workers()
                self._shutdown()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        for sig in HANDLED_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)  # one signal stops the run; cleanup goes on
        raise _Signal(signum)

    def _rdzv_parameters(self) -> RendezvousParameters:
        c = self.config
        return RendezvousParameters(
            backend=c.rdzv_backend, endpoint=c.rdzv_endpoint, run_id=c.run_id,
            min_nodes=c.min_nodes, max_nodes=c.max_nodes, local_addr=c.local_addr,
            config=dict(c.rdzv_configs), node_rank=c.node_rank, master_addr=c.master_addr,
            master_port=c.master_port)

    def _invoke_run(self) -> int:
        assert self._handler is not None
        handler, c = self._handler, self.config
        while True:
            try:
                info = handler.next_rendezvous()
            except RendezvousClosedError:
                return self._closed_outcome()
            self._last_info = info
            restarts = int(info.run_store.add("restart_count", 0))
            log.info("distcomm-run: round %d: node %d of %d, %d worker(s) each, restart %d of "
                     "%d", info.round, info.rank, info.world_size, c.nproc_per_node, restarts,
                     c.max_restarts)
            self._start_workers(info, restarts)
            result = self._monitor()
            if result is RunResult.SUCCEEDED:
                self._exit_barrier(info)
                self._stop_workers()
                publish(info.run_store, "outcome", "succeeded")  # read by check() once closed
                self._close_rendezvous()
                self._depart(info)
                return 0
            if result is RunResult.CLOSED:
                self._stop_workers()
                return self._closed_outcome()
            if result is RunResult.MEMBERSHIP_CHANGED:
                log.warning("distcomm-run: the membership changed (%d node(s) waiting to join "
                            "or a new round began): restarting the workers in a new round",
                            handler.num_nodes_waiting())
                self._stop_workers()
                continue
            failures = self._failures(info)
            self._stop_workers()
            count = self._count_restart(info)
            error = ChildFailedError(c.name, failures)
            if count > c.max_restarts:
                publish(info.run_store, "outcome", "failed")  # read by check() once closed
                self._close_rendezvous()
                print(error.format_msg(), file=sys.stderr, flush=True)
                self._depart(info)
                return 1
            first = error.get_first_failure()[1]
            log.warning("distcomm-run: worker group failed (rank %d: %s); restart %d of %d",
                        first.rank, first.message, count, c.max_restarts)

    def _closed_outcome(self) -> int:
        info = self._last_info
        outcome = b""
        if info is not None:
            with contextlib.suppress(DistError, OSError):
                if info.run_store.check(["outcome"]):
                    outcome = info.run_store.get("outcome")
            self._depart(info)
        if outcome == b"succeeded":
            return 0
        print(f"distcomm-run: the rendezvous of run {self.config.run_id!r} was closed "
              f"{'after the run failed on another node' if outcome else 'by another node'}",
              file=sys.stderr, flush=True)
        return 1

    # -- one round ----------------------------------------------------------------------------

    def _advertised_host(self) -> str:
        c = self.config
        if c.local_addr:
            return c.local_addr
        return "127.0.0.1" if c.max_nodes == 1 else socket.getfqdn()

    def _master(self, info: RendezvousInfo) -> tuple[str, int]:
        """The address of the store the workers use, hosted here when no backend offers one."""
        if info.bootstrap_address is not None:
            return info.bootstrap_address
        if info.rank == 0:
            host = self._advertised_host()
            self._worker_store = TCPStore(_resolve_ipv4(host), 0, is_master=True,
                                          wait_for_workers=False)
            port = self._worker_store.port  # type: ignore[attr-defined]
            info.store.set("worker_store", f"{port} {host}")
            return host, port
        port_text, _, host = info.store.get("worker_store").decode().partition(" ")
        return host, int(port_text)

    def _check_homogeneous(self, info: RendezvousInfo) -> None:
        nproc = self.config.nproc_per_node
        info.store.set(f"nproc/{info.rank}", str(nproc))
        values = info.store.multi_get([f"nproc/{rank}" for rank in range(info.world_size)])
        counts = {rank: int(value) for rank, value in enumerate(values)}
        if len(set(counts.values())) > 1:
            raise RendezvousError(
                f"the nodes of run {self.config.run_id!r} start different numbers of workers "
                f"(node rank: --nproc_per_node): "
                f"{', '.join(f'{r}: {n}' for r, n in sorted(counts.items()))}; every node must "
                f"pass the same --nproc_per_node")

    def _start_workers(self, info: RendezvousInfo, restarts: int) -> None:
        c = self.config
        self._check_homogeneous(info)
        host, port = self._master(info)
        nproc, world = c.nproc_per_node, c.nproc_per_node * info.world_size
        attempt_dir = os.path.join(self._log_root, f"attempt_{self._attempt}")
        self._attempt += 1
        base = dict(os.environ)
        base.setdefault("OMP_NUM_THREADS", str(max(1, physical_cores() // nproc)))
        commands, envs, prefixes = {}, {}, {}
        for local_rank in range(nproc):
            rank = info.rank * nproc + local_rank
            env = dict(base)  # WorkerProcesses adds the error-file variables
            env.update({
                "LOCAL_RANK": str(local_rank), "RANK": str(rank), "GROUP_RANK": str(info.rank),
                "ROLE_RANK": str(rank), "ROLE_NAME": c.role, "LOCAL_WORLD_SIZE": str(nproc),
                "WORLD_SIZE": str(world), "ROLE_WORLD_SIZE": str(world),
                "MASTER_ADDR": host, "MASTER_PORT": str(port),
                "DISTCOMM_USE_AGENT_STORE": "1",
                "DISTCOMM_STORE_PREFIX": f"/worker/round_{info.round}",
                "DISTCOMM_TIMER_FILE": self._timer.file_path if self._timer else "",
            })
            for name, value in (("RESTART_COUNT", str(restarts)),
                                ("MAX_RESTARTS", str(c.max_restarts)), ("RUN_ID", c.run_id)):
                env[f"DISTCOMM_{name}"] = env[f"TORCHELASTIC_{name}"] = value
            commands[local_rank] = list(c.command)
            envs[local_rank] = env
            template = c.log_line_prefix_template
            if template is None and c.tee.get(local_rank, Std.NONE) != Std.NONE:
                template = DEFAULT_PREFIX_TEMPLATE
            prefixes[local_rank] = string.Template(template or "").safe_substitute(
                rank=rank, local_rank=local_rank, role_name=c.role)
        with self._expired_lock:
            self._expired.clear()
        self._workers = WorkerProcesses(
            commands, envs, log_dir=attempt_dir, redirects=c.redirects, tee=c.tee,
            console_ranks=c.console_ranks, prefixes=prefixes)
        self._workers.start()

    def _monitor(self) -> RunResult:
        assert self._workers is not None and self._handler is not None
        c, handler = self.config, self._handler
        next_check = time.monotonic() + RDZV_CHECK_INTERVAL
        while True:
            time.sleep(c.monitor_interval)
            codes = self._workers.poll()
            if any(code not in (None, 0) for code in codes.values()):
                return RunResult.FAILED
            if all(code == 0 for code in codes.values()):
                return RunResult.SUCCEEDED
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + RDZV_CHECK_INTERVAL
                if handler.is_closed():
                    return RunResult.CLOSED
                if handler.num_nodes_waiting() > 0:
                    return RunResult.MEMBERSHIP_CHANGED

    def _failures(self, info: RendezvousInfo) -> dict[int, ProcessFailure]:
        assert self._workers is not None
        c, host = self.config, socket.gethostname()
        codes, pids = self._workers.poll(), self._workers.pids()
        with self._expired_lock:
            expired = dict(self._expired)
        failures = {}
        for local_rank, code in sorted(codes.items()):
            if code in (None, 0):
                continue
            rank = info.rank * c.nproc_per_node + local_rank
            pid = pids[local_rank]
            reason = ""
            if pid in expired:
                reason = f"expiration timer scope {expired[pid]!r} expired; the worker was killed"
            failures[rank] = ProcessFailure(
                local_rank=local_rank, rank=rank, pid=pid, exitcode=code,
                error_file=self._workers.error_file(local_rank), host=host, role=c.role,
                log_files=self._workers.log_files(local_rank), reason=reason)
        return failures

    def _count_restart(self, info: RendezvousInfo) -> int:
        """Count round `info.round`'s failure once for the run; the run's restart count."""
        store, key = info.run_store, f"restart_count_after_round_{info.round}"
        if int(store.add(f"failed_round_{info.round}", 1)) == 1:
            count = int(store.add("restart_count", 1))
            store.set(key, str(count))
            return count
        return int(store.get(key))

    def _exit_barrier(self, info: RendezvousInfo) -> None:
        """Wait until every node's workers are done, so no node's store leaves early."""
        store = info.store
        if int(store.add("finished", 1)) == info.world_size:
            store.set("all_finished", "1")
            return
        deadline = time.monotonic() + self.config.exit_barrier_timeout
        assert self._handler is not None
        while time.monotonic() < deadline:
            try:
                store.wait(["all_finished"], timeout=1.0)
                return
            except DistError as exc:
                if not isinstance(exc, TimeoutError):
                    raise
            if self._handler.is_closed():
                return
        log.warning("distcomm-run: not every node finished within %.0f s of this one; "
                    "leaving", self.config.exit_barrier_timeout)

    def _depart(self, info: RendezvousInfo) -> None:
        """Leave together: a node that serves the store must not go while others use it.

        Every node of the last round counts itself out, then waits (up to
        DEPARTURE_TIMEOUT: a node that died never counts) until all have.
        """
        with contextlib.suppress(DistError, OSError):
            store = info.store
            if int(store.add("departed", 1)) >= info.world_size:
                store.set("all_departed", "1")
                return
            with contextlib.suppress(DistError):
                store.wait(["all_departed"], timeout=DEPARTURE_TIMEOUT)

    def _on_timer_expired(self, pid: int, scope: str, expiration_time: float) -> None:
        with self._expired_lock:
            self._expired[pid] = scope
        log.warning("distcomm-run: worker pid %d overstayed expiration timer scope %r: killed",
                    pid, scope)

    # -- teardown -----------------------------------------------------------------------------

    def _stop_workers(self) -> None:
        workers, self._workers = self._workers, None
        if workers is not None:
            workers.close(grace=self.config.shutdown_timeout)  # stops what still runs
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


def launch(config: LaunchConfig) -> int:
    """Run `config` on this node with an elastic agent; the exit status for the launcher."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO if os.environ.get("DISTCOMM_LAUNCH_VERBOSE") else
                     logging.WARNING)
        log.propagate = False
    return ElasticAgent(config).run()
