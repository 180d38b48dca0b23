"""distcomm.multiprocessing.spawn: real processes through spawn, forkserver and fork."""

from __future__ import annotations

import gc
import importlib
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from distcomm.multiprocessing.spawn import (
    ProcessContext,
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    spawn,
    start_processes,
)
from tests import processes

ROOT = Path(__file__).resolve().parent.parent
METHODS = [
    m for m in ("spawn", "forkserver", "fork") if m in multiprocessing.get_all_start_methods()
]
linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only"
)

#: cmdline marks of the helpers multiprocessing keeps for the whole session
_SESSION_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


# ------------------------------------------------------------- functions the children run


def _write_result(i: int, out: str, base: int) -> None:
    proc = multiprocessing.current_process()
    record = {"i": i, "value": base + i * i, "pid": os.getpid(), "daemon": proc.daemon}
    _write_atomic(Path(out, f"{i}.json"), json.dumps(record))


def _write_atomic(path: Path, text: str) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _raise_or_sleep(i: int, bad: int) -> None:
    if i == bad:
        raise ValueError(f"boom from process {i}")
    time.sleep(120)


def _exit_or_sleep(i: int, bad: int, how: str) -> None:
    if i == bad:
        if how == "os._exit":
            os._exit(3)
        sys.exit(3)
    time.sleep(120)


def _sigkill_or_sleep(i: int, bad: int) -> None:
    if i == bad:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


def _keyboard_interrupt(i: int) -> None:
    raise KeyboardInterrupt


def _wait_for_go(i: int, out: str) -> None:
    go = Path(out, "go")
    while not go.exists():  # the test holds the children here to see join(timeout) time out
        time.sleep(0.01)
    _write_result(i, out, 0)


def _record_pid_and_sleep(i: int, out: str) -> None:
    _write_atomic(Path(out, f"pid-{i}"), str(os.getpid()))
    time.sleep(120)


# ---------------------------------------------------------------------------- helpers


def _alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(autouse=True)
def no_process_left():
    """Fail a test that leaves a process it started running (and kill it)."""
    with processes.no_process_left(_SESSION_HELPERS):
        yield


