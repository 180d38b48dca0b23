"""The launcher's worker processes and failure reports: real processes, real signals.

Workers are `sys.executable -c ...` children. Console output is read with pytest's fd
capture (workers that inherit the console write straight into it). Every test checks
that it left no process of its own behind.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from distcomm.launch import output as output_module
from distcomm.launch.errors import (
    NO_RECORDED_TRACEBACK,
    NO_TRACEBACK,
    NOT_KEPT,
    ChildFailedError,
    ProcessFailure,
    exit_description,
    record,
)
from distcomm.launch.workers import (
    Std,
    WorkerProcesses,
    parse_local_ranks_filter,
    parse_std,
)
from tests import processes

PY = sys.executable
linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only"
)


def _alive(pid: int, create_time: float | None = None) -> bool:
    """Whether `pid` is a live process (zombies count as gone; a reused pid too)."""
    try:
        proc = psutil.Process(pid)
        if create_time is not None and abs(proc.create_time() - create_time) > 0.01:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(autouse=True)
def no_process_left():
    """Fail a test that leaves a process it started running (and kill it)."""
    with processes.no_process_left():
        yield


def _workers(commands: dict[int, str], log_dir, **kwargs) -> WorkerProcesses:
    """WorkerProcesses running `python -c <code>` per local rank (defaults: no files)."""
    options = {"redirects": {}, "tee": {}, "console_ranks": None, "prefixes": {}}
    options.update(kwargs)
    return WorkerProcesses(
        {lr: [PY, "-c", textwrap.dedent(code)] for lr, code in commands.items()},
        {lr: dict(os.environ) for lr in commands},
        log_dir=None if log_dir is None else str(log_dir),
        **options,
    )


def _wait_exit(workers: WorkerProcesses, timeout: float = 30.0) -> dict[int, int | None]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = workers.poll()
        if None not in codes.values():
            return codes
        time.sleep(0.02)
    raise AssertionError(f"workers still running after {timeout} s: {workers.poll()}")


def _wait_file(path, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            text = Path(path).read_text()
            if text.endswith("\n"):
                return text
        time.sleep(0.02)
    raise AssertionError(f"{path} did not appear within {timeout} s")


# -- exit codes -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_exit_codes_and_signals(tmp_path):
    workers = _workers(
        {
            0: "pass",
            1: "import sys; sys.exit(3)",
            2: "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
            3: "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
        },
        tmp_path,
    )
    with workers:
        workers.start()
        pids = workers.pids()
        assert sorted(pids) == [0, 1, 2, 3] and len(set(pids.values())) == 4
        assert _wait_exit(workers) == {0: 0, 1: 3, 2: -signal.SIGKILL, 3: -signal.SIGTERM}
        workers.stop()  # after they all ended: harmless
        workers.stop()
    assert workers.poll() == {0: 0, 1: 3, 2: -9, 3: -15}


def test_exit_description():
    assert exit_description(0) == "exit code 0"
    assert exit_description(1) == "exit code 1"
    assert exit_description(-9) == "signal SIGKILL (-9)"
    assert exit_description(-15) == "signal SIGTERM (-15)"
    assert exit_description(None) == "still running"
    assert exit_description(137) == "exit code 137 (128+SIGKILL)"
    assert exit_description(-99).startswith("signal 99")


def test_poll_before_start_and_start_twice(tmp_path):
    workers = _workers({0: "pass"}, tmp_path)
    with pytest.raises(RuntimeError, match="before start"):
        workers.poll()
    assert workers.pids() == {} and workers.error_file(0) == ""
    with workers:
        workers.start()
        with pytest.raises(RuntimeError, match="already called"):
            workers.start()
        _wait_exit(workers)


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one"):
        WorkerProcesses({}, {}, log_dir=None, redirects={}, tee={}, console_ranks=None, prefixes={})
    with pytest.raises(ValueError, match="differ"):
        WorkerProcesses(
            {0: ["true"]},
            {1: {}},
            log_dir=None,
            redirects={},
            tee={},
            console_ranks=None,
            prefixes={},
        )
    with pytest.raises(ValueError, match="empty"):
        WorkerProcesses(
            {0: []}, {0: {}}, log_dir=None, redirects={}, tee={}, console_ranks=None, prefixes={}
        )


@pytest.mark.timeout(60)
def test_command_that_cannot_start_ends_the_others(tmp_path):
    workers = WorkerProcesses(
        {0: [PY, "-c", "import time; time.sleep(60)"], 1: [str(tmp_path / "no-such-program")]},
        {0: dict(os.environ), 1: dict(os.environ)},
        log_dir=str(tmp_path),
        redirects={},
        tee={},
        console_ranks=None,
        prefixes={},
    )
    with pytest.raises(FileNotFoundError, match="local rank 1: cannot start"):
        workers.start()
    assert workers.poll()[0] is not None  # rank 0 was ended and reaped


# -- stopping process trees -------------------------------------------------------------------

#: a worker that starts a grandchild ignoring SIGTERM and one in its own session, writes
#: "<worker> <grandchild> <session child>" to PIDS, then sleeps (ignoring SIGTERM if asked)
TREE = """
import os, signal, subprocess, sys, time
ignore = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          "open({pids!r} + '.ready', 'w').close(); time.sleep(120)")
stubborn = subprocess.Popen([sys.executable, "-c", ignore])
escaped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                           start_new_session=True)
if {worker_ignores}:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
while not os.path.exists({pids!r} + ".ready"):  # the stubborn one ignores SIGTERM now
    time.sleep(0.01)
