"""Evicting a stopped worker: how long a Manager loop's survivors take to commit again.

Three workers on this host run a numpy SGD loop under `distcomm.recovery.Manager` (a
persistent 1 MiB float32 gradient, all_reduced with ``timeout=--op-timeout`` every step);
worker 2 stops itself with SIGSTOP at step --stop-step (as a GC pause, swap, a debugger
or a VM migration would stop it). The survivors' step times out, the vote fails, they
re-form without it and go on. Measured per run: the stop to the first step committed by
the two survivors ("to N-1"). The backends alternate over --repeat rounds, so load
changes hit them alike; the table gives min / median / max per backend. The stopped
worker is killed once the survivors are done. Every process stays on loopback.

Examples::

    python benchmarks/eviction.py
    python benchmarks/eviction.py --repeat 5 --backends gloo,tcp --op-timeout 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKERS = 3
STOPPED = 2
AFTER = 5  # steps the survivors commit without the stopped worker before they end


def worker() -> None:
    """One worker of the loop (this file run with --worker; configured by environment)."""
    import numpy as np

    import distcomm as dist
    from distcomm.recovery import Manager

    events = Path(os.environ["EVENTS"])
    stop_step = int(os.environ["STOP_STEP"])
    op_timeout = float(os.environ["OP_TIMEOUT"])

    def log(**event: float) -> None:
        with events.open("a") as f:
            f.write(json.dumps(event) + "\n")

    dist.init_process_group(os.environ["BACKEND"])
    rank = dist.get_rank()
    weights = {"w": np.zeros(256 * 1024, dtype=np.float32)}
    grad = np.empty_like(weights["w"])

    def load(state: dict) -> None:
        weights["w"] = state["w"]

    mgr = Manager(lambda: {"w": weights["w"]}, load, settle=0.5)
    without = 0
    with mgr:
        while without < AFTER:
            mgr.start_step()
            if rank == STOPPED and mgr.step == stop_step:
                log(stop=time.time())
                os.kill(os.getpid(), signal.SIGSTOP)
            grad[...] = float(mgr.step + 1)
            try:
                dist.all_reduce(grad, timeout=op_timeout)
                ok = True
            except dist.DistError:
                ok = False
            if mgr.should_commit(ok):
                weights["w"] += grad / dist.get_world_size()
                log(t=time.time(), step=mgr.step, size=dist.get_world_size())
                without += dist.get_world_size() < WORKERS
            time.sleep(0.02)
    dist.destroy_process_group()


def one_run(backend: str, args: argparse.Namespace) -> float:
    """The stop to the survivors' first commit, in seconds, of one run on `backend`."""
    from distcomm.store import TCPStore

    with tempfile.TemporaryDirectory(prefix="distcomm-eviction-") as folder:
        events = Path(folder) / "events.jsonl"
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "WORLD_SIZE": str(WORKERS),
            "DISTCOMM_USE_AGENT_STORE": "1",
            "BACKEND": backend,
            "EVENTS": str(events),
            "STOP_STEP": str(args.stop_step),
            "OP_TIMEOUT": str(args.op_timeout),
            "OMP_NUM_THREADS": "1",
        }
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker"],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(WORKERS)
        ]
        try:
            for proc in procs[:STOPPED]:
                _, err = proc.communicate(timeout=args.timeout)
                if proc.returncode != 0:
                    raise RuntimeError(f"a survivor failed ({proc.returncode}): {err[-2000:]}")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
            store.close()
        lines = [json.loads(line) for line in events.read_text().splitlines()]
    stop = next(e["stop"] for e in lines if "stop" in e)
    return min(e["t"] for e in lines if e.get("size", WORKERS) < WORKERS) - stop


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=3, help="rounds (each backend once)")
    parser.add_argument("--backends", default="gloo,tcp", help="comma-separated")
    parser.add_argument("--op-timeout", type=float, default=3.0, help="the step's timeout=")
    parser.add_argument("--stop-step", type=int, default=10, help="worker 2 stops here")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    backends = args.backends.split(",")
    times: dict[str, list[float]] = {b: [] for b in backends}
    for _ in range(args.repeat):
        for backend in backends:
            times[backend].append(one_run(backend, args))
    print(
        f"# {WORKERS} workers, worker {STOPPED} stopped (SIGSTOP) at step {args.stop_step}, "
        f"the step's timeout={args.op_timeout:g} s; the stop to the survivors' first commit"
    )
    print(f"{'backend':>8} {'runs':>5} {'min (s)':>8} {'median (s)':>11} {'max (s)':>8}")
    for backend, found in times.items():
        print(
            f"{backend:>8} {len(found):>5} {min(found):>8.2f} {statistics.median(found):>11.2f} "
            f"{max(found):>8.2f}"
        )


if __name__ == "__main__":
    main()
