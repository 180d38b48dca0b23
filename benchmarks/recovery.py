"""Recovery from a lost worker: a 4-worker numpy SGD loop on this host, one worker killed
(SIGKILL) mid-run: distcomm-run's two ways of recovering beside torchrun's, in one run.

Modes, alternated over --repeat rounds (so load changes hit all alike):

- restart: distcomm-run's default, restart everyone: ``distcomm-run --standalone
  --nproc_per_node=4 --max-restarts 1 benchmarks/recovery_worker.py --impl distcomm``. The
  loop checkpoints (rank 0 writes the weights and the step every --checkpoint-every steps;
  every rank loads it at start), so the restarted group resumes from the last checkpoint.
- replace: ``distcomm-run --standalone --nproc_per_node=4 --on-failure=replace -m
  distcomm.examples.resilient_sgd --backend gloo``: the survivors re-form the world at
  N-1 and go on (distcomm.recovery.Manager); the agent starts a replacement, which joins at
  a later step and is caught up from a survivor.
- torch: torchrun's restart, ``torchrun --standalone --nproc_per_node=4 --max-restarts 1
  benchmarks/recovery_worker.py --impl torch`` (torch.distributed, gloo, CPU tensors), the
  same loop and checkpoint as restart. Needs torch, in this interpreter or --torch-python.
- torch-unshared: the same with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. torchrun (torch 2.13)
  hands its rendezvous TCPStore to the workers and keeps it over restarts, and the workers'
  keys carry no attempt in their names (torch/distributed/rendezvous.py assumes "a new
  TCPStore for every retry"), so a restarted gloo group can read the first attempt's
  addresses: "connectFullMesh failed ... Connection refused", or a hang. With the variable
  every round has a TCPStore of its own, and the restart works.

In every mode the worker with RANK --crash-rank kills itself at step --crash-step (on the
first attempt only, or unless it is a replacement), and every rank appends JSON lines to
an events file: ``{"kill": t, "step": S}`` from the dying worker (S: the steps committed
when it died), ``{"t": t, "step": n, "size": world}`` per committed step (n: committed
count). From those lines, per run:

- to N-1: the kill to the first step committed by a world of N-1 (replace only; "n/a" for
  the restart modes, which have no such phase);
- to N: the kill to the first step committed by N workers after it (replace: the first
  such step past S, once the replacement is in; restart: the first step the restarted
  group commits);
- to step S+1: the kill to the commit of the step it interrupted (work regained: the
  restart modes first redo the steps since their checkpoint);
- steps lost: the steps whose work was thrown away: the step in flight at the kill plus
  the committed steps that had to be done again (replace: none when the survivors redo only
  the step in flight, so 1; restart: S minus the checkpoint's step, plus 1).

A run counts only when the launcher exited 0, the kill and the recovery are in the events,
and every rank ended with the same weights; a failed run (or one past --timeout) is
counted in its row ("failed in k of n runs") with its error, and kept in the CSV. Every
launcher runs in a temporary directory of its own (TMPDIR too, so that flight-recorder
traces and torchelastic's files go there) that is removed after it; this script is the
child subreaper of everything it starts, and kills whatever outlives a launcher.

Examples::

    python benchmarks/recovery.py
    python benchmarks/recovery.py --repeat 5 --modes replace,restart --csv recovery.csv
    python benchmarks/recovery.py --torch-python TORCH_VENV/bin/python --csv recovery.csv
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path
from typing import Any

import plots  # benchmarks/plots.py, beside this script
from launcher import failure_reason  # benchmarks/launcher.py, beside it too

HERE = Path(__file__).resolve().parent
WORKER = HERE / "recovery_worker.py"
MODES = ("restart", "replace", "torch", "torch-unshared")
TORCH_MODES = ("torch", "torch-unshared")
#: torch's opt-out of sharing the rendezvous TCPStore with the workers (torch-unshared)
UNSHARED = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
#: the issue's target for the replace mode: seconds from the kill to the first step at N-1
#: and at N, and the steps lost at most (the step in flight)
TARGET_N1, TARGET_N, TARGET_LOST = 2.0, 5.0, 1
#: seconds a launcher gets after SIGTERM (past --timeout) before all it started is killed
GRACE = 15.0
#: the CSV's columns: one row per run
FIELDS = (
    "mode",
    "label",
    "nproc",
    "run",
    "status",
    "error",
    "to_n_minus_1_s",
    "to_n_s",
    "to_next_step_s",
    "steps_lost",
    "steps_redone",
    "kill_step",
    "resumed_from",
    "wall_s",
    "sha",
    "leftover_processes",
)


@dataclass
class Run:
    """One run of one mode; the times are None where not measured or the run failed."""

    mode: str
    label: str
    nproc: int
    run: int
    status: str = "ok"  # ok, failed, timeout
    error: str = ""
    to_n_minus_1_s: float | None = None
    to_n_s: float | None = None
    to_next_step_s: float | None = None  # the kill to the commit of the step it interrupted
    steps_lost: int | None = None
    steps_redone: int | None = None
    kill_step: int | None = None
    resumed_from: int | None = None  # the committed count the recovered loop went on from
    wall_s: float | None = None
    sha: str = ""
    leftover_processes: int = 0


# -- processes -------------------------------------------------------------------------------


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux): a worker whose
    launcher died is re-parented here, not to init, so that it can be found and killed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (from /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        out[int(entry)] = int(fields[1])
    return out


def descendants(root: int) -> list[int]:
    """Every process below `root` (children first, then theirs)."""
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _alive(pid: int) -> bool:
    """A process that is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] != "Z"


