"""init_process_group end to end: every init method and launcher environment, then a collective."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import distcomm as dist
from distcomm.bootstrap.stores import _JOINED as JOINED
from tests.harness import run_ranks
from tests.processes import free_port

REPO = str(Path(__file__).resolve().parent.parent)


def _init_and_reduce(backend: str | None, init_method: str | None, pass_ranks: bool) -> tuple:
    kwargs = {}
    if pass_ranks:
        kwargs = {"rank": int(os.environ["TEST_RANK"]), "world_size": int(os.environ["TEST_SIZE"])}
    dist.init_process_group(backend, init_method=init_method, timeout=60, **kwargs)
    try:
        x = np.full(4, dist.get_rank() + 1, dtype=np.int64)
        dist.all_reduce(x)
        return dist.get_rank(), dist.get_world_size(), dist.get_backend(), int(x[0])
    finally:
        dist.destroy_process_group()


def _check(results: list, n: int, backend: str = "tcp") -> None:
    assert results == [(r, n, backend, n * (n + 1) // 2) for r in range(n)]


def _clear_torch_vars(rank: int) -> dict[str, str]:
    return {"RANK": "", "WORLD_SIZE": "", "LOCAL_RANK": "", "LOCAL_WORLD_SIZE": ""}


@pytest.mark.parametrize("n", [1, 3])
def test_env_init_rank0_hosts_the_store(n):
    port = free_port()
    # backend=None: the default for CPU arrays, gloo
    _check(
        run_ranks(
            _init_and_reduce, n, None, None, False, timeout=60, env={"MASTER_PORT": str(port)}
        ),
        n,
        backend="gloo",
    )


def test_tcp_url_with_explicit_ranks():
    port = free_port()
    results = run_ranks(
        _init_and_reduce,
        2,
        "tcp",
        f"tcp://127.0.0.1:{port}",
        True,
        timeout=60,
        rank_env=lambda r: {"TEST_RANK": str(r), "TEST_SIZE": "2", "RANK": "", "WORLD_SIZE": ""},
    )
    _check(results, 2)


def test_file_url(tmp_path):
    results = run_ranks(
        _init_and_reduce,
        3,
        "tcp",
        f"file://{tmp_path}/rendezvous",
        True,
        timeout=60,
        rank_env=lambda r: {"TEST_RANK": str(r), "TEST_SIZE": "3"},
    )
    _check(results, 3)


def test_open_mpi_environment():
    port = free_port()

    def ompi(rank: int) -> dict[str, str]:
        env = _clear_torch_vars(rank)
        env.update(
            OMPI_COMM_WORLD_RANK=str(rank),
            OMPI_COMM_WORLD_SIZE="3",
            OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
            MASTER_PORT=str(port),
        )
        return env

    _check(run_ranks(_init_and_reduce, 3, "tcp", None, False, timeout=60, rank_env=ompi), 3)


def test_mpich_pmi_environment():
    port = free_port()

    def pmi(rank: int) -> dict[str, str]:
        env = _clear_torch_vars(rank)
        env.update(PMI_RANK=str(rank), PMI_SIZE="2", MASTER_PORT=str(port))
        return env

    _check(run_ranks(_init_and_reduce, 2, "tcp", None, False, timeout=60, rank_env=pmi), 2)


def test_slurm_environment_takes_master_from_the_nodelist():
    port = free_port()

    def slurm(rank: int) -> dict[str, str]:
        env = _clear_torch_vars(rank)
        env.update(
            SLURM_PROCID=str(rank),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(rank),
            SLURM_JOB_NODELIST="localhost,other-node[01-03]",
            MASTER_ADDR="",
            MASTER_PORT=str(port),
            SLURM_JOB_ID="4242",
        )
        return env

    _check(run_ranks(_init_and_reduce, 2, "tcp", None, False, timeout=60, rank_env=slurm), 2)


def _explicit_store(port: int) -> tuple:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=30)
    dist.init_process_group("tcp", store=store, rank=rank, world_size=size)
    try:
        x = np.ones(2)
        dist.all_reduce(x)
        return float(x[0])
    finally:
        dist.destroy_process_group()
        store.close()


def test_explicit_store_argument():
    with dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) as store:
        assert run_ranks(_explicit_store, 3, store.port, timeout=60) == [3.0, 3.0, 3.0]


def _reinit_twice(path: str) -> list:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = []
    for round_ in range(2):
        dist.init_process_group(
            "tcp", init_method=f"file://{path}-{round_}", rank=rank, world_size=size, timeout=30
        )
        x = np.full(1, round_ + 1.0)
        dist.all_reduce(x)
        out.append(float(x[0]))
        dist.destroy_process_group()
    return out


def test_init_destroy_init_again(tmp_path):
    assert run_ranks(_reinit_twice, 2, str(tmp_path / "rdzv"), timeout=60) == [[2.0, 4.0]] * 2


def _missing_rank() -> str:
    try:
        dist.init_process_group("tcp", init_method="env://")
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_missing_rank_lists_what_was_looked_for():
    message = run_ranks(
        _missing_rank,
        1,
        timeout=30,
        rank_env=lambda r: {"RANK": "", "WORLD_SIZE": "", "MASTER_PORT": "29999"},
    )[0]
    for word in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        assert word in message, message


# -- ranks that never start: warnings while init waits, then it completes ----------------------

JOIN_SCRIPT = """
import sys
import numpy as np
import distcomm as dist

