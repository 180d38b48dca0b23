"""Where a small collective's time goes: the same 8-byte call timed at each layer.

Run under a launcher, one line per layer on rank 0 (microseconds per call, the best of
5 rounds of --calls calls after a warm-up):

    distcomm-run --standalone --nproc_per_node=2 benchmarks/layers.py            # gloo
    mpiexec -n 2 python benchmarks/layers.py --backend mpi

- gloo: `engine` calls the shared-memory engine's step directly (no runner, no Work),
  `backend` the group's backend (`Runner`, signature, op queue, Work), `dist` the
  public function (argument checks, dispatch, the flight recorder's entry);
- mpi: `raw` is mpi4py's buffer method on MPI.COMM_WORLD, then `backend` and `dist`.

The layers reach into the group (`backend_for`, the backend's path and runner): this is
a measuring tool, not an example.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

import distcomm as dist
from distcomm.backends.engine.protocol import OP_CODES, Call, Signature
from distcomm.deadline import Deadline
from distcomm.ops import ReduceOp
from distcomm.world import resolve


def best_of(fn: Callable[[], object], calls: int, sync: Callable[[], object]) -> float:
    """Microseconds per call of `fn`, the best of 5 rounds after a warm-up."""
    for _ in range(calls // 10):
        fn()
    best = float("inf")
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def gloo_layers(array: np.ndarray, calls: int) -> dict[str, float]:
    backend = resolve(None, "layers").backend_for(array, "layers")
    path, runner, deadline = backend._path, backend._runner, Deadline(300.0)

    def engine(name: str, *args: object) -> Callable[[], None]:
        signature = {
            "all_reduce": Signature.of("all_reduce", array, ReduceOp.SUM),
            "broadcast": Signature.of("broadcast", array, root=0),
            "barrier": Signature(OP_CODES["barrier"]),
        }[name]
        step = getattr(path, name)

        def run() -> None:
            seq = runner.seq
            runner.seq += 1  # the engine's steps are numbered as the runner numbers them
            step(Call(seq, signature, name, deadline), *args)

        return run

    timings = {}
    for name, args, ours, public in (
        (
            "all_reduce",
            (array, ReduceOp.SUM),
            lambda: backend.all_reduce(array, ReduceOp.SUM),
            lambda: dist.all_reduce(array),
        ),
        (
            "broadcast",
            (array, 0),
            lambda: backend.broadcast(array, 0),
            lambda: dist.broadcast(array, 0),
        ),
        ("barrier", (), lambda: backend.barrier(), dist.barrier),
    ):
        timings[f"{name}: engine"] = best_of(engine(name, *args), calls, dist.barrier)
        timings[f"{name}: backend"] = best_of(ours, calls, dist.barrier)
        timings[f"{name}: dist"] = best_of(public, calls, dist.barrier)
    return timings


def mpi_layers(array: np.ndarray, calls: int) -> dict[str, float]:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    backend = resolve(None, "layers").backend_for(array, "layers")
    buf, out = [array, MPI.FLOAT], np.empty(array.size * comm.size, array.dtype)
    timings = {}
    for name, raw, ours, public in (
        (
            "all_reduce",
            lambda: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM),
            lambda: backend.all_reduce(array, ReduceOp.SUM),
            lambda: dist.all_reduce(array),
        ),
        (
            "broadcast",
            lambda: comm.Bcast(buf, 0),
            lambda: backend.broadcast(array, 0),
            lambda: dist.broadcast(array, 0),
        ),
        ("barrier", comm.Barrier, lambda: backend.barrier(), dist.barrier),
        (
            "all_gather",
            lambda: comm.Allgather(buf, [out, MPI.FLOAT]),
            lambda: backend.all_gather(out, array),
            lambda: dist.all_gather_single(out, array),
        ),
    ):
        timings[f"{name}: raw"] = best_of(raw, calls, comm.Barrier)
        timings[f"{name}: backend"] = best_of(ours, calls, comm.Barrier)
        timings[f"{name}: dist"] = best_of(public, calls, comm.Barrier)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("gloo", "mpi"), default="gloo")
    parser.add_argument("--calls", type=int, default=20000, help="calls per round")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    array = np.zeros(2, np.float32)  # stays 0 however often it is summed
    layers = gloo_layers if args.backend == "gloo" else mpi_layers
    timings = layers(array, args.calls)
    if dist.get_rank() == 0:
        print(f"# {args.backend}, {dist.get_world_size()} ranks, 8 bytes, us per call")
        for name, us in timings.items():
            print(f"{name:24s} {us:7.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
