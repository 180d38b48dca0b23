"""distcomm-run's failure report without flags: the raising rank's traceback, the root cause
chosen over the ranks that failed because of it, and a console where ranks' tracebacks
do not interleave.

The first tests read the pieces without processes (the traceback finder, the console
grouper, the stderr tail, the root-cause choice, the exception hook); the others run real
distcomm-run jobs.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from distcomm.errors import DistNetworkError, caused_by_peers, peer_failure
from distcomm.launch import excepthook
from distcomm.launch.error_handler import ErrorHandler, exception_record
from distcomm.launch.errors import NO_TRACEBACK, ChildFailedError, ProcessFailure
from distcomm.launch.tracebacks import (
    StderrTail,
    TracebackGrouper,
    exception_lines,
    last_traceback,
    peer_failure_in,
)
from tests.launchjobs import run_launcher, script

pytestmark = pytest.mark.timeout(240)

_ASSERT_BLOCK = [
    "Traceback (most recent call last):",
    '  File "a.py", line 3, in <module>',
    "    main()",
    '  File "a.py", line 2, in main',
    "    raise ValueError(1)",
    "ValueError: 1",
]


# -- the pieces, without processes --------------------------------------------------------


def test_last_traceback_takes_the_last_block_and_what_is_chained_before_it():
    chained = [
        "Traceback (most recent call last):",
        '  File "a.py", line 5, in <module>',
        "KeyError: 'x'",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        *_ASSERT_BLOCK,
    ]
    lines = ["noise", *_ASSERT_BLOCK, "between", *chained, "after"]
    start, end = last_traceback(lines)
    assert lines[start:end] == chained
    assert exception_lines(chained) == ["KeyError: 'x'", "ValueError: 1"]
    assert last_traceback(["no", "traceback"]) is None
    cut = _ASSERT_BLOCK[:3]  # the process ended while writing it
    assert last_traceback(["x", *cut]) == (1, 4)


def test_peer_failure_messages_are_recognised():
    assert peer_failure_in("[rank 2/3] all_reduce #0: rank 1 closed the connection") == (1,)
    text = "rank 2 aborted the group: rank 1 closed the connection (exit or crash?)"
    assert peer_failure_in(text) == (2,)  # the peer it heard from
    assert peer_failure_in("rank 4 has left the group (destroy_process_group or exit)") == (4,)
    assert peer_failure_in("the link to rank 3 (10.0.0.3:4000) failed: nothing ...") == (3,)
    assert peer_failure_in("watchdog: another rank aborted the group (rank 5: boom)") == (5,)
    assert peer_failure_in("store at 10.0.0.1:29500 closed the connection (did ...") == ()
    assert peer_failure_in("ValueError: bad value on rank 1") is None


def test_the_peer_mark_follows_the_exception_chain():
    peer = caused_by_peers(DistNetworkError("rank 1 closed the connection"), [1])
    try:
        try:
            raise peer
        except DistNetworkError as exc:
            raise RuntimeError("the step failed") from exc
    except RuntimeError as exc:
        assert peer_failure(exc) == (1,)
        assert exception_record(exc)["message"]["extraInfo"]["peer_ranks"] == [1]
    try:
        try:
            raise peer
        except DistNetworkError:
            raise ValueError("unrelated") from None
    except ValueError as exc:
        assert peer_failure(exc) is None
        assert "peer_ranks" not in exception_record(exc)["message"]["extraInfo"]


def test_stderr_tail_is_bounded_and_times_the_exception_line():
    block = [line.encode() for line in _ASSERT_BLOCK]
    tail = StderrTail(max_lines=5, max_bytes=1000)
    tail.add([b"early"], 1.0)
    tail.add(block[:-1], 2.0)
    tail.add([b"ValueError: 1\r"], 3.0)
    assert tail.lines() == [*_ASSERT_BLOCK[1:-1], "ValueError: 1"]  # the last five
    assert tail.failure_time() is None  # its header is gone
    tail.add([b"x" * 10_000], 4.0)
    assert tail.lines() == ["x" * 1000]  # cut to the bound in bytes, which it fills
    whole = StderrTail()
    whole.add([b"early"], 1.0)
    whole.add(block[:-1], 2.0)
    whole.add([block[-1], b"exiting"], 3.0)
    assert whole.failure_time() == 3.0


def test_grouper_holds_a_traceback_until_its_exception_line():
    grouper = TracebackGrouper(max_bytes=10_000)
    block = [line.encode() for line in _ASSERT_BLOCK]
    assert grouper.feed([b"before"], 0.0) == [b"before"]
    assert grouper.feed(block[:3], 1.0) == [] and grouper.idle_since == 1.0
    assert grouper.feed([*block[3:], b"after"], 2.0) == [*block, b"after"]
    assert grouper.idle_since is None
    assert grouper.feed(block[:2], 3.0) == [] and grouper.flush() == block[:2]
    capped = TracebackGrouper(max_bytes=40)
    assert capped.feed(block[:2], 0.0) == block[:2]  # past the cap: shown as it stands


def _failure(tmp_path: Path, rank: int, message: str, at: float, peers=None) -> ProcessFailure:
    info = {"py_callstack": f"Traceback ...\n{message}\n", "timestamp_ns": str(int(at * 1e9))}
    if peers is not None:
        info["peer_ranks"] = peers
    path = tmp_path / f"error{rank}.json"
    path.write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))
    return ProcessFailure(rank, 100 + rank, 1, str(path), rank=rank)


def test_root_cause_is_the_first_failure_no_peer_caused(tmp_path):
    failures = {
        0: _failure(tmp_path, 0, "DistNetworkError: rank 1 closed the connection", 10.0, [1]),
        1: _failure(tmp_path, 1, "ValueError: bad", 11.0),
        2: _failure(tmp_path, 2, "DistNetworkError: rank 1 closed the connection", 9.0),
    }
    error = ChildFailedError("train.py", failures)
    assert error.get_first_failure()[0] == 1
    head, root = error.format_msg().split("Root Cause (first observed failure):")
    assert "[1]:" in root and "caused by" not in root
    assert head.count("caused by : a peer's failure (rank 1)") == 2  # marked, or recognised
    # when a peer caused every failure seen, the first of them
    del failures[1]
    assert ChildFailedError("train.py", failures).get_first_failure()[0] == 2
    # another node's view of it keeps the mark
    remote = ProcessFailure.from_record(json.loads(json.dumps(failures[0].to_record())))
    assert remote.peer_ranks == (1,)


def test_a_failure_without_a_record_is_read_from_its_stderr_tail():
    failure = ProcessFailure(0, 7, 1, stderr_tail=["warming up", *_ASSERT_BLOCK, "bye"])
    assert failure.message == "ValueError: 1"
    text = failure.traceback_text()
    assert text.splitlines() == [
        "(no recorded traceback; the last one in its stderr)",
        *_ASSERT_BLOCK,
    ]
    assert failure.peer_ranks is None
    quiet = ProcessFailure(0, 7, 1, stderr_tail=[])
    assert quiet.traceback_text() == NO_TRACEBACK and "--redirects" not in NO_TRACEBACK
    assert "@record" not in NO_TRACEBACK


def test_the_hook_records_then_chains_and_leaves_a_record_alone(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("DISTCOMM_ERROR_FILE", str(path))
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(args[1]))
    assert excepthook.install()
    try:
        assert isinstance(sys.excepthook, excepthook.RecordingHook)
        assert excepthook.install()  # once
        assert sys.excepthook.previous is not sys.excepthook
        error = caused_by_peers(DistNetworkError("rank 3 closed the connection"), [3])
        sys.excepthook(DistNetworkError, error, None)
        assert seen == [error]
        data = json.loads(path.read_text())
        assert data["message"]["message"] == "DistNetworkError: rank 3 closed the connection"
        assert data["message"]["extraInfo"]["peer_ranks"] == [3]
        path.write_text("written by @record")
        sys.excepthook(ValueError, ValueError("later"), None)
        assert path.read_text() == "written by @record" and len(seen) == 2
        path.unlink()
        sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)
        assert not path.exists() and len(seen) == 3
    finally:
        assert excepthook.uninstall()
    assert not isinstance(sys.excepthook, excepthook.RecordingHook)
    monkeypatch.delenv("DISTCOMM_ERROR_FILE")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert not excepthook.install(ErrorHandler())  # not launched: nothing to write to


# -- real jobs ----------------------------------------------------------------------------


def _split(stderr: str, name: str) -> tuple[str, dict[int, str], str]:
    """(the console before the report, rank -> its block, the root cause's rank)."""
    title = stderr.index(f"{name} FAILED\n")
    start = stderr.rfind("=" * 72, 0, title)
    console, report = stderr[:start], stderr[start:]
    head, _, root = report.partition("Root Cause (first observed failure):")
    blocks = {}
    for part in (head, root):
        for match in re.finditer(
            r"^\[(\d+)\]:\n(.*?)(?=^\[\d+\]:|^-{72}|^={72}|\Z)", part, re.M | re.S
        ):
            blocks[int(match[1])] = match[2]
    (root_rank,) = {int(r) for r in re.findall(r"^\[(\d+)\]:", root, re.M)}
    return console, blocks, root_rank


#: rank 1 raises before the all_reduce the others wait in (the README's first failure)
RAISES_BEFORE_ALL_REDUCE = """
    import numpy as np
    import distcomm as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("bad value on rank 1")
    dist.all_reduce(np.ones(4))
"""


def test_the_raising_rank_is_the_root_cause_with_its_traceback(tmp_path):
    """No flags, no @record: the report's root cause is the rank that raised, its
    ValueError traceback quoted; a rank that failed because of it is marked so."""
    path = script(tmp_path / "bad.py", RAISES_BEFORE_ALL_REDUCE)
    res = run_launcher(["--standalone", "--nproc_per_node=3", path.name], tmp_path)
    assert res.returncode == 1, res.stderr
    _, blocks, root = _split(res.stderr, "bad.py")
    assert root == 1, res.stderr
    assert "message   : ValueError: bad value on rank 1" in blocks[1], res.stderr
    assert 'raise ValueError("bad value on rank 1")' in blocks[1]
    assert "caused by" not in blocks[1]
    assert "@record" not in res.stderr and "--redirects" not in res.stderr
    for rank, block in blocks.items():
        if rank != 1:
            assert "caused by : a peer's failure (rank " in block, res.stderr


#: rank 1 leaves the group (the others fail at once, because of it), waits until they
#: have ended, then raises: the agent sees the failures it caused first
LEAVES_THEN_RAISES = """
    import os, sys, time
    from pathlib import Path
    import numpy as np
    import psutil
    import distcomm as dist

    out = Path(sys.argv[1])
    dist.init_process_group(sys.argv[2])
    rank, size = dist.get_rank(), dist.get_world_size()
    (out / f"pid_{rank}").write_text(str(os.getpid()))
    if rank != 1:
        dist.all_reduce(np.ones(4))
        raise SystemExit("not reached: rank 1 never joins")

    def ended(pid):
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    while len(list(out.glob("pid_*"))) < size:
        time.sleep(0.01)
    others = [int((out / f"pid_{r}").read_text()) for r in range(size) if r != 1]
    dist.destroy_process_group()
    while not all(ended(pid) for pid in others):
        time.sleep(0.01)
    raise ValueError("bad value on rank 1")
"""


@pytest.mark.parametrize("backend", ["gloo", "tcp"])
def test_ranks_failing_because_of_a_peer_are_marked(tmp_path, backend):
    """The ranks that fail because rank 1 left are marked in their blocks and in their
    error files, and rank 1, which failed after them, is still the root cause."""
    out = tmp_path / "out"
    out.mkdir()
    path = script(tmp_path / "leaves.py", LEAVES_THEN_RAISES)
    res = run_launcher(
        ["--standalone", "--nproc_per_node=3", "--log_dir=logs", path.name, str(out), backend],
        tmp_path,
    )
    assert res.returncode == 1, res.stderr
    _, blocks, root = _split(res.stderr, "leaves.py")
    assert sorted(blocks) == [0, 1, 2] and root == 1, res.stderr
    assert "message   : ValueError: bad value on rank 1" in blocks[1]
    for rank in (0, 2):
        assert re.search(r"caused by : a peer's failure \(rank [012]\)", blocks[rank]), res.stderr
        assert "DistNetworkError" in blocks[rank]
    for rank in (0, 1, 2):
        (error_file,) = (tmp_path / "logs").glob(f"*/attempt_0/{rank}/error.json")
        message = json.loads(error_file.read_text())["message"]
        assert ("peer_ranks" in message["extraInfo"]) is (rank != 1), message
        expected = "ValueError" if rank == 1 else "DistNetworkError"
        assert message["message"].startswith(expected), message


NEVER_IMPORTS_DISTCOMM = """
    import os, time
    if os.environ["RANK"] == "0":
        {}["missing-key"]
    time.sleep(120)  # until the agent ends it
"""


@pytest.mark.parametrize("flags", [[], ["--local_ranks_filter=1"]], ids=["shown", "hidden"])
def test_a_script_without_distcomm_has_its_traceback_quoted(tmp_path, flags):
    """A worker that never imports distcomm wrote no error file: the report quotes the
    traceback on its stderr, also for a rank whose output the console does not show."""
    path = script(tmp_path / "plain.py", NEVER_IMPORTS_DISTCOMM)
    res = run_launcher(["--standalone", "--nproc_per_node=2", *flags, path.name], tmp_path)
    assert res.returncode == 1, res.stderr
    console, blocks, root = _split(res.stderr, "plain.py")
    assert sorted(blocks) == [0] and root == 0, res.stderr
    assert "message   : KeyError: 'missing-key'" in blocks[0]
    assert "(no recorded traceback; the last one in its stderr)" in blocks[0]
    assert '{}["missing-key"]' in blocks[0]
    assert ("KeyError" in console) == (not flags), console


#: every rank raises at the same moment and writes its traceback slowly, in small pieces
#: (as a console under load would take it), keeping a copy in out/tb_<rank>
RAISE_AT_ONCE = """
    import os, sys, time, traceback
    from pathlib import Path

    out = Path(sys.argv[1])
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    def slow_hook(exc_type, exc, tb):
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        (out / f"tb_{rank}").write_text(text)
        for start in range(0, len(text), 7):
            sys.stderr.write(text[start:start + 7])
            sys.stderr.flush()
            time.sleep(0.002)

        (out / f"done_{rank}").write_text("")  # the agent ends the others once one ends
        while len(list(out.glob("done_*"))) < size:
            time.sleep(0.005)

    sys.excepthook = slow_hook
    CHAINS
    (out / f"ready_{rank}").write_text("")
    while len(list(out.glob("ready_*"))) < size:
        time.sleep(0.005)
    globals()[f"r{rank}_f0"]()
"""


def _chains(ranks: int, depth: int) -> str:
    """Functions r<rank>_f0 .. r<rank>_f<depth>: each rank's frames are its own."""
    lines = []
    for rank in range(ranks):
        for i in range(depth):
            lines.append(f"def r{rank}_f{i}(): r{rank}_f{i + 1}()")
        lines.append(f"def r{rank}_f{depth}(): raise TypeError('raised on rank {rank}')")
    return "\n".join(lines)


def test_tracebacks_of_ranks_failing_at_once_do_not_interleave(tmp_path):
    """Three ranks write their tracebacks at once, in pieces: each line of the console
    belongs to one rank, each traceback is one run of lines, and each is quoted."""
    out = tmp_path / "out"
    out.mkdir()
    path = tmp_path / "at_once.py"
    path.write_text(textwrap.dedent(RAISE_AT_ONCE).replace("CHAINS", _chains(3, 12)))
    res = run_launcher(["--standalone", "--nproc_per_node=3", path.name, str(out)], tmp_path)
    assert res.returncode == 1, res.stderr
    console, blocks, _ = _split(res.stderr, "at_once.py")
    tracebacks = {rank: (out / f"tb_{rank}").read_text() for rank in range(3)}
    known = {line for text in tracebacks.values() for line in text.splitlines()}
    ours = re.compile(r"r\d_f|Traceback|Error|File")
    mixed = [line for line in console.splitlines() if ours.search(line) and line not in known]
    assert not mixed, console
    for rank, text in tracebacks.items():
        assert text in console, f"rank {rank}'s traceback is not in one piece:\n{console}"
        if rank in blocks:  # the agent ended the ranks it had not seen fail yet
            assert f"message   : TypeError: raised on rank {rank}" in blocks[rank]
            assert f"in r{rank}_f12" in blocks[rank]


REDIRECTED = """
    import os
    print(f"out-{os.environ['RANK']}", flush=True)
    if os.environ["RANK"] == "1":
        raise ValueError("bad value on rank 1")
"""


@pytest.mark.parametrize("flag", ["--redirects=2", "--tee=2"])
def test_redirects_and_tee_still_work(tmp_path, flag):
    """--redirects=2 keeps stderr off the console and --tee=2 shows it prefixed; both
    write stderr.log, and the report quotes the traceback from that log by its path."""
    path = script(tmp_path / "redirected.py", REDIRECTED)
    res = run_launcher(
        ["--standalone", "--nproc_per_node=2", "--log_dir=logs", flag, path.name], tmp_path
    )
    assert res.returncode == 1, res.stderr
    console, blocks, root = _split(res.stderr, "redirected.py")
    assert root == 1 and sorted(blocks) == [1], res.stderr
    (log,) = (tmp_path / "logs").glob("*/attempt_0/1/stderr.log")
    assert "ValueError: bad value on rank 1" in log.read_text()
    assert "message   : ValueError: bad value on rank 1" in blocks[1]
    assert f"(no recorded traceback; the last one in {log})" in blocks[1]
    assert "out-0" in res.stdout and "out-1" in res.stdout  # stdout as before
    if flag == "--redirects=2":
        assert "ValueError" not in console, console
    else:
        assert "[default1]:ValueError: bad value on rank 1" in console.splitlines(), console


CHAINED_HOOK = """
    import os, sys
    from pathlib import Path
    import distcomm as dist
    from distcomm.launch.errors import ErrorHandler, record

    def mine(exc_type, exc, tb):
        Path(sys.argv[1]).write_text(f"custom hook saw {{exc_type.__name__}}")
        sys.__excepthook__(exc_type, exc, tb)

    sys.excepthook = mine

    class Handler(ErrorHandler):
        def record_exception(self, e):
            self._write_error_file(self._get_error_file_path(),
                                   '{{"message": {{"message": "from @record"}}}}')

    def main():
        dist.init_process_group("gloo")
        raise ValueError("bad value")

    {call}
"""


def test_the_exception_hook_chains_to_the_hook_before_it(tmp_path):
    """init_process_group's hook writes the error file and then calls the hook the script
    installed before; an error file @record wrote is left as it is."""
    for decorated in (False, True):
        run = tmp_path / ("record" if decorated else "hook")
        run.mkdir()
        marker = run / "marker"
        call = "record(main, error_handler=Handler())()" if decorated else "main()"
        path = script(run / "hooked.py", CHAINED_HOOK.format(call=call))
        res = run_launcher(
            ["--standalone", "--nproc_per_node=1", "--log_dir=logs", path.name, str(marker)],
            run,
        )
        assert res.returncode == 1, res.stderr
        assert marker.read_text() == "custom hook saw ValueError"
        (error_file,) = (run / "logs").glob("*/attempt_0/0/error.json")
        data = json.loads(error_file.read_text())
        if decorated:
            assert data == {"message": {"message": "from @record"}}
            continue
        assert data["message"]["message"] == "ValueError: bad value"
        assert 'raise ValueError("bad value")' in data["message"]["extraInfo"]["py_callstack"]
        assert f"error_file: {error_file}" in res.stderr


PRINTS_AT_ONCE = """
    import os
    rank = os.environ["RANK"]
    for i in range(3000):  # a line in pieces, as print under -u writes text, then newline
        for piece in (f"rank {rank} ", f"line {i} ", "x" * 40, "\\n"):
            os.write(1, piece.encode())
            os.sched_yield()
"""


def test_printed_lines_of_ranks_printing_at_once_never_mix(tmp_path):
    """stdout, unprefixed and not teed, reaches the console as whole lines of one rank."""
    path = script(tmp_path / "prints.py", PRINTS_AT_ONCE)
    res = run_launcher(["--standalone", "--nproc_per_node=3", path.name], tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    whole = re.compile(r"rank [012] line \d+ x{40}")
    assert all(whole.fullmatch(line) for line in lines), [
        line for line in lines if not whole.fullmatch(line)
    ][:5]
    assert len(lines) == 9000, len(lines)
