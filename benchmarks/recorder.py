"""The flight recorder's cost per operation, in one process.

What `distcomm.collectives` pays for each synchronous collective: `Recorder.record`, then
marking the entry done, with the recorder on (DISTCOMM_TRACE_BUFFER entries) minus the
same calls with it off (DISTCOMM_TRACE_BUFFER=0). A collective between processes takes
tens of microseconds with a noise of several, which hides a cost of this size (see
`collectives.py --trace both`); here each variant is timed in many short rounds,
interleaved, and the minimum of each is kept, which a busy machine cannot inflate.
For scale it also times an empty method call and one monotonic clock read.

    python benchmarks/recorder.py [--rounds 60] [--calls 20000]
"""

from __future__ import annotations

import argparse
import time
import timeit

import numpy as np

from distcomm.ops import ReduceOp
from distcomm.trace.recorder import Recorder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60, help="rounds of each variant")
    parser.add_argument("--calls", type=int, default=20000, help="calls per round")
    args = parser.parse_args()
    if args.rounds < 1 or args.calls < 1:
        parser.error("--rounds and --calls must be >= 1")

    array, op = np.zeros(1, np.float64), ReduceOp.SUM  # the 8-byte all_reduce
    on, off = Recorder.create(2000), Recorder.create(0)

    def recorder_on() -> None:
        entry = on.record("all_reduce", array, -1, op)
        if entry is not None:
            on.done[entry % on.size] = entry

    def recorder_off() -> None:
        entry = off.record("all_reduce", array, -1, op)
        if entry is not None:
            off.done[entry % off.size] = entry

    class Empty:
        def call(self) -> None:
            pass

    empty = Empty()

    def method_call() -> None:
        empty.call()

    clock = time.monotonic_ns
    variants = [recorder_on, recorder_off, method_call, clock]
    best = {f.__name__: float("inf") for f in variants}
    for _ in range(args.rounds):
        for f in variants:
            best[f.__name__] = min(
                best[f.__name__], timeit.timeit(f, number=args.calls) / args.calls * 1e9
            )
    print(f"best of {args.rounds} rounds of {args.calls} calls, ns per call:")
    for name, value in best.items():
        print(f"  {name:<14} {value:8.0f}")
    print(f"flight recorder cost per op: {best['recorder_on'] - best['recorder_off']:.0f} ns")


if __name__ == "__main__":
    main()
