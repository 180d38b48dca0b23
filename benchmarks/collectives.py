"""nccl-tests-style benchmark of distcomm's collectives, optionally beside torch.distributed's gloo.

The script spawns `--nprocs` ranks on this host, or, started by an external launcher,
runs as that launcher's ranks (below); it times each collective over a range of sizes and
prints one table per op: size, count, time, algorithm and bus bandwidth, and the number
of wrong elements in the checked result. With `--compare torch` the same
ranks also run torch.distributed's gloo backend on the same numpy buffers (through
`torch.from_numpy`), right after ours at each size, and the table gains torch's time,
bus bandwidth and the ratio torch_time / our_time (> 1: distcomm is faster).

With `--backend nccl` the buffers are CuPy arrays, one GPU per rank (rank % GPUs), the
group is 'cpu:gloo,cuda:nccl' (gloo only aligns the ranks and collects the timings), and
each timed loop ends with a synchronisation of the rank's stream. `--compare cupy` runs
raw `cupy.cuda.nccl` calls on the same buffers, on a communicator of their own.

Examples::

    python benchmarks/collectives.py --op all_reduce -b 8 -e 64M --nprocs 4
    python benchmarks/collectives.py --op all_reduce,broadcast,all_gather --compare torch
    python benchmarks/collectives.py --op all --csv results.csv
    python benchmarks/collectives.py --backend nccl --compare cupy --nprocs 1 -e 1G

Spawned ranks talk over 127.0.0.1 only: the parent hosts the stores on port 0 (the
system picks a free port) and passes the real ports to the ranks. The ranks die with the
parent (PR_SET_PDEATHSIG), every wait has a timeout, and on any failure every rank is
killed and its error printed.

Under an external launcher every process is one rank, across as many hosts as the
launcher spans, and rank 0 prints (the header then says which ranks ran on which host).
The launcher is recognised from the environment: distcomm-run (or torchrun-style
variables: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as for env://) or an MPI launcher
(mpiexec, srun: PMI_RANK, OMPI_COMM_WORLD_RANK, PMIX_RANK)::

    distcomm-run --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST \
        benchmarks/collectives.py --op all_reduce,all_gather --backend gloo
    mpiexec -n 8 -hosts a,b python benchmarks/collectives.py --backend mpi --compare mpi4py

There `--nprocs` is the launcher's business (given, it must match the world size),
`--compare torch` is not offered (torch's gloo would need a store of its own) and
`--backend nccl` is refused: it starts its own ranks, one per GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import multiprocessing
import multiprocessing.connection
import os
import platform
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import plots  # benchmarks/plots.py, beside this script

from distcomm.launch.errors import exit_description

OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier")
DTYPES = ("float32", "float64", "float16", "int8", "uint8", "int32", "int64")
#: Ops whose buffers are split in one piece per rank: sizes round down to a multiple of n.
SPLIT_OPS = ("all_gather", "reduce_scatter", "all_to_all")
#: Fewest timed iterations of a size whose iterations are scaled down.
MIN_SCALED_ITERS = 5
#: How long the other ranks may take to report their own error after a first failure.
GRACE_AFTER_FAILURE = 3.0
#: Extra seconds the parent waits beyond --timeout, so a rank's own timeout error arrives first.
PARENT_MARGIN = 30.0
LOOPBACK = "127.0.0.1"

FIELDS = (
    "op",
    "nprocs",
    "dtype",
    "backend",
    "size",
    "count",
    "iters",
    "time_us",
    "algbw",
    "busbw",
    "wrong",
    "peer_time_us",
    "peer_algbw",
    "peer_busbw",
    "peer_wrong",
    "ratio",
    "trace_off_us",
    "trace_cost_us",
)


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    return 0.0


# -- command line ------------------------------------------------------------------------------


def parse_bytes(text: str) -> int:
    """'8', '64K', '64M', '1G' (also '64MB', '64MiB'; powers of 1024) -> bytes.

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(I?B)?\s*", text.upper())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: write a number of bytes with an optional K, M or G "
            "suffix (powers of 1024), e.g. 8, 64K, 64M, 1G"
        )
    return int(match.group(1)) * 1024 ** " KMG".index(match.group(2) or " ")


