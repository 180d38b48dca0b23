"""Tests of the launcher's rendezvous: static, and dynamic over c10d, file and etcd stores.

Real stores, real threads and processes, everything on 127.0.0.1. Dynamic rounds use short
last-call and keep-alive settings; nothing asserts how long a step took.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from distcomm.launch.rendezvous import (
    DynamicRendezvousHandler,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
    StaticRendezvous,
    get_rendezvous_handler,
    register_rendezvous_backend,
    registered_rendezvous_backends,
)
from distcomm.launch.rendezvous.chair import Chair, Keys, Request, peek
from distcomm.launch.rendezvous.state import (
    Action,
    Limits,
    RendezvousState,
    apply,
    decide,
    drop_dead,
    leave_round,
    num_waiting,
    withdraw,
)
from distcomm.store import TCPStore
from tests.processes import free_port

try:
    from tests.etcd_server import etcd_endpoint
except ImportError:  # the etcd fixture's module is not there: the etcd cases skip

    @pytest.fixture
    def etcd_endpoint() -> str:
        pytest.skip("tests/etcd_server.py (the etcd server fixture) is not available")


HOST = "127.0.0.1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: short settings so rounds and failure detection take a fraction of a second
FAST = {
    "last_call_timeout": "0.5",
    "keep_alive_interval": "0.2",
    "keep_alive_max_attempt": "5",
    "join_timeout": "30",
    "read_timeout": "10",
}
#: seconds without a heartbeat after which the others drop a node, with these settings
DEAD_AFTER = float(FAST["keep_alive_interval"]) * int(FAST["keep_alive_max_attempt"])
#: how long a thread or process of a test may take before the test gives up on it
WAIT = 30.0


@pytest.fixture(autouse=True)
def _no_auth_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISTCOMM_AUTH_KEY", raising=False)


# -- a run of dynamic handlers over one store -------------------------------------------------


class Run:
    """Creates the handlers of one run (the same store, run id and node range) and shuts
    them all down at the end, the c10d host last."""

    def __init__(self, backend: str, endpoint: str, run_id: str) -> None:
        self.backend, self.endpoint, self.run_id = backend, endpoint, run_id
        self.handlers: list[RendezvousHandler] = []

    def params(self, min_nodes: int, max_nodes: int, **conf: str) -> RendezvousParameters:
        config = {**FAST, **conf}
        endpoint = self.endpoint
        if self.backend == "c10d":
            if self.handlers:  # the first handler hosts on a free port; the rest connect
                endpoint = f"{HOST}:{self.handlers[0].bootstrap_address[1]}"
                config.setdefault("is_host", "false")
            else:
                endpoint = f"{HOST}:0"
                config.setdefault("is_host", "true")
        return RendezvousParameters(
            self.backend,
            endpoint,
            self.run_id,
            min_nodes,
            max_nodes,
            local_addr=HOST,
            config=config,
        )

    def handler(self, min_nodes: int, max_nodes: int, **conf: str) -> DynamicRendezvousHandler:
        handler = get_rendezvous_handler(self.params(min_nodes, max_nodes, **conf))
        assert isinstance(handler, DynamicRendezvousHandler)
        self.handlers.append(handler)
        return handler

    def close(self) -> None:
        for handler in reversed(self.handlers):
            handler.shutdown()


@pytest.fixture(params=["c10d", "file", "etcd"])
def run(request: pytest.FixtureRequest, tmp_path) -> Iterator[Run]:
    backend = request.param
    if backend == "etcd":
        endpoint = request.getfixturevalue("etcd_endpoint")
    elif backend == "file":
        endpoint = str(tmp_path / "rdzv")
    else:
        endpoint = ""
    the_run = Run(backend, endpoint, f"run-{backend}-{os.getpid()}-{time.monotonic_ns()}")
    yield the_run
    the_run.close()


def _together(*calls: Callable[[], RendezvousInfo]) -> list[RendezvousInfo]:
    """Run the calls in threads at once; their results in order (or the first exception)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result(timeout=WAIT) for future in futures]


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.02)


def _check_round(infos: list[RendezvousInfo], size: int) -> None:
    assert sorted(info.rank for info in infos) == list(range(size))
    assert {info.world_size for info in infos} == {size}
    assert len({info.round for info in infos}) == 1


