"""The stall inspector: ranks that wait for a late one say so while they wait, naming it.

Real jobs of three processes, every backend that runs here at once (the waits are
sleeps, so they share the machine): rank 2 enters collective #3 20 s after the others
(DISTCOMM_STALL_WARN_S=3), then posts its send to rank 0 7 s late. Every operation must
still succeed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests.harness import LOOPBACK_ENV
from tests.mpijobs import LAUNCHER as MPI_LAUNCHER
from tests.mpijobs import job_env as mpi_env

pytestmark = pytest.mark.timeout(240)

LATE = 20.0  # how late rank 2 enters collective #3
SEND_LATE = 7.0  # then how late it posts its send to rank 0
WARN = "3"

WORKER = """
    import os, signal, sys, time
    import numpy as np
    import distcomm as dist

    backend, rendezvous, rank, late, send_late, stop = sys.argv[1:7]
    late, send_late = float(late), float(send_late)
    if backend == "mpi":
        dist.init_process_group("mpi", timeout=120)
        rank = dist.get_rank()
    else:
        rank = int(rank)
        dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank,
                                world_size=3, timeout=120)
    x = np.full(4, rank + 1, dtype=np.float32)
    dist.all_reduce(x)                  # #0: 6
    dist.all_reduce(x)                  # #1: 18
    dist.broadcast(x, src=0)            # #2
    if rank == 2:
        if stop == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # the test continues it
        else:
            time.sleep(late)
    dist.all_reduce(x)                  # #3: 54, late on rank 2
    y = np.zeros(2, dtype=np.int64)
    if rank == 0:
        dist.recv(y, src=2)
    elif rank == 2:
        time.sleep(send_late)
        dist.send(np.array([7, 8]), dst=0)
    dist.barrier()
    print(f"ok {rank} {x[0]:.0f} {y.tolist()}", flush=True)
    dist.destroy_process_group()
