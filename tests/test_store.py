"""Tests of the key-value stores: HashStore, FileStore, TCPStore and PrefixStore.

Every socket is on 127.0.0.1. Multi-process tests run their ranks through the harness
(`run_ranks`, no process group); the TCPStore master lives in the test process.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import multiprocessing
import os
import socket
import struct
import threading
import time
import uuid
from datetime import timedelta

import psutil
import pytest

from distcomm import auth
from distcomm.errors import (
    DistNetworkError,
    DistStoreError,
    DistStoreTimeoutError,
    DistTimeoutError,
)
from distcomm.store import EtcdStore, FileStore, HashStore, PrefixStore, Store, TCPStore
from distcomm.store.file import records as filelog
from distcomm.store.file import store as file_module
from distcomm.store.tcp.protocol import HEADER, Cmd, Status, encode_frame
from distcomm.store.tcp.server import StoreServer
from tests.etcd_server import etcd_endpoint  # noqa: F401 - fixture of the etcd kind
from tests.harness import run_ranks, wait_until
from tests.processes import free_port
from tests.store_wire import read_response, recv_exact

HOST = "127.0.0.1"
KINDS = ["hash", "file", "tcp", "prefix-tcp", "etcd"]


# -- helpers and fixtures -------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_auth_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISTCOMM_AUTH_KEY", raising=False)


@pytest.fixture
def master():
    store = TCPStore(HOST, 0, is_master=True, timeout=10)
    yield store
    store.close()


def _etcd_prefix() -> str:
    return f"/distcomm-test/store-{uuid.uuid4().hex[:12]}/"


def _make(kind: str, tmp_path, opened: list, request=None) -> Store:
    if kind == "etcd":  # a real etcd on loopback (tests/etcd_server.py), one per module
        store: Store = EtcdStore(
            request.getfixturevalue("etcd_endpoint"), _etcd_prefix(), timeout=10
        )
    elif kind == "hash":
        store: Store = HashStore()
        store.set_timeout(10)
    elif kind == "file":
        store = FileStore(str(tmp_path / "store"), timeout=10)
    else:
        store = TCPStore(HOST, 0, is_master=True, timeout=10)
        if kind == "prefix-tcp":
            opened.append(store)
            store = PrefixStore("ns", store)
    opened.append(store)
    return store


@pytest.fixture(params=KINDS)
def store(request, tmp_path):
    opened: list[Store] = []
    yield _make(request.param, tmp_path, opened, request)
    for each in reversed(opened):
        each.close()


@pytest.fixture(params=KINDS)
def store_pair(request, tmp_path):
    """Two handles on one store: (writer, reader), distinct objects where the kind allows."""
    opened: list[Store] = []
    first = _make(request.param, tmp_path, opened, request)
    if request.param == "hash":
        second: Store = first
    elif request.param == "etcd":
        second = EtcdStore(first.endpoint, first.prefix, timeout=10)
    elif request.param == "file":
        second = FileStore(first.path, timeout=10)
    elif request.param == "tcp":
        second = TCPStore(HOST, first.port, timeout=10)
    else:
        second = PrefixStore("ns", TCPStore(HOST, first.underlying_store.port, timeout=10))
        opened.append(second.underlying_store)
    opened.append(second)
    yield first, second
    for each in reversed(opened):
        each.close()


def _tcp_state(port: int) -> tuple[list, list]:
    """This process's sockets on `port` and its threads serving it."""
    conns = [
        c
        for c in psutil.Process().net_connections(kind="tcp")
        if (c.laddr and c.laddr.port == port) or (c.raddr and c.raddr.port == port)
    ]
    threads = [t for t in threading.enumerate() if t.name == f"distcomm-store-server-{port}"]
    return conns, threads


def _settle(store: Store) -> None:
    """Make `store`'s earlier writes visible to other clients before they read.

    TCPStore's set, append and multi_set return once sent, as torch's do; an answered
    request on the same connection comes after them, so once it returns they have landed.
    """
    store.check([])