def parse_ops(text: str) -> tuple[str, ...]:
    """'all', one op, or a comma-separated list -> the ops in the order given."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if names == ["all"]:
        return OPS
    unknown = [name for name in names if name not in OPS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown op {', '.join(unknown) or text!r}: choose from {', '.join(OPS)} or 'all' "
            "(several ops: a comma-separated list)"
        )
    return tuple(dict.fromkeys(names))


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""\
timing: at each size every rank fills its buffers, runs the op once and checks the
  result (#wrong counts the wrong elements: 0 is a pass), runs the rest of the warm-up,
  enters a barrier, then times -n iterations with time.perf_counter. The time shown is
  the largest over the ranks of the mean time per iteration.
iterations: above --scale_above bytes (default 1M) the iterations shrink in proportion
  to the size (-n * scale_above / size, at least 5) and so does the warm-up (at least
  1), to keep big sizes quick; the iters column shows what ran. --scale_above 0 turns
  this off.
sizes: from -b to -e, multiplied by -f. size and count describe the whole buffer
  (all_gather's output, reduce_scatter's input, all_to_all's input); for those ops the
  size rounds down to a multiple of nprocs elements and sizes too small to give each
  rank one element are skipped. barrier runs once, at size 0.
bandwidth: algbw = size / time and busbw = algbw * factor, in GB/s (1e9 bytes/s), with
  nccl-tests' factors: all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all
  (n-1)/n; broadcast, reduce 1.
compare: with --compare torch each size runs ours, then torch.distributed's gloo in the
  same ranks on the same buffers (torch.from_numpy); torch/ours is the ratio of the two
  times: above 1, distcomm is faster. --compare cupy (with --backend nccl) does the same
  with raw cupy.cuda.nccl calls on the same CuPy buffers.
exit status: 0 when every rank finished and every check passed, 1 otherwise, 2 for a
  usage error (including --compare torch without torch installed).
recorder: --trace on (default) times with the flight recorder on, as users run; off
  with it off (DISTCOMM_TRACE_BUFFER=0); both times each size --trace_rounds times
  (default 3) with it on and as many times off, alternating in the same ranks, keeps the
  fastest of each, and adds the columns off(us) and rec(us) = time - off: the
  recorder's cost per op. Many short rounds (-n 500 --trace_rounds 20) resist a noisy
  machine better than a few long ones.""",
    )
    parser.add_argument(
        "-b", "--minbytes", type=parse_bytes, default=8, help="smallest size in bytes (default 8)"
    )
    parser.add_argument(
        "-e",
        "--maxbytes",
        type=parse_bytes,
        default=64 * 1024**2,
        help="largest size in bytes, suffixes K/M/G (default 64M)",
    )
    parser.add_argument(
        "-f",
        "--stepfactor",
        type=int,
        default=2,
        help="multiply the size by this between rows (default 2)",
    )
    parser.add_argument(
        "-n", "--iters", type=int, default=20, help="timed iterations per size (default 20)"
    )
    parser.add_argument(
        "-w",
        "--warmup_iters",
        type=int,
        default=5,
        help="warm-up iterations per size, the checked one included (default 5)",
    )
    parser.add_argument(
        "--scale_above",
        type=parse_bytes,
        default=1024**2,
        help="shrink the iterations of sizes above this (default 1M; 0: never)",
    )
    parser.add_argument(
        "--op",
        type=parse_ops,
        default=("all_reduce",),
        help=f"{', '.join(OPS)}, a comma-separated list of them, or 'all' (default all_reduce)",
    )
    parser.add_argument("--backend", default="gloo", help="distcomm backend (default gloo)")
    parser.add_argument(
        "--nprocs",
        type=int,
        default=None,
        help="number of ranks to spawn (default 2); under an external launcher, the "
        "launcher's world size",
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="element type (default float32)"
    )
    parser.add_argument(
        "--compare",
        choices=("torch", "mpi4py", "cupy"),
        help="also run torch.distributed's gloo backend (torch), raw mpi4py "
        "calls (mpi4py, under mpiexec), or raw cupy.cuda.nccl calls "
        "(cupy, with --backend nccl) on the same buffers",
    )
    parser.add_argument(
        "--trace",
        choices=("on", "off", "both"),
        default="on",
        help="time with the flight recorder on, off, or both to show its cost (default on)",
    )
    parser.add_argument(
        "--trace_rounds",
        type=int,
        default=3,
        help="with --trace both, how many times each size is timed with the recorder on "
        "and off, alternating; the fastest of each is kept (default 3)",
    )
    parser.add_argument("--csv", metavar="PATH", help="also write every row to this CSV file")
    parser.add_argument(
        "--png",
        metavar="PATH",
        help="also plot time and bus bandwidth against size, ours and the peer's, per op "
        "(needs matplotlib; benchmarks/plots.py draws several runs' CSV files together)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=300.0,
        help="seconds any one collective or the start of the ranks may "
        "take; the parent gives up when no row arrives for this plus "
        f"{PARENT_MARGIN:.0f} s (default 300)",
    )
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.png:
        plots.require_matplotlib(parser)
    if args.trace_rounds < 1:
        parser.error(f"--trace_rounds must be >= 1, got {args.trace_rounds}")
    launcher = launched_by(parser)
    if launcher is not None:
        world = int(os.environ["WORLD_SIZE"]) if launcher != "mpiexec" else None
        if args.nprocs is not None and world is not None and args.nprocs != world:
            parser.error(
                f"--nprocs {args.nprocs}, but {launcher} started this process as one rank of "
                f"{world}: drop --nprocs (the launcher decides how many ranks run)"
            )
        if args.compare == "torch":
            parser.error(
                f"--compare torch spawns its ranks itself; under {launcher} it would need a "
                "store of its own: run the comparison without a launcher"
            )
        if args.compare == "mpi4py" and launcher != "mpiexec":
            parser.error(f"--compare mpi4py runs under mpiexec, not {launcher}")
    elif args.nprocs is None:
        args.nprocs = 2
    if args.nprocs is not None and args.nprocs < 1:
        parser.error(f"--nprocs must be >= 1, got {args.nprocs}")
    if args.minbytes < 1 or args.maxbytes < args.minbytes:
        parser.error(f"need 1 <= --minbytes <= --maxbytes, got {args.minbytes} and {args.maxbytes}")
    if args.stepfactor < 2:
        parser.error(f"--stepfactor must be >= 2, got {args.stepfactor}")
    if args.iters < 1 or args.warmup_iters < 0:
        parser.error(
            f"need --iters >= 1 and --warmup_iters >= 0, got {args.iters} and {args.warmup_iters}"
        )
    from distcomm.backends import get_backend_record

    try:
        reason = get_backend_record(args.backend).availability()
    except ValueError as exc:
        parser.error(f"--backend: {exc}")
    if reason:
        parser.error(f"--backend {args.backend!r} is not available here: {reason}")
    if args.backend == "nccl" and launcher is not None:
        parser.error(f"--backend nccl starts its own ranks, one per GPU: run it without {launcher}")
    if args.backend == "nccl":
        from distcomm.gpu import device_count

        if args.nprocs > device_count():
            parser.error(
                f"--backend nccl needs one GPU per rank: --nprocs {args.nprocs} but "
                f"{device_count()} GPU(s) here"
            )
    if args.compare == "cupy" and args.backend != "nccl":
        parser.error("--compare cupy needs --backend nccl (it compares GPU buffers)")
    if args.backend == "nccl" and args.compare not in (None, "cupy"):
        parser.error(
            f"--backend nccl uses GPU buffers: compare it with --compare cupy, not "
            f"--compare {args.compare}"
        )
    if args.compare == "torch":
        try:
            import torch.distributed as tdist
        except ImportError as exc:
            parser.error(
                f"--compare torch needs PyTorch, which is not importable in this "
                f"Python ({sys.executable}: {exc}); install it (pip install torch) "
                "or run without --compare"
            )
        if not (tdist.is_available() and tdist.is_gloo_available()):
            parser.error(
                "--compare torch: this PyTorch build has no torch.distributed gloo backend"
            )


