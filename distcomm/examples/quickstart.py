"""Data-parallel SGD on a synthetic linear regression: distcomm's quickstart.

Every rank holds one shard of a dataset drawn from a fixed seed and starts from rank
0's random weights (broadcast). At each step it computes its shard's gradient and
averages it with the other ranks' (all_reduce with ReduceOp.AVG), so every rank takes
the same step. At the end the ranks compare their weights (all_gather) and rank 0
reports how close they came to the true weights.

Run it on N local ranks, which the script starts itself::

    python -m distcomm.examples.quickstart --nprocs 4

or as one worker of a job whose launcher sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT (rank 0 then hosts the store there; PORT is any free TCP port)::

    export MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT WORLD_SIZE=2
    RANK=0 python -m distcomm.examples.quickstart & RANK=1 python -m distcomm.examples.quickstart

or as one rank of an MPI or Slurm job, which init_process_group finds by itself::

    mpiexec -n 4 python -m distcomm.examples.quickstart
    srun -n 4 python -m distcomm.examples.quickstart    # in a Slurm allocation

The exit status is 0 only when the final check passes: identical weights on every rank,
within 0.01 of the true ones.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time

import numpy as np

import distcomm as dist
from distcomm.bootstrap import detect_environment
from distcomm.procutil import set_pdeathsig

SEED = 0
SAMPLES = 4096  # the whole dataset; rank r holds rows r, r + world_size, r + 2 world_size...
FEATURES = 16
NOISE = 0.01
TOLERANCE = 0.01  # the largest accepted |recovered - true| weight
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: launchers whose every process is one rank: MPI's (their rank variables) and srun's
RANK_LAUNCHERS = ("Open MPI", "PMIx", "MPICH")


__all__ = ["main", "train"]


def make_shard(rank: int, world_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This rank's rows (x, y) of the dataset, and the true weights (the same everywhere)."""
    rng = np.random.default_rng(SEED)
    true_w = rng.normal(size=FEATURES)
    x = rng.normal(size=(SAMPLES, FEATURES))
    y = x @ true_w + NOISE * rng.normal(size=SAMPLES)
    return x[rank::world_size], y[rank::world_size], true_w


