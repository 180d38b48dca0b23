"""Shared fixtures: persistent worlds per (backend, world size), an in-process 1-rank group."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

import distcomm as dist
from distcomm.backends import registered_backends
from tests.harness import LOOPBACK_ENV, RankPool

WORLD_SIZES = (1, 2, 3, 4)


#: DISTCOMM_HOST_ID values that place ranks 0, 2 on one pretend host and 1, 3 on another
TWO_HOSTS = "two-hosts"


def cpu_variants() -> list[tuple[str, dict[str, str]]]:
    """(backend, extra environment) pairs the conformance suite runs: every CPU backend,
    gloo once more with its shared-memory path switched off, and gloo on two pretend
    hosts (shared memory within each, TCP between them)."""
    variants = [(name, {}) for name in cpu_backends()]
    if "gloo" in cpu_backends():
        variants.append(("gloo", {"DISTCOMM_GLOO_TRANSPORT": "tcp"}))
        variants.append(("gloo", {"DISTCOMM_HOST_ID": TWO_HOSTS}))
    return variants


def _rank_env(env: dict[str, str]):
    if env.get("DISTCOMM_HOST_ID") == TWO_HOSTS:
        return lambda rank: {"DISTCOMM_HOST_ID": f"host-{rank % 2}"}
    return None


def cpu_backends() -> list[str]:
    """Registered backends that serve CPU arrays and run without a launcher here."""
    names = []
    for name, record in sorted(registered_backends().items()):
        if "cpu" in record.devices and name != "mpi" and not record.availability():
            names.append(name)
    return names


class World:
    """A world of ranks for one (backend, size), rebuilt when a failing test broke it."""

    def __init__(self, backend: str, size: int, env: dict[str, str] | None = None) -> None:
        self.backend, self.size, self.env = backend, size, dict(env or {})
        self._pool: RankPool | None = None

    def run(self, fn, *args, timeout: float = 60.0, **kwargs):
        """Run `fn(*args, **kwargs)` on every rank; the results in rank order."""
        if self._pool is None or self._pool.broken:
            env = {k: v for k, v in self.env.items() if v != TWO_HOSTS}
            self._pool = RankPool(
                self.size, self.backend, env=env, rank_env=_rank_env(self.env), init_timeout=60.0
            )
        return self._pool.run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __repr__(self) -> str:
        return f"World({self.backend!r}, {self.size}, env={self.env!r})"


def _variant_id(param: tuple) -> str:
    backend, size, env = param
    if env.get("DISTCOMM_HOST_ID") == TWO_HOSTS:
        return f"{backend}+2hosts-{size}"
    forced = env.get("DISTCOMM_GLOO_TRANSPORT")
    return f"{backend}{'+' + forced if forced else ''}-{size}"


#: set by tests/mpi_world.py: this process is one rank of an mpiexec job (the launcher
#: under test is chosen by DISTCOMM_TEST_MPIEXEC, see tests/mpijobs.py)
UNDER_MPIEXEC = os.environ.get("DISTCOMM_TEST_UNDER_MPIEXEC") == "1"


def _world_params() -> list[tuple]:
    if UNDER_MPIEXEC:
        return [("mpi", 0, {})]
    return [(b, n, env) for b, env in cpu_variants() for n in WORLD_SIZES]


def world_id(param: tuple) -> str:
    """A world fixture's test id: "mpi" under mpiexec, else backend, size and variant."""
    return "mpi" if param[0] == "mpi" else _variant_id(param)


def open_world(param: tuple) -> Iterator[World]:
    """A world fixture's body: the mpiexec job's ranks under tests/test_mpi.py, else a
    World of `param` (backend, size, environment), closed after its tests."""
    if UNDER_MPIEXEC:
        from tests.mpi_world import MpiWorld

        w = MpiWorld()
    else:
        w = World(*param)
    yield w
    w.close()


@pytest.fixture(scope="session", params=_world_params(), ids=world_id)
def world(request):
    """A persistent initialised world; tests run functions on all its ranks."""
    yield from open_world(request.param)


@pytest.fixture
def solo(monkeypatch):
    """An initialised 1-rank default group in the test process itself (no sockets)."""
    for key, value in LOOPBACK_ENV.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1, timeout=10)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_leftover_group():
    """Every test starts and ends without a default group in the test process."""
    yield
    if dist.is_initialized() and not UNDER_MPIEXEC:  # there, the world group persists
        dist.destroy_process_group()
        pytest.fail("the test left an initialised process group behind")


#: the name of a TCPStore server's thread, before its port (distcomm/store/tcp/server.py)
_STORE_SERVER = "distcomm-store-server-"
#: seconds a server thread the test started may take to end after the test
_STOPPING_GRACE = 5.0


@pytest.fixture(autouse=True)
def _no_store_server_left():
    """A test stops every TCPStore server it started (`close()` on the hosting store).

    Only server threads started during the test count, not those of the persistent
    worlds (`RankPool.open_pools`); one still stopping gets a short grace.
    """
    before = set(threading.enumerate())
    yield
    started = [
        t for t in threading.enumerate() if t not in before and t.name.startswith(_STORE_SERVER)
    ]
    if not started:
        return
    pools = {f"{_STORE_SERVER}{pool.store_port}" for pool in list(RankPool.open_pools)}
    end = time.monotonic() + _STOPPING_GRACE
    for thread in started:
        if thread.name not in pools:
            thread.join(max(0.0, end - time.monotonic()))
    left = sorted(t.name for t in started if t.is_alive() and t.name not in pools)
    if left:
        pytest.fail(
            f"the test left TCPStore server thread(s) running: {', '.join(left)}; "
            "close() every store it hosts, on its error paths too"
        )


def pytest_report_header(config):
    return f"distcomm CPU backends under test: {', '.join(cpu_backends())}; cores: {os.cpu_count()}"
