"""distcomm.launch.timer against torch.distributed.elastic.timer: names, signatures, semantics."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from distcomm.launch import timer

WAIT = 60.0  # bound for things that take a second or two (a child importing torch: more)

_SUBMODULES = ("api", "file_based_local_timer", "local_timer", "debug_info_logging")


@pytest.fixture
def fifo(tmp_path):
    return str(tmp_path / "timer.fifo")


@pytest.fixture
def sleeper():
    """A child process that sleeps until killed; killed and waited at teardown."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(WAIT)


class Events:
    def __init__(self) -> None:
        self.events: list[tuple[str, timer.FileTimerRequest | None]] = []
        self.expired: list[tuple[int, str, float]] = []

    def log_event(self, name: str, request: timer.FileTimerRequest | None) -> None:
        self.events.append((name, request))

    def on_expired(self, pid: int, scope_id: str, expiration_time: float) -> None:
        self.expired.append((pid, scope_id, expiration_time))

    def names(self) -> list[str]:
        return [name for name, _ in self.events]


def _server(fifo: str, events: Events) -> timer.FileTimerServer:
    return timer.FileTimerServer(
        fifo, "run", max_interval=0.2, log_event=events.log_event, on_expired=events.on_expired
    )


# -- behaviour of the names torch has ---------------------------------------------------------


def test_file_timer_request_takes_torchs_fields():
    request = timer.FileTimerRequest(worker_pid=12, scope_id="s", expiration_time=5.0)
    assert (request.worker_pid, request.worker_id, request.scope_id) == (12, 12, "s")
    assert request.signal == 0 and request.version == 1 and not request.reaps
    assert timer.FileTimerRequest(12, "s", 5.0, signal.SIGTERM).reaps
    line = request.to_json()
    assert isinstance(line, str) and "\n" not in line
    assert json.loads(line) == {
        "version": 1,
        "pid": 12,
        "scope_id": "s",
        "expiration_time": 5.0,
        "signal": 0,
    }
    assert timer.FileTimerRequest.from_json(line) == request
    assert timer.FileTimerRequest(12, "s", 5.0) != timer.FileTimerRequest(12, "s", 5.0, 9)


def test_a_timer_without_signal_is_reported_not_reaped(fifo, sleeper):
    events = Events()
    server = _server(fifo, events)
    try:
        server.register_timers([timer.FileTimerRequest(sleeper.pid, "report-only", 1.0)])
        server.run_once()
        assert sleeper.poll() is None  # still running
        assert server.get_expired_timers(math.inf) == {}  # the expired timer is dropped
        assert events.names() == ["timer expired"]
        assert events.events[0][1].scope_id == "report-only"
        assert events.expired == []  # on_expired is for timers that reap
    finally:
        server.stop()
    assert events.names()[-1] == "watchdog stopped"


def test_the_first_expired_timer_with_a_signal_reaps(fifo, sleeper):
    events = Events()
    server = _server(fifo, events)
    try:
        server.register_timers(
            [
                timer.FileTimerRequest(sleeper.pid, "no-signal", 1.0, 0),
                timer.FileTimerRequest(sleeper.pid, "term", 2.0, int(signal.SIGTERM)),
                timer.FileTimerRequest(sleeper.pid, "later", time.time() + 3600, 9),
            ]
        )
        server.run_once()
        assert sleeper.wait(WAIT) == -signal.SIGTERM
        assert [scope for _, scope, _ in events.expired] == ["term"]
        assert [(n, r.scope_id) for n, r in events.events] == [
            ("timer expired", "no-signal"),
            ("timer expired", "term"),
            ("kill worker process", "term"),
        ]
        assert server.get_expired_timers(math.inf) == {}  # the reaped worker's timers go
    finally:
        server.stop()


def test_is_process_running(sleeper):
    assert timer.FileTimerServer.is_process_running(os.getpid())
    assert timer.FileTimerServer.is_process_running(sleeper.pid)
    sleeper.kill()
    deadline = time.monotonic() + WAIT  # a zombie (not yet waited) has exited too
    while timer.FileTimerServer.is_process_running(sleeper.pid):
        assert time.monotonic() < deadline, "killed child still counted as running"
        time.sleep(0.02)
    sleeper.wait(WAIT)
    assert not timer.FileTimerServer.is_process_running(sleeper.pid)
    with pytest.raises(ValueError, match="process groups"):
        timer.FileTimerServer.is_process_running(0)
    with pytest.raises(TypeError, match="pid must be an int"):
        timer.FileTimerServer.is_process_running("1")  # type: ignore[arg-type]


def test_get_last_progress_time(fifo):
    server = timer.FileTimerServer(fifo, "run", max_interval=0.05)
    try:
        before = int(time.time())
        first = server.get_last_progress_time()
        assert isinstance(first, int) and before <= first <= int(time.time())  # no step yet
        before = int(time.time())
        server.run_once()
        after = int(time.time())
        progress = server.get_last_progress_time()
        assert isinstance(progress, int) and before <= progress <= after
    finally:
        server.stop()