def mean_loss(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    """The mean squared error over every rank's shard (a collective: all ranks call it)."""
    loss = np.array([np.mean((x @ w - y) ** 2)])
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return float(loss[0])


def train(args: argparse.Namespace) -> bool:
    """Join the job (RANK, WORLD_SIZE, MASTER_* from the environment), train, check."""
    dist.init_process_group(args.backend, timeout=args.timeout)
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        x, y, true_w = make_shard(rank, world_size)
        # each rank draws its own weights; broadcasting rank 0's makes them all start equal
        w = np.random.default_rng([SEED, 1, rank]).normal(size=FEATURES)
        dist.broadcast(w, src=0)
        if rank == 0:
            print(
                f"{world_size} rank(s), backend {dist.get_backend()}, {len(y)} samples "
                f"and {FEATURES} features per rank, {args.steps} steps, lr {args.lr}"
            )
        for step in range(args.steps):
            if step % args.print_every == 0:
                loss = mean_loss(x, y, w)
                if rank == 0:
                    print(f"step {step:5d}  loss {loss:.6f}")
            grad = 2.0 / len(y) * (x.T @ (x @ w - y))  # gradient of this shard's loss
            dist.all_reduce(grad, op=dist.ReduceOp.AVG)  # ... averaged over all shards
            w -= args.lr * grad
        loss = mean_loss(x, y, w)
        gathered = [np.empty_like(w) for _ in range(world_size)]
        dist.all_gather(gathered, w)
        identical = all(np.array_equal(other, w) for other in gathered)
        error = float(np.max(np.abs(w - true_w)))
        ok = identical and error < TOLERANCE
        if rank == 0:
            print(
                f"final loss {loss:.6f}; max |w - w_true| {error:.2e} (tolerance "
                f"{TOLERANCE}); weights identical on all ranks: {identical}"
            )
            print("OK" if ok else "FAILED")
        return ok
    finally:
        dist.destroy_process_group()


# -- starting the ranks ourselves (--nprocs) ---------------------------------------------------


def _spawned_rank(rank: int, env: dict[str, str], args: argparse.Namespace) -> None:
    """A rank started by `spawn`: dies with the parent and leaves Ctrl-C to it."""
    set_pdeathsig(signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    sys.exit(0 if train(args) else 1)


def spawn(args: argparse.Namespace) -> int:
    """Host the store, start `args.nprocs` ranks on this host, wait; the exit status."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=args.timeout
    )
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(args.nprocs),
        "LOCAL_WORLD_SIZE": str(args.nprocs),
        "DISTCOMM_USE_AGENT_STORE": "1",
        "DISTCOMM_SOCKET_IFNAME": "lo",
    }
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_spawned_rank, args=(rank, env, args), name=f"rank {rank}")
        for rank in range(args.nprocs)
    ]
    deadline, status = time.monotonic() + args.timeout, 0
    try:
        for proc in procs:
            proc.start()
        running = list(procs)
        while running and time.monotonic() < deadline:
            multiprocessing.connection.wait(
                [p.sentinel for p in running], timeout=deadline - time.monotonic()
            )
            for proc in [p for p in running if p.exitcode is not None]:
                running.remove(proc)
                if proc.exitcode != 0 and not status:
                    how = (
                        f"was killed by signal {-proc.exitcode}"
                        if proc.exitcode < 0
                        else f"exited with status {proc.exitcode}"
                    )
                    print(f"quickstart: {proc.name} {how}; stopping the others", file=sys.stderr)
                    status, deadline = 1, min(deadline, time.monotonic() + 5.0)
        if running and not status:
            names = ", ".join(p.name for p in running)
            print(
                f"quickstart: {names} still running after {args.timeout:g} s; stopping every rank",
                file=sys.stderr,
            )
            status = 1
        return status
    except KeyboardInterrupt:
        print("quickstart: interrupted; stopping every rank", file=sys.stderr)
        return 130
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            if proc.pid is not None:
                proc.join(5.0)
        store.close()


def launcher_rank() -> str | None:
    """ "rank R (LAUNCHER)" when an MPI launcher or srun started this process as one rank of
    a job, else None (a Slurm batch script is not a rank: it runs once, whatever the job's
    task count)."""
    info = detect_environment(with_master=False)
    if info.rank is None or not (info.srun or info.launcher in RANK_LAUNCHERS):
        return None
    return f"rank {info.rank} ({info.source_of('rank')}, {info.launcher})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--nprocs",
        type=int,
        default=None,
        help="start this many ranks on this host (default 2); not when "
        "launched with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set",
    )
    parser.add_argument("--steps", type=int, default=100, help="SGD steps (default 100)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    parser.add_argument(
        "--backend",
        default=None,
        help="distcomm backend (default: distcomm's default for CPU arrays)",
    )
    parser.add_argument(
        "--print_every",
        type=int,
        default=10,
        help="print the loss every this many steps (default 10)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds any wait may take, and the whole run with --nprocs (default 120)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.print_every < 1 or args.timeout <= 0:
        parser.error("--steps, --print_every and --timeout must be positive")
    present = [name for name in LAUNCH_VARS if name in os.environ]
    try:
        rank_of_job = None if "RANK" in os.environ else launcher_rank()
    except ValueError as exc:
        parser.error(f"the launcher's variables are malformed: {exc}")
    if rank_of_job is not None:
        # under mpiexec/srun: this process is one rank; init_process_group finds the rest
        if args.nprocs is not None:
            parser.error(
                f"--nprocs starts ranks itself, but this process already is "
                f"{rank_of_job} of a launched job: drop --nprocs"
            )
        return 0 if train(args) else 1
    if present and len(present) < len(LAUNCH_VARS):
        missing = ", ".join(name for name in LAUNCH_VARS if name not in os.environ)
        parser.error(
            f"the environment sets {', '.join(present)} but not {missing}: set all "
            "four (as a launcher does) or none (then use --nprocs)"
        )
    if present:
        if args.nprocs is not None:
            parser.error(
                f"--nprocs starts ranks itself, but this process already is rank "
                f"{os.environ['RANK']} of a launched job: drop --nprocs"
            )
        return 0 if train(args) else 1
    args.nprocs = 2 if args.nprocs is None else args.nprocs
    if args.nprocs < 1:
        parser.error(f"--nprocs must be >= 1, got {args.nprocs}")
    return spawn(args)


if __name__ == "__main__":
    sys.exit(main())
