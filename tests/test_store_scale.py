"""The TCPStore at a job's scale and under a server that sheds or loses connections.

4,096 clients over 8 processes connect at once to one server and pass a barrier; a
client retries a refused connect until the server appears, and a connection the server
sheds during the handshake; the pauses between retries are randomised and bounded; and a
non-idempotent request whose answer is lost is never sent twice. Every socket is on
127.0.0.1; the master store lives in the test process. Tests assert results and counts,
never durations.
"""

from __future__ import annotations

import logging
import random
import resource
import socket
import struct
import threading
import time
import traceback

import pytest

from distcomm import auth
from distcomm.errors import DistNetworkError, DistStoreTimeoutError
from distcomm.net import retry_delays
from distcomm.store import TCPStore
from distcomm.store.tcp.protocol import HEADER, QUIET, Cmd
from tests.harness import RankPool
from tests.store_wire import recv_exact

HOST = "127.0.0.1"
#: the barrier's processes, and clients (threads, one connection each) per process
PROCESSES, PER_PROCESS = 8, 512
CLIENTS = PROCESSES * PER_PROCESS


@pytest.fixture(autouse=True)
def _no_auth_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISTCOMM_AUTH_KEY", raising=False)


# -- 4,096 clients, one server ---------------------------------------------------------------


def _raise_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _barrier_clients(port: int, count: int, total: int, start: float) -> dict:
    """`count` clients in threads, released together at `start` (monotonic): each
    connects, adds 1 to "arrive", sets "go" if its add made `total`, then waits for
    "go". Returns what each add returned, how many returned, and the first errors."""
    _raise_file_limit()
    go = threading.Event()
    lock = threading.Lock()
    counts: list[int] = []
    errors: list[str] = []
    stores: list[TCPStore] = []

    def client() -> None:
        try:
            go.wait()
            store = TCPStore(HOST, port, timeout=60)
            with lock:
                stores.append(store)
            count = store.add("arrive", 1)
            if count == total:
                store.set("go", "1")
            store.wait(["go"])
            with lock:
                counts.append(count)
        except Exception:
            with lock:
                errors.append(traceback.format_exc())

    threads = [threading.Thread(target=client, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    time.sleep(max(0.0, start - time.monotonic()))
    go.set()
    for thread in threads:
        thread.join(90)
    for store in stores:
        store.close()
    return {
        "counts": counts,
        "errors": errors[:3],
        "failed": len(errors),
        "hung": sum(thread.is_alive() for thread in threads),
    }


@pytest.mark.timeout(180)
def test_4096_clients_connect_at_once_and_pass_a_barrier_through_one_server():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < CLIENTS + 512:
        pytest.skip(
            f"the server needs {CLIENTS + 512} file descriptors; RLIMIT_NOFILE's hard "
            f"limit is {hard}"
        )
    master = TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=60)
    try:
        with RankPool(PROCESSES, start_timeout=60) as pool:
            start = time.monotonic() + 0.5  # every process has started: threads, then go
            results = pool.run(
                _barrier_clients, master.port, PER_PROCESS, CLIENTS, start, timeout=120
            )
        failures = [error for result in results for error in result["errors"]]
        assert sum(r["failed"] for r in results) == 0, failures[0]
        assert sum(r["hung"] for r in results) == 0
        counts = sorted(count for result in results for count in result["counts"])
        assert counts == list(range(1, CLIENTS + 1))  # every client returned, no add twice
        assert master.get("arrive") == str(CLIENTS).encode()
    finally:
        master.close()


# -- retrying a connect ------------------------------------------------------------------------


def test_retry_delays_are_randomised_grow_and_stay_bounded():
    first, most = 0.01, 1.0
    draws = [list(_take(retry_delays(first, most, random.Random(seed)), 12)) for seed in range(50)]
    for delays in draws:
        ceiling = first
        for delay in delays:
            assert ceiling / 2 <= delay <= ceiling  # never at once, never past the ceiling
            ceiling = min(ceiling * 2, most)
        assert max(delays) <= most
        assert delays[-1] >= most / 2  # the ceiling was reached and stays there
    for n in range(12):  # clients refused together come back at different moments
        assert len({delays[n] for delays in draws}) == len(draws)
    assert retry_delays(first, most, random.Random(1)).__next__() == draws[1][0]


def _take(delays, count: int):
    for _ in range(count):
        yield next(delays)


def test_a_client_retries_a_refused_connect_until_the_server_appears(monkeypatch, caplog):
    monkeypatch.setenv("DISTCOMM_STALL_WARN_S", "0.2")
    reserved = socket.socket()  # bound, not listening: connecting to it is refused
    reserved.bind((HOST, 0))
    port = reserved.getsockname()[1]
    retrying = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "still retrying" in record.getMessage():
                retrying.set()

    seen = Seen(logging.WARNING)
    logging.getLogger("distcomm").addHandler(seen)
    made: list[TCPStore] = []
    errors: list[BaseException] = []

    def client() -> None:
        try:
            made.append(TCPStore(HOST, port, timeout=30))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=client, daemon=True)
    master = None
    try:
        with caplog.at_level(logging.WARNING, "distcomm"):
            thread.start()
            assert retrying.wait(20), "the client did not say it was retrying"
            assert thread.is_alive() and not made  # refused so far, still trying
            master = TCPStore(
                HOST,
                port,
                is_master=True,
                wait_for_workers=False,
                master_listen_fd=reserved.fileno(),
                timeout=30,
            )
            thread.join(30)
        assert not errors, errors
        assert made and made[0].add("late", 1) == 1
        assert master.get("late") == b"1"
        lines = [r.getMessage() for r in caplog.records if "still retrying" in r.getMessage()]
        assert lines and f"connecting to the TCPStore at {HOST}:{port}" in lines[0], lines
        assert "refused" in lines[0], lines
    finally:
        logging.getLogger("distcomm").removeHandler(seen)
        for store in made:
            store.close()
        if master is not None:
            master.close()
        reserved.close()


