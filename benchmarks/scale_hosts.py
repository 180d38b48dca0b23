"""Threads, sockets and TCP connections per rank of one gloo job across simulated hosts.

The script runs ONE distcomm job of --hosts x --nproc ranks (default 8 x 8 = 64): one
`distcomm.run` agent per host, joined by a c10d rendezvous on host 0's address, each
starting --nproc workers. The hosts are network namespaces joined by a bridge
(`tests/netns.py`: addresses that exist only inside them, removed afterwards), so the
run needs root and `ip netns`. Host h holds the ranks h*nproc to h*nproc+nproc-1.

It measures the transport that every tcp and gloo group of a process shares (one I/O
thread and one connection per pair of processes, made on first use: the "fabric"). Each
rank runs, on gloo (shared memory within a host, TCP between hosts):

1. init: ``init_process_group("gloo")``;
2. world: an 8-byte all_reduce on the world (checked: the number of ranks), a barrier;
3. subgroups: ``new_subgroups(group_size=nproc)`` (one group per host) and
   ``new_subgroups_by_enumeration`` of the cross-host groups {i, i+nproc, i+2*nproc, ...}
   (one rank per host), then an 8-byte all_reduce on each of this rank's two groups
   (checked: --hosts and --nproc).

After each phase a rank records its threads (/proc/self/task), its sockets (the
/proc/self/fd entries that are sockets) and the fabric's open connections (those of
every distinct fabric its groups use: one is expected), writes one JSON line to a file
in a shared folder (the namespaces share the file system) and leaves the group. The
parent prints, per phase, the median and the maximum over the ranks as a markdown table,
then a one-line JSON summary (saved with --json). A rank that fails, a wrong result or a
job that runs past --timeout makes the exit status non-zero with a message saying which;
every process in the namespaces is killed and the namespaces are deleted in any case.

Examples::

    sudo python benchmarks/scale_hosts.py                       # 8 hosts x 8 ranks
    sudo python benchmarks/scale_hosts.py --hosts 2 --nproc 2   # a quick try
    sudo python benchmarks/scale_hosts.py --json scale-hosts.json --timeout 900
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scale import count_sockets  # benchmarks/ (this script's folder) is on sys.path

ROOT = Path(__file__).resolve().parent.parent
#: the c10d rendezvous port on host 0
RDZV_PORT = 29400
PHASES = ("init", "world", "subgroups")
MEASURES = ("threads", "sockets", "connections")
#: seconds the agents get to finish after one of them failed, before they are killed
FAIL_GRACE = 30.0
#: lines of each agent's log shown when the job fails
LOG_TAIL = 15


# -- in each rank -------------------------------------------------------------------------------


def fabrics(groups: Sequence[Any]) -> list[Any]:
    """The distinct fabrics (shared TCP endpoints) of `groups`' cpu backends; a group of
    one rank has none."""
    found: dict[int, Any] = {}
    for group in groups:
        backend = getattr(group, "_backends", {}).get("cpu")
        fabric = getattr(getattr(backend, "_transport", None), "fabric", None)
        if fabric is not None:
            found[id(fabric)] = fabric
    return list(found.values())


def snapshot(groups: Sequence[Any]) -> dict[str, Any]:
    """Threads, sockets and fabric connections of this process now."""
    ends = fabrics(groups)
    peers = sorted(p for fabric in ends for p in fabric.connections())
    return {
        "threads": len(os.listdir("/proc/self/task")),
        "sockets": count_sockets(),
        "connections": len(peers),
        "peers": peers,
        "fabrics": len(ends),
    }


def thread_names() -> list[str]:
    """The names of this process's Python threads (the kernel's count may be higher:
    threads of native libraries are not among them)."""
    import threading

    # digits out, so that the ranks' sets compare: distcomm-io-3 -> distcomm-io-N
    return sorted(re.sub(r"\d+", "N", thread.name) for thread in threading.enumerate())


def path_name(group: Any) -> str:
    """The path the group's collectives take ("shm", "shm+tcp", "tcp", ...)."""
    backend = getattr(group, "_backends", {}).get("cpu")
    return str(getattr(getattr(backend, "_path", None), "name", "?"))


def all_reduce_ones(dist: Any, group: Any, expected: int, what: str) -> None:
    """An 8-byte SUM all_reduce of 1.0 on `group`; raise unless it gives `expected`."""
    import numpy as np

    value = np.ones(1, dtype=np.float64)
    dist.all_reduce(value, group=group)
    if value[0] != expected:
        raise RuntimeError(f"{what} all_reduce gave {value[0]}, expected {expected}")


def cross_host_layout(hosts: int, nproc: int) -> list[list[int]]:
    """The groups of one rank per host: {i, i+nproc, i+2*nproc, ...} for each local rank i."""
    return [[h * nproc + i for h in range(hosts)] for i in range(nproc)]