def _in_thread(fn, *args):
    """Start `fn(*args)` in a thread; returns (thread, box) where box gets 'value'/'error'."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


# -- the Store methods, on every store --------------------------------------------------------


def test_set_get_roundtrip(store):
    store.set("text", "héllo")
    store.set("raw", b"\x00\xffbytes")
    store.set("empty", b"")
    assert store.get("text") == "héllo".encode()
    assert store.get("raw") == b"\x00\xffbytes"
    assert store.get("empty") == b""
    store.set("text", "again")
    assert store.get("text") == b"again"


def test_get_waits_for_a_later_set(store_pair):
    writer, reader = store_pair
    thread, box = _in_thread(reader.get, "late")
    time.sleep(0.1)
    writer.set("late", "value")
    thread.join(10)
    assert box == {"value": b"value"}


def test_get_of_a_missing_key_times_out_naming_it(store):
    store.set_timeout(0.5)
    with pytest.raises(
        DistStoreTimeoutError, match=r"key '(ns/)?missing' was not set within 0\.5 s"
    ):
        store.get("missing")
    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(DistTimeoutError):
        store.get("missing")
    with pytest.raises(TimeoutError):
        store.multi_get(["missing"])


def test_timeout_property(store):
    store.set_timeout(timedelta(seconds=3))
    assert store.timeout == timedelta(seconds=3)
    store.set_timeout(1.5)
    assert store.timeout == timedelta(seconds=1.5)


def test_add_counts_and_stores_decimal(store_pair):
    writer, reader = store_pair
    assert writer.add("counter", 5) == 5
    assert reader.add("counter", -2) == 3
    assert writer.add("counter", 0) == 3
    assert reader.get("counter") == b"3"
    writer.set("preset", "40")
    _settle(writer)
    assert reader.add("preset", 2) == 42
    assert writer.add("big", 2**70) == 2**70


def test_add_rejects_non_integers(store):
    store.set("word", "abc")
    with pytest.raises(DistStoreError, match=r"word'.*not an integer"):
        store.add("word", 1)
    with pytest.raises(TypeError, match="int"):
        store.add("counter", 1.5)
    assert store.get("word") == b"abc"


def test_compare_set_follows_torch(store):
    # missing key, empty expected: set, returns desired
    assert store.compare_set("a", "", "first") == b"first"
    assert store.get("a") == b"first"
    # missing key, non-empty expected: returns expected, sets nothing
    assert store.compare_set("b", "guess", "x") == b"guess"
    assert not store.check(["b"])
    # existing and equal: set, returns desired
    assert store.compare_set("a", "first", b"second") == b"second"
    assert store.get("a") == b"second"
    # existing and different: returns current, sets nothing
    assert store.compare_set("a", "wrong", "third") == b"second"
    assert store.get("a") == b"second"
    # an existing empty value counts as equal to an empty expected value
    store.set("e", b"")
    assert store.compare_set("e", "", "filled") == b"filled"


def test_wait_and_check(store_pair):
    writer, reader = store_pair
    assert reader.check([])
    assert not reader.check(["x"])
    writer.set("x", "1")
    _settle(writer)
    assert reader.check(["x"])
    assert not reader.check(["x", "y"])
    reader.wait(["x"])
    reader.wait(["x"], timeout=0.1)
    thread, box = _in_thread(reader.wait, ["x", "y", "z"])
    time.sleep(0.05)
    writer.set("z", "1")
    time.sleep(0.05)
    writer.set("y", "1")
    thread.join(10)
    assert box == {"value": None}
    assert reader.check(["x", "y", "z"])


@pytest.mark.parametrize(
    "timeout", [timedelta(days=30), float("inf"), 1e300], ids=["30-days", "inf", "1e300"]
)
def test_timeouts_of_any_length(store_pair, timeout):
    writer, reader = store_pair
    reader.set_timeout(timeout)
    thread, box = _in_thread(reader.wait, ["late"], timeout)
    time.sleep(0.1)
    writer.set("late", "1")
    thread.join(10)
    assert box == {"value": None}
    assert reader.get("late") == b"1"  # a get waits with the store's timeout: `timeout`


def test_wait_timeout_names_only_missing_keys(store):
    store.set("here", "1")
    with pytest.raises(
        DistStoreTimeoutError, match=r"keys \['(ns/)?gone', '(ns/)?lost'\] were not set"
    ) as info:
        store.wait(["here", "gone", "lost"], timedelta(seconds=0.3))
    assert "'here'" not in str(info.value)
    with pytest.raises(DistStoreTimeoutError, match=r"key '(ns/)?gone' was not set within 0\.2 s"):
        store.wait(["gone"], 0.2)


def test_delete_key(store):
    store.set("k", "v")
    assert store.delete_key("k") is True
    assert store.delete_key("k") is False
    assert not store.check(["k"])
    store.set_timeout(0.2)
    with pytest.raises(DistStoreTimeoutError):
        store.get("k")


def test_num_keys(store):
    assert store.num_keys() == 0
    store.set("a", "1")
    store.add("b", 1)
    store.append("c", "x")
    store.set("a", "2")
    assert store.num_keys() == 3
    store.delete_key("a")
    assert store.num_keys() == 2


def test_append(store_pair):
    writer, reader = store_pair
    writer.append("log", "a")
    _settle(writer)
    reader.append("log", b"b")
    _settle(reader)
    writer.append("log", "c")
    _settle(writer)
    assert reader.get("log") == b"abc"


def test_multi_set_and_multi_get(store_pair):
    writer, reader = store_pair
    writer.multi_set(["a", "b", "c"], ["1", b"2", ""])
    assert reader.multi_get(["c", "a", "b"]) == [b"", b"1", b"2"]
    assert reader.multi_get([]) == []
    with pytest.raises(ValueError, match="one value per key"):
        writer.multi_set(["a", "b"], ["1"])
    thread, box = _in_thread(reader.multi_get, ["later1", "later2"])
    time.sleep(0.05)
    writer.set("later2", "2")
    writer.set("later1", "1")
    thread.join(10)
    assert box == {"value": [b"1", b"2"]}


def test_multi_get_timeout_names_missing_keys(store):
    store.set("have", "1")
    store.set_timeout(0.3)
    with pytest.raises(DistStoreTimeoutError, match=r"\['(ns/)?no1', '(ns/)?no2'\]"):
        store.multi_get(["have", "no1", "no2"])


def test_keys_and_values_are_validated(store):
    with pytest.raises(ValueError, match="non-empty"):
        store.set("", "v")
    with pytest.raises(TypeError, match="str"):
        store.set(3, "v")
    with pytest.raises(TypeError, match="str or bytes"):
        store.set("k", 3)
    with pytest.raises(TypeError, match="list of str"):
        store.wait("k")
    with pytest.raises(TypeError, match="list of str"):
        store.check("k")


def test_large_values(store_pair):
    writer, reader = store_pair
    if isinstance(writer, EtcdStore):
        pytest.skip(
            "etcd takes requests up to about 1.5 MiB (its --max-request-bytes); "
            "test_etcd_store checks that larger values are refused clearly"
        )
    big = os.urandom(1 << 20) * 6  # 6 MiB: under the TCPStore limit of 8 MiB per value
    writer.set("big", big)
    assert reader.get("big") == big
    writer.append("big", b"tail")
    _settle(writer)
    assert reader.multi_get(["big"])[0][-4:] == b"tail"


def test_threads_share_one_store(store):
    def work(index):
        for step in range(50):
            store.add("total", 1)
            store.set(f"t{index}", str(step))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert store.get("total") == b"200"
    assert store.multi_get([f"t{i}" for i in range(4)]) == [b"49"] * 4


# -- PrefixStore ------------------------------------------------------------------------------


def test_prefix_store_namespaces_keys():
    base = HashStore()
    outer = PrefixStore("job", base)
    inner = PrefixStore("group", outer)
    inner.set("k", "v")
    inner.add("n", 2)
    assert base.get("job/group/k") == b"v"
    assert base.get("job/group/n") == b"2"
    assert inner.underlying_store is outer
    assert outer.underlying_store is base
    assert inner.num_keys() == base.num_keys() == 2
    base.set("other", "x")
    assert outer.num_keys() == 3  # counts every key underneath, like torch
    assert not outer.check(["other"])


def test_prefix_store_timeout_follows_the_underlying_store():
    base = HashStore()
    prefixed = PrefixStore("p", base)
    base.set_timeout(7)
    assert prefixed.timeout == timedelta(seconds=7)
    prefixed.set_timeout(0.2)
    assert base.timeout == timedelta(seconds=0.2)
    with pytest.raises(DistStoreTimeoutError, match="'p/missing'"):
        prefixed.get("missing")


def test_prefix_store_close_leaves_the_underlying_store_open(master):
    PrefixStore("p", master).close()
    master.set("still", "open")
    assert master.get("still") == b"open"
    with pytest.raises(TypeError, match="Store"):
        PrefixStore("p", {})


# -- TCPStore ---------------------------------------------------------------------------------


def test_tcp_store_properties(master):
    assert master.host == HOST
    assert master.port > 0
    assert master.local_address == HOST
    client = TCPStore(HOST, master.port, timeout=5)
    try:
        assert client.port == master.port
        assert client.local_address == HOST
    finally:
        client.close()


def test_tcp_master_binds_exactly_its_host(master):
    listening = [
        c
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == master.port
    ]
    assert [c.laddr.ip for c in listening] == [HOST]


def test_tcp_arguments_are_validated():
    with pytest.raises(ValueError, match="port"):
        TCPStore(HOST, 70000)
    with pytest.raises(ValueError, match="is_master"):
        TCPStore(HOST, 0)
    with pytest.raises(ValueError, match="world_size"):
        TCPStore(HOST, 0, world_size=0, is_master=True)
    with pytest.raises(TypeError, match="timedelta"):
        TCPStore(HOST, 0, is_master=True, timeout="soon")


def test_tcp_close_leaves_no_socket_or_thread():
    store = TCPStore(HOST, 0, is_master=True, timeout=5)
    client = TCPStore(HOST, store.port, timeout=5)
    port = store.port
    conns, threads = _tcp_state(port)
    assert any(c.status == psutil.CONN_LISTEN for c in conns)
    assert len(threads) == 1
    client.close()
    store.close()
    store.close()  # idempotent
    assert _tcp_state(port) == ([], [])
    with pytest.raises(DistStoreError, match="closed"):
        store.set("k", "v")
    with pytest.raises(DistStoreError, match="closed"):
        client.get("k")


class _CountingSocket(socket.socket):
    """A socket that records the options set on it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.options: list[int] = []

    def setsockopt(self, level: int, option: int, *value: object) -> None:
        self.options.append(option)
        return super().setsockopt(level, option, *value)


