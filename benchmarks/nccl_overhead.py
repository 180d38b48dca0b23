"""Where the nccl backend's time per call goes, at one rank on one GPU.

At one rank an in-place all_reduce moves nothing, so what is timed is the cost of a call:
raw `cupy.cuda.nccl` (`comm.allReduce` on the current stream), the CUDA calls distcomm
makes around it (an event created and recorded, a device guard), and `dist.all_reduce`
on the `nccl` backend, synchronous and asynchronous, with the flight recorder on and off.
Each figure is the median (and the minimum) over --rounds of --calls calls, in
microseconds per call, the device synchronised before and after each round. --profile
adds a cProfile listing of the synchronous call (recorder on).

Example::

    python benchmarks/nccl_overhead.py --calls 2000 --rounds 7
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import distcomm as dist


def per_call(cupy: Any, fn: Callable[[], Any], calls: int, rounds: int) -> tuple[float, float]:
    """(median, minimum) over `rounds` of the microseconds per call of `calls` calls."""
    sync = cupy.cuda.Device().synchronize
    times = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return round(statistics.median(times), 2), round(min(times), 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per round (2000)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per figure (7)")
    parser.add_argument(
        "--profile", action="store_true", help="also print a cProfile listing of dist.all_reduce"
    )
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds must be >= 1")
    from distcomm.errors import BackendUnavailableError
    from distcomm.gpu.nccl import import_nccl

    try:
        nccl, version = import_nccl()
    except BackendUnavailableError as exc:
        parser.error(str(exc))
    import cupy

    def report(what: str, fn: Callable[[], Any]) -> None:
        median, least = per_call(cupy, fn, args.calls, args.rounds)
        print(f"{what:40s} {median:8.2f} {least:8.2f}", flush=True)

    print(
        f"# CuPy {cupy.__version__}, NCCL {'.'.join(map(str, version))}; us per call: "
        "median, minimum",
        flush=True,
    )
    x = cupy.zeros(2, dtype=cupy.float32)
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    stream = cupy.cuda.get_current_stream().ptr
    report(
        "raw comm.allReduce",
        lambda: comm.allReduce(x.data.ptr, x.data.ptr, 2, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream),
    )
    event = cupy.cuda.Event(disable_timing=True)
    report("cupy.cuda.Event()", lambda: cupy.cuda.Event(disable_timing=True))
    report("event.record", lambda: event.record(cupy.cuda.get_current_stream()))

    def guard() -> None:
        with cupy.cuda.Device(0):
            pass

    report("with cupy.cuda.Device(0)", guard)
    for trace in ("2000", "0"):
        os.environ["DISTCOMM_TRACE_BUFFER"] = trace
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=60)
        try:
            report(f"dist.all_reduce, recorder {trace}", lambda: dist.all_reduce(x))
            report(
                f"dist.all_reduce async, recorder {trace}",
                lambda: dist.all_reduce(x, async_op=True),
            )
            if args.profile and trace != "0":
                profile = cProfile.Profile()
                profile.enable()
                for _ in range(args.calls):
                    dist.all_reduce(x)
                profile.disable()
                pstats.Stats(profile).sort_stats("tottime").print_stats(30)
        finally:
            dist.destroy_process_group()
    comm.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
