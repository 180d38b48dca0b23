"""Print distcomm's public API against torch's, as Markdown tables, one per area.

    python -m tests.torch_api_table            # needs torch: pip install torch==2.13.0

Areas: the process-group and collective API (torch.distributed.distributed_c10d.__all__
and distcomm.__all__), the stores' methods, torchrun's flags, and the Python launch,
error and timer APIs of torch's elastic package, each beside the distcomm module a port
imports instead. docs/torch-differences.md shows the output.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable

#: what a torch name stays missing for, on purpose (shown in the table)
NOT_MIRRORED = {
    "ProcessGroupGloo": "torch's C++ gloo backend class: distcomm's is made by "
    "init_process_group/new_group (backend='gloo')",
}

#: (torch module, distcomm module) of the elastic package's Python APIs
ELASTIC = [
    ("torch.distributed.run", "distcomm.run", ["get_args_parser", "main", "parse_args", "run"]),
    ("torch.distributed.launcher.api", "distcomm.launch.api", None),
    ("torch.distributed.elastic.multiprocessing.errors", "distcomm.launch.errors", None),
    ("torch.distributed.elastic.timer", "distcomm.launch.timer", None),
]


def _public(module: object) -> set[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    return set(names)


def c10d_rows() -> list[tuple[str, bool, bool]]:
    """(name, in torch.distributed, in distcomm) for the union of both APIs, sorted."""
    import torch.distributed as torch_dist
    import torch.distributed.distributed_c10d as c10d

    import distcomm

    theirs = set(c10d.__all__)
    ours = set(distcomm.__all__)
    return [
        (name, name in theirs or hasattr(torch_dist, name), name in ours)
        for name in sorted(theirs | ours, key=str.lower)
    ]


def store_rows() -> list[tuple[str, bool, bool]]:
    """(method, in torch's Store, in every distcomm store) for the stores' methods."""
    import torch.distributed as torch_dist

    import distcomm

    theirs = {m for m in dir(torch_dist.Store) if not m.startswith("_")}
    stores = [
        distcomm.TCPStore,
        distcomm.FileStore,
        distcomm.HashStore,
        distcomm.PrefixStore,
        distcomm.EtcdStore,
    ]
    ours = set.intersection(*({m for m in dir(s) if not m.startswith("_")} for s in stores))
    return [
        (name, name in theirs, name in ours)
        for name in sorted(theirs | (ours & theirs), key=str.lower)
    ]


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """The parser's long options, each under its dashed spelling (--nproc-per-node)."""
    return {
        opt.replace("_", "-")
        for action in parser._actions
        for opt in action.option_strings
        if opt.startswith("--")
    }


def flag_rows() -> list[tuple[str, bool, bool]]:
    """(flag, in torchrun, in distcomm-run); each flag under its dashed spelling."""
    import torch.distributed.run as torch_run

    from distcomm.launch.run import get_args_parser

    theirs = _flags(torch_run.get_args_parser())
    ours = _flags(get_args_parser())
    return [(flag, flag in theirs, flag in ours) for flag in sorted(theirs | ours)]


def elastic_rows() -> list[tuple[str, bool, bool]]:
    """(module.name, in torch's module, in distcomm's counterpart)."""
    rows = []
    for torch_name, ours_name, names in ELASTIC:
        theirs = importlib.import_module(torch_name)
        try:
            ours: object | None = importlib.import_module(ours_name)
        except ImportError:
            ours = None
        wanted = set(names) if names is not None else _public(theirs)
        for name in sorted(wanted, key=str.lower):
            label = f"{ours_name}.{name}"
            rows.append((label, hasattr(theirs, name), ours is not None and hasattr(ours, name)))
    return rows


def _table(
    title: str, header: tuple[str, str, str], rows: Iterable[tuple[str, bool, bool]]
) -> tuple[list[str], list[str]]:
    rows = list(rows)
    missing = [name for name, in_torch, in_ours in rows if in_torch and not in_ours]
    lines = [
        f"#### {title}",
        "",
        f"{sum(t for _, t, _ in rows)} of torch's, {sum(o for _, _, o in rows)} of "
        f"distcomm's; {len(missing)} of torch's missing from distcomm",
        "",
        f"| {header[0]} | {header[1]} | {header[2]} |",
        "|---|---|---|",
    ]
    for name, in_torch, in_ours in rows:
        mark = (
            "✓"
            if in_ours
            else (f"not mirrored: {NOT_MIRRORED[name]}" if name in NOT_MIRRORED else "**missing**")
        )
        lines.append(f"| `{name}` | {'✓' if in_torch else ''} | {mark} |")
    lines.append("")
    return lines, [m for m in missing if m not in NOT_MIRRORED]


def main() -> int:
    try:
        import torch
    except ImportError as exc:
        print(
            f"torch is needed to compare with it: {exc} (pip install torch==2.13.0)",
            file=sys.stderr,
        )
        return 2
    out = [f"torch {torch.__version__} against distcomm", ""]
    missing: list[str] = []
    for title, header, rows in [
        ("Process groups and collectives", ("name", "torch.distributed", "distcomm"), c10d_rows()),
        (
            "Store methods (every distcomm store)",
            ("method", "torch Store", "distcomm"),
            store_rows(),
        ),
        ("torchrun flags", ("flag", "torchrun", "distcomm-run"), flag_rows()),
        ("Launch, errors and timers", ("name", "torch", "distcomm"), elastic_rows()),
    ]:
        lines, gone = _table(title, header, rows)
        out += lines
        missing += gone
    print("\n".join(out))
    if missing:
        print(f"missing: {', '.join(missing)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
