"""Print distcomm's public API against torch.distributed's, as a Markdown table.

    python -m tests.torch_api_table            # needs torch: pip install torch==2.13.0

Rows: every name of torch.distributed.distributed_c10d.__all__ (the process-group and
collective API) and every name of distcomm.__all__, each marked with where it exists.
The README's "Differences from torch.distributed" shows this script's output.
"""

from __future__ import annotations

import sys


def rows() -> list[tuple[str, bool, bool]]:
    """(name, in torch.distributed, in distcomm) for the union of both APIs, sorted."""
    import torch
    import torch.distributed as torch_dist
    import torch.distributed.distributed_c10d as c10d

    import distcomm

    del torch
    theirs = set(c10d.__all__)
    ours = set(distcomm.__all__)
    return [(name, name in theirs or hasattr(torch_dist, name), name in ours)
            for name in sorted(theirs | ours, key=str.lower)]


def main() -> int:
    try:
        table = rows()
    except ImportError as exc:
        print(f"torch is needed to compare with it: {exc} (pip install torch==2.13.0)",
              file=sys.stderr)
        return 2
    import torch

    missing = [name for name, in_torch, in_ours in table if in_torch and not in_ours]
    print(f"torch {torch.__version__}: {sum(t for _, t, _ in table)} names in "
          f"torch.distributed, {sum(o for _, _, o in table)} in distcomm's; "
          f"{len(missing)} of torch's missing from distcomm\n")
    print("| name | torch.distributed | distcomm |")
    print("|---|---|---|")
    for name, in_torch, in_ours in table:
        print(f"| `{name}` | {'✓' if in_torch else ''} | {'✓' if in_ours else '**missing**'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
