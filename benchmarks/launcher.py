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

A launch that fails (or runs past --timeout) counts as a failed run of its cell: the table
says "failed in k of n runs", the CSV keeps the run with no time and its error, and the
plot marks the cell failed with that error.

Examples::

    python benchmarks/launcher.py
    python benchmarks/launcher.py --nproc 2 --repeat 10 --compare none
    python benchmarks/launcher.py --csv launcher.csv --png launcher.png
    python benchmarks/plots.py launcher launcher.csv --png launcher.png   # from the CSV
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import date
from pathlib import Path
from typing import Any

import plots  # benchmarks/plots.py, beside this script

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
WORKERS = {
    "distcomm": WORKER.format(module="distcomm", init=""),
    "torch": WORKER.format(module="torch.distributed", init='"gloo"'),
}


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    }
    env.update(
        HYDRA_IFACE="lo",
        UCX_NET_DEVICES="lo",
        DISTCOMM_SOCKET_IFNAME="lo",
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
    )
    return env


def _launcher(peer: str) -> list[str]:
    module = "distcomm.run" if peer == "distcomm" else "torch.distributed.run"
    return [sys.executable, "-m", module]


#: an exception's last line in a traceback ("RuntimeError: ..."), the launchers' own excepted
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))(?::\s*(.*))?$")
#: noise in torch's messages on a plot: C++ source locations ("[/__w/.../pair.cc:152] ") and
#: gloo's ", remote=[127.0.0.1]:31112$2"
_NOISE = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\]\s*|,\s*remote=\S*")


def failure_reason(stderr: str, returncode: int) -> str:
    """One line that says why a launch failed: the workers' last exception (not the
    launcher's ChildFailedError that reports it), else the exit status."""
    reason = ""
    for line in stderr.splitlines():
        match = _EXCEPTION.match(line.strip())
        if match and "ChildFailedError" not in match.group(1):
            reason = line.strip()
    reason = _NOISE.sub("", reason)
    if len(reason) > 120:
        reason = reason[:117] + "..."
    return reason or f"exit status {returncode}"