with open({pids!r} + ".tmp", "w") as fp:
    fp.write(f"{{os.getpid()}} {{stubborn.pid}} {{escaped.pid}}\\n")
os.replace({pids!r} + ".tmp", {pids!r})
time.sleep(120)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker_ignores", [False, True], ids=["worker-dies", "worker-ignores"])
def test_stop_kills_the_whole_tree(tmp_path, worker_ignores):
    pids_file = str(tmp_path / "pids")
    workers = _workers(
        {
            0: TREE.format(worker_ignores=worker_ignores, pids=pids_file),
            1: "import time; time.sleep(120)",
        },
        tmp_path,
    )
    with workers:
        workers.start()
        pids = [int(p) for p in _wait_file(pids_file).split()]
        stamps = {pid: psutil.Process(pid).create_time() for pid in pids}
        assert psutil.Process(pids[2]).pid == os.getsid(pids[2])  # it has its own session
        workers.stop(grace=0.5)
        codes = workers.poll()
        assert codes[0] == (-signal.SIGKILL if worker_ignores else -signal.SIGTERM)
        assert codes[1] == -signal.SIGTERM
        assert [pid for pid in pids if _alive(pid, stamps[pid])] == []
        workers.stop(grace=0.5)  # idempotent
    assert workers.poll() == codes


@pytest.mark.timeout(60)
def test_stop_with_sigkill_and_close_stops_running_workers(tmp_path):
    workers = _workers({0: "import time; time.sleep(120)"}, tmp_path)
    workers.start()
    workers.stop(grace=30.0, sig=signal.SIGKILL)
    assert workers.poll() == {0: -signal.SIGKILL}
    workers.close()

    workers = _workers({0: "import time; time.sleep(120)"}, tmp_path / "second")
    workers.start()
    pid = workers.pids()[0]
    workers.close(grace=5.0)
    assert workers.poll() == {0: -signal.SIGTERM} and not _alive(pid)


FROZEN = """
    import os, signal, sys
    from pathlib import Path

    def on_term(signum, frame):
        Path({handled!r}).write_text("SIGTERM handled\\n")
        sys.exit(7)

    signal.signal(signal.SIGTERM, on_term)
    Path({ready!r}).write_text(f"{{os.getpid()}}\\n")
    os.kill(os.getpid(), signal.SIGSTOP)  # frozen until SIGCONT
    signal.pause()
"""


