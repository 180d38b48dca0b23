"""Timers and error files behave as torch's: the differences that torch's own tests
(test/distributed/elastic/timer and .../multiprocessing/errors) found, one test each."""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import pytest

from distcomm.launch import timer
from distcomm.launch.errors import ChildFailedError, ErrorHandler, ProcessFailure, record
from distcomm.launch.timer import api as timer_api
from distcomm.launch.timer.api import RequestQueue, TimerRequest, TimerServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def no_env_error_file(monkeypatch):
    monkeypatch.delenv("DISTCOMM_ERROR_FILE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)


# -- timers ---------------------------------------------------------------------------------


class _Recorder(timer.TimerClient):
    def acquire(self, scope_id, expiration_time):
        pass

    def release(self, scope_id):
        pass


def test_configure_none_unsets_the_client(monkeypatch):
    monkeypatch.setattr(timer_api, "_timer_client", None)
    monkeypatch.delenv(timer.TIMER_FILE_ENV, raising=False)
    timer.configure(_Recorder())
    with timer.expires(after=1):
        pass
    timer.configure(None)
    assert timer_api._timer_client is None
    with pytest.raises(RuntimeError, match=r"configure\(client\)"):
        timer.expires(after=1)
    with pytest.raises(TypeError, match=r"TimerClient.*or None"):
        timer.configure("not a client")


class _Queue(RequestQueue):
    def __init__(self, requests=()):
        self.requests = list(requests)
        self.gets: list[tuple[int, float]] = []

    def size(self):
        return len(self.requests)

    def get(self, size, timeout):
        self.gets.append((size, timeout))
        taken, self.requests = self.requests[:size], self.requests[size:]
        return taken


class _Server(TimerServer):
    """Worker 1's reap raises, 2's succeeds, 3's fails; each has two expired timers."""

    def __init__(self, queue, max_interval=1):
        super().__init__(queue, max_interval)
        self.registered: list[TimerRequest] = []
        self.cleared: list[set] = []
        self.reap_calls: list[int] = []

    def register_timers(self, timer_requests):
        self.registered += timer_requests

    def clear_timers(self, worker_ids):
        self.cleared.append(set(worker_ids))

    def get_expired_timers(self, deadline):
        return {i: [TimerRequest(i, f"s{i}_{n}", 1) for n in (0, 1)] for i in (1, 2, 3)}

    def _reap_worker(self, worker_id):
        self.reap_calls.append(worker_id)
        if worker_id == 1:
            raise RuntimeError("reaping failed loudly")
        return worker_id == 2


def test_a_reap_that_raises_is_logged_and_the_others_are_reaped(caplog):
    queue = _Queue([TimerRequest(1, "a", 5), TimerRequest(2, "b", 5)])
    server = _Server(queue)
    with caplog.at_level(logging.ERROR, logger="distcomm.launch.timer.api"):
        server._run_watchdog()  # torch's name for one step; run_once is the same step
    assert queue.gets == [(2, 1)]
    assert [r.scope_id for r in server.registered] == ["a", "b"]
    assert server.reap_calls == [1, 2, 3]
    # as torch's: a reap that raised counts as done (its timers go); a False reap is retried
    assert server.cleared == [{1, 2}]
    assert "reaping failed loudly" in caplog.text and "could not reap worker 3" in caplog.text


def test_the_background_loop_goes_on_after_a_reap_that_raises():
    server = _Server(_Queue(), max_interval=0.01)
    server.start()
    try:
        deadline = time.monotonic() + 30
        while server.reap_calls.count(3) < 2 and time.monotonic() < deadline:
            server._stop_requested.wait(0.01)
    finally:
        server.stop()
    assert server.reap_calls.count(3) >= 2 and server.reap_calls.count(1) >= 2


def test_start_on_a_running_server_is_tolerated(tmp_path):
    events = []
    server = timer.FileTimerServer(
        str(tmp_path / "pipe"), "run", max_interval=0.05, log_event=lambda n, r: events.append(n)
    )
    try:
        server.start()
        thread = server._thread
        server.start()  # torch's tests start a started server: no error, no second thread
        assert server._thread is thread and thread.is_alive()
        assert events == ["watchdog started"]
    finally:
        server.stop()
    assert not thread.is_alive() and not (tmp_path / "pipe").exists()
    assert events == ["watchdog started", "watchdog stopped"]


def test_the_loop_steps_through_run_watchdog(tmp_path):
    """torch's tests count the loop's steps by wrapping `_run_watchdog` on the instance."""
    server = timer.FileTimerServer(str(tmp_path / "pipe"), "run", max_interval=0.01)
    steps = []
    step = server._run_watchdog

    def counted():
        steps.append(1)
        step()

    server._run_watchdog = counted
    try:
        server.start()
        client = timer.FileTimerClient(str(tmp_path / "pipe"))
        client._send_request(timer.FileTimerRequest(os.getpid() + 10**7, "x", -1))
        deadline = time.monotonic() + 30
        while len(steps) < 3 and time.monotonic() < deadline:
            server._stop_requested.wait(0.01)
    finally:
        server.stop()
    assert len(steps) >= 3


# -- error files ----------------------------------------------------------------------------


def _raises_child_failure(error_file: str):
    @record
    def agent_main():
        raise ChildFailedError("trainer", {0: ProcessFailure(0, 997, 1, error_file)})

    return agent_main


def test_record_writes_nothing_when_the_child_recorded_nothing(tmp_path, monkeypatch, caplog):
    parent = tmp_path / "parent.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(parent))
    monkeypatch.delenv("DISTCOMM_ERROR_FILE", raising=False)
    # the logger's own level: an earlier test may have set the package's
    with (
        caplog.at_level(logging.INFO, logger="distcomm.launch.errors.api"),
        pytest.raises(ChildFailedError),
    ):
        _raises_child_failure("")()
    assert not parent.exists()
    assert "no error file to pass on" in caplog.text and "@record" in caplog.text

    child = tmp_path / "child.json"  # with a child record, it is passed on as before
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(child))
    ErrorHandler().record_exception(ValueError("deep down"))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(parent))
    with pytest.raises(ChildFailedError):
        _raises_child_failure(str(child))()
    expected = json.loads(child.read_text())
    expected["message"]["errorCode"] = 1
    assert json.loads(parent.read_text()) == expected


