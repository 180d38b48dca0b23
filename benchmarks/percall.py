"""The spread of a collective's time: each all_reduce (8 bytes, or --bytes) and barrier
timed alone.

`layers.py` reports the best of a few rounds, which hides a slow mode a run may fall into;
this script times every call and prints percentiles, so two versions can be compared by
their typical call as well as their best. Run under a launcher, rank 0 prints:

    distcomm-run --standalone --nproc_per_node=2 benchmarks/percall.py
    DISTCOMM_GLOO_TRANSPORT=tcp distcomm-run --standalone --nproc_per_node=2 \\
        benchmarks/percall.py --pin

`--pin` keeps each rank's process on one core (its local rank modulo the core count),
which removes the scheduler's placement of the ranks' threads from the comparison.
`--bytes 65536,262144,1048576` times all_reduce at those sizes too (shared memory's
cross-memory path above 32 KiB), one row each.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import distcomm as dist


def per_call(fn, calls: int) -> np.ndarray:
    """Microseconds of each of `calls` calls of `fn`, after a warm-up and a barrier."""
    for _ in range(calls // 5):
        fn()
    dist.barrier()
    times = np.empty(calls)
    clock = time.perf_counter
    for i in range(calls):
        start = clock()
        fn()
        times[i] = clock() - start
    return times * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pin", action="store_true", help="one core per rank's process")
    parser.add_argument(
        "--bytes", default="8", help="all_reduce sizes in bytes, comma-separated (float32)"
    )
    args = parser.parse_args()
    if args.pin:
        os.sched_setaffinity(0, {int(os.environ.get("LOCAL_RANK", "0")) % os.cpu_count()})
    dist.init_process_group("gloo")
    ops = {}
    for nbytes in (int(b) for b in args.bytes.split(",")):
        array = np.zeros(max(1, nbytes // 4), np.float32)  # stays 0 however often summed
        name = "all_reduce" if nbytes == 8 else f"all_reduce {nbytes} B"
        ops[name] = lambda array=array: dist.all_reduce(array)
    ops["barrier"] = dist.barrier
    times: dict[str, list[np.ndarray]] = {name: [] for name in ops}
    for _ in range(args.rounds):
        for name, fn in ops.items():
            times[name].append(per_call(fn, args.calls))
    if dist.get_rank() == 0:
        print(
            f"# gloo, {dist.get_world_size()} ranks, us per call, "
            f"{args.rounds} x {args.calls} calls{', pinned' if args.pin else ''}"
        )
        for name, runs in times.items():
            t = np.concatenate(runs)
            p10, p50, p90 = np.percentile(t, [10, 50, 90])
            print(f"{name:22s} p10 {p10:7.1f}  p50 {p50:7.1f}  p90 {p90:7.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
