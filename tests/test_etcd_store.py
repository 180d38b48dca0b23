"""Tests of EtcdStore against a real etcd on 127.0.0.1 (started by tests/etcd_server.py).

The Store contract every store shares runs on EtcdStore in tests/test_store.py (its
`etcd` kind); this module covers what is etcd's own: watches, transactions, revisions,
endpoints and a server that fails. One etcd serves the module; every test gets stores
under its own key prefix. Tests that kill a server start their own.
"""

from __future__ import annotations

import base64
import http.client
import http.server
import json
import os
import re
import socket
import threading
import time
import uuid

import pytest

from distcomm.errors import (
    DistError,
    DistNetworkError,
    DistStoreError,
    DistStoreTimeoutError,
)
from distcomm.store import EtcdStore, Store
from distcomm.store.etcd.client import parse_endpoint
from tests import etcd_server
from tests.etcd_server import EtcdServer, etcd_endpoint  # noqa: F401
from tests.harness import run_ranks
from tests.processes import free_port

HOST = "127.0.0.1"


# -- helpers and fixtures -------------------------------------------------------------------


def _unique_prefix(tag: str = "t") -> str:
    return f"/distcomm-test/{tag}-{uuid.uuid4().hex[:12]}/"


@pytest.fixture
def prefix() -> str:
    return _unique_prefix()


@pytest.fixture
def store(etcd_endpoint, prefix):  # noqa: F811 - the fixture imported above
    with EtcdStore(etcd_endpoint, prefix, timeout=10) as each:
        yield each


@pytest.fixture
def store_pair(etcd_endpoint, prefix):  # noqa: F811
    """Two EtcdStore objects on the same prefix: (writer, reader)."""
    with (
        EtcdStore(etcd_endpoint, prefix, timeout=10) as writer,
        EtcdStore(etcd_endpoint, prefix, timeout=10) as reader,
    ):
        yield writer, reader


@pytest.fixture
def own_server():
    """An etcd for this test alone (for tests that kill it)."""
    with EtcdServer(etcd_server.etcd_binary()) as server:
        yield server


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


def _etcd_post(endpoint: str, path: str, body: dict) -> dict:
    """One raw request to etcd's JSON API (to look at what the store wrote)."""
    host, port = endpoint.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("POST", f"/v3/{path}", json.dumps(body))
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# -- the Store methods ----------------------------------------------------------------------


def test_is_a_store_with_its_endpoint_and_prefix(store, etcd_endpoint, prefix):  # noqa: F811
    assert isinstance(store, Store)
    assert store.endpoint == etcd_endpoint
    assert store.prefix == prefix
    assert repr(store) == f"EtcdStore({etcd_endpoint!r}, prefix={prefix!r})"


def test_keys_live_under_the_prefix(store, etcd_endpoint, prefix):  # noqa: F811
    store.set("k", "v")
    answer = _etcd_post(etcd_endpoint, "kv/range", {"key": _b64(prefix.encode() + b"k")})
    assert base64.b64decode(answer["kvs"][0]["value"]) == b"v"


def test_get_waits_for_a_set_from_another_thread(store_pair):
    writer, reader = store_pair
    thread, box = _in_thread(reader.get, "late")
    time.sleep(0.2)
    writer.set("late", "value")
    thread.join(10)
    assert box == {"value": b"value"}


def _wait_then_set(endpoint: str, prefix: str) -> bytes | None:
    rank = int(os.environ["RANK"])
    with EtcdStore(endpoint, prefix, timeout=30) as store:
        if rank == 0:
            store.wait(["from1"])
            return store.get("from1")
        time.sleep(0.3)
        store.set("from1", "rank 1 was here")
        return None


@pytest.mark.timeout(90)
def test_wait_and_get_are_satisfied_by_another_process(etcd_endpoint, prefix):  # noqa: F811
    results = run_ranks(_wait_then_set, 2, etcd_endpoint, prefix, timeout=60)
    assert results == [b"rank 1 was here", None]


def test_waiting_watches_instead_of_polling(store, monkeypatch):
    calls: list[str] = []
    post = store._post

    def counting(path, body, what):
        calls.append(path)
        return post(path, body, what)

    monkeypatch.setattr(store, "_post", counting)
    with pytest.raises(DistStoreTimeoutError):
        store.wait(["never"], 1.0)
    # one read before the watch and one after it ends, however long the wait
    assert calls == ["kv/txn", "kv/txn"]


