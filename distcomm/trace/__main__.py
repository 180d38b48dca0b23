"""`python -m distcomm.trace DIR [--json]`: explain a run's flight-recorder traces.

Exit status 0 when the traces could be read (whatever they show), 2 when not.
"""

from __future__ import annotations

import argparse
import json
import sys

from .analyze import TraceError, analyze, render


def main(argv: list[str] | None = None) -> int:
    """Read the traces in DIR and print what they show; the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m distcomm.trace",
        description="Line up the flight-recorder traces of a run's ranks (DISTCOMM_TRACE_DIR) "
        "and name the first collective that not every rank entered, where the missing "
        "ranks were instead, and mismatched collectives.",
    )
    parser.add_argument("directory", metavar="DIR", help="the run's DISTCOMM_TRACE_DIR")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = parser.parse_args(argv)
    try:
        report = analyze(args.directory)
    except TraceError as exc:
        print(f"python -m distcomm.trace: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