def test_file_timer_client_signal_attribute_and_checks(fifo):
    assert timer.FileTimerClient(fifo).signal == signal.SIGKILL
    assert timer.FileTimerClient(fifo, signal.SIGTERM).signal == signal.SIGTERM
    assert timer.FileTimerClient(fifo, 0).signal == 0  # torch: report only
    assert timer.FileTimerClient(fifo, -1).signal == -1
    with pytest.raises(TypeError, match="signal must be a signal number"):
        timer.FileTimerClient(fifo, "SIGTERM")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="or 0 to have expiries reported"):
        timer.FileTimerClient(fifo, 12345)


def test_client_without_server_raises_broken_pipe_error(fifo):
    with pytest.raises(BrokenPipeError):  # what torch's FileTimerClient raises
        timer.FileTimerClient(fifo, timeout=0.1).acquire("s", time.time() + 5)


def test_log_debug_info_for_expired_timers(caplog):
    with caplog.at_level(logging.INFO, logger="distcomm.launch.timer.debug_info_logging"):
        timer.log_debug_info_for_expired_timers("run-7", {})
        assert caplog.records == []
        timer.log_debug_info_for_expired_timers("run-7", {12: ['{"scope_id": "x"}']})
    [rec] = caplog.records
    assert "run-7" in rec.getMessage() and "12" in rec.getMessage()


# -- torch, where it is installed ---------------------------------------------------------------


def _torch_timer():
    return pytest.importorskip("torch.distributed.elastic.timer")


def _torch_names() -> list[tuple[str, str]]:
    try:
        importlib.import_module("torch.distributed.elastic.timer")
    except ImportError:
        return []
    names = []
    for sub in _SUBMODULES:
        mod = importlib.import_module(f"torch.distributed.elastic.timer.{sub}")
        names += [(sub, name) for name in mod.__all__]
    return names


def _check_signature(ours, theirs, what: str) -> None:
    """torch's parameters come first, same names, kinds and defaults; ours may add
    keyword-only parameters with defaults."""
    mine = list(inspect.signature(ours).parameters.values())
    torch_params = list(inspect.signature(theirs).parameters.values())
    assert [(p.name, p.kind, p.default) for p in mine[: len(torch_params)]] == [
        (p.name, p.kind, p.default) for p in torch_params
    ], what
    for extra in mine[len(torch_params) :]:
        assert extra.kind is inspect.Parameter.KEYWORD_ONLY, f"{what}: {extra.name}"
        assert extra.default is not inspect.Parameter.empty, f"{what}: {extra.name}"


@pytest.mark.parametrize(
    ("sub", "name"), _torch_names() or [pytest.param("", "", marks=pytest.mark.skip("no torch"))]
)
def test_signature_matches_torch(sub, name):
    theirs = getattr(importlib.import_module(f"torch.distributed.elastic.timer.{sub}"), name)
    ours = getattr(importlib.import_module(f"distcomm.launch.timer.{sub}"), name)
    assert getattr(timer, name) is ours  # also at the package's top level
    _check_signature(ours, theirs, name)
    if not inspect.isclass(theirs):
        return
    for attr, value in vars(theirs).items():
        if attr.startswith("_") and attr != "__init__":
            continue
        if attr in getattr(theirs, "__slots__", ()):  # a data attribute: one of our fields
            assert attr in {f.name for f in dataclasses.fields(ours)}, f"{name}.{attr}"
            continue
        assert hasattr(ours, attr), f"{name}.{attr} missing"
        if isinstance(value, property):
            assert isinstance(inspect.getattr_static(ours, attr), property), f"{name}.{attr}"
        elif callable(value) or isinstance(value, staticmethod):
            _check_signature(getattr(ours, attr), getattr(theirs, attr), f"{name}.{attr}")


def test_package_has_torchs_names():
    torch_timer = _torch_timer()
    star: dict[str, object] = {}
    exec("from torch.distributed.elastic.timer import *", star)
    wanted = {n for n in star if not n.startswith("_") and not inspect.ismodule(star[n])}
    assert wanted <= set(timer.__all__)
    for sub in _SUBMODULES:  # torch's submodules, by the same names
        assert hasattr(torch_timer, sub)
        importlib.import_module(f"distcomm.launch.timer.{sub}")


def test_torch_request_line_parses_here():
    torch_timer = _torch_timer()
    theirs = torch_timer.FileTimerRequest(4321, "scope", 12.5, signal.SIGTERM)
    assert timer.FileTimerRequest.from_json(theirs.to_json()) == timer.FileTimerRequest(
        4321, "scope", 12.5, signal.SIGTERM
    )


@pytest.mark.timeout(180)
def test_torch_client_is_reaped_by_our_server(fifo):
    """A worker using torch's FileTimerClient overstays and our FileTimerServer reaps it."""
    _torch_timer()
    events = Events()
    server = _server(fifo, events)
    code = textwrap.dedent(
        f"""
        import time
        from torch.distributed.elastic.timer import FileTimerClient, configure, expires
        configure(FileTimerClient({fifo!r}))
        with expires(after=1, scope="torch-stuck"):
            time.sleep(600)
        """
    )
    server.start()
    worker = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert worker.wait(WAIT * 2) == -signal.SIGKILL
        assert [(pid, scope) for pid, scope, _ in events.expired] == [(worker.pid, "torch-stuck")]
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(WAIT)
        server.stop()