def sizes(args: argparse.Namespace) -> list[int]:
    """-b, -b*f, -b*f^2, ... up to -e."""
    out, size = [], args.minbytes
    while size <= args.maxbytes:
        out.append(size)
        size *= args.stepfactor
    return out


def iterations(nbytes: int, iters: int, warmup: int, scale_above: int) -> tuple[int, int]:
    """(timed, warm-up) iterations for `nbytes`; warm-up is at least 1 (the checked run)."""
    if scale_above <= 0 or nbytes <= scale_above:
        return iters, max(1, warmup)
    factor = scale_above / nbytes
    return (
        min(iters, max(MIN_SCALED_ITERS, math.ceil(iters * factor))),
        max(1, math.ceil(warmup * factor)),
    )


# -- one op at one size, on one rank -----------------------------------------------------------


@dataclass
class Case:
    """One op at one size on one rank: how to run it, refill its buffers and check them.

    Attributes:
        size, count: the row's bytes and elements (see the --help epilog).
        fill: set the inputs (and clear the outputs) to the checked pattern.
        wrong: the number of wrong elements after one run from `fill`.
        ours, theirs: one call of distcomm's op, and of torch's on the same buffers.
        settle: after the check, give the buffers values that repeated runs keep finite
            (reductions in place would otherwise overflow to inf).
    """

    size: int
    count: int
    fill: Callable[[], None]
    wrong: Callable[[], int]
    ours: Callable[[], Any]
    theirs: Callable[[], Any] | None
    settle: Callable[[], None] = lambda: None


def _const(value: int, dtype: np.dtype) -> np.ndarray:
    """`value` in `dtype`, wrapping as integer arithmetic in that dtype does."""
    return np.array(value, dtype=np.int64).astype(dtype)


