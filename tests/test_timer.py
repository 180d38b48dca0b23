"""Tests of distcomm.launch.timer: real worker processes overstaying `expires` blocks get reaped."""

from __future__ import annotations

import math
import multiprocessing
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from distcomm.launch import timer
from distcomm.launch.timer import api as timer_api

WAIT = 30.0  # generous bound for anything that should happen within a second or two


# -- helpers --------------------------------------------------------------------------------


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(proc: psutil.Process, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while not _gone(proc):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _kill(proc: psutil.Process) -> None:
    try:
        if not _gone(proc):
            proc.kill()
    except psutil.NoSuchProcess:
        pass


class Children:
    """Starts Python subprocesses and, at teardown, kills and waits whatever is left."""

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen] = []
        self.others: list[psutil.Process] = []

    def python(self, code: str, timer_file: str | None = None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != timer.TIMER_FILE_ENV}
        if timer_file is not None:
            env[timer.TIMER_FILE_ENV] = timer_file
        popen = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.popens.append(popen)
        return popen

    def cleanup(self) -> None:
        for popen in self.popens:
            if popen.poll() is None:
                popen.kill()
            popen.communicate(timeout=WAIT)
        for proc in self.others:
            _kill(proc)


@pytest.fixture
def children():
    kids = Children()
    yield kids
    kids.cleanup()


def _read_line(popen: subprocess.Popen, timeout: float = WAIT) -> str:
    """One line of the child's stdout, failing (with its stderr) if none comes in time."""
    with selectors.DefaultSelector() as sel:
        sel.register(popen.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            popen.kill()
            raise AssertionError(f"child printed nothing in {timeout} s: {popen.communicate()}")
    line = popen.stdout.readline().decode()
    if not line:
        raise AssertionError(f"child exited early: {popen.wait(WAIT)}, {popen.communicate()}")
    return line.strip()


def _wait(popen: subprocess.Popen) -> int:
    try:
        return popen.wait(WAIT)
    except subprocess.TimeoutExpired:
        popen.kill()
        raise AssertionError(f"child still running after {WAIT} s: {popen.communicate()}") from None


class Recorder:
    """Collects on_expired and log_event calls from the watchdog thread."""

    def __init__(self) -> None:
        self.expired: list[tuple[int, str, float]] = []
        self.events: list[tuple[str, timer.FileTimerRequest | None]] = []
        self.called = threading.Event()

    def on_expired(self, pid: int, scope_id: str, expiration_time: float) -> None:
        self.expired.append((pid, scope_id, expiration_time))
        self.called.set()

    def log_event(self, name: str, request: timer.FileTimerRequest | None) -> None:
        self.events.append((name, request))


@pytest.fixture
def fifo(tmp_path):
    return str(tmp_path / "timer.fifo")


@pytest.fixture
def file_server(fifo):
    """A started FileTimerServer with a Recorder as `.recorder`; stopped at teardown."""
    recorder = Recorder()
    server = timer.FileTimerServer(
        fifo,
        run_id="test",
        max_interval=0.2,
        log_event=recorder.log_event,
        on_expired=recorder.on_expired,
    )
    server.recorder = recorder
    server.start()
    yield server
    server.stop()


class RecordingClient(timer.TimerClient):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float]] = []

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self.calls.append(("acquire", scope_id, expiration_time))

    def release(self, scope_id: str) -> None:
        self.calls.append(("release", scope_id, -1))


# -- multiprocessing-queue timers: worker functions (spawned, so module level) --------------


def _overstay(mp_queue) -> None:
    timer.configure(timer.LocalTimerClient(mp_queue))
    with timer.expires(after=0.5):
        time.sleep(60)


def _finish_in_time(mp_queue) -> None:
    timer.configure(timer.LocalTimerClient(mp_queue))
    with timer.expires(after=30):
        pass


def _hold_one_of_two(mp_queue, entered, proceed) -> None:
    timer.configure(timer.LocalTimerClient(mp_queue))
    with timer.expires(after=30, scope="released"):
        pass
    with timer.expires(after=30, scope="held"):
        entered.set()
        proceed.wait(60)


def _overstay_with_grandchild(mp_queue, pids) -> None:
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pids.put(grandchild.pid)
    timer.configure(timer.LocalTimerClient(mp_queue))
    with timer.expires(after=0.5, scope="tree"):
        time.sleep(60)


@pytest.fixture
def spawn():
    return multiprocessing.get_context("spawn")


@pytest.fixture
def local_server(spawn):
    mp_queue = spawn.Queue()
    server = timer.LocalTimerServer(mp_queue, max_interval=0.2)
    server.queue = mp_queue
    yield server
    server.stop()
    mp_queue.close()