"""

#: name -> (backend, extra environment, "stop" to SIGSTOP rank 2 instead of sleeping)
VARIANTS = {
    "tcp": ("tcp", {}, ""),
    "gloo-shm": ("gloo", {}, ""),
    "gloo-tcp": ("gloo", {"DISTCOMM_GLOO_TRANSPORT": "tcp"}, ""),
    "tcp-stopped": ("tcp", {}, "stop"),
}
if MPI_LAUNCHER is not None:
    VARIANTS["mpi"] = ("mpi", {}, "")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTCOMM_")}
    env.update(LOOPBACK_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    env["DISTCOMM_STALL_WARN_S"] = WARN
    env.update(extra)
    return env


def _continue_when_stopped(proc: subprocess.Popen, after: float) -> None:
    """Send SIGCONT to `proc` `after` seconds after it stopped itself."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        with open(f"/proc/{proc.pid}/stat") as fp:
            if fp.read().rsplit(")", 1)[1].split()[0] == "T":
                break
        time.sleep(0.1)
    time.sleep(after)
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every variant's job, run at once: name -> [(exit code, stdout, stderr) per rank]."""
    tmp = tmp_path_factory.mktemp("stall")
    worker = tmp / "worker.py"
    worker.write_text(textwrap.dedent(WORKER))
    running: dict[str, list[subprocess.Popen]] = {}
    helpers = []
    try:
        for name, (backend, extra, stop) in VARIANTS.items():
            args = [str(worker), backend, str(tmp / f"rdzv-{name}")]
            if backend == "mpi":
                command = MPI_LAUNCHER.command(
                    3, sys.executable, *args, "-1", str(LATE), str(SEND_LATE), stop
                )
                env = mpi_env(DISTCOMM_STALL_WARN_S=WARN, **extra)
                running[name] = [
                    subprocess.Popen(
                        command,
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        start_new_session=True,
                    )
                ]
                continue
            running[name] = [
                subprocess.Popen(
                    [sys.executable, *args, str(r), str(LATE), str(SEND_LATE), stop],
                    env=_env(**extra),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
                for r in range(3)
            ]
            if stop:
                helper = threading.Thread(
                    target=_continue_when_stopped, args=(running[name][2], LATE), daemon=True
                )
                helper.start()
                helpers.append(helper)
        results = {}
        for name, procs in running.items():
            outputs = [p.communicate(timeout=180) for p in procs]
            results[name] = [
                (p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)
            ]
        return results
    finally:
        for procs in running.values():
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        for helper in helpers:
            helper.join(5)


def _ranks(name: str, results: list[tuple[int, str, str]]) -> dict[int, str]:
    """Each rank's stderr, checked for success; an mpiexec job's output split by rank."""
    out = "".join(r[1] for r in results)
    err = "".join(r[2] for r in results)
    assert all(r[0] == 0 for r in results), f"{name}: exit codes {[r[0] for r in results]}:\n{err}"
    for rank in range(3):
        assert f"ok {rank} 54 {[7, 8] if rank == 0 else [0, 0]}" in out, f"{name}:\n{out}\n{err}"
    if len(results) == 3:
        return {rank: results[rank][2] for rank in range(3)}
    lines = err.splitlines()
    return {
        rank: "\n".join(line for line in lines if f"stall: rank {rank} " in line)
        for rank in range(3)
    }


def _ages(text: str, rank: int, what: str) -> list[int]:
    return [
        int(a)
        for a in re.findall(rf"stall: rank {rank} has waited (\d+) s in {re.escape(what)}", text)
    ]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_late_rank_is_named_while_the_others_wait(jobs, name):
    err = _ranks(name, jobs[name])
    shared_store = VARIANTS[name][0] != "mpi"
    for rank in (0, 1):
        ages = _ages(err[rank], rank, "#3 all_reduce (float32, 4 elements, SUM) of group 'default'")
        # warnings at about 3, 6 and 12 s while rank 2 is 20 s late: backoff, no flood
        assert 2 <= len(ages) <= 4 and ages == sorted(ages), (name, err[rank])
        for k, age in enumerate(ages):  # at 3, 6 and 12 s (or a tick later)
            assert age >= int(WARN) * 2**k, (name, err[rank])
        assert "The operation goes on" in err[rank]
        if not shared_store:
            assert "not known here (no shared store)" in err[rank], err[rank]
            continue
        assert "not entered by: rank 2 " in err[rank], (name, err[rank])
        if VARIANTS[name][2] == "stop":
            # stopped before it could say it completed #2: heard of at start-up only
            assert re.search(r"rank 2 has not answered for \d+ s \(last heard: it ", err[rank]), (
                name,
                err[rank],
            )
        else:
            assert "rank 2 completed #2 broadcast" in err[rank], (name, err[rank])
    # rank 2 never waited on #3; rank 0 then waited for rank 2's send
    assert _ages(err[2], 2, "#3") == [], (name, err[2])
    recv_ages = _ages(err[0], 0, "recv from rank 2 (int64, 2 elements)")
    assert recv_ages and recv_ages[0] >= 3, (name, err[0])
    if shared_store:
        assert (
            "rank 2 has not posted the matching send to rank 0; it completed #3 all_reduce"
            in err[0]
        ), (name, err[0])


# -- in this process ---------------------------------------------------------------------


def test_a_long_store_wait_says_so_then_times_out(monkeypatch, caplog):
    """A TCPStore get or wait still waiting after DISTCOMM_STALL_WARN_S names the keys,
    with backoff; the timeout still comes when it should, naming them too."""
    from distcomm.errors import DistStoreTimeoutError
    from distcomm.store import TCPStore

    monkeypatch.setenv("DISTCOMM_STALL_WARN_S", "0.3")
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=2.5) as store:
        caplog.set_level("WARNING", logger="distcomm.store.tcp")
        with pytest.raises(DistStoreTimeoutError, match=r"'late' was not set within 2\.5 s"):
            store.get("late")
        ages = [
            float(a)
            for a in re.findall(
                r"get\('late'\) on .* has waited ([\d.]+) s for 'late', not set yet", caplog.text
            )
        ]
        # at 0.3, 0.9 and 2.1 s on a quiet machine; a loaded one may report later, so
        # fewer, never more, and never earlier
        assert len(ages) == len(caplog.records) and 1 <= len(ages) <= 4, caplog.text
        assert ages == sorted(ages) and ages[0] >= 0.3, ages
        assert len(ages) < 3 or ages[2] >= 1.2, ages  # backoff: not every 0.3 s
        other = store.clone()  # a connection of its own: this one is busy waiting
        try:
            timer = threading.Timer(0.5, other.set, ("soon", "1"))
            timer.start()
            caplog.clear()
            store.wait(["soon"], 5.0)  # set after 0.5 s: a warning (one, unless the
            timer.join()  # loaded machine runs the timer late), then success
        finally:
            other.close()
        said = [record.getMessage() for record in caplog.records]
        assert said and all("'soon', not set yet" in m for m in said), caplog.text


