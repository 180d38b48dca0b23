"""A worker of tests/test_frozen_rank.py: three ranks, rank 2 frozen inside a collective.

Rank 2 (the victim) is stopped with SIGSTOP inside a collective: at the point STOP names
(`entry`: before it publishes its part; `readK`: before its K-th read of a peer's
memory; `external`: the test stops it at a random moment of a loop). Ranks 0 and 1 time
out (`timeout=`), re-form without it, and keep all_reducing (MAX) the same arrays, all
ones, until the woken victim has finished its abandoned collective, then a few times
more. A survivor counts every element that is not 1 (a write of the victim's, whose
arrays hold 100), and the victim says how its abandoned collective ended.

The environment: BACKEND, OP (the collective the victim is frozen in), COUNT (float32
elements), STOP, FLAGS (a folder for the files the processes and the test meet at), the
store the test hosts (MASTER_ADDR, MASTER_PORT, DISTCOMM_USE_AGENT_STORE=1). Prints one
line "RESULT <json>".
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import distcomm as dist
from distcomm.backends.engine.shm import engine
from distcomm.world import state

BACKEND = os.environ["BACKEND"]
OP = os.environ["OP"]
COUNT = int(os.environ["COUNT"])
STOP = os.environ["STOP"]
FLAGS = Path(os.environ["FLAGS"])
VICTIM = 2
OP_TIMEOUT = 3.0
#: the woken victim's collective ends well within this (it only has to notice)
WAIT_S = 120.0


def flag(name: str) -> None:
    (FLAGS / name).touch()


def wait_flag(name: str, seconds: float = WAIT_S) -> None:
    deadline = time.monotonic() + seconds
    while not (FLAGS / name).exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} did not appear within {seconds} s")
        time.sleep(0.02)


def freeze() -> None:
    """Stop this process here until the test continues it."""
    flag("stopping")
    os.kill(os.getpid(), signal.SIGSTOP)


def arm_freeze() -> None:
    """Freeze the victim at the point STOP names, once, inside the next collective."""
    if STOP == "entry":
        original = engine.IntraNode._arrive

        def arrive(self, *args, **kwargs):
            engine.IntraNode._arrive = original
            freeze()
            return original(self, *args, **kwargs)

        engine.IntraNode._arrive = arrive
    elif STOP.startswith("read"):
        reads = [int(STOP[4:])]
        original_read = engine.cma_read

        def read(*args):
            reads[0] -= 1
            if reads[0] == 0:
                freeze()
            return original_read(*args)

        engine.cma_read = read


def collective(buf: np.ndarray, out: np.ndarray, timeout: float | None) -> None:
    """The collective OP on `buf` (and `out`, its output where it has one)."""
    size = dist.get_world_size()
    m = COUNT // size
    even = size * m  # what divides evenly among the ranks
    if OP == "all_reduce":
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, timeout=timeout)
    elif OP.startswith("reduce") and OP != "reduce_scatter":
        dist.reduce(buf, dst=int(OP[6:]), op=dist.ReduceOp.MAX, timeout=timeout)
    elif OP == "all_gather":
        dist.all_gather_single(out[:even], buf[:m], timeout=timeout)
    elif OP == "reduce_scatter":
        dist.reduce_scatter_single(out[:m], buf[:even], op=dist.ReduceOp.MAX, timeout=timeout)
    elif OP.startswith("broadcast"):
        dist.broadcast(buf, src=int(OP[9:]), timeout=timeout)
    elif OP == "all_to_all":
        dist.all_to_all_single(out[:even], buf[:even], timeout=timeout)
    else:
        raise ValueError(f"unknown OP {OP!r}")


def victim() -> dict:
    buf = np.full(COUNT, 100.0, dtype=np.float32)
    out = np.zeros(COUNT, dtype=np.float32)
    if STOP != "external":
        arm_freeze()
    flag("looping")
    outcome = "ok"
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:  # `external`: until the abandoned one fails
        buf[...] = 100.0
        try:
            collective(buf, out, None)
        except dist.DistError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
            break
        if STOP != "external":
            break
    flag("victim-done")
    return {"victim_op": outcome}


def survivor(rank: int) -> dict:
    buf = np.full(COUNT, 1.0, dtype=np.float32)
    out = np.zeros(COUNT, dtype=np.float32)
    error = ""
    deadline = time.monotonic() + WAIT_S
    while not error and time.monotonic() < deadline:
        buf[...] = 1.0
        try:
            collective(buf, out, OP_TIMEOUT)
        except dist.DistError as exc:
            error = type(exc).__name__
    # re-form without the victim, through the job's store (the old group is aborted)
    pg = dist.group.WORLD
    store = state.store
    store.set(f"frozen/handle/{rank}", pg.get_init_handle())
    handles = [store.get(f"frozen/handle/{r}").decode() for r in (0, 1)]
    pg.reconfigure("without-the-frozen-rank", handles).wait()
    flag(f"reformed-{rank}")
    buf[...] = 1.0  # the same array, whose address the abandoned collective published
    bad, ops = 0, 0
    after = None
    seen = np.zeros(1, dtype=np.int64)
    while after is None or ops < after:
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        ops += 1
        bad = max(bad, int(np.count_nonzero(buf != 1.0)))
        if after is None:  # both survivors see the victim finish at the same op
            seen[0] = (FLAGS / "victim-done").exists()
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
            if seen[0]:
                after = ops + 20  # a few more once the victim has finished
        if time.monotonic() > deadline + WAIT_S:
            raise AssertionError("the victim did not finish its collective in time")
    dist.barrier()
    bad = max(bad, int(np.count_nonzero(buf != 1.0)))
    return {"error": error, "bad": bad, "ops": ops, "size": dist.get_world_size()}


def manager_loop(rank: int) -> dict:
    """SGD with a persistent 4 MiB gradient under the recovery Manager: every step adds
    (step + 1) to every weight whatever the world's size, so the final weights are known
    in closed form. The victim freezes inside its all_reduce at step FREEZE_AT; the
    survivors commit steps without it, it is continued, fails, comes back as a newcomer
    and is caught up. Everyone stops at the first step >= STEPS with all three in."""
    from distcomm.recovery import Manager

    steps = int(os.environ.get("STEPS", "20"))
    weights = {"w": np.zeros(COUNT, dtype=np.float64)}
    grad = np.empty(COUNT, dtype=np.float32)  # allocated once, as frameworks keep grads

    def load(state: dict) -> None:
        weights["w"] = state["w"]

    mgr = Manager(lambda: {"w": weights["w"]}, load, settle=0.5)
    sizes: list[int] = []
    deadline = time.monotonic() + 3 * WAIT_S
    with mgr:
        while mgr.step < steps or mgr.world_size < 3:
            if time.monotonic() > deadline:
                raise AssertionError(f"the loop did not end: sizes {sizes}, step {mgr.step}")
            mgr.start_step()
            if rank == VICTIM and mgr.step == FREEZE_AT and not (FLAGS / "stopping").exists():
                arm_freeze()
            grad[...] = float(mgr.step + 1)
            try:
                dist.all_reduce(grad, timeout=OP_TIMEOUT)
                ok = True
            except dist.DistError:
                ok = False
            if mgr.should_commit(ok):
                weights["w"] += grad / dist.get_world_size()
                sizes.append(dist.get_world_size())
                if sizes[-1] == 2 and sizes.count(2) == 3:
                    flag(f"reformed-{dist.get_rank()}")  # three steps committed without it
            time.sleep(0.02)
    expected = float(mgr.step * (mgr.step + 1) // 2)
    w = weights["w"]
    return {
        "steps": mgr.step,
        "sizes": sorted(set(sizes)),
        "wrong": int(np.count_nonzero(w != expected)),
        "w0": float(w[0]),
        "expected": expected,
        "size": dist.get_world_size(),
    }


FREEZE_AT = 5


def main() -> None:
    dist.init_process_group(BACKEND, timeout=60)
    rank = dist.get_rank()
    if OP == "manager":
        result = manager_loop(rank)
    else:
        result = victim() if rank == VICTIM else survivor(rank)
    result.update(rank=rank, pid=os.getpid())
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
