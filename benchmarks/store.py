"""TCPStore benchmark: distcomm.TCPStore beside torch.distributed.TCPStore, on 127.0.0.1.

Three measurements, distcomm's and torch's (when torch is importable) in the same run,
interleaved repetition by repetition so that load from elsewhere hits both alike:

- single client: calls per second of one client doing set (a 16-byte value), get (an
  existing key), add, wait (an existing key), check (an existing key) and compare_set
  (one that always succeeds): --count calls after a warm-up, --repeat times; the median.
- barrier: N clients (--clients) spread over --processes processes, one thread and one
  TCPStore connection per client, all connected and idle before the clock starts. At a
  common start each client calls add("arrive", 1); the one that reaches N sets "go";
  every client then waits for "go". The time from the start to the last client's return,
  --rounds times with fresh keys; the median and the minimum.
- connect+barrier: the same N clients over the same processes, none connected yet. At a
  common start each client creates its TCPStore (connects, as a job's processes do when
  they start together) and then does the barrier above; the time from the start to the
  last client's return, --rounds times (each round connects anew); the median and the
  minimum. With --clients 4096 this is a whole job's start-up against one server.
- CPU: the user+system CPU time of the server's process while the single-client calls
  ran, divided by the calls (in microseconds), and over a barrier (or connect+barrier)
  round, divided by N; the same for the client process(es), to show which side a
  difference comes from.

Each implementation's server runs in a process of its own: a master TCPStore on port 0
with wait_for_workers=False, whose main thread only answers CPU-time queries on a pipe.
Every client runs in other processes (multiprocessing's spawn context).

Examples::

    python benchmarks/store.py
    python benchmarks/store.py --quick
    python benchmarks/store.py --clients 64,256 --processes 2 --impl ours --json store.json
    python benchmarks/store.py --csv store.csv --png store.png
    python benchmarks/store.py --count 2000 --clients 4096 --processes 8   # a job's start
    python benchmarks/plots.py store store.csv --png store.png   # redrawn from the CSV
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
import os
import platform
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import date, timedelta
from typing import Any

import plots  # benchmarks/plots.py, beside this script
from children import child, command  # benchmarks/children.py, beside it too

from distcomm.launch.errors import exit_description
from distcomm.net import raise_file_limit

LOOPBACK = "127.0.0.1"
IMPLS = ("ours", "torch")
LABELS = {"ours": "distcomm", "torch": "torch"}
#: The single-client calls, in the order measured.
OPS = ("set", "get", "add", "wait", "check", "compare_set")
#: Requests each call puts on the wire: torch's get is a WAIT then a GET.
WIRE_REQUESTS = {"ours": dict.fromkeys(OPS, 1), "torch": {**dict.fromkeys(OPS, 1), "get": 2}}
VALUE = b"v" * 16
#: Seconds between the parent's "go" and the common start of a barrier round.
START_LEAD = 0.1
#: The defaults of the sizes of the run, and those of --quick.
DEFAULTS = {"count": 20000, "repeat": 3, "clients": (64, 256, 1024, 2048), "rounds": 5}
QUICK = {"count": 2000, "repeat": 3, "clients": (64, 256), "rounds": 3}
#: Connections a barrier process opens at once (keeps below the server's listen backlog).
CONNECTING_AT_ONCE = 32
#: The stack of each client thread of a connect+barrier process (it starts thousands).
THREAD_STACK = 512 << 10


class BenchError(RuntimeError):
    """A child process failed, died or did not answer in time."""


# -- command line ------------------------------------------------------------------------------


def parse_clients(text: str) -> tuple[int, ...]:
    """'64,256,1024' -> (64, 256, 1024); '' or 'none' -> () (no barrier rows)."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"--clients wants a comma-separated list of client counts >= 1 (e.g. 64,256,1024), "
            f"or 'none', got {text!r}"
        )
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""\
reading the table: 'better' says whether a higher or a lower number wins; ours/torch is
  distcomm's number divided by torch's (so above 1 wins for ops/s, below 1 for times and
  CPU). The barrier cells are the median round, the fastest in brackets.
server CPU per call: a call is one Store method call; torch's get puts two requests on
  the wire (a WAIT, then a GET), distcomm's one (MULTI_GET); the others are one request
  each in both. The CPU time includes the server process's idle master client and its
  pipe to this script (two queries per measurement).
environment: the children get TORCH_CPP_LOG_LEVEL=ERROR (torch warns once per connection
  that it cannot resolve the peer's name) and RES_OPTIONS='timeout:1 attempts:1' (torch
  looks that name up on the DNS; where queries go unanswered each connect would stall 5 s
  or more); both only where not set already, neither touches the timed calls.
