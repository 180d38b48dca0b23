"""The worker of benchmarks/recovery.py's restart modes: a plain data-parallel numpy SGD loop
with a checkpoint, for distcomm (run by ``distcomm-run``) or torch.distributed (gloo, CPU
tensors; run by ``torchrun``).

It is distcomm/examples/resilient_sgd.py's loop (the same global batch per step, split
among the ranks, gradients summed with all_reduce, the same learning rate) without the
per-step vote: a lost worker fails the step's all_reduce, the launcher restarts every
worker, and the loop starts again from its checkpoint. Rank 0 writes the weights and the
committed step count to --checkpoint every --checkpoint-every steps (a temporary file, then
a rename); every rank loads it at start when it is there.

The worker with RANK --crash-rank kills itself (SIGKILL) at step --crash-step on the first
attempt only (TORCHELASTIC_RESTART_COUNT "0"). With --events FILE every rank appends JSON
lines as resilient_sgd.py does: ``{"kill": t, "step": s}`` from the dying worker and
``{"t": time, "step": n, "size": world, "restart": k}`` per committed step (n: the committed
count; k: TORCHELASTIC_RESTART_COUNT, which resilient_sgd.py's lines do not carry).

Run by hand::

    distcomm-run --standalone --nproc_per_node=4 --max-restarts 1 \\
        benchmarks/recovery_worker.py --impl distcomm --checkpoint /tmp/ckpt.npz \\
        --crash-rank 1 --crash-step 25 --events /tmp/events.jsonl
    torchrun --standalone --nproc_per_node=4 --max-restarts 1 \\
        benchmarks/recovery_worker.py --impl torch --checkpoint /tmp/ckpt.npz ...

Imports only numpy and the --impl's package (a torch worker never imports distcomm).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import numpy as np

FEATURES = 16
BATCH = 64  # the global batch, split among the ranks


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """Step `step`'s global batch (the same on every rank; resilient_sgd.py's)."""
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, FEATURES))
    true_w = np.linspace(-1.0, 1.0, FEATURES)
    return x, x @ true_w + 0.01 * rng.standard_normal(BATCH)


def load_checkpoint(path: str) -> tuple[np.ndarray, int]:
    """(weights, committed steps) from `path`, or zeros and 0 when there is none."""
    if path and os.path.exists(path):
        with np.load(path) as data:
            return data["w"].copy(), int(data["step"])
    return np.zeros(FEATURES), 0


def save_checkpoint(path: str, w: np.ndarray, step: int) -> None:
    """Write atomically: a reader sees the old checkpoint or the new one, never half."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.savez(f, w=w, step=np.int64(step))
    os.replace(tmp, path)


class Numpy:
    """distcomm: numpy arrays in, all_reduce in place."""

    def __init__(self, backend: str) -> None:
        import distcomm

        self.dist = distcomm
        distcomm.init_process_group(backend)

    def all_reduce(self, grad: np.ndarray) -> np.ndarray:
        self.dist.all_reduce(grad)
        return grad


class Torch:
    """torch.distributed on gloo: the gradient as a CPU tensor (sharing the array's memory)."""

    def __init__(self, backend: str) -> None:
        import torch
        import torch.distributed

        self.torch, self.dist = torch, torch.distributed
        torch.distributed.init_process_group(backend)

    def all_reduce(self, grad: np.ndarray) -> np.ndarray:
        self.dist.all_reduce(self.torch.from_numpy(grad))
        return grad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=("distcomm", "torch"), default="distcomm")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--crash-rank", type=int, default=-1, help="this RANK kills itself")
    parser.add_argument("--crash-step", type=int, default=-1, help="... at this step")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds of work per step")
    parser.add_argument("--events", default="", help="append a line per committed step")
    parser.add_argument("--checkpoint", default="", help="rank 0 writes it, every rank loads it")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps (default 10)")
    args = parser.parse_args(argv)

    comm = Torch(args.backend) if args.impl == "torch" else Numpy(args.backend)
    rank, size = comm.dist.get_rank(), comm.dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    w, step = load_checkpoint(args.checkpoint)
    resumed = step
    events = open(args.events, "a") if args.events else None  # noqa: SIM115
    while step < args.steps:
        if step == args.crash_step and rank == args.crash_rank and restart == 0:
            if events is not None:
                events.write(json.dumps({"kill": time.time(), "step": step}) + "\n")
                events.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step)
        mine = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
        grad = 2.0 * x[mine].T @ (x[mine] @ w - y[mine])
        if args.sleep:
            time.sleep(args.sleep)
        grad = comm.all_reduce(grad)  # a lost peer raises here: the launcher restarts us
        w = w - args.lr * grad / BATCH
        step += 1
        if events is not None:
            line = {"t": time.time(), "step": step, "size": size, "restart": restart}
            events.write(json.dumps(line) + "\n")
            events.flush()
        if rank == 0 and args.checkpoint and step % args.checkpoint_every == 0:
            save_checkpoint(args.checkpoint, w, step)
    digest = hashlib.sha256(w.tobytes()).hexdigest()[:16]
    print(json.dumps({"rank": rank, "steps": step, "resumed": resumed, "sha": digest}), flush=True)
    comm.dist.destroy_process_group()
    return 0 if np.isfinite(w).all() and step == args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