@pytest.fixture
def temp_root(tmp_path, monkeypatch) -> Path:
    """A private system temp dir, to see what the error files leave behind."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def _error_dirs(root: Path) -> list[Path]:
    """What our contexts left in the temp dir (multiprocessing's own pymp-* dirs aside)."""
    return sorted(root.glob("distcomm-spawn-*"))


def _results(out: Path, nprocs: int) -> list[dict]:
    return [json.loads(Path(out, f"{i}.json").read_text()) for i in range(nprocs)]


def _join_all(ctx: ProcessContext) -> None:
    while not ctx.join(timeout=60):
        pass


def _wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        time.sleep(0.02)


# ------------------------------------------------------------------------------ success


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_spawn_runs_fn_with_index_and_args(tmp_path, temp_root, nprocs):
    assert spawn(_write_result, args=(str(tmp_path), 100), nprocs=nprocs) is None
    results = _results(tmp_path, nprocs)
    assert [r["value"] for r in results] == [100 + i * i for i in range(nprocs)]
    assert len({r["pid"] for r in results}) == nprocs
    assert os.getpid() not in {r["pid"] for r in results}
    assert _error_dirs(temp_root) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", METHODS)
def test_start_methods_run_and_report(tmp_path, temp_root, method):
    ctx = start_processes(
        _write_result, args=(str(tmp_path), 7), nprocs=2, join=False, start_method=method
    )
    assert isinstance(ctx, ProcessContext)
    _join_all(ctx)
    results = _results(tmp_path, 2)
    assert [r["value"] for r in results] == [7, 8]
    assert [r["pid"] for r in results] == ctx.pids()
    assert ctx.sentinels == {}
    assert ctx.join() is True  # joining a finished context again is harmless

    bad = start_processes(_raise_or_sleep, args=(1,), nprocs=2, join=False, start_method=method)
    with pytest.raises(ProcessRaisedException, match="boom from process 1") as info:
        _join_all(bad)
    assert (info.value.error_index, info.value.pid) == (1, bad.pids()[1])
    assert not _alive(bad.pids()[0])
    assert _error_dirs(temp_root) == []


@pytest.mark.timeout(60)
def test_fork_accepts_an_unpicklable_fn(tmp_path):
    out = str(tmp_path)
    spawn(lambda i, base: _write_result(i, out, base), args=(5,), nprocs=2, start_method="fork")
    assert [r["value"] for r in _results(tmp_path, 2)] == [5, 6]


@pytest.mark.timeout(60)
def test_join_with_timeout_polls_without_blocking(tmp_path, temp_root):
    ctx = start_processes(_wait_for_go, args=(str(tmp_path),), nprocs=3, join=False)
    try:
        assert ctx.join(timeout=0.2) is False  # the children wait for the go file
        assert ctx.join(timeout=0) is False
        assert len(ctx.sentinels) == 3
        assert all(_alive(pid) for pid in ctx.pids())
    finally:
        (tmp_path / "go").touch()
    rounds = 0
    while not ctx.join(timeout=5):
        rounds += 1
        assert rounds < 100, "join(timeout=5) never saw the children finish"
    assert [r["i"] for r in _results(tmp_path, 3)] == [0, 1, 2]
    assert all(p.exitcode == 0 for p in ctx.processes)
    assert _error_dirs(temp_root) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("daemon", [False, True])
def test_daemon_flag_reaches_the_children(tmp_path, daemon):
    ctx = start_processes(
        _write_result, args=(str(tmp_path), 0), nprocs=2, join=False, daemon=daemon
    )
    assert [p.daemon for p in ctx.processes] == [daemon, daemon]
    _join_all(ctx)
    assert [r["daemon"] for r in _results(tmp_path, 2)] == [daemon, daemon]


@pytest.mark.timeout(60)
def test_keyboard_interrupt_in_a_child_ends_it_quietly():
    ctx = start_processes(_keyboard_interrupt, nprocs=2, join=False)
    _join_all(ctx)
    assert [p.exitcode for p in ctx.processes] == [0, 0]


# ------------------------------------------------------------------------------ failures


@pytest.mark.timeout(60)
def test_raising_child_raises_with_its_traceback_and_the_others_are_stopped(temp_root):
    ctx = start_processes(_raise_or_sleep, args=(1,), nprocs=3, join=False)
    pids = ctx.pids()
    with pytest.raises(ProcessRaisedException) as info:
        _join_all(ctx)
    err = info.value
    assert (err.error_index, err.pid, err.error_pid) == (1, pids[1], pids[1])
    text = str(err)
    assert "Process 1 terminated with the following error" in text
    assert f"pid {pids[1]}" in text
    assert "Traceback (most recent call last)" in text
    assert "ValueError: boom from process 1" in text
    assert "_raise_or_sleep" in text
    for i in (0, 2):
        assert not _alive(pids[i]), f"process {i} survived the failure of process 1"
        assert ctx.processes[i].exitcode == -signal.SIGTERM
    assert ctx.sentinels == {}
    assert _error_dirs(temp_root) == []
    with pytest.raises(ProcessRaisedException) as again:  # later joins report the same
        ctx.join()
    assert again.value is err


@pytest.mark.timeout(60)
def test_spawn_with_join_raises_the_childs_exception(temp_root):
    with pytest.raises(ProcessRaisedException, match="boom from process 0") as info:
        spawn(_raise_or_sleep, args=(0,), nprocs=2)
    assert info.value.error_index == 0
    assert _error_dirs(temp_root) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["os._exit", "sys.exit"])
def test_non_zero_exit_raises_process_exited(temp_root, how):
    ctx = start_processes(_exit_or_sleep, args=(1, how), nprocs=2, join=False)
    pids = ctx.pids()
    with pytest.raises(ProcessExitedException) as info:
        _join_all(ctx)
    err = info.value
    assert (err.error_index, err.pid, err.exit_code, err.signal_name) == (1, pids[1], 3, None)
    assert "process 1 terminated with exit code 3" in str(err)
    assert not _alive(pids[0])
    assert _error_dirs(temp_root) == []


