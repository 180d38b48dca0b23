"""How the launcher's and the rendezvous's errors are worded: torch's sentence verbatim,
then what held the value (the parameter a Python caller passed, or the flag when the value
came from distcomm-run's command line), then what to do.

``tests/test_torch_messages.py`` holds each such message against torch 2.13's.
"""

from __future__ import annotations

__all__ = ["RDZV_FLAGS", "given", "torch_message"]

#: distcomm-run's flag for each parameter of `RendezvousParameters`; an option (any other
#: name) comes from ``--rdzv_conf``
RDZV_FLAGS = {
    "backend": "--rdzv_backend",
    "endpoint": "--rdzv_endpoint",
    "run_id": "--rdzv_id",
    "min_nodes": "--nnodes",
    "max_nodes": "--nnodes",
    "local_addr": "--local_addr",
    "node_rank": "--node_rank",
    "master_addr": "--master_addr",
    "master_port": "--master_port",
}


def given(name: str, value: object, from_flags: bool = False, *, flag: str | None = None) -> str:
    """What held `value`, for a message: ``name=value`` (the value's repr) for a caller of
    the Python API; with `from_flags`, the flag that set it: `flag`, else the rendezvous
    flag of parameter `name` (``--nnodes='0:2'``), else ``--rdzv_conf name='value'``."""
    if from_flags:
        name = flag or RDZV_FLAGS.get(name) or f"--rdzv_conf {name}"
    return f"{name}={value!r}"


def torch_message(sentence: str, where: str, remedy: str) -> str:
    """torch's `sentence` verbatim, then `where` the value came from (see `given`) and
    `remedy`: "The read timeout must be a positive integer. read_timeout=0: give a whole
    number of seconds > 0."."""
    stop = "" if sentence.endswith((".", "?")) else "."
    return f"{sentence}{stop} {where}: {remedy}."