@pytest.mark.timeout(120)
def test_stop_wakes_a_frozen_worker(tmp_path):
    """A stopped worker gets SIGCONT after SIGTERM, so its handler runs at once: the exit
    is the handler's, not the SIGKILL that ends the grace period."""
    handled, ready = tmp_path / "handled", tmp_path / "ready"
    workers = _workers(
        {
            0: FROZEN.format(handled=str(handled), ready=str(ready)),
            1: "import time; time.sleep(120)",
        },
        tmp_path,
    )
    with workers:
        workers.start()
        pid = int(_wait_file(ready))
        deadline = time.monotonic() + 30
        while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, "the worker did not stop itself"
            time.sleep(0.02)
        workers.stop(grace=60.0)
        assert workers.poll() == {0: 7, 1: -signal.SIGTERM}
        assert handled.read_text() == "SIGTERM handled\n"


@pytest.mark.timeout(60)
def test_send_signal_reaches_running_workers_only(tmp_path):
    """send_signal (the agent's SIGUSR1/SIGUSR2 forwarding) reaches each running worker's
    handler and leaves it running; an ended worker is skipped."""
    ready = tmp_path / "ready"
    worker = f"""
        import os, signal, sys, time
        from pathlib import Path
        got = []
        signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
        Path({str(ready)!r}, os.environ["LR"]).write_text("ready\\n")
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        Path({str(ready)!r}, os.environ["LR"]).write_text(f"got {{got}}\\n")
        sys.exit(3 if got else 1)
    """
    ready.mkdir()
    workers = WorkerProcesses(
        {0: [PY, "-c", textwrap.dedent(worker)], 1: [PY, "-c", "pass"]},
        {0: dict(os.environ, LR="0"), 1: dict(os.environ, LR="1")},
        log_dir=str(tmp_path / "logs"),
        redirects={},
        tee={},
        console_ranks=None,
        prefixes={},
    )
    with workers:
        workers.start()
        _wait_file(ready / "0")
        deadline = time.monotonic() + 30
        while workers.poll()[1] is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert workers.send_signal(signal.SIGUSR1) == [workers.pids()[0]]
        assert _wait_exit(workers) == {0: 3, 1: 0}
        assert (ready / "0").read_text() == f"got [{int(signal.SIGUSR1)}]\n"