def sweep(wait: float = 0.0) -> int:
    """Kill (SIGKILL) every process below this one, after giving them `wait` seconds to end
    by themselves, and reap the ones re-parented here. Returns how many were still alive."""
    me = os.getpid()
    deadline = time.monotonic() + wait
    while True:
        left = [p for p in descendants(me) if _alive(p)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid, ppid in _parents().items():  # orphans re-parented here: reap them
        if ppid == me:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    return len(left)


def stop(proc: subprocess.Popen) -> None:
    """A launcher still running gets SIGTERM (it stops its workers), and --timeout's GRACE
    seconds later SIGKILL, with everything it started."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=GRACE)
    except subprocess.TimeoutExpired:
        for pid in [*descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


# -- one run -----------------------------------------------------------------------------------


def _env(tmp: str, mode: str) -> dict[str, str]:
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", UNSHARED)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in drop and not k.startswith(("PET_", "TORCHELASTIC_"))
    }
    env.update(
        TMPDIR=tmp,  # flight-recorder traces, torchelastic's log dirs: removed with the run
        DISTCOMM_SOCKET_IFNAME="lo",
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
    )
    if mode == "torch-unshared":
        env[UNSHARED] = "1"
    return env


def command(mode: str, args: argparse.Namespace, events: str, checkpoint: str) -> list[str]:
    """The launcher's command line for `mode`."""
    common = [
        f"--steps={args.steps}",
        f"--crash-rank={args.crash_rank}",
        f"--crash-step={args.crash_step}",
        f"--sleep={args.sleep:g}",
        f"--events={events}",
    ]
    ckpt = [f"--checkpoint={checkpoint}", f"--checkpoint-every={args.checkpoint_every}"]
    nproc = f"--nproc_per_node={args.nproc}"
    if mode == "replace":
        return [
            sys.executable,
            "-m",
            "distcomm.run",
            "--standalone",
            nproc,
            "--on-failure=replace",
            "-m",
            "distcomm.examples.resilient_sgd",
            "--backend=gloo",
            *common,
        ]
    if mode == "restart":
        launch = [sys.executable, "-m", "distcomm.run"]
        impl = "distcomm"
    else:
        launch = [args.torch_python, "-m", "torch.distributed.run"]
        impl = "torch"
    return [
        *launch,
        "--standalone",
        nproc,
        "--max-restarts=1",
        str(WORKER),
        f"--impl={impl}",
        "--backend=gloo",
        *ckpt,
        *common,
    ]


def read_events(path: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the kill line or None, the committed-step lines)."""
    kill, commits = None, []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line cut short by the kill
            if "kill" in event:
                kill = kill or event
            elif "t" in event:
                commits.append(event)
    return kill, commits


def measure(result: Run, kill: dict[str, Any], commits: list[dict[str, Any]]) -> str:
    """Fill `result`'s times and steps from the events; returns why they are incomplete
    ('' when they are not)."""
    n, t0, s = result.nproc, float(kill["kill"]), int(kill["step"])
    result.kill_step = s
    if result.mode == "replace":
        # every commit past S, and every commit at N-1, came after the kill
        recovered = [c for c in commits if c["step"] > s or c["size"] == n - 1]
        shrunk = [c["t"] for c in recovered if c["size"] == n - 1]
        if not shrunk:
            return "no step committed at N-1 after the kill"
        result.to_n_minus_1_s = min(shrunk) - t0
        back = [c["t"] for c in recovered if c["size"] == n]
        result.to_n_s = min(back) - t0 if back else None
    else:
        recovered = [c for c in commits if c.get("restart", 0) >= 1]
        if not recovered:
            return "no step committed after the restart"
        result.to_n_s = min(c["t"] for c in recovered) - t0
    resumed = min(c["step"] for c in recovered) - 1
    past = [c["t"] for c in recovered if c["step"] == s + 1]
    result.to_next_step_s = min(past) - t0 if past else None
    result.resumed_from = resumed
    result.steps_redone = max(0, s - resumed)
    result.steps_lost = result.steps_redone + 1  # and the step in flight
    if result.to_n_s is None:
        return "the replacement never committed a step (the job ended at N-1)"
    return ""


def run_once(mode: str, label: str, run: int, args: argparse.Namespace) -> Run:
    result = Run(mode, label, args.nproc, run)
    with tempfile.TemporaryDirectory(prefix="dc-recovery-") as tmp:
        events, checkpoint = Path(tmp, "events.jsonl"), Path(tmp, "checkpoint.npz")
        cmd = command(mode, args, str(events), str(checkpoint))
        out_path, err_path = Path(tmp, "stdout"), Path(tmp, "stderr")
        start = time.monotonic()
        with open(out_path, "w") as out, open(err_path, "w") as err:
            proc = subprocess.Popen(
                cmd, env=_env(tmp, mode), stdout=out, stderr=err, stdin=subprocess.DEVNULL
            )
            try:
                proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                result.status, result.error = "timeout", f"timed out after {args.timeout:g} s"
            finally:
                stop(proc)  # on a timeout, Ctrl-C or an error too
        result.wall_s = time.monotonic() - start
        result.leftover_processes = sweep(wait=2.0)
        stdout, stderr = out_path.read_text(), err_path.read_text()
        if result.status == "ok" and proc.returncode != 0:
            result.status, result.error = "failed", failure_reason(stderr, proc.returncode)
        shas = set()
        for line in stdout.splitlines():
            try:
                shas.add(json.loads(line)["sha"])
            except (ValueError, KeyError, TypeError):
                continue
        result.sha = ",".join(sorted(shas))
        kill, commits = read_events(events)
        why = "no kill in the events" if kill is None else measure(result, kill, commits)
        if result.status == "ok" and not why and len(shas) != 1:
            why = f"the ranks ended with different weights ({result.sha or 'none printed'})"
        if result.status == "ok" and why:
            result.status, result.error = "failed", why
        if result.status != "ok":
            tail = "\n".join(stderr.strip().splitlines()[-5:])
            print(
                f"{mode}: {shlex.join(cmd[1:])} {result.status}: {result.error}\n{tail}",
                file=sys.stderr,
                flush=True,
            )
            result.to_n_minus_1_s = result.to_n_s = result.to_next_step_s = None
            result.steps_lost = result.steps_redone = None
    return result


# -- the report --------------------------------------------------------------------------------


def torch_version(python: str) -> str | None:
    """torch's version in `python`, or None when it has no torch."""
    try:
        done = subprocess.run(
            [python, "-c", "import torch; print(torch.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def labels(torch: str | None) -> dict[str, str]:
    import distcomm

    return {
        "restart": f"distcomm-run restart (distcomm {distcomm.__version__}, checkpoint)",
        "replace": f"distcomm-run --on-failure=replace (distcomm {distcomm.__version__})",
        "torch": f"torchrun restart (torch {torch}, gloo, checkpoint)",
        "torch-unshared": f"torchrun restart, {UNSHARED}=1 (torch {torch}, gloo, checkpoint)",
    }


def spread(values: list[float | int | None], fmt: str) -> str:
    """'min / median / max' of the runs that worked, and how many failed."""
    good = [v for v in values if v is not None]
    note = plots.failure_note(values)
    if not good:
        return note or "-"
    cell = " / ".join(format(v, fmt) for v in (min(good), statistics.median(good), max(good)))
    return cell + (f" ({note})" if note else "")


def target(runs: list[Run]) -> str:
    """Whether the replace runs met the issue's target, and by how much."""
    if not runs:
        return "not measured (replace mode not run)"
    met = [
        r
        for r in runs
        if r.status == "ok"
        and r.to_n_minus_1_s is not None
        and r.to_n_minus_1_s <= TARGET_N1
        and r.to_n_s is not None
        and r.to_n_s <= TARGET_N
        and r.steps_lost is not None
        and r.steps_lost <= TARGET_LOST
    ]
    verdict = "MET" if len(met) == len(runs) else "NOT MET"
    ok = [r for r in runs if r.status == "ok"]
    worst = ""
    if ok:
        worst = (
            f"; worst run: N-1 after {max(r.to_n_minus_1_s or 0 for r in ok):.2f} s, N after "
            f"{max(r.to_n_s or 0 for r in ok):.2f} s, {max(r.steps_lost or 0 for r in ok)} "
            "step(s) lost"
        )
    return f"{verdict} in {len(met)} of {len(runs)} runs{worst}"


def print_table(runs: list[Run], modes: list[str], names: dict[str, str]) -> None:
    print("| mode | to N-1 (s) | to N (s) | to step S+1 (s) | steps lost | runs |")
    print("|---|---|---|---|---|---|")
    for mode in modes:
        mine = [r for r in runs if r.mode == mode]
        n1 = "n/a" if mode != "replace" else spread([r.to_n_minus_1_s for r in mine], ".2f")
        ok = sum(r.status == "ok" for r in mine)
        print(
            f"| {names[mode]} | {n1} | {spread([r.to_n_s for r in mine], '.2f')} | "
            f"{spread([r.to_next_step_s for r in mine], '.2f')} | "
            f"{spread([r.steps_lost for r in mine], 'g')} | {ok} of {len(mine)} ok |"
        )
    for mode in modes:
        errors = sorted({r.error for r in runs if r.mode == mode and r.error})
        for error in errors:
            count = sum(r.error == error for r in runs if r.mode == mode)
            print(f"# {mode}: {count}x {error}")


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _mode_list(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(
            f"modes are a comma-separated subset of {','.join(MODES)}, got {text!r}"
        )
    return list(dict.fromkeys(modes))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--nproc", type=int, default=4, help="workers")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (each mode once a round)")
    parser.add_argument(
        "--modes",
        type=_mode_list,
        default=",".join(MODES),
        help="comma-separated, of " + ",".join(MODES),
    )
    parser.add_argument("--steps", type=int, default=100, help="steps of the loop")
    parser.add_argument("--crash-rank", type=int, default=1, help="the RANK that kills itself")
    parser.add_argument(
        "--crash-step",
        type=int,
        default=25,
        help="... at this step (between two checkpoints, so that the restart modes redo work)",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=10, help="steps between checkpoints (restart modes)"
    )
    parser.add_argument("--sleep", type=float, default=0.02, help="seconds of work per step")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per run")
    parser.add_argument(
        "--torch-python",
        metavar="PATH",
        help="the interpreter with torch for the torch mode (default: this one, if it has "
        "torch; else the torch mode is skipped)",
    )
    parser.add_argument("--csv", metavar="PATH", help="also write every run here, one row each")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.nproc < 2 or args.repeat < 1 or not args.timeout > 0 or args.sleep < 0:
        parser.error("need --nproc >= 2, --repeat >= 1, --timeout > 0 and --sleep >= 0")
    if not 0 <= args.crash_rank < args.nproc:
        parser.error(f"--crash-rank must be a rank, 0..{args.nproc - 1}")
    if not 0 < args.crash_step < args.steps or args.checkpoint_every < 1:
        parser.error("need 0 < --crash-step < --steps and --checkpoint-every >= 1")
    return args


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM: clean up as on Ctrl-C


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import distcomm

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminate)
    modes = list(args.modes)
    torch = None
    if any(m in TORCH_MODES for m in modes):
        if args.torch_python is None and importlib.util.find_spec("torch") is not None:
            args.torch_python = sys.executable
        torch = torch_version(args.torch_python) if args.torch_python else None
        if torch is None:
            print(
                f"# note: no torch in {args.torch_python or sys.executable}: the torch modes "
                "are skipped (--torch-python names an interpreter that has it)",
                flush=True,
            )
            modes = [m for m in modes if m not in TORCH_MODES]
    names = labels(torch)
    reaper = become_subreaper()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"# python {shlex.join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)])}")
    print(
        f"# {date.today().isoformat()}: distcomm {distcomm.__version__}"
        + (f", torch {torch}" if torch else "")
        + f"; {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{platform.platform()}; load average at start {load}"
    )
    print(
        f"# {args.nproc} workers, {args.steps} steps of {args.sleep:g} s work, RANK "
        f"{args.crash_rank} SIGKILLs itself at step {args.crash_step}; restart modes: "
        f"--max-restarts 1, checkpoint every {args.checkpoint_every} steps; {args.repeat} "
        f"rounds, modes alternated: {', '.join(modes)}; --timeout {args.timeout:g} s per run",
        flush=True,
    )
    shm_before = _shm()
    runs: list[Run] = []
    began = time.monotonic()
    try:
        for round_ in range(args.repeat):
            for mode in modes:
                r = run_once(mode, names[mode], round_, args)
                runs.append(r)
                n1 = "" if r.to_n_minus_1_s is None else f"N-1 after {r.to_n_minus_1_s:.2f} s, "
                n = "" if r.to_n_s is None else f"N after {r.to_n_s:.2f} s, "
                lost = "" if r.steps_lost is None else f"{r.steps_lost} step(s) lost, "
                print(
                    f"#   round {round_ + 1}/{args.repeat} {mode}: {r.status}: {n1}{n}{lost}"
                    + ("" if r.resumed_from is None else f"resumed from step {r.resumed_from}, ")
                    + f"wall {r.wall_s:.1f} s"
                    + (f" ({r.error})" if r.error else "")
                    + (
                        f", {r.leftover_processes} process(es) outlived the launcher: killed"
                        if r.leftover_processes
                        else ""
                    ),
                    flush=True,
                )
    except KeyboardInterrupt:
        sweep()
        print("\ninterrupted: every process it started is stopped", file=sys.stderr)
        return 130
    print()
    print(
        f"# min / median / max over {args.repeat} runs; times from the kill (the dying "
        "worker's clock) to the first step committed (wall clock, same host)"
    )
    print_table(runs, modes, names)
    print(
        f"# target (replace): resumes at N-1 within {TARGET_N1:g} s and at N within "
        f"{TARGET_N:g} s of the kill, losing at most the step in flight: "
        + target([r for r in runs if r.mode == "replace"])
    )
    back_to = args.crash_step - args.crash_step % args.checkpoint_every
    print(
        "# steps lost: the step in flight at the kill plus the committed steps done again; "
        f"the restart modes go back to their last checkpoint, step {back_to} for a kill at "
        f"step {args.crash_step} with one every {args.checkpoint_every} steps (1 to "
        f"{args.checkpoint_every} steps lost, by where the kill falls)"
    )
    shas = {r.sha for r in runs if r.status == "ok" and r.sha}
    by_mode = {m: sorted({r.sha for r in runs if r.mode == m and r.sha}) for m in modes}
    print(
        "# final weights (sha256, the same on every rank of a run; per mode): "
        + "; ".join(f"{m} {','.join(v) or '-'}" for m, v in by_mode.items())
        + (
            " (all identical)"
            if len(shas) == 1
            else " (modes may differ in the last bits: the sums are taken in other orders)"
        )
    )
    leaked = _shm() - shm_before
    leftovers = sum(r.leftover_processes for r in runs)
    print(
        f"# clean-up: {leftovers} process(es) outlived their launcher"
        + ("" if reaper else " (not a subreaper here: orphans may go unseen)")
        + f"; new names left in /dev/shm: {', '.join(sorted(leaked)) or 'none'}"
    )
    print(f"# {time.monotonic() - began:.0f} s in all", flush=True)
    if args.csv:
        plots.write_csv([asdict(r) for r in runs], args.csv, FIELDS)
    return 0 if all(r.status == "ok" for r in runs if r.mode not in TORCH_MODES) else 1


if __name__ == "__main__":
    sys.exit(main())