dist.init_process_group(sys.argv[3], init_method=sys.argv[1], rank=int(sys.argv[2]),
                        world_size=3, timeout=600)  # far beyond the test's deadline
x = np.ones(2)
dist.all_reduce(x)
print(f"sum {x[0]:.0f}", flush=True)
dist.destroy_process_group()
"""


def _start(script, url: str, rank: int, stall: str, backend: str) -> _Watched:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTCOMM_")}
    env.update(
        DISTCOMM_STALL_WARN_S=stall,
        DISTCOMM_SOCKET_IFNAME="lo",
        PYTHONPATH=os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")])),
    )
    return _Watched(
        subprocess.Popen(
            [sys.executable, str(script), url, str(rank), backend],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    )


class _Watched:
    """A process whose output is read as it comes, so a test can wait for a line."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self._cond = threading.Condition()
        self._out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._readers = [
            threading.Thread(target=self._read, args=(name,), daemon=True) for name in self._out
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str) -> None:
        for line in getattr(self.proc, name):
            with self._cond:
                self._out[name].append(line)
                self._cond.notify_all()

    def warnings(self) -> list[str]:
        """The "still waiting" lines of its stderr so far."""
        with self._cond:
            return [line for line in self._out["stderr"] if "still waiting" in line]

    def wait_for(self, predicate: Callable[[list[str]], bool], timeout: float) -> bool:
        """Whether `predicate(self.warnings())` came true within `timeout` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.warnings()), timeout)

    def finish(self, timeout: float) -> tuple[str, str]:
        """Its stdout and stderr, once it has ended (killed after `timeout` seconds)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass  # killed: its exit status says so
        self.kill()
        for reader in self._readers:
            reader.join(10)
        return "".join(self._out["stdout"]), "".join(self._out["stderr"])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _joined(url: str, count: int, timeout: float) -> bool:
    """Whether `count` ranks have joined the roll call of the store at `url` (hosted by its
    rank 0) and so wait for the others, within `timeout` seconds."""
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timeout)
    try:
        end = time.monotonic() + timeout
        while store.add(f"{JOINED}/count", 0) < count:
            if time.monotonic() > end:
                return False
            time.sleep(0.05)
        return True
    finally:
        store.close()


def _names_rank_2_alone(warnings: list[str]) -> bool:
    return (
        len(warnings) >= 2 and "2 of 3 ranks joined the store; missing rank(s) 2." in (warnings[-1])
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["tcp", "gloo"])
@pytest.mark.parametrize("stall", ["0.5", "0"])
def test_init_warns_which_ranks_are_missing_then_completes(tmp_path, stall, backend):
    script = tmp_path / "join.py"
    script.write_text(JOIN_SCRIPT)
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [_start(script, url, rank, stall, backend) for rank in (0, 1)]
    try:
        # ranks 0 and 1 wait for rank 2 alone, however long they took to start
        assert _joined(url, 2, timeout=120), [p.finish(0) for p in procs]
        if stall == "0":
            time.sleep(2)  # a wait in which warnings at 0.5, 1 and 2 s would have come
        else:  # both have warned at least twice, the last time naming rank 2 alone
            for proc in procs:
                assert proc.wait_for(_names_rank_2_alone, 120), proc.finish(0)
        for proc in procs:
            assert proc.proc.poll() is None, proc.finish(0)
        procs.append(_start(script, url, 2, stall, backend))
        outputs = [proc.finish(120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.proc.returncode == 0 and out.strip() == "sum 3", (out, err)
    # rank 0, which hosts the store, and rank 1 wait for rank 2: both warn, naming it
    for rank in (0, 1):
        err = outputs[rank][1]
        warnings = [line for line in err.splitlines() if "still waiting" in line]
        if stall == "0":
            assert not warnings, err
            assert "has waited" not in err, err  # nor does a store wait
            continue
        assert all(f"[rank {rank}/3]" in line for line in warnings), err
        # the first may still miss a slow-starting rank 1; the last names rank 2 alone
        assert "2 of 3 ranks joined the store; missing rank(s) 2." in warnings[-1], err
        # backoff, not one warning per poll: each next report at least twice as far out
        nexts = [float(re.search(r"next report at (\d+) s", line)[1]) for line in warnings]
        assert all(b >= 2 * a for a, b in itertools.pairwise(nexts)), err
    assert "still waiting" not in outputs[2][1], outputs[2]


def test_init_timeout_names_the_ranks_that_never_joined():
    from distcomm.rendezvous import rendezvous

    with pytest.raises(dist.DistTimeoutError) as caught:
        rendezvous(
            f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=3,
            timeout=1.0,
            environ={"DISTCOMM_STALL_WARN_S": "0"},
        )
    message = str(caught.value)
    assert "[rank 0/3]" in message and "only 1 of 3 ranks joined the store" in message
    assert "rank(s) 1, 2 never did" in message


@pytest.mark.parametrize("value", ["-1", "soon", "inf"])
def test_stall_warn_setting_rejects_bad_values(value):
    from distcomm import config

    with pytest.raises(ValueError, match="DISTCOMM_STALL_WARN_S"):
        config.load({"DISTCOMM_STALL_WARN_S": value})
    assert config.load({}).stall_warn_s == 30.0
    assert config.load({"DISTCOMM_STALL_WARN_S": "0"}).stall_warn_s == 0.0