@linux_only
@pytest.mark.timeout(60)
def test_workers_die_with_a_killed_agent(tmp_path):
    """PR_SET_PDEATHSIG: SIGKILL the agent, its workers go too."""
    agent = textwrap.dedent(f"""
        import os, sys, time
        from distcomm.launch.workers import WorkerProcesses
        workers = WorkerProcesses({{0: [sys.executable, "-c", "import time; time.sleep(120)"]}},
                                  {{0: dict(os.environ)}}, log_dir={str(tmp_path)!r},
                                  redirects={{}}, tee={{}}, console_ranks=None, prefixes={{}})
        workers.start()
        print(workers.pids()[0], flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([PY, "-c", agent], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(proc.stdout.readline())
        assert _alive(worker)
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(worker)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()


# -- output: files and console ----------------------------------------------------------------

BOTH = "import sys; print('out-{0}'); print('err-{0}', file=sys.stderr)"


@pytest.mark.timeout(60)
def test_redirects_write_files_only(tmp_path, capfd):
    workers = _workers(
        {0: BOTH.format(0), 1: BOTH.format(1)}, tmp_path, redirects={0: Std.ALL, 1: Std.OUT}
    )
    with workers:
        workers.start()
        _wait_exit(workers)
    assert (tmp_path / "0" / "stdout.log").read_text() == "out-0\n"
    assert (tmp_path / "0" / "stderr.log").read_text() == "err-0\n"
    assert (tmp_path / "1" / "stdout.log").read_text() == "out-1\n"
    assert not (tmp_path / "1" / "stderr.log").exists()
    assert workers.log_files(0) == {
        "stdout": str(tmp_path / "0" / "stdout.log"),
        "stderr": str(tmp_path / "0" / "stderr.log"),
    }
    assert workers.log_files(1) == {"stdout": str(tmp_path / "1" / "stdout.log")}
    assert workers.error_file(1) == str(tmp_path / "1" / "error.json")
    out, err = capfd.readouterr()
    assert "out-0" not in out and "out-1" not in out and "err-0" not in err
    assert err.splitlines() == ["err-1"]  # through the agent, unprefixed
    assert workers.stderr_tail(0) is None  # its log holds it
    assert workers.stderr_tail(1).lines() == ["err-1"]


@pytest.mark.timeout(60)
def test_stderr_tail_is_kept_whatever_reaches_the_console(tmp_path, capfd):
    """The agent keeps the end of every worker's stderr that does not go only to its log:
    shown or left out by the console filter, prefixed or not; and when it saw each end."""
    code = "import sys; print('line', file=sys.stderr); sys.exit({0})"
    workers = _workers(
        {0: code.format(0), 1: code.format(1), 2: code.format(2)},
        tmp_path,
        console_ranks={0, 2},
        prefixes={2: "[2]:"},
    )
    with workers:
        workers.start()
        assert workers.exit_time(0) is None
        before = time.time()
        _wait_exit(workers)
        for local_rank in range(3):
            tail = workers.stderr_tail(local_rank, time.monotonic() + 30)
            assert tail.lines() == ["line"], local_rank
            assert tail.failure_time() is None  # no traceback
            assert workers.exit_time(local_rank) >= before
    assert sorted(capfd.readouterr().err.splitlines()) == ["[2]:line", "line"]


@pytest.mark.timeout(60)
def test_tee_goes_to_file_and_prefixed_console(tmp_path, capfdbinary):
    code = r"""
        import os, sys
        sys.stdout.write("line one\nline two\n"); sys.stdout.flush()
        os.write(2, b"bytes \xff\xfe not utf-8\n")
        os.write(1, b"no newline at the end")
    """
    workers = _workers(
        {0: code, 1: BOTH.format(1)},
        tmp_path,
        tee={0: Std.ALL},
        prefixes={0: "[default0]:", 1: "[default1]:"},
    )
    with workers:
        workers.start()
        _wait_exit(workers)
    stdout_log = (tmp_path / "0" / "stdout.log").read_bytes()
    assert stdout_log == b"line one\nline two\nno newline at the end"
    assert (tmp_path / "0" / "stderr.log").read_bytes() == b"bytes \xff\xfe not utf-8\n"
    assert not (tmp_path / "1").joinpath("stdout.log").exists()
    out, err = capfdbinary.readouterr()
    assert sorted(out.splitlines(keepends=True)) == [
        b"[default0]:line one\n",
        b"[default0]:line two\n",
        b"[default0]:no newline at the end\n",
        b"[default1]:out-1\n",
    ]
    assert sorted(err.splitlines(keepends=True)) == [
        b"[default0]:bytes \xff\xfe not utf-8\n",
        b"[default1]:err-1\n",
    ]


@pytest.mark.timeout(60)
def test_console_ranks_filter(tmp_path, capfd):
    workers = _workers(
        {0: BOTH.format(0), 1: BOTH.format(1), 2: BOTH.format(2)},
        tmp_path,
        tee={2: Std.OUT},
        console_ranks={0},
        prefixes={2: "[2]:"},
    )
    with workers:
        workers.start()
        _wait_exit(workers)
    out, err = capfd.readouterr()
    assert out.splitlines() == ["out-0"] and err.splitlines() == ["err-0"]
    assert (tmp_path / "2" / "stdout.log").read_text() == "out-2\n"  # files still written


@pytest.mark.timeout(60)
def test_prefixed_lines_never_mix(tmp_path, capfdbinary):
    """Lines written in small pieces by several workers at once arrive whole."""
    code = """
        import os
        line = b"{ch}" * 3000 + b"\\n"
        for _ in range(100):
            for start in range(0, len(line), 700):
                os.write(1, line[start:start + 700])
    """
    letters = "abcd"
    workers = _workers(
        {lr: code.format(ch=ch) for lr, ch in enumerate(letters)},
        tmp_path,
        prefixes={lr: f"[{lr}]:" for lr in range(len(letters))},
    )
    with workers:
        workers.start()
        _wait_exit(workers)
    lines = capfdbinary.readouterr().out.splitlines()
    assert len(lines) == 100 * len(letters)
    for line in lines:
        lr = int(line[1:2])
        assert line == f"[{lr}]:".encode() + letters[lr].encode() * 3000


def _read_console_until(capfdbinary, text: bytes, seen: bytes) -> bytes:
    deadline = time.monotonic() + 30
    while text not in seen and time.monotonic() < deadline:
        time.sleep(0.01)
        seen += capfdbinary.readouterr().out
    return seen


@pytest.mark.timeout(60)
def test_partial_and_long_lines(tmp_path, capfdbinary, monkeypatch):
    """A partial line shows after a pause; an overlong partial line shows at once."""
    monkeypatch.setattr(output_module, "PARTIAL_LINE_FLUSH_S", 0.05)
    go, go2 = tmp_path / "go", tmp_path / "go2"
    code = f"""
        import os, time
        def wait(path):
            while not os.path.exists(path):
                time.sleep(0.01)
        os.write(1, b"progress")
        wait({str(go)!r})
        os.write(1, b" done\\n" + b"x" * 25)
        wait({str(go2)!r})
        os.write(1, b"y\\n")
    """
    workers = _workers({0: code}, tmp_path, prefixes={0: "[0]:"})
    with workers:
        workers.start()
        seen = _read_console_until(capfdbinary, b"progress", b"")
        monkeypatch.setattr(output_module, "PARTIAL_LINE_FLUSH_S", 600.0)
        monkeypatch.setattr(output_module, "MAX_LINE_BYTES", 10)
        go.touch()
        seen = _read_console_until(capfdbinary, b"x" * 25, seen)
        go2.touch()
        _wait_exit(workers)
    seen += capfdbinary.readouterr().out
    assert seen.splitlines() == [b"[0]:progress", b"[0]: done", b"[0]:" + b"x" * 25, b"[0]:y"]


@pytest.mark.timeout(60)
def test_temporary_log_dir_without_log_dir(caplog):
    workers = _workers({0: "pass"}, None, tee={0: Std.NONE})
    with workers:
        workers.start()
        directory = workers.log_dir
        assert directory and os.path.isdir(directory)
        assert workers.error_file(0) == os.path.join(directory, "0", "error.json")
        _wait_exit(workers)
    assert not os.path.exists(directory)  # nothing was written: removed

    workers = _workers({0: "print('kept')"}, None, redirects={0: Std.OUT})
    with caplog.at_level(logging.WARNING, logger="distcomm.launch.workers"), workers:
        workers.start()
        _wait_exit(workers)
    try:
        assert Path(workers.log_files(0)["stdout"]).read_text() == "kept\n"
        assert workers.log_dir in caplog.text
    finally:
        shutil.rmtree(workers.log_dir)


@pytest.mark.timeout(60)
def test_no_descriptor_leak(tmp_path):
    me = psutil.Process()
    threads_before = set(threading.enumerate())  # other tests' are not this one's to judge

    def cycle(directory) -> None:
        workers = _workers(
            {0: BOTH.format(0), 1: BOTH.format(1), 2: "import time; time.sleep(60)"},
            directory,
            tee={0: Std.ALL},
            redirects={1: Std.ERR},
            console_ranks={0, 1},
            prefixes={1: "[1]:"},
        )
        workers.start()
        deadline = time.monotonic() + 30
        while None in (workers.poll()[0], workers.poll()[1]) and time.monotonic() < deadline:
            time.sleep(0.02)
        workers.stop(grace=5.0)
        workers.close()

    cycle(tmp_path / "warm-up")
    before = me.num_fds()
    cycle(tmp_path / "measured")
    assert me.num_fds() == before
    assert [
        t.name
        for t in threading.enumerate()
        if t.name.startswith("distcomm-local") and t not in threads_before
    ] == []


# -- flag parsing -----------------------------------------------------------------------------


def test_parse_std():
    assert parse_std("3", 2) == {0: Std.ALL, 1: Std.ALL}
    assert parse_std("0", 2) == {0: Std.NONE, 1: Std.NONE}
    assert parse_std("", 2) == {0: Std.NONE, 1: Std.NONE}
    assert parse_std("0:3,1:1", 3) == {0: Std.ALL, 1: Std.OUT, 2: Std.NONE}
    assert parse_std(" 2 : 2 , 0:1 ", 3) == {0: Std.OUT, 1: Std.NONE, 2: Std.ERR}


@pytest.mark.parametrize("spec", ["4", "x", "0:4", "0:3,", "0=3", "3:1", "0:1,0:2", "-1"])
def test_parse_std_rejects(spec):
    with pytest.raises(ValueError, match=r"--tee=.*expected one value for every local rank"):
        parse_std(spec, 2, "--tee")
    with pytest.raises(ValueError, match="--redirects/--tee"):
        parse_std(spec, 2)


def test_parse_local_ranks_filter():
    assert parse_local_ranks_filter("", 4) is None
    assert parse_local_ranks_filter("  ", 4) is None
    assert parse_local_ranks_filter("0,2", 4) == {0, 2}
    assert parse_local_ranks_filter(" 3 ", 4) == {3}


@pytest.mark.parametrize("spec", ["4", "0,,1", "a", "-1", "0;1", "1.0"])
def test_parse_local_ranks_filter_rejects(spec):
    with pytest.raises(ValueError, match="--local_ranks_filter"):
        parse_local_ranks_filter(spec, 4)


# -- @record and failure reports --------------------------------------------------------------


@record
def _fails(message: str) -> None:
    """Raise a ValueError."""
    raise ValueError(message)


def test_record_writes_torch_layout_and_reraises(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("DISTCOMM_ERROR_FILE", str(path))
    before = time.time()
    with pytest.raises(ValueError, match="bad input"):
        _fails("bad input")
    data = json.loads(path.read_text())
    assert set(data) == {"message"} and set(data["message"]) == {"message", "extraInfo"}
    assert data["message"]["message"] == "ValueError: bad input"
    info = data["message"]["extraInfo"]
    assert info["py_callstack"].startswith("Traceback (most recent call last):")
    assert "raise ValueError(message)" in info["py_callstack"]
    assert "wrapper" not in info["py_callstack"]
    assert isinstance(info["timestamp"], str) and int(info["timestamp"]) >= int(before)
    assert _fails.__name__ == "_fails" and _fails.__doc__ == "Raise a ValueError."


def test_record_env_fallback_and_unset(tmp_path, monkeypatch):
    monkeypatch.delenv("DISTCOMM_ERROR_FILE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    with pytest.raises(ValueError):
        _fails("nowhere")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "torch.json"))
    with pytest.raises(ValueError):
        _fails("torch's variable")
    assert "torch's variable" in (tmp_path / "torch.json").read_text()
    assert record(lambda x: x + 1)(1) == 2


def test_record_passes_on_a_nested_root_cause(tmp_path, monkeypatch):
    """An agent's @record writes its first failure's record (a launcher inside a launcher)."""
    inner = _recorded(tmp_path, "inner.json", "ValueError: deep down", 1_700_000_000 * 10**9)
    failure = ProcessFailure(0, 99, 1, inner, rank=3)

    @record
    def agent_main() -> None:
        raise ChildFailedError("train.py", {3: failure})

    monkeypatch.setenv("DISTCOMM_ERROR_FILE", str(tmp_path / "agent.json"))
    with pytest.raises(ChildFailedError):
        agent_main()
    expected = json.loads(json.dumps(failure.error_data))
    expected["message"]["errorCode"] = 1  # the child's exit status, as torch's record adds it
    assert json.loads((tmp_path / "agent.json").read_text()) == expected


def test_record_never_hides_the_exception(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DISTCOMM_ERROR_FILE", str(tmp_path / "missing-dir" / "error.json"))
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="the original"):
        _fails("the original")
    assert "could not write the error file" in caplog.text


def _recorded(tmp_path, name: str, message: str, timestamp_ns: int) -> str:
    path = tmp_path / name
    path.write_text(
        json.dumps(
            {
                "message": {
                    "message": message,
                    "extraInfo": {
                        "py_callstack": f"Traceback (most recent call last):\n  ...\n{message}\n",
                        "timestamp": str(timestamp_ns // 10**9),
                        "timestamp_ns": str(timestamp_ns),
                    },
                }
            }
        )
    )
    return str(path)


def test_process_failure_reads_the_error_file(tmp_path):
    error_file = _recorded(tmp_path, "e.json", "KeyError: 'x'", 1_700_000_000_250_000_000)
    failure = ProcessFailure(
        local_rank=1,
        rank=5,
        pid=42,
        exitcode=1,
        error_file=error_file,
        host="node-a",
        timestamp=1.0,
    )
    assert failure.timestamp == pytest.approx(1_700_000_000.25)  # the file's time wins
    assert failure.message == "KeyError: 'x'"
    assert failure.traceback_text().endswith("KeyError: 'x'")
    assert failure.signal_name() == "<N/A>"
    os.remove(error_file)  # read once, when made
    assert failure.message == "KeyError: 'x'"

    # torch's layout without our timestamp_ns, and torch's C++ layout
    path = tmp_path / "torch.json"
    path.write_text(
        json.dumps(
            {
                "message": {
                    "message": "RuntimeError: x",
                    "extraInfo": {"py_callstack": "tb", "timestamp": "1700000000"},
                }
            }
        )
    )
    assert ProcessFailure(0, 1, 1, str(path)).timestamp == 1_700_000_000
    path.write_text(json.dumps({"message": "c++ error", "timestamp": "1700000001"}))
    failure = ProcessFailure(0, 1, 1, str(path))
    assert failure.message == "c++ error" and failure.timestamp == 1_700_000_001
    assert failure.traceback_text() == NO_RECORDED_TRACEBACK  # a file, so no @record hint
    path.write_text("{not json")
    failure = ProcessFailure(0, 1, 1, str(path))
    assert "unreadable" in failure.message
    assert failure.traceback_text() == NO_RECORDED_TRACEBACK and failure.error_file == str(path)


def test_process_failure_without_a_record(tmp_path):
    before = time.time()
    killed = ProcessFailure(local_rank=0, rank=0, pid=7, exitcode=-9)
    assert killed.signal_name() == "SIGKILL"
    unwritten = ProcessFailure(0, 7, 1, str(tmp_path / "error.json"))
    assert unwritten.error_file == "<N/A>"  # as torch's: nothing was recorded there
    assert "error_file: <N/A>" in ChildFailedError("x", {0: unwritten}).format_msg()
    assert killed.message == "process 7 ended with signal SIGKILL (-9)"
    assert killed.traceback_text() == NO_TRACEBACK
    assert isinstance(killed.timestamp, int) and killed.timestamp >= int(before)
    assert ProcessFailure(0, 7, None).message == "process 7 was still running"

    stderr = tmp_path / "stderr.log"
    stderr.write_bytes(b"".join(b"line %d\n" % i for i in range(30)) + b"Segfault \xff\n")
    failure = ProcessFailure(
        local_rank=0, rank=0, pid=7, exitcode=-11, log_files={"stderr": str(stderr)}
    )
    text = failure.traceback_text()
    assert "\nline 11\n" in text and "line 10\n" not in text and text.endswith("Segfault \ufffd")
    assert "line 28" not in failure.traceback_text(tail=2)


def test_child_failed_error_report(tmp_path):
    t0 = 1_700_000_000 * 10**9
    recorded = _recorded(tmp_path, "r2.json", "ValueError: first", t0)
    stderr = tmp_path / "stderr.log"
    stderr.write_text("Fatal Python error: Segmentation fault\n")
    failures = {
        0: ProcessFailure(
            0,
            100,
            -9,
            rank=0,
            host="node-a",
            timestamp=t0 / 1e9 + 5,
            reason="expiration timer 'stuck' expired",
        ),
        2: ProcessFailure(0, 102, 1, recorded, rank=2, host="node-b"),
        3: ProcessFailure(
            1,
            103,
            -11,
            rank=3,
            host="node-b",
            timestamp=t0 / 1e9 + 9,
            log_files={"stderr": str(stderr)},
        ),
    }
    error = ChildFailedError("train.py", failures)
    assert error.get_first_failure() == (2, failures[2])
    text = error.format_msg()
    assert str(error) == text
    lines = text.splitlines()
    assert lines[1] == "train.py FAILED"
    head, root = text.split("Root Cause (first observed failure):")
    assert "[0]:" in head and "[3]:" in head and "[2]:" not in head
    assert "[2]:" in root and "ValueError: first" in root and "Traceback" in root
    assert "node-b" in root and "0 (local_rank: 0)" not in root
    assert "-9 (SIGKILL)" in head and "-11 (SIGSEGV)" in head
    assert "expiration timer 'stuck' expired" in head
    assert "Fatal Python error: Segmentation fault" in head  # the stderr tail
    assert NO_TRACEBACK in head  # rank 0: nothing recorded, no log

    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == text and copy.get_first_failure()[0] == 2

    # ties go to the smallest rank; one failure has no other failures
    same = {r: ProcessFailure(r, 10 + r, 1, rank=r, timestamp=5.0) for r in (3, 1, 2)}
    assert ChildFailedError("x", same).get_first_failure()[0] == 1
    assert "<NO_OTHER_FAILURES>" in ChildFailedError("x", {1: same[1]}).format_msg()
    with pytest.raises(ValueError):
        ChildFailedError("x", {})


def test_report_names_no_file_that_is_not_kept(tmp_path):
    """With files_kept=False (the files are in the agent's temporary directory) the report
    names none of them, and the stderr tail read by capture_logs outlives the log."""
    recorded = _recorded(tmp_path, "r0.json", "ValueError: first", 1_700_000_000 * 10**9)
    stderr = tmp_path / "stderr.log"
    stderr.write_text("".join(f"line {i}\n" for i in range(30)))
    failures = {
        0: ProcessFailure(0, 100, 1, recorded, files_kept=False),
        1: ProcessFailure(1, 101, -11, rank=1, log_files={"stderr": str(stderr)}, files_kept=False),
    }
    failures[1].capture_logs()
    stderr.unlink()
    os.remove(recorded)
    text = ChildFailedError("train.py", failures).format_msg()
    assert str(tmp_path) not in text
    assert f"error_file: {NOT_KEPT}" in text and f"stderr    : {NOT_KEPT}" in text
    assert "ValueError: first" in text and "Traceback" in text
    assert "(no recorded traceback; last 20 lines of its stderr)" in text
    assert "line 29" in text and "line 9\n" not in text
    assert "@record" not in text
    assert failures[1].traceback_text(tail=2).endswith("line 28\nline 29")

    # another node's report keeps the choice; kept files are named
    remote = ProcessFailure.from_record(json.loads(json.dumps(failures[1].to_record())))
    assert not remote.files_kept and "line 29" in remote.traceback_text()
    assert str(tmp_path) not in ChildFailedError("x", {1: remote}).format_msg()
    kept = ProcessFailure(0, 7, 1, _recorded(tmp_path, "k.json", "KeyError: 'k'", 10**18))
    assert f"error_file: {kept.error_file}" in ChildFailedError("x", {0: kept}).format_msg()


@pytest.mark.timeout(60)
def test_recorded_worker_failure_end_to_end(tmp_path):
    """A worker's @record traceback and a SIGKILLed worker's stderr reach the report."""
    code = """
        from distcomm.launch.errors import record

        @record
        def main():
            raise RuntimeError("loss is nan at step 7")

        main()
    """
    crash = (
        "import os, sys, signal; print('about to die', file=sys.stderr, flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(code))
    workers = WorkerProcesses(
        {0: [PY, str(script)], 1: [PY, "-c", crash]},
        {0: dict(os.environ), 1: dict(os.environ)},
        log_dir=str(tmp_path),
        redirects={0: Std.ALL, 1: Std.ALL},
        tee={},
        console_ranks=None,
        prefixes={},
    )
    with workers:
        workers.start()
        codes = _wait_exit(workers)
        failures = {
            lr: ProcessFailure(
                lr,
                workers.pids()[lr],
                codes[lr],
                workers.error_file(lr),
                host="here",
                log_files=workers.log_files(lr),
            )
            for lr in codes
        }
    assert codes == {0: 1, 1: -signal.SIGKILL}
    assert failures[0].message == "RuntimeError: loss is nan at step 7"
    assert 'raise RuntimeError("loss is nan at step 7")' in failures[0].traceback_text()
    assert failures[1].traceback_text().endswith("about to die")
    report = ChildFailedError("worker.py", failures).format_msg()
    assert "loss is nan" in report and "SIGKILL" in report and "about to die" in report
