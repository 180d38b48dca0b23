"""Data-parallel SGD that survives `kill -9` of a worker: it goes on at N-1 and returns to
N when the replacement arrives, ending with the same weights on every rank.

Each step's global batch is drawn from a fixed seed by step number, and split among the
ranks of the world of that moment; the gradients are summed (all_reduce) and divided by
the global batch size, so every rank takes the same step whatever the world's size. The
loop is a `distcomm.recovery.Manager` loop: a step is applied only when every rank voted
that it finished it; a lost worker makes the vote fail, the survivors re-form the world
and redo the step, and the replacement that distcomm-run starts is caught up with the
weights of a survivor.

Run it with the replace mode of distcomm-run, making worker 1 kill itself at step 20::

    distcomm-run --standalone --nproc_per_node=4 --on-failure=replace \\
        -m distcomm.examples.resilient_sgd --steps 60 --crash-rank 1 --crash-step 20

Every rank prints one JSON line at the end (its final weights' checksum, the steps it
committed, the world sizes it saw); with --events FILE each rank also appends a line per
committed step (time, step, world size) for benchmarks/recovery.py. With --op-timeout S the
step's all_reduce and the Manager's own collectives wait at most S seconds: a worker that
stops instead of dying is evicted that soon, and comes back as a newcomer when it runs
again. The exit status is 0 when the weights are finite and the loop finished every step.
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

import distcomm as dist
from distcomm.recovery import JobFinishedError, Manager

__all__ = ["batch", "main"]

FEATURES = 16
BATCH = 64  # the global batch, split among the ranks of each step's world


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """Step `step`'s global batch (the same on every rank)."""
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, FEATURES))
    true_w = np.linspace(-1.0, 1.0, FEATURES)
    return x, x @ true_w + 0.01 * rng.standard_normal(BATCH)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--crash-rank", type=int, default=-1, help="this RANK kills itself")
    parser.add_argument("--crash-step", type=int, default=-1, help="... at this step")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds of work per step")
    parser.add_argument("--events", default="", help="append a line per committed step")
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument(
        "--op-timeout",
        type=float,
        default=None,
        help="seconds that bound each step's all_reduce and the Manager's vote and catch-up: "
        "a worker that stops (a pause, swap, a debugger) is evicted that soon",
    )
    args = parser.parse_args(argv)

    try:
        dist.init_process_group(args.backend)  # a replacement joins the running job here
    except JobFinishedError:  # a replacement that came after the last step: done
        print(json.dumps({"late": True}), flush=True)
        return 0
    model = {"w": np.zeros(FEATURES)}

    def load(state: dict) -> None:
        model["w"] = state["w"]

    mgr = Manager(lambda: {"w": model["w"]}, load, settle=args.settle, op_timeout=args.op_timeout)
    with mgr:  # leaving it tells a replacement still on its way that the job is done
        code = _train(args, mgr, model)
    dist.destroy_process_group()
    return code


def _train(args: argparse.Namespace, mgr: Manager, model: dict) -> int:
    replacement = bool(os.environ.get("DISTCOMM_REPLACEMENT"))
    worlds: list[int] = []
    events = open(args.events, "a") if args.events else None  # noqa: SIM115
    while mgr.step < args.steps:
        try:
            mgr.start_step()
        except JobFinishedError:  # left out of a re-forming while slow, back too late: done
            print(json.dumps({"late": True, "evicted": True}), flush=True)
            return 0
        step, rank, size = mgr.step, mgr.rank, mgr.world_size
        if (
            step == args.crash_step
            and os.environ.get("RANK") == str(args.crash_rank)
            and not replacement
        ):
            if events is not None:
                events.write(json.dumps({"kill": time.time(), "step": step}) + "\n")
                events.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step)
        mine = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
        grad = 2.0 * x[mine].T @ (x[mine] @ model["w"] - y[mine])
        if args.sleep:
            time.sleep(args.sleep)
        try:
            dist.all_reduce(grad, timeout=args.op_timeout)
            ok = True
        except dist.DistError:
            ok = False
        if mgr.should_commit(ok):
            model["w"] = model["w"] - args.lr * grad / BATCH
            worlds.append(size)
            if events is not None:
                events.write(json.dumps({"t": time.time(), "step": mgr.step, "size": size}) + "\n")
                events.flush()
    digest = hashlib.sha256(model["w"].tobytes()).hexdigest()[:16]
    print(
        json.dumps(
            {
                "rank": mgr.rank,
                "steps": mgr.step,
                "sha": digest,
                "sizes": sorted(set(worlds)),
                "reforms": mgr.reforms,
                "replacement": replacement,
            }
        ),
        flush=True,
    )
    return 0 if np.isfinite(model["w"]).all() and mgr.step == args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