def _join(process) -> int:
    process.join(WAIT)
    if process.is_alive():
        process.kill()
        process.join(WAIT)
        raise AssertionError(f"worker {process.pid} still running after {WAIT} s")
    return process.exitcode


# -- multiprocessing-queue timers -----------------------------------------------------------


@pytest.mark.timeout(60)
def test_local_worker_overstaying_is_killed(spawn, local_server):
    local_server.start()
    worker = spawn.Process(target=_overstay, args=(local_server.queue,))
    worker.start()
    assert _join(worker) == -signal.SIGKILL


@pytest.mark.timeout(60)
def test_local_worker_finishing_in_time_is_not_killed(spawn, local_server):
    local_server.start()
    worker = spawn.Process(target=_finish_in_time, args=(local_server.queue,))
    worker.start()
    assert _join(worker) == 0


@pytest.mark.timeout(60)
def test_local_run_once_registers_and_releases(spawn, local_server):
    entered, proceed = spawn.Event(), spawn.Event()
    worker = spawn.Process(target=_hold_one_of_two, args=(local_server.queue, entered, proceed))
    worker.start()
    try:
        assert entered.wait(WAIT)
        deadline = time.monotonic() + WAIT
        while worker.pid not in local_server.get_expired_timers(math.inf):
            assert time.monotonic() < deadline, "the worker's timer never registered"
            local_server.run_once()
        held = local_server.get_expired_timers(math.inf)[worker.pid]
        assert [t.scope_id for t in held] == ["held"]
        assert local_server.get_expired_timers(time.time()) == {}
    finally:
        proceed.set()
    assert _join(worker) == 0


@pytest.mark.timeout(60)
def test_local_reaping_kills_the_whole_process_tree(spawn, local_server, children):
    local_server.start()
    pids = spawn.Queue()
    worker = spawn.Process(target=_overstay_with_grandchild, args=(local_server.queue, pids))
    worker.start()
    try:
        grandchild = psutil.Process(pids.get(timeout=WAIT))
        children.others.append(grandchild)
        assert _join(worker) == -signal.SIGKILL
        assert _wait_gone(grandchild), "the worker's child survived the reaping"
    finally:
        pids.close()


@pytest.mark.timeout(60)
def test_local_server_stops_promptly_and_leaves_no_thread(local_server):
    server = timer.LocalTimerServer(local_server.queue, max_interval=60)
    watchdog = _started_threads(server.start, "-watchdog")
    server.start()  # running already: tolerated, as torch's, and no second thread
    assert server._thread is watchdog[0]
    server.stop()
    server.stop()
    assert not [t for t in watchdog if t.is_alive()]


def _started_threads(start, suffix: str) -> list[threading.Thread]:
    """The threads named ...`suffix` that `start()` started (one, checked), and only
    those: a check of all the process's threads would judge other tests' too."""
    before = set(threading.enumerate())
    start()
    started = [t for t in threading.enumerate() if t not in before and t.name.endswith(suffix)]
    assert len(started) == 1, [t.name for t in threading.enumerate()]
    return started


# -- named-pipe timers ----------------------------------------------------------------------