def run_phases(dist: Any, hosts: int, nproc: int, timeout: float) -> dict[str, Any]:
    """The three phases of one rank; its record (without rank and errors)."""
    dist.init_process_group("gloo", timeout=timeout)
    world = dist.group.WORLD
    record: dict[str, Any] = {"phases": {"init": snapshot([world])}}
    all_reduce_ones(dist, world, hosts * nproc, "world")
    dist.barrier()
    record["phases"]["world"] = snapshot([world])
    local, _ = dist.new_subgroups(group_size=nproc)
    cross, _ = dist.new_subgroups_by_enumeration(cross_host_layout(hosts, nproc))
    all_reduce_ones(dist, cross, hosts, "cross-host subgroup")
    all_reduce_ones(dist, local, nproc, "host subgroup")
    record["phases"]["subgroups"] = snapshot([world, local, cross])
    record["paths"] = {
        "world": path_name(world),
        "host": path_name(local),
        "cross": path_name(cross),
    }
    record["thread_names"] = thread_names()
    return record


def write_record(out: Path, rank: int, record: dict[str, Any]) -> None:
    """One JSON line in rank-<rank>.json, renamed into place whole."""
    tmp = out / f".rank-{rank}.json"
    tmp.write_text(json.dumps(record) + "\n")
    tmp.rename(out / f"rank-{rank}.json")


def worker(args: argparse.Namespace) -> int:
    import distcomm as dist

    rank = int(os.environ["RANK"])
    record: dict[str, Any] = {"rank": rank, "host_name": os.uname().nodename}
    code = 0
    try:
        record.update(run_phases(dist, args.hosts, args.nproc, args.rank_timeout))
    except BaseException as exc:  # reported in the record; the parent says which rank
        record["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        record["traceback"] = traceback.format_exc()
        code = 1
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:
            record.setdefault("error", f"destroy_process_group: {exc!r}")
            code = 1
    write_record(Path(args.out), rank, record)
    return code


# -- the parent ---------------------------------------------------------------------------------


def agent_env(out: Path) -> dict[str, str]:
    """The agents' environment: nothing inherited from a surrounding job, one auth key for
    the whole job (its ports are reachable from every host)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DISTCOMM_", "TORCHELASTIC_", "PET_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
        TMPDIR=str(out),
        DISTCOMM_AUTH_KEY=f"scale-hosts-{os.getpid()}-{time.monotonic_ns()}",
        PYTHONUNBUFFERED="1",
    )
    return env


def start_agents(cluster: Any, args: argparse.Namespace, out: Path) -> list[subprocess.Popen]:
    """One distcomm.run agent per host, its output in agent-<host>.log."""
    first = cluster.hosts[0].address
    env = agent_env(out)
    rank_timeout = max(30.0, args.timeout * 0.8)  # a rank's own error comes before ours
    agents = []
    for host in cluster.hosts:
        command = [
            sys.executable,
            "-m",
            "distcomm.run",
            f"--nnodes={args.hosts}",
            f"--nproc-per-node={args.nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={first}:{RDZV_PORT}",
            f"--rdzv-id=scale-hosts-{os.getpid()}",
            str(Path(__file__).resolve()),
            "--worker",
            "--out",
            str(out),
            # no --nproc here: distcomm-run, as torchrun, takes a prefix of one of its own
            # options after the script's name for that option and calls it ambiguous
            "--hosts",
            str(args.hosts),
            "--worker-nproc",
            str(args.nproc),
            "--rank-timeout",
            str(rank_timeout),
        ]
        with (out / f"agent-{host.index}.log").open("w") as log:
            agents.append(
                host.popen(command, env=env, cwd=out, stdout=log, stderr=subprocess.STDOUT)
            )
    return agents


def wait_agents(agents: list[subprocess.Popen], timeout: float) -> tuple[list[int | None], bool]:
    """Wait for the agents; their exit statuses (None: still running, to be killed) and
    whether the job ran past `timeout`. After one fails the others get FAIL_GRACE s."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        codes = [agent.poll() for agent in agents]
        if all(code is not None for code in codes):
            return codes, False
        if any(code not in (None, 0) for code in codes):
            deadline = min(deadline, time.monotonic() + FAIL_GRACE)
        if time.monotonic() > deadline:
            return codes, time.monotonic() - started > timeout
        time.sleep(0.2)


def read_records(out: Path) -> dict[int, dict[str, Any]]:
    """The ranks' records by rank."""
    records = {}
    for path in out.glob("rank-*.json"):
        record = json.loads(path.read_text())
        records[record["rank"]] = record
    return records


def log_tails(out: Path, hosts: int) -> str:
    parts = []
    for index in range(hosts):
        path = out / f"agent-{index}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        parts.append(
            f"===== agent on host {index} (last {LOG_TAIL} lines) =====\n"
            + "\n".join(lines[-LOG_TAIL:])
        )
    return "\n".join(parts)