def test_wait_needs_every_key_at_once(store_pair):
    writer, reader = store_pair
    writer.set("a", "1")
    thread, box = _in_thread(reader.multi_get, ["a", "b"])
    time.sleep(0.1)
    writer.delete_key("a")
    writer.set("b", "2")
    time.sleep(0.2)
    assert thread.is_alive()  # 'a' is gone again: still waiting
    writer.set("a", "3")
    thread.join(10)
    assert box == {"value": [b"3", b"2"]}


def test_prefixes_keep_stores_apart(etcd_endpoint):  # noqa: F811
    base = _unique_prefix("iso")
    with (
        EtcdStore(etcd_endpoint, base + "one/", timeout=0.3) as one,
        EtcdStore(etcd_endpoint, base + "two/", timeout=0.3) as two,
        EtcdStore(etcd_endpoint, base, timeout=0.3) as parent,
    ):
        one.set("k", "1")
        two.set("k", "2")
        two.set("only-two", "x")
        assert one.get("k") == b"1"
        assert two.get("k") == b"2"
        assert (one.num_keys(), two.num_keys()) == (1, 2)
        assert parent.num_keys() == 3  # every key under its prefix, as PrefixStore counts
        assert not one.check(["only-two"])
        with pytest.raises(DistStoreTimeoutError):
            one.get("only-two")
        assert one.delete_key("only-two") is False
        assert one.add("k", 1) == 2
        assert two.get("k") == b"2"


def test_multi_set_is_one_revision(store, etcd_endpoint, prefix):  # noqa: F811
    store.multi_set(["x", "y", "z"], ["1", "2", "3"])
    answer = _etcd_post(
        etcd_endpoint,
        "kv/range",
        {
            "key": _b64(prefix.encode()),
            "range_end": _b64(prefix.encode()[:-1] + b"0"),
        },
    )
    assert len({kv["mod_revision"] for kv in answer["kvs"]}) == 1


def test_more_keys_than_one_txn_takes(store_pair):
    writer, reader = store_pair
    names = [f"k{index:03d}" for index in range(300)]
    thread, box = _in_thread(reader.multi_get, names)
    writer.multi_set(names, [name.upper() for name in names])
    thread.join(20)
    assert box == {"value": [name.upper().encode() for name in names]}
    assert reader.check(names)
    reader.wait(names, 5)
    assert reader.num_keys() == 300
    writer.delete_key("k150")
    assert not reader.check(names)


def test_values_over_etcds_request_limit_are_refused(store):
    with pytest.raises(DistStoreError, match=r"refused set\('big'\).*--max-request-bytes"):
        store.set("big", b"x" * (3 << 20))
    store.set("fits", b"y" * (1 << 20))
    assert store.get("fits") == b"y" * (1 << 20)


def test_a_compacted_start_revision_is_read_again(store, etcd_endpoint):  # noqa: F811
    for step in range(5):
        store.set("churn", str(step))
    revision = int(_etcd_post(etcd_endpoint, "kv/range", {"key": _b64(b"x")})["header"]["revision"])
    _etcd_post(etcd_endpoint, "kv/compaction", {"revision": revision, "physical": True})
    snapshot = store._snapshot
    stale = [True]

    def first_one_stale(names, values, what):
        found, current = snapshot(names, values, what)
        if stale and not found:
            stale.clear()
            return found, 1  # the watch starts at revision 2, compacted away
        return found, current

    store._snapshot = first_one_stale
    thread, box = _in_thread(store.get, "after-compaction")
    time.sleep(0.2)
    store.set("after-compaction", "seen")
    thread.join(10)
    assert box == {"value": b"seen"}
    assert not stale


# -- across processes ---------------------------------------------------------------------------


def _hammer(endpoint: str, prefix: str, rounds: int) -> list[str]:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with EtcdStore(endpoint, prefix, timeout=30) as store:
        for _ in range(rounds):
            store.add("counter", 1)
            store.append("log", f"{rank},")
        store.set(f"done{rank}", str(rounds))
        return [value.decode() for value in store.multi_get([f"done{p}" for p in range(size)])]


@pytest.mark.timeout(120)
def test_add_and_append_from_many_processes_are_atomic(store, etcd_endpoint, prefix):  # noqa: F811
    size, rounds = 4, 50
    results = run_ranks(_hammer, size, etcd_endpoint, prefix, rounds, timeout=90)
    assert results == [[str(rounds)] * size] * size
    assert store.get("counter") == str(size * rounds).encode()
    entries = store.get("log").decode().rstrip(",").split(",")
    assert sorted(entries) == sorted(str(rank) for rank in range(size) for _ in range(rounds))