def test_a_request_sets_its_kernel_timeout_only_when_the_one_set_does_not_serve():
    """A request is its send and its receive: the receive timeout is set when a budget
    is not within a second (longer) or a quarter (shorter) of the one set, and a send
    timeout only for a request too large to go out at once."""
    from distcomm.store.tcp.connection import Connection

    ours, server = socket.socketpair()
    sock = _CountingSocket(fileno=ours.detach())
    conn = Connection(sock)
    answer = encode_frame(Status.OK, [b"7"])[0]
    request = encode_frame(Cmd.ADD, [b"k", b"1"])

    def ask(budget: float) -> None:
        server.sendall(answer)  # waiting before the request is sent: read after it
        assert conn.exchange(request, budget) == (Status.OK, [b"7"], None)
        assert recv_exact(server, len(request[0])) == request[0]

    try:
        for budget in (300.9, 301.0, 301.0, 300.8):  # the register, then the store timeout
            ask(budget)
        assert sock.options == [socket.SO_RCVTIMEO]
        ask(31.0)  # a wait's first slice
        ask(301.0)
        assert sock.options == [socket.SO_RCVTIMEO] * 3
        ask(float("inf"))  # none
        ask(float("inf"))
        assert sock.options == [socket.SO_RCVTIMEO] * 4
        big = encode_frame(Cmd.SET, [b"k", b"v" * (1 << 20)])
        assert len(big) > 1  # sent in pieces: it may wait, so its send is bounded
        reader = threading.Thread(target=recv_exact, args=(server, sum(map(len, big))))
        reader.start()
        conn.exchange(big, 301.0, quiet=True)
        reader.join(30)
        assert sock.options == [socket.SO_RCVTIMEO] * 4 + [socket.SO_SNDTIMEO]
        timeval = struct.Struct("@ll")
        assert timeval.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)) == (
            0,
            0,
        )  # inf: the kernel's none
        assert timeval.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, 16)) == (
            301,
            0,
        )
    finally:
        conn.close(shutdown=True)
        server.close()