STUCK = """
    import time
    from distcomm.launch import timer
    with timer.expires(after=0.5, scope="stuck"):
        time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_file_worker_overstaying_is_killed_and_reported(file_server, children):
    worker = children.python(STUCK, timer_file=file_server.file_path)
    assert _wait(worker) == -signal.SIGKILL
    recorder = file_server.recorder
    assert recorder.called.wait(WAIT)
    [(pid, scope, expiration)] = recorder.expired
    assert (pid, scope) == (worker.pid, "stuck")
    assert expiration > 0
    deadline = time.monotonic() + WAIT  # "kill worker process" comes once the kill is seen
    while len(recorder.events) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    names = [name for name, _ in recorder.events]
    assert names == ["watchdog started", "timer expired", "kill worker process"]
    for _, request in recorder.events[1:]:
        assert (request.worker_pid, request.scope_id) == (worker.pid, "stuck")


@pytest.mark.timeout(60)
def test_file_worker_releasing_in_time_is_not_killed(file_server, children):
    worker = children.python(
        """
        from distcomm.launch import timer
        with timer.expires(after=30, scope="quick"):
            pass
        print("done", flush=True)
        """,
        timer_file=file_server.file_path,
    )
    assert _read_line(worker) == "done"
    assert _wait(worker) == 0
    assert file_server.recorder.expired == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (
            """
            with timer.expires(after=1, scope="outer"):
                with timer.expires(after=30, scope="inner"):
                    pass
                time.sleep(60)
            """,
            ["outer"],
        ),
        (
            """
            with timer.expires(after=30, scope="outer"):
                with timer.expires(after=0.5, scope="inner"):
                    time.sleep(60)
            """,
            ["inner"],
        ),
    ],
    ids=["outer-expires", "inner-expires"],
)
def test_file_nested_scopes(file_server, children, code, expected):
    code = "import time\nfrom distcomm.launch import timer\n" + textwrap.dedent(code)
    worker = children.python(code, timer_file=file_server.file_path)
    assert _wait(worker) == -signal.SIGKILL
    assert file_server.recorder.called.wait(WAIT)
    assert [scope for _, scope, _ in file_server.recorder.expired] == expected


@pytest.mark.timeout(60)
def test_file_run_once_drives_the_watchdog(fifo, children):
    recorder = Recorder()
    server = timer.FileTimerServer(fifo, "test", max_interval=0.2, on_expired=recorder.on_expired)
    try:
        worker = children.python(
            """
            import time
            from distcomm.launch import timer
            with timer.expires(after=30, scope="outer"):
                with timer.expires(after=1, scope="soon"):
                    print("in", flush=True)
                    time.sleep(60)
            """,
            timer_file=fifo,
        )
        assert _read_line(worker) == "in"
        server.run_once()
        held = server.get_expired_timers(math.inf)[worker.pid]
        assert [t.scope_id for t in held] == ["soon", "outer"]
        deadline = time.monotonic() + WAIT
        while worker.poll() is None:
            assert time.monotonic() < deadline, "run_once never reaped the worker"
            server.run_once()
        assert _wait(worker) == -signal.SIGKILL
        assert [(pid, scope) for pid, scope, _ in recorder.expired] == [(worker.pid, "soon")]
        server.run_once()
        assert server.get_expired_timers(math.inf) == {}
    finally:
        server.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("ignore_sigterm", "exit_signal"),
    [(False, signal.SIGTERM), (True, signal.SIGKILL)],
    ids=["terminates", "ignores-sigterm"],
)
def test_file_signal_other_than_sigkill_escalates(fifo, children, ignore_sigterm, exit_signal):
    server = timer.FileTimerServer(fifo, "test", max_interval=0.2)
    server.reap_grace_period = 0.5
    server.start()
    try:
        worker = children.python(
            f"""
            import signal, time
            from distcomm.launch import timer
            if {ignore_sigterm}:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            timer.configure(timer.FileTimerClient({fifo!r}, signal=signal.SIGTERM))
            with timer.expires(after=0.5, scope="term"):
                time.sleep(60)
            """
        )
        assert _wait(worker) == -exit_signal
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_file_server_drops_malformed_requests_and_dead_pids(fifo):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(WAIT)
    server = timer.FileTimerServer(fifo, "test", max_interval=0.2)
    try:
        far = time.time() + 3600
        lines = [
            b"not json\n",
            b"[1, 2]\n",
            b'{"version": 99, "pid": 1, "scope_id": "x", "expiration_time": 1, "signal": 9}\n',
            b'{"version": 1, "pid": -5, "scope_id": "x", "expiration_time": 1, "signal": 9}\n',
            b'{"version": 1, "pid": 1, "scope_id": "x", "expiration_time": 1, "signal": 12345}\n',
            timer.FileTimerRequest(dead.pid, "dead", far, 9).to_json().encode() + b"\n",
            timer.FileTimerRequest(os.getpid(), "myself", far, 9).to_json().encode() + b"\n",
        ]
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            for line in lines:
                os.write(fd, line)
        finally:
            os.close(fd)
        server.run_once()
        assert server.get_expired_timers(math.inf) == {}
    finally:
        server.stop()


def test_file_request_round_trips_through_json():
    request = timer.FileTimerRequest(1234, "scope ü", 12.5, int(signal.SIGTERM))
    assert timer.FileTimerRequest.from_json(request.to_json()) == request
    release = timer.FileTimerRequest(1234, "scope", -1, 0)
    assert timer.FileTimerRequest.from_json(release.to_json()).is_release


# -- server lifecycle -----------------------------------------------------------------------


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
@pytest.mark.timeout(60)
def test_file_server_stop_removes_pipe_thread_and_descriptors(fifo):
    before = _open_fds()
    server = timer.FileTimerServer(fifo, "test", max_interval=60)
    assert os.path.exists(fifo)
    watchdog = _started_threads(server.start, "FileTimerServer-watchdog")
    server.stop()
    server.stop()
    assert not os.path.exists(fifo)
    assert not [t for t in watchdog if t.is_alive()]
    assert _open_fds() == before
    with pytest.raises(RuntimeError, match="stopped"):
        server.run_once()
    with pytest.raises(RuntimeError, match="stopped"):
        server.start()


def test_file_server_reuses_a_stale_pipe(fifo):
    os.mkfifo(fifo)
    server = timer.FileTimerServer(fifo, "test", max_interval=1)
    server.stop()
    assert not os.path.exists(fifo)


def test_file_server_refuses_a_pipe_in_use_and_other_files(fifo, tmp_path):
    server = timer.FileTimerServer(fifo, "test", max_interval=1)
    try:
        with pytest.raises(FileExistsError, match="in use by another timer server"):
            timer.FileTimerServer(fifo, "test", max_interval=1)
    finally:
        server.stop()
    regular = tmp_path / "regular"
    regular.write_text("keep me")
    with pytest.raises(FileExistsError, match="not a named pipe"):
        timer.FileTimerServer(str(regular), "test", max_interval=1)
    assert regular.read_text() == "keep me"


def test_file_server_rejects_bad_max_interval_without_leaving_a_pipe(fifo):
    with pytest.raises(ValueError, match="max_interval"):
        timer.FileTimerServer(fifo, "test", max_interval=0)
    assert not os.path.exists(fifo)


# -- expires / configure / clients: arguments -----------------------------------------------


def test_expires_acquires_on_entry_and_releases_on_exit_nested():
    client = RecordingClient()
    with (
        timer.expires(after=5, scope="outer", client=client),
        pytest.raises(KeyError),
        timer.expires(after=1, scope="inner", client=client),
    ):
        raise KeyError("released anyway")
    assert [(op, scope) for op, scope, _ in client.calls] == [
        ("acquire", "outer"),
        ("acquire", "inner"),
        ("release", "inner"),
        ("release", "outer"),
    ]
    assert client.calls[0][2] > time.time()


def test_expires_default_scope_is_the_callers_file_and_line():
    client = RecordingClient()
    line = sys._getframe().f_lineno + 1
    with timer.expires(after=5, client=client):
        pass
    assert client.calls[0][1] == f"{__file__}:{line}"


@pytest.mark.parametrize("after", [0, -1, math.nan, math.inf])
def test_expires_rejects_bad_durations(after):
    with pytest.raises(ValueError, match="after"):
        timer.expires(after=after, client=RecordingClient())


@pytest.mark.parametrize("after", ["1", None, True])
def test_expires_rejects_non_numbers(after):
    with pytest.raises(TypeError, match="after"):
        timer.expires(after=after, client=RecordingClient())


def test_expires_without_a_client_says_what_to_do(monkeypatch):
    monkeypatch.setattr(timer_api, "_timer_client", None)
    monkeypatch.delenv(timer.TIMER_FILE_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"configure\(client\).*distcomm-run"):
        timer.expires(after=1)


def test_expires_configures_a_file_client_from_the_environment(monkeypatch, fifo):
    monkeypatch.setattr(timer_api, "_timer_client", None)
    monkeypatch.setenv(timer.TIMER_FILE_ENV, fifo)
    timer.expires(after=1, scope="unused")
    assert isinstance(timer_api._timer_client, timer.FileTimerClient)
    assert timer_api._timer_client.file_path == fifo


def test_configure_rejects_non_clients(monkeypatch):
    monkeypatch.setattr(timer_api, "_timer_client", None)
    with pytest.raises(TypeError, match="TimerClient"):
        timer.configure("not a client")


def test_file_client_rejects_a_scope_too_long_for_one_pipe_write(fifo):
    client = timer.FileTimerClient(fifo)
    with pytest.raises(ValueError, match=r"too long.*PIPE_BUF"):
        client.acquire("x" * 5000, time.time() + 5)


def test_file_client_without_a_server_fails_clearly(fifo):
    client = timer.FileTimerClient(fifo, timeout=0.2)
    with pytest.raises(timer.TimerServerUnavailableError, match="does not exist"):
        client.acquire("scope", time.time() + 5)
    os.mkfifo(fifo)
    with pytest.raises(timer.TimerServerUnavailableError, match="no server has the pipe open"):
        client.release("scope")


def test_file_client_rejects_bad_arguments(fifo):
    with pytest.raises(ValueError, match="signal"):
        timer.FileTimerClient(fifo, signal=12345)
    with pytest.raises(ValueError, match="timeout"):
        timer.FileTimerClient(fifo, timeout=-1)


def test_local_server_rejects_bad_max_interval(spawn):
    with pytest.raises(ValueError, match="max_interval"):
        timer.LocalTimerServer(spawn.Queue(), max_interval=-1)