def _claim(endpoint: str, prefix: str, keys: int) -> list[bytes]:
    rank = os.environ["RANK"]
    with EtcdStore(endpoint, prefix, timeout=30) as store:
        return [store.compare_set(f"leader{k}", "", f"rank{rank}") for k in range(keys)]


@pytest.mark.timeout(120)
def test_compare_set_race_has_one_winner(store, etcd_endpoint, prefix):  # noqa: F811
    size, keys = 4, 20
    results = run_ranks(_claim, size, etcd_endpoint, prefix, keys, timeout=90)
    for k in range(keys):
        winners = [rank for rank in range(size) if results[rank][k] == f"rank{rank}".encode()]
        assert len(winners) == 1
        assert {results[rank][k] for rank in range(size)} == {f"rank{winners[0]}".encode()}
        assert store.get(f"leader{k}") == f"rank{winners[0]}".encode()


# -- endpoints, failures, teardown ---------------------------------------------------------------


def test_endpoint_forms():
    assert parse_endpoint("127.0.0.1:2380") == ("127.0.0.1", 2380)
    assert parse_endpoint("http://localhost:1234/") == ("localhost", 1234)
    assert parse_endpoint("HTTP://10.0.0.1:5") == ("10.0.0.1", 5)
    assert parse_endpoint("[::1]:2379") == ("::1", 2379)
    assert parse_endpoint("http://[fe80::1]:7") == ("fe80::1", 7)
    assert parse_endpoint("etcd-host") == ("etcd-host", 2379)
    assert parse_endpoint("[::1]") == ("::1", 2379)


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("https://127.0.0.1:2379", "TLS is not supported"),
        ("unix://socket", "scheme 'unix'"),
        ("", "not an address"),
        ("127.0.0.1:0", "port '0'"),
        ("127.0.0.1:70000", "port '70000'"),
        ("127.0.0.1:http", "port 'http'"),
        ("::1:2379", "needs brackets"),
        ("[::1:2379", "not an address"),
        ("http://127.0.0.1:2379/v3", "not an address"),
        ("a:1,b:2", "one endpoint"),
        (":2379", "names no host"),
    ],
)
def test_bad_endpoints_are_value_errors(endpoint, message):
    with pytest.raises(ValueError, match=message):
        EtcdStore(endpoint)


def test_bad_arguments(etcd_endpoint):  # noqa: F811
    with pytest.raises(TypeError, match="endpoint must be a str"):
        EtcdStore(2379)
    with pytest.raises(ValueError, match="prefix must be non-empty"):
        EtcdStore(etcd_endpoint, "")
    with pytest.raises(TypeError, match="prefix must be a str"):
        EtcdStore(etcd_endpoint, b"/x/")
    with pytest.raises(TypeError, match="timedelta"):
        EtcdStore(etcd_endpoint, timeout="soon")


def test_nothing_listening_is_a_network_error():
    port = free_port(HOST)
    with pytest.raises(DistNetworkError, match=rf"etcd at 127\.0\.0\.1:{port}.*is etcd running"):
        EtcdStore(f"127.0.0.1:{port}", timeout=5)
    with pytest.raises(ConnectionError):
        EtcdStore(f"http://127.0.0.1:{port}", timeout=5)


