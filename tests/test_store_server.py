"""The TCPStore server against clients that misbehave: one test per way a client once broke it.

Every socket is on 127.0.0.1. The server runs in the test process (a master TCPStore),
except where a test needs its own process limits or memory.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import socket
import threading
import time
import warnings
from datetime import timedelta

import pytest

from distcomm import auth
from distcomm.errors import DistNetworkError, DistStoreError, DistStoreTimeoutError
from distcomm.store import TCPStore
from distcomm.store.tcp.bookkeeping import Throttle as _Throttle
from distcomm.store.tcp.protocol import HEADER, LENGTH, SECONDS, Cmd, Limits, Status
from distcomm.store.tcp.server import StoreServer
from tests.harness import wait_until
from tests.store_wire import frame, raw_connection, read_response, recv_exact

HOST = "127.0.0.1"


@pytest.fixture(autouse=True)
def _no_auth_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISTCOMM_AUTH_KEY", raising=False)
    monkeypatch.delenv("DISTCOMM_STORE_MAX_KEY_BYTES", raising=False)
    monkeypatch.delenv("DISTCOMM_STORE_MAX_VALUE_BYTES", raising=False)


@pytest.fixture
def master():
    store = TCPStore(HOST, 0, is_master=True, timeout=10)
    yield store
    store.close()


def _raw(port: int, timeout: float = 10.0) -> socket.socket:
    return raw_connection(HOST, port, timeout)


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def _server(store: TCPStore) -> StoreServer:
    return store._server


# -- 1. timeouts of any size never stop the server ----------------------------------------------


@pytest.mark.parametrize(
    "timeout", [timedelta(days=30), 1e300, math.inf], ids=["30-days", "1e300", "inf"]
)
def test_long_waits_are_served(master, timeout):
    client = TCPStore(HOST, master.port, timeout=timeout)
    try:
        master.set("now", "1")
        client.wait(["now"], timeout)
        thread = threading.Thread(target=client.wait, args=(["later"], timeout), daemon=True)
        thread.start()
        time.sleep(0.2)
        master.set("later", "1")
        thread.join(10)
        assert not thread.is_alive()
        assert client.get("later") == b"1"  # a get waits with the store's timeout: `timeout`
    finally:
        client.close()
    master.set("still", "serving")
    assert master.get("still") == b"serving"


def test_a_store_made_with_a_30_day_timeout_works():
    store = TCPStore(HOST, 0, is_master=True, world_size=1, timeout=timedelta(days=30))
    try:
        store.set("k", "v")
        assert store.get("k") == b"v"
        assert store.timeout == timedelta(days=30)
    finally:
        store.close()


def test_timeout_values_no_request_may_carry_are_refused_and_huge_ones_parked(master):
    with _raw(master.port) as sock:
        for bad in (math.nan, -1.0):
            sock.sendall(frame(Cmd.WAIT, [SECONDS.pack(bad), b"k"]))
            status, args = read_response(sock)
            assert status == Status.ERROR and b"timeout must be >= 0" in args[0]
        sock.sendall(frame(Cmd.WAIT, [SECONDS.pack(0.0), b"k"]))  # 0: answered at once
        assert read_response(sock) == (Status.TIMEOUT, [b"k"])
    parked = []
    for seconds in (math.inf, 1e300, 3e6, 2.2e6):  # 2.2e6 s is beyond epoll's ~24.8 days
        sock = _raw(master.port)
        sock.sendall(frame(Cmd.WAIT, [SECONDS.pack(seconds), b"k"]))
        parked.append(sock)
    time.sleep(0.2)
    parked.pop().close()  # a parked request whose client leaves is forgotten
    master.set("k", "1")
    for sock in parked:
        assert read_response(sock) == (Status.OK, [])
        sock.close()
    assert master.add("alive", 1) == 1


def test_a_fault_while_serving_closes_one_connection_not_the_server(master, monkeypatch, caplog):
    def broken(conn, args):
        raise RuntimeError("a bug in a handler")

    server = _server(master)
    monkeypatch.setitem(server._handlers, Cmd.NUM_KEYS, broken)
    with caplog.at_level(logging.WARNING, "distcomm.store"), _raw(master.port) as sock:
        sock.sendall(frame(Cmd.NUM_KEYS, []))
        assert _closed_by_server(sock)
    assert "internal error" in caplog.text
    master.set("k", "v")
    assert master.get("k") == b"v"


def test_a_fault_in_the_loop_itself_is_survived(master, monkeypatch, caplog):
    server = _server(master)
    real = server._fire_timers
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in the loop")
        real()

    monkeypatch.setattr(server, "_fire_timers", flaky)
    with caplog.at_level(logging.WARNING, "distcomm.store"):
        with pytest.raises(DistStoreTimeoutError):
            master.wait(["never"], timeout=0.2)  # its timer fires through the loop
        master.set("k", "v")
        assert master.get("k") == b"v"
    assert calls and "event loop; serving on" in caplog.text


# -- 2. size limits -----------------------------------------------------------------------------


def test_a_huge_declared_request_is_refused_at_its_header(master):
    with _raw(master.port) as sock:
        sock.sendall(HEADER.pack(0xFFFFFFFF, Cmd.SET))  # 4 GiB announced, nothing follows
        status, args = read_response(sock)
        assert status == Status.ERROR and b"over the limit" in args[0]
        assert _closed_by_server(sock)
    assert not _server(master)._conns or all(
        len(conn.inbuf) < (1 << 20) for conn in _server(master)._conns.values()
    )
    assert master.num_keys() == 0


def test_client_refuses_oversized_keys_and_values_before_sending(master):
    limits = master.limits
    assert limits == Limits()  # torch's: 8 KiB keys, 8 MiB values
    with pytest.raises(ValueError, match=r"value of 8,388,609 bytes .* DISTCOMM_STORE_MAX_VALUE"):
        master.set("big", b"x" * (limits.max_value + 1))
    with pytest.raises(ValueError, match=r"key of 8,193 bytes .* DISTCOMM_STORE_MAX_KEY_BYTES"):
        master.get("k" * (limits.max_key + 1))
    with pytest.raises(ValueError, match="split"):
        master.multi_set([f"k{i}" for i in range(3)], [b"x" * (4 << 20)] * 3)
    master.set("big", b"x" * limits.max_value)  # exactly the limit is fine
    assert len(master.get("big")) == limits.max_value


def test_the_server_refuses_what_a_client_did_not_check(master):
    client = TCPStore(HOST, master.port, timeout=10)
    try:
        client._limits = Limits(max_value=1 << 30)  # a client that believes otherwise
        client.set("big", b"x" * ((8 << 20) + 100))  # quiet: refused afterwards
        with pytest.raises(DistStoreError, match=r"refused an earlier set.*over the limit"):
            client.add("n", 1)
        assert client.add("n", 1) == 2  # the add that reported it ran, and so does the next
        assert not master.check(["big"])
    finally:
        client.close()
    with _raw(master.port) as sock:
        sock.sendall(frame(Cmd.GET, [SECONDS.pack(0), b"k" * 9000]))
        status, args = read_response(sock)
        assert status == Status.ERROR and b"key of 9,000 bytes" in args[0]


def test_limits_are_set_on_the_master_and_learnt_by_clients(monkeypatch):
    monkeypatch.setenv("DISTCOMM_STORE_MAX_VALUE_BYTES", "32M")
    monkeypatch.setenv("DISTCOMM_STORE_MAX_KEY_BYTES", "64")
    store = TCPStore(HOST, 0, is_master=True, timeout=10)
    monkeypatch.delenv("DISTCOMM_STORE_MAX_VALUE_BYTES")
    monkeypatch.delenv("DISTCOMM_STORE_MAX_KEY_BYTES")
    client = TCPStore(HOST, store.port, timeout=10)
    try:
        assert client.limits == Limits(max_key=64, max_value=32 << 20)
        big = os.urandom(1 << 20) * 24
        client.set("big", big)
        assert store.get("big") == big
        with pytest.raises(ValueError, match="key of 65 bytes"):
            client.set("k" * 65, "v")
    finally:
        client.close()
        store.close()


@pytest.mark.parametrize("value", ["lots", "0", "5G", "-1"])
def test_a_bad_limit_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("DISTCOMM_STORE_MAX_VALUE_BYTES", value)
    with pytest.raises(ValueError, match="DISTCOMM_STORE_MAX_VALUE_BYTES"):
        TCPStore(HOST, 0, is_master=True, timeout=5)


# -- 3. backpressure ----------------------------------------------------------------------------


def test_a_client_that_never_reads_is_not_served_beyond_the_watermark(master):
    server = _server(master)
    master.set("v", b"x" * (64 << 10))
    request = frame(Cmd.GET, [SECONDS.pack(0), b"v"])
    sock = _raw(master.port)
    sock.settimeout(0.5)
    sent = 0
    try:
        while sent < 20000:  # 1.3 GiB of answers if all were served; the send blocks first
            sock.sendall(request * 100)
            sent += 100
    except (TimeoutError, BlockingIOError):
        pass
    try:
        # the server reads the flood on its own thread: wait until it holds answers the
        # client does not read
        flooding = wait_until(
            lambda: [conn for conn in list(server._conns.values()) if conn.out_bytes > 0],
            "the server to hold answers the flooding client does not read",
        )
        assert len(flooding) == 1
        conn = flooding[0]
        assert conn.out_bytes <= server.out_high_water + (1 << 20)  # one answer over at most
        assert len(conn.inbuf) <= (1 << 19)  # no more read than one receive's worth
        other = TCPStore(HOST, master.port, timeout=10)
        try:
            other.set("other", "1")
            assert other.get("other") == b"1"  # served while the flood waits
        finally:
            other.close()
    finally:
        sock.close()


def test_a_large_answer_ending_in_an_empty_value_is_sent_whole(master):
    big = os.urandom(100000)
    master.multi_set(["big", "empty"], [big, b""])
    assert master.multi_get(["big", "empty"]) == [big, b""]
    assert master.multi_get(["empty", "big", "empty"]) == [b"", big, b""]
    assert master.add("alive", 1) == 1


def test_pipelined_requests_are_served_in_turns(master):
    server = _server(master)
    with _raw(master.port) as sock:
        count = 5 * server.frames_per_turn + 3
        sock.sendall(frame(Cmd.ADD, [b"n", b"1"]) * count)
        for index in range(count):
            assert read_response(sock) == (Status.OK, [str(index + 1).encode()])
    assert master.get("n") == str(count).encode()


# -- 4. no quadratic work -----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_many_appends_build_the_right_value(master):
    chunk = os.urandom(1024)
    for _ in range(10000):
        master.append("log", chunk)
    assert master.get("log") == chunk * 10000
    master.append("log", b"!")
    assert master.get("log")[-1:] == b"!"


@pytest.mark.timeout(60)
def test_a_wait_on_many_keys_is_answered_once_all_are_set(master):
    keys = [f"key-{i}" for i in range(40000)]
    client = TCPStore(HOST, master.port, timeout=30)
    try:
        thread = threading.Thread(target=client.wait, args=(keys,), daemon=True)
        thread.start()
        time.sleep(0.2)
        for start in range(0, len(keys), 1000):  # from the last key to the first
            batch = keys[::-1][start : start + 1000]
            master.multi_set(batch, ["1"] * len(batch))
        thread.join(30)
        assert not thread.is_alive()
        values = client.multi_get(keys[::997])
        assert values == [b"1"] * len(values)
    finally:
        client.close()


def test_a_key_deleted_after_it_was_seen_is_waited_for_again(master):
    client = TCPStore(HOST, master.port, timeout=10)
    try:
        master.set("a", "1")
        box: dict = {}
        thread = threading.Thread(
            target=lambda: box.update(value=client.multi_get(["a", "b"])), daemon=True
        )
        thread.start()
        time.sleep(0.2)
        assert master.delete_key("a")
        master.set("b", "2")
        time.sleep(0.2)
        assert thread.is_alive()  # "a" is missing again
        master.set("a", "3")
        thread.join(10)
        assert box == {"value": [b"3", b"2"]}
    finally:
        client.close()


# -- 5. idle and half-open connections ----------------------------------------------------------


def test_a_connection_that_never_sends_a_request_is_dropped(master, monkeypatch):
    monkeypatch.setattr(StoreServer, "handshake_timeout", 0.3)
    client = TCPStore(HOST, master.port, timeout=10)  # registered at once: stays
    try:
        with _raw(master.port) as sock:
            assert _closed_by_server(sock)
        time.sleep(0.5)
        client.set("idle", "but registered")
        assert client.get("idle") == b"but registered"
    finally:
        client.close()


def test_a_request_left_half_sent_is_dropped(master, monkeypatch):
    monkeypatch.setattr(StoreServer, "io_timeout", 0.3)
    with _raw(master.port) as sock:
        sock.sendall(frame(Cmd.REGISTER, []))
        assert read_response(sock)[0] == Status.OK
        sock.sendall(frame(Cmd.SET, [b"k", b"v" * 100])[:50])  # and never the rest
        assert _closed_by_server(sock)
    assert not master.check(["k"])


def test_connections_without_a_request_are_capped(master, monkeypatch, caplog):
    monkeypatch.setattr(StoreServer, "max_pending", 3)
    with caplog.at_level(logging.WARNING, "distcomm.store"):
        socks = [_raw(master.port) for _ in range(6)]
        try:
            time.sleep(0.2)
            for sock in socks[:3]:  # the oldest are dropped for the newest
                assert _closed_by_server(sock)
            for sock in socks[3:]:
                sock.sendall(frame(Cmd.NUM_KEYS, []))
                assert read_response(sock) == (Status.OK, [b"0"])
        finally:
            for sock in socks:
                sock.close()
    warned = [r for r in caplog.records if "without a request" in r.getMessage()]
    assert len(warned) == 1  # three drops, one line


def test_warnings_are_rate_limited(caplog):
    throttle = _Throttle(every=60.0)
    with caplog.at_level(logging.WARNING, "distcomm.store"):
        for index in range(100):
            throttle.warn("drop", "dropping client %d", index)
        throttle.warn("other", "another kind")
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["dropping client 0", "another kind"]
    throttle._last["drop"] -= 61  # a minute later: the next one says how many were left out
    with caplog.at_level(logging.WARNING, "distcomm.store"):
        throttle.warn("drop", "dropping client %d", 100)
    assert caplog.records[-1].getMessage() == (
        "dropping client 100 (99 more like this in the last 60 s)"
    )


def _crowded_master(conn) -> None:
    """Host a store with room for 40 descriptors; report the port, then its log at the end."""
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("distcomm.store").addHandler(Keep())
    store = TCPStore(HOST, 0, is_master=True, timeout=30)
    conn.send(store.port)
    conn.recv()
    conn.send(records)
    store.close()


@pytest.mark.timeout(120)
def test_at_the_descriptor_limit_new_clients_still_get_in():
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_crowded_master, args=(child,), daemon=True)
    process.start()
    idle: list[socket.socket] = []
    try:
        assert parent.poll(60)
        port = parent.recv()
        for _ in range(60):  # more than the server has descriptors for
            try:
                idle.append(socket.create_connection((HOST, port), timeout=5))
            except OSError:
                break
        time.sleep(0.5)
        client = TCPStore(HOST, port, timeout=20)
        client.set("in", "yes")
        assert client.get("in") == b"yes"
        client.close()
        parent.send("done")
        assert parent.poll(30)
        records = parent.recv()
        accept_warnings = [r for r in records if "cannot accept" in r]
        assert 1 <= len(accept_warnings) <= 3, records  # rate-limited, not one per attempt
    finally:
        for sock in idle:
            sock.close()
        process.kill()
        process.join(10)


# -- 6. REGISTER counts connections -------------------------------------------------------------


def test_register_counts_each_connection_once(master):
    with _raw(master.port) as sock:
        for _ in range(5):
            sock.sendall(frame(Cmd.REGISTER, []))
            status, args = read_response(sock)
            assert status == Status.OK
        assert args[0] == b"2"  # the master's own client and this connection
        assert Limits.decode(args[1:]) == Limits()
        sock.sendall(frame(Cmd.WAIT_WORKERS, [SECONDS.pack(0.3), b"6"]))
        assert read_response(sock) == (Status.TIMEOUT, [b"2"])


def test_a_register_sent_before_the_greeting_is_answered_after_it(master):
    with socket.create_connection((HOST, master.port), timeout=10) as sock:
        sock.sendall(frame(Cmd.REGISTER, []))  # at once, as a keyless client does
        hello = recv_exact(sock, auth.HELLO_SIZE)
        assert hello.startswith(auth.MAGIC) and hello[len(auth.MAGIC)] == 0
        status, args = read_response(sock)
        assert status == Status.OK and args[0] == b"2"  # the master's client, then this one
        assert Limits.decode(args[1:]) == Limits()


def test_a_request_sent_with_the_proof_is_answered_with_the_accept():
    key = b"the-right-key"
    store = TCPStore(HOST, 0, is_master=True, timeout=10, auth_key=key)
    try:
        with socket.create_connection((HOST, store.port), timeout=10) as sock:
            hello = recv_exact(sock, auth.HELLO_SIZE)
            proof, expected = auth.proof_message(key, hello, "the store")
            sock.sendall(proof + frame(Cmd.REGISTER, []))  # in one packet
            auth.verify_accept(expected, recv_exact(sock, auth.ACCEPT_SIZE), "the store")
            status, args = read_response(sock)
            assert status == Status.OK and args[0] == b"2"
        client = TCPStore(HOST, store.port, timeout=10, auth_key=key)  # the same, built in
        client.set("k", "v")
        assert store.get("k") == b"v"
        client.close()
    finally:
        store.close()


def test_a_proof_refused_with_a_request_behind_it_reads_as_a_refusal():
    store = TCPStore(HOST, 0, is_master=True, timeout=10, auth_key="the-right-key")
    try:
        with pytest.raises(DistNetworkError, match="refused this process's DISTCOMM_AUTH_KEY"):
            TCPStore(HOST, store.port, timeout=2, auth_key="a-wrong-key")  # no retry: a refusal
    finally:
        store.close()


# -- the non-loopback warning -------------------------------------------------------------------


def test_binding_beyond_loopback_without_a_key_warns(monkeypatch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TCPStore(HOST, 0, is_master=True, timeout=5).close()
        assert not [w for w in caught if "DISTCOMM_AUTH_KEY" in str(w.message)]
        TCPStore("0.0.0.0", 0, is_master=True, timeout=5).close()
        exposed = [w for w in caught if "DISTCOMM_AUTH_KEY" in str(w.message)]
        assert len(exposed) == 1 and "0.0.0.0" in str(exposed[0].message)
        monkeypatch.setenv("DISTCOMM_AUTH_KEY", "a-key")
        TCPStore("0.0.0.0", 0, is_master=True, timeout=5).close()
        assert len([w for w in caught if "DISTCOMM_AUTH_KEY" in str(w.message)]) == 1


def test_frames_are_length_prefixed():
    assert frame(Cmd.SET, [b"k", b"vv"]) == (
        HEADER.pack(11, Cmd.SET) + LENGTH.pack(1) + b"k" + LENGTH.pack(2) + b"vv"
    )