def test_tcp_garbage_collection_stops_the_server():
    store = TCPStore(HOST, 0, is_master=True, timeout=5)
    port = store.port
    del store
    gc.collect()
    # collected on the server's own thread, the loop ends on its next turn, unjoined
    wait_until(
        lambda: _tcp_state(port) == ([], []),
        f"the server on port {port} to stop",
        detail=lambda: _tcp_state(port),
    )


def test_tcp_harness_construction_still_works():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=5.0)
    assert isinstance(store.port, int) and store.port > 0
    store.close()


def test_tcp_close_unblocks_a_waiting_thread(master):
    client = TCPStore(HOST, master.port, timeout=30)
    thread, box = _in_thread(client.get, "never")
    time.sleep(0.2)
    client.close()
    thread.join(10)
    assert isinstance(box.get("error"), DistStoreError)
    assert "closed" in str(box["error"])


def test_tcp_client_before_master_retries():
    port = free_port(HOST)
    thread, box = _in_thread(lambda: TCPStore(HOST, port, timeout=10))
    time.sleep(0.3)
    late_master = TCPStore(HOST, port, is_master=True, world_size=2, timeout=10)
    try:
        thread.join(10)
        client = box["value"]
        client.set("k", "v")
        assert late_master.get("k") == b"v"
        client.close()
    finally:
        late_master.close()


