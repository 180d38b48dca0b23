"""What torch's own store tests (test/distributed/test_store.py) found: one test per cause.

The torchrun-style master under distcomm-run, torch's words in our errors, custom Python
stores, PrefixStore's extended API, `libuvBackend`, `num_keys`, and the env:// master
address checks.
"""

from __future__ import annotations

import socket
import time
import warnings
from datetime import timedelta

import pytest

import distcomm as dist
from distcomm.bootstrap.schemes import loopback_warning
from distcomm.errors import DistNetworkError, DistStoreError, DistStoreTimeoutError
from distcomm.store import FileStore, HashStore, PrefixStore, Store, TCPStore
from tests.launchjobs import records, run_launcher, script
from tests.processes import free_port

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"


@pytest.fixture
def master():
    store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=10)
    try:
        yield store
    finally:
        store.close()


# -- 1. a torchrun-style master under distcomm-run ----------------------------------------------

#: what torch's examples do under torchrun: rank 0 opens the store as master
AGENT_MASTER_WORKER = """
    import json, os, sys
    from datetime import timedelta
    import distcomm as dist

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size,
                          is_master=(rank == 0), timeout=timedelta(seconds=60))
    store.set(f"from/{rank}", str(rank))
    seen = [store.get(f"from/{peer}").decode() for peer in range(size)]
    store.add("done", 1)
    with open(os.path.join(sys.argv[1], f"{rank}.json"), "w") as f:
        json.dump({"rank": rank, "seen": seen, "port": store.port,
                   "agent": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}, f)
"""