@pytest.mark.timeout(60)
def test_child_killed_by_a_signal_names_it(temp_root):
    ctx = start_processes(_sigkill_or_sleep, args=(0,), nprocs=2, join=False)
    pids = ctx.pids()
    with pytest.raises(ProcessExitedException) as info:
        _join_all(ctx)
    err = info.value
    assert (err.error_index, err.pid) == (0, pids[0])
    assert (err.signal_name, err.exit_code) == ("SIGKILL", -signal.SIGKILL)
    assert "process 0 terminated with signal SIGKILL" in str(err)
    assert not _alive(pids[1])
    assert _error_dirs(temp_root) == []


@pytest.mark.timeout(60)
def test_grace_period_lets_the_others_finish_first(tmp_path):
    ctx = start_processes(_raise_or_sleep, args=(0,), nprocs=2, join=False)
    pids = ctx.pids()
    with pytest.raises(ProcessRaisedException):
        while not ctx.join(grace_period=0.1):
            pass
    assert not _alive(pids[1])
    assert ctx.processes[1].exitcode == -signal.SIGTERM


@pytest.mark.timeout(60)
def test_unreferenced_context_removes_its_error_dir(temp_root):
    ctx = start_processes(_raise_or_sleep, args=(0,), nprocs=1, join=False)
    for p in ctx.processes:
        p.join(60)
    assert len(_error_dirs(temp_root)) == 1  # the failing child wrote its traceback
    del ctx, p
    gc.collect()
    assert _error_dirs(temp_root) == []


# ------------------------------------------------------------------------- bad arguments


def test_unknown_start_method_is_a_value_error(temp_root):
    with pytest.raises(ValueError, match=r"start_method='threads'.*choose one of.*'spawn'"):
        spawn(_write_result, args=("x", 0), start_method="threads")
    assert _error_dirs(temp_root) == []


@pytest.mark.parametrize("method", [m for m in METHODS if m != "fork"])
def test_unpicklable_fn_is_a_clear_type_error(temp_root, method):
    with pytest.raises(TypeError, match=r"cannot be pickled.*module level") as info:
        start_processes(lambda i: None, nprocs=2, start_method=method)
    assert f"start_method={method!r}" in str(info.value)
    assert _error_dirs(temp_root) == []


@pytest.mark.timeout(60)
def test_unpicklable_args_are_a_clear_type_error(temp_root):
    with pytest.raises(TypeError, match=r"args cannot be pickled"):
        spawn(_write_result, args=(threading.Lock(), 0), nprocs=2)
    assert _error_dirs(temp_root) == []


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"nprocs": 0}, ValueError, r"nprocs must be >= 1, got 0"),
        ({"nprocs": 2.0}, TypeError, r"nprocs must be an int"),
        ({"args": "abc"}, TypeError, r"args must be a tuple.*args=\(x,\)"),
    ],
)
def test_argument_errors(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        spawn(_write_result, **kwargs)


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="fn must be callable"):
        spawn("not a function")


# -------------------------------------------------------------------------- exceptions


@pytest.mark.parametrize(
    "exc",
    [
        ProcessException("base", 2, 1234),
        ProcessRaisedException("raised\nTraceback ...", 1, 4321),
        ProcessExitedException("exited", 3, 999, -9, signal_name="SIGKILL"),
        ProcessExitedException("exited", 0, 998, 3),
    ],
)
def test_exceptions_survive_pickling(exc):
    copy = pickle.loads(pickle.dumps(exc))
    assert type(copy) is type(exc)
    assert (str(copy), copy.msg, copy.error_index, copy.pid, copy.error_pid) == (
        str(exc),
        exc.msg,
        exc.error_index,
        exc.pid,
        exc.error_pid,
    )
    if isinstance(exc, ProcessExitedException):
        assert (copy.exit_code, copy.signal_name) == (exc.exit_code, exc.signal_name)


def test_exceptions_are_dist_errors():
    from distcomm.errors import DistError

    assert issubclass(ProcessRaisedException, ProcessException)
    assert issubclass(ProcessExitedException, ProcessException)
    assert issubclass(ProcessException, DistError)


# --------------------------------------------------------------------- death of the parent

_PARENT = """
import sys
from distcomm.multiprocessing.spawn import spawn
from tests.test_mp_spawn import _record_pid_and_sleep
spawn(_record_pid_and_sleep, args=(sys.argv[1],), nprocs=2, start_method=sys.argv[2])
"""


