"""distcomm-run, the elastic launcher: CLI (`run`), agent, rendezvous, workers, errors, timer.

`distcomm.launch.errors.record` and `distcomm.launch.timer` are the parts a worker uses;
`distcomm.launch.api` is torch's Python launch API (`LaunchConfig`, `elastic_launch`,
`launch_agent`, as `torch.distributed.launcher.api`). Nothing is imported here, so that a
worker importing `errors` or `timer` does not load the agent.
"""

__all__: list[str] = []  # the public parts are the submodules named above
