"""distcomm-run against torchrun: launch wall time and recovery time after a worker failure.

Two measurements, each repeated --repeat times, ours and torch's (when torch is
installed) interleaved in the same run, medians printed side by side:

- launch: wall time of ``distcomm-run --standalone --nproc_per_node=N worker.py`` where
  the worker initialises the default group, runs one barrier and exits; torch's peer is
  ``torchrun --standalone --nproc_per_node=N`` with the same worker written for
  torch.distributed (gloo).
- recovery: with --max_restarts=1, rank 1 fails right after the first barrier; the time
  from its failure to the restarted group's first completed barrier (wall clock, the
  failing worker and the new rank 0 write their times to files).

Examples::

    python benchmarks/launcher.py
    python benchmarks/launcher.py --nproc 2 --repeat 10 --compare none
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

#: one worker for both launchers ({module} and {init} differ; both set TORCHELASTIC_*)
WORKER = """
    import os, sys, time
    from pathlib import Path
    import {module} as dist
    dist.init_process_group({init})
    dist.barrier()
    out, restart = Path(sys.argv[1]), os.environ["TORCHELASTIC_RESTART_COUNT"]
    if sys.argv[2] == "fail":
        if restart == "0" and dist.get_rank() == 1:
            (out / "failed_at").write_text(repr(time.time()))
            os._exit(1)
        if restart == "1" and dist.get_rank() == 0:
            (out / "recovered_at").write_text(repr(time.time()))
        if restart == "0":
            time.sleep(60)  # held until the agent stops the group
    dist.destroy_process_group()
"""
WORKERS = {"distcomm": WORKER.format(module="distcomm", init=""),
           "torch": WORKER.format(module="torch.distributed", init='"gloo"')}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(HYDRA_IFACE="lo", UCX_NET_DEVICES="lo", DISTCOMM_SOCKET_IFNAME="lo",
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    return env


def _launcher(peer: str) -> list[str]:
    module = "distcomm.run" if peer == "distcomm" else "torch.distributed.run"
    return [sys.executable, "-m", module]


def run_once(peer: str, worker: Path, nproc: int, mode: str, timeout: float) -> float | None:
    """One launch; the wall time (launch) or the recovery time (fail) in seconds, None if
    the launch failed (its stderr's last lines are printed)."""
    with tempfile.TemporaryDirectory(prefix="dc-bench-") as tmp:
        out = Path(tmp)
        args = [*_launcher(peer), "--standalone", f"--nproc_per_node={nproc}",
                "--max_restarts=1", str(worker), str(out), mode]
        start = time.perf_counter()
        res = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - start
        if res.returncode != 0:
            tail = "\n".join(res.stderr.strip().splitlines()[-5:])
            print(f"{peer}: {' '.join(args[2:])} failed ({res.returncode}):\n{tail}",
                  file=sys.stderr)
            return None
        if mode == "launch":
            return wall
        return float((out / "recovered_at").read_text()) - float((out / "failed_at").read_text())


def _cell(values: list[float | None]) -> tuple[str, float | None]:
    """The median of the runs that worked, and how many failed."""
    good = [v for v in values if v is not None]
    if not good:
        return f"all {len(values)} runs failed", None
    median = statistics.median(good)
    failed = len(values) - len(good)
    return f"{median:.2f}" + (f" ({failed} of {len(values)} runs failed)" if failed else ""), median


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="workers (default 4)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per cell (default 5)")
    parser.add_argument("--compare", choices=("torch", "none"), default="torch",
                        help="run torchrun beside distcomm-run when torch is installed")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per launch")
    args = parser.parse_args()
    peers = ["distcomm"]
    if args.compare == "torch":
        if importlib.util.find_spec("torch") is None:
            print("torch is not installed: measuring distcomm-run alone", file=sys.stderr)
        else:
            peers.append("torch")
    with tempfile.TemporaryDirectory(prefix="dc-bench-workers-") as tmp:
        workers = {"distcomm": Path(tmp, "ours.py"), "torch": Path(tmp, "theirs.py")}
        for peer, path in workers.items():
            path.write_text(textwrap.dedent(WORKERS[peer]))
        times: dict[tuple[str, str], list[float | None]] = {}
        for mode in ("launch", "fail"):
            for _ in range(args.repeat):
                for peer in peers:  # interleaved, so load changes hit both alike
                    times.setdefault((mode, peer), []).append(
                        run_once(peer, workers[peer], args.nproc, mode, args.timeout))
    print(f"# distcomm-run vs torchrun, {args.nproc} workers, median of {args.repeat} runs, "
          f"{os.cpu_count()} CPUs")
    head = "| measurement | distcomm-run (s) |" + (" torchrun (s) | torchrun/ours |"
                                                   if "torch" in peers else "")
    print(head)
    print("|---|---|" + ("---|---|" if "torch" in peers else ""))
    labels = {"launch": "launch: init + barrier + exit (wall)",
              "fail": "recovery: failure -> restarted group's first barrier"}
    for mode in ("launch", "fail"):
        cells = [_cell(times[(mode, peer)]) for peer in peers]
        row = f"| {labels[mode]} | " + " | ".join(text for text, _ in cells) + " |"
        if "torch" in peers:
            ours, theirs = cells[0][1], cells[1][1]
            row += f" {theirs / ours:.2f}x |" if ours and theirs else " - |"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