def test_tcp_client_without_master_names_the_address():
    port = free_port(HOST)
    with pytest.raises(DistNetworkError, match=f"127.0.0.1:{port}"):
        TCPStore(HOST, port, timeout=0.3)


def test_tcp_wait_for_workers():
    port = free_port(HOST)
    clients = [_in_thread(lambda: TCPStore(HOST, port, timeout=10)) for _ in range(2)]
    store = TCPStore(HOST, port, world_size=3, is_master=True, timeout=10)
    try:
        for thread, box in clients:
            thread.join(10)
            box["value"].close()
    finally:
        store.close()


def test_tcp_wait_for_workers_timeout_says_who_arrived():
    with pytest.raises(DistStoreTimeoutError, match="only 1 of 3"):
        TCPStore(HOST, 0, world_size=3, is_master=True, timeout=0.5)
    # without wait_for_workers the constructor returns at once
    TCPStore(HOST, 0, world_size=3, is_master=True, timeout=0.5, wait_for_workers=False).close()


def test_tcp_many_clients_and_parked_waiters(master):
    clients = [TCPStore(HOST, master.port, timeout=20) for _ in range(150)]
    try:
        for index, client in enumerate(clients):
            client.set(f"c{index}", str(index))
        assert master.multi_get([f"c{i}" for i in range(150)]) == [
            str(i).encode() for i in range(150)
        ]
        waiters = [_in_thread(client.get, "go") for client in clients[:60]]
        time.sleep(0.3)
        master.set("go", "now")
        for thread, box in waiters:
            thread.join(20)
            assert box == {"value": b"now"}
    finally:
        for client in clients:
            client.close()


def test_tcp_bad_requests_get_errors_and_the_connection_stays_usable(master):
    with socket.create_connection((HOST, master.port), timeout=5) as sock:
        hello = recv_exact(sock, auth.HELLO_SIZE)
        assert hello[len(auth.MAGIC)] == 0  # no key required
        sock.sendall(HEADER.pack(0, 250))  # unknown command
        assert read_response(sock)[0] == Status.ERROR
        sock.sendall(b"".join(encode_frame(Cmd.SET, [b"only-a-key"])))
        status, args = read_response(sock)  # SET is answered only when refused
        assert status == Status.LATE_ERROR and b"malformed SET" in args[0]
        sock.sendall(HEADER.pack(3, Cmd.SET) + b"\x09\x00\x00")  # truncated argument length
        assert read_response(sock)[0] == Status.LATE_ERROR
        sock.sendall(HEADER.pack(3, Cmd.ADD) + b"\x09\x00\x00")
        assert read_response(sock)[0] == Status.ERROR
        sock.sendall(b"".join(encode_frame(Cmd.SET, [b"raw", b"ok"])))
        sock.sendall(b"".join(encode_frame(Cmd.CHECK, [b"raw"])))
        assert read_response(sock) == (Status.OK, [b"\x01"])
    assert master.get("raw") == b"ok"


def _silent_server(listener: socket.socket, log: list) -> None:
    """A fake store that answers everything but its first ADD (and quiet SETs, as the real one)."""
    first = True
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        sock.sendall(auth.hello_message(None)[0])
        while True:
            header = recv_exact(sock, HEADER.size)
            if len(header) < HEADER.size:
                break
            size, code = HEADER.unpack(header)
            recv_exact(sock, size)
            log.append(code)
            if code == Cmd.ADD and first:
                first = False
            elif code not in (Cmd.SET, Cmd.APPEND, Cmd.MULTI_SET):
                sock.sendall(b"".join(encode_frame(Status.OK, [b"1"])))
        sock.close()


def test_tcp_client_safety_net_resets_a_stuck_connection():
    listener = socket.create_server((HOST, 0))
    log: list[int] = []
    thread = threading.Thread(target=_silent_server, args=(listener, log), daemon=True)
    thread.start()
    client = TCPStore(HOST, listener.getsockname()[1], timeout=0.3)
    try:
        with pytest.raises(DistStoreTimeoutError, match="did not answer"):
            client.add("stuck", 1)
        assert client.add("fine", 1) == 1  # on a new connection, not registered twice
        assert log == [Cmd.REGISTER, Cmd.ADD, Cmd.ADD]
    finally:
        client.close()
        listener.close()


