"""CuPy arrays on a CPU backend (host staging) against a plain device-host-device round trip.

For each size, in the same process and interleaved within each repetition:

- distcomm: `dist.all_reduce(x)` on a CuPy array in a one-rank gloo group. The op at one
  rank changes nothing, so what is timed is the staging itself: the copy to a pinned
  host buffer, the (empty) CPU op, the copy back and the synchronisations;
- plain: `x.set(cupy.asnumpy(x))`, what a user writes without distcomm (pageable memory);
- pinned: the same two copies through a pinned buffer allocated once, the best a host
  round trip can do here.

The median of --repeat timed runs per size is printed (after one warm-up), with the
bandwidths (bytes moved each way / time) and plain/distcomm (above 1: staging is faster
than the plain round trip). Every run is checked: the array must be unchanged.

Examples::

    python benchmarks/staging.py
    python benchmarks/staging.py --sizes 8,1M,64M,1G --repeat 20 --csv staging.csv
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import plots  # benchmarks/plots.py, beside this script
from collectives import parse_bytes  # this folder's benchmark: one size syntax

import distcomm as dist

FIELDS = (
    "bytes",
    "distcomm_us",
    "plain_us",
    "pinned_us",
    "distcomm_GBps",
    "plain_GBps",
    "pinned_GBps",
    "plain_over_distcomm",
    "pinned_over_distcomm",
)


def parse_sizes(text: str) -> list[int]:
    """'8,1M,64M' -> byte counts, each at least one float32 (collectives.py's syntax)."""
    sizes = [parse_bytes(part) for part in text.split(",") if part.strip()]
    if not sizes or min(sizes) < 4:
        raise argparse.ArgumentTypeError(
            f"need one or more sizes of at least 4 bytes, got {text!r}"
        )
    return sizes


def _time_us(fn: Callable[[], None], sync: Callable[[], None]) -> float:
    """Microseconds `fn()` takes, the device synchronised before and after."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - start) * 1e6


def _one_size(cupy: Any, size: int, repeat: int) -> dict[str, Any]:
    sync = cupy.cuda.get_current_stream().synchronize
    count = size // 4
    x = cupy.arange(count, dtype=cupy.float32)
    want = cupy.asnumpy(x)
    pinned = cupy.cuda.alloc_pinned_memory(count * 4)
    host = np.frombuffer(pinned, dtype=np.float32, count=count)

    def ours() -> None:
        dist.all_reduce(x)

    def plain() -> None:
        x.set(cupy.asnumpy(x))

    def pinned_trip() -> None:
        x.get(out=host)
        x.set(host)

    cases = {"distcomm": ours, "plain": plain, "pinned": pinned_trip}
    for fn in cases.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeat):  # interleaved, so a slow moment hits every case
        for name, fn in cases.items():
            times[name].append(_time_us(fn, sync))
    if not (cupy.asnumpy(x) == want).all():
        raise AssertionError(f"{size} B: the array changed during the round trips")
    row: dict[str, Any] = {"bytes": size}
    for name in cases:
        us = statistics.median(times[name])
        row[f"{name}_us"] = round(us, 1)
        row[f"{name}_GBps"] = round(size / us / 1e3, 3)
    row["plain_over_distcomm"] = round(row["plain_us"] / row["distcomm_us"], 3)
    row["pinned_over_distcomm"] = round(row["pinned_us"] / row["distcomm_us"], 3)
    return row


def run(sizes: list[int], repeat: int) -> list[dict[str, Any]]:
    import cupy

    rows = []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=300)
    try:
        for size in sizes:
            rows.append(_one_size(cupy, size, repeat))
            print("  ".join(f"{rows[-1][f]:>12}" for f in FIELDS), flush=True)
    finally:
        dist.destroy_process_group()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=parse_sizes("8,1K,64K,1M,4M,16M,64M,256M,1G"),
        help="byte counts, comma-separated, K/M/G suffixes (default 8 to 1G)",
    )
    parser.add_argument(
        "--repeat", type=int, default=20, help="timed runs per size and case (default 20)"
    )
    parser.add_argument("--csv", metavar="PATH", help="also write the rows to this CSV file")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    from distcomm.errors import BackendUnavailableError
    from distcomm.gpu import import_cupy

    try:
        cupy = import_cupy("benchmarks/staging.py")
    except BackendUnavailableError as exc:
        parser.error(str(exc))
    device = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    print(
        f"# GPU {device.id}: {name}; CuPy {cupy.__version__}; CUDA runtime "
        f"{cupy.cuda.runtime.runtimeGetVersion()}; median of {args.repeat} runs, us",
        flush=True,
    )
    print("  ".join(f"{f:>12}" for f in FIELDS), flush=True)  # the rows line up below
    rows = run(args.sizes, args.repeat)
    if args.csv:
        plots.write_csv(rows, args.csv, FIELDS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
