"""`python -m distcomm.run`: the same program as the `distcomm-run` command."""

from __future__ import annotations

import sys

from .launch.run import main

if __name__ == "__main__":
    sys.exit(main())