class Mpi4pyPeer:
    """The torch.distributed calls this benchmark makes, done with raw mpi4py buffer calls
    on the same numpy arrays (the `--compare mpi4py` peer)."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD.Dup()

    @staticmethod
    def view(array: np.ndarray) -> np.ndarray:
        return array

    def all_reduce(self, buf: np.ndarray) -> None:
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, self.MPI.SUM)

    def reduce(self, buf: np.ndarray, dst: int) -> None:
        if self.comm.rank == dst:
            self.comm.Reduce(self.MPI.IN_PLACE, buf, self.MPI.SUM, dst)
        else:
            self.comm.Reduce(buf, None, self.MPI.SUM, dst)

    def broadcast(self, buf: np.ndarray, src: int) -> None:
        self.comm.Bcast(buf, src)

    def all_gather_single(self, out: np.ndarray, inp: np.ndarray) -> None:
        self.comm.Allgather(inp, out)

    def reduce_scatter_single(self, out: np.ndarray, inp: np.ndarray) -> None:
        self.comm.Reduce_scatter_block(inp, out, self.MPI.SUM)

    def all_to_all_single(self, out: np.ndarray, inp: np.ndarray) -> None:
        self.comm.Alltoall(inp, out)

    def barrier(self) -> None:
        self.comm.Barrier()

    def destroy_process_group(self) -> None:
        self.comm.Free()


class CupyNcclPeer:
    """The same calls done with raw cupy.cuda.nccl on the caller's current stream, on a
    communicator of their own (the `--compare cupy` peer)."""

    def __init__(self, dist: Any, rank: int, n: int) -> None:
        import cupy
        from cupy.cuda import nccl

        self.cupy, self.nccl, self.rank, self.n = cupy, nccl, rank, n
        uid = [nccl.get_unique_id() if rank == 0 else None]
        dist.broadcast_object_list(uid, src=0)  # over the group's CPU backend
        self.comm = nccl.NcclCommunicator(n, uid[0], rank)
        self.token = cupy.zeros(1, cupy.float32)

    @staticmethod
    def view(array: Any) -> Any:
        return array

    def _type(self, array: Any) -> tuple[int, int]:
        return getattr(self.nccl, f"NCCL_{array.dtype.name.upper()}"), array.size

    def _stream(self) -> int:
        return self.cupy.cuda.get_current_stream().ptr

    def all_reduce(self, buf: Any) -> None:
        dt, count = self._type(buf)
        self.comm.allReduce(
            buf.data.ptr, buf.data.ptr, count, dt, self.nccl.NCCL_SUM, self._stream()
        )

    def reduce(self, buf: Any, dst: int) -> None:
        dt, count = self._type(buf)
        self.comm.reduce(
            buf.data.ptr, buf.data.ptr, count, dt, self.nccl.NCCL_SUM, dst, self._stream()
        )

    def broadcast(self, buf: Any, src: int) -> None:
        dt, count = self._type(buf)
        self.comm.broadcast(buf.data.ptr, buf.data.ptr, count, dt, src, self._stream())

    def all_gather_single(self, out: Any, inp: Any) -> None:
        dt, count = self._type(inp)
        self.comm.allGather(inp.data.ptr, out.data.ptr, count, dt, self._stream())

    def reduce_scatter_single(self, out: Any, inp: Any) -> None:
        dt, count = self._type(out)
        self.comm.reduceScatter(
            inp.data.ptr, out.data.ptr, count, dt, self.nccl.NCCL_SUM, self._stream()
        )

    def all_to_all_single(self, out: Any, inp: Any) -> None:
        dt, count = self._type(inp)
        per, stream, step = count // self.n, self._stream(), inp.itemsize * (count // self.n)
        self.nccl.groupStart()
        for peer in range(self.n):
            self.comm.send(inp.data.ptr + peer * step, per, dt, peer, stream)
            self.comm.recv(out.data.ptr + peer * step, per, dt, peer, stream)
        self.nccl.groupEnd()

    def barrier(self) -> None:
        self.comm.allReduce(
            self.token.data.ptr,
            self.token.data.ptr,
            1,
            self.nccl.NCCL_FLOAT32,
            self.nccl.NCCL_SUM,
            self._stream(),
        )
        self.cupy.cuda.get_current_stream().synchronize()

    def destroy_process_group(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()
        self.comm.destroy()


def _cupy_version() -> str:
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError:
        return "CuPy not installed"
    from distcomm.gpu.nccl import parse_version

    return f"CuPy {cupy.__version__}, NCCL {'.'.join(map(str, parse_version(nccl.get_version())))}"


def _mpi4py_version() -> str:
    try:
        import mpi4py
    except ImportError:
        return "(not installed)"
    return mpi4py.__version__


def make_case(
    op: str, nbytes: int, dtype: np.dtype, rank: int, n: int, dist: Any, tdist: Any, xp: Any = np
) -> Case | None:
    """The Case of `op` at `nbytes`, or None when the size holds too few elements.

    `tdist` is torch.distributed, a `Mpi4pyPeer`, a `CupyNcclPeer`, or None; `xp` is the
    array module of the buffers (numpy, or cupy for GPU buffers).
    """
    count = nbytes // dtype.itemsize
    if op in SPLIT_OPS:
        count -= count % n
    if op != "barrier" and count == 0:
        return None
    per = count // n
    torch = None
    raw = isinstance(tdist, (Mpi4pyPeer, CupyNcclPeer))
    if tdist is not None and not raw:
        import torch

    def view(array: np.ndarray) -> Any:
        if raw:
            return array
        return torch.from_numpy(array) if torch is not None else None

    if op == "barrier":
        if xp is not np:  # the GPU backend's barrier (a plain barrier runs on gloo)

            def ours() -> None:
                dist.barrier(device_ids=[xp.cuda.Device().id])
        else:
            ours = dist.barrier
        return Case(0, 0, lambda: None, lambda: 0, ours, tdist.barrier if tdist else None)
    if op in ("all_reduce", "reduce"):
        buf = xp.empty(count, dtype)
        total = _const(n * (n + 1) // 2, dtype).item()
        checked = op == "all_reduce" or rank == 0
        if op == "all_reduce":
            ours, t = (lambda: dist.all_reduce(buf)), view(buf)
            theirs = (lambda: tdist.all_reduce(t)) if tdist else None
        else:
            ours, t = (lambda: dist.reduce(buf, dst=0)), view(buf)
            theirs = (lambda: tdist.reduce(t, dst=0)) if tdist else None
        return Case(
            count * dtype.itemsize,
            count,
            lambda: buf.fill(rank + 1),
            lambda: int(xp.count_nonzero(buf != total)) if checked else 0,
            ours,
            theirs,
            settle=lambda: buf.fill(0),
        )
    if op == "broadcast":
        buf = xp.empty(count, dtype)
        pattern = xp.asarray((np.arange(count) % 97 + 1).astype(dtype))
        t = view(buf)

        def fill() -> None:
            buf[...] = pattern if rank == 0 else 0

        return Case(
            count * dtype.itemsize,
            count,
            fill,
            lambda: int(xp.count_nonzero(buf != pattern)),
            lambda: dist.broadcast(buf, src=0),
            (lambda: tdist.broadcast(t, src=0)) if tdist else None,
        )
    if op == "all_gather":
        inp, out = xp.empty(per, dtype), xp.empty(count, dtype)
        expected = xp.asarray(np.repeat(np.arange(1, n + 1), per).astype(dtype))
        ti, to = view(inp), view(out)

        def fill() -> None:
            inp.fill(rank + 1)
            out.fill(0)

        # torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated)
        gather = getattr(tdist, "all_gather_single", None) or getattr(
            tdist, "all_gather_into_tensor", None
        )
        return Case(
            count * dtype.itemsize,
            count,
            fill,
            lambda: int(xp.count_nonzero(out != expected)),
            lambda: dist.all_gather_single(out, inp),
            (lambda: gather(to, ti)) if tdist else None,
        )
    if op == "reduce_scatter":
        # rank q's piece j holds (q+1)(j+1); rank r gets sum over q: (r+1) n(n+1)/2
        inp, out = xp.empty(count, dtype), xp.empty(per, dtype)
        total = _const((rank + 1) * n * (n + 1) // 2, dtype).item()
        ti, to = view(inp), view(out)

        def fill() -> None:
            inp.reshape(n, per)[...] = xp.asarray(
                ((rank + 1) * np.arange(1, n + 1)).astype(dtype)[:, None]
            )
            out.fill(0)

        # torch >= 2.13 names it reduce_scatter_single (reduce_scatter_tensor is deprecated)
        scatter = getattr(tdist, "reduce_scatter_single", None) or getattr(
            tdist, "reduce_scatter_tensor", None
        )
        return Case(
            count * dtype.itemsize,
            count,
            fill,
            lambda: int(xp.count_nonzero(out != total)),
            lambda: dist.reduce_scatter_single(out, inp),
            (lambda: scatter(to, ti)) if tdist else None,
        )
    if op == "all_to_all":
        # rank q's piece j holds q*n + j + 1; rank r's piece j arrives from rank j
        inp, out = xp.empty(count, dtype), xp.empty(count, dtype)
        sent = xp.asarray((rank * n + np.arange(n) + 1).astype(dtype)[:, None])
        expected = xp.asarray(np.repeat(np.arange(n) * n + rank + 1, per).astype(dtype))
        ti, to = view(inp), view(out)

        def fill() -> None:
            inp.reshape(n, per)[...] = sent
            out.fill(0)

        return Case(
            count * dtype.itemsize,
            count,
            fill,
            lambda: int(xp.count_nonzero(out != expected)),
            lambda: dist.all_to_all_single(out, inp),
            (lambda: tdist.all_to_all_single(to, ti)) if tdist else None,
        )
    raise ValueError(f"unknown op {op!r}")


def measure(
    run: Callable[[], Any],
    barrier: Callable[[], Any],
    case: Case,
    iters: int,
    warmup: int,
    sync: Callable[[], Any] = lambda: None,
) -> tuple[float, int]:
    """(mean seconds per iteration on this rank, wrong elements of the checked run).

    `sync` waits for the GPU work queued so far (GPU buffers); it ends the timed loop.
    """
    case.fill()
    run()
    wrong = case.wrong()
    case.settle()
    for _ in range(warmup - 1):
        run()
    sync()
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    sync()
    return (time.perf_counter() - start) / iters, wrong


# -- the ranks ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What every rank runs (sent to the spawned ranks)."""

    ops: tuple[str, ...]
    sizes: tuple[int, ...]
    dtype: str
    backend: str
    nprocs: int
    iters: int
    warmup: int
    scale_above: int
    timeout: float
    torch_port: int | None
    compare: str | None = None
    trace: str = "on"
    trace_rounds: int = 3


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _rank_main(
    rank: int, plan: Plan, env: dict[str, str], conn: multiprocessing.connection.Connection
) -> None:
    """A spawned rank: initialise both libraries, run the plan; rank 0 reports each row."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and kills us
    os.environ.update(env)
    try:
        import distcomm as dist

        xp, sync = np, None
        if plan.backend == "nccl":
            import cupy

            from distcomm import gpu

            gpu.set_device(rank % gpu.device_count())
            xp, sync = cupy, cupy.cuda.get_current_stream().synchronize
        spec = "cpu:gloo,cuda:nccl" if plan.backend == "nccl" else plan.backend
        dist.init_process_group(spec, init_method="env://", timeout=plan.timeout)
        tdist: Any = CupyNcclPeer(dist, rank, plan.nprocs) if plan.compare == "cupy" else None
        if plan.torch_port is not None:
            import torch.distributed as tdist

            limit = timedelta(seconds=plan.timeout)
            store = tdist.TCPStore(
                LOOPBACK, plan.torch_port, plan.nprocs, is_master=False, timeout=limit
            )
            tdist.init_process_group(
                "gloo", store=store, rank=rank, world_size=plan.nprocs, timeout=limit
            )
        conn.send(("ready", None))
        dtype = np.dtype(plan.dtype)
        for op in plan.ops:
            for nbytes in plan.sizes if op != "barrier" else (0,):
                case = make_case(op, nbytes, dtype, rank, plan.nprocs, dist, tdist, xp)
                if case is None:
                    if rank == 0:
                        conn.send(("skip", (op, nbytes)))
                    continue
                row = _run_case(op, case, plan, dist, tdist, sync)
                if rank == 0:
                    conn.send(("row", row))
        if tdist is not None:
            tdist.destroy_process_group()
        dist.destroy_process_group()
        conn.send(("done", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def set_recorder(dist: Any, on: bool) -> None:
    """Turn the default group's flight recorder on (DISTCOMM_TRACE_BUFFER entries) or off."""
    from distcomm import config
    from distcomm.trace.recorder import Recorder

    world = dist.group.WORLD
    if (world.recorder.size > 0) != on:
        world.recorder = Recorder.create(config.load().trace_buffer if on else 0)