@linux_only
@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", METHODS)
def test_children_die_when_the_parent_is_killed(tmp_path, method):
    temp_root = tmp_path / "tmp"
    temp_root.mkdir()
    env = dict(
        os.environ,
        TMPDIR=str(temp_root),
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    with open(tmp_path / "parent.err", "wb") as err:
        parent = subprocess.Popen(
            [sys.executable, "-c", _PARENT, str(tmp_path), method],
            cwd=ROOT,
            env=env,
            stdout=err,
            stderr=err,
        )
    pids: list[int] = []
    try:
        pid_files = [tmp_path / f"pid-{i}" for i in range(2)]

        def started() -> bool:
            if parent.poll() is not None:
                raise AssertionError(
                    f"the parent exited ({parent.returncode}):\n"
                    f"{(tmp_path / 'parent.err').read_text()}"
                )
            return all(f.exists() for f in pid_files)

        _wait_until(started, "the children did not write their pids")
        children = [int(f.read_text()) for f in pid_files]
        assert all(_alive(pid) for pid in children)
        # the children, and multiprocessing's helpers (resource tracker, fork server)
        pids = [p.pid for p in psutil.Process(parent.pid).children(recursive=True)]
        assert set(children) <= set(pids)
        parent.kill()
        parent.wait(timeout=30)
        _wait_until(
            lambda: not any(_alive(pid) for pid in children),
            f"children {children} outlived their SIGKILLed parent",
        )
        _wait_until(
            lambda: not any(_alive(pid) for pid in pids),
            f"processes {pids} started for the parent outlived it",
        )
        assert _error_dirs(temp_root) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@linux_only
@pytest.mark.timeout(60)
def test_the_death_signal_follows_the_thread_that_started_the_children(tmp_path):
    """As documented: the kernel sends PR_SET_PDEATHSIG when the starting *thread* ends."""
    started: list[ProcessContext] = []

    def start() -> None:
        started.append(
            start_processes(_record_pid_and_sleep, args=(str(tmp_path),), nprocs=1, join=False)
        )
        _wait_until(lambda: (tmp_path / "pid-0").exists(), "the child did not start")

    thread = threading.Thread(target=start)
    thread.start()
    thread.join(60)
    with pytest.raises(ProcessExitedException) as info:
        _join_all(started[0])
    assert info.value.signal_name == "SIGKILL"


@linux_only
@pytest.mark.timeout(60)
def test_a_child_whose_parent_is_already_gone_ends_at_once(tmp_path):
    """The check after prctl: a child reparented before the death signal was set kills
    itself (simulated by telling it another parent pid)."""
    # the package re-exports the function `spawn` under the module's name, as torch does
    spawn_module = importlib.import_module("distcomm.multiprocessing.spawn")

    process = multiprocessing.get_context("spawn").Process(
        target=spawn_module._wrap,
        args=(_write_result, 0, (str(tmp_path), 0), str(tmp_path / "error"), -1, False),
    )
    process.start()
    process.join(60)
    assert process.exitcode == -signal.SIGKILL
    assert not (tmp_path / "0.json").exists()


@pytest.mark.timeout(60)
def test_an_interrupted_parent_stops_its_children(tmp_path, temp_root):
    pid_files = [tmp_path / f"pid-{i}" for i in range(2)]

    def interrupt_once_started() -> None:
        _wait_until(lambda: all(f.exists() for f in pid_files), "the children did not start")
        os.kill(os.getpid(), signal.SIGINT)  # the parent only, unlike a terminal's Ctrl-C

    # pytest started as a background job of a non-interactive shell inherits SIGINT
    # ignored (bash's rule for asynchronous commands), and Python then keeps it ignored:
    # this test is about spawn, so it uses Python's own handler while it runs
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    thread = threading.Thread(target=interrupt_once_started, daemon=True)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            spawn(_record_pid_and_sleep, args=(str(tmp_path),), nprocs=2)
    finally:
        signal.signal(signal.SIGINT, previous)
    thread.join(60)
    pids = [int(f.read_text()) for f in pid_files]
    assert not any(_alive(pid) for pid in pids)
    assert _error_dirs(temp_root) == []