def run_once(
    peer: str, worker: Path, nproc: int, mode: str, timeout: float
) -> tuple[float | None, str]:
    """One launch: (the wall time (launch) or the recovery time (fail) in seconds, "") or,
    if the launch failed, (None, why; its stderr's last lines are printed)."""
    with tempfile.TemporaryDirectory(prefix="dc-bench-") as tmp:
        out = Path(tmp)
        args = [
            *_launcher(peer),
            "--standalone",
            f"--nproc_per_node={nproc}",
            "--max_restarts=1",
            str(worker),
            str(out),
            mode,
        ]
        start = time.perf_counter()
        proc = subprocess.Popen(
            args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the launcher stops its workers (they are in sessions of their own)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            print(
                f"{peer}: {' '.join(args[2:])} ran past {timeout:.0f} s: stopped", file=sys.stderr
            )
            return None, f"timed out after {timeout:.0f} s"
        except BaseException:  # Ctrl-C: the launcher got it too and stops its workers
            try:
                proc.wait(timeout=30)
            except BaseException:
                proc.kill()  # a second Ctrl-C, or it hangs: do not leave it behind
                proc.wait()
            raise
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            tail = "\n".join(stderr.strip().splitlines()[-5:])
            print(
                f"{peer}: {' '.join(args[2:])} failed ({proc.returncode}):\n{tail}", file=sys.stderr
            )
            return None, failure_reason(stderr, proc.returncode)
        if mode == "launch":
            return wall, ""
        try:
            failed = float((out / "failed_at").read_text())
            recovered = float((out / "recovered_at").read_text())
        except (OSError, ValueError) as exc:
            print(
                f"{peer}: {' '.join(args[2:])} exited 0 but recorded no recovery: {exc}",
                file=sys.stderr,
            )
            return None, "exited 0 without a recovery"
        return recovered - failed, ""


def _cell(values: list[float | None]) -> tuple[str, float | None]:
    """The median of the runs that worked, and how many failed."""
    good = [v for v in values if v is not None]
    note = plots.failure_note(values)
    if not good:
        return note, None
    median = statistics.median(good)
    return f"{median:.2f}" + (f" ({note})" if note else ""), median


def labels(peers: list[str]) -> dict[str, str]:
    """Each launcher as the CSV and the plot name it, with the version installed."""
    import distcomm

    out = {"distcomm": f"distcomm-run (distcomm {distcomm.__version__})"}
    if "torch" in peers:
        out["torch"] = f"torchrun (torch {importlib.metadata.version('torch')})"
    return out


def csv_rows(
    times: dict[tuple[str, str], list[tuple[float | None, str]]], nproc: int, names: dict[str, str]
) -> list[dict[str, Any]]:
    """The runs as rows of plots.LAUNCHER_FIELDS (a failed run: no seconds, its error)."""
    return [
        dict(
            measurement=MEASUREMENTS[mode],
            impl=peer,
            label=names[peer],
            nproc=nproc,
            run=run,
            seconds=seconds,
            error=error,
        )
        for (mode, peer), results in times.items()
        for run, (seconds, error) in enumerate(results)
    ]


#: each mode's name in the CSV and on the plot
MEASUREMENTS = {"launch": "launch", "fail": "recovery"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="workers (default 4)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per cell (default 5)")
    parser.add_argument(
        "--compare",
        choices=("torch", "none"),
        default="torch",
        help="run torchrun beside distcomm-run when torch is installed",
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per launch")
    parser.add_argument(
        "--csv",
        metavar="PATH",
        help="also write every run here, one row each, failed runs with "
        "their error (benchmarks/plots.py launcher redraws from it)",
    )
    parser.add_argument(
        "--png",
        metavar="PATH",
        help="also plot each launcher's runs side by side (needs matplotlib)",
    )
    args = parser.parse_args(argv)
    if args.nproc < 1 or args.repeat < 1 or not args.timeout > 0:
        parser.error("need --nproc >= 1, --repeat >= 1 and --timeout > 0")
    if args.png:
        plots.require_matplotlib(parser)  # before the run, not after minutes of it
    peers = ["distcomm"]
    if args.compare == "torch":
        if importlib.util.find_spec("torch") is None:
            print("torch is not installed: measuring distcomm-run alone", file=sys.stderr)
        else:
            peers.append("torch")
    names = labels(peers)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="dc-bench-workers-") as tmp:
        workers = {"distcomm": Path(tmp, "ours.py"), "torch": Path(tmp, "theirs.py")}
        for peer, path in workers.items():
            path.write_text(textwrap.dedent(WORKERS[peer]))
        times: dict[tuple[str, str], list[tuple[float | None, str]]] = {}
        for mode in ("launch", "fail"):
            for _ in range(args.repeat):
                for peer in peers:  # interleaved, so load changes hit both alike
                    times.setdefault((mode, peer), []).append(
                        run_once(peer, workers[peer], args.nproc, mode, args.timeout)
                    )
    print(
        f"# {' vs '.join(names.values())}, {args.nproc} workers, median of {args.repeat} "
        f"runs, {os.cpu_count()} CPUs, load average at start {load}"
    )
    head = "| measurement | distcomm-run (s) |" + (
        " torchrun (s) | torchrun/ours |" if "torch" in peers else ""
    )
    print(head)
    print("|---|---|" + ("---|---|" if "torch" in peers else ""))
    descriptions = {
        "launch": "launch: init + barrier + exit (wall)",
        "fail": "recovery: failure -> restarted group's first barrier",
    }
    for mode in ("launch", "fail"):
        cells = [_cell([seconds for seconds, _ in times[(mode, peer)]]) for peer in peers]
        row = f"| {descriptions[mode]} | " + " | ".join(text for text, _ in cells) + " |"
        if "torch" in peers:
            ours, theirs = cells[0][1], cells[1][1]
            row += f" {theirs / ours:.2f}x |" if ours and theirs else " - |"
        print(row)
    rows = csv_rows(times, args.nproc, names)
    if args.csv:
        plots.write_csv(rows, args.csv, plots.LAUNCHER_FIELDS)
    if args.png:
        plots.launcher(
            rows,
            args.png,
            f"{date.today().isoformat()}, {os.cpu_count()} CPUs, Python "
            f"{platform.python_version()}, load average at start {load}; "
            f"{args.repeat} runs per launcher, interleaved",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