def _host_store(conn) -> None:
    store = TCPStore(HOST, 0, is_master=True, timeout=30)
    conn.send(store.port)
    time.sleep(60)


@pytest.mark.timeout(60)
def test_tcp_master_death_fails_blocked_clients_promptly():
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_host_store, args=(child,), daemon=True)
    process.start()
    try:
        assert parent.poll(30)
        client = TCPStore(HOST, parent.recv(), timeout=30)
        killer = threading.Timer(0.3, process.kill)
        killer.start()
        with pytest.raises(
            DistNetworkError, match=r"store at 127\.0\.0\.1:\d+ closed the connection"
        ):
            client.get("never-set")
        with pytest.raises(DistNetworkError, match="closed the connection"):
            client.set("after", "death")
        client.close()
    finally:
        process.kill()
        process.join(10)


# -- TCPStore across processes ----------------------------------------------------------------


def _hammer(port: int, rounds: int) -> list[str]:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = TCPStore(HOST, port, timeout=30)
    try:
        for step in range(rounds):
            store.add("counter", 1)
            store.set(f"rank{rank}/{step}", f"{rank}:{step}")
            store.append("log", f"{rank},")
            assert store.get(f"rank{rank}/{step}") == f"{rank}:{step}".encode()
        last = store.multi_get([f"rank{peer}/{rounds - 1}" for peer in range(size)])
        return [value.decode() for value in last]
    finally:
        store.close()


@pytest.mark.timeout(120)
def test_tcp_many_processes_hammer_one_store(master):
    size, rounds = 8, 100
    results = run_ranks(_hammer, size, master.port, rounds, timeout=90)
    expected = [f"{peer}:{rounds - 1}" for peer in range(size)]
    assert results == [expected] * size
    assert master.get("counter") == str(size * rounds).encode()
    entries = master.get("log").decode().rstrip(",").split(",")
    assert sorted(entries) == sorted(str(rank) for rank in range(size) for _ in range(rounds))


def _claim(port: int, keys: int) -> list[bytes]:
    rank = os.environ["RANK"]
    store = TCPStore(HOST, port, timeout=30)
    try:
        return [store.compare_set(f"leader{k}", "", f"rank{rank}") for k in range(keys)]
    finally:
        store.close()


@pytest.mark.timeout(120)
def test_tcp_compare_set_race_has_one_winner(master):
    size, keys = 6, 30
    results = run_ranks(_claim, size, master.port, keys, timeout=90)
    for k in range(keys):
        seen = {results[rank][k] for rank in range(size)}
        winners = [rank for rank in range(size) if results[rank][k] == f"rank{rank}".encode()]
        assert len(winners) == 1
        assert seen == {f"rank{winners[0]}".encode()}
        assert master.get(f"leader{k}") == f"rank{winners[0]}".encode()


def _authed_client(port: int) -> bytes:
    rank = os.environ["RANK"]
    store = TCPStore(HOST, port, timeout=10)
    try:
        store.set(f"hello{rank}", rank)
        return store.get(f"hello{rank}")
    finally:
        store.close()


# -- authentication ---------------------------------------------------------------------------


@pytest.fixture
def keyed_master(monkeypatch):
    monkeypatch.setenv("DISTCOMM_AUTH_KEY", "the-right-key")
    store = TCPStore(HOST, 0, is_master=True, timeout=10)
    yield store
    store.close()


@pytest.mark.timeout(60)
def test_auth_right_key_works_across_processes(keyed_master):
    env = {"DISTCOMM_AUTH_KEY": "the-right-key"}
    assert run_ranks(_authed_client, 2, keyed_master.port, timeout=45, env=env) == [b"0", b"1"]


def test_auth_wrong_or_missing_key_is_refused(keyed_master, monkeypatch):
    monkeypatch.setenv("DISTCOMM_AUTH_KEY", "a-wrong-key")
    with pytest.raises(DistNetworkError, match="refused this process's DISTCOMM_AUTH_KEY"):
        TCPStore(HOST, keyed_master.port, timeout=2)
    monkeypatch.delenv("DISTCOMM_AUTH_KEY")
    with pytest.raises(DistNetworkError, match="requires authentication"):
        TCPStore(HOST, keyed_master.port, timeout=2)
    keyed_master.set("still", "serving")
    assert keyed_master.get("still") == b"serving"