# -- a relay that sheds connections or loses answers ------------------------------------------


def _read_frame(sock: socket.socket) -> bytes | None:
    """One whole frame (header and body), or None once the peer closed."""
    header = recv_exact(sock, HEADER.size)
    if len(header) < HEADER.size:
        return None
    body = recv_exact(sock, HEADER.unpack(header)[0])
    return header + body


class _Relay:
    """A TCP relay to a real store server, frame by frame, which misbehaves on purpose.

    Args:
        upstream: the real server's port.
        shed: how many of the first connections to cut after the server's greeting, at
            the client's first request, before the server sees it: closed, then reset
            (SO_LINGER 0), in turn.
        lose_add: "drop" closes the client's connection, "hang" stays silent, after
            passing the first ADD to the server and keeping its answer.
    """

    def __init__(self, upstream: int, shed: int = 0, lose_add: str | None = None) -> None:
        self.upstream, self.shed, self.lose_add = upstream, shed, lose_add
        self.connections = 0
        self.adds_passed = 0
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            self._socks.append(client)
            threading.Thread(
                target=self._relay, args=(client, self.connections), daemon=True
            ).start()

    def _relay(self, client: socket.socket, number: int) -> None:
        try:
            server = socket.create_connection((HOST, self.upstream))
            self._socks.append(server)
            client.sendall(recv_exact(server, auth.HELLO_SIZE))  # the greeting (no key)
            while (request := _read_frame(client)) is not None:
                if number <= self.shed:
                    if number % 2 == 0:
                        client.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                    client.close()
                    return
                server.sendall(request)
                code = HEADER.unpack_from(request)[1]
                if code in QUIET:
                    continue
                answer = _read_frame(server)
                if answer is None:
                    return
                if code == Cmd.ADD and self.lose_add and not self.adds_passed:
                    self.adds_passed += 1
                    if self.lose_add == "drop":
                        client.close()
                    return  # "hang": the client hears nothing more on this connection
                client.sendall(answer)
        except OSError:
            pass

    def close(self) -> None:
        self._listener.close()
        for sock in self._socks:
            sock.close()


@pytest.fixture
def relay():
    master = TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=10)
    made: list[_Relay] = []

    def make(**kwargs) -> tuple[TCPStore, _Relay]:
        made.append(_Relay(master.port, **kwargs))
        return master, made[-1]

    yield make
    for each in made:
        each.close()
    master.close()


def test_a_connection_shed_during_the_handshake_is_made_again(relay):
    master, shed = relay(shed=2)  # the first closed, the second reset, the third served
    client = TCPStore(HOST, shed.port, timeout=10)
    try:
        assert shed.connections == 3
        assert client.add("in", 1) == 1
        assert master.get("in") == b"1"
    finally:
        client.close()


def test_an_add_whose_connection_drops_is_not_sent_again(relay):
    master, lossy = relay(lose_add="drop")
    client = TCPStore(HOST, lossy.port, timeout=10)
    try:
        with pytest.raises(
            DistNetworkError,
            match=r"add\('counter'\) failed; the add may or may not have been "
            r"applied, and it is not sent again",
        ):
            client.add("counter", 1)
        assert master.get("counter") == b"1"  # applied once, by the request that got there
        with pytest.raises(DistNetworkError, match="closed the connection"):
            client.add("counter", 1)  # the connection is gone: nothing is re-sent
        assert master.add("counter", 0) == 1
        assert lossy.connections == 1
    finally:
        client.close()


def test_an_add_whose_answer_never_comes_is_not_sent_again(relay):
    master, lossy = relay(lose_add="hang")
    client = TCPStore(HOST, lossy.port, timeout=0.5)
    try:
        with pytest.raises(
            DistStoreTimeoutError,
            match=r"did not answer add\('counter'\).*the add may or may not "
            r"have been applied, and it is not sent again",
        ):
            client.add("counter", 1)
        assert master.get("counter") == b"1"
        assert client.add("counter", 1) == 2  # on a new connection: once, not twice
        assert lossy.connections == 2
        assert master.add("counter", 0) == 2
    finally:
        client.close()