class _NotEtcd(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/v3/kv/range":
            body = b"<html>hello</html>"
            self.send_response(200)
        else:
            body = b"Not Found"
            self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def not_etcd():
    server = http.server.ThreadingHTTPServer((HOST, 0), _NotEtcd)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"{HOST}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_another_http_server_is_a_store_error(not_etcd, monkeypatch):
    with pytest.raises(DistStoreError, match="not etcd's JSON"):
        EtcdStore(not_etcd, timeout=5)
    monkeypatch.setattr(EtcdStore, "_count", lambda self, what: 0)  # let the constructor pass
    with (
        EtcdStore(not_etcd, timeout=5) as store,
        pytest.raises(DistStoreError, match=r"refused set.*etcd >= 3\.4.*HTTP 404"),
    ):
        store.set("k", "v")


class _DropsIdleConnections(http.server.BaseHTTPRequestHandler):
    """Answers like etcd, then closes the connection without saying so (HTTP/1.1)."""

    protocol_version = "HTTP/1.1"
    connections: list[int] = []

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.connections.append(self.client_address[1])
        body = b'{"header": {"revision": "1"}}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, *args):
        pass


def test_a_dropped_idle_connection_is_replaced():
    server = http.server.ThreadingHTTPServer((HOST, 0), _DropsIdleConnections)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with EtcdStore(f"{HOST}:{server.server_address[1]}", timeout=5) as store:
            for _ in range(3):
                time.sleep(0.05)  # let the server's close arrive
                store.set("k", "v")
        assert len(set(_DropsIdleConnections.connections)) == 4  # the probe, then 3 sets
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_missing_etcd_skips_or_fails_when_required(monkeypatch):
    monkeypatch.setattr(etcd_server, "find_etcd", lambda: None)
    monkeypatch.delenv("DISTCOMM_TEST_REQUIRE_ETCD", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install etcd-server"):
        etcd_server.etcd_binary()
    monkeypatch.setenv("DISTCOMM_TEST_REQUIRE_ETCD", "1")
    with pytest.raises(pytest.fail.Exception, match="DISTCOMM_TEST_REQUIRE_ETCD=1 requires"):
        etcd_server.etcd_binary()


def test_a_server_that_never_answers_times_out():
    with socket.create_server((HOST, 0)) as silent:  # accepts (backlog), never answers
        port = silent.getsockname()[1]
        with pytest.raises(DistStoreTimeoutError, match=rf"127\.0\.0\.1:{port} did not answer"):
            EtcdStore(f"{HOST}:{port}", timeout=0.2)


@pytest.mark.timeout(60)
def test_server_killed_mid_use_is_a_network_error(own_server):
    store = EtcdStore(own_server.endpoint, timeout=30)
    try:
        store.set("before", "1")
        assert store.add("n", 1) == 1
        thread, box = _in_thread(store.get, "never-set")  # waiting on a watch
        time.sleep(0.3)
        own_server.kill()
        thread.join(20)
        assert not thread.is_alive()
        assert isinstance(box.get("error"), DistNetworkError), box
        assert own_server.endpoint in str(box["error"])
        for call in (
            lambda: store.set("after", "death"),
            lambda: store.get("before"),
            lambda: store.add("n", 1),
            store.num_keys,
            lambda: store.wait(["x"], 5),
        ):
            with pytest.raises(DistNetworkError, match="is etcd running"):
                call()
    finally:
        store.close()


def test_a_long_wait_says_so_then_times_out(
    etcd_endpoint,  # noqa: F811 (the fixture imported above)
    prefix,
    monkeypatch,
    caplog,
):
    """As TCPStore's and FileStore's: a get, wait or queue_pop still waiting after
    DISTCOMM_STALL_WARN_S names the keys it misses, with backoff, then times out."""
    monkeypatch.setenv("DISTCOMM_STALL_WARN_S", "0.3")
    caplog.set_level("WARNING", logger="distcomm.store")
    with EtcdStore(etcd_endpoint, prefix, timeout=1.5) as store:
        store.set("here", "1")
        with pytest.raises(DistStoreTimeoutError, match="'late'"):
            store.wait(["here", "late"])
        ages = [
            float(a)
            for a in re.findall(
                r"wait\(\['here', 'late'\]\) on the EtcdStore .* has waited ([\d.]+) s for "
                r"'late', not set yet",
                caplog.text,
            )
        ]
        assert len(ages) in (2, 3) and ages == sorted(ages) and ages[0] >= 0.3, caplog.text
        caplog.clear()
        with pytest.raises(DistStoreTimeoutError, match="stayed empty"):
            store.queue_pop("jobs")
        assert "queue_pop('jobs') on the EtcdStore" in caplog.text, caplog.text
        assert "has waited" in caplog.text, caplog.text
        caplog.clear()
        writer = threading.Timer(0.5, store.clone().set, ("soon", "1"))
        writer.start()
        assert store.get("soon") == b"1"  # set after 0.5 s: one warning, then the value
        writer.join()
        assert len(caplog.records) == 1 and "'soon', not set yet" in caplog.text, caplog.text


def test_close_ends_waits_and_later_calls(store_pair):
    _, store = store_pair
    thread, box = _in_thread(store.wait, ["never"], 30)
    time.sleep(0.3)
    store.close()
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(box.get("error"), DistStoreError), box
    assert not isinstance(box["error"], DistNetworkError)
    store.close()  # idempotent
    with pytest.raises(DistStoreError, match="is closed; set"):
        store.set("k", "v")
    with pytest.raises(DistError, match="is closed"):
        store.get("k")


def test_an_unused_store_closes_without_error(etcd_endpoint):  # noqa: F811
    store = EtcdStore(etcd_endpoint, _unique_prefix())
    store.close()
    del store
