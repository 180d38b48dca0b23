"""The elastic agent, one per node: rendezvous, start the workers, monitor, restart, scale.

The agent's family, one job per module:

- `elastic`: `ElasticAgent`, the loop over rounds (rendezvous, start, monitor, restart);
- `config`: `AgentConfig`, what the agent runs, and the signals that stop it;
- `worker_env`: each worker's command, environment and console prefix for a round;
- `watch`: the other nodes seen from a thread of its own, and what the agent does next;
- `round_sync`: what the agents of a round agree on through its store (exit barrier, ...);
- `failures`: what the agent reads about its failed workers;
- `replace`: --on-failure=replace, a failed worker replaced while the others run on;
- `report`: the agent's events, and the failure report of a round across the nodes;
- `address`: the IP the agent advertises to the other nodes;
- `tempdir`: the agent's temporary directory, and those of agents that died without
  removing theirs.
"""

from .config import DEFAULT_SIGNALS_TO_HANDLE, FORWARDED_SIGNALS, AgentConfig, SignalException
from .elastic import ElasticAgent, launch, setup_logging
from .watch import RunResult

__all__ = [
    "DEFAULT_SIGNALS_TO_HANDLE",
    "FORWARDED_SIGNALS",
    "AgentConfig",
    "ElasticAgent",
    "RunResult",
    "SignalException",
    "launch",
    "setup_logging",
]
