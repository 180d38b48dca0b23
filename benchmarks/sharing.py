"""Sending a numpy array to a child through a Queue: distcomm.multiprocessing vs the stdlib.

For each size the parent puts one array on a Queue, a child (started before timing) takes
it, reads its first and last element and acknowledges on a second Queue; the time from
`put` to the acknowledgement is measured --repeat times and the median printed. Three
ways, interleaved within each repetition, in the same run:

- stdlib: `multiprocessing.Queue` (the array is pickled, pushed through the pipe and
  unpickled: two copies and the pipe), driven from a process that never imports
  distcomm.multiprocessing (importing it registers its reducers for the whole process);
- distcomm, plain: `distcomm.multiprocessing.Queue` with an ordinary array (copied once
  into shared memory by the sender, mapped by the child);
- distcomm, shared: the same with an array already in shared memory (`share_memory`):
  only a handle travels, whatever the size.

Examples::

    python benchmarks/sharing.py
    python benchmarks/sharing.py --sizes 1M,64M,1G --repeat 5 --strategy file_system
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as std_mp
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from collectives import parse_bytes  # this folder's benchmark: one size syntax


def _child(inbox, outbox) -> None:
    while True:
        arr = inbox.get()
        if arr is None:
            return
        outbox.put((int(arr[0]), int(arr[-1]), arr.nbytes))
        del arr


class Peer:
    """A child process fed through one queue pair of a multiprocessing flavour."""

    def __init__(self, module) -> None:
        ctx = module.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_child, args=(self.inbox, self.outbox), daemon=True)
        self.proc.start()

    def send(self, arr: np.ndarray) -> float:
        start = time.perf_counter()
        self.inbox.put(arr)
        first, last, nbytes = self.outbox.get(timeout=600)
        elapsed = time.perf_counter() - start
        if (first, last, nbytes) != (int(arr[0]), int(arr[-1]), arr.nbytes):
            raise RuntimeError(
                f"the child saw {(first, last, nbytes)}, expected "
                f"{(int(arr[0]), int(arr[-1]), arr.nbytes)}"
            )
        return elapsed

    def close(self) -> None:
        self.inbox.put(None)
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def drive(flavour: str, strategy: str) -> int:
    """A driver process: reads "SIZE KIND" lines, answers each with the seconds one send took.

    KIND is plain or shared; flavour is stdlib (this process never imports distcomm's
    multiprocessing) or distcomm.
    """
    if flavour == "stdlib":
        module, share = std_mp, None
    else:
        import distcomm.multiprocessing as module

        module.set_sharing_strategy(strategy)
        share = module.share_memory
    peer = Peer(module)
    arrays: dict[tuple[int, str], np.ndarray] = {}
    try:
        for line in sys.stdin:
            size_text, kind = line.split()
            size = int(size_text)
            if (size, kind) not in arrays:
                arrays.clear()
                gc.collect()
                plain = np.arange(size, dtype=np.uint8)
                arrays[(size, kind)] = share(plain) if kind == "shared" else plain
            print(json.dumps(peer.send(arrays[(size, kind)])), flush=True)
            gc.collect()
    finally:
        peer.close()
    return 0


class Driver:
    """A driver process of one flavour, asked for one timed send at a time."""

    def __init__(self, flavour: str, strategy: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--drive", flavour, "--strategy", strategy],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def send(self, size: int, kind: str) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{size} {kind}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the driver {self.proc.args} exited ({self.proc.wait()})")
        return float(json.loads(line))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.3f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        default="1M,64M,1G",
        help="array sizes in bytes, K/M/G suffixes (default 1M,64M,1G)",
    )
    parser.add_argument("--repeat", type=int, default=5, help="sends per cell (default 5)")
    parser.add_argument(
        "--strategy",
        choices=("file_descriptor", "file_system"),
        default="file_descriptor",
        help="distcomm's sharing strategy",
    )
    parser.add_argument("--drive", choices=("stdlib", "distcomm"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        return drive(args.drive, args.strategy)
    sizes = [parse_bytes(part) for part in args.sizes.split(",") if part.strip()]
    std, ours = Driver("stdlib", args.strategy), Driver("distcomm", args.strategy)
    print(
        f"# one array through a Queue to a child and back an acknowledgement; median of "
        f"{args.repeat}; distcomm strategy {args.strategy}; {os.cpu_count()} CPUs"
    )
    print(
        "| size | stdlib | distcomm, plain array | distcomm, shared array | "
        "stdlib/plain | stdlib/shared |"
    )
    print("|---|---|---|---|---|---|")
    try:
        for size in sizes:
            times: dict[str, list[float]] = {"std": [], "plain": [], "shared": []}
            for _ in range(args.repeat):  # interleaved, so load changes hit all three alike
                times["std"].append(std.send(size, "plain"))
                times["plain"].append(ours.send(size, "plain"))
            for _ in range(args.repeat):
                times["shared"].append(ours.send(size, "shared"))
            m = {key: statistics.median(values) for key, values in times.items()}
            label = f"{size / 2**30:g} GiB" if size >= 2**30 else f"{size / 2**20:g} MiB"
            print(
                f"| {label} | {_fmt(m['std'])} | {_fmt(m['plain'])} | {_fmt(m['shared'])} "
                f"| {m['std'] / m['plain']:.1f}x | {m['std'] / m['shared']:.0f}x |",
                flush=True,
            )
    finally:
        std.close()
        ours.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