def _run_case(
    op: str, case: Case, plan: Plan, dist: Any, tdist: Any, sync: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """Time ours, then the peer's, and combine every rank's numbers (valid on rank 0)."""
    n = plan.nprocs
    iters, warmup = iterations(case.size, plan.iters, plan.warmup, plan.scale_above)
    sync = sync or (lambda: None)
    set_recorder(dist, plan.trace != "off")
    ours, wrong = measure(case.ours, dist.barrier, case, iters, warmup, sync)
    off = math.nan
    if plan.trace == "both":
        ons, offs = [ours], []
        for i in range(plan.trace_rounds):
            set_recorder(dist, False)
            offs.append(measure(case.ours, dist.barrier, case, iters, warmup, sync)[0])
            set_recorder(dist, True)
            if i < plan.trace_rounds - 1:
                ons.append(measure(case.ours, dist.barrier, case, iters, warmup, sync)[0])
        ours, off = min(ons), min(offs)
    theirs, their_wrong = math.nan, 0
    if case.theirs is not None:
        theirs, their_wrong = measure(case.theirs, tdist.barrier, case, iters, warmup, sync)
    mine = np.array([ours, wrong, theirs, their_wrong, off], dtype=np.float64)
    every = np.empty(n * mine.size, dtype=np.float64)
    dist.all_gather_single(every, mine)
    every = every.reshape(n, mine.size)
    time_us = float(every[:, 0].max()) * 1e6
    algbw = case.size / time_us / 1e3 if time_us > 0 else 0.0
    row: dict[str, Any] = dict(
        op=op,
        nprocs=n,
        dtype=plan.dtype,
        backend=plan.backend,
        size=case.size,
        count=case.count,
        iters=iters,
        time_us=time_us,
        algbw=algbw,
        busbw=algbw * bus_factor(op, n),
        wrong=int(every[:, 1].sum()),
        peer_time_us="",
        peer_algbw="",
        peer_busbw="",
        peer_wrong="",
        ratio="",
        trace_off_us="",
        trace_cost_us="",
    )
    if plan.trace == "both":
        off_us = float(every[:, 4].max()) * 1e6
        row.update(trace_off_us=off_us, trace_cost_us=time_us - off_us)
    if case.theirs is not None:
        torch_us = float(every[:, 2].max()) * 1e6
        peer_algbw = case.size / torch_us / 1e3 if torch_us > 0 else 0.0
        row.update(
            peer_time_us=torch_us,
            peer_algbw=peer_algbw,
            peer_busbw=peer_algbw * bus_factor(op, n),
            peer_wrong=int(every[:, 3].sum()),
            ratio=torch_us / time_us,
        )
    return row


# -- the parent: spawn, supervise, print --------------------------------------------------------


def copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """This machine's memory-copy bandwidth in bytes/s: the yardstick for large messages."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def _gpu_names() -> str:
    """The name of each GPU CuPy sees (queried without making a context current here)."""
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    names = [cupy.cuda.runtime.getDeviceProperties(i)["name"] for i in range(count)]
    return ", ".join(
        f"{i}: {n.decode() if isinstance(n, bytes) else n}" for i, n in enumerate(names)
    )


class Report:
    """Prints the tables as rows arrive and keeps the rows for the CSV file."""

    def __init__(
        self, args: argparse.Namespace, torch_version: str | None, nprocs: int | None = None
    ) -> None:
        self.args = args
        self.torch_version = torch_version
        self.nprocs = nprocs or args.nprocs
        #: the peer's name in headers, and its full description
        self.peer = args.compare or ""
        self.peer_label = (
            f"torch {torch_version} gloo"
            if args.compare == "torch"
            else f"raw mpi4py {_mpi4py_version()}"
            if args.compare == "mpi4py"
            else f"raw cupy.cuda.nccl ({_cupy_version()})"
            if args.compare
            else ""
        )
        self.rows: list[dict[str, Any]] = []
        self.op: str | None = None

    def host(self) -> None:
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
        import distcomm

        load = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
        print(
            f"# host: {platform.node()} {platform.system()} {platform.machine()}, "
            f"{os.cpu_count()} cores ({usable} usable), {load} at start, python "
            f"{platform.python_version()}, numpy {np.__version__}, distcomm "
            f"{distcomm.__version__}"
            + (f", torch {self.torch_version}" if self.torch_version else "")
        )
        print(
            f"# memory copy bandwidth (numpy copy of 64 MiB, one core, best of 5): "
            f"{copy_bandwidth() / 1e9:.2f} GB/s",
            flush=True,
        )
        if self.args.backend == "nccl":
            print(f"# GPUs: {_gpu_names()}; {_cupy_version()}", flush=True)
        a = self.args
        print(
            f"# iterations: -n {a.iters} -w {a.warmup_iters}"
            + (f", scaled down above {a.scale_above} bytes" if a.scale_above else "")
            + "; time = max over ranks of the mean time per iteration",
            flush=True,
        )

    def _start_op(self, op: str) -> None:
        if op == self.op:
            return
        self._finish_op()
        self.op = op
        a = self.args
        peer = f", compared with {self.peer_label}" if a.compare else ""
        print(f"#\n# op {op}, nprocs {self.nprocs}, dtype {a.dtype}, backend {a.backend}{peer}")
        head = (
            f"#{'size(B)':>11} {'count':>10} {'iters':>5} {'time(us)':>11} "
            f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6}"
        )
        if a.compare:
            head += (
                f"  | {self.peer + '(us)':>11} {'busbw(GB/s)':>11} {'#wrong':>6} "
                f"{self.peer + '/ours':>11}"
            )
        if a.trace == "both":
            head += f"  | {'off(us)':>9} {'rec(us)':>8}"
        print(head)

    def skip(self, op: str, nbytes: int) -> None:
        self._start_op(op)
        per = "rank" if op in SPLIT_OPS else "buffer"
        print(
            f"#{nbytes:>11} skipped: less than one {self.args.dtype} element per {per}", flush=True
        )

    def add(self, row: dict[str, Any]) -> None:
        self._start_op(row["op"])
        self.rows.append(row)
        line = (
            f"{row['size']:>12} {row['count']:>10} {row['iters']:>5} "
            f"{row['time_us']:>11.1f} {row['algbw']:>11.3f} {row['busbw']:>11.3f} "
            f"{row['wrong']:>6}"
        )
        if self.args.compare:
            line += (
                f"  | {row['peer_time_us']:>11.1f} {row['peer_busbw']:>11.3f} "
                f"{row['peer_wrong']:>6} {row['ratio']:>11.2f}"
            )
        if self.args.trace == "both":
            line += f"  | {row['trace_off_us']:>9.2f} {row['trace_cost_us']:>8.2f}"
        print(line, flush=True)

    def _finish_op(self) -> None:
        rows = [r for r in self.rows if r["op"] == self.op]
        if not rows:
            return
        line = f"# avg bus bandwidth: {np.mean([r['busbw'] for r in rows]):.3f} GB/s"
        if self.args.compare:
            ratios = [r["ratio"] for r in rows if r["ratio"] != "" and r["ratio"] > 0]
            line += (
                f"; {self.peer_label} {np.mean([r['peer_busbw'] for r in rows]):.3f} "
                f"GB/s; geometric mean of {self.peer}/ours "
                f"{math.exp(np.mean(np.log(ratios))):.2f}"
            )
        print(line, flush=True)

    def close(self, finished: bool) -> int:
        """Finish the last table, write the CSV; the number of rows with wrong results."""
        self._finish_op()
        bad = sum(1 for r in self.rows if r["wrong"] or r["peer_wrong"] not in ("", 0))
        verdict = (
            "the run did not finish (see the error)"
            if not finished
            else "all checks passed"
            if not bad
            else "SOME CHECKS FAILED"
        )
        print(f"# {len(self.rows)} rows, {bad} with wrong results: {verdict}", flush=True)
        if self.args.csv:
            plots.write_csv(self.rows, self.args.csv, FIELDS)
        if self.args.png and self.rows:
            a = self.args
            peer = f" beside {self.peer_label}" if a.compare else ""
            plots.collectives(
                self.rows, a.png, f"distcomm {a.backend}{peer}: {self.nprocs} ranks, {a.dtype}"
            )
        return bad


def supervise(procs: list[Any], conns: list[Any], report: Report, timeout: float) -> bool:
    """Relay rank 0's rows until every rank is done; False (errors printed) on any failure.

    The deadline restarts with every message: it bounds the wait for progress, not the run.
    """
    n = len(procs)
    pending = set(range(n))
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout + PARENT_MARGIN
    while pending:
        now = time.monotonic()
        if now >= deadline:
            if not errors:
                errors[-1] = (
                    f"no rank reported anything for {timeout + PARENT_MARGIN:.0f} s "
                    f"(--timeout {timeout:g} + {PARENT_MARGIN:.0f}); rank(s) "
                    f"{', '.join(map(str, sorted(pending)))} still running"
                )
            break
        waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        ready = multiprocessing.connection.wait(waitables, timeout=deadline - now)
        for r in sorted(pending):
            if conns[r] in ready:
                try:
                    kind, payload = conns[r].recv()
                except (EOFError, OSError):
                    kind, payload = "died", None
                if kind == "row":
                    report.add(payload)
                elif kind == "skip":
                    report.skip(*payload)
                elif kind == "error":
                    errors[r] = payload.rstrip()
                if kind in ("done", "error", "died"):
                    pending.discard(r)
                if kind == "died":
                    procs[r].join(1.0)
                    errors[r] = f"exited without reporting: {exit_description(procs[r].exitcode)}"
                if not errors:
                    deadline = time.monotonic() + timeout + PARENT_MARGIN
            elif not procs[r].is_alive() and not conns[r].poll():
                pending.discard(r)
                errors[r] = f"exited without reporting: {exit_description(procs[r].exitcode)}"
        if errors:
            deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE)
    if not errors:
        return True
    # a rank that died without a word is the likely cause; the others' errors follow from it
    silent = [r for r in errors if r >= 0 and errors[r].startswith("exited without")]
    first = silent[0] if silent else next(iter(errors))
    print(
        f"\nerror: the benchmark failed (first failure: "
        f"{'the parent' if first < 0 else f'rank {first}'}); every rank is stopped. "
        "Report of each rank:",
        file=sys.stderr,
    )
    for r in ([-1] if -1 in errors else []) + list(range(n)):
        text = errors.get(
            r,
            "still running when stopped (hung, or waiting on a failed rank?)"
            if r in pending
            else "finished",
        )
        print(f"### {'parent' if r < 0 else f'rank {r}/{n}'}\n{text}", file=sys.stderr)
    return False


def stop(procs: list[Any]) -> None:
    """Kill every rank still alive and reap them all."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5.0)


def _mpi_rank() -> int | None:
    """This process's rank when an MPI launcher started it, else None."""
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


#: what a launcher that starts every rank itself (distcomm-run, torchrun, a script) sets
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by(parser: argparse.ArgumentParser) -> str | None:
    """Which external launcher started this process as one of its ranks, if any:
    "distcomm-run", "env://" (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) or
    "mpiexec". A partial set of the env:// variables is a usage error."""
    present = [name for name in LAUNCH_VARS if name in os.environ]
    if "RANK" not in os.environ and _mpi_rank() is not None:
        return "mpiexec"
    if not present:
        return None
    if len(present) < len(LAUNCH_VARS):
        missing = ", ".join(name for name in LAUNCH_VARS if name not in os.environ)
        parser.error(
            f"the environment sets {', '.join(present)} but not {missing}: set all four (as "
            "a launcher does, and each process is one rank) or none (the benchmark then "
            "spawns --nprocs ranks on this host)"
        )
    if not os.environ["WORLD_SIZE"].isdigit() or not os.environ["RANK"].isdigit():
        parser.error(
            f"RANK={os.environ['RANK']!r} and WORLD_SIZE={os.environ['WORLD_SIZE']!r} must "
            "be integers"
        )
    return "distcomm-run" if os.environ.get("DISTCOMM_RUN_ID") else "env://"


def _hosts(dist: Any) -> str:
    """Which ranks run on which host: "host-a: 0-3; host-b: 4-7" (a collective)."""
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, platform.node())
    by_host: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        by_host.setdefault(name, []).append(rank)

    def ranks(members: list[int]) -> str:
        if members == list(range(members[0], members[-1] + 1)) and len(members) > 2:
            return f"{members[0]}-{members[-1]}"
        return ",".join(map(str, members))

    return "; ".join(f"{name}: {ranks(members)}" for name, members in by_host.items())


