"""How the cost of a group grows with its size: init time, small-message latency, threads,
sockets, memory and store requests per rank, for N real ranks on this host.

For each size N of --sizes and each backend of --backends the script starts N ranks on
this host, all released into init together (they import first, then wait on a file lock
the parent holds), and each rank measures:

- init: wall time of ``init_process_group`` (the store included, as env:// opens it);
- the first 8-byte all_reduce (connections made lazily show here), then the median of
  --iters 8-byte all_reduces and of --iters barriers; every result is checked (the sum
  of 1.0 over N ranks);
- threads (``threading.active_count()`` and the kernel's count, /proc/self/status),
  sockets (the /proc/self/fd entries that are sockets) and RSS, after those ops;
- the store requests it made during init and during one ``new_group(ranks=all)``
  (distcomm only: the ranks pass ``store=`` a wrapper around a ``TCPStore`` client that
  counts each call; the peers print n/a), and threads and sockets after that new group.

Each rank writes its values to a file; the parent prints one row per (backend, N) with
the median and the maximum over the ranks. Backends:

- tcp, gloo: distcomm's backends; gloo-tcp: gloo with DISTCOMM_GLOO_TRANSPORT=tcp;
- mpi4py: raw mpi4py on the MPI library under ``mpiexec -n N`` (init: ``MPI.Init()``,
  the new group: ``COMM_WORLD.Dup()``);
- torch: torch.distributed's gloo on torch tensors, if torch is installed (else skipped
  with a note).

distcomm and torch ranks rendezvous as env:// does: MASTER_ADDR=127.0.0.1, MASTER_PORT a
port the system picked (bound to port 0, then passed on), rank 0 hosting the store. A
configuration that fails or runs past --timeout is killed (its whole process tree) and
reported in its row with the first rank's error; the run goes on. After each one the
script checks that no process of it is left and that nothing new is in /dev/shm.

Examples::

    python benchmarks/scale.py
    python benchmarks/scale.py --sizes 8,32,64 --backends tcp,gloo,gloo-tcp,mpi4py \\
        --csv scale.csv --png scale.png
    python benchmarks/plots.py scale scale.csv --png scale.png   # redraw from the CSV
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import plots  # benchmarks/plots.py, beside this script

from distcomm import Store

BACKENDS = ("tcp", "gloo", "gloo-tcp", "mpi4py", "torch")
DISTCOMM_BACKENDS = ("tcp", "gloo", "gloo-tcp")
LOOPBACK = "127.0.0.1"
#: Seconds the parent waits past --timeout, so that a rank's own timeout error comes first.
PARENT_MARGIN = 30.0
#: Seconds between SIGTERM and SIGKILL when a configuration is stopped.
GRACE = 5.0

#: Each measure: (key in the rank's file and the CSV, heading, format of its cells).
MEASURES: tuple[tuple[str, str, str], ...] = (
    ("init_s", "init (s)", "{:.2f}"),
    ("first_all_reduce_ms", "1st all_reduce (ms)", "{:.1f}"),
    ("all_reduce_us", "all_reduce (us)", "{:.0f}"),
    ("barrier_us", "barrier (us)", "{:.0f}"),
    ("threads_py", "threads (py)", "{:.0f}"),
    ("threads_os", "threads (os)", "{:.0f}"),
    ("sockets", "sockets", "{:.0f}"),
    ("rss_mib", "RSS (MiB)", "{:.0f}"),
    ("store_requests_init", "store req. init", "{:.0f}"),
    ("store_requests_new_group", "store req. new_group", "{:.0f}"),
    ("threads_os_after_new_group", "threads (os), 2 groups", "{:.0f}"),
    ("sockets_after_new_group", "sockets, 2 groups", "{:.0f}"),
)
#: The CSV columns: one row per (backend, N); a failed configuration has status "failed"
#: or "timed out", its error, and the measures of whichever ranks wrote theirs.
FIELDS = (
    "backend",
    "label",
    "nprocs",
    "status",
    "error",
    "ranks_reported",
    "all_reduce_correct",
    *(f"{key}_{stat}" for key, _, _ in MEASURES for stat in ("median", "max")),
)


class CountingStore(Store):
    """A store that forwards every call to `inner` and counts the calls by method (each
    one request of the caller; a clone shares the counts)."""

    def __init__(
        self, inner: Store, counts: Counter | None = None, lock: threading.Lock | None = None
    ) -> None:
        super().__init__(inner.timeout)
        self.inner = inner
        self.counts: Counter = Counter() if counts is None else counts
        self._lock = threading.Lock() if lock is None else lock

    def requests(self) -> int:
        """How many calls reached the store so far."""
        with self._lock:
            return sum(self.counts.values())

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.counts[name] += 1
        return getattr(self.inner, name)(*args, **kwargs)

    @property
    def timeout(self) -> timedelta:
        return self.inner.timeout

    def set_timeout(self, timeout: float | timedelta) -> None:
        self.inner.set_timeout(timeout)

    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        return self._call("compare_set", key, expected_value, desired_value)

    def wait(self, keys: Sequence[str], timeout: float | timedelta | None = None) -> None:
        self._call("wait", keys, timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self._call("check", keys)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    def append(self, key: str, value: str | bytes) -> None:
        self._call("append", key, value)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self._call("multi_get", keys)

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self._call("multi_set", keys, values)

    def has_extended_api(self) -> bool:
        return self.inner.has_extended_api()

    def list_keys(self) -> list[str]:
        return self._call("list_keys")

    def queue_push(self, key: str, value: str | bytes) -> None:
        self._call("queue_push", key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self._call("queue_pop", key, block)

    def queue_len(self, key: str) -> int:
        return self._call("queue_len", key)

    def barrier(self, key: str, world_size: int, timeout: float | timedelta | None = None) -> None:
        self._call("barrier", key, world_size, timeout)

    def clone(self) -> Store:
        inner = self.inner.clone()
        return self if inner is self.inner else CountingStore(inner, self.counts, self._lock)

    def close(self) -> None:
        self.inner.close()


# -- in each rank ------------------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """SIGKILL this rank when the parent dies (PR_SET_PDEATHSIG); exit if it already has."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def wait_for_go(workdir: Path, rank: int) -> None:
    """Say this rank is ready, then block until the parent releases every rank at once
    (it holds an exclusive lock on go.lock until all are ready)."""
    (workdir / f"ready.{rank}").touch()
    with open(workdir / "go.lock", "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        fcntl.flock(lock, fcntl.LOCK_UN)


def count_sockets() -> int:
    """The open file descriptors of this process that are sockets."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # the descriptor of the listing itself, closed by now
    return count


def process_counts() -> dict[str, float]:
    """This process's threads (Python's and the kernel's), sockets and RSS in MiB."""
    status = Path("/proc/self/status").read_text()
    threads = re.search(r"^Threads:\s+(\d+)", status, re.M)
    rss = re.search(r"^VmRSS:\s+(\d+)\s+kB", status, re.M)
    sockets = count_sockets()
    return {
        "threads_py": threading.active_count(),
        "threads_os": int(threads.group(1)) if threads else -1,
        "sockets": sockets,
        "rss_mib": int(rss.group(1)) / 1024 if rss else -1,
    }


class RankValues(dict):
    """One rank's measures, written to its file after each step, so that a rank killed
    later (a configuration stopped at its first failure, or timed out) still reports them."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def save(self) -> None:
        tmp = self.path.with_name("." + self.path.name)
        tmp.write_text(json.dumps(self))
        tmp.rename(self.path)


def _median_us(op: Callable[[], None], iters: int) -> float:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(
    n: int,
    iters: int,
    init: Callable[[], None],
    all_reduce: Callable[[Any], Any],
    barrier: Callable[[], None],
    new_group: Callable[[], None],
    buffer: Callable[[], Any],
    store_requests: Callable[[], int] | None,
    out: RankValues,
) -> dict:
    """The measures of one rank (MEASURES' keys), init to the second group, saved into
    `out` as they come (so that a rank that fails on the way still reports the others)."""
    start = time.perf_counter()
    init()
    out["init_s"] = time.perf_counter() - start
    out["store_requests_init"] = store_requests() if store_requests else None
    out.save()
    wrong = out["all_reduce_wrong"] = 0
    buf = buffer()
    start = time.perf_counter()
    result = all_reduce(buf)
    out["first_all_reduce_ms"] = (time.perf_counter() - start) * 1e3
    wrong += float(result[0]) != n

    def steady() -> None:
        nonlocal wrong
        wrong += float(all_reduce(buffer())[0]) != n

    out["all_reduce_us"] = _median_us(steady, iters)
    out["all_reduce_wrong"] = wrong
    out.save()
    out["barrier_us"] = _median_us(barrier, iters)
    out.update(process_counts())
    out.save()
    before = store_requests() if store_requests else 0
    new_group()
    out["store_requests_new_group"] = store_requests() - before if store_requests else None
    after = process_counts()
    out["threads_os_after_new_group"] = after["threads_os"]
    out["sockets_after_new_group"] = after["sockets"]
    out["all_reduce_wrong"] = wrong
    return out


def distcomm_rank(
    backend: str, rank: int, n: int, iters: int, timeout: float, out: RankValues
) -> dict:
    import numpy as np

    import distcomm as dist

    holder: dict[str, Any] = {}

    def init() -> None:
        # as env:// does: rank 0 hosts the TCPStore at MASTER_ADDR:MASTER_PORT
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            n,
            is_master=rank == 0,
            timeout=timedelta(seconds=timeout),
        )
        holder["store"] = CountingStore(store)
        dist.init_process_group(
            "gloo" if backend == "gloo-tcp" else backend,
            store=holder["store"],
            rank=rank,
            world_size=n,
            timeout=timedelta(seconds=timeout),
        )

    def all_reduce(buf: Any) -> Any:
        dist.all_reduce(buf)
        return buf

    try:
        return measure(
            n,
            iters,
            init,
            all_reduce,
            dist.barrier,
            lambda: dist.new_group(ranks=list(range(n))),
            lambda: np.ones(1, dtype=np.float64),
            lambda: holder["store"].requests(),
            out,
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if "store" in holder:
            holder["store"].close()


def torch_rank(rank: int, n: int, iters: int, timeout: float, out: RankValues) -> dict:
    import torch
    import torch.distributed as dist

    try:
        return measure(
            n,
            iters,
            lambda: dist.init_process_group(
                "gloo", init_method="env://", timeout=timedelta(seconds=timeout)
            ),
            lambda buf: (dist.all_reduce(buf), buf)[1],
            dist.barrier,
            lambda: dist.new_group(ranks=list(range(n))),
            lambda: torch.ones(1, dtype=torch.float64),
            None,
            out,
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def mpi4py_rank(n: int, iters: int, out: RankValues) -> dict:
    import mpi4py

    mpi4py.rc.initialize = False  # MPI.Init() is timed as the init
    mpi4py.rc.finalize = False
    import numpy as np
    from mpi4py import MPI

    comms: list[Any] = []

    def all_reduce(buf: Any) -> Any:
        MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return buf

    try:
        return measure(
            n,
            iters,
            MPI.Init,
            all_reduce,
            lambda: MPI.COMM_WORLD.Barrier(),
            lambda: comms.append(MPI.COMM_WORLD.Dup()),
            lambda: np.ones(1, dtype=np.float64),
            None,
            out,
        )
    finally:
        for comm in comms:
            comm.Free()
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()


def rank_main(args: argparse.Namespace) -> int:
    """One rank: wait for the go, measure, write rank.<r>.json (and, if it failed, what it
    measured before the failure there, and its traceback to error.<r>.txt)."""
    workdir = Path(args.workdir)
    backend = args.rank_of
    if backend == "mpi4py":
        rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))
    else:
        rank = int(os.environ["RANK"])
        _die_with_parent(args.parent)
    n = int(os.environ.get("WORLD_SIZE", args.world))
    values = RankValues(workdir / f"rank.{rank}.json")
    try:
        if backend in DISTCOMM_BACKENDS:
            import numpy  # noqa: F401  (imported before the go, as the others)

            import distcomm  # noqa: F401
        elif backend == "torch":
            import torch.distributed  # noqa: F401
        wait_for_go(workdir, rank)
        if backend in DISTCOMM_BACKENDS:
            distcomm_rank(backend, rank, n, args.iters, args.timeout, values)
        elif backend == "torch":
            torch_rank(rank, n, args.iters, args.timeout, values)
        else:
            mpi4py_rank(n, args.iters, values)
    except BaseException as exc:
        lines = traceback.format_exception(exc)
        (workdir / f"error.{rank}.txt").write_text("".join(lines))
        print(f"[rank {rank}/{n}] {lines[-1].strip()}", file=sys.stderr, flush=True)
        code = 1
    else:
        code = 0
    values.save()
    if code == 0:
        (workdir / f"done.{rank}").touch()
    return code


# -- in the parent -----------------------------------------------------------------------------


def free_port() -> int:
    """A port the system picks on 127.0.0.1 (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _child_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "DISTCOMM_GLOO_TRANSPORT",
        )
    }
    env.update(
        HYDRA_IFACE="lo",
        UCX_NET_DEVICES="lo",
        DISTCOMM_SOCKET_IFNAME="lo",
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def _kill_tree(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM each child's process group, a grace period, then SIGKILL, and reap them."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None or sig == signal.SIGKILL:
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + GRACE
        while sig == signal.SIGTERM and time.monotonic() < deadline:
            if all(proc.poll() is not None for proc in procs):
                break
            time.sleep(0.1)
    for proc in procs:
        try:
            proc.wait(timeout=GRACE)
        except subprocess.TimeoutExpired:
            pass


def leftovers(token: str) -> list[int]:
    """The processes (other than this one) whose command line names `token`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if token.encode() in cmdline:
            found.append(int(entry))
    return found


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def run_config(backend: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """Start N ranks of `backend`, release them together, collect their files: a row."""
    shm_before = _shm()
    row: dict[str, Any] = {"backend": backend, "nprocs": n, "status": "ok", "error": ""}
    with tempfile.TemporaryDirectory(prefix="dc-scale-") as tmp:
        workdir = Path(tmp)
        lock_path = workdir / "go.lock"
        lock_path.touch()
        lock = open(lock_path, "rb")  # noqa: SIM115  (held until every rank is ready)
        fcntl.flock(lock, fcntl.LOCK_EX)
        env = _child_env()
        me = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--rank-of",
            backend,
            "--workdir",
            tmp,
            "--world",
            str(n),
            "--iters",
            str(args.iters),
            "--timeout",
            str(args.timeout),
            "--parent",
            str(os.getpid()),
        ]
        procs: list[subprocess.Popen] = []
        log = open(workdir / "output.log", "wb")  # noqa: SIM115
        try:
            if backend == "mpi4py":
                mpiexec = shutil.which("mpiexec") or "mpiexec"
                procs.append(
                    subprocess.Popen(
                        [mpiexec, "-n", str(n), *me],
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=log,
                        start_new_session=True,
                    )
                )
            else:
                env.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(free_port()), WORLD_SIZE=str(n))
                if backend == "gloo-tcp":
                    env["DISTCOMM_GLOO_TRANSPORT"] = "tcp"
                for rank in range(n):
                    procs.append(
                        subprocess.Popen(
                            me,
                            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                            stdin=subprocess.DEVNULL,
                            stdout=log,
                            stderr=log,
                            start_new_session=True,
                        )
                    )
            row.update(_supervise(procs, workdir, n, lock, args.timeout + PARENT_MARGIN))
        finally:
            lock.close()
            if any(proc.poll() is None for proc in procs):
                _kill_tree(procs)
            log.close()
            stray = leftovers(tmp)
            for pid in stray:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if stray:
                print(
                    f"{backend}, {n} ranks: killed {len(stray)} processes left behind",
                    file=sys.stderr,
                )
        ranks = [json.loads(p.read_text()) for p in sorted(workdir.glob("rank.*.json"))]
        ranks = [r for r in ranks if r]  # a rank that failed before init measured nothing
        if row["status"] != "ok":
            row["error"] = row["error"] or _first_error(workdir)
            tail = (workdir / "output.log").read_text(errors="replace").strip().splitlines()
            print(
                f"{backend}, {n} ranks: {row['status']}: {row['error']}\n  "
                + "\n  ".join(tail[-5:]),
                file=sys.stderr,
            )
    new_shm = _shm() - shm_before
    if new_shm:
        print(
            f"{backend}, {n} ranks: new in /dev/shm afterwards: {sorted(new_shm)}", file=sys.stderr
        )
        row["error"] = (
            row["error"] + "; " if row["error"] else ""
        ) + f"left {len(new_shm)} entries in /dev/shm"
    row["ranks_reported"] = len(ranks)
    checked = [r["all_reduce_wrong"] for r in ranks if "all_reduce_wrong" in r]
    row["all_reduce_correct"] = all(w == 0 for w in checked) if checked else None
    for key, _, _ in MEASURES:
        values = [r[key] for r in ranks if r.get(key) is not None]
        row[f"{key}_median"] = statistics.median(values) if values else None
        row[f"{key}_max"] = max(values) if values else None
    return row


def _supervise(
    procs: list[subprocess.Popen], workdir: Path, n: int, lock: Any, limit: float
) -> dict[str, str]:
    """Wait for every rank to be ready, release them, wait for them to finish, all within
    `limit` seconds; stop at the first rank that exits with an error."""
    deadline = time.monotonic() + limit
    released = False
    while True:
        if not released and len(list(workdir.glob("ready.*"))) >= n:
            fcntl.flock(lock, fcntl.LOCK_UN)
            released = True
        codes = [proc.poll() for proc in procs]
        if all(code is not None for code in codes):
            bad = [code for code in codes if code != 0]
            if bad:
                return {"status": "failed", "error": ""}
            if len(list(workdir.glob("done.*"))) < n:
                return {"status": "failed", "error": "exited 0 without every rank's values"}
            return {}
        if any(code not in (None, 0) for code in codes) or any(workdir.glob("error.*")):
            time.sleep(2.0)  # let the other ranks write their own errors, then stop them
            return {"status": "failed", "error": ""}
        if time.monotonic() > deadline:
            ready = len(list(workdir.glob("ready.*")))
            done = len(list(workdir.glob("done.*")))
            where = (
                f"{ready} of {n} ranks started" if not released else f"{done} of {n} ranks finished"
            )
            return {"status": "timed out", "error": f"timed out after {limit:.0f} s ({where})"}
        time.sleep(0.2)


def _first_error(workdir: Path) -> str:
    """The last line of the earliest rank error (the root cause), else the exit codes."""
    errors = sorted(workdir.glob("error.*.txt"), key=lambda p: p.stat().st_mtime)
    if not errors:
        return "a rank exited with an error (no traceback recorded)"
    rank = errors[0].name.split(".")[1]
    last = errors[0].read_text().strip().splitlines()[-1]
    if len(last) > 200:
        last = last[:197] + "..."
    return f"rank {rank}: {last}"


def labels(backends: Sequence[str]) -> dict[str, str]:
    """Each backend as the table, the CSV and the plot name it, with the version."""
    import importlib.metadata

    import distcomm

    names = {
        "tcp": f"distcomm tcp ({distcomm.__version__})",
        "gloo": f"distcomm gloo ({distcomm.__version__})",
        "gloo-tcp": f"distcomm gloo, TCP only ({distcomm.__version__})",
    }
    if "mpi4py" in backends:
        names["mpi4py"] = f"raw mpi4py {importlib.metadata.version('mpi4py')}"
    if "torch" in backends:
        names["torch"] = f"torch gloo {importlib.metadata.version('torch')}"
    return names


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    median, most = row.get(f"{key}_median"), row.get(f"{key}_max")
    if median is None:
        peer = row["backend"] not in DISTCOMM_BACKENDS
        return "n/a" if peer and key.startswith("store") else "-"
    return f"{fmt.format(median)} / {fmt.format(most)}"


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| backend | N | status | " + " | ".join(h for _, h, _ in MEASURES) + " |")
    print("|---|---|---|" + "---|" * len(MEASURES))
    for row in rows:
        status = (
            row["status"]
            if row["all_reduce_correct"] in (True, None)
            else row["status"] + ", WRONG all_reduce"
        )
        if row["status"] != "ok":
            status += f" ({row['ranks_reported']} of {row['nprocs']} ranks reported)"
        if row["error"]:
            status += f": {row['error']}"
        print(
            f"| {row['backend']} | {row['nprocs']} | {status} | "
            + " | ".join(_cell(row, key, fmt) for key, _, fmt in MEASURES)
            + " |",
            flush=True,
        )


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sizes wants integers like 8,32,64, got {text!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--sizes wants integers >= 1, got {text!r}")
    return sizes


def _backends(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown backend(s) {unknown or text!r}; choose from {', '.join(BACKENDS)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=_sizes("8,32,64,128,256"),
        help="world sizes, comma separated (default 8,32,64,128,256)",
    )
    parser.add_argument(
        "--backends",
        type=_backends,
        default=_backends("tcp,gloo,gloo-tcp,mpi4py,torch"),
        help=f"comma separated, of {', '.join(BACKENDS)} (default all; "
        "torch is skipped when not installed)",
    )
    parser.add_argument(
        "--iters", type=int, default=50, help="timed all_reduces and barriers per rank (default 50)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds per configuration, start to exit (default 600)",
    )
    parser.add_argument("--csv", metavar="PATH", help="also write the rows here")
    parser.add_argument(
        "--png", metavar="PATH", help="also plot each measure against N (needs matplotlib)"
    )
    # a rank started by the parent
    parser.add_argument("--rank-of", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--parent", type=int, default=0, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rank_of:
        return rank_main(args)
    if args.iters < 1 or not args.timeout > 0:
        parser.error("need --iters >= 1 and --timeout > 0")
    if args.png:
        plots.require_matplotlib(parser)  # before the run, not after minutes of it
    backends = list(args.backends)
    if "torch" in backends and importlib.util.find_spec("torch") is None:
        print("# torch is not installed: skipping the torch backend", flush=True)
        backends.remove("torch")
    if "mpi4py" in backends and (
        importlib.util.find_spec("mpi4py") is None or shutil.which("mpiexec") is None
    ):
        print("# mpi4py or mpiexec is missing: skipping the mpi4py backend", flush=True)
        backends.remove("mpi4py")
    names = labels(backends)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"# {date.today().isoformat()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, load average at start {load}; each cell: median / "
        f"max over the ranks; {args.iters} timed 8-byte all_reduces and barriers per rank",
        flush=True,
    )
    rows = []
    for n in args.sizes:
        for backend in backends:
            start = time.monotonic()
            row = run_config(backend, n, args)
            row["label"] = names[backend]
            rows.append(row)
            print(
                f"# {backend}, {n} ranks: {row['status']} in {time.monotonic() - start:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    print_table(rows)
    if args.csv:
        plots.write_csv(rows, args.csv, FIELDS)
    if args.png:
        plots.scale(
            rows,
            args.png,
            f"{date.today().isoformat()}, {os.cpu_count()} CPUs, load average at start {load}",
        )
    return 0 if all(row["status"] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
