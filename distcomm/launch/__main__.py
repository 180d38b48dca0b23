"""`python -m distcomm.launch`: the legacy launcher (torch.distributed.launch) for old scripts.

Takes distcomm-run's flags plus ``--use-env``/``--use_env``. Without ``--use-env`` each
worker also gets ``--local-rank=<local rank>`` right after the script's name, as
``python -m torch.distributed.launch`` passes it; with it, the script reads LOCAL_RANK
from the environment (set either way), as under distcomm-run.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from .agent import launch
from .run import config_from_args, get_args_parser

__all__ = ["main"]

NOTE = (
    "distcomm.launch: legacy launcher, as torch.distributed.launch; the current one is "
    "distcomm-run (no --local-rank argument: scripts read LOCAL_RANK from the environment)"
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the legacy launcher with `argv` (default sys.argv[1:]); returns the exit status."""
    print(NOTE, file=sys.stderr, flush=True)
    try:
        parser = get_args_parser()
    except ValueError as exc:  # a DISTCOMM_<FLAG> or PET_<FLAG> variable holds a bad value
        print(f"distcomm.launch: error: {exc}", file=sys.stderr)
        return 2
    parser.prog = "python -m distcomm.launch"
    parser.add_argument(
        "--use-env",
        "--use_env",
        action="store_true",
        help="do not pass --local-rank=N to the script; it reads LOCAL_RANK from the "
        "environment (always set)",
    )
    try:
        args = parser.parse_args(argv)
        if args.no_python and not args.use_env:
            raise ValueError(
                "--no-python needs --use-env: a program that is not a Python script is "
                "not passed --local-rank=N; read LOCAL_RANK from the environment"
            )
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.use_env:
        index = len(config.command) - len(args.training_script_args)
        config = dataclasses.replace(config, local_rank_argv_index=index)
    return launch(config)


if __name__ == "__main__":
    sys.exit(main())