def test_auth_key_against_a_keyless_server(master, monkeypatch):
    monkeypatch.setenv("DISTCOMM_AUTH_KEY", "the-right-key")
    with pytest.raises(DistNetworkError, match="does not authenticate"):
        TCPStore(HOST, master.port, timeout=2)


def test_auth_the_raw_request_used_below_works_without_a_key(master):
    with socket.create_connection((HOST, master.port), timeout=5) as sock:
        recv_exact(sock, auth.HELLO_SIZE)
        sock.sendall(b"".join(encode_frame(Cmd.SET, [b"pwned", b"x" * 100])))
        sock.sendall(b"".join(encode_frame(Cmd.CHECK, [b"pwned"])))
        assert read_response(sock) == (Status.OK, [b"\x01"])
    assert master.check(["pwned"])


def test_auth_unauthenticated_raw_requests_are_not_served(keyed_master):
    # A request longer than the proof: taken as a bad proof, the connection is dropped.
    with socket.create_connection((HOST, keyed_master.port), timeout=5) as sock:
        hello = recv_exact(sock, auth.HELLO_SIZE)
        assert hello[len(auth.MAGIC)] == 1  # key required
        sock.sendall(b"".join(encode_frame(Cmd.SET, [b"pwned", b"x" * 100])))
        try:
            assert sock.recv(1024) == b""
        except ConnectionResetError:
            pass
    # A short request: nothing is parsed or answered before a proof arrives.
    with socket.create_connection((HOST, keyed_master.port), timeout=5) as sock:
        recv_exact(sock, auth.HELLO_SIZE)
        sock.sendall(b"".join(encode_frame(Cmd.SET, [b"pwned", b"x"])))
        sock.settimeout(0.3)
        with pytest.raises(socket.timeout):
            sock.recv(1024)
        assert not keyed_master.check(["pwned"])
    assert not keyed_master.check(["pwned"])
    assert keyed_master.num_keys() == 0


def test_auth_key_argument_instead_of_the_environment():
    store = TCPStore(HOST, 0, is_master=True, timeout=10, auth_key=b"given-key")
    try:
        with pytest.raises(DistNetworkError, match="requires authentication"):
            TCPStore(HOST, store.port, timeout=2)
        with pytest.raises(DistNetworkError, match="refused this process's DISTCOMM_AUTH_KEY"):
            TCPStore(HOST, store.port, timeout=2, auth_key="another-key")
        client = TCPStore(HOST, store.port, timeout=5, auth_key="given-key")
        twin = client.clone()  # a clone proves the same key
        client.set("k", "v")
        assert twin.get("k") == b"v"
        twin.close()
        client.close()
    finally:
        store.close()
    with pytest.raises(TypeError, match="auth_key must be bytes, str or None"):
        TCPStore(HOST, 0, is_master=True, auth_key=123)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="auth_key must not be empty"):
        TCPStore(HOST, 0, is_master=True, auth_key=b"")


def test_auth_stalled_handshake_is_dropped(monkeypatch):
    monkeypatch.setenv("DISTCOMM_AUTH_KEY", "the-right-key")
    monkeypatch.setattr(StoreServer, "handshake_timeout", 0.3)
    store = TCPStore(HOST, 0, is_master=True, timeout=5)
    try:
        with socket.create_connection((HOST, store.port), timeout=5) as sock:
            assert len(recv_exact(sock, auth.HELLO_SIZE)) == auth.HELLO_SIZE
            sock.sendall(b"\x00" * 10)  # part of a proof, then silence
            assert sock.recv(1024) == b""  # the server hangs up
        store.set("k", "v")  # and keeps serving authenticated clients
    finally:
        store.close()


# -- FileStore --------------------------------------------------------------------------------


def _file_user(path: str) -> int:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = FileStore(path, world_size=size, timeout=30)
    for _ in range(20):
        store.add("count", 1)
    store.set(f"rank{rank}", str(rank))
    store.wait([f"rank{peer}" for peer in range(size)])
    count = int(store.get("count"))
    store.close()
    return count


@pytest.mark.timeout(120)
def test_file_store_across_processes_and_cleanup(tmp_path):
    path = str(tmp_path / "shared")
    size = 4
    assert run_ranks(_file_user, size, path, timeout=90) == [20 * size] * size
    assert not os.path.exists(path)