def test_process_failure_without_an_error_file_says_n_a(tmp_path):
    for given in ("", str(tmp_path / "never-written.json")):
        failure = ProcessFailure(local_rank=0, pid=997, exitcode=-signal.SIGSEGV, error_file=given)
        assert failure.error_file == "<N/A>"
        assert failure.signal_name() == "SIGSEGV"
        assert "error_file: <N/A>" in ChildFailedError("t", {0: failure}).format_msg()
    hidden = ProcessFailure(0, 997, 1, "", files_kept=False)  # nothing to hide: still <N/A>
    assert "error_file: <N/A>" in ChildFailedError("t", {0: hidden}).format_msg()


def test_process_failure_timestamp_is_an_int(tmp_path, no_env_error_file, monkeypatch):
    path = tmp_path / "error.json"
    for data in ({"message": "c++ error", "timestamp": 10}, {"message": "x", "timestamp": "10"}):
        path.write_text(json.dumps(data))
        failure = ProcessFailure(0, 997, 1, str(path))
        assert failure.timestamp == 10 and type(failure.timestamp) is int
        assert failure.message == data["message"]
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    ErrorHandler().record_exception(ValueError("recorded"))
    failure = ProcessFailure(0, 997, 1, str(path))
    assert str(failure.timestamp) == failure.error_file_data["message"]["extraInfo"]["timestamp"]
    observed = ProcessFailure(0, 997, 1, timestamp=1_700_000_000.75)
    assert observed.timestamp == 1_700_000_000 and type(observed.timestamp) is int

    # the root cause is still chosen on the finer time: rank 1 failed 0.25 s before rank 0
    early = ProcessFailure(1, 998, 1, rank=1, timestamp=1_700_000_000.5)
    assert ChildFailedError("t", {0: observed, 1: early}).get_first_failure()[0] == 1
    remote = ProcessFailure.from_record(json.loads(json.dumps(early.to_record())))
    assert ChildFailedError("t", {0: observed, 1: remote}).get_first_failure()[0] == 1
    with pytest.raises(TypeError, match="timestamp"):
        ProcessFailure(0, 997, 1, timestamp="10")


def test_an_error_file_without_message_is_refused(tmp_path):
    path = tmp_path / "error.json"
    for data in ({"unknown_key": "unknown_value"}, ["message"]):
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=r"error\.json.*no 'message' field.*@record"):
            ProcessFailure(local_rank=0, pid=997, exitcode=1, error_file=str(path))
    path.write_text("{half a fi")  # not JSON (a writer killed mid-write): reported, not refused
    assert "unreadable" in ProcessFailure(0, 997, 1, str(path)).message


def test_record_returns_none_on_system_exit_zero(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTCOMM_ERROR_FILE", str(tmp_path / "error.json"))

    @record
    def main(code):
        raise SystemExit(code)

    assert main(0) is None
    for code in (1, None, "bye"):
        with pytest.raises(SystemExit):
            main(code)
    assert not (tmp_path / "error.json").exists()


def test_errors_has_torchs_submodules():
    """A port that rewrites only the package prefix finds torch's submodules."""
    from distcomm.launch.errors import error_handler, handlers

    assert error_handler.ErrorHandler is ErrorHandler
    assert isinstance(handlers.get_error_handler(), ErrorHandler)


def test_a_worker_error_file_without_message_is_reported_not_fatal_to_the_launcher(tmp_path):
    """ProcessFailure refuses an error file without "message", as torch's does; the agent
    then reports the worker's exit and that the file was not an error handler's."""
    from tests.launchjobs import run_launcher, script

    worker = script(
        tmp_path / "worker.py",
        """
        import json, os, sys
        path = os.environ["TORCHELASTIC_ERROR_FILE"]
        with open(path, "w") as fp:
            json.dump({"not": "an error record"}, fp)
        sys.exit(3)
    """,
    )
    done = run_launcher(["--nproc-per-node", "1", "--max-restarts", "0", str(worker)], tmp_path)
    assert done.returncode != 0, done
    assert "has no 'message' field" in done.stderr, done.stderr
    assert "exit code 3" in done.stderr or "exitcode: 3" in done.stderr, done.stderr
    assert "Traceback (most recent call last)" not in done.stderr.split("Root Cause")[0], (
        done.stderr
    )
