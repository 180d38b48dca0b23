"""Runtime of distcomm's reduction (reduce_into, SUM) against the number of intra-op threads.

For each size and each thread count from 1 to --max-threads the script times
`distcomm.ops.reduce_into(acc, incoming, ReduceOp.SUM)` (acc += incoming, the step every
reducing collective repeats) under `distcomm.parallel.threads(n)` and prints one table:
size, threads, pieces (how many threads reduce_into really used), median time,
bandwidth and speedup against 1 thread. This is the study that sets
`distcomm.ops.PARALLEL_REDUCE_BYTES`: below it reduce_into stays on one thread.

Examples::

    python benchmarks/threads.py
    python benchmarks/threads.py --sizes 64K,256K,1M,4M --threshold 0 --min-chunk 16K
    python benchmarks/threads.py --max-threads 8 --png threads.png
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np
import plots  # benchmarks/plots.py, beside this script
from collectives import parse_bytes  # this folder's benchmark: one size syntax

DTYPES = ("float32", "float64", "float16", "int8", "uint8", "int32", "int64")


def parse_sizes(text: str) -> tuple[int, ...]:
    """A comma-separated list of sizes ('1M,16M,64M') -> bytes, in the order given."""
    sizes = tuple(parse_bytes(part) for part in text.split(",") if part.strip())
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"need one or more sizes >= 1 byte, got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""\
timing: for each (size, threads) the arrays are filled once, reduced --warmup times,
  then --reps times, each call timed alone with time.perf_counter; the time shown is
  the median. GB/s is the array size divided by that time (the memory traffic is three
  times that: two reads and a write). speedup is the 1-thread time over this time.
threshold: by default reduce_into runs as shipped, splitting only arrays of at least
  PARALLEL_REDUCE_BYTES into pieces of at least its minimum chunk; --threshold and
  --min-chunk override both for this run, e.g. --threshold 0 to see what threads do to
  the sizes below the threshold.
""",
    )
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=parse_sizes("1M,16M,64M"),
        help="array sizes in bytes, comma-separated, suffixes K/M/G (default 1M,16M,64M)",
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="element type (default float32)"
    )
    parser.add_argument(
        "--max-threads",
        type=int,
        default=os.cpu_count() or 1,
        help=f"time 1 to this many threads (default: the logical cores, {os.cpu_count()} here)",
    )
    parser.add_argument(
        "--reps", type=int, default=20, help="timed calls per size and thread count (default 20)"
    )
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed calls before them (default 3)"
    )
    parser.add_argument(
        "--threshold",
        type=parse_bytes,
        help="override distcomm.ops.PARALLEL_REDUCE_BYTES for this run",
    )
    parser.add_argument(
        "--min-chunk",
        type=parse_bytes,
        help="override the fewest bytes one thread reduces for this run",
    )
    parser.add_argument(
        "--png",
        metavar="PATH",
        help="also plot time against threads, one line per size (needs matplotlib)",
    )
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.max_threads < 1:
        parser.error(f"--max-threads must be >= 1, got {args.max_threads}")
    if args.reps < 1 or args.warmup < 0:
        parser.error(f"need --reps >= 1 and --warmup >= 0, got {args.reps} and {args.warmup}")
    if args.min_chunk is not None and args.min_chunk < 1:
        parser.error(f"--min-chunk must be >= 1 byte, got {args.min_chunk}")
    if args.png:
        plots.require_matplotlib(parser)


def pieces(ops: Any, nbytes: int, itemsize: int, threads: int) -> int:
    """How many pieces reduce_into splits an array of `nbytes` into with `threads` threads."""
    if nbytes < ops.PARALLEL_REDUCE_BYTES:
        return 1
    min_chunk = max(1, ops._PARALLEL_REDUCE_CHUNK // itemsize)
    return max(1, min(threads, nbytes // itemsize // min_chunk))


def measure(nbytes: int, dtype: np.dtype, threads: int, reps: int, warmup: int) -> float:
    """Median seconds of one reduce_into(acc, incoming, SUM) with `threads` threads."""
    from distcomm import parallel
    from distcomm.ops import ReduceOp, reduce_into

    count = max(1, nbytes // dtype.itemsize)
    acc, incoming = np.zeros(count, dtype), np.ones(count, dtype)
    times = []
    with parallel.threads(threads):
        for i in range(warmup + reps):
            start = time.perf_counter()
            reduce_into(acc, incoming, ReduceOp.SUM)
            if i >= warmup:
                times.append(time.perf_counter() - start)
            if i % 8 == 7:
                acc.fill(0)  # keep narrow dtypes away from overflow and float16 from inf
    return statistics.median(times)


def plot(path: str, rows: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for size in dict.fromkeys(r["size"] for r in rows):
        mine = [r for r in rows if r["size"] == size]
        ax.plot(
            [r["threads"] for r in mine],
            [r["time_ms"] for r in mine],
            marker="o",
            label=f"{size / 2**20:g} MiB",
        )
    ax.set_xlabel("intra-op threads (distcomm.parallel.set_num_threads)")
    ax.set_ylabel("median time per reduce_into (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"# wrote the plot to {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    import distcomm
    from distcomm import ops

    if args.threshold is not None:
        ops.PARALLEL_REDUCE_BYTES = args.threshold
    if args.min_chunk is not None:
        ops._PARALLEL_REDUCE_CHUNK = args.min_chunk
    dtype = np.dtype(args.dtype)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    load = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    print(
        f"# host: {platform.node()} {platform.system()} {platform.machine()}, "
        f"{os.cpu_count()} cores ({usable} usable), {load} at start, python "
        f"{platform.python_version()}, numpy {np.__version__}, distcomm "
        f"{distcomm.__version__}"
    )
    print(
        f"# reduce_into SUM on {args.dtype}; threshold {ops.PARALLEL_REDUCE_BYTES} bytes, "
        f"min chunk {ops._PARALLEL_REDUCE_CHUNK} bytes; median of {args.reps} calls "
        f"after {args.warmup} warm-up"
    )
    print(
        f"#{'size(B)':>11} {'threads':>7} {'pieces':>6} {'time(ms)':>10} {'GB/s':>8} "
        f"{'speedup':>7}",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    try:
        for nbytes in args.sizes:
            base = None
            for n in range(1, args.max_threads + 1):
                seconds = measure(nbytes, dtype, n, args.reps, args.warmup)
                base = base or seconds
                row = dict(
                    size=nbytes,
                    threads=n,
                    time_ms=seconds * 1e3,
                    pieces=pieces(ops, nbytes, dtype.itemsize, n),
                    gbps=nbytes / seconds / 1e9,
                    speedup=base / seconds,
                )
                rows.append(row)
                print(
                    f"{nbytes:>12} {n:>7} {row['pieces']:>6} {row['time_ms']:>10.3f} "
                    f"{row['gbps']:>8.2f} {row['speedup']:>7.2f}",
                    flush=True,
                )
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    if args.png:
        plot(args.png, rows, f"reduce_into SUM, {args.dtype}, {platform.node()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
