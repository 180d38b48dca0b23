"""The process's fabric: one I/O thread, connections on first use, shared by every group.

Each test counts what it made (threads, this process's connections, store requests);
none times anything.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import distcomm as dist
from distcomm import auth, world
from distcomm.backends.engine.transport import dial as dial_module
from distcomm.backends.engine.transport import fabric as fabric_module
from distcomm.backends.tcp import TcpBackend
from distcomm.deadline import Deadline
from distcomm.store import HashStore, TCPStore
from tests.harness import LOOPBACK_ENV, run_ranks
from tests.processes import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import scale  # benchmarks/: its CountingStore

pytestmark = pytest.mark.timeout(300)


def _transport(group=None):
    group = dist.group.WORLD if group is None else group
    return group._backends["cpu"]._transport


def _links() -> set[tuple]:
    """This process's fabric connections, as (peer process rank, local port, peer port)."""
    fabric = _transport().fabric
    return {
        (p, c.sock.getsockname()[1], c.sock.getpeername()[1])
        for p, c in fabric.connections().items()
    }


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _server_threads() -> int:
    """The TCPStore server's threads, which live in rank 0's process."""
    return sum(t.name.startswith("distcomm-store") for t in threading.enumerate())


# -- threads: one I/O thread, whatever the number of peers and groups -------------------------


def _threads_after_work() -> dict:
    x = np.ones(1000)
    dist.all_reduce(x)
    dist.barrier()
    dist.broadcast(x, 0)
    n = dist.get_world_size()
    dist.all_to_all_single(np.zeros(n), np.ones(n))  # every rank connected to every other
    sub = dist.new_group(list(range(n)))
    dist.all_reduce(x, group=sub)
    halves = dist.new_group(
        [r for r in range(n) if r % 2 == dist.get_rank() % 2], use_local_synchronization=True
    )
    dist.all_reduce(x, group=halves)
    return {
        "os": _os_threads() - _server_threads(),
        "py": threading.active_count() - _server_threads(),
        "names": sorted(t.name for t in threading.enumerate()),
    }


@pytest.mark.parametrize("backend", ["tcp", "gloo"])
@pytest.mark.parametrize("nprocs", [2, 8])
def test_threads_per_rank_stay_constant(nprocs, backend):
    # gloo over TCP: the path whose every collective uses the connections
    env = {"DISTCOMM_GLOO_TRANSPORT": "tcp"} if backend == "gloo" else None
    results = run_ranks(_threads_after_work, nprocs, backend=backend, env=env, timeout=120)
    for rank, counts in enumerate(results):
        # main, the fabric's I/O thread and the stall inspector's; nothing per peer
        assert counts["os"] <= 4 and counts["py"] <= 4, (rank, counts)
        assert sum(name.startswith("distcomm-io") for name in counts["names"]) == 1, counts


# -- connections on first use --------------------------------------------------------------


def _store_barrier(name: str) -> None:
    """Every rank is here (through the job's store, not the group's connections)."""
    store, n = world.state.store, dist.get_world_size()
    if store.add(f"test/{name}/count", 1) == n:
        store.set(f"test/{name}/all", "1")
    store.wait([f"test/{name}/all"])


def _connections_as_ops_run() -> dict:
    seen = {"init": len(_links())}
    _store_barrier("counted")  # before any rank's first collective dials
    x = np.ones(1)
    dist.all_reduce(x)
    dist.barrier()
    seen["all_reduce+barrier"] = len(_links())
    n = dist.get_world_size()
    dist.all_to_all_single(np.zeros(n), np.ones(n))
    seen["all_to_all"] = len(_links())
    return seen


def test_a_rank_connects_only_to_the_peers_it_talks_to():
    n = 16
    results = run_ranks(
        _connections_as_ops_run,
        n,
        backend="gloo",
        env={"DISTCOMM_GLOO_TRANSPORT": "tcp"},
        timeout=180,
    )
    for rank, seen in enumerate(results):
        assert seen["init"] == 0, (rank, seen)
        assert 0 < seen["all_reduce+barrier"] <= 2 * math.log2(n) + 4, (rank, seen)
        assert seen["all_to_all"] == n - 1, (rank, seen)


def _shm_only() -> int:
    x = np.ones(1000)
    dist.all_reduce(x)
    dist.barrier()
    dist.broadcast(x, 0)
    return len(_links())


def test_gloo_on_one_host_holds_no_tcp_connection():
    # shared memory carries every collective: nothing uses a TCP connection
    assert run_ranks(_shm_only, 4, backend="gloo", timeout=60) == [0] * 4


# -- one connection per pair of processes, shared by all groups -----------------------------


def _groups_share_connections() -> dict:
    x = np.ones(64)
    dist.all_reduce(x)
    dist.barrier()
    before = _links()
    n, me = dist.get_world_size(), dist.get_rank()
    again = dist.new_group(list(range(n)))
    dist.all_reduce(x, group=again)
    dist.barrier(group=again)
    mine, _all = dist.new_subgroups_by_enumeration([list(range(n))])
    dist.all_reduce(x, group=mine)
    split = dist.split_group(split_ranks=[list(range(n))])
    dist.all_reduce(x, group=split)
    after_groups = _links()
    dist.destroy_process_group(again)
    dist.destroy_process_group(split)
    after_destroy = _links()
    y = np.full(4, float(me))
    dist.all_reduce(y)  # the world still works over the same connections
    return {
        "before": before,
        "groups": after_groups,
        "destroyed": after_destroy,
        "sum": float(y[0]),
        "last": _links(),
    }


