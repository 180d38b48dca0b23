"""A worker of tests/test_recovery.py: SCENARIO names what it does; it prints one JSON
line of results. The store is the test's (DISTCOMM_USE_AGENT_STORE=1)."""

from __future__ import annotations

import json
import os
import re
import signal
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


def _env_float(name: str) -> float | None:
    value = os.environ.get(name)
    return float(value) if value else None


def _touch(path: str) -> None:
    part = f"{path}.{os.getpid()}.part"  # several ranks may create it at once
    with open(part, "w"):
        pass
    os.replace(part, path)


def loop(steps: int, stop_file: str = "") -> None:
    """A Manager loop whose weights sum every step's (step + 1): identical everywhere.

    Environment (all optional): VICTIM with STOP_FILE: SIGKILL itself at step 5 (once);
    HOLD: at half-way wait until that file exists; HOLD_UNTIL: from half-way on, vote
    every step down (discard it) until that file exists, so the members keep voting
    (and so taking newcomers in) without going on; MARK_BACK: create that file once this
    process is in the world after joining or re-forming; OP_TIMEOUT: the step's
    all_reduce takes timeout=; MGR_OP_TIMEOUT, REFORM_TIMEOUT: the Manager's op_timeout
    and reform_timeout; FREEZE_AT with FROZEN: after the all_reduce of that step (once),
    create FROZEN and SIGSTOP itself; SHRUNK: create that file on committing a step at a
    world size below WORLD_SIZE; COMMITTED: create that file on committing a step."""
    model = {"w": np.zeros(4)}

    def load(state: dict) -> None:
        model["w"] = state["w"]

    kwargs = {}
    if _env_float("MGR_OP_TIMEOUT"):
        kwargs["op_timeout"] = _env_float("MGR_OP_TIMEOUT")
    if _env_float("REFORM_TIMEOUT"):
        kwargs["reform_timeout"] = _env_float("REFORM_TIMEOUT")
    op_timeout = _env_float("OP_TIMEOUT")
    hold_until = os.environ.get("HOLD_UNTIL", "")
    mark_back = os.environ.get("MARK_BACK", "")
    freeze_at = int(os.environ.get("FREEZE_AT", "-1"))
    shrunk = os.environ.get("SHRUNK", "")
    committed = os.environ.get("COMMITTED", "")
    world = int(os.environ.get("WORLD_SIZE", "0"))
    joined = SCENARIO == "newcomer"
    mgr = Manager(lambda: {"w": model["w"]}, load, settle=0.5, **kwargs)
    sizes = []
    held_since = None
    while mgr.step < steps:
        mgr.start_step()
        if mark_back and (joined or mgr.reforms > 0) and not os.path.exists(mark_back):
            _touch(mark_back)
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
            dist.all_reduce(g, timeout=op_timeout)
            ok = True
        except dist.DistError:
            ok = False
        if mgr.step == freeze_at and not os.path.exists(os.environ["FROZEN"]):
            _touch(os.environ["FROZEN"])
            os.kill(os.getpid(), signal.SIGSTOP)  # until the test sends SIGCONT
        holding = bool(hold_until) and mgr.step >= steps // 2 and not os.path.exists(hold_until)
        if holding:
            held_since = held_since or time.monotonic()
            if time.monotonic() - held_since > 300:
                raise SystemExit(f"{hold_until} did not appear within 300 s of holding")
        if mgr.should_commit(ok and not holding):
            model["w"] = model["w"] + g / dist.get_world_size()
            sizes.append(dist.get_world_size())
            if shrunk and dist.get_world_size() < world and not os.path.exists(shrunk):
                _touch(shrunk)
            if committed and not os.path.exists(committed):
                _touch(committed)
        time.sleep(0.02)
        if (
            mgr.step >= steps // 2
            and os.environ.get("HOLD")
            and not os.path.exists(os.environ["HOLD"])
        ):
            # the members wait at the half-way point until the test saw the newcomer register
            deadline = time.monotonic() + 60
            while not os.path.exists(os.environ["HOLD"]) and time.monotonic() < deadline:
                time.sleep(0.05)
    OUT.update(
        w=model["w"].tolist(),
        steps=mgr.step,
        sizes=sorted(set(sizes)),
        rank=dist.get_rank(),
        size=dist.get_world_size(),
        reforms=mgr.reforms,
    )


#: DIE_AT: where a newcomer SIGKILLs itself while joining, found by the store requests it
#: makes (keys of distcomm.membership and reconfigure): before registering, right after,
#: once a member list named it, after acknowledging that list, while connecting
_STAGES = {
    "before-registering": ("add", re.compile(r"/m/\d+/newcomers$"), True),
    "registered": ("set", re.compile(r"/m/\d+/nc/\d+$"), False),
    "named": ("get", re.compile(r"/m/\d+/nc/\d+/epoch$"), False),
    "acknowledged": ("set", re.compile(r"/m/\d+/e/\d+/ack/\d+$"), False),
    # its record in the roll call of the new group's backends: the others wait for it
    "connecting": ("compare_set", re.compile(r"distcomm/reconf/m\d+/backends/\d+/\d+$"), False),
}


def die_while_joining(stage: str) -> None:
    """SIGKILL this process at `stage` of its joining (see _STAGES). With ELSEWHERE set, its
    init handle names another host, so the members cannot look at its process."""
    from distcomm.store import TCPStore

    if os.environ.get("ELSEWHERE"):
        import types

        import distcomm.reconfigure as reconfigure

        reconfigure.socket = types.SimpleNamespace(gethostname=lambda: "elsewhere.invalid")
    method, pattern, before = _STAGES[stage]
    real = getattr(TCPStore, method)

    def hooked(self, key, *args, **kwargs):
        if before and pattern.search(key):
            os.kill(os.getpid(), signal.SIGKILL)
        result = real(self, key, *args, **kwargs)
        if pattern.search(key):
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(TCPStore, method, hooked)


def main() -> None:
    join = SCENARIO == "newcomer"
    if os.environ.get("DIE_AT"):
        die_while_joining(os.environ["DIE_AT"])
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
        mgr = Manager(lambda: {}, lambda state: None, settle=0.5, reform_timeout=3)
        handles = [None] * dist.get_world_size()
        dist.all_gather_object(handles, pg.get_init_handle())
        if dist.get_rank() == 0:
            gone = subprocess.Popen(["true"])
            gone.wait()
            ghost = f"dc1:{NEWCOMER_RANKS + 999}:0:{socket.gethostname()}:{gone.pid}:gone"
            decided = membership.Decision(1, [*handles, ghost], 0, [])
            state.store.compare_set(membership._p() + "e/1/list", "", decided.dump())
        dist.barrier()
        # a barrier returns on one rank while another may still be finishing it: rank 0
        # aborts only once every rank is past it (the abort would fail that barrier)
        store = state.store
        store.add("lost-test/past-barrier", 1)
        if dist.get_rank() == 0:
            deadline = time.monotonic() + 60
            while int(store.add("lost-test/past-barrier", 0)) < dist.get_world_size():
                assert time.monotonic() < deadline, "the other ranks did not pass the barrier"
                time.sleep(0.02)
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