# -- the state machine, without a store -------------------------------------------------------

LIMITS = Limits(min_nodes=2, max_nodes=3, last_call_timeout=10.0, dead_after=5.0)


def _step(state: RendezvousState, node: str, now: float, expired: bool = False) -> Action:
    action = decide(state, node, LIMITS, now, expired)
    apply(state, action, node, LIMITS, now)
    return action


def test_state_machine_last_call_max_and_ranks() -> None:
    state = RendezvousState()
    assert _step(state, "b", 0.0) is Action.JOIN
    assert state.deadline is None  # below min_nodes: no last call yet
    assert _step(state, "a", 1.0) is Action.JOIN
    assert state.deadline == 11.0
    assert _step(state, "a", 5.0) is Action.WAIT  # the last call is on
    assert _step(state, "a", 11.0) is Action.COMPLETE
    assert state.complete and state.participants == {"a": 0, "b": 1}
    assert _step(state, "c", 12.0) is Action.ENTER_WAIT_LIST
    assert state.wait_list == ["c"]
    assert _step(state, "b", 12.0) is Action.FINISH
    # b restarts: the round is over, the next opens with whoever comes
    assert leave_round(state, "b") and state.round == 1 and not state.complete
    assert _step(state, "c", 13.0) is Action.JOIN and state.wait_list == []
    assert _step(state, "b", 13.0) is Action.JOIN and state.deadline == 23.0
    assert _step(state, "a", 14.0) is Action.JOIN  # the third node: max_nodes, complete now
    assert state.complete and state.participants == {"a": 0, "b": 1, "c": 2}


def test_state_machine_dead_nodes_closed_and_timeout() -> None:
    state = RendezvousState()
    for node in ("a", "b"):
        _step(state, node, 0.0)
    state.last_heartbeats["a"] = 100.0
    assert drop_dead(state, "a", LIMITS, 100.0)  # b is silent since 0.0: dropped
    assert list(state.participants) == ["a"] and state.deadline is None
    assert _step(state, "a", 101.0, expired=True) is Action.TIMEOUT
    assert state.participants == {}
    assert not withdraw(state, "a", LIMITS, 101.0)
    state.closed = True
    assert decide(state, "a", LIMITS, 102.0, False) is Action.CLOSED
    assert RendezvousState.decode(state.encode()) == state


def test_state_machine_waiting_nodes_count_only_when_they_fit() -> None:
    state = RendezvousState()
    for node in ("a", "b"):
        _step(state, node, 0.0)
    _step(state, "a", 20.0)
    _step(state, "c", 21.0)
    assert num_waiting(state, LIMITS) == 1  # 2 of max 3: a restart lets c in
    full = Limits(min_nodes=2, max_nodes=2, last_call_timeout=10.0, dead_after=5.0)
    assert num_waiting(state, full) == 0  # a full round has no room: no restart for it
    leave_round(state, "a")
    _step(state, "a", 22.0)
    assert num_waiting(state, LIMITS) == 2  # a gathers round 1, c still waits


def test_state_machine_complete_round_left_empty_opens_the_next() -> None:
    state = RendezvousState()
    for node in ("a", "b"):
        _step(state, node, 0.0)
    _step(state, "a", 20.0)
    assert state.complete
    withdraw(state, "a", LIMITS, 21.0)
    assert state.complete and state.round == 0
    withdraw(state, "b", LIMITS, 21.0)
    assert not state.complete and state.round == 1


def test_state_machine_complete_round_keeps_a_dead_members_rank() -> None:
    """Every member of a complete round reads the same ranks and world size, however late:
    a member that dies (or looks dead under load) keeps its rank; only its heartbeat goes,
    and a node on the wait list counts as waiting beside the live members."""
    state = RendezvousState()
    for node in ("a", "b", "c"):
        _step(state, node, 0.0)
    assert state.complete and state.participants == {"a": 0, "b": 1, "c": 2}
    state.last_heartbeats.update(a=10.0, b=10.0)
    apply(state, decide(state, "d", LIMITS, 10.0, False), "d", LIMITS, 10.0)
    assert num_waiting(state, LIMITS) == 0  # three live members of max 3
    assert drop_dead(state, "a", LIMITS, 10.0) == ["c"]
    assert state.complete and state.participants == {"a": 0, "b": 1, "c": 2}
    assert "c" not in state.last_heartbeats
    assert drop_dead(state, "a", LIMITS, 11.0) == []  # dropped once: nothing changes again
    assert _step(state, "b", 11.0) is Action.FINISH
    assert num_waiting(state, LIMITS) == 1  # d fits beside the two live members
    state.last_heartbeats.update(d=20.0)
    assert drop_dead(state, "d", LIMITS, 20.0) == ["a", "b"]  # the last members: next round
    assert not state.complete and state.round == 1 and state.participants == {}


