"""What the elastic agent runs: `AgentConfig`, its defaults, and the signal that stops it.

`distcomm.launch.api.to_agent_config` is the one place that builds an `AgentConfig`, from a
torch-style `LaunchConfig` (which distcomm-run's flags become first).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from ..logs_specs import LogsSpecs
from ..numa import NumaOptions
from ..output import Std
from ..rendezvous.api import RendezvousParameters

__all__ = [
    "DEFAULT_SIGNALS_TO_HANDLE",
    "EXIT_BARRIER_TIMEOUT",
    "FORWARDED_SIGNALS",
    "AgentConfig",
    "SignalException",
]

#: seconds an agent whose workers succeeded waits for the other nodes' workers (torch: 300)
EXIT_BARRIER_TIMEOUT = 300.0
#: signals that stop the run (torchrun's --signals_to_handle default)
DEFAULT_SIGNALS_TO_HANDLE = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: signals passed on to the workers without stopping the run, unless listed to stop it
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


@dataclass
class AgentConfig:
    """What the agent runs: distcomm-run's flags (see `run.py` for each flag's meaning).

    `logs_specs`, when given, names each attempt's log directory (else `log_dir` does, in
    torchrun's layout). `numa_binding` is --numa-binding. Workers started with
    `virtual_local_rank` all see LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES set to their GPU.
    `on_failure` and `max_replacements` are --on-failure and --max-replacements.
    """

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
    signals_to_handle: tuple[int, ...] = DEFAULT_SIGNALS_TO_HANDLE
    #: where in `command` to insert ``--local-rank=<local rank>`` for each worker (the
    #: legacy ``python -m distcomm.launch`` without --use-env); None: not passed
    local_rank_argv_index: int | None = None
    logs_specs: LogsSpecs | None = None
    event_log_handler: str = "null"
    numa_binding: NumaOptions | None = None
    duplicate_stdout_filters: list[str] = field(default_factory=list)
    duplicate_stderr_filters: list[str] = field(default_factory=list)
    virtual_local_rank: bool = False
    #: --on-failure: "restart" (every worker of the node) or "replace" (the failed one
    #: only, up to `max_replacements` over the run; see `replace.py`)
    on_failure: str = "restart"
    max_replacements: int = 3
    #: the values came from distcomm-run's command line (`run.config_from_args`): errors
    #: raised later (the rendezvous's) name the flags rather than the parameters
    from_flags: bool = False

    def rdzv_parameters(self, auth_key: bytes | None) -> RendezvousParameters:
        """The rendezvous's parameters, with `auth_key` for its stores."""
        return RendezvousParameters(
            backend=self.rdzv_backend,
            endpoint=self.rdzv_endpoint,
            run_id=self.run_id,
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            local_addr=self.local_addr,
            config=dict(self.rdzv_configs),
            node_rank=self.node_rank,
            master_addr=self.master_addr,
            master_port=self.master_port,
            auth_key=auth_key,
            from_flags=self.from_flags,
        )


class SignalException(Exception):
    """The agent got one of `signals_to_handle` (torch's ``SignalException``).

    Attributes:
        sigval: the signal.
    """

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval
