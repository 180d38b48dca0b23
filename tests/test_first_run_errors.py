"""A first run's mistakes fail at once and say what to fix, instead of waiting in silence.

Ranks started with different world sizes, the same rank twice, or different backends fail
every rank at once, naming both sides; a set-up wait for a rank that does not come says
which rank while it waits and when it gives up, never only an internal key; a store
client pointed at a port another program holds says so.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

import pytest

import distcomm as dist
from distcomm.backends.engine.shm.setup import same_host_setup
from distcomm.deadline import Deadline
from distcomm.store import HashStore, PrefixStore, TCPStore
from distcomm.store.ranks import wait_for_ranks
from tests.harness import run_ranks
from tests.processes import free_port

pytestmark = pytest.mark.timeout(180)

INIT_TIMEOUT = 20.0  # a hang shows as a timeout error, not as a passing test


def _init(backend: str = "gloo") -> tuple[str, str]:
    """init_process_group from the environment: ("ok", "") or (error type, message)."""
    backend = os.environ.get("TEST_BACKEND", backend)
    try:
        dist.init_process_group(backend, timeout=INIT_TIMEOUT)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    dist.destroy_process_group()
    return "ok", ""


def _init_rank1_last() -> tuple[str, str]:
    """`_init`, on rank 1 once the join's outcome is in the store: it comes last."""
    if os.environ["RANK"] == "1":
        probe = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=30)
        try:
            probe.wait(["distcomm/rendezvous/joined/outcome"])
        finally:
            probe.close()
    return _init()


def _sizes(sizes: dict[int, int], **more: str):
    return lambda rank: {"WORLD_SIZE": str(sizes[rank]), **more}


def test_a_rank_with_another_world_size_fails_every_rank_at_once():
    port = str(free_port())
    results = run_ranks(
        _init, 3, timeout=120, env={"MASTER_PORT": port}, rank_env=_sizes({0: 3, 1: 2, 2: 3})
    )
    for kind, message in results:
        assert kind == "ValueError", results
        assert (
            "rank 1 was started with world size 2 (from WORLD_SIZE (torch style)), but "
            "rank 0 with world size 3 (from WORLD_SIZE (torch style)): set the same "
            "WORLD_SIZE on every rank"
        ) in message, results
        assert "distcomm/" not in message, results  # no internal key
    assert [message.split("]")[0] for _, message in results] == [
        "[rank 0/3",
        "[rank 1/2",
        "[rank 2/3",
    ]


def test_an_extra_rank_with_a_larger_world_size_is_named_to_every_rank():
    # ranks 0 and 1 are a job of two; a third process thinks the job has three. Rank 1
    # comes last, after the third was refused: it learns why too, not "missing rank 2"
    port = str(free_port())
    results = run_ranks(
        _init_rank1_last,
        3,
        timeout=120,
        env={"MASTER_PORT": port},
        rank_env=_sizes({0: 2, 1: 2, 2: 3}),
    )
    for kind, message in results:
        assert kind == "ValueError", results
        assert (
            "rank 2 was started with world size 3 (from WORLD_SIZE (torch style)), but "
            "rank 0 with world size 2"
        ) in message, results
        assert "missing rank" not in message, results


def test_the_same_rank_twice_fails_every_rank_at_once():
    port = str(free_port())
    results = run_ranks(
        _init,
        3,
        timeout=120,
        env={"MASTER_PORT": port},
        rank_env=lambda r: {"RANK": str(min(r, 1))},
    )
    for kind, message in results:
        assert kind == "ValueError", results
        assert "rank 1 was started twice (pid " in message, results
        assert "give every process its own rank" in message, results


def test_ranks_asking_for_different_backends_fail_at_once():
    port = str(free_port())
    results = run_ranks(
        _init,
        2,
        timeout=120,
        env={"MASTER_PORT": port},
        rank_env=lambda r: {"TEST_BACKEND": "gloo" if r == 0 else "tcp"},
    )
    for kind, message in results:
        assert kind == "ValueError", results
        assert (
            "rank 1 asked for backend 'tcp' ('tcp' for cpu arrays), but rank 0 for "
            "'gloo' ('gloo'): pass the same backend"
        ) in message, results


# -- set-up waits name ranks, not keys ----------------------------------------------------


@pytest.fixture
def server():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=30)
    yield store
    store.close()


@pytest.fixture
def warnings(monkeypatch, caplog):
    monkeypatch.setenv("DISTCOMM_STALL_WARN_S", "0.3")
    caplog.set_level(logging.WARNING)
    return caplog


def _still_waiting(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]


def test_the_shared_memory_setup_names_the_rank_it_waits_for(server, warnings):
    store = PrefixStore("distcomm/0/gloo", server)
    with pytest.raises(dist.DistTimeoutError) as caught:
        same_host_setup(store, 0, 2, Deadline(1.5), "auto", "[rank 0/2] setup on 'gloo'")
    message = str(caught.value)
    assert message.startswith("[rank 0/2] setup on 'gloo': only 1 of 2 ranks"), message
    assert "rank(s) 1 never did" in message and "gloo backend?" in message, message
    assert "distcomm/" not in message and "who" not in message, message
    lines = _still_waiting(warnings)
    assert lines and all("missing rank(s) 1." in line for line in lines), lines
    assert not [r for r in warnings.records if "has waited" in r.getMessage()]  # no raw key