def test_state_machine_next_round_completes_once_every_live_node_is_back() -> None:
    """A round after a complete one does not wait its last call once every node of the
    previous round that is alive, and every waiting node, has joined."""
    state = RendezvousState()
    for node in ("a", "b", "c"):
        _step(state, node, 0.0)
    assert state.complete  # max_nodes
    # a plain restart: all three back, complete at the last join, no last call
    leave_round(state, "a")
    assert state.previous == ["a", "b", "c"]
    _step(state, "a", 1.0)
    assert _step(state, "b", 1.0) is Action.JOIN and not state.complete  # c still alive
    assert state.deadline == 11.0
    assert _step(state, "c", 1.0) is Action.JOIN and state.complete
    assert state.previous == []
    # c dies: a and b wait only until c's heartbeat is missed, not for the last call
    for node in ("a", "b"):
        state.last_heartbeats[node] = 2.0
    leave_round(state, "a")
    _step(state, "a", 2.0)
    _step(state, "b", 2.0)
    assert _step(state, "a", 4.0) is Action.WAIT  # c's last heartbeat (1.0) is recent
    state.last_heartbeats.update(a=6.5, b=6.5)
    assert drop_dead(state, "a", LIMITS, 6.5) == ["c"]
    assert _step(state, "a", 6.5) is Action.COMPLETE and 6.5 < 12.0  # before the last call
    assert state.participants == {"a": 0, "b": 1}
    # a node on the wait list is waited for too
    wide = Limits(min_nodes=2, max_nodes=4, last_call_timeout=10.0, dead_after=5.0)
    assert decide(state, "d", wide, 7.0, False) is Action.ENTER_WAIT_LIST
    apply(state, Action.ENTER_WAIT_LIST, "d", wide, 7.0)
    leave_round(state, "b")
    for node in ("b", "a"):
        apply(state, decide(state, node, wide, 7.0, False), node, wide, 7.0)
    assert not state.complete and decide(state, "a", wide, 7.5, False) is Action.WAIT
    apply(state, decide(state, "d", wide, 7.5, False), "d", wide, 7.5)
    assert state.complete and sorted(state.participants) == ["a", "b", "d"]
    # a first round has nobody to expect: it keeps its last call
    first = RendezvousState()
    _step(first, "a", 0.0)
    _step(first, "b", 0.0)
    assert _step(first, "a", 1.0) is Action.WAIT and not first.complete
    assert RendezvousState.decode(state.encode()) == state


# -- the chair, over a real store -------------------------------------------------------------


class _Desk:
    """One run's keys on a master TCPStore, and a Chair over them (as a node's thread uses
    it, without the thread: the test calls `serve`)."""

    def __init__(self, limits: Limits, run_id: str = "desk") -> None:
        self.store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=10)
        self.keys = Keys(run_id)
        self.limits = limits
        self.dropped: list[str] = []
        self.calls: dict[str, int] = {}

    def chair(self) -> Chair:
        chair = Chair(
            self.store,
            self.store.clone(),
            self.keys,
            self.limits,
            "chair",
            RendezvousState.decode,
            self.dropped.extend,
        )
        chair.load()
        return chair

    def beat(self, *nodes: str) -> None:
        for node in nodes:
            self.store.set(self.keys.heartbeat(node), repr(time.time()))

    def join(self, node: str, after: int | None = None, again: bool = False) -> int:
        """Push a join of `node` (the same call again when `again`); its call number."""
        if not again:
            self.calls[node] = self.calls.get(node, 0) + 1
        call = self.calls[node]
        self.beat(node)
        self.store.queue_push(self.keys.requests, Request(node, call, "join", after=after).encode())
        return call

    def answer(self, node: str) -> dict[str, object] | None:
        raw = peek(self.store, self.keys.answer(node, self.calls[node]))
        return None if raw is None else json.loads(raw)

    def summary(self) -> dict[str, object]:
        return json.loads(self.store.get(self.keys.summary))

    def close(self) -> None:
        self.store.close()


@pytest.fixture
def desk() -> Iterator[Callable[[Limits], _Desk]]:
    made: list[_Desk] = []

    def make(limits: Limits) -> _Desk:
        made.append(_Desk(limits))
        return made[-1]

    yield make
    for one in made:
        one.close()


@pytest.mark.timeout(60)
def test_chair_a_member_lost_from_a_complete_round_ends_it_and_never_shrinks_it(desk) -> None:
    """The race this design closes: a member of a complete round is dropped (its heartbeat
    stopped); a member that reads its answer afterwards still reads the round it joined
    (size 3, its own rank), the round is over for everyone, and the next one forms without
    the lost node."""
    # dead_after: far above a stall of the test between a's and b's beat and the chair's
    # read on a loaded machine, which would drop them too
    d = desk(Limits(min_nodes=2, max_nodes=3, last_call_timeout=30.0, dead_after=2.0))
    chair = d.chair()
    for node in ("a", "b", "c"):
        d.join(node)
    chair.serve(heartbeats=True)
    round0 = {node: d.answer(node) for node in "abc"}
    assert {node: (a["rank"], a["size"], a["round"]) for node, a in round0.items()} == {
        "a": (0, 3, 0),
        "b": (1, 3, 0),
        "c": (2, 3, 0),
    }
    assert not d.summary()["lost"]
    chair.serve(heartbeats=True)  # the chair's first read of their heartbeats
    time.sleep(2.1)  # c's heartbeat stops: older than dead_after at the next read
    d.beat("a", "b")
    chair.serve(heartbeats=True)
    assert d.dropped == ["c"]
    state = RendezvousState.decode(d.store.get(d.keys.state))
    assert state.complete and state.participants == {"a": 0, "b": 1, "c": 2}
    assert "c" not in state.last_heartbeats
    assert d.summary()["lost"] and d.summary()["round"] == 0
    assert d.answer("c") == round0["c"]  # read late: still the round it joined
    d.join("a", after=0)
    d.join("b", after=0)
    chair.serve(heartbeats=False)  # every live member is back: no last call
    assert {node: (d.answer(node)["rank"], d.answer(node)["size"]) for node in "ab"} == {
        "a": (0, 2),
        "b": (1, 2),
    }
    assert d.summary()["round"] == 1 and not d.summary()["lost"]


@pytest.mark.timeout(60)
def test_chair_a_request_pushed_twice_ends_the_round_once(desk) -> None:
    """A node pushes its request again when the chair changed (the old one may have taken
    it and died): naming the round it leaves makes the second push change nothing."""
    d = desk(Limits(min_nodes=2, max_nodes=2, last_call_timeout=30.0, dead_after=30.0))
    chair = d.chair()
    d.join("a")
    d.join("b")
    chair.serve(heartbeats=False)
    assert d.answer("a")["round"] == d.answer("b")["round"] == 0
    d.join("a", after=0)
    d.join("a", after=0, again=True)
    d.join("b", after=0)
    chair.serve(heartbeats=False)
    assert d.answer("a")["round"] == d.answer("b")["round"] == 1
    assert RendezvousState.decode(d.store.get(d.keys.state)).round == 1


@pytest.mark.timeout(60)
def test_a_new_chair_goes_on_from_the_stored_state(desk) -> None:
    """A chair's pending joins are in the stored state: the next chair answers them."""
    d = desk(Limits(min_nodes=2, max_nodes=2, last_call_timeout=30.0, dead_after=30.0))
    first = d.chair()
    d.join("a")
    first.serve(heartbeats=True)  # written: a is a participant and waits
    assert d.answer("a") is None
    second = d.chair()  # the first one went silent; another node took the chair
    assert second.state.pending == {"a": 1}
    d.join("b")
    second.serve(heartbeats=False)
    assert (d.answer("a")["rank"], d.answer("b")["rank"]) == (0, 1)
    assert d.answer("a")["size"] == 2


# -- dynamic rounds over real stores ----------------------------------------------------------