def problems(
    codes: list[int | None],
    timed_out: bool,
    timeout: float,
    records: dict[int, dict[str, Any]],
    world: int,
) -> list[str]:
    """What went wrong with the job, one line each (empty: nothing)."""
    found = []
    running = [i for i, code in enumerate(codes) if code is None]
    if timed_out:
        found.append(
            f"the job ran past --timeout {timeout:.0f} s "
            f"(agents still running on hosts {running}; killed)"
        )
    elif running:
        found.append(
            f"agents on hosts {running} still ran {FAIL_GRACE:.0f} s after another failed; killed"
        )
    failed = {i: code for i, code in enumerate(codes) if code not in (None, 0)}
    if failed:
        found.append(f"agents exited non-zero (host: status): {failed}")
    for rank in sorted(records):
        if "error" in records[rank]:
            found.append(f"rank {rank} failed: {records[rank]['error']}")
    missing = sorted(set(range(world)) - set(records))
    if missing:
        found.append(f"{len(missing)} of {world} ranks wrote no record: {missing}")
    return found


def summarize(records: dict[int, dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """{phase: {measure: {"median": m, "max": x}}} over the ranks."""
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for phase in PHASES:
        summary[phase] = {}
        for measure in MEASURES:
            values = [r["phases"][phase][measure] for r in records.values()]
            summary[phase][measure] = {"median": statistics.median(values), "max": max(values)}
    return summary


def print_table(summary: dict[str, dict[str, dict[str, float]]]) -> None:
    print("| phase | " + " | ".join(f"{m} (median / max)" for m in MEASURES) + " |")
    print("|---|" + "---|" * len(MEASURES))
    for phase in PHASES:
        cells = [
            f"{summary[phase][m]['median']:g} / {summary[phase][m]['max']:g}" for m in MEASURES
        ]
        print(f"| {phase} | " + " | ".join(cells) + " |")


def print_notes(records: dict[int, dict[str, Any]], nproc: int) -> None:
    """The paths the groups took, the thread names, how many ranks have how many
    connections, and the ranks with the most after the last phase (with their peers)."""
    paths = sorted({json.dumps(r["paths"], sort_keys=True) for r in records.values()})
    print(f"# group paths: {'; '.join(paths)}")
    names = sorted({", ".join(r["thread_names"]) for r in records.values()})
    print(f"# Python threads after the last phase (distinct sets): {' | '.join(names)}")
    fabric_counts = sorted({r["phases"][p]["fabrics"] for r in records.values() for p in PHASES})
    print(f"# fabrics per rank (distinct values over ranks and phases): {fabric_counts}")
    for phase in PHASES:
        spread = Counter(r["phases"][phase]["connections"] for r in records.values())
        print(f"# {phase}: ranks by connections {dict(sorted(spread.items()))}")
    last = {rank: r["phases"]["subgroups"] for rank, r in records.items()}
    most = max(s["connections"] for s in last.values())
    top = sorted(rank for rank, s in last.items() if s["connections"] == most)
    for rank in top[:8]:
        peers = last[rank]["peers"]
        print(
            f"# rank {rank} (host {rank // nproc}): {most} connections, to ranks {peers} "
            f"(hosts {[p // nproc for p in peers]})"
        )
    if len(top) > 8:
        print(f"# ... and {len(top) - 8} more ranks with {most} connections")


def run_job(args: argparse.Namespace, out: Path) -> int:
    """Run the job on a fresh cluster; print the results; the exit status."""
    from tests import netns

    world = args.hosts * args.nproc
    started = time.monotonic()
    with netns.Cluster(args.hosts) as cluster:
        agents = start_agents(cluster, args, out)
        try:
            codes, timed_out = wait_agents(agents, args.timeout)
        finally:
            cluster.kill_all()  # nothing of the job outlives the wait
    seconds = time.monotonic() - started
    records = read_records(out)
    found = problems(codes, timed_out, args.timeout, records, world)
    if found:
        print(log_tails(out, args.hosts), file=sys.stderr)
        print("scale_hosts.py: the job failed:\n  " + "\n  ".join(found), file=sys.stderr)
        return 1
    summary = summarize(records)
    print(
        f"# one gloo job of {world} ranks on {args.hosts} namespace hosts x {args.nproc} "
        f"ranks each; median / max over the ranks; {seconds:.0f} s in all"
    )
    print_table(summary)
    print_notes(records, args.nproc)
    result = {
        "hosts": args.hosts,
        "nproc": args.nproc,
        "world": world,
        "seconds": round(seconds, 1),
        "phases": summary,
    }
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=8, help="simulated hosts (default 8)")
    parser.add_argument("--nproc", type=int, default=8, help="ranks per host (default 8)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds the whole job may take (default 600)"
    )
    parser.add_argument("--json", metavar="PATH", help="also save the summary there")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--worker-nproc", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank-timeout", type=float, default=300.0, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.hosts < 1 or args.nproc < 1:
        parser.error(f"need --hosts >= 1 and --nproc >= 1, got {args.hosts} and {args.nproc}")
    if args.worker:
        args.nproc = args.worker_nproc
        return worker(args)
    sys.path.insert(0, str(ROOT))
    from tests import netns

    why = netns.unavailable()
    if why:
        print(f"scale_hosts.py needs network namespaces: {why}", file=sys.stderr)
        return 2
    out = Path(tempfile.mkdtemp(prefix="dc-scale-hosts-"))
    try:
        return run_job(args, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