clocks: the barrier's start and end times are time.monotonic() in different processes
  (one system-wide clock on Linux). Each barrier process sleeps until the common start,
  then releases its threads, so waking the threads is part of the time, alike for both.""",
    )
    parser.add_argument(
        "--impl",
        choices=("ours", "torch", "both"),
        default="both",
        help="which TCPStore to measure (default both; torch's is skipped "
        "with a note when torch is not importable)",
    )
    parser.add_argument(
        "--count", type=int, help="timed calls per single-client measurement (default 20000)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed calls before each (default --count / 10)"
    )
    parser.add_argument(
        "--repeat", type=int, help="single-client measurements per op and store (default 3)"
    )
    parser.add_argument(
        "--clients",
        type=parse_clients,
        help="barrier sizes, comma-separated, or 'none' (default 64,256,1024,2048)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=4,
        help="processes the barrier clients are spread over (default 4)",
    )
    parser.add_argument("--rounds", type=int, help="barrier rounds per size and store (default 5)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short run: --count 2000 --repeat 3 --clients 64,256 --rounds 3 "
        "(explicit options still win)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds any one step may take: a store call, a child's answer, "
        "connecting the clients of one barrier (default 60)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the raw numbers here")
    parser.add_argument(
        "--csv",
        metavar="PATH",
        help="also write every run of every measurement here, one row each "
        "(benchmarks/plots.py store redraws the picture from it)",
    )
    parser.add_argument(
        "--png",
        metavar="PATH",
        help="also plot each store's runs side by side: calls/s, barrier "
        "time, CPU per call, connect time (needs matplotlib)",
    )
    return parser


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], str | None]:
    """The options, the stores to measure and torch's version (None: not measured)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:  # options given explicitly win
            setattr(args, name, value)
    if args.warmup is None:
        args.warmup = max(1, args.count // 10)
    for name in ("count", "repeat", "processes", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or not args.timeout > 0:
        parser.error(f"need --warmup >= 0 and --timeout > 0, got {args.warmup} and {args.timeout}")
    if args.png:
        plots.require_matplotlib(parser)  # before the run, not after minutes of it
    impls = list(IMPLS) if args.impl == "both" else [args.impl]
    torch_version = None
    if "torch" in impls:
        try:
            import torch
            import torch.distributed as tdist

            if not tdist.is_available():
                raise ImportError("this build has no torch.distributed")
            torch_version = torch.__version__
        except ImportError as exc:
            if args.impl == "torch":
                parser.error(
                    f"--impl torch needs PyTorch, which is not importable in this "
                    f"Python ({sys.executable}: {exc})"
                )
            print(f"# note: torch is not importable ({exc}): measuring distcomm alone", flush=True)
            impls.remove("torch")
    return args, impls, torch_version


# -- children ----------------------------------------------------------------------------------


def _store_class(impl: str) -> Any:
    """distcomm.TCPStore or torch.distributed.TCPStore (imported here, not in the timing)."""
    if impl == "ours":
        from distcomm import TCPStore
    else:
        from torch.distributed import TCPStore
    return TCPStore


def _make_store(impl: str, port: int, is_master: bool, timeout: float) -> Any:
    """A TCPStore of either library, built with the same (torch's) constructor call."""
    return _store_class(impl)(LOOPBACK, port, None, is_master, timedelta(seconds=timeout), False)


def _serve(
    conn: multiprocessing.connection.Connection,
    impl: str,
    timeout: float,
    cpu_conn: multiprocessing.connection.Connection,
) -> None:
    """A server process: the master store; then answer CPU-time queries until "stop"."""
    store = _make_store(impl, 0, True, timeout)
    conn.send(("ok", (store.port, os.getpid())))
    conns = [conn, cpu_conn]
    idle_limit = 20 * timeout
    while True:
        ready = multiprocessing.connection.wait(conns, idle_limit)
        if not ready:
            raise TimeoutError(f"no query for {idle_limit:.0f} s")
        for ready_conn in ready:
            try:
                message = ready_conn.recv()
            except EOFError:
                if ready_conn is conn:
                    return  # the parent is gone
                conns.remove(ready_conn)
                continue
            if message == "stop":
                if hasattr(store, "close"):
                    store.close()
                return
            ready_conn.send(("ok", time.process_time()))  # every thread, user + system


def _op_loop(store: Any, op: str) -> Callable[[int], None]:
    """`n` calls of `op` on `store`, the keys set up beforehand."""
    key = f"bench/{op}"
    if op in ("get", "wait", "check", "compare_set"):
        store.set(key, VALUE)
    if op == "set":

        def run(n: int, call: Any = store.set) -> None:
            for _ in range(n):
                call(key, VALUE)
    elif op == "get":

        def run(n: int, call: Any = store.get) -> None:
            for _ in range(n):
                call(key)
    elif op == "add":

        def run(n: int, call: Any = store.add) -> None:
            for _ in range(n):
                call(key, 1)
    elif op == "wait":

        def run(n: int, call: Any = store.wait) -> None:
            keys = [key]
            for _ in range(n):
                call(keys)
    elif op == "check":

        def run(n: int, call: Any = store.check) -> None:
            keys = [key]
            for _ in range(n):
                call(keys)
    elif op == "compare_set":

        def run(n: int, call: Any = store.compare_set) -> None:
            for _ in range(n):
                call(key, VALUE, VALUE)
    else:
        raise ValueError(f"unknown op {op!r}: choose from {', '.join(OPS)}")

    def run_acknowledged(n: int, check: Any = store.check) -> None:
        run(n)
        check([key])  # torch's set is not acknowledged: wait until the server applied them all

    return run_acknowledged


def _single_client(
    conn: multiprocessing.connection.Connection,
    impl: str,
    port: int,
    timeout: float,
    cpu_conn: multiprocessing.connection.Connection,
) -> None:
    """One client: run each ("op", name, count, warmup) command; report the seconds, the
    server process's CPU seconds and this process's."""
    store = _make_store(impl, port, False, timeout)
    conn.send(("ok", None))

    def server_cpu() -> float:
        cpu_conn.send("cpu")
        if not cpu_conn.poll(timeout):
            raise TimeoutError(f"the {impl} server process did not report its CPU time")
        return cpu_conn.recv()[1]

    while True:
        message = command(conn, 20 * timeout)
        if message == "stop":
            return
        _, op, count, warmup = message
        run = _op_loop(store, op)
        run(warmup)
        cpu = server_cpu()
        own = time.process_time()
        start = time.perf_counter()
        run(count)
        seconds = time.perf_counter() - start
        own = time.process_time() - own
        conn.send(("ok", (seconds, server_cpu() - cpu, own)))


def _barrier_clients(
    conn: multiprocessing.connection.Connection,
    impl: str,
    port: int,
    total: int,
    local: int,
    rounds: int,
    timeout: float,
) -> None:
    """`local` of the barrier's `total` clients, one thread and connection each.

    Commands: "connect" (answer: seconds to connect all), ("go", round, start) for each
    round (answer: the last client's end time, how late this process released its
    threads, the CPU seconds this process spent on the round), "stop".
    """
    starts = [threading.Event() for _ in range(rounds)]
    ends = [[0.0] * local for _ in range(rounds)]
    done = [threading.Semaphore(0) for _ in range(rounds)]
    connected = threading.Semaphore(0)
    gate = threading.Semaphore(CONNECTING_AT_ONCE)
    errors: list[str] = []

    def client(index: int) -> None:
        try:
            with gate:
                store = _make_store(impl, port, False, timeout)
            connected.release()
            for r in range(rounds):
                if not starts[r].wait(20 * timeout):
                    raise TimeoutError(f"barrier round {r} never started")
                prefix = f"barrier{total}/round{r}/"
                if store.add(prefix + "arrive", 1) == total:
                    store.set(prefix + "go", b"1")
                store.wait([prefix + "go"])
                ends[r][index] = time.monotonic()
                done[r].release()
        except BaseException:
            errors.append(f"client {index}: {traceback.format_exc()}")
            connected.release()
            for r in range(rounds):
                done[r].release()

    def collect(semaphore: threading.Semaphore, what: str) -> None:
        deadline = time.monotonic() + timeout
        for _ in range(local):
            if not semaphore.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(
                    f"{what}: not every client of this process finished within {timeout:.0f} s"
                )
            if errors:
                raise RuntimeError(
                    f"{what} failed in {len(errors)} client(s); the first:\n{errors[0]}"
                )

    _store_class(impl)  # the import is no part of the connect time
    conn.send(("ok", None))  # imported and ready to connect
    if command(conn, 20 * timeout) != "connect":
        raise RuntimeError("expected 'connect'")
    began = time.monotonic()
    for index in range(local):
        threading.Thread(target=client, args=(index,), daemon=True).start()
    collect(connected, f"connecting {local} clients")
    conn.send(("ok", time.monotonic() - began))
    for r in range(rounds):
        _, number, start = command(conn, 20 * timeout)
        if number != r:
            raise RuntimeError(f"expected round {r}, got {number}")
        time.sleep(max(0.0, start - time.monotonic()))
        late = time.monotonic() - start
        cpu = time.process_time()
        starts[number].set()
        collect(done[number], f"barrier round {number}")
        conn.send(("ok", (max(ends[number]), late, time.process_time() - cpu)))
    if command(conn, 20 * timeout) != "stop":
        raise RuntimeError("expected 'stop'")


def _connect_barrier_clients(
    conn: multiprocessing.connection.Connection,
    impl: str,
    port: int,
    total: int,
    local: int,
    timeout: float,
) -> None:
    """`local` of the connect+barrier's `total` clients, one thread each, none connected.

    Commands: ("ready", round) starts the round's threads, which wait (answer: None);
    ("go", round, start): at `start` each thread creates its TCPStore, then does the
    barrier (answer: the last client's end time, how late this process released its
    threads, the CPU seconds this process spent); the stores are closed before the
    answer, out of the time; "stop".
    """
    _store_class(impl)  # the import is no part of the time
    threading.stack_size(THREAD_STACK)  # thousands of threads: keep their stacks small
    conn.send(("ok", None))
    while True:
        message = command(conn, 20 * timeout)
        if message == "stop":
            return
        _, number = message
        go = threading.Event()
        ends = [0.0] * local
        stores: list[Any] = [None] * local
        done = threading.Semaphore(0)
        errors: list[str] = []
        prefix = f"connect{total}/round{number}/"

        def client(
            index: int,
            go: threading.Event = go,
            ends: list[float] = ends,
            stores: list[Any] = stores,
            done: threading.Semaphore = done,
            errors: list[str] = errors,
            prefix: str = prefix,
        ) -> None:
            try:
                if not go.wait(20 * timeout):
                    raise TimeoutError("the round never started")
                store = stores[index] = _make_store(impl, port, False, timeout)
                if store.add(prefix + "arrive", 1) == total:
                    store.set(prefix + "go", b"1")
                store.wait([prefix + "go"])
                ends[index] = time.monotonic()
            except BaseException:
                errors.append(f"client {index}: {traceback.format_exc()}")
            finally:
                done.release()

        for index in range(local):
            threading.Thread(target=client, args=(index,), daemon=True).start()
        conn.send(("ok", None))
        _, again, start = command(conn, 20 * timeout)
        if again != number:
            raise RuntimeError(f"expected round {number}, got {again}")
        time.sleep(max(0.0, start - time.monotonic()))
        late = time.monotonic() - start
        cpu = time.process_time()
        go.set()
        deadline = time.monotonic() + timeout
        for _ in range(local):
            if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(
                    f"connect+barrier round {number}: not every client of this "
                    f"process finished within {timeout:.0f} s"
                )
        if errors:
            raise RuntimeError(
                f"connect+barrier round {number} failed in {len(errors)} "
                f"client(s); the first:\n{errors[0]}"
            )
        cpu = time.process_time() - cpu
        for store in stores:  # torch's has no close(): dropping it closes its socket
            if hasattr(store, "close"):
                store.close()
        stores.clear()
        conn.send(("ok", (max(ends), late, cpu)))


# -- the parent's side -------------------------------------------------------------------------


class Children:
    """The child processes of this run: start, talk to with timeouts, and kill."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: list[Any] = []

    def start(self, name: str, target: Callable[..., None], *args: Any) -> tuple[Any, Any]:
        """Spawn `target(conn, *args)`; (process, the parent's end of its pipe)."""
        parent_end, child_end = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=child, args=(target, child_end, *args), name=name, daemon=True
        )
        proc.start()
        child_end.close()
        self.procs.append(proc)
        return proc, parent_end

    def recv(self, proc: Any, conn: Any, what: str, timeout: float | None = None) -> Any:
        """The payload of the child's next ("ok", payload) answer.

        Raises:
            BenchError: the child reported an error, died or did not answer in time.
        """
        limit = self.timeout if timeout is None else timeout
        ready = multiprocessing.connection.wait([conn, proc.sentinel], limit)
        if conn in ready or conn.poll():
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                proc.join(1.0)
                raise BenchError(
                    f"{proc.name} exited during {what}: {exit_description(proc.exitcode)}"
                ) from None
            if kind == "error":
                raise BenchError(f"{proc.name} failed during {what}:\n{payload.rstrip()}")
            return payload
        if ready:
            proc.join(1.0)
            raise BenchError(f"{proc.name} exited during {what}: {exit_description(proc.exitcode)}")
        raise BenchError(f"{proc.name} did not answer within {limit:.0f} s during {what}")

    def call(
        self, proc: Any, conn: Any, message: Any, what: str, timeout: float | None = None
    ) -> Any:
        conn.send(message)
        return self.recv(proc, conn, what, timeout)

    def stop(self, proc: Any, conn: Any) -> None:
        """Ask a child to stop; kill it if it is still alive after a grace period."""
        try:
            conn.send("stop")
        except OSError:
            pass
        proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
        conn.close()
        if proc in self.procs:
            self.procs.remove(proc)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5.0)
        self.procs.clear()


class Server:
    """One implementation's server process, and a pipe to ask it for its CPU time."""

    def __init__(self, children: Children, impl: str, timeout: float) -> None:
        self.children, self.impl = children, impl
        self.cpu_parent_end, self.cpu_child_end = children.ctx.Pipe()
        self.proc, self.conn = children.start(
            f"{LABELS[impl]} server", _serve, impl, timeout, self.cpu_child_end
        )
        self.port, self.pid = children.recv(
            self.proc, self.conn, "the server's start", timeout=timeout + 30
        )

    def cpu(self) -> float:
        """The server process's CPU seconds so far (user + system, every thread)."""
        return self.children.call(self.proc, self.conn, "cpu", "a CPU-time query")

    def stop(self) -> None:
        self.children.stop(self.proc, self.conn)


def run_single(
    args: argparse.Namespace, impls: list[str], servers: dict[str, Server], children: Children
) -> dict[str, Any]:
    """The single-client rows: per store and op, calls/s and server CPU per call."""
    clients = {}
    for impl in impls:
        proc, conn = children.start(
            f"{LABELS[impl]} single client",
            _single_client,
            impl,
            servers[impl].port,
            args.timeout,
            servers[impl].cpu_parent_end,
        )
        clients[impl] = (proc, conn)
    for impl in impls:
        children.recv(*clients[impl], "the single client's start", timeout=args.timeout + 30)
    results: dict[str, Any] = {impl: {} for impl in impls}
    for op in OPS:
        for _ in range(args.repeat):
            for impl in impls:  # interleaved: load changes hit both alike
                seconds, cpu, own = children.call(
                    *clients[impl],
                    ("op", op, args.count, args.warmup),
                    f"{op} x {args.count}",
                    timeout=20 * args.timeout,
                )
                row = results[impl].setdefault(
                    op, {"seconds": [], "server_cpu_s": [], "client_cpu_s": []}
                )
                row["seconds"].append(seconds)
                row["server_cpu_s"].append(cpu)
                row["client_cpu_s"].append(own)
    for impl in impls:
        children.stop(*clients[impl])
        for op, row in results[impl].items():
            rates = [args.count / s for s in row["seconds"]]
            cpu_us = [1e6 * c / args.count for c in row["server_cpu_s"]]
            own_us = [1e6 * c / args.count for c in row["client_cpu_s"]]
            row.update(
                ops_per_s=rates,
                ops_per_s_median=statistics.median(rates),
                server_cpu_us_per_call=cpu_us,
                server_cpu_us_per_call_median=statistics.median(cpu_us),
                client_cpu_us_per_call=own_us,
                client_cpu_us_per_call_median=statistics.median(own_us),
                wire_requests_per_call=WIRE_REQUESTS[impl][op],
            )
    return results


def run_barrier(
    args: argparse.Namespace,
    impls: list[str],
    servers: dict[str, Server],
    children: Children,
    total: int,
) -> dict[str, Any]:
    """The barrier rows for `total` clients: each store's round times and server CPU."""
    nprocs = min(args.processes, total)
    shares = [total // nprocs + (1 if i < total % nprocs else 0) for i in range(nprocs)]
    groups: dict[str, list[tuple[Any, Any]]] = {}
    try:
        for impl in impls:  # all start (and import) at once; they connect one store at a time
            groups[impl] = [
                children.start(
                    f"{LABELS[impl]} barrier process {i}",
                    _barrier_clients,
                    impl,
                    servers[impl].port,
                    total,
                    share,
                    args.rounds,
                    args.timeout,
                )
                for i, share in enumerate(shares)
            ]
        for impl in impls:
            for proc, conn in groups[impl]:
                children.recv(
                    proc, conn, "the start of a barrier process", timeout=args.timeout + 30
                )
        result: dict[str, Any] = {}
        for impl in impls:
            for _, conn in groups[impl]:
                conn.send("connect")
            connect = max(
                children.recv(proc, conn, f"connecting {total} clients")
                for proc, conn in groups[impl]
            )
            result[impl] = {
                "connect_s": connect,
                "seconds": [],
                "server_cpu_s": [],
                "client_cpu_s": [],
                "late_start_s": [],
            }
        for r in range(args.rounds):
            for impl in impls:
                _timed_round(
                    result[impl],
                    servers[impl],
                    groups[impl],
                    children,
                    f"barrier round {r} of {total} clients",
                    r,
                )
        return _summarize(result, impls, nprocs, shares, total)
    finally:
        for members in groups.values():
            for proc, conn in members:
                children.stop(proc, conn)


def _timed_round(
    row: dict[str, Any],
    server: Server,
    members: list[tuple[Any, Any]],
    children: Children,
    what: str,
    r: int,
) -> None:
    """One round of a barrier measurement: every process of `members` starts its clients at
    one moment; the time to the last client's return, the server's and the clients' CPU."""
    cpu = server.cpu()
    start = time.monotonic() + START_LEAD
    for _, conn in members:
        conn.send(("go", r, start))
    answers = [children.recv(proc, conn, what) for proc, conn in members]
    row["server_cpu_s"].append(server.cpu() - cpu)
    row["seconds"].append(max(end for end, _, _ in answers) - start)
    row["late_start_s"].append(max(late for _, late, _ in answers))
    row["client_cpu_s"].append(sum(cpu for _, _, cpu in answers))


def _summarize(
    result: dict[str, Any], impls: list[str], nprocs: int, shares: list[int], total: int
) -> dict[str, Any]:
    """Each store's rows with their minimum, median and CPU per client added."""
    for impl in impls:
        row = result[impl]
        row.update(
            processes=nprocs,
            clients_per_process=shares,
            min_s=min(row["seconds"]),
            median_s=statistics.median(row["seconds"]),
            server_cpu_us_per_client=[1e6 * c / total for c in row["server_cpu_s"]],
            client_cpu_us_per_client=[1e6 * c / total for c in row["client_cpu_s"]],
        )
        for name in ("server_cpu_us_per_client", "client_cpu_us_per_client"):
            row[name + "_median"] = statistics.median(row[name])
    return result


def run_connect_barrier(
    args: argparse.Namespace,
    impls: list[str],
    servers: dict[str, Server],
    children: Children,
    total: int,
) -> dict[str, Any]:
    """The connect+barrier rows for `total` clients: each store's round times, server CPU."""
    nprocs = min(args.processes, total)
    shares = [total // nprocs + (1 if i < total % nprocs else 0) for i in range(nprocs)]
    groups: dict[str, list[tuple[Any, Any]]] = {}
    try:
        for impl in impls:
            groups[impl] = [
                children.start(
                    f"{LABELS[impl]} connect+barrier process {i}",
                    _connect_barrier_clients,
                    impl,
                    servers[impl].port,
                    total,
                    share,
                    args.timeout,
                )
                for i, share in enumerate(shares)
            ]
        for impl in impls:
            for proc, conn in groups[impl]:
                children.recv(
                    proc, conn, "the start of a connect+barrier process", timeout=args.timeout + 30
                )
        result: dict[str, Any] = {
            impl: {"seconds": [], "server_cpu_s": [], "client_cpu_s": [], "late_start_s": []}
            for impl in impls
        }
        for r in range(args.rounds):
            for impl in impls:  # interleaved, round by round
                for proc, conn in groups[impl]:
                    children.call(proc, conn, ("ready", r), f"starting the threads of round {r}")
                _timed_round(
                    result[impl],
                    servers[impl],
                    groups[impl],
                    children,
                    f"connect+barrier round {r} of {total} clients",
                    r,
                )
        return _summarize(result, impls, nprocs, shares, total)
    finally:
        for members in groups.values():
            for proc, conn in members:
                children.stop(proc, conn)


# -- the report --------------------------------------------------------------------------------


def machine(torch_version: str | None) -> dict[str, Any]:
    import distcomm

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpus": os.cpu_count(),
        "usable_cpus": usable,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "distcomm": distcomm.__version__,
        "torch": torch_version,
        "load_average": list(os.getloadavg()),
    }


def _num(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ops/s":
        return f"{value:,.0f}"
    if unit == "ms":
        return f"{value:.1f}" if value >= 10 else f"{value:.2f}"
    return f"{value:.1f}"


def print_table(report: dict[str, Any], impls: list[str], args: argparse.Namespace) -> None:
    info = report["machine"]
    versions = f"distcomm {info['distcomm']}" + (
        f" vs torch {info['torch']}" if info["torch"] else ""
    )
    print(
        f"\n# TCPStore on {LOOPBACK}: {versions}; {info['cpus']} CPUs ({info['usable_cpus']} "
        f"usable), Python {info['python']}, {info['platform']}, load average at start "
        + " ".join(f"{x:.2f}" for x in info["load_average"])
    )
    print(
        f"# single client: {args.count} calls after {args.warmup} warm-up, median of "
        f"{args.repeat}; barrier: clients over {args.processes} processes, median of "
        f"{args.rounds} rounds (fastest in brackets)"
    )
    both = len(impls) == 2
    head = "| measurement | better | " + " | ".join(LABELS[i] for i in impls) + " |"
    print(head + (" ours/torch |" if both else ""))
    print("|---|---|" + "---|" * len(impls) + ("---|" if both else ""))

    def line(
        name: str,
        better: str,
        unit: str,
        values: list[float | None],
        extra: list[str] | None = None,
    ) -> None:
        cells = [_num(v, unit) + (extra[k] if extra else "") for k, v in enumerate(values)]
        text = f"| {name} ({unit}) | {better} | " + " | ".join(cells) + " |"
        if both:
            ours, theirs = values
            text += f" {ours / theirs:.2f} |" if ours and theirs else " - |"
        print(text)

    single = report["single"]
    for op in OPS:
        line(
            f"{op}, 1 client", "higher", "ops/s", [single[i][op]["ops_per_s_median"] for i in impls]
        )
    for total in args.clients:
        rows = report["barrier"][str(total)]
        line(
            f"barrier, {total} clients",
            "lower",
            "ms",
            [1e3 * rows[i]["median_s"] for i in impls],
            [f" ({1e3 * rows[i]['min_s']:.1f})" for i in impls],
        )
    for total in args.clients:
        rows = report["connect_barrier"][str(total)]
        line(
            f"connect+barrier, {total} clients",
            "lower",
            "ms",
            [1e3 * rows[i]["median_s"] for i in impls],
            [f" ({1e3 * rows[i]['min_s']:.1f})" for i in impls],
        )
    for op in OPS:
        note = [" (2 requests)" if WIRE_REQUESTS[i][op] == 2 else "" for i in impls]
        line(
            f"server CPU per call: {op}",
            "lower",
            "us",
            [single[i][op]["server_cpu_us_per_call_median"] for i in impls],
            note,
        )
    for op in OPS:
        line(
            f"client CPU per call: {op}",
            "lower",
            "us",
            [single[i][op]["client_cpu_us_per_call_median"] for i in impls],
        )
    for side in ("server", "client"):
        for total in args.clients:
            rows = report["barrier"][str(total)]
            line(
                f"{side} CPU per client, barrier of {total}",
                "lower",
                "us",
                [rows[i][f"{side}_cpu_us_per_client_median"] for i in impls],
            )
        for total in args.clients:
            rows = report["connect_barrier"][str(total)]
            line(
                f"{side} CPU per client, connect+barrier of {total}",
                "lower",
                "us",
                [rows[i][f"{side}_cpu_us_per_client_median"] for i in impls],
            )
    for total in args.clients:
        rows = report["barrier"][str(total)]
        line(
            f"connect {total} clients (not in the barrier time)",
            "lower",
            "ms",
            [1e3 * rows[i]["connect_s"] for i in impls],
        )
    print(
        "# ours/torch: distcomm's number over torch's; with 'better: higher' above 1 means "
        "distcomm is faster, with 'lower' below 1 does. A call of torch's get is two "
        "requests on the wire (WAIT + GET), distcomm's one. Client CPU: the client "
        "process(es), loop and threads included.",
        flush=True,
    )
    if "torch" in impls and args.clients:
        print(
            "# torch's connect times include a reverse DNS lookup of each connection's peer "
            "(::ffff:127.0.0.1) by its client and by its server: a query the DNS server leaves "
            "unanswered stalls the connect until the resolver gives up (RES_OPTIONS="
            f"{os.environ.get('RES_OPTIONS', '')!r} here).",
            flush=True,
        )


def store_label(impl: str, info: dict[str, Any]) -> str:
    """The store as the CSV and the plot name it: its library and version."""
    return f"{LABELS[impl]} {info['distcomm' if impl == 'ours' else 'torch']} TCPStore"


def csv_rows(report: dict[str, Any], impls: list[str]) -> list[dict[str, Any]]:
    """The report as rows of plots.STORE_FIELDS: one per run of each measurement and store
    (the single client's repeats, the barrier's rounds, one connect per barrier size)."""
    rows: list[dict[str, Any]] = []

    def add(impl: str, measurement: str, op: str, clients: int, values: list[float]) -> None:
        label = store_label(impl, report["machine"])
        rows.extend(
            dict(
                impl=impl,
                label=label,
                measurement=measurement,
                op=op,
                clients=clients,
                run=run,
                value=value,
            )
            for run, value in enumerate(values)
        )

    for impl in impls:
        for op, row in report["single"].get(impl, {}).items():
            add(impl, "calls_per_s", op, 1, row["ops_per_s"])
            add(impl, "server_cpu_us_per_call", op, 1, row["server_cpu_us_per_call"])
            add(impl, "client_cpu_us_per_call", op, 1, row["client_cpu_us_per_call"])
    for total, result in report["barrier"].items():
        for impl in impls:
            row = result[impl]
            add(impl, "barrier_ms", "barrier", int(total), [1e3 * s for s in row["seconds"]])
            add(
                impl,
                "barrier_server_cpu_us_per_client",
                "barrier",
                int(total),
                row["server_cpu_us_per_client"],
            )
            add(
                impl,
                "barrier_client_cpu_us_per_client",
                "barrier",
                int(total),
                row["client_cpu_us_per_client"],
            )
            add(impl, "connect_ms", "connect", int(total), [1e3 * row["connect_s"]])
    for total, result in report.get("connect_barrier", {}).items():
        for impl in impls:
            row = result[impl]
            add(
                impl,
                "connect_barrier_ms",
                "connect+barrier",
                int(total),
                [1e3 * s for s in row["seconds"]],
            )
            add(
                impl,
                "connect_barrier_server_cpu_us_per_client",
                "connect+barrier",
                int(total),
                row["server_cpu_us_per_client"],
            )
    return rows


def plot_title(report: dict[str, Any], args: argparse.Namespace) -> str:
    """The line under the plot's heading: the machine, the day and the run's sizes."""
    info = report["machine"]
    return (
        f"{date.today().isoformat()}, {info['cpus']} CPUs ({info['usable_cpus']} usable), "
        f"Python {info['python']}, load average at start "
        + " ".join(f"{x:.2f}" for x in info["load_average"])
        + f"; one client: {args.count} calls per run, {args.repeat} runs; barrier: "
        f"clients over {args.processes} processes, {args.rounds} rounds"
    )


def main(argv: list[str] | None = None) -> int:
    args, impls, torch_version = parse_args(argv)
    # torch's clients warn about every unresolvable peer name ("hostname ... cannot be retrieved")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # and its client and server look up each connection's peer name (::ffff:127.0.0.1, which no
    # hosts file lists) on the DNS: a resolver that never answers would stall every connect
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    raise_file_limit()
    children = Children(args.timeout)
    report: dict[str, Any] = {
        "machine": machine(torch_version),
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "csv", "png")},
        "single": {},
        "barrier": {},
        "connect_barrier": {},
    }
    servers: dict[str, Server] = {}
    began = time.monotonic()
    try:
        for impl in impls:
            servers[impl] = Server(children, impl, args.timeout)
        up = ", ".join(f"{LABELS[i]} pid {s.pid} port {s.port}" for i, s in servers.items())
        print(f"# servers up ({up}); single client ...", flush=True)
        report["single"] = run_single(args, impls, servers, children)
        for total in args.clients:
            print(f"# barrier of {total} clients ...", flush=True)
            report["barrier"][str(total)] = run_barrier(args, impls, servers, children, total)
            print(f"# connect+barrier of {total} clients ...", flush=True)
            report["connect_barrier"][str(total)] = run_connect_barrier(
                args, impls, servers, children, total
            )
        for server in servers.values():
            server.stop()
    except BenchError as exc:
        print(f"\nerror: {exc}\nevery child process is stopped.", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every child process", file=sys.stderr)
        return 130
    finally:
        children.kill_all()
    report["wall_s"] = time.monotonic() - began
    print_table(report, impls, args)
    print(f"# {report['wall_s']:.0f} s in all", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"# wrote the raw numbers to {args.json}", flush=True)
    if args.csv or args.png:
        rows = csv_rows(report, impls)
        if args.csv:
            plots.write_csv(rows, args.csv, plots.STORE_FIELDS)
        if args.png:
            plots.store(rows, args.png, plot_title(report, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
