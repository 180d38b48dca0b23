"""`python -m distcomm.run`: the same program as the `distcomm-run` command.

As torch's ``torch.distributed.run``: `get_args_parser()`, `parse_args(args)`, `run(args)`
(raises `ChildFailedError` when the run fails) and `main(args=None)` (returns the exit
status).
"""

from __future__ import annotations

import sys

from .launch.run import config_from_args, get_args_parser, main, parse_args, run

__all__ = ["config_from_args", "get_args_parser", "main", "parse_args", "run"]

if __name__ == "__main__":
    sys.exit(main())
