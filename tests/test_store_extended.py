"""Tests of the stores' extended API (torch 2.13's): list_keys, the queues, barrier,
has_extended_api, and TCPStore's multi_tenant, master_listen_fd and use_libuv.

The Store tests run on every store kind of tests/test_store.py (its fixtures); where
torch is installed, one test per operation runs the same sequence on torch's store and
compares the answers.
"""

from __future__ import annotations

import os
import queue
import socket
import tempfile
import threading
import time
import uuid
from datetime import timedelta

import pytest

from distcomm.errors import DistNetworkError, DistStoreError, DistStoreTimeoutError
from distcomm.store import (
    EtcdStore,
    FileStore,
    HashStore,
    PrefixStore,
    QueueEmptyError,
    Store,
    TCPStore,
)
from tests import test_store as base
from tests.etcd_server import etcd_endpoint  # noqa: F401 - fixture of the etcd kind
from tests.harness import run_ranks
from tests.test_store import HOST, _in_thread, _settle, _tcp_state

WAIT = 30.0  # the most any blocking step of a test waits


# -- fixtures: test_store's store kinds ---------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_auth_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISTCOMM_AUTH_KEY", raising=False)


@pytest.fixture
def master():
    store = TCPStore(HOST, 0, is_master=True, timeout=WAIT)
    yield store
    store.close()


@pytest.fixture(params=base.KINDS)
def store(request, tmp_path):
    yield from base.store.__wrapped__(request, tmp_path)


@pytest.fixture(params=base.KINDS)
def store_pair(request, tmp_path):
    yield from base.store_pair.__wrapped__(request, tmp_path)


def _join(thread: threading.Thread, box: dict):
    """The result of an `_in_thread` call, which must finish within WAIT seconds."""
    thread.join(WAIT)
    assert not thread.is_alive(), "the thread is still blocked"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _until(condition, what: str) -> None:
    """Wait (up to WAIT seconds) for `condition()` to hold."""
    end = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < end, f"{what} did not happen within {WAIT} s"
        time.sleep(0.01)


# -- list_keys --------------------------------------------------------------------------------


def test_list_keys_lists_keys_not_queues(store):
    assert store.list_keys() == []
    store.set("a", "1")
    store.add("b", 1)
    store.append("c", "x")
    store.queue_push("q", "item")
    _settle(store)
    assert sorted(store.list_keys()) == ["a", "b", "c"]
    assert len(store.list_keys()) == store.num_keys() == 3
    store.delete_key("a")
    assert sorted(store.list_keys()) == ["b", "c"]


def test_list_keys_of_a_prefix_store_holds_only_its_keys():
    inner = HashStore()
    for key in ("other", "pre/a", "pre/x/y", "prefix/z", "pre"):
        inner.set(key, "v")
    view = PrefixStore("pre", inner)
    assert sorted(view.list_keys()) == ["a", "x/y"]
    assert view.num_keys() == 5  # the underlying store's, as torch counts
    nested = PrefixStore("x", view)
    assert nested.list_keys() == ["y"]


# -- queues -----------------------------------------------------------------------------------


def test_queue_is_fifo_across_handles(store_pair):
    writer, reader = store_pair
    assert reader.queue_len("q") == 0
    writer.queue_push("q", "first")
    writer.queue_push("q", b"\x00second")
    writer.queue_push("q", "")
    _settle(writer)
    assert reader.queue_len("q") == 3
    assert reader.queue_pop("q") == b"first"
    assert reader.queue_pop("q", block=False) == b"\x00second"
    assert writer.queue_pop("q") == b""
    assert reader.queue_len("q") == writer.queue_len("q") == 0
    assert reader.queue_len("never-pushed") == 0


