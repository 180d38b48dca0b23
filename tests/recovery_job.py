"""A worker of tests/test_recovery.py: SCENARIO names what it does; it prints one JSON
line of results. The store is the test's (DISTCOMM_USE_AGENT_STORE=1)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np

import distcomm as dist
from distcomm.recovery import Manager
from distcomm.world import state

BACKEND = os.environ.get("BACKEND", "tcp")
SCENARIO = sys.argv[1]
OUT: dict = {"pid": os.getpid()}


def loop(steps: int, stop_file: str = "") -> None:
    """A Manager loop whose weights sum every step's (step + 1): identical everywhere."""
    model = {"w": np.zeros(4)}

    def load(state: dict) -> None:
        model["w"] = state["w"]

    mgr = Manager(lambda: {"w": model["w"]}, load, settle=0.5)
    sizes = []
    while mgr.step < steps:
        mgr.start_step()
        if (
            stop_file
            and mgr.step == 5
            and os.environ.get("VICTIM")
            and not os.path.exists(stop_file)
        ):
            open(stop_file, "w").close()
            os.kill(os.getpid(), 9)
        g = np.full(4, float(mgr.step + 1))
        try:
            dist.all_reduce(g)
            ok = True
        except dist.DistError:
            ok = False
        if mgr.should_commit(ok):
            model["w"] = model["w"] + g / dist.get_world_size()
            sizes.append(dist.get_world_size())
        time.sleep(0.02)
        if (
            mgr.step >= steps // 2
            and os.environ.get("HOLD")
            and not os.path.exists(os.environ["HOLD"])
        ):
            # the members wait at the half-way point until the newcomer was started
            deadline = time.monotonic() + 60
            while not os.path.exists(os.environ["HOLD"]) and time.monotonic() < deadline:
                time.sleep(0.05)
    OUT.update(
        w=model["w"].tolist(),
        steps=mgr.step,
        sizes=sorted(set(sizes)),
        rank=dist.get_rank(),
        size=dist.get_world_size(),
    )


def main() -> None:
    join = SCENARIO == "newcomer"
    dist.init_process_group(BACKEND, join=join)
    if SCENARIO in ("member", "newcomer", "victim"):
        loop(int(os.environ.get("STEPS", "40")), os.environ.get("STOP_FILE", ""))
    elif SCENARIO == "reconfigure":
        pg = dist.group.WORLD
        handles = [None] * dist.get_world_size()
        dist.all_gather_object(handles, pg.get_init_handle())
        assert pg.get_init_handle() == pg.get_init_handle()
        old = dist.get_rank()
        sub = dist.new_group(list(range(dist.get_world_size())))
        try:
            sub.reconfigure("test-sub", handles)
            OUT["sub"] = "accepted"
        except ValueError as exc:
            OUT["sub"] = "is not the default group" in str(exc)
        work = pg.reconfigure("test-reverse", list(reversed(handles)))
        work.wait()
        x = np.array([float(old)])
        dist.all_reduce(x)
        OUT.update(old=old, new=dist.get_rank(), size=dist.get_world_size(), sum=float(x[0]))
    elif SCENARIO == "abort":
        pg = dist.group.WORLD
        heard = []
        pg.register_abort_hook(heard.append)
        x = np.ones(3)
        if dist.get_rank() == 0:
            threading.Timer(1.0, pg.abort, args=("stopped by the test",)).start()
            buf = np.zeros(3)
            try:
                dist.recv(buf, src=1)  # rank 1 never sends: only the abort ends this
                OUT["error"] = None
            except dist.DistError as exc:
                OUT["error"] = str(exc)
        else:
            try:
                dist.all_reduce(x)  # rank 0 never joins it: only the abort ends it
                OUT["error"] = None
            except dist.DistError as exc:
                OUT["error"] = str(exc)
        try:
            dist.all_reduce(x)
            OUT["later"] = None
        except dist.DistError as exc:
            OUT["later"] = type(exc).__name__
        deadline = time.monotonic() + 10
        while not heard and time.monotonic() < deadline:
            time.sleep(0.05)
        OUT.update(aborted=pg.is_aborted(), hooks=heard, rank=dist.get_rank())
        # leave together: a rank that leaves early could be heard of before the abort
        store = state.store
        store.add("abort-test/done", 1)
        deadline = time.monotonic() + 60
        while int(store.add("abort-test/done", 0)) < dist.get_world_size():
            assert time.monotonic() < deadline, "the other ranks did not finish"
            time.sleep(0.05)
    elif SCENARIO == "lost-while-connecting":
        # epoch 1's list names a process that is gone (as if it died after the roll):
        # connecting fails, and the Manager's next attempt leaves it out
        import socket
        import subprocess

        from distcomm import membership
        from distcomm.reconfigure import NEWCOMER_RANKS

        pg = dist.group.WORLD
        mgr = Manager(lambda: {}, lambda state: None, settle=0.5, timeout=3)
        handles = [None] * dist.get_world_size()
        dist.all_gather_object(handles, pg.get_init_handle())
        if dist.get_rank() == 0:
            gone = subprocess.Popen(["true"])
            gone.wait()
            ghost = f"dc1:{NEWCOMER_RANKS + 999}:0:{socket.gethostname()}:{gone.pid}:gone"
            decided = membership.Decision(1, [*handles, ghost], 0, [])
            state.store.compare_set(membership._p() + "e/1/list", "", decided.dump())
        dist.barrier()
        if dist.get_rank() == 0:
            pg.abort("the test re-forms the world")
        deadline = time.monotonic() + 30
        while not pg.is_aborted():  # the others hear of it before their next step
            assert time.monotonic() < deadline, "the abort did not arrive"
            time.sleep(0.02)
        mgr.start_step()
        x = np.ones(2)
        dist.all_reduce(x)
        OUT.update(size=dist.get_world_size(), sum=x.tolist(), reforms=mgr.reforms)
    print("RESULT " + json.dumps(OUT), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