def test_a_wait_whose_ranks_have_all_come_warns_of_no_missing_rank(warnings):
    """Every rank has set its key, but the last has not yet written the step's outcome
    (it is descheduled, say): the wait goes on and names no missing rank, since there is
    none to name; it used to warn 'still waiting ... missing rank(s) none'."""
    store = HashStore()
    keys = {r: f"joined/{r}" for r in range(3)}
    for key in keys.values():
        store.set(key, "here")
    waits = 0
    real_wait = store.wait

    def wait(wanted, timeout=None):
        nonlocal waits
        waits += 1
        if waits == 4:  # three steps of waiting, each long enough for a warning, then done
            store.set("outcome", "ok")
        return real_wait(wanted, timeout)

    store.wait = wait
    wait_for_ranks(
        store,
        keys,
        Deadline(60),
        "[rank 0/3] roll call",
        arrived="joined",
        hint="start them",
        done="outcome",
        warn_after=0.05,
    )
    assert waits == 4
    assert _still_waiting(warnings) == []


# -- a store address held by another program ----------------------------------------------


class _Impostor:
    """A TCP server of another program on a free port: it accepts, then sends `banner`
    and stays silent, closes at once (`close`), or just stays silent."""

    def __init__(self, banner: bytes = b"", close: bool = False) -> None:
        self._banner, self._close = banner, close
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if self._close:
                conn.close()
                continue
            if self._banner:
                conn.sendall(self._banner)
            self._held.append(conn)

    def close(self) -> None:
        self._listener.close()
        for conn in self._held:
            conn.close()


@pytest.fixture
def impostor():
    made: list[_Impostor] = []

    def make(**kwargs) -> _Impostor:
        made.append(_Impostor(**kwargs))
        return made[-1]

    yield make
    for server in made:
        server.close()


def test_a_store_client_says_another_program_sent_something_else(impostor):
    port = impostor(banner=b"SSH-2.0-OpenSSH_9.6\r\n").port
    with pytest.raises(dist.DistNetworkError) as caught:
        TCPStore("127.0.0.1", port, timeout=5)
    message = str(caught.value)
    assert (
        f"what answers at 127.0.0.1:{port} is not a distcomm TCPStore (it sent "
        "b'SSH-2.0-OpenSSH_9.6\\r\\n'"
    ) in message, message
    assert "is another program using this port? Pick another port (MASTER_PORT" in message


def test_a_store_client_says_another_program_closed_at_once(impostor):
    port = impostor(close=True).port
    with pytest.raises(dist.DistNetworkError) as caught:
        TCPStore("127.0.0.1", port, timeout=5)
    message = str(caught.value)
    assert f"what answers at 127.0.0.1:{port} closed the connection without sending" in message
    assert "is another program using this port?" in message, message


def test_a_silent_program_on_the_store_port_is_named_while_and_after_waiting(impostor, warnings):
    port = impostor().port
    with pytest.raises(dist.DistNetworkError) as caught:
        TCPStore("127.0.0.1", port, timeout=1.5)
    message = str(caught.value)
    assert (
        f"what answers at 127.0.0.1:{port} accepted the connection but sent nothing" in message
    ), message
    assert "it is probably not a distcomm TCPStore" in message, message
    assert "is another program using this port?" in message, message
    lines = [r.getMessage() for r in warnings.records if "has not greeted" in r.getMessage()]
    assert len(lines) == 1 and "may be busy, or another program" in lines[0], lines


def test_a_busy_store_that_greets_late_is_still_used(warnings):
    # the server's loop is held up past the warning: the client warns, waits, then works
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10)
    listener = socket.create_server(("127.0.0.1", 0))
    relay_ready = threading.Event()

    def relay() -> None:  # hands the client to the store only after a pause
        conn, _ = listener.accept()
        relay_ready.wait(5)
        upstream = socket.create_connection(("127.0.0.1", server.port))
        for a, b in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    threading.Thread(target=relay, daemon=True).start()
    timer = threading.Timer(1.0, relay_ready.set)
    timer.start()
    try:
        client = TCPStore("127.0.0.1", listener.getsockname()[1], timeout=10)
        client.set("k", "v")
        assert server.get("k") == b"v"
        client.close()
    finally:
        timer.cancel()
        listener.close()
        server.close()
    assert any("has not greeted" in r.getMessage() for r in warnings.records)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def test_c10d_rendezvous_on_a_port_another_program_holds(impostor):
    from distcomm.launch.rendezvous import (
        RendezvousConnectionError,
        RendezvousParameters,
        get_rendezvous_handler,
    )

    port = impostor(banner=b"HTTP/1.1 400 Bad Request\r\n\r\n").port
    params = RendezvousParameters(
        "c10d", f"127.0.0.1:{port}", "job", 1, 1, config={"read_timeout": "5"}
    )
    with pytest.raises(RendezvousConnectionError) as caught:
        get_rendezvous_handler(params)
    message = str(caught.value)
    assert "this agent found the port taken" in message, message
    assert (
        f"what answers at 127.0.0.1:{port} is not a distcomm TCPStore (it sent "
        "b'HTTP/1.1 400 Bad Request"
    ) in message, message
    assert "--rdzv_endpoint" in message, message
