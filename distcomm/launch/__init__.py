"""distcomm-run, the elastic launcher: CLI (`run`), agent, rendezvous, workers, errors, timer.

`distcomm.launch.errors.record` and `distcomm.launch.timer` are the parts a worker uses.
"""