def test_new_groups_of_connected_ranks_open_no_socket_and_destroy_closes_none():
    n = 4
    results = run_ranks(
        _groups_share_connections,
        n,
        backend="gloo",
        env={"DISTCOMM_GLOO_TRANSPORT": "tcp"},
        timeout=120,
    )
    for rank, seen in enumerate(results):
        assert seen["before"], (rank, seen)
        assert seen["groups"] == seen["before"], (rank, seen)
        assert seen["destroyed"] == seen["before"], (rank, seen)
        assert seen["last"] == seen["before"], (rank, seen)
        assert seen["sum"] == n * (n - 1) / 2, (rank, seen)


# -- dialling: at once from both ends, for another set-up, from something else -------------


def _pair(store, body):
    """Make a 2-rank tcp group of two backends in this process (one thread each) and run
    `body(backend)` on both at once; returns their results in rank order."""
    results: list = [None, None]
    errors: list = []
    start, end = threading.Barrier(2), threading.Barrier(2)

    def rank(r: int) -> None:
        backend = None
        try:
            backend = TcpBackend(store, r, 2, 20.0, "pair")
            start.wait(20)
            results[r] = body(backend)
            end.wait(20)  # neither leaves (closing the connection) before both looked
        except BaseException as exc:  # reported below
            errors.append(exc)
            end.abort()
        finally:
            if backend is not None:
                backend.shutdown()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return results


def _exchange_at_once(backend: TcpBackend):
    other = 1 - backend.rank
    out = np.full(8, float(backend.rank))
    into = np.zeros(8)
    recv = backend.recv(into, other, 7)
    backend.send(out, other, 7).wait()
    recv.wait()
    conns = backend._transport.fabric.connections()
    return into[0], [(c.sock.getsockname(), c.sock.getpeername()) for c in conns.values()]


def test_two_ranks_that_dial_each_other_at_once_end_with_one_connection():
    for _ in range(20):
        store = HashStore()
        (got0, links0), (got1, links1) = _pair(store, _exchange_at_once)
        assert (got0, got1) == (1.0, 0.0)
        assert len(links0) == 1 and len(links1) == 1, (links0, links1)
        assert links0[0] == links1[0][::-1], (links0, links1)  # the same socket pair


def _dial(port: int, hello: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        auth.client_handshake(sock, None, Deadline(10), "the fabric")
        sock.sendall(hello)
        return sock.recv(1)


def test_a_dial_for_another_set_up_or_rank_is_refused_and_strangers_are_dropped(monkeypatch):
    for key, value in LOOPBACK_ENV.items():
        monkeypatch.setenv(key, value)
    store = HashStore()
    fabric = fabric_module.attach(store, 5, 10.0)
    try:
        port = int(fabric.address.rsplit(":", 1)[1])
        hello = dial_module._HELLO
        magic = dial_module._HELLO_MAGIC
        # another set-up (the job re-initialised on the same store), another rank
        assert _dial(port, hello.pack(magic, 1, fabric.generation + 1, 5)) == b"\x00"
        assert _dial(port, hello.pack(magic, 1, fabric.generation, 6)) == b"\x00"
        # something that is not distcomm: dropped, and the fabric goes on serving
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n" * 4)
            sock.settimeout(10)
            try:
                while sock.recv(4096):
                    pass
            except ConnectionResetError:
                pass  # closed with the rest of the request unread
        assert _dial(port, hello.pack(magic, 1, fabric.generation, 5)) == b"\x01"
        assert fabric.connections().keys() <= {1}
    finally:
        fabric.release()


# -- store requests: a constant number per rank, not one per peer ---------------------------


def _count_requests(port: int, backend: str) -> dict:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    inner = TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=60)
    store = scale.CountingStore(inner)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=60)
    init = store.requests()
    dist.all_reduce(np.ones(4))
    before = store.requests()
    group = dist.new_group(list(range(size)))
    made = store.requests() - before
    dist.all_reduce(np.ones(4), group=group)
    dist.destroy_process_group()
    return {"init": init, "new_group": made, "counts": dict(store.counts)}


#: the store requests of a group's roll call (`check_same_backends`): its barrier
BARRIER = 7
#: at most this many more per rank to make a group: the roll call's extra key on the last
#: rank to arrive, the process's address (its first group only), and gloo's exchange of
#: hosts and shared-memory segments (the roll call numbers the set-up for the backends,
#: and a group's first dial, later, fetches the members' addresses)
MORE = {"tcp": 2, "gloo": 10}


@pytest.mark.parametrize("backend", ["tcp", "gloo"])
def test_a_group_costs_each_rank_the_same_few_store_requests_at_any_size(backend):
    per_size = {}
    for n in (2, 8):
        results = run_ranks(_count_requests, n, free_port(), backend, timeout=120)
        per_size[n] = results
        for rank, counts in enumerate(results):
            assert counts["init"] <= BARRIER + MORE[backend], (n, rank, counts)
            assert counts["new_group"] <= BARRIER + MORE[backend], (n, rank, counts)
    # no request per peer: a rank costs the same at 8 ranks as at 2 (the last to arrive
    # at a barrier writes one key more)
    for what in ("init", "new_group"):
        small = {c[what] for c in per_size[2]}
        large = {c[what] for c in per_size[8]}
        assert max(large) <= max(small) + 1 and min(large) >= min(small) - 1, (what, per_size)