def test_queue_pop_without_blocking_on_an_empty_queue(store):
    with pytest.raises(QueueEmptyError, match=r"queue '(ns/)?q' .* is empty") as caught:
        store.queue_pop("q", block=False)
    assert isinstance(caught.value, DistStoreError)
    assert isinstance(caught.value, queue.Empty)
    store.queue_push("q", "x")
    _settle(store)
    assert store.queue_pop("q", block=False) == b"x"
    with pytest.raises(QueueEmptyError):
        store.queue_pop("q", block=False)


def test_blocking_queue_pop_times_out_naming_the_queue(store):
    store.set_timeout(0.2)
    with pytest.raises(DistStoreTimeoutError, match=r"queue '(ns/)?q' stayed empty for 0\.2 s"):
        store.queue_pop("q")


def test_blocking_queue_pop_gets_a_later_push(store_pair):
    writer, reader = store_pair
    reader.set_timeout(WAIT)
    thread, box = _in_thread(reader.queue_pop, "later")
    time.sleep(0.05)  # give the pop a chance to block first (either order must work)
    writer.queue_push("later", "value")
    assert _join(thread, box) == b"value"
    assert writer.queue_len("later") == 0


def test_queues_are_apart_from_keys(store):
    store.set("a", "key")
    store.queue_push("a", "item")
    _settle(store)
    assert store.get("a") == b"key"
    assert store.queue_len("a") == 1
    assert store.num_keys() == 1
    assert store.delete_key("a") is True
    assert store.queue_len("a") == 1  # delete_key leaves the queue, as torch's
    assert store.delete_key("a") is False
    store.set_timeout(0.2)
    with pytest.raises(DistStoreTimeoutError):
        store.get("a")  # a queue is not a value
    assert store.queue_pop("a") == b"item"


def test_wait_and_check_count_a_non_empty_queue_as_set(store_pair):
    writer, reader = store_pair
    assert not reader.check(["q"])
    writer.queue_push("q", "x")
    _settle(writer)
    assert reader.check(["q"])
    reader.wait(["q"], timedelta(seconds=WAIT))
    writer.set("k", "v")
    _settle(writer)
    assert reader.check(["q", "k"])
    assert reader.queue_pop("q") == b"x"
    assert not reader.check(["q"])
    with pytest.raises(DistStoreTimeoutError, match="q' was not set"):
        reader.wait(["q"], 0.2)
    thread, box = _in_thread(reader.wait, ["q2", "k"], WAIT)
    time.sleep(0.05)
    writer.queue_push("q2", "y")
    assert _join(thread, box) is None
    assert reader.queue_len("q2") == 1  # a wait takes nothing


def test_queue_arguments_are_validated(store):
    with pytest.raises(ValueError, match="non-empty"):
        store.queue_push("", "x")
    with pytest.raises(TypeError, match="key must be a str"):
        store.queue_push(1, "x")
    with pytest.raises(TypeError, match="str or bytes"):
        store.queue_push("q", 3)
    with pytest.raises(TypeError, match="block must be True or False"):
        store.queue_pop("q", block="no")
    with pytest.raises(TypeError, match="key must be a str"):
        store.queue_len(None)


def test_many_threads_pop_each_item_once(store_pair):
    writer, reader = store_pair
    reader.set_timeout(WAIT)
    count, threads = 40, 4
    popped: list[list[bytes]] = [[] for _ in range(threads)]

    def pop_until_stop(index: int) -> None:
        handle = reader.clone()
        try:
            while (item := handle.queue_pop("work")) != b"stop":
                popped[index].append(item)
        finally:
            if handle is not reader:
                handle.close()

    started = [_in_thread(pop_until_stop, index) for index in range(threads)]
    for item in range(count):
        writer.queue_push("work", str(item))
    for _ in range(threads):
        writer.queue_push("work", "stop")
    for thread, box in started:
        _join(thread, box)
    everything = sorted(int(item) for items in popped for item in items)
    assert everything == list(range(count))


# -- queues across processes ------------------------------------------------------------------


