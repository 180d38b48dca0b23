"""Plots of the benchmarks' rows, ours beside each peer (matplotlib, the `bench` extra).

`collectives(rows, path)` draws what `benchmarks/collectives.py` measured: for each op, the
time per call and the bus bandwidth against the message size, one line for distcomm and
one for the peer of each run (torch gloo, raw mpi4py, raw CuPy NCCL). The rows may come
from several runs (the CSV files of a gloo run beside torch and an mpi run beside mpi4py,
say): each (backend, ranks) pair is one line, and so is each peer.

    python benchmarks/collectives.py --op all_reduce --compare torch --png gloo.png
    python benchmarks/plots.py collectives gloo.csv mpi.csv --png collectives.png
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Iterable
from typing import Any

#: the peer a run of each distcomm backend is compared with (--compare)
PEERS = {"gloo": "torch gloo", "tcp": "torch gloo", "mpi": "raw mpi4py", "nccl": "raw CuPy NCCL"}


def require_matplotlib(parser: argparse.ArgumentParser) -> None:
    """Stop with a usage error naming the fix when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error(f"--png needs matplotlib, which is not importable in this Python "
                     f"({sys.executable}); install it (pip install matplotlib, or the "
                     "'bench' extra: pip install -e '.[bench]') or run without --png")


def _number(value: Any) -> float | None:
    if value in ("", None):
        return None
    return float(value)


def _series(rows: Iterable[dict[str, Any]]) -> dict[tuple[str, str], dict[str, list]]:
    """{(label, op): {"size": [...], "time": [...], "busbw": [...]}}, ours and the peers."""
    out: dict[tuple[str, str], dict[str, list]] = {}
    for row in rows:
        backend, n, op = row["backend"], int(row["nprocs"]), row["op"]
        size = int(row["size"])
        for label, time_key, bw_key in (
            (f"distcomm {backend}, {n} ranks", "time_us", "busbw"),
            (f"{PEERS.get(backend, 'peer')}, {n} ranks", "peer_time_us", "peer_busbw"),
        ):
            time_us = _number(row.get(time_key))
            if time_us is None:
                continue
            line = out.setdefault((label, op), {"size": [], "time": [], "busbw": []})
            line["size"].append(size)
            line["time"].append(time_us)
            line["busbw"].append(_number(row.get(bw_key)) or 0.0)
    return out


def collectives(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Write a PNG to `path`: per op, time and bus bandwidth against size, every line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _series(rows)
    ops = list(dict.fromkeys(op for _, op in series))
    sized = [op for op in ops if op != "barrier"]
    labels = list(dict.fromkeys(label for label, _ in series))
    colours = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    height = len(sized) + (1 if "barrier" in ops else 0)
    fig, axes = plt.subplots(max(height, 1), 2, figsize=(12, 3.6 * max(height, 1)),
                             squeeze=False)
    for i, op in enumerate(sized):
        ax_time, ax_bw = axes[i]
        for label in labels:
            line = series.get((label, op))
            if line is None:
                continue
            style = dict(marker="o", markersize=3, color=colours[label], label=label,
                         linestyle="--" if label.startswith(tuple(PEERS.values())) else "-")
            ax_time.plot(line["size"], line["time"], **style)
            ax_bw.plot(line["size"], line["busbw"], **style)
        ax_time.set(xscale="log", yscale="log", xlabel="message size (bytes)",
                    ylabel="time per call (us)", title=f"{op}: latency")
        ax_bw.set(xscale="log", xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)",
                  title=f"{op}: bus bandwidth")
        for ax in (ax_time, ax_bw):
            ax.grid(True, which="both", alpha=0.3)
        ax_time.legend(fontsize="small")
    if "barrier" in ops:
        ax, spare = axes[len(sized)]
        names = [label for label in labels if (label, "barrier") in series]
        times = [series[(label, "barrier")]["time"][0] for label in names]
        ax.barh(names, times, color=[colours[label] for label in names])
        ax.set(xscale="log", xlabel="time per call (us)", title="barrier")
        ax.grid(True, which="both", axis="x", alpha=0.3)
        spare.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"# wrote the plot to {path}", flush=True)


def read_csv(paths: Iterable[str]) -> list[dict[str, Any]]:
    """The rows of every CSV file, in order."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        with open(path, newline="") as f:
            rows.extend(csv.DictReader(f))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot benchmark CSV files, ours beside the peers.")
    parser.add_argument("kind", choices=("collectives",),
                        help="which benchmark wrote the files")
    parser.add_argument("csv", nargs="+", help="CSV files written with --csv")
    parser.add_argument("--png", required=True, metavar="PATH", help="the picture to write")
    parser.add_argument("--title", default="", help="a title above the plots")
    args = parser.parse_args(argv)
    require_matplotlib(parser)
    try:
        rows = read_csv(args.csv)
        if not rows:
            parser.error(f"no rows in {', '.join(args.csv)}")
        collectives(rows, args.png, args.title)
    except (OSError, KeyError, ValueError) as exc:
        parser.error(f"cannot plot {', '.join(args.csv)}: {exc!r} (files written by "
                     "benchmarks/collectives.py --csv?)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