def test_the_inspector_thread_ends_with_the_group(solo, monkeypatch):
    """One inspector thread while distcomm is initialised; none with
    DISTCOMM_STALL_WARN_S=0."""
    import distcomm as dist

    names = {t.name for t in threading.enumerate()}
    assert "distcomm-stall-inspector" in names
    dist.destroy_process_group()
    assert "distcomm-stall-inspector" not in {t.name for t in threading.enumerate()}
    monkeypatch.setenv("DISTCOMM_STALL_WARN_S", "0")
    dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1)
    assert "distcomm-stall-inspector" not in {t.name for t in threading.enumerate()}


def test_a_long_file_store_wait_says_so(tmp_path, monkeypatch, caplog):
    from distcomm.errors import DistStoreTimeoutError
    from distcomm.store import FileStore

    monkeypatch.setenv("DISTCOMM_STALL_WARN_S", "0.3")
    store = FileStore(str(tmp_path / "store"), timeout=1.0)
    try:
        caplog.set_level("WARNING", logger="distcomm.store")
        with pytest.raises(DistStoreTimeoutError, match="'late'"):
            store.wait(["late"])
    finally:
        store.close()
    ages = [float(a) for a in re.findall(r"has waited ([\d.]+) s for 'late'", caplog.text)]
    # at 0.3 and 0.9 s on a quiet machine; later, so fewer, on a loaded one
    assert 1 <= len(ages) <= 3 and ages == sorted(ages) and ages[0] >= 0.3, caplog.text


# -- the progress keys leave the store with their group ----------------------------------


def _stall_keys_then_destroy() -> bool:
    """In a rank: wait until its progress keys are published (default group, a subgroup),
    destroy the subgroup, see its key go, then destroy everything."""
    import distcomm as dist
    from distcomm.store import TCPStore

    dist.init_process_group("gloo", timeout=30)
    rank = dist.get_rank()
    sub = dist.new_group([0, 1])
    probe = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=30)
    try:
        probe.wait([f"distcomm/stall/0/{rank}", f"distcomm/stall/1/{rank}"])  # both published
        dist.destroy_process_group(sub)
        deadline = time.monotonic() + 20
        while probe.check([f"distcomm/stall/1/{rank}"]) and time.monotonic() < deadline:
            time.sleep(0.05)  # the inspector's next tick deletes the subgroup's key
        gone = not probe.check([f"distcomm/stall/1/{rank}"])
        assert probe.check([f"distcomm/stall/0/{rank}"])  # the default group's stays
    finally:
        probe.close()
    dist.destroy_process_group()
    return gone


def test_each_rank_deletes_its_progress_keys_when_its_groups_go():
    from distcomm.store import TCPStore
    from tests.harness import run_ranks

    with TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=30) as store:
        results = run_ranks(
            _stall_keys_then_destroy,
            2,
            timeout=120,
            env={
                "MASTER_PORT": str(store.port),
                "DISTCOMM_USE_AGENT_STORE": "1",
                "DISTCOMM_STALL_WARN_S": "1",
            },
        )
        assert results == [True, True]  # each subgroup key went with its group
        left = [key for key in store.list_keys() if key.startswith("distcomm/stall/")]
    assert left == [], left


def test_stopping_the_inspector_does_not_hang_when_the_store_is_gone():
    from types import SimpleNamespace

    from distcomm.store import TCPStore
    from distcomm.trace.stall import StallInspector

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=5)
    client = TCPStore("127.0.0.1", server.port, timeout=5)
    trace = SimpleNamespace(
        size=1, oldest_running=lambda cursor, p2p, now: (None, cursor), newest=lambda p2p: None
    )
    group = SimpleNamespace(
        store_key="0", is_member=True, ranks=[0], recorder=trace, rank=lambda: 0
    )
    inspector = StallInspector(1.0, client, lambda: [group])
    inspector.inspect()  # publishes its key
    server.wait(["distcomm/stall/0/0"], 5)
    server.close()  # the store goes away first
    inspector.stop()  # returns, raising nothing: the key could not be deleted