@pytest.mark.timeout(60)
def test_round_of_three(run: Run) -> None:
    handlers = [run.handler(3, 3) for _ in range(3)]
    infos = _together(*(h.next_rendezvous for h in handlers))
    _check_round(infos, 3)
    assert infos[0].round == 0
    if run.backend == "c10d":
        address = handlers[0].bootstrap_address
        assert address is not None and address[1] != 0
        assert {info.bootstrap_address for info in infos} == {address}
    else:
        assert {info.bootstrap_address for info in infos} == {None}
    # the round's store is shared by its nodes; the run's store by every round
    infos[0].store.set("hello", b"round")
    infos[1].run_store.set("hello", b"run")
    assert infos[2].store.get("hello") == b"round"
    assert infos[2].run_store.get("hello") == b"run"
    assert [h.num_nodes_waiting() for h in handlers] == [0, 0, 0]
    for handler in handlers:
        assert handler.get_backend() == run.backend
        assert handler.get_run_id() == run.run_id
        assert not handler.is_closed()


@pytest.mark.timeout(60)
def test_last_call_completes_with_min_nodes(run: Run) -> None:
    handlers = [run.handler(2, 4) for _ in range(2)]
    infos = _together(*(h.next_rendezvous for h in handlers))
    _check_round(infos, 2)


class _Lines(logging.Handler):
    """Keeps the messages logged to it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.timeout(60)
def test_last_call_is_logged_when_the_wait_starts(run: Run) -> None:
    """A round with min_nodes but not max_nodes says once that it waits out its last call,
    for how long and how to avoid it; the restart round that follows (every node back)
    completes at once and says nothing."""
    lines = _Lines()
    logger = logging.getLogger("distcomm.launch.rendezvous")
    logger.addHandler(lines)
    try:
        handler = run.handler(1, 3, last_call_timeout="0.5")
        first = handler.next_rendezvous()
        said = [line for line in lines.lines if "last_call_timeout" in line]
        handler.next_rendezvous()  # a restart: its only node is back
    finally:
        logger.removeHandler(lines)
    assert first.world_size == 1
    (line,) = said
    assert f"{run.run_id!r} ({run.backend}): 1 node(s) joined round {first.round} " in line
    assert "(--nnodes=1:3); waiting up to " in line
    assert "(--rdzv_conf last_call_timeout=0.5) for more before starting the workers" in line
    assert "pass --nnodes=1 to start at once" in line
    assert [line for line in lines.lines if "last_call_timeout" in line] == said


@pytest.mark.timeout(90)
def test_late_node_waits_then_everyone_rejoins(run: Run) -> None:
    # round 1's last call must outlast the test thread's steps between its first two
    # nodes and its third
    first = [run.handler(2, 3, last_call_timeout="2") for _ in range(2)]
    round0 = _together(*(h.next_rendezvous for h in first))
    _check_round(round0, 2)
    late = run.handler(2, 3, last_call_timeout="2")
    with ThreadPoolExecutor(3) as pool:
        pending = pool.submit(late.next_rendezvous)
        _until(lambda: first[0].num_nodes_waiting() == 1, "the late node is on the wait list")
        assert first[1].num_nodes_waiting() == 1
        assert late.state().wait_list == [late.node_id]
        # the agents restart: the first to come back ends round 0 and opens round 1
        restarted = pool.submit(first[0].next_rendezvous)
        _until(lambda: late.state().round == 1, "round 1 opens")
        assert first[1].num_nodes_waiting() >= 1  # its round is over: it must rejoin
        rejoined = pool.submit(first[1].next_rendezvous)
        round1 = [future.result(WAIT) for future in (restarted, rejoined, pending)]
    _check_round(round1, 3)
    assert round1[0].round == round0[0].round + 1
    assert late.state().wait_list == []


_CHILD = textwrap.dedent("""
    import sys
    from distcomm.launch.rendezvous import RendezvousParameters, get_rendezvous_handler
    backend, endpoint, run_id, host = sys.argv[1:5]
    conf = dict(item.split("=") for item in sys.argv[5:])
    handler = get_rendezvous_handler(RendezvousParameters(
        backend, endpoint, run_id, 2, 3, local_addr=host, config=conf))
    print(handler.node_id, flush=True)
    info = handler.next_rendezvous()
    print("rank", info.rank, flush=True)
    sys.stdin.read()  # until the test kills it