def test_torchrun_style_master_uses_the_agents_store(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    worker = script(tmp_path / "worker.py", AGENT_MASTER_WORKER)
    res = run_launcher(["--standalone", "--nproc_per_node=2", str(worker), str(out)], tmp_path)
    assert res.returncode == 0, res.stderr
    recs = records(out)
    assert [r["rank"] for r in recs] == [0, 1]
    assert all(r["seen"] == ["0", "1"] for r in recs)
    assert all(r["agent"] == "True" for r in recs)
    assert "Address already in use" not in res.stderr


def test_master_on_the_agent_port_becomes_a_client(master, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_PORT", str(master.port))
    second = TCPStore(HOST, master.port, 2, is_master=True, timeout=5)  # waits for no one
    try:
        assert second.port == master.port
        assert "client" in repr(second)
        second.set("k", "v")
        assert master.get("k") == b"v"
    finally:
        second.close()
    assert master.get("k") == b"v"  # closing the client left the agent's server running


def test_agent_store_needs_the_variable_and_the_port(master, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    monkeypatch.setenv("MASTER_PORT", str(master.port))
    with pytest.raises(DistNetworkError, match="Address already in use"):
        TCPStore(HOST, master.port, is_master=True, timeout=5)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "1")
    monkeypatch.setenv("MASTER_PORT", str(master.port + 1))  # another port: not the agent's
    with pytest.raises(DistNetworkError, match="Address already in use"):
        TCPStore(HOST, master.port, is_master=True, timeout=5)
    monkeypatch.setenv("MASTER_PORT", str(master.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "maybe")
    with pytest.raises(ValueError, match="TORCHELASTIC_USE_AGENT_STORE='maybe' is not a boolean"):
        TCPStore(HOST, master.port, is_master=True, timeout=5)


# -- 11. torch's words in our messages --------------------------------------------------------


def test_bind_failure_opens_with_torchs_words(master):
    port = master.port
    with pytest.raises(
        DistNetworkError,
        match=rf"^The server socket has failed to listen on any local .*{port}.*"
        r"Address already in use",
    ):
        TCPStore("localhost", port, 1, True, timeout=5)


def test_missing_clients_timeout_has_torchs_words():
    with pytest.raises(
        DistStoreError,
        match=r"Timed out after \d+ seconds waiting for clients. \d+/\d+ clients joined.*"
        r"only 1 of 2 store clients connected",
    ):
        TCPStore("localhost", 0, 2, True, timeout=timedelta(seconds=1))
    TCPStore("localhost", 0, 2, True, timeout=1, wait_for_workers=False).close()


def test_world_size_0_has_torchs_words():
    with pytest.raises(ValueError, match=r"TCPStore world size cannot be 0.*got 0"):
        TCPStore("localhost", 0, world_size=0, is_master=False)
    with pytest.raises(ValueError, match="world_size must be None"):
        TCPStore("localhost", 0, world_size=-1, is_master=True)


def test_store_timeouts_have_torchs_words(master, tmp_path):
    master.set_timeout(timedelta(seconds=0.1))
    with pytest.raises(DistStoreError, match="wait timeout after 100ms, keys: /nonexistent key"):
        master.get("nonexistent key")
    with pytest.raises(
        DistStoreTimeoutError,
        match=r"wait timeout after 250ms, keys: /a, /b - keys \['a', 'b'\] "
        r"were not set within 0\.2 s",
    ):
        master.wait(["a", "b"], timedelta(seconds=0.25))
    with pytest.raises(DistStoreError, match=r"timeout.*queue 'q' stayed empty"):
        master.queue_pop("q")
    master.set("nonexistent key", "x")  # the connection still serves
    assert master.get("nonexistent key") == b"x"
    for store in (HashStore(), FileStore(str(tmp_path / "f"), 1), PrefixStore("p", HashStore())):
        with pytest.raises(RuntimeError, match=r"[t -i]imeout") as caught:
            store.wait(["bad_key"], timedelta(seconds=0.25))
        assert "timeout" in str(caught.value) and "bad_key' was not set" in str(caught.value)


# -- 2. an unresolvable host: the same error on every rank -------------------------------------


@pytest.mark.parametrize("is_master", [True, False])
def test_unresolvable_host_fails_as_torchs_naming_it(is_master):
    started = time.monotonic()
    with pytest.raises(
        DistNetworkError,
        match=r"client socket has timed out after 1000ms.*dnsnotexist\.invalid"
        r".*did not resolve",
    ):
        TCPStore(
            "dnsnotexist.invalid",
            0 if is_master else 23456,
            2,
            is_master,
            timeout=timedelta(seconds=1),
        )
    assert time.monotonic() - started >= 0.9  # retried until the timeout, as torch does


def test_unresolvable_master_addr_fails_alike_on_every_rank():
    env = {"MASTER_ADDR": "dnsnotexist.invalid", "MASTER_PORT": "23456"}
    for rank in (0, 1):
        with pytest.raises(
            DistNetworkError,
            match=r"client socket has timed out after 1000ms.*"
            r"'dnsnotexist\.invalid' did not resolve",
        ):
            dist.rendezvous("env://", rank=rank, world_size=2, timeout=1, environ=env)


# -- 2. a master address that other hosts cannot reach ------------------------------------------


def _loopback_alias() -> str:
    """A name of this host that resolves to a loopback address, or skip."""
    name = socket.gethostname()
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(name, None)}
    except socket.gaierror:
        pytest.skip("this host's name does not resolve")
    if not addresses or not all(a.startswith("127.") or a == "::1" for a in addresses):
        return "localhost"
    return name


def test_loopback_master_addr_of_a_multi_host_job_warns_at_once():
    host = _loopback_alias()
    message = loopback_warning(host, 8, 4, "MASTER_ADDR")
    assert message is not None
    assert host in message and "127." in message and "Set MASTER_ADDR" in message
    assert "world size 8 > LOCAL_WORLD_SIZE 4" in message
    assert loopback_warning(host, 4, 4, "MASTER_ADDR") is None  # one host
    assert loopback_warning(host, 8, None, "MASTER_ADDR") is None  # unknown
    assert loopback_warning("192.0.2.1", 8, 4, "MASTER_ADDR") is None  # not loopback
    assert "Set the tcp:// URL's host" in loopback_warning("localhost", 2, 1, "tcp:// URL")


def test_loopback_master_addr_warning_in_env_rendezvous():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "LOCAL_WORLD_SIZE": "1"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(dist.DistError):  # rank 1 never comes; the warning came first
            dist.rendezvous("env://", rank=0, world_size=2, timeout=1, environ=env)
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("127.0.0.1" in t and "loopback" in t and "LOCAL_WORLD_SIZE" in t for t in texts), (
        texts
    )


# -- 5. custom Python stores -----------------------------------------------------------------


class _PythonStore(Store):
    """torch's test store: set, get, add and compare_set, nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        if type(value) is not bytes:
            raise AssertionError("set must be called with bytes")
        self.data[key] = value

    def get(self, key):
        return self.data.get(key, b"")

    def add(self, key, value):
        new = int(self.data.get(key, 0)) + value
        self.set(key, str(new).encode())
        return new

    def compare_set(self, key, expected, new):
        if type(expected) is not bytes or type(new) is not bytes:
            raise AssertionError("compare_set must be called with bytes")
        value = self.data.get(key)
        if value is None or value == expected:
            value = self.data[key] = new
        return value


class _Recording(Store):
    """A store with the extended API that records what it is handed."""

    def __init__(self) -> None:
        self.appends: list = []
        self.multi_sets: list = []
        self.multi_gets: list = []
        super().__init__()

    def append(self, key, value):
        self.appends.append((key, value))

    def multi_get(self, keys):
        self.multi_gets.append(keys)
        return [b"x"] * len(keys)

    def multi_set(self, keys, values):
        self.multi_sets.append((keys, values))

    def has_extended_api(self):
        return True


def test_a_partial_store_subclass_can_be_made_and_says_what_is_missing():
    class Empty(Store):
        pass

    store = Empty()
    assert store.has_extended_api() is False
    assert store.timeout == timedelta(seconds=300)
    calls = {
        "set": lambda: store.set("k", "v"),
        "get": lambda: store.get("k"),
        "add": lambda: store.add("k", 1),
        "compare_set": lambda: store.compare_set("k", "", "v"),
        "wait": lambda: store.wait(["k"]),
        "check": lambda: store.check(["k"]),
        "delete_key": lambda: store.delete_key("k"),
        "num_keys": store.num_keys,
        # built on compare_set, get and set, as torch's are
        "compare_set()": lambda: store.append("k", "v"),
        "get()": lambda: store.multi_get(["k"]),
        "set()": lambda: store.multi_set(["k"], ["v"]),
    }
    for name, call in calls.items():
        with pytest.raises(NotImplementedError, match=f"Empty does not implement {name}"):
            call()
        with pytest.raises(RuntimeError, match=r"Not implemented\."):  # torch's words
            call()
    with pytest.raises(NotImplementedError):
        store.list_keys()


def test_append_over_compare_set_appends_even_the_same_text():
    store = _PythonStore()
    store.append("k", "po")
    store.append("k", b"tato")
    assert store.data["k"] == b"potato"

    class WithCheck(_PythonStore):
        def check(self, keys):
            return all(key in self.data for key in keys)

    checked = WithCheck()
    checked.append("k", "x")
    checked.append("k", "x")  # torch's fallback stops here, the key already holding "x"
    assert checked.data["k"] == b"xx"


def test_prefix_store_passes_the_extended_api_through_with_bytes():
    inner = _Recording()
    prefix = PrefixStore("p", inner)
    assert prefix.has_extended_api() is True
    prefix.append("foo", "bar")
    assert inner.appends == [("p/foo", b"bar")]
    assert prefix.multi_get(["foo", "bar"]) == [b"x", b"x"]
    assert inner.multi_gets == [["p/foo", "p/bar"]]
    prefix.multi_set(["foo", "bar"], ["x", b"y"])
    assert inner.multi_sets == [(["p/foo", "p/bar"], [b"x", b"y"])]


def test_prefix_store_emulates_the_extended_api_over_a_plain_store():
    inner = _PythonStore()
    prefix = PrefixStore("p", inner)
    assert prefix.has_extended_api() is False
    prefix.append("foo", b"po")
    prefix.append("foo", "tato")
    assert prefix.get("foo") == b"potato"
    prefix.set("s", "str")  # handed as bytes (the store asserts it)
    prefix.multi_set(["a", "b"], [b"c", "d"])
    assert prefix.multi_get(["a", "b", "foo"]) == [b"c", b"d", b"potato"]
    assert set(inner.data) == {"p/foo", "p/s", "p/a", "p/b"}

    class Empty(Store):
        pass

    bare = PrefixStore("p", Empty())
    assert bare.has_extended_api() is False
    for call in (
        lambda: bare.append("foo", "bar"),
        lambda: bare.multi_get(["foo"]),
        lambda: bare.multi_set(["foo"], [b"v"]),
    ):
        with pytest.raises(RuntimeError, match=r"Not implemented\."):
            call()


def test_prefix_store_of_none_is_a_value_error():
    with pytest.raises(ValueError, match="cannot be None"):
        PrefixStore("prefix", None)
    with pytest.raises(TypeError, match="needs a distcomm Store"):
        PrefixStore("prefix", {})


def test_prefix_store_underlying_non_prefix_store():
    base = HashStore()
    store = PrefixStore("a", base)
    assert store._underlying_non_prefix_store is base
    assert PrefixStore("b", PrefixStore("a", store))._underlying_non_prefix_store is base


# -- 7. libuvBackend ---------------------------------------------------------------------------


@pytest.mark.parametrize("use_libuv", [True, False])
def test_libuv_backend_reports_what_was_asked(use_libuv):
    store = TCPStore("localhost", 0, 1, True, use_libuv=use_libuv, timeout=10)
    try:
        assert store.libuvBackend is use_libuv
        clone = store.clone()
        try:
            assert clone.libuvBackend is use_libuv
        finally:
            clone.close()
        store.queue_push("q", "1")  # one server either way: queues work
        assert store.queue_pop("q") == b"1"
    finally:
        store.close()
    default = TCPStore("localhost", 0, 1, True, timeout=10)
    try:
        assert default.libuvBackend is True
    finally:
        default.close()


# -- 10. num_keys ------------------------------------------------------------------------------


def test_tcp_num_keys_counts_the_keys_set():
    """torch's counts an internal client-count key too (one more); documented."""
    store = TCPStore("localhost", 0, 1, True, timeout=10)
    try:
        assert store.num_keys() == 0
        for key in ("key", "key0", "key1"):
            store.set(key, "v")
        store.add("key3", 1)
        assert store.num_keys() == 4 == len(store.list_keys())
        store.delete_key("key")
        assert store.num_keys() == 3
    finally:
        store.close()