def launched_main(args: argparse.Namespace, launcher: str) -> int:
    """Every process started by an external launcher is one rank; rank 0 prints."""
    import distcomm as dist

    dist.init_process_group(args.backend, timeout=args.timeout)
    rank, n = dist.get_rank(), dist.get_world_size()
    hosts = _hosts(dist)
    peer = Mpi4pyPeer() if args.compare == "mpi4py" else None
    plan = Plan(
        args.op,
        tuple(sizes(args)),
        args.dtype,
        args.backend,
        n,
        args.iters,
        args.warmup_iters,
        args.scale_above,
        args.timeout,
        None,
        trace=args.trace,
        trace_rounds=args.trace_rounds,
    )
    report = Report(args, None, nprocs=n) if rank == 0 else None
    if report is not None:
        report.host()
        print(f"# {n} ranks started by {launcher}, by host: {hosts}", flush=True)
    dtype = np.dtype(args.dtype)
    for op in plan.ops:
        for nbytes in plan.sizes if op != "barrier" else (0,):
            case = make_case(op, nbytes, dtype, rank, n, dist, peer)
            if case is None:
                if report is not None:
                    report.skip(op, nbytes)
                continue
            row = _run_case(op, case, plan, dist, peer)
            if report is not None:
                report.add(row)
    bad = report.close(True) if report is not None else 0
    if peer is not None:
        peer.destroy_process_group()
    dist.destroy_process_group()
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    launcher = launched_by(parser)
    if launcher is not None:
        return launched_main(args, launcher)
    if args.backend == "mpi" or args.compare == "mpi4py":
        parser.error(
            "--backend mpi and --compare mpi4py run under an MPI launcher: "
            "mpiexec -n 2 python benchmarks/collectives.py --backend mpi "
            "--compare mpi4py"
        )
    from distcomm import TCPStore

    torch_store, torch_version = None, None
    store = TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False, timeout=args.timeout)
    procs: list[Any] = []
    conns: list[Any] = []
    try:
        if args.compare == "torch":
            import torch
            import torch.distributed as tdist

            torch_version = torch.__version__
            torch_store = tdist.TCPStore(
                LOOPBACK,
                0,
                args.nprocs,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=args.timeout),
            )
        plan = Plan(
            args.op,
            tuple(sizes(args)),
            args.dtype,
            args.backend,
            args.nprocs,
            args.iters,
            args.warmup_iters,
            args.scale_above,
            args.timeout,
            torch_store.port if torch_store is not None else None,
            args.compare,
            trace=args.trace,
            trace_rounds=args.trace_rounds,
        )
        base = {
            "MASTER_ADDR": LOOPBACK,
            "MASTER_PORT": str(store.port),
            "WORLD_SIZE": str(args.nprocs),
            "LOCAL_WORLD_SIZE": str(args.nprocs),
            "DISTCOMM_USE_AGENT_STORE": "1",
            "DISTCOMM_SOCKET_IFNAME": "lo",
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        report = Report(args, torch_version)
        report.host()
        ctx = multiprocessing.get_context("spawn")
        for rank in range(args.nprocs):
            parent_end, child_end = ctx.Pipe(duplex=False)
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, plan, env, child_end),
                name=f"bench-rank-{rank}",
                daemon=True,
            )
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        ok = supervise(procs, conns, report, args.timeout)
        bad = report.close(ok)
        return 0 if ok and not bad else 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every rank", file=sys.stderr)
        return 130
    finally:
        stop(procs)
        store.close()
        del torch_store


if __name__ == "__main__":
    sys.exit(main())