def _open(kind: str, where: str) -> Store:
    if kind == "tcp":
        return TCPStore(HOST, int(where), timeout=WAIT)
    if kind == "file":
        return FileStore(where, timeout=WAIT)
    endpoint, prefix = where.split(" ")
    return EtcdStore(endpoint, prefix, timeout=WAIT)


def _popper(kind: str, where: str) -> list[str]:
    """Pop items of queue "work" until a "stop"; then the items popped, in order."""
    store = _open(kind, where)
    try:
        store.add("poppers", 1)
        got = []
        while (item := store.queue_pop("work")) != b"stop":
            got.append(item.decode())
        return got
    finally:
        store.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["tcp", "file", "etcd"])
def test_processes_pop_each_item_exactly_once(kind, tmp_path, request):
    size, count = 4, 60
    if kind == "tcp":
        owner: Store = TCPStore(HOST, 0, is_master=True, timeout=WAIT)
        where = str(owner.port)
    elif kind == "file":
        where = str(tmp_path / "store")
        owner = FileStore(where, timeout=WAIT)
    else:
        endpoint = request.getfixturevalue("etcd_endpoint")
        prefix = f"/distcomm-test/queue-{uuid.uuid4().hex[:12]}/"
        owner, where = EtcdStore(endpoint, prefix, timeout=WAIT), f"{endpoint} {prefix}"
    try:
        for item in range(count // 2):  # half before the poppers start, half while they pop
            owner.queue_push("work", str(item))

        def push_rest() -> None:
            owner.wait(["poppers"], WAIT)
            for item in range(count // 2, count):
                owner.queue_push("work", str(item))
            for _ in range(size):
                owner.queue_push("work", "stop")

        pusher, box = _in_thread(push_rest)
        results = run_ranks(_popper, size, kind, where, timeout=120)
        _join(pusher, box)
        everything = [int(item) for items in results for item in items]
        assert sorted(everything) == list(range(count))
        for items in results:  # FIFO: each popper sees the items in push order
            assert [int(item) for item in items] == sorted(int(item) for item in items)
        assert owner.queue_len("work") == 0
    finally:
        owner.close()


# -- barrier ----------------------------------------------------------------------------------


def test_barrier_of_one_and_its_keys(store):
    store.barrier("solo", 1)
    assert sorted(store.list_keys()) == ["solo/last_member", "solo/num_members"]
    store.barrier("solo", 1)  # a finished barrier's key returns at once, as torch's
    assert store.get("solo/num_members") == b"2"


def test_barrier_releases_every_caller(store_pair):
    first, second = store_pair
    size = 3
    handles = [first, second, first.clone()]
    try:
        started = [_in_thread(handle.barrier, "round", size, WAIT) for handle in handles]
        results = [_join(thread, box) for thread, box in started]
    finally:
        if handles[2] is not first:
            handles[2].close()
    assert results == [None] * size
    assert first.get("round/num_members") == b"3"


def test_barrier_timeout_says_how_many_arrived(store):
    other = store.clone()
    try:
        thread, box = _in_thread(other.barrier, "partial", 3, timedelta(seconds=WAIT))
        _until(lambda: store.check(["partial/num_members"]), "the first arrival")
        with pytest.raises(
            DistStoreTimeoutError,
            match=r"barrier 'partial' .*: 2 of 3 "
            r"callers arrived within 0\.2 s",
        ):
            store.barrier("partial", 3, timeout=0.2)
        store.barrier("partial", 3, timeout=WAIT)  # the third arrival releases the first
        assert _join(thread, box) is None
    finally:
        if other is not store:
            other.close()


def test_barrier_default_timeout_is_the_stores(store):
    store.set_timeout(0.2)
    with pytest.raises(DistStoreTimeoutError, match=r"1 of 2 callers arrived within 0\.2 s"):
        store.barrier("b", 2)


def test_barrier_arguments_are_validated(store):
    with pytest.raises(ValueError, match=">= 1"):
        store.barrier("b", 0)
    with pytest.raises(TypeError, match="world_size must be an int"):
        store.barrier("b", "2")
    with pytest.raises(ValueError, match="non-empty"):
        store.barrier("", 1)


# -- has_extended_api -------------------------------------------------------------------------


class _Minimal(Store):
    """A Store with only the basic methods (a stand-in for a third-party store)."""

    def __init__(self) -> None:
        super().__init__()
        self._inner = HashStore()

    def set(self, key, value):
        self._inner.set(key, value)

    def get(self, key):
        return self._inner.get(key)

    def add(self, key, amount):
        return self._inner.add(key, amount)

    def compare_set(self, key, expected_value, desired_value):
        return self._inner.compare_set(key, expected_value, desired_value)

    def wait(self, keys, timeout=None):
        self._inner.wait(keys, timeout)

    def check(self, keys):
        return self._inner.check(keys)

    def delete_key(self, key):
        return self._inner.delete_key(key)

    def num_keys(self):
        return self._inner.num_keys()

    def append(self, key, value):
        self._inner.append(key, value)


def test_has_extended_api(store):
    assert store.has_extended_api() is True


def test_a_minimal_store_has_no_extended_api_but_a_barrier():
    minimal = _Minimal()
    assert minimal.has_extended_api() is False
    assert PrefixStore("p", minimal).has_extended_api() is False
    for call in (
        minimal.list_keys,
        lambda: minimal.queue_push("q", "x"),
        lambda: minimal.queue_pop("q"),
        lambda: minimal.queue_len("q"),
    ):
        with pytest.raises(NotImplementedError, match="_Minimal does not implement"):
            call()
    minimal.barrier("b", 1)  # built on add and wait
    assert minimal.check(["b/last_member"])


# -- TCPStore: the parked pops ----------------------------------------------------------------


def test_tcp_blocking_pop_is_parked_at_the_server(master):
    client = TCPStore(HOST, master.port, timeout=WAIT)
    try:
        thread, box = _in_thread(client.queue_pop, "q")
        server = master._server
        _until(lambda: len(server._poppers.get(b"q", ())) == 1, "the parked pop")
        master.queue_push("q", "handed")
        assert _join(thread, box) == b"handed"
        assert b"q" not in server._poppers and b"q" not in server._queues
    finally:
        client.close()


def test_tcp_pop_of_a_closed_client_takes_no_item(master):
    client = TCPStore(HOST, master.port, timeout=WAIT)
    thread, box = _in_thread(client.queue_pop, "q")
    server = master._server
    _until(lambda: len(server._poppers.get(b"q", ())) == 1, "the parked pop")
    client.close()
    with pytest.raises(DistStoreError, match="closed"):
        _join(thread, box)
    _until(lambda: b"q" not in server._poppers, "the server forgetting the pop")
    master.queue_push("q", "kept")
    assert master.queue_pop("q", block=False) == b"kept"


def test_tcp_pops_waiting_together_are_served_in_order(master):
    clients = [TCPStore(HOST, master.port, timeout=WAIT) for _ in range(3)]
    server = master._server
    try:
        started = []
        for index, client in enumerate(clients):
            started.append(_in_thread(client.queue_pop, "line"))
            _until(lambda n=index + 1: len(server._poppers.get(b"line", ())) == n, "the parked pop")
        for item in ("0", "1", "2"):
            master.queue_push("line", item)
        assert [_join(thread, box) for thread, box in started] == [b"0", b"1", b"2"]
    finally:
        for client in clients:
            client.close()


# -- TCPStore: multi_tenant, master_listen_fd, use_libuv --------------------------------------


def test_tcp_multi_tenant_masters_share_one_server():
    first = TCPStore(HOST, 0, is_master=True, multi_tenant=True, timeout=WAIT)
    port = first.port
    second = TCPStore(HOST, port, is_master=True, multi_tenant=True, timeout=WAIT)
    try:
        first.set("k", "v")
        assert second.get("k") == b"v"
        with pytest.raises(DistNetworkError, match="cannot listen"):
            TCPStore(HOST, port, is_master=True, timeout=WAIT)  # not a tenant: binds
        first.close()  # the other tenant keeps the server
        assert second.get("k") == b"v"
        assert TCPStore(HOST, port, timeout=WAIT).get("k") == b"v"
    finally:
        first.close()
        second.close()
    assert _tcp_state(port)[1] == []  # the last tenant stopped it
    with pytest.raises(DistNetworkError):
        TCPStore(HOST, port, timeout=0.3)


def test_tcp_serves_on_a_given_listening_socket():
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port = sock.getsockname()[1]
        store = TCPStore(HOST, port, is_master=True, master_listen_fd=sock.fileno(), timeout=WAIT)
        try:
            client = TCPStore(HOST, port, timeout=WAIT)
            client.set("k", "v")
            assert store.get("k") == b"v"
            client.close()
        finally:
            store.close()
        os.fstat(sock.fileno())  # the caller's descriptor is still the caller's
        taker = TCPStore(HOST, 0, is_master=True, master_listen_fd=sock.fileno(), timeout=WAIT)
        assert taker.port == port  # port 0 takes the socket's
        taker.close()


def test_tcp_master_listen_fd_is_validated():
    with socket.socket() as sock, socket.socket(type=socket.SOCK_DGRAM) as udp:
        sock.bind((HOST, 0))
        port = sock.getsockname()[1]
        with pytest.raises(ValueError, match=f"bound to port {port}, but the store was given"):
            TCPStore(HOST, port + 1, is_master=True, master_listen_fd=sock.fileno())
        udp.bind((HOST, 0))
        with pytest.raises(ValueError, match="not a TCP socket"):
            TCPStore(HOST, 0, is_master=True, master_listen_fd=udp.fileno())
        with pytest.raises(TypeError, match="master_listen_fd must be an int"):
            TCPStore(HOST, 0, is_master=True, master_listen_fd="3")
    with socket.socket() as unbound, pytest.raises(ValueError, match="not bound"):
        TCPStore(HOST, 0, is_master=True, master_listen_fd=unbound.fileno())
    with tempfile.TemporaryFile() as plain, pytest.raises(ValueError, match="not an open"):
        TCPStore(HOST, 0, is_master=True, master_listen_fd=plain.fileno())


def test_tcp_use_libuv_is_accepted():
    for flag in (True, False):
        store = TCPStore(HOST, 0, is_master=True, use_libuv=flag, timeout=WAIT)
        store.set("k", "v")
        assert store.get("k") == b"v"
        store.close()
    with pytest.raises(TypeError, match="use_libuv must be True or False"):
        TCPStore(HOST, 0, is_master=True, use_libuv="yes")


# -- FileStore: queued items survive compaction -----------------------------------------------


def test_file_queue_survives_compaction(tmp_path):
    path = str(tmp_path / "store")
    store = FileStore(path, timeout=WAIT)
    try:
        for item in range(1200):
            store.queue_push("q", f"{item:04d}".encode() * 250)  # 1000 bytes each
        for item in range(1190):
            assert store.queue_pop("q")[:4] == f"{item:04d}".encode()
        store.set("k", "v")  # a write after the pops: the log is compacted
        assert os.path.getsize(path) < 1 << 20
        fresh = FileStore(path, timeout=WAIT)
        assert fresh.queue_len("q") == 10
        assert [fresh.queue_pop("q")[:4] for _ in range(10)] == [
            f"{item:04d}".encode() for item in range(1190, 1200)
        ]
        assert store.queue_len("q") == 0
        fresh.close()
    finally:
        store.close()


# -- the same sequences on torch's stores -----------------------------------------------------


def _torch_and_ours(kind: str, tmp_path):
    """(torch's store, ours) of one kind, both empty, with a 0.2 s timeout."""
    dist = pytest.importorskip("torch.distributed")
    if kind == "hash":
        pair = dist.HashStore(), HashStore()
    elif kind == "tcp":
        pair = (
            dist.TCPStore(HOST, 0, 1, True, timedelta(seconds=WAIT)),
            TCPStore(HOST, 0, is_master=True, timeout=WAIT),
        )
    else:  # prefix over hash
        pair = dist.PrefixStore("ns", dist.HashStore()), PrefixStore("ns", HashStore())
    for each in pair:
        each.set_timeout(timedelta(seconds=0.2))
    return pair


def _outcome(call):
    try:
        value = call()
    except Exception as exc:  # the class name of torch's and ours
        return type(exc).__name__
    return sorted(value) if isinstance(value, list) else value


@pytest.mark.parametrize("kind", ["hash", "tcp", "prefix"])
def test_list_keys_as_torch(kind, tmp_path):
    theirs, ours = _torch_and_ours(kind, tmp_path)
    answers = []
    for store in (theirs, ours):
        steps = [store.list_keys()]
        store.set("a", "1")
        store.add("b", 2)
        store.append("c", "x")
        store.queue_push("q", "1")
        store.compare_set("d", "", "y")
        steps.append(sorted(store.list_keys()))
        store.delete_key("a")
        steps.append(sorted(store.list_keys()))
        answers.append(steps)
    assert answers[0] == answers[1]


@pytest.mark.parametrize("kind", ["hash", "tcp", "prefix"])
def test_queues_as_torch(kind, tmp_path):
    theirs, ours = _torch_and_ours(kind, tmp_path)
    answers = []
    for store in (theirs, ours):
        steps = [store.queue_len("q"), store.check(["q"])]
        store.queue_push("q", "x")
        store.queue_push("q", b"y")
        store.set("q", "value")
        store.queue_push("z", "other")
        steps += [
            store.queue_len("q"),
            store.check(["q"]),
            store.get("q"),
            store.delete_key("q"),
            store.queue_len("q"),
            store.check(["q"]),
        ]
        steps += [store.queue_pop("q"), store.queue_pop("q", False)]
        steps += [
            _outcome(lambda s=store: s.queue_pop("q", False)),
            _outcome(lambda s=store: s.queue_pop("never", False)),
            store.queue_len("q"),
            store.check(["q"]),
            store.queue_len("z"),
            store.wait(["z"], timedelta(seconds=WAIT)),
        ]
        answers.append(steps)
    assert answers[0] == answers[1]
    assert answers[1][10] == "QueueEmptyError"


@pytest.mark.parametrize("kind", ["hash", "prefix"])
def test_barrier_as_torch(kind, tmp_path):
    theirs, ours = _torch_and_ours(kind, tmp_path)
    answers = []
    for store in (theirs, ours):
        store.barrier("b", 1)
        store.barrier("b", 1)
        steps = [sorted(store.list_keys()), store.get("b/num_members")]
        store.barrier("b", 2, timedelta(seconds=0.2))  # finished already: returns
        store.add("two/num_members", 1)  # another caller arrived
        store.barrier("two", 2, timedelta(seconds=WAIT))
        steps += [
            sorted(store.list_keys()),
            _outcome(lambda s=store: s.barrier("three", 2, timedelta(seconds=0.2))),
        ]
        answers.append(steps)
    assert answers[0][:3] == answers[1][:3]
    assert answers[1][3] == "DistStoreTimeoutError"  # torch: DistStoreError (its base)


@pytest.mark.parametrize("kind", ["hash", "tcp", "prefix"])
def test_has_extended_api_as_torch(kind, tmp_path):
    theirs, ours = _torch_and_ours(kind, tmp_path)
    assert theirs.has_extended_api() == ours.has_extended_api() is True


def test_queue_empty_error_is_a_store_error_as_torch():
    dist = pytest.importorskip("torch.distributed")
    assert issubclass(dist.QueueEmptyError, dist.DistStoreError)
    assert issubclass(QueueEmptyError, DistStoreError)
