"""The Python launch API, as torch's ``torch.distributed.launcher.api``.

`elastic_launch(config, entrypoint)(*args)` runs this node's part of a job with an elastic
agent and returns ``{global rank: return value}`` for the node's workers::

    from distcomm.launch.api import LaunchConfig, elastic_launch

    def train(scale):                      # importable: a module, or the main script
        import os
        return int(os.environ["RANK"]) * scale

    if __name__ == "__main__":
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2,
                              rdzv_backend="c10d", rdzv_endpoint="localhost:0")
        print(elastic_launch(config, train)(10))   # {0: 0, 1: 10}

The entrypoint is a function, run in a fresh Python process per worker (it and its
arguments are pickled, the function by reference: define it at the top level of a module
or of the main script, as with torch's spawn start method), or a command: a program's
path, with `args` as its arguments (``{global rank: None}`` on success). Failures raise
`ChildFailedError`, whose report names every failed rank.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.spawn
import os
import pickle
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import get as env_var
from ..errors import DistError
from .agent import AgentConfig, ElasticAgent, SignalException, setup_logging
from .errors import ChildFailedError
from .events import get_event_handler
from .flag_values import START_METHODS, parse_signals
from .logs_specs import DefaultLogsSpecs, LogsSpecs
from .numa import NumaOptions
from .rendezvous.api import check_node_counts
from .rendezvous.backends import parse_endpoint
from .rendezvous.settings import effective_backend
from .wording import torch_message

__all__ = ["LaunchConfig", "elastic_launch", "launch_agent", "run_agent"]

log = logging.getLogger("distcomm.launch")

#: torch's join timeout of a LaunchConfig without rdzv_timeout (its rdzv_configs "timeout")
DEFAULT_RDZV_TIMEOUT = 900


@dataclass
class LaunchConfig:
    """torch's launch configuration: the same fields, names and defaults.

    Attributes:
        min_nodes, max_nodes: the range of nodes of the run.
        nproc_per_node: workers on this node.
        logs_specs: where log files go (`DefaultLogsSpecs()` when None); it also holds
            the redirects, tee and local ranks filter.
        run_id: the run's id (a random one, with a warning, when empty).
        role: the workers' ROLE_NAME.
        rdzv_endpoint, rdzv_backend: as --rdzv-endpoint/--rdzv-backend (torch's default
            backend, etcd, needs an etcd server; c10d with "localhost:0" runs one node).
            For static the endpoint is node 0's "host:port" (port 0: a free one, one node).
        rdzv_configs: --rdzv-conf keys (``rank`` is the static node rank); a ``timeout``
            (900 s unless `rdzv_timeout` is given) is added, as torch does.
        rdzv_timeout: torch's legacy rendezvous timeout (-1: unset).
        max_restarts, monitor_interval: as the flags (torch's default: 3 restarts).
        start_method: spawn, fork or forkserver: checked, then unused (torch's field, kept for
            parity; a worker is always a new interpreter, see --start-method).
        log_line_prefix_template: the console prefix of worker lines.
        metrics_cfg: torch's metrics configuration; accepted and unused (no metrics).
        local_addr: as --local-addr.
        event_log_handler: where the agent's events go (see `events.py`).
        numa_options: a `NumaOptions` (or torch's), a mode name, or None.
        signals_to_handle: comma-separated signals that stop the run.
        duplicate_stdout_filters, duplicate_stderr_filters: as the flags.
        virtual_local_rank: as --virtual-local-rank.
        shutdown_timeout: seconds workers get after SIGTERM (None:
            TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30).

    Raises:
        ValueError: a negative shutdown_timeout (others are checked at launch).
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    logs_specs: LogsSpecs | None = None
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "etcd"
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_line_prefix_template: str | None = None
    metrics_cfg: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    event_log_handler: str = "null"
    numa_options: NumaOptions | Any | None = None
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    shutdown_timeout: int | float | None = None

    def __post_init__(self) -> None:
        if self.rdzv_timeout != -1:
            self.rdzv_configs["timeout"] = self.rdzv_timeout
        elif "timeout" not in self.rdzv_configs:
            self.rdzv_configs["timeout"] = DEFAULT_RDZV_TIMEOUT
        if self.logs_specs is None:
            self.logs_specs = DefaultLogsSpecs()
        if self.shutdown_timeout is None:
            self.shutdown_timeout = env_var("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be non-negative, got {self.shutdown_timeout}")


class elastic_launch:
    """``elastic_launch(config, entrypoint)(*args)``: launch and return the node's results.

    Args:
        config: the launch configuration.
        entrypoint: a function, or a program (path or name on PATH).
    """

    def __init__(self, config: LaunchConfig, entrypoint: Callable[..., Any] | str | None) -> None:
        self._config = config
        self._entrypoint = entrypoint

    def __call__(self, *args: Any) -> dict[int, Any]:
        return launch_agent(self._config, self._entrypoint, list(args))


def _entrypoint_name(entrypoint: Callable[..., Any] | str | None, args: list[Any]) -> str:
    """torch's rule: a function's name; for the Python interpreter, the first argument not
    starting with "-" (the script); else the program."""
    if callable(entrypoint):
        return str(getattr(entrypoint, "__name__", repr(entrypoint)))
    if isinstance(entrypoint, str):
        if entrypoint == sys.executable:
            return next((str(a) for a in args if not str(a).startswith("-")), "")
        return entrypoint
    return ""


def _static_address(config: LaunchConfig) -> tuple[str, int]:
    """Node 0's (host, port) from rdzv_endpoint, with torch's launcher's sentences.

    Raises:
        ValueError: no endpoint, or one without a port.
    """
    endpoint = config.rdzv_endpoint.strip()
    if not endpoint:
        raise ValueError(
            torch_message(
                "Endpoint is missing in endpoint. Try to add --master-addr and --master-port",
                f"LaunchConfig(rdzv_endpoint={config.rdzv_endpoint!r})",
                "rdzv_backend='static' needs rdzv_endpoint='HOST:PORT' of node 0 (port 0 for "
                "a free port when max_nodes is 1)",
            )
        )
    host, port = parse_endpoint(endpoint, -1)
    if port == -1:
        raise ValueError(
            torch_message(
                f"port is missing in endpoint: {endpoint}. Try to specify --master-port",
                f"LaunchConfig(rdzv_endpoint={config.rdzv_endpoint!r})",
                "give node 0's 'HOST:PORT'",
            )
        )
    return host, port


def _numa(options: Any) -> NumaOptions | None:
    if options is None or isinstance(options, NumaOptions):
        return options
    if isinstance(options, str):
        return NumaOptions(options)
    mode = getattr(options, "affinity_mode", None)
    if mode is None:
        raise TypeError(f"numa_options must be a NumaOptions, a mode name or None, got {options!r}")
    return NumaOptions(mode, bool(getattr(options, "should_fall_back_if_binding_fails", False)))


def to_agent_config(config: LaunchConfig, command: list[str], name: str) -> AgentConfig:
    """The agent's configuration for `config`, running `command` in each worker.

    Raises:
        ValueError: a field's value is invalid (the message names the field).
        TypeError: logs_specs is not a distcomm LogsSpecs, or numa_options is of no
            known kind.
    """
    for field_name in ("min_nodes", "max_nodes", "nproc_per_node", "max_restarts"):
        value = getattr(config, field_name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"LaunchConfig.{field_name} must be an integer, got {value!r}")
    check_node_counts(config.min_nodes, config.max_nodes)  # torch's RendezvousParameters's
    if config.nproc_per_node < 1:
        raise ValueError(f"LaunchConfig.nproc_per_node must be >= 1, got {config.nproc_per_node}")
    if config.max_restarts < 0:
        raise ValueError(f"LaunchConfig.max_restarts must be >= 0, got {config.max_restarts}")
    if not float(config.monitor_interval) > 0:
        raise ValueError(
            f"LaunchConfig.monitor_interval must be > 0 seconds, got {config.monitor_interval}"
        )
    if config.start_method not in START_METHODS:
        raise ValueError(
            f"LaunchConfig.start_method={config.start_method!r} is not one of "
            f"{', '.join(START_METHODS)}"
        )
    specs = config.logs_specs if config.logs_specs is not None else DefaultLogsSpecs()
    if not isinstance(specs, LogsSpecs):
        raise TypeError(
            f"LaunchConfig.logs_specs must be a distcomm.launch.logs_specs.LogsSpecs, got "
            f"{type(specs).__name__}"
        )
    get_event_handler(config.event_log_handler)  # an unknown name fails here, named
    conf = {str(k): str(v) for k, v in config.rdzv_configs.items()}
    backend = effective_backend(config.rdzv_backend, conf)
    endpoint = config.rdzv_endpoint.strip()
    master_addr, master_port, node_rank = "127.0.0.1", 0, -1
    if backend == "static":
        master_addr, master_port = _static_address(config)
        rank = conf.pop("rank", None)
        if rank is not None:
            if not rank.strip().isdigit():
                raise ValueError(f"rdzv_configs['rank']={rank!r} must be a node rank >= 0")
            node_rank = int(rank)
    elif not endpoint and backend in ("c10d", "file", "etcd"):
        if backend != "c10d" or config.max_nodes > 1:
            raise ValueError(
                f"rdzv_backend={backend!r} needs rdzv_endpoint "
                f"({'a shared file path' if backend == 'file' else 'HOST:PORT'})"
            )
        endpoint = "localhost:0"
    nproc = config.nproc_per_node
    return AgentConfig(
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        nproc_per_node=nproc,
        command=command,
        name=name,
        run_id=config.run_id,
        role=config.role,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=conf,
        max_restarts=config.max_restarts,
        monitor_interval=float(config.monitor_interval),
        log_dir=specs.root_log_dir or None,
        redirects=specs.redirects(nproc),
        tee=specs.tee(nproc),
        console_ranks=specs.local_ranks_filter,
        log_line_prefix_template=config.log_line_prefix_template,
        local_addr=config.local_addr,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        shutdown_timeout=float(config.shutdown_timeout or 0),
        signals_to_handle=parse_signals(config.signals_to_handle),
        logs_specs=specs,
        event_log_handler=config.event_log_handler,
        numa_binding=_numa(config.numa_options),
        duplicate_stdout_filters=list(config.duplicate_stdout_filters or []),
        duplicate_stderr_filters=list(config.duplicate_stderr_filters or []),
        virtual_local_rank=bool(config.virtual_local_rank),
    )


def run_agent(config: AgentConfig) -> ElasticAgent:
    """Run an elastic agent for `config` on this node; the agent once the run succeeded.

    Raises:
        ChildFailedError: the run failed; the report has every node's failed ranks.
        SignalException: one of the signals to handle stopped the run.
        DistError, ValueError, OSError: the rendezvous or the setup failed (as raised).
    """
    setup_logging()
    agent = ElasticAgent(config)
    code = agent.run()
    if code == 0:
        return agent
    if agent.signal is not None:
        sig = agent.signal
        raise SignalException(f"Process {os.getpid()} got signal: {sig}", sig)  # type: ignore[arg-type]
    if agent.error is not None:
        raise agent.error
    if agent.failures:
        raise ChildFailedError(config.name, agent.failures)
    raise DistError(
        f"run {config.run_id!r} failed on another node, which recorded no worker failure "
        "(see that node's output)"
    )


def launch_agent(
    config: LaunchConfig, entrypoint: Callable[..., Any] | str | None, args: list[Any]
) -> dict[int, Any]:
    """Run `entrypoint(*args)` in this node's workers (torch's ``launch_agent``).

    Returns:
        {global rank: return value} for this node's workers (None for a command).

    Raises:
        ChildFailedError: a worker failed and no restart was left.
        SignalException: the agent was stopped by a signal.
        ValueError, TypeError: a bad configuration or entrypoint (named).
    """
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
        log.warning("config has no run_id, generated a random run_id: %s", config.run_id)
    name = _entrypoint_name(entrypoint, args)
    if isinstance(entrypoint, str):
        if not entrypoint:
            raise ValueError("elastic_launch: the entrypoint command is empty")
        agent = run_agent(to_agent_config(config, [entrypoint, *map(str, args)], name))
        return dict.fromkeys(sorted(agent.ranks.values()))
    if not callable(entrypoint):
        raise TypeError(
            f"elastic_launch: the entrypoint must be a function or a command string, got "
            f"{entrypoint!r}"
        )
    work = tempfile.mkdtemp(prefix="distcomm-launch-")
    try:
        payload, results = os.path.join(work, "payload.pkl"), os.path.join(work, "results")
        os.mkdir(results)
        try:
            data = pickle.dumps((entrypoint, list(args)))
        except Exception as exc:
            raise TypeError(
                f"elastic_launch: the entrypoint {name!r} or its arguments cannot be pickled "
                f"to the workers ({exc}); define the function at the top level of a module or "
                "of the main script"
            ) from exc
        with open(payload, "wb") as fp:
            pickle.dump(_preparation(), fp)
            fp.write(data)
        command = [sys.executable, "-u", "-m", "distcomm.launch._entrypoint", payload, results]
        agent = run_agent(to_agent_config(config, command, name))
        values: dict[int, Any] = {}
        for rank in sorted(agent.ranks.values()):
            with open(os.path.join(results, f"{rank}.pkl"), "rb") as fp:
                values[rank] = pickle.load(fp)
        return values
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _preparation() -> dict[str, Any]:
    """What a worker needs to find functions of this process's main module (spawn's data)."""
    with contextlib.suppress(Exception):
        data = multiprocessing.spawn.get_preparation_data("distcomm-worker")
        data.pop("authkey", None)  # not needed: the workers do not talk back over mp
        data.pop("start_method", None)
        return dict(data)
    return {}
