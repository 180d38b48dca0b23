"""After a collective's timeout every rank's error names the late rank in `peer_ranks`.

Three ranks; rank 2 is late for an all_reduce the others call with `timeout=` (or on a
group with a short timeout): it does not call it, or it is stopped with SIGSTOP. The ranks
whose own wait expires and the ranks told of the abort raise with ``peer_ranks == (2,)``
(a program that evicts by rank reads it, not the message); the late rank's own error has
``peer_ranks`` None, since it is the cause, and its message says the others blamed it,
in words distcomm-run's failure report does not take for a peer's failure. Run on tcp and
on gloo: shared memory (one host), TCP (DISTCOMM_GLOO_TRANSPORT=tcp) and the hierarchical
path (pretend hosts, DISTCOMM_HOST_ID); and on nccl (the CUDA stand-in, ranks as threads).

The workers are real processes (this module, run with ``-m``) around a store the test
hosts; they meet at files, never by sleeping, and the test asserts results, not durations.
`Job` is also the driver of tests/test_abort_tellers.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

import distcomm as dist
from distcomm.store import TCPStore

from .processes import no_process_left

# the CUDA stand-in's fixtures (make_cluster uses cuda), for the nccl test
from .test_nccl_standin import Rank, cuda, make_cluster  # noqa: F401

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[1]
#: how long a worker or the test waits for a flag: only a broken run takes that long
WAIT_S = 120.0
#: the per-operation timeout of the callers (seconds)
OP_TIMEOUT = 2.0
#: the group timeout of the `group` way: its collectives' own waits expire
GROUP_TIMEOUT = 5.0
LATE = 2
SIZE = 3


# -- the test's side ----------------------------------------------------------------------


class Job:
    """Workers (`python -m <module>`, one per rank) around a store this test hosts; they
    meet at files in `flags`. Use as a context manager: leaving it continues and kills
    whatever still runs."""

    def __init__(self, tmp_path: Path, module: str, **env: str) -> None:
        self.flags = tmp_path / "flags"
        self.flags.mkdir()
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.module = module
        self.env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.store.port),
            "WORLD_SIZE": str(SIZE),
            "DISTCOMM_USE_AGENT_STORE": "1",
            "DISTCOMM_SOCKET_IFNAME": "lo",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "FLAGS": str(self.flags),
            **env,
        }
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(10)
        self.store.close()

    def start(self, per_rank: list[dict[str, str]]) -> None:
        for rank, env in enumerate(per_rank):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", self.module],
                    cwd=ROOT,
                    env={**self.env, "RANK": str(rank), "LOCAL_RANK": str(rank), **env},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )

    def wait_flag(self, name: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not (self.flags / name).exists():
            ended = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if ended:
                raise AssertionError(
                    f"rank(s) {ended} ended before {name} appeared:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} did not appear within {WAIT_S} s")
            time.sleep(0.02)

    def stop_seen(self, rank: int) -> None:
        """Wait until rank `rank`, which stops itself, is stopped; then tell the others."""
        self.wait_flag(f"stopping-{rank}")
        proc = psutil.Process(self.procs[rank].pid)
        deadline = time.monotonic() + WAIT_S
        while proc.status() != psutil.STATUS_STOPPED:
            if time.monotonic() > deadline:
                raise AssertionError(f"rank {rank} did not stop within {WAIT_S} s")
            time.sleep(0.01)
        (self.flags / f"stopped-{rank}").touch()

    def cont(self, rank: int) -> None:
        self.procs[rank].send_signal(signal.SIGCONT)

    def output(self) -> str:
        """The exit status and the end of the stderr of each rank that ended."""
        parts = []
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                _out, err = proc.communicate(timeout=10)
                parts.append(f"### rank {rank}: exit {proc.returncode}\n{err[-3000:]}")
        return "\n".join(parts)

    def results(self) -> list[dict[str, Any]]:
        found = []
        for rank, proc in enumerate(self.procs):
            out, err = proc.communicate(timeout=WAIT_S)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, (
                f"rank {rank} failed ({proc.returncode}):\n{err[-4000:]}"
            )
            found.append(json.loads(lines[-1][len("RESULT ") :]))
        return found


# -- the workers' side ------------------------------------------------------------------


def flag(name: str) -> None:
    (Path(os.environ["FLAGS"]) / name).touch()


def wait_flag(name: str) -> None:
    path = Path(os.environ["FLAGS"]) / name
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} did not appear within {WAIT_S} s")
        time.sleep(0.02)


def stop_here(rank: int) -> None:
    """Stop this process (SIGSTOP) until the test continues it."""
    flag(f"stopping-{rank}")
    os.kill(os.getpid(), signal.SIGSTOP)


def told_of_abort(pg: Any) -> None:
    """Wait until this rank's transport has heard of the group's abort (its mailbox holds
    the failure): a rank told nothing fails the test."""
    mailbox = pg._backends["cpu"]._transport.mailbox
    deadline = time.monotonic() + WAIT_S
    while mailbox.failure is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"this rank was not told of the abort within {WAIT_S} s")
        time.sleep(0.01)


def _outcome(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    try:
        fn(*args, **kwargs)
    except dist.DistError as exc:
        peers = exc.peer_ranks
        return {
            "kind": type(exc).__name__,
            "peers": None if peers is None else list(peers),
            "message": str(exc),
        }
    return {"kind": "ok"}


def _worker() -> None:
    way, mode = os.environ["WAY"], os.environ["MODE"]
    dist.init_process_group(os.environ["BACKEND"], timeout=60)
    rank = dist.get_rank()
    x = np.ones(4)
    dist.all_reduce(x)  # every rank is there: connections and segments are made
    pg = dist.new_group(list(range(SIZE)), timeout=GROUP_TIMEOUT) if way == "group" else None
    group = pg if pg is not None else dist.group.WORLD
    seen: dict[str, Any] = {"rank": rank, "sum": float(x[0])}
    seen["path"] = group._backends["cpu"].transport
    if rank == LATE:
        if mode == "stopped":
            stop_here(rank)
        else:
            for r in range(SIZE):
                if r != LATE:
                    wait_flag(f"timed-out-{r}")
        told_of_abort(group)
        seen["error"] = _outcome(dist.all_reduce, np.ones(4), group=group)
        flag("late-told")
    else:
        if mode == "stopped":
            wait_flag(f"stopped-{LATE}")
        if way == "group":
            seen["error"] = _outcome(dist.all_reduce, np.ones(4), group=group)
        elif way == "async":
            work = dist.all_reduce(np.ones(4), async_op=True, timeout=OP_TIMEOUT)
            seen["error"] = _outcome(work.wait)
        else:
            seen["error"] = _outcome(dist.all_reduce, np.ones(4), timeout=OP_TIMEOUT)
        flag(f"timed-out-{rank}")
        told_of_abort(group)
        seen["after"] = _outcome(dist.barrier, group=group)  # the group stays aborted
        wait_flag("late-told")  # the late rank hears of the abort before anyone leaves
    dist.destroy_process_group()
    print("RESULT " + json.dumps(seen), flush=True)


# -- the tests ----------------------------------------------------------------------------

#: variant -> (backend, the path its collectives take, environment, ranks' pretend hosts)
VARIANTS = {
    "tcp": ("tcp", "tcp", {}, None),
    "gloo_shm": ("gloo", "shm", {}, None),
    "gloo_tcp": ("gloo", "tcp", {"DISTCOMM_GLOO_TRANSPORT": "tcp"}, None),
    "gloo_hier": ("gloo", "shm+tcp", {}, ["a", "a", "b"]),  # the late rank on a host alone
}
CASES = [
    ("tcp", "absent", "sync"),
    ("tcp", "stopped", "sync"),
    ("tcp", "absent", "async"),
    ("tcp", "absent", "group"),
    ("gloo_tcp", "absent", "sync"),
    ("gloo_tcp", "stopped", "sync"),
    ("gloo_hier", "absent", "sync"),
    ("gloo_hier", "stopped", "sync"),
    ("gloo_shm", "absent", "sync"),
    ("gloo_shm", "stopped", "async"),
]


def _run(tmp_path: Path, variant: str, mode: str, way: str) -> list[dict[str, Any]]:
    backend, _path, env, hosts = VARIANTS[variant]
    per_rank = [
        {"DISTCOMM_HOST_ID": f"pretend-host-{hosts[r]}"} if hosts else {} for r in range(SIZE)
    ]
    with Job(
        tmp_path, "tests.test_timeout_peers", BACKEND=backend, MODE=mode, WAY=way, **env
    ) as job:
        job.start(per_rank)
        if mode == "stopped":
            job.stop_seen(LATE)
            for r in range(SIZE):
                if r != LATE:
                    job.wait_flag(f"timed-out-{r}")
            job.cont(LATE)
        return job.results()


#: the words of the shared-memory engine's error for a collective it finds given up


@pytest.mark.parametrize("variant,mode,way", CASES, ids=["-".join(c) for c in CASES])
def test_every_rank_names_the_late_rank_in_peer_ranks(tmp_path, variant, mode, way):
    from distcomm.launch.tracebacks import peer_failure_in

    with no_process_left():
        results = _run(tmp_path, variant, mode, way)
    expected_path = VARIANTS[variant][1]
    for seen in results:
        assert seen["sum"] == SIZE, results
        assert seen["path"] == expected_path, results  # the path the variant is about
    for rank in range(SIZE):
        if rank == LATE:
            continue
        error, after = results[rank]["error"], results[rank]["after"]
        assert error["kind"] != "ok" and after["kind"] != "ok", (rank, results)
        for what, found in (("error", error), ("next operation's error", after)):
            assert found["kind"] == "DistTimeoutError", (rank, what, found)
            assert found["peers"] == [LATE], (rank, what, found)
        assert error["kind"] != "DistTimeoutError" or f"rank(s) {LATE} " in error["message"]
    late = results[LATE]["error"]
    assert late["kind"] != "ok", results
    # the cause: no peer to blame, in words the failure report does not take for a
    # peer's failure
    assert late["kind"] == "DistTimeoutError", late
    assert late["peers"] is None, late
    assert "blames this rank" in late["message"], late
    assert peer_failure_in(late["message"]) is None, late


def test_an_abort_notice_carries_the_ranks_it_blames():
    """The ABORT message's format (`protocol.AbortNotice`), through the header's bytes."""
    from distcomm.backends.engine.protocol import (
        ABORT,
        NOTICE_PEERS_MAX,
        NOTICE_REASON_MAX,
        AbortNotice,
        Header,
    )

    for peers in (None, (), (2,), (0, 5, 7)):
        notice = AbortNotice(1, 2, peers, "rank(s) 2 did not answer: é")
        header, payload = notice.pack()
        assert header.kind == ABORT and header.nbytes == len(payload)
        assert AbortNotice.unpack(Header.unpack(header.pack()), bytearray(payload)) == notice
    many = AbortNotice(0, 1, tuple(range(NOTICE_PEERS_MAX + 1)), "x" * (NOTICE_REASON_MAX + 9))
    header, payload = many.pack()
    back = AbortNotice.unpack(Header.unpack(header.pack()), payload)
    assert back.peers == () and back.reason == "x" * NOTICE_REASON_MAX  # blamed, unnamed


# -- nccl: the CUDA stand-in, ranks as threads ------------------------------------------


def _nccl_first(me: Rank) -> None:
    dist.all_reduce(me.cp.ones(2, me.cp.float32), group=me.group(), timeout=20)


def _nccl_late(me: Rank, timed_out: threading.Barrier) -> dict[str, Any]:
    """The callers' all_reduce never completes (the stand-in hangs it, as NCCL would wait
    for the rank that did not call); the late rank calls once they timed out, and its
    watchdog reads their abort notice."""
    pg, x = me.group(), me.cp.ones(4, me.cp.float32)
    if me.rank != LATE:
        seen = {"error": _outcome(dist.all_reduce, x, group=pg, timeout=OP_TIMEOUT)}
        timed_out.wait(30)
        seen["after"] = _outcome(dist.all_reduce, x, group=pg)
        return seen
    timed_out.wait(30)
    return {"error": _outcome(dist.all_reduce, x, group=pg, timeout=30)}


def test_nccl_names_the_late_rank_in_peer_ranks(solo, make_cluster):  # noqa: F811
    """nccl asks through the store which ranks wait in no operation; its abort notice in
    the store carries them to the others."""
    from distcomm.launch.tracebacks import peer_failure_in

    cluster = make_cluster(SIZE, timeout=60)
    cluster.run(_nccl_first)
    cluster.standin.hang()
    results = cluster.run(_nccl_late, threading.Barrier(SIZE), timeout=90)
    cluster.standin.unhang()
    for rank, seen in enumerate(results):
        if rank == LATE:
            error = seen["error"]
            assert error["kind"] != "ok" and error["peers"] is None, error
            assert "blames this rank" in error["message"], error
            assert peer_failure_in(error["message"]) is None, error
            continue
        for found in (seen["error"], seen["after"]):
            assert found["kind"] != "ok" and found["peers"] == [LATE], (rank, results)


if __name__ == "__main__":
    _worker()