""")


def _spawn_node(run: Run, **conf: str) -> tuple[subprocess.Popen[str], str]:
    """A node in its own process, joining with min 2 / max 3; returns it and its node id."""
    params = run.params(2, 3, **conf)
    conf = [f"{key}={value}" for key, value in params.config.items()]
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, run.backend, params.endpoint, run.run_id, HOST, *conf],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=WAIT)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


@pytest.mark.timeout(90)
def test_killed_node_is_dropped_before_the_round_completes(run: Run) -> None:
    observer = run.handler(2, 3)  # only reads the state (and hosts the c10d store)
    proc, node = _spawn_node(run)
    try:
        assert node, "the child process printed no node id"
        _until(lambda: node in observer.state().participants, "the child joined")
        _kill(proc)
        # once its heartbeats are overdue the next writer drops it, so the two nodes
        # below complete a round of 2 (with it, they would make max_nodes=3 at once)
        time.sleep(DEAD_AFTER * 1.5)
        survivors = [run.handler(2, 3) for _ in range(2)]
        infos = _together(*(h.next_rendezvous for h in survivors))
    finally:
        _kill(proc)
    _check_round(infos, 2)
    state = observer.state()
    assert node not in state.participants and node not in state.last_heartbeats


@pytest.mark.timeout(90)
def test_survivors_of_a_killed_node_form_the_next_round(run: Run) -> None:
    """The survivors' round completes once the dead node is dropped, without waiting for
    the last call (10 minutes here: the round would outlast WAIT); before that, their
    watch says the round is over."""
    slow = {"last_call_timeout": "600"}
    survivors = [run.handler(2, 3, **slow) for _ in range(2)]
    proc, node = _spawn_node(run, **slow)
    try:
        _until(lambda: node in survivors[0].state().participants, "the child joined")
        infos = _together(*(h.next_rendezvous for h in survivors))
        assert proc.stdout is not None
        child_rank = int(proc.stdout.readline().split()[1])
        assert sorted([child_rank, *(info.rank for info in infos)]) == [0, 1, 2]
        assert {info.world_size for info in infos} == {3}
        view = survivors[0].watch()
        assert not view.round_over and view.nodes_waiting == 0 and not view.closed
        _kill(proc)
        # the agents learn from the rendezvous alone that the round lost a node
        _until(lambda: all(h.watch().round_over for h in survivors), "the round is over")
        assert survivors[1].num_nodes_waiting() >= 1
        again = _together(*(h.next_rendezvous for h in survivors))
    finally:
        _kill(proc)
    _check_round(again, 2)
    assert again[0].round == infos[0].round + 1
    _until(lambda: node not in survivors[0].state().last_heartbeats, "the node is forgotten")


@pytest.mark.timeout(60)
def test_join_timeout(run: Run) -> None:
    handler = run.handler(2, 3, join_timeout="0.5")
    with pytest.raises(RendezvousTimeoutError) as info:
        handler.next_rendezvous()
    message = str(info.value)
    assert run.run_id in message and "1 node(s) joined" in message
    assert "min 2, max 3" in message and "join_timeout" in message
    assert isinstance(info.value, TimeoutError)
    assert handler.node_id not in handler.state().participants  # it left on its way out


@pytest.mark.timeout(60)
def test_set_closed(run: Run) -> None:
    handlers = [run.handler(2, 2) for _ in range(2)]
    _together(*(h.next_rendezvous for h in handlers))
    handlers[0].set_closed()
    assert handlers[1].is_closed()
    with pytest.raises(RendezvousClosedError, match=run.run_id):
        handlers[1].next_rendezvous()
    late = run.handler(2, 2)
    with pytest.raises(RendezvousClosedError, match="use a new --rdzv_id"):
        late.next_rendezvous()


@pytest.mark.timeout(60)
def test_shutdown_leaves_the_state(run: Run) -> None:
    handlers = [run.handler(1, 2) for _ in range(2)]
    _together(*(h.next_rendezvous for h in handlers))
    assert handlers[1].shutdown() is True
    assert handlers[1].shutdown() is True  # idempotent
    state = handlers[0].state()
    assert handlers[1].node_id in state.participants  # the complete round's ranks stay
    assert handlers[1].node_id not in state.last_heartbeats
    assert handlers[0].watch().round_over  # but its member is gone
    with pytest.raises(Exception, match="shut down"):
        handlers[1].next_rendezvous()
    # alone now, the other node forms the next round by itself (min 1)
    assert handlers[0].next_rendezvous().world_size == 1


# -- c10d specifics ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_c10d_first_agent_to_arrive_hosts() -> None:
    """is_host unset and a local endpoint: every agent tries to host; one binds, the rest
    find the port taken and connect."""
    port = free_port(HOST)
    params = RendezvousParameters("c10d", f"{HOST}:{port}", "race", 2, 2, config=dict(FAST))
    handlers = [get_rendezvous_handler(params) for _ in range(2)]
    try:
        infos = _together(*(h.next_rendezvous for h in handlers))
        _check_round(infos, 2)
        assert {info.bootstrap_address for info in infos} == {(HOST, port)}
    finally:
        for handler in reversed(handlers):
            handler.shutdown()


@pytest.mark.timeout(60)
def test_c10d_port_zero_hosts_on_a_free_port() -> None:
    params = RendezvousParameters("c10d", "localhost:0", "standalone", 1, 1, config=dict(FAST))
    handler = get_rendezvous_handler(params)
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        host, port = info.bootstrap_address
        assert host == "localhost" and port != 0
        client = TCPStore(host, port, timeout=10)  # the workers can reach it there
        client.close()
    finally:
        assert handler.shutdown() is True


@pytest.mark.timeout(60)
def test_c10d_host_keeps_its_store_until_the_others_left() -> None:
    the_run = Run("c10d", "", "linger")
    host, client = the_run.handler(2, 2), the_run.handler(2, 2)
    try:
        infos = _together(host.next_rendezvous, client.next_rendezvous)
        with ThreadPoolExecutor(1) as pool:
            closing = pool.submit(host.shutdown)
            _until(lambda: host.node_id not in client.state().last_heartbeats, "the host left")
            assert not closing.done()
            infos[1].run_store.set("outcome", b"succeeded")  # the store still serves
            client.set_closed()
            assert client.shutdown() is True
            assert closing.result(WAIT) is True
    finally:
        the_run.close()


def test_c10d_explicit_host_on_a_taken_port() -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        params = RendezvousParameters(
            "c10d", f"{HOST}:{taken.getsockname()[1]}", "taken", 1, 1, config={"is_host": "true"}
        )
        with pytest.raises(RendezvousConnectionError, match="cannot host the store"):
            get_rendezvous_handler(params)


def test_c10d_unreachable_store() -> None:
    params = RendezvousParameters(
        "c10d",
        f"{HOST}:{free_port(HOST)}",
        "nobody",
        1,
        1,
        config={"is_host": "false", "read_timeout": "0.3"},
    )
    with pytest.raises(RendezvousConnectionError, match="cannot reach the store"):
        get_rendezvous_handler(params)


# -- static -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_static_one_node_on_a_free_port() -> None:
    handler = get_rendezvous_handler(RendezvousParameters("static", "", "solo", 1, 1))
    assert isinstance(handler, StaticRendezvous)
    try:
        first, second = handler.next_rendezvous(), handler.next_rendezvous()
        assert (first.rank, first.world_size, first.round, second.round) == (0, 1, 0, 1)
        host, port = first.bootstrap_address
        assert host == "127.0.0.1" and port != 0
        assert handler.num_nodes_waiting() == 0
        first.store.set("k", b"v")
        assert not second.store.check(["k"])  # a store per round
    finally:
        assert handler.shutdown() is True


@pytest.mark.timeout(60)
def test_static_two_nodes() -> None:
    port = free_port(HOST)

    def params(rank: int, **conf: str) -> RendezvousParameters:
        return RendezvousParameters(
            "static",
            "",
            "pair",
            2,
            2,
            node_rank=rank,
            master_addr=HOST,
            master_port=port,
            config={"join_timeout": "20", **conf},
        )

    node1 = get_rendezvous_handler(params(1))  # may start before node 0
    node0 = get_rendezvous_handler(params(0))
    try:
        for expected_round in (0, 1):
            infos = _together(node1.next_rendezvous, node0.next_rendezvous)
            assert [(i.rank, i.world_size, i.round) for i in infos] == [
                (1, 2, expected_round),
                (0, 2, expected_round),
            ]
            assert {i.bootstrap_address for i in infos} == {(HOST, port)}
        infos[0].run_store.set("k", b"v")
        assert infos[1].run_store.get("k") == b"v"
        node0.set_closed()
        assert node1.is_closed()
        with pytest.raises(RendezvousClosedError):
            node1.next_rendezvous()
    finally:
        node1.shutdown()
        node0.shutdown()


@pytest.mark.timeout(60)
def test_static_join_timeout() -> None:
    params = RendezvousParameters(
        "static",
        "",
        "alone",
        2,
        2,
        node_rank=0,
        master_addr=HOST,
        master_port=free_port(HOST),
        config={"join_timeout": "0.5"},
    )
    handler = get_rendezvous_handler(params)
    try:
        with pytest.raises(RendezvousTimeoutError, match="only 1 of 2 nodes"):
            handler.next_rendezvous()
    finally:
        handler.shutdown()


# -- parameters -------------------------------------------------------------------------------


def _params(
    backend: str = "c10d",
    endpoint: str = "localhost:0",
    min_nodes: int = 1,
    max_nodes: int = 1,
    **kwargs: object,
) -> RendezvousParameters:
    return RendezvousParameters(backend, endpoint, "bad", min_nodes, max_nodes, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("params", "flag"),
    [
        (_params(config={"join_timeot": "5"}), "unknown key(s) join_timeot"),
        (_params(config={"join_timeout": "-1"}), "join_timeout"),
        (_params(config={"keep_alive_max_attempt": "0"}), "keep_alive_max_attempt"),
        (_params(config={"is_host": "maybe"}), "is_host"),
        (_params(endpoint="127.0.0.1:99999"), "endpoint='127.0.0.1:99999'"),
        (_params(endpoint="127.0.0.1:0", config={"is_host": "false"}), "endpoint='127.0.0.1:0'"),
        (_params("file", ""), "endpoint='PATH'"),
        (_params("etcd", ""), "endpoint='HOST[:PORT]'"),
        (_params("static", "", 1, 4), "min_nodes=1, max_nodes=4"),
        (_params("static", "", 2, 2, master_port=29999), "no node_rank"),
        (_params("static", "", 2, 2, node_rank=2, master_port=29999), "node_rank=2"),
        (_params("static", "", 2, 2, node_rank=1), "master_port"),
        (_params("static", "", 1, 1, config={"last_cal": "1"}), "unknown key(s) last_cal"),
    ],
)
def test_bad_parameters(params: RendezvousParameters, flag: str) -> None:
    """Parameters a Python caller made: the message names the parameter, never a flag."""
    with pytest.raises(ValueError, match=re.escape(flag)) as info:
        get_rendezvous_handler(params)
    assert not re.search(r"(?<![\w-])--(rdzv|nnodes|node_rank|master_)", str(info.value))


@pytest.mark.parametrize(("min_nodes", "max_nodes"), [(3, 2), (0, 2)])
def test_bad_node_range_is_refused_when_the_parameters_are_made(
    min_nodes: int, max_nodes: int
) -> None:
    with pytest.raises(ValueError, match="min_nodes="):
        _params(min_nodes=min_nodes, max_nodes=max_nodes)


def test_unknown_conf_key_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="keep_alive_max_attempt") as info:
        get_rendezvous_handler(_params(config={"bogus": "1"}))
    assert "bogus" in str(info.value) and "join_timeout" in str(info.value)


def test_unknown_backend_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="backend='zookeeper'") as info:
        get_rendezvous_handler(_params("zookeeper"))
    for name in ("c10d", "etcd", "file", "static"):
        assert name in str(info.value)


def test_register_a_backend() -> None:
    class Named(StaticRendezvous):
        def get_backend(self) -> str:
            return "test-static"

    def factory(params: RendezvousParameters) -> RendezvousHandler:
        return Named(params.run_id, 1)

    register_rendezvous_backend("test-static", factory)
    register_rendezvous_backend("test-static", factory)  # the same again: fine
    assert "test-static" in registered_rendezvous_backends()
    handler = get_rendezvous_handler(_params("test-static"))
    assert handler.get_run_id() == "bad"
    with pytest.raises(ValueError, match="already registered"):
        register_rendezvous_backend("c10d", factory)
