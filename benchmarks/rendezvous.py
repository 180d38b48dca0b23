"""The elastic launcher's rendezvous at scale: N simulated nodes form rounds, on 127.0.0.1.

A simulated node is what one agent of distcomm-run is to the rendezvous, without workers: a
handler made as the launcher makes it, ``get_rendezvous_handler(RendezvousParameters(
backend, endpoint, run_id, min_nodes=N, max_nodes=N, local_addr="127.0.0.1", config=...))``,
whose ``next_rendezvous()`` runs in a thread of its own. The N nodes are spread over
--processes processes (multiprocessing's spawn context), many threads in each, against one
of the three dynamic backends:

- c10d: one more process hosts the TCPStore: its handler is made with the endpoint
  "127.0.0.1:0" and is_host=true and never joins a round; the nodes get the port it bound
  and is_host=false;
- etcd: a real single-member etcd on 127.0.0.1 (tests/etcd_server.py starts Debian's
  etcd-server), one for the whole run, a new run id for each configuration;
- file: a FileStore file in a temporary directory.

Only the rendezvous's public API is used: ``next_rendezvous()``, ``watch()``,
``shutdown()``, RendezvousInfo's ``rank``, ``world_size`` and ``round`` (and the c10d host
handler's ``bootstrap_address`` to learn the port it bound). For each backend and N:

- round: from a common start (every node process releases its threads at one
  time.monotonic()) to the last node's RendezvousInfo. Ranks 0..N-1 must come out exactly
  once, with one world size N and one round number on every node; a configuration that
  fails the check is reported FAILED, with what was wrong, and the script exits 1. A round
  that does not complete within --timeout is reported as such (with how many nodes had
  their RendezvousInfo), and the next configuration runs.
- requests per node per round: in every node process, before any handler is made, each
  request method of the stores that talk to the server or the file (TCPStore, FileStore,
  EtcdStore; PrefixStore is left alone, it only forwards) is wrapped by a counter. One call
  is one request; a request method that another calls (TCPStore.get calls multi_get) counts
  once. Each process takes its count when the last of its nodes has its RendezvousInfo
  (the heartbeat threads' requests until then included); the sum over the processes,
  divided by N.
- heartbeat load: once the round is complete every node polls ``watch()`` every 0.5 s,
  as the launcher's agent does while its workers run; for --window
  keep-alive intervals the requests are counted, per node and per interval, split into the
  handlers' own threads (their heartbeats) and the nodes' threads (the watch polls).
- state: after that window, a client of its own (not counted) lists the store's keys and
  reads every key whose name contains the run id (key names are the backend's to choose,
  so that is the only rule); their number and the bytes of their values.
- recovery (--kill): the nodes are made with min_nodes=N-1 (--nnodes=N-1:N; with N:N no
  round would form again without a replacement), and one runs alone in a process of its
  own. The first round must still have all N nodes. After the window that
  process gets SIGKILL; the others call ``next_rendezvous()`` again as soon as their
  ``watch()`` says the round is over. The time from the kill to the last survivor's new
  RendezvousInfo (N-1 nodes, ranks 0..N-2 exactly once, one world size and one round), beside
  keep_alive_interval x keep_alive_max_attempt + 5 s.

The nodes use a join_timeout and a read_timeout far above --timeout and a short
last_call_timeout (--last-call). Every child dies with this script (PR_SET_PDEATHSIG) and is
killed at its end, on Ctrl-C and on failures; temporary directories and the etcd server go
with them.

Examples::

    python benchmarks/rendezvous.py --quick
    python benchmarks/rendezvous.py --nodes 16,64,256 --backends c10d --kill --timeout 120
    python benchmarks/rendezvous.py --csv rdzv.csv --png rdzv.png
    python benchmarks/plots.py rendezvous rdzv.csv --png rdzv.png   # redrawn from the CSV
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import date
from pathlib import Path
from typing import Any

import plots  # benchmarks/plots.py, beside this script
from children import child, command  # benchmarks/children.py, beside it too

from distcomm.launch.agent.round_sync import RDZV_CHECK_INTERVAL
from distcomm.launch.errors import exit_description
from distcomm.launch.rendezvous import (
    RendezvousParameters,
    RendezvousSettings,
    get_rendezvous_handler,
)
from distcomm.net import raise_file_limit

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"
BACKENDS = ("c10d", "etcd", "file")
#: The Store methods that put a request on the wire (or read or lock the file).
REQUEST_METHODS = (
    "set",
    "get",
    "add",
    "compare_set",
    "wait",
    "check",
    "delete_key",
    "num_keys",
    "append",
    "multi_get",
    "multi_set",
    "list_keys",
    "queue_push",
    "queue_pop",
    "queue_len",
)
#: Seconds between the parent's "go" and the common start of a round.
START_LEAD = 0.5
#: Nodes a process serves at most when --processes is not given, and processes at most.
NODES_PER_PROCESS = 32
MOST_PROCESSES = 32
#: The defaults of the run's sizes, and those of --quick.
DEFAULTS = {"nodes": (16, 64, 256, 1024), "window": 3}
QUICK = {"nodes": (16, 64), "window": 2}
#: Seconds a node process may take to start and make its handlers, beyond --timeout / 4.
STARTUP = 60.0
#: Seconds the nodes' shutdown() may take (their close_timeout), and the host's.
CLOSE_TIMEOUT = 10.0
#: Seconds added to keep_alive_interval x keep_alive_max_attempt for the recovery's target.
RECOVERY_SLACK = 5.0


class BenchError(RuntimeError):
    """A child process failed, died or did not answer in time."""


# -- what a configuration is and what it measured ------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One configuration: N nodes on one backend.

    Attributes:
        backend: c10d, etcd or file.
        nodes: N, the round's max_nodes and (without `kill`) its min_nodes.
        processes: the processes the nodes are spread over (the killed node's own
            process not counted).
        keep_alive: keep_alive_interval, seconds.
        max_attempts: keep_alive_max_attempt.
        last_call: last_call_timeout, seconds.
        timeout: seconds a round (and the recovery) may take before it is reported
            incomplete.
        window: keep-alive intervals during which the heartbeat load is counted (0: none).
        kill: whether to kill one node after the round and time the survivors' next one.
    """

    backend: str
    nodes: int
    processes: int
    keep_alive: float = 5.0
    max_attempts: int = 3
    last_call: float = 5.0
    timeout: float = 300.0
    window: int = 3
    kill: bool = False

    @property
    def min_nodes(self) -> int:
        """N, or N - 1 with `kill` (--nnodes=N-1:N): a round of N:N never forms without a
        replacement for the killed node."""
        return self.nodes - 1 if self.kill else self.nodes

    @property
    def recovery_limit(self) -> float:
        """The recovery's target: keep_alive_interval x keep_alive_max_attempt + 5 s."""
        return self.keep_alive * self.max_attempts + RECOVERY_SLACK

    def config(self) -> dict[str, str]:
        """The --rdzv_conf of every node: generous join and read timeouts, a short last call."""
        return {
            "join_timeout": f"{max(600.0, 4 * self.timeout):g}",
            "read_timeout": f"{max(120.0, 2 * self.timeout):g}",
            "last_call_timeout": f"{self.last_call:g}",
            "close_timeout": f"{CLOSE_TIMEOUT:g}",
            "keep_alive_interval": f"{self.keep_alive:g}",
            "keep_alive_max_attempt": str(self.max_attempts),
        }

    def shares(self) -> list[int]:
        """Nodes per process: the N nodes (N - 1 with --kill) spread evenly, then the killed
        node's process of one."""
        spread = self.nodes - 1 if self.kill else self.nodes
        count = max(1, min(self.processes, spread))
        shares = [spread // count + (1 if i < spread % count else 0) for i in range(count)]
        return [*shares, 1] if self.kill else shares


def default_processes(nodes: int) -> int:
    """N / 32 processes, at least 1 and at most 32."""
    return max(1, min(MOST_PROCESSES, math.ceil(nodes / NODES_PER_PROCESS)))


@dataclass
class Result:
    """What one configuration measured (None: not measured, or the step failed).

    `status` is "ok", "incomplete" (the round did not complete within the timeout),
    "failed" (a check failed or a node raised; `error` says what) or "error" (the
    benchmark's own machinery failed). `infos` and `recovery_infos` hold each node's
    (rank, world_size, round), in no particular order.
    """

    backend: str
    nodes: int
    processes: int
    status: str = "error"
    error: str | None = None
    round_s: float | None = None
    completed: int = 0
    round: int | None = None
    late_start_s: float | None = None
    requests_per_node: float | None = None
    requests_by_method: dict[str, float] = field(default_factory=dict)
    window_s: float | None = None
    heartbeat_requests_per_node_per_interval: float | None = None
    watch_requests_per_node_per_interval: float | None = None
    round_over_in_window: int | None = None
    state_keys: int | None = None
    state_bytes: int | None = None
    state_largest_bytes: int | None = None
    recovery_status: str | None = None
    recovery_error: str | None = None
    recovery_s: float | None = None
    recovery_limit_s: float | None = None
    recovery_round: int | None = None
    recovered: int | None = None
    warnings: int = 0
    first_warning: str | None = None
    infos: list[tuple[int, int, int]] = field(default_factory=list)
    recovery_infos: list[tuple[int, int, int]] = field(default_factory=list)


def check_round(infos: Sequence[tuple[int, int, int]], size: int) -> str | None:
    """Why these (rank, world_size, round) triples are not one round of `size` nodes: None
    when ranks 0..size-1 each came out once, every world size is `size` and one round."""
    problems = []
    ranks = Counter(rank for rank, _, _ in infos)
    missing = sorted(set(range(size)) - set(ranks))
    twice = sorted(rank for rank, count in ranks.items() if count > 1)
    stray = sorted(rank for rank in ranks if not 0 <= rank < size)
    if len(infos) != size:
        problems.append(f"{len(infos)} nodes got a RendezvousInfo, not {size}")
    if missing:
        problems.append(f"ranks missing: {_short(missing)}")
    if twice:
        problems.append(f"ranks given more than once: {_short(twice)}")
    if stray:
        problems.append(f"ranks outside 0..{size - 1}: {_short(stray)}")
    worlds = Counter(world for _, world, _ in infos)
    if set(worlds) - {size}:
        problems.append(f"world sizes seen (size: nodes): {dict(sorted(worlds.items()))}")
    rounds = Counter(number for _, _, number in infos)
    if len(rounds) > 1:
        problems.append(f"round numbers seen (round: nodes): {dict(sorted(rounds.items()))}")
    return "; ".join(problems) or None


def _short(values: Sequence[int], most: int = 10) -> str:
    text = ", ".join(str(v) for v in values[:most])
    return text + (f" and {len(values) - most} more" if len(values) > most else "")


# -- counting store requests, in each node process ----------------------------------------


class RequestCounter:
    """This process's store requests, by method and by the thread that made them.

    `install` wraps each request method that the given store classes define themselves; a
    call counts once when it starts, and not again for the request methods it calls inside
    (TCPStore.get is a multi_get). A call from a thread that called `mark_node_thread` is a
    "node" request (next_rendezvous, watch, shutdown); any other is "background" (the
    handlers' heartbeat threads).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()
        self._local = threading.local()

    def install(self, classes: Sequence[type]) -> None:
        for cls in classes:
            for name in REQUEST_METHODS:
                method = cls.__dict__.get(name)
                if method is not None and not getattr(method, "_counted", False):
                    setattr(cls, name, self._wrap(name, method))

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        local, lock, counts = self._local, self._lock, self._counts

        @functools.wraps(method)
        def counted(store: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(local, "inside", False):
                return method(store, *args, **kwargs)
            with lock:
                counts[(getattr(local, "source", "background"), name)] += 1
            local.inside = True
            try:
                return method(store, *args, **kwargs)
            finally:
                local.inside = False

        counted._counted = True  # type: ignore[attr-defined]
        return counted

    def mark_node_thread(self) -> None:
        """Count this thread's requests as the node's own (not the handler's background)."""
        self._local.source = "node"

    def snapshot(self) -> dict[str, dict[str, int]]:
        """{"node": {method: calls}, "background": {method: calls}} so far."""
        out: dict[str, dict[str, int]] = {"node": {}, "background": {}}
        with self._lock:
            for (source, name), count in self._counts.items():
                out[source][name] = count
        return out


def _minus(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict:
    return {
        source: {k: v - before.get(source, {}).get(k, 0) for k, v in methods.items()}
        for source, methods in after.items()
    }


def _total(counts: dict[str, dict[str, int]], source: str | None = None) -> int:
    return sum(sum(methods.values()) for name, methods in counts.items() if source in (None, name))


def _store_classes(backend: str) -> list[type]:
    from distcomm.store import FileStore, TCPStore

    classes: list[type] = [TCPStore, FileStore]
    if backend == "etcd":
        from distcomm.store.etcd import EtcdStore

        classes.append(EtcdStore)
    return classes


class WarningTally(logging.Handler):
    """Counts distcomm's warnings in this process (and keeps the first) instead of letting
    hundreds of nodes print them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.first: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if self.first is None:
            try:
                self.first = record.getMessage()[:400]
            except Exception:
                self.first = str(record.msg)[:400]

    def install(self) -> None:
        logger = logging.getLogger("distcomm")
        logger.addHandler(self)
        logger.propagate = False


# -- children ------------------------------------------------------------------------------


def _params(scenario: Scenario, run_id: str, endpoint: str, **conf: str) -> RendezvousParameters:
    return RendezvousParameters(
        scenario.backend,
        endpoint,
        run_id,
        min_nodes=scenario.min_nodes,
        max_nodes=scenario.nodes,
        local_addr=LOOPBACK,
        config={**scenario.config(), **conf},
    )


def _host(conn: Any, scenario: Scenario, run_id: str) -> None:
    """The c10d store's host: a handler with endpoint 127.0.0.1:0 and is_host=true, which
    never joins a round; answers its port, then serves until "stop" and shuts down."""
    handler = get_rendezvous_handler(_params(scenario, run_id, f"{LOOPBACK}:0", is_host="true"))
    address = getattr(handler, "bootstrap_address", None)
    if not address:
        raise RuntimeError(f"the c10d host handler {handler!r} does not say which port it bound")
    conn.send(("ok", (address[1], os.getpid())))
    while command(conn, 4 * scenario.timeout + 600)[0] != "stop":
        pass
    handler.shutdown()  # the nodes are gone: returns at once
    conn.send(("ok", None))


class Nodes:
    """The simulated nodes of one process: a handler and a thread each.

    A node's thread waits for the common start, calls next_rendezvous(), then, once the
    parent starts the monitoring, polls watch() every RDZV_CHECK_INTERVAL (0.5 s, as the
    launcher's agent does while its workers run); with `rejoin`,
    it calls next_rendezvous() again the first time watch() says the round is over.
    """

    def __init__(
        self,
        scenario: Scenario,
        run_id: str,
        endpoint: str,
        local: int,
        rejoin: bool,
        counter: RequestCounter,
    ) -> None:
        self.scenario, self.local, self.rejoin, self.counter = scenario, local, rejoin, counter
        self.handlers = [
            get_rendezvous_handler(_params(scenario, run_id, endpoint, is_host="false"))
            if scenario.backend == "c10d"
            else get_rendezvous_handler(_params(scenario, run_id, endpoint))
            for _ in range(local)
        ]
        self.go, self.monitor, self.stop = threading.Event(), threading.Event(), threading.Event()
        self.done, self.recovered = threading.Semaphore(0), threading.Semaphore(0)
        self.first: list[tuple[float, int, int, int] | None] = [None] * local
        self.second: list[tuple[float, int, int, int] | None] = [None] * local
        self.over_seen: list[float | None] = [None] * local
        self.busy = [False] * local
        self.errors: list[str] = []
        self.round_counts: dict[str, dict[str, int]] | None = None
        self.threads = [
            threading.Thread(target=self._node, args=(i,), name=f"sim-node-{i}", daemon=True)
            for i in range(local)
        ]
        for thread in self.threads:
            thread.start()

    def _join(self, i: int) -> tuple[float, int, int, int] | None:
        self.busy[i] = True
        try:
            info = self.handlers[i].next_rendezvous()
            return time.monotonic(), info.rank, info.world_size, info.round
        except Exception as exc:
            self.errors.append(f"node {i}: {type(exc).__name__}: {exc}")
            return None
        finally:
            self.busy[i] = False

    def _node(self, i: int) -> None:
        self.counter.mark_node_thread()
        self.go.wait()
        if self.stop.is_set():
            return
        self.first[i] = self._join(i)
        self.done.release()
        if self.first[i] is None:
            return
        self.monitor.wait()
        handler, rejoined = self.handlers[i], False
        while not self.stop.wait(RDZV_CHECK_INTERVAL):  # the agent's monitoring
            try:
                view = handler.watch()
            except Exception as exc:
                self.errors.append(f"node {i}: watch(): {type(exc).__name__}: {exc}")
                continue
            if not view.round_over:
                continue
            if self.over_seen[i] is None:
                self.over_seen[i] = time.monotonic()
            if self.rejoin and not rejoined:
                rejoined = True
                self.second[i] = self._join(i)
                self.recovered.release()

    def _collect(self, semaphore: threading.Semaphore, deadline: float) -> int:
        got = 0
        for _ in range(self.local):
            if not semaphore.acquire(timeout=max(0.0, deadline - time.monotonic())):
                break
            got += 1
        return got

    def run_round(self, start: float, timeout: float) -> dict[str, Any]:
        time.sleep(max(0.0, start - time.monotonic()))
        late = time.monotonic() - start
        self.go.set()
        self._collect(self.done, start + timeout)
        self.round_counts = self.counter.snapshot()
        return {
            "late_s": late,
            "first": list(self.first),
            "requests": self.round_counts,
            "errors": list(self.errors),
        }

    def window(self, seconds: float) -> dict[str, Any]:
        self.monitor.set()
        before = self.counter.snapshot()
        time.sleep(seconds)
        after = self.counter.snapshot()
        return {
            "requests": _minus(after, before),
            "over": sum(seen is not None for seen in self.over_seen),
        }

    def recover(self, deadline: float) -> dict[str, Any]:
        self.monitor.set()
        self._collect(self.recovered, deadline)
        return {
            "second": list(self.second),
            "over_seen": list(self.over_seen),
            "errors": list(self.errors),
        }

    def shut_down(self, grace: float) -> int:
        """Stop the threads, shut down every handler not inside next_rendezvous (all at
        once, up to `grace` seconds); how many left cleanly."""
        self.stop.set()
        self.monitor.set()
        self.go.set()
        deadline = time.monotonic() + grace
        for thread in self.threads:
            thread.join(
                timeout=max(0.0, min(self.scenario.keep_alive, deadline - time.monotonic()))
            )
        idle = [h for h, busy in zip(self.handlers, self.busy, strict=True) if not busy]
        clean: list[bool] = []

        def leave(handler: Any) -> None:
            self.counter.mark_node_thread()
            clean.append(bool(handler.shutdown()))

        leaving = [threading.Thread(target=leave, args=(h,), daemon=True) for h in idle]
        for thread in leaving:
            thread.start()
        for thread in leaving:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return sum(clean)


def _node_process(
    conn: Any, scenario: Scenario, run_id: str, endpoint: str, local: int, rejoin: bool
) -> None:
    """A node process: `local` nodes, run through the parent's commands ("round", "window",
    "recover", "stop"), each answered with what the nodes measured."""
    counter = RequestCounter()
    counter.install(_store_classes(scenario.backend))  # before any handler (and store) is made
    tally = WarningTally()
    tally.install()
    nodes = Nodes(scenario, run_id, endpoint, local, rejoin, counter)
    conn.send(("ok", os.getpid()))
    idle = 4 * scenario.timeout + 600
    while True:
        message = command(conn, idle)
        kind = message[0]
        if kind == "round":
            reply = nodes.run_round(*message[1:])
        elif kind == "window":
            reply = nodes.window(*message[1:])
        elif kind == "recover":
            reply = nodes.recover(*message[1:])
        elif kind == "stop":
            conn.send(("ok", {"clean": nodes.shut_down(CLOSE_TIMEOUT + 2)}))
            return
        else:
            raise RuntimeError(f"unknown command {message!r}")
        reply["warnings"] = (tally.count, tally.first)
        conn.send(("ok", reply))


# -- the parent's side ---------------------------------------------------------------------


class Children:
    """The child processes of one configuration: start, talk to with timeouts, and kill."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: list[tuple[Any, Any]] = []

    def start(self, name: str, target: Callable[..., None], *args: Any) -> tuple[Any, Any]:
        """Spawn `target(conn, *args)`; (process, the parent's end of its pipe)."""
        parent_end, child_end = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=child, args=(target, child_end, *args), name=name, daemon=True
        )
        proc.start()
        child_end.close()
        self.procs.append((proc, parent_end))
        return proc, parent_end

    def recv(self, proc: Any, conn: Any, what: str, timeout: float) -> Any:
        """The payload of the child's next ("ok", payload) answer.

        Raises:
            BenchError: the child reported an error, died or did not answer in time.
        """
        ready = multiprocessing.connection.wait([conn, proc.sentinel], timeout)
        if conn in ready or (ready and conn.poll()):
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
        raise BenchError(f"{proc.name} did not answer within {timeout:.0f} s during {what}")

    def ask(
        self, members: Sequence[tuple[Any, Any]], message: Any, what: str, timeout: float
    ) -> list[Any]:
        """Send `message` to every member, then collect their answers (one deadline)."""
        for _, conn in members:
            conn.send(message)
        deadline = time.monotonic() + timeout
        return [
            self.recv(proc, conn, what, max(0.0, deadline - time.monotonic()))
            for proc, conn in members
        ]

    def stop(self, members: Sequence[tuple[Any, Any]], grace: float) -> None:
        """Ask the live members to stop, give them `grace` seconds together, kill the rest."""
        for proc, conn in members:
            if proc.is_alive():
                try:
                    conn.send(("stop",))
                except OSError:
                    pass
        deadline = time.monotonic() + grace
        for proc, _ in members:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill(members)

    def kill(self, members: Sequence[tuple[Any, Any]] | None = None) -> None:
        members = list(self.procs if members is None else members)
        for proc, _ in members:
            if proc.is_alive():
                proc.kill()
        for proc, conn in members:
            proc.join(5.0)
            conn.close()
            if (proc, conn) in self.procs:
                self.procs.remove((proc, conn))


def _sum_counts(parts: Sequence[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    out: dict[str, Counter] = {"node": Counter(), "background": Counter()}
    for part in parts:
        for source, methods in part.items():
            out[source].update(methods)
    return {source: dict(methods) for source, methods in out.items()}


def state_size(backend: str, endpoint: str, run_id: str, timeout: float) -> tuple[int, int, int]:
    """(keys, bytes of their values, the largest value) of every key whose name contains
    `run_id`, read by a client of this process (not counted)."""
    from distcomm.store import FileStore, TCPStore

    if backend == "c10d":
        host, port = endpoint.rsplit(":", 1)
        store: Any = TCPStore(host, int(port), is_master=False, timeout=timeout)
    elif backend == "file":
        store = FileStore(endpoint, world_size=-1, timeout=timeout)
    else:
        from distcomm.store.etcd import EtcdStore

        # the rendezvous's keys lie under <etcd_prefix>/<run_id>/: list them all
        store = EtcdStore(endpoint, prefix=RendezvousSettings().etcd_prefix + "/", timeout=timeout)
    try:
        keys = [key for key in store.list_keys() if run_id in key]
        sizes = [len(value) for value in store.multi_get(keys)] if keys else []
    finally:
        store.close()
    return len(keys), sum(sizes), max(sizes, default=0)


def _warnings(result: Result, answers: Sequence[dict[str, Any]]) -> None:
    counts = [answer["warnings"] for answer in answers]
    result.warnings = max(result.warnings, sum(count for count, _ in counts))
    result.first_warning = result.first_warning or next((t for _, t in counts if t), None)


def simulate(
    scenario: Scenario, etcd_endpoint: str | None = None, say: Callable[[str], None] | None = None
) -> Result:
    """Run one configuration in fresh processes and return what it measured.

    A round that fails or does not complete is a Result with that status, not an exception;
    only a failure of the benchmark itself (a child that died or did not answer) is caught
    into status "error". Every child is killed and every temporary file removed on return,
    also on KeyboardInterrupt (which propagates).

    Args:
        scenario: the configuration.
        etcd_endpoint: the etcd server to use (backend etcd); None starts one for this call.
        say: where to write progress lines (None: nowhere).
    """
    say = say or (lambda line: None)
    if scenario.backend not in BACKENDS:
        raise ValueError(f"backend {scenario.backend!r} is not one of {', '.join(BACKENDS)}")
    if scenario.nodes < 2 and scenario.kill:
        raise ValueError("--kill needs at least 2 nodes (one is killed)")
    result = Result(scenario.backend, scenario.nodes, len(scenario.shares()))
    run_id = f"bench-{scenario.backend}-{scenario.nodes}-{uuid.uuid4().hex[:8]}"
    children = Children()
    tmp = tempfile.mkdtemp(prefix="distcomm-rdzv-bench-")
    etcd = None
    started = time.monotonic()
    try:
        if scenario.backend == "c10d":
            host = children.start("c10d host", _host, scenario, run_id)
            port, _ = children.recv(*host, "hosting the store", STARTUP)
            endpoint = f"{LOOPBACK}:{port}"
        elif scenario.backend == "etcd":
            if etcd_endpoint is None:
                etcd = start_etcd()
                etcd_endpoint = etcd.endpoint
            endpoint = etcd_endpoint
        else:
            endpoint = os.path.join(tmp, "rendezvous")
        shares = scenario.shares()
        members = [
            children.start(
                f"node process {i} ({share} nodes)",
                _node_process,
                scenario,
                run_id,
                endpoint,
                share,
                scenario.kill,
            )
            for i, share in enumerate(shares)
        ]
        startup = STARTUP + scenario.timeout / 4
        deadline = time.monotonic() + startup
        for proc, conn in members:
            children.recv(proc, conn, "making its handlers", max(0.0, deadline - time.monotonic()))
        say(f"{len(members)} node processes up ({time.monotonic() - started:.1f} s); the round")
        _round(scenario, result, children, members)
        if result.completed:
            try:
                result.state_keys, result.state_bytes, result.state_largest_bytes = state_size(
                    scenario.backend, endpoint, run_id, 60.0
                )
            except Exception as exc:
                say(f"could not read the state: {exc}")
        if result.status == "ok" and scenario.window > 0:
            say(
                f"round complete in {result.round_s:.2f} s; heartbeat load over "
                f"{scenario.window} keep-alive intervals"
            )
            _window(scenario, result, children, members)
        if result.status == "ok" and scenario.kill:
            say("killing the lone node's process; the survivors' next round")
            _recover(scenario, result, children, members)
        if result.status == "ok":  # leave as an agent leaves; otherwise just kill
            children.stop(members, CLOSE_TIMEOUT + 5)
            if scenario.backend == "c10d":
                children.stop([host], CLOSE_TIMEOUT + 5)
    except BenchError as exc:
        result.status, result.error = "error", str(exc)
    finally:
        children.kill()
        if etcd is not None:
            etcd.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _round(
    scenario: Scenario, result: Result, children: Children, members: list[tuple[Any, Any]]
) -> None:
    start = time.monotonic() + START_LEAD
    answers = children.ask(
        members,
        ("round", start, scenario.timeout),
        f"a round of {scenario.nodes} nodes",
        scenario.timeout + 60,
    )
    _warnings(result, answers)
    firsts = [entry for answer in answers for entry in answer["first"]]
    done = [entry for entry in firsts if entry is not None]
    errors = [error for answer in answers for error in answer["errors"]]
    result.completed = len(done)
    result.late_start_s = max(answer["late_s"] for answer in answers)
    result.infos = [(rank, world, number) for _, rank, world, number in done]
    counts = _sum_counts([answer["requests"] for answer in answers])
    result.requests_per_node = _total(counts) / scenario.nodes
    merged: Counter = Counter()
    for methods in counts.values():
        merged.update(methods)
    result.requests_by_method = {k: v / scenario.nodes for k, v in sorted(merged.items())}
    if errors:
        result.status = "failed"
        result.error = f"{len(errors)} node(s) raised; the first: {errors[0]}"
        return
    if len(done) < scenario.nodes:
        result.status = "incomplete"
        result.error = (
            f"only {len(done)} of {scenario.nodes} nodes had their RendezvousInfo "
            f"after {scenario.timeout:g} s"
        )
        return
    problem = check_round(result.infos, scenario.nodes)
    if problem:
        result.status, result.error = "failed", f"not one round of {scenario.nodes}: {problem}"
        return
    result.status = "ok"
    result.round = result.infos[0][2]
    result.round_s = max(end for end, _, _, _ in done) - start


def _window(
    scenario: Scenario, result: Result, children: Children, members: list[tuple[Any, Any]]
) -> None:
    seconds = scenario.window * scenario.keep_alive
    answers = children.ask(members, ("window", seconds), "the heartbeat window", seconds + 60)
    _warnings(result, answers)
    counts = _sum_counts([answer["requests"] for answer in answers])
    per = scenario.nodes * scenario.window
    result.window_s = seconds
    result.heartbeat_requests_per_node_per_interval = _total(counts, "background") / per
    result.watch_requests_per_node_per_interval = _total(counts, "node") / per
    result.round_over_in_window = sum(answer["over"] for answer in answers)


def _recover(
    scenario: Scenario, result: Result, children: Children, members: list[tuple[Any, Any]]
) -> None:
    result.recovery_limit_s = scenario.recovery_limit
    victim, survivors = members[-1], members[:-1]
    killed_at = time.monotonic()
    victim[0].kill()
    victim[0].join(5.0)
    answers = children.ask(
        survivors,
        ("recover", killed_at + scenario.timeout),
        "the survivors' next round",
        scenario.timeout + 60,
    )
    _warnings(result, answers)
    seconds = [entry for answer in answers for entry in answer["second"]]
    done = [entry for entry in seconds if entry is not None]
    errors = [error for answer in answers for error in answer["errors"]]
    early = [
        t for answer in answers for t in answer["over_seen"] if t is not None and t < killed_at
    ]
    size = scenario.nodes - 1
    result.recovered = len(done)
    result.recovery_infos = [(rank, world, number) for _, rank, world, number in done]
    if errors:
        result.recovery_status = "failed"
        result.recovery_error = f"{len(errors)} error(s); the first: {errors[0]}"
    elif early:
        result.recovery_status = "failed"
        result.recovery_error = f"{len(early)} node(s) saw their round over before the kill"
    elif len(done) < size:
        result.recovery_status = "incomplete"
        result.recovery_error = (
            f"only {len(done)} of {size} survivors had a new "
            f"RendezvousInfo after {scenario.timeout:g} s"
        )
    else:
        problem = check_round(result.recovery_infos, size)
        if (
            problem is None
            and result.round is not None
            and result.recovery_infos[0][2] <= result.round
        ):
            problem = (
                f"the new round's number {result.recovery_infos[0][2]} is not above {result.round}"
            )
        if problem:
            result.recovery_status = "failed"
            result.recovery_error = f"not one round of {size}: {problem}"
        else:
            result.recovery_status = "ok"
            result.recovery_round = result.recovery_infos[0][2]
            result.recovery_s = max(end for end, _, _, _ in done) - killed_at
    if result.recovery_status != "ok":
        result.status = "failed"
        result.error = f"recovery: {result.recovery_error}"


def start_etcd() -> Any:
    """A single-member etcd on 127.0.0.1 (tests/etcd_server.py); stop() it when done.

    Raises:
        FileNotFoundError: no etcd binary (apt-get install etcd-server).
    """
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))  # last: the distcomm on the path stays the one measured
    from tests.etcd_server import EtcdServer

    return EtcdServer()


# -- command line and report ---------------------------------------------------------------


def _sizes(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"--nodes wants a comma-separated list of node counts >= 1 (e.g. 16,64,256), "
            f"got {text!r}"
        )
    return values


def _backends(text: str) -> tuple[str, ...]:
    values = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [v for v in values if v not in BACKENDS]
    if not values or unknown:
        raise argparse.ArgumentTypeError(
            f"--backends wants a comma-separated list of {', '.join(BACKENDS)}, got {text!r}"
        )
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""\
reading the table: round is the common start to the last node's RendezvousInfo;
  requests are Store method calls on TCPStore, FileStore or EtcdStore (one call may be more
  than one HTTP request to etcd, and a FileStore call is one locked read or write of the
  file), summed over the node processes and divided by N; per interval: requests per node
  per keep-alive interval once the round is complete, the handlers' heartbeat threads +
  the nodes' watch() polls; state: the keys whose name contains the run id, and the bytes
  of their values; recovery: SIGKILL of one node's process to the survivors' last new
  RendezvousInfo, against keep_alive_interval x keep_alive_max_attempt + 5 s.""",
    )
    parser.add_argument(
        "--nodes", type=_sizes, help="node counts N, comma-separated (default 16,64,256,1024)"
    )
    parser.add_argument(
        "--backends",
        type=_backends,
        default=BACKENDS,
        help="rendezvous backends, comma-separated (default c10d,etcd,file)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        help="processes the nodes are spread over (default N/32, at least 1 and at most 32)",
    )
    parser.add_argument(
        "--keep-alive",
        type=float,
        default=5.0,
        help="keep_alive_interval in seconds (default 5, the launcher's)",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=3,
        help="keep_alive_max_attempt (default 3, the launcher's)",
    )
    parser.add_argument(
        "--last-call",
        type=float,
        default=5.0,
        help="last_call_timeout in seconds (default 5; it only matters with "
        "--kill, where min_nodes is N-1)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=None,
        help="keep-alive intervals over which the heartbeat load is counted "
        "(default 3; 0 skips it)",
    )
    parser.add_argument(
        "--kill",
        action="store_true",
        help="also kill one node after the round and time the survivors' next",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a round (and the recovery) may take before it is "
        "reported incomplete (default 300)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short run: --nodes 16,64 --window 2 (explicit options win)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write every result here")
    parser.add_argument(
        "--csv",
        metavar="PATH",
        help="also write one row per backend and N here (benchmarks/plots.py "
        "rendezvous redraws the picture from it)",
    )
    parser.add_argument(
        "--png",
        metavar="PATH",
        help="also plot each measure against N, one line per backend (needs matplotlib)",
    )
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:  # options given explicitly win
            setattr(args, name, value)
    if args.processes is not None and args.processes < 1:
        parser.error(f"--processes must be >= 1, got {args.processes}")
    if not (args.keep_alive > 0 and args.last_call > 0 and args.timeout > 0):
        parser.error("--keep-alive, --last-call and --timeout must be > 0")
    if args.max_attempts < 1 or args.window < 0:
        parser.error("--max-attempts must be >= 1 and --window >= 0")
    if args.kill and min(args.nodes) < 2:
        parser.error("--kill needs every --nodes count to be at least 2 (one node is killed)")
    if args.png:
        plots.require_matplotlib(parser)  # before the run, not after minutes of it
    return args


def machine() -> dict[str, Any]:
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
        "load_average": list(os.getloadavg()),
    }


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _verdict(result: Result) -> str:
    if result.status == "ok":
        return "ok"
    label = {"incomplete": "INCOMPLETE", "failed": "FAILED", "error": "ERROR"}[result.status]
    return f"{label}: {' '.join((result.error or '').split())[:300]}"


def print_table(results: Sequence[Result], args: argparse.Namespace, info: dict[str, Any]) -> None:
    print(
        f"\n# rendezvous on {LOOPBACK}: distcomm {info['distcomm']}; {info['cpus']} CPUs "
        f"({info['usable_cpus']} usable), Python {info['python']}, {info['platform']}, load "
        "average at start " + " ".join(f"{x:.2f}" for x in info["load_average"])
    )
    print(
        f"# keep_alive_interval {args.keep_alive:g} s, keep_alive_max_attempt "
        f"{args.max_attempts}, last_call_timeout {args.last_call:g} s, --timeout "
        f"{args.timeout:g} s, heartbeat window {args.window} intervals"
        + (
            f", --kill (recovery target {args.keep_alive * args.max_attempts + RECOVERY_SLACK:g} s)"
            if args.kill
            else ""
        )
    )
    print(
        "| backend | nodes | processes | round (s) | requests/node/round | "
        "per node per interval: heartbeat + watch | state: keys, bytes | recovery (s) | result |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        load = "-"
        if r.heartbeat_requests_per_node_per_interval is not None:
            load = (
                f"{r.heartbeat_requests_per_node_per_interval:.2f} + "
                f"{r.watch_requests_per_node_per_interval:.2f}"
            )
        state = "-" if r.state_keys is None else f"{r.state_keys}, {r.state_bytes:,}"
        recovery = _cell(r.recovery_s, ".2f")
        if r.recovery_s is not None and r.recovery_limit_s is not None:
            recovery += " (within)" if r.recovery_s <= r.recovery_limit_s else " (OVER)"
        round_s = _cell(r.round_s, ".2f")
        if r.status == "incomplete":
            round_s = f"> {args.timeout:g} ({r.completed}/{r.nodes} done)"
        print(
            f"| {r.backend} | {r.nodes} | {r.processes} | {round_s} | "
            f"{_cell(r.requests_per_node, ',.1f')} | {load} | {state} | {recovery} | "
            f"{_verdict(r)} |"
        )
    print(
        "# requests per node per round by method: "
        + "; ".join(
            f"{r.backend} {r.nodes}: "
            + ", ".join(f"{k} {v:.1f}" for k, v in r.requests_by_method.items())
            for r in results
            if r.requests_by_method
        )
    )
    warned = [r for r in results if r.warnings]
    for r in warned:
        print(
            f"# {r.backend} {r.nodes}: {r.warnings} distcomm warning(s) logged by the nodes; "
            f"the first: {' '.join((r.first_warning or '').split())[:300]}"
        )
    over = [r for r in results if r.round_over_in_window]
    for r in over:
        print(
            f"# {r.backend} {r.nodes}: {r.round_over_in_window} node(s) saw their round over "
            "during the heartbeat window, with every node alive (a node dropped for late "
            "heartbeats?)"
        )
    print(
        "# state: every key whose name contains the run id (key names are the backend's "
        "choice); bytes of the values. The request counts include the heartbeat threads "
        "until each process's last node had its RendezvousInfo.",
        flush=True,
    )


def csv_rows(results: Sequence[Result], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The results as rows of plots.RENDEZVOUS_FIELDS, one per backend and N."""
    rows = []
    for r in results:
        row = asdict(r)
        row.update(keep_alive_interval=args.keep_alive, keep_alive_max_attempt=args.max_attempts)
        rows.append({name: row.get(name) for name in plots.RENDEZVOUS_FIELDS})
    return rows


def plot_title(info: dict[str, Any], args: argparse.Namespace) -> str:
    return (
        f"{date.today().isoformat()}, {info['cpus']} CPUs, Python {info['python']}; "
        f"keep-alive {args.keep_alive:g} s x {args.max_attempts}, last call "
        f"{args.last_call:g} s, round timeout {args.timeout:g} s"
    )


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM: clean up as on Ctrl-C


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    raise_file_limit()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where started ignoring it
    signal.signal(signal.SIGTERM, _terminate)
    info = machine()
    results: list[Result] = []
    etcd = None
    began = time.monotonic()
    try:
        backends = list(args.backends)
        if "etcd" in backends:
            try:
                etcd = start_etcd()
            except FileNotFoundError as exc:
                print(f"# note: no etcd ({exc}): the etcd backend is skipped", flush=True)
                backends.remove("etcd")
        for backend in backends:
            for nodes in args.nodes:
                scenario = Scenario(
                    backend,
                    nodes,
                    args.processes or default_processes(nodes),
                    keep_alive=args.keep_alive,
                    max_attempts=args.max_attempts,
                    last_call=args.last_call,
                    timeout=args.timeout,
                    window=args.window,
                    kill=args.kill,
                )
                scenario = replace(scenario, processes=min(scenario.processes, nodes))
                print(
                    f"# {backend}, {nodes} nodes over {len(scenario.shares())} processes ...",
                    flush=True,
                )
                result = simulate(
                    scenario,
                    etcd.endpoint if etcd else None,
                    say=lambda line: print(f"#   {line}", flush=True),
                )
                print(f"#   {_verdict(result)}", flush=True)
                results.append(result)
    except KeyboardInterrupt:
        print("\ninterrupted: every child process is stopped", file=sys.stderr)
        return 130
    finally:
        if etcd is not None:
            etcd.stop()
    print_table(results, args, info)
    print(f"# {time.monotonic() - began:.0f} s in all", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": info,
                    "args": {
                        k: v for k, v in vars(args).items() if k not in ("json", "csv", "png")
                    },
                    "results": [asdict(r) for r in results],
                },
                f,
                indent=1,
            )
        print(f"# wrote the results to {args.json}", flush=True)
    if args.csv or args.png:
        rows = csv_rows(results, args)
        if args.csv:
            plots.write_csv(rows, args.csv, plots.RENDEZVOUS_FIELDS)
        if args.png:
            plots.rendezvous(rows, args.png, plot_title(info, args))
    return 1 if any(r.status in ("failed", "error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