def test_file_store_cleanup_after_the_last_user(tmp_path):
    path = str(tmp_path / "store")
    first = FileStore(path, world_size=2, timeout=5)
    second = FileStore(path, world_size=2, timeout=5)
    second.set("k", "v")
    first.close()
    assert os.path.exists(path)
    assert second.get("k") == b"v"
    second.close()
    second.close()  # idempotent
    assert not os.path.exists(path)
    with pytest.raises(DistStoreError, match="closed"):
        second.get("k")
    fresh = FileStore(path, world_size=1, timeout=5)
    assert fresh.num_keys() == 0
    del fresh
    gc.collect()
    assert not os.path.exists(path)


def test_file_store_without_world_size_keeps_the_file(tmp_path):
    path = str(tmp_path / "store")
    store = FileStore(path, timeout=5)
    store.set("k", "v")
    store.close()
    assert os.path.exists(path)
    again = FileStore(path, timeout=5)
    assert again.get("k") == b"v"
    again.close()


def test_file_store_path_errors_name_the_path(tmp_path):
    missing = str(tmp_path / "no" / "such" / "dir" / "store")
    with pytest.raises(DistStoreError, match=r"no/such/dir.*does not exist"):
        FileStore(missing)
    with pytest.raises(DistStoreError, match="is a directory"):
        FileStore(str(tmp_path))
    junk = tmp_path / "junk"
    junk.write_bytes(b"not a store at all, just some text\n")
    with pytest.raises(DistStoreError, match="not a distcomm FileStore file"):
        FileStore(str(junk))
    with pytest.raises(ValueError, match="world_size"):
        FileStore(str(tmp_path / "x"), world_size=0)


def test_file_store_permission_error_message():
    exc = PermissionError(errno.EACCES, "Permission denied")
    message = str(file_module._open_error("/shared/locked/store", exc))
    assert "'/shared/locked/store'" in message and "permission denied" in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_file_store_unwritable_directory(tmp_path):
    folder = tmp_path / "readonly"
    folder.mkdir(mode=0o500)
    with pytest.raises(DistStoreError, match=r"readonly.*permission denied"):
        FileStore(str(folder / "store"))


def test_file_store_survives_a_torn_record(tmp_path):
    path = str(tmp_path / "store")
    first = FileStore(path, timeout=5)
    first.set("a", "1")
    with open(path, "ab") as f:  # a writer that died halfway through a record
        f.write(filelog.RECORD.pack(file_module.OP_SET, 5, 5) + b"ab")
    second = FileStore(path, timeout=5)
    assert second.get("a") == b"1"
    second.set("b", "2")
    assert first.multi_get(["a", "b"]) == [b"1", b"2"]
    assert first.num_keys() == 2
    first.close()
    second.close()


@pytest.mark.parametrize("use_ofd", [True, False], ids=["ofd", "flock"])
def test_file_lock_separates_two_files_of_one_process(tmp_path, use_ofd):
    if use_ofd and not hasattr(fcntl, "F_OFD_SETLK"):
        pytest.skip("no open-file-description locks on this platform")
    path = str(tmp_path / "lockfile")
    fds = [os.open(path, os.O_RDWR | os.O_CREAT) for _ in range(2)]
    try:
        first, second = (file_module.FileLock(fd, path, use_ofd) for fd in fds)
        deadline = file_module.Deadline(5)
        first.acquire(True, deadline)
        with pytest.raises(DistStoreTimeoutError, match="could not lock"):
            second.acquire(False, file_module.Deadline(0.05))
        first.release()
        second.acquire(False, deadline)
        first.acquire(False, deadline)  # shared locks coexist
        with pytest.raises(DistStoreTimeoutError):
            second.acquire(True, file_module.Deadline(0.05))  # upgrade blocked by the other
        first.release()
        second.acquire(True, deadline)
        second.release()
    finally:
        for fd in fds:
            os.close(fd)


def test_file_record_format_is_length_prefixed(tmp_path):
    path = tmp_path / "store"
    store = FileStore(str(path), timeout=5)
    store.set("key", b"value")
    store.close()
    data = path.read_bytes()
    assert data.startswith(file_module.MAGIC)
    offset = len(file_module.MAGIC) + filelog.RECORD.size  # after the OPEN record
    op, key_size, value_size = struct.unpack_from("<BII", data, offset)
    assert (op, key_size, value_size) == (file_module.OP_SET, 3, 5)
    start = offset + filelog.RECORD.size
    assert data[start : start + 8] == b"keyvalue"


def test_store_package_exports():
    import distcomm.store

    assert sorted(distcomm.store.__all__) == [
        "EtcdStore",
        "FileStore",
        "HashStore",
        "PrefixStore",
        "QueueEmptyError",
        "Store",
        "TCPStore",
    ]
