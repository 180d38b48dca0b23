"""distcomm-run, the elastic launcher: CLI (`run`), agent, rendezvous, workers, errors, timer.

`distcomm.launch.errors.record` and `distcomm.launch.timer` are the parts a worker uses;
`LaunchConfig`, `elastic_launch` and `launch_agent` are torch's Python launch API.
"""

from .api import LaunchConfig, elastic_launch, launch_agent

__all__ = ["LaunchConfig", "elastic_launch", "launch_agent"]
