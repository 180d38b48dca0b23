"""torch.distributed.run's Python API; `python -m distcomm.run` is the `distcomm-run` command.

`config_from_args(args)` returns torch's ``(LaunchConfig, entrypoint, args)`` for
``distcomm.launch.api.elastic_launch``. A program that launches through these functions
sees failures as under torch:
`main(args)` and `run(args)` return None once every worker succeeded and raise otherwise:

- `ChildFailedError` (``distcomm.launch.errors``): workers failed and no restart was left;
  its report names every failed rank;
- `ValueError`: a flag's value is invalid or contradicts another (``--no-python`` with
  ``--module``, ``--nproc-per-node=unknown``, an unknown ``--logs-specs``...), the message
  naming it; a malformed ``--nnodes`` raises `NnodesFormatError`, also a `RuntimeError`
  as in torch;
- `SystemExit(2)`: argparse's own errors (an unknown flag, ``--max-restarts=x``), after
  printing the usage, as in torch;
- `SignalException`: a signal of ``--signals-to-handle`` stopped the run;
- whatever the agent raised (a rendezvous that failed: `DistError`), unchanged.

The command (``python -m distcomm.run``, `distcomm-run`) is ``distcomm.launch.run.main``:
it prints the failure report and exits with a status instead of a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .launch.errors import record
from .launch.flag_values import NnodesFormatError
from .launch.run import (
    determine_local_world_size,
    get_args_parser,
    get_rdzv_endpoint,
    get_use_env,
    parse_args,
    parse_min_max_nnodes,
    run,
    run_script_path,
)
from .launch.run import (
    launch_config_from_args as config_from_args,
)
from .launch.run import main as _command

__all__ = [
    "NnodesFormatError",
    "config_from_args",
    "determine_local_world_size",
    "get_args_parser",
    "get_rdzv_endpoint",
    "get_use_env",
    "main",
    "parse_args",
    "parse_min_max_nnodes",
    "run",
    "run_script_path",
]


@record
def main(args: Sequence[str] | None = None) -> None:
    """Parse `args` (default sys.argv[1:]) and run the job on this node, as torch's ``main``.

    Decorated with `record`: under an outer launcher the first failure is written to this
    process's error file.

    Raises:
        ChildFailedError: the run failed. ValueError: a bad flag value (named).
        SystemExit: argparse's status 2 for an unknown flag or a mistyped value.
        SignalException: a handled signal stopped the run.
    """
    run(parse_args(args))


if __name__ == "__main__":
    sys.exit(_command())
