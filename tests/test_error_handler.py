"""Tests of `record`'s ErrorHandler (torch.distributed.elastic.multiprocessing.errors' API)."""

from __future__ import annotations

import inspect
import json
import logging

import pytest

from distcomm.launch import errors
from distcomm.launch.errors import (
    ChildFailedError,
    ErrorHandler,
    ProcessFailure,
    get_error_handler,
    record,
)


@pytest.fixture
def error_file(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    path = tmp_path / "error.json"
    monkeypatch.setenv("DISTCOMM_ERROR_FILE", str(path))
    return path


class Recording(ErrorHandler):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def initialize(self) -> None:
        self.calls.append(("initialize",))

    def record_exception(self, e: BaseException) -> None:
        self.calls.append(("record_exception", e))
        super().record_exception(e)

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        self.calls.append(("dump_error_file", rootcause_error_file, error_code))
        super().dump_error_file(rootcause_error_file, error_code)


def test_get_error_handler_returns_an_error_handler():
    handler = get_error_handler()
    assert type(handler) is ErrorHandler
    assert get_error_handler() is not handler  # a new one each time, as torch's


def test_record_uses_the_custom_handler(error_file):
    handler = Recording()

    def main(x: int) -> int:
        if x < 0:
            raise ValueError(f"bad x {x}")
        return x * 2

    wrapped = record(main, error_handler=handler)
    assert wrapped(3) == 6
    assert handler.calls == [("initialize",)]
    with pytest.raises(ValueError, match="bad x -1") as info:
        wrapped(-1)
    assert handler.calls[1:] == [("initialize",), ("record_exception", info.value)]
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == "ValueError: bad x -1"
    stack = message["extraInfo"]["py_callstack"]
    assert "in main" in stack and "in wrapper" not in stack  # from `fn` down
    # the re-raised exception keeps its whole traceback
    assert info.traceback[-1].name == "main"


def test_record_dumps_a_child_failure_through_the_handler(error_file, tmp_path):
    child = tmp_path / "child.json"
    child.write_text(json.dumps({"message": {"message": "KeyError: 'k'", "extraInfo": {}}}))
    failure = ProcessFailure(0, 4242, -11, str(child), rank=5)
    handler = Recording()

    def agent_main() -> None:
        raise ChildFailedError("train.py", {5: failure})

    with pytest.raises(ChildFailedError):
        record(agent_main, handler)()
    assert handler.calls[1:] == [("dump_error_file", str(child), -11)]
    assert json.loads(error_file.read_text()) == {
        "message": {"message": "KeyError: 'k'", "extraInfo": {}, "errorCode": -11}
    }


def test_record_of_a_failure_whose_file_is_gone(error_file, tmp_path):
    """A root cause read earlier (its file since removed, or on another node) is written."""
    child = tmp_path / "child.json"
    child.write_text(json.dumps({"message": {"message": "OSError: disk", "extraInfo": {}}}))
    failure = ProcessFailure(1, 77, 1, str(child), rank=9, host="node-b")
    child.unlink()

    def agent_main() -> None:
        raise ChildFailedError("train.py", {9: failure})

    with pytest.raises(ChildFailedError):
        record(agent_main)()
    assert json.loads(error_file.read_text())["message"]["message"] == "OSError: disk"


def test_a_failing_handler_never_hides_the_exception(error_file, caplog):
    class Broken(ErrorHandler):
        def record_exception(self, e: BaseException) -> None:
            raise RuntimeError("handler bug")

    def main() -> None:
        raise ValueError("the original")

    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="the original"):
        record(main, error_handler=Broken())()
    assert "error handler Broken failed (RuntimeError: handler bug)" in caplog.text


def test_record_rejects_bad_arguments():
    with pytest.raises(TypeError, match="decorates a function"):
        record(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="initialize, record_exception, dump_error_file"):
        record(print, error_handler=object())  # type: ignore[arg-type]


def test_handler_methods(error_file, tmp_path):
    handler = ErrorHandler()
    assert handler._get_error_file_path() == str(error_file)
    handler.initialize()
    data = {"message": {"message": "x"}}
    handler.override_error_code_in_rootcause_data("f", data, 3)
    assert data == {"message": {"message": "x", "errorCode": 3}}
    cpp = {"message": "c++ layout"}
    handler.override_error_code_in_rootcause_data("f", cpp, 3)
    assert cpp == {"message": "c++ layout"}
    child = tmp_path / "child.json"
    child.write_text(json.dumps(cpp))
    handler.dump_error_file(str(child))  # error_code 0: copied as it is
    assert json.loads(error_file.read_text()) == cpp
    with pytest.raises(FileNotFoundError):
        handler.dump_error_file(str(tmp_path / "missing.json"), 1)


def test_handler_without_an_error_file_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.delenv("DISTCOMM_ERROR_FILE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    handler = ErrorHandler()
    assert handler._get_error_file_path() is None
    handler.record_exception(ValueError("x"))
    assert list(tmp_path.iterdir()) == []


def test_process_failure_takes_torchs_field_order(tmp_path):
    failure = ProcessFailure(2, 1234, -9, "")
    assert (failure.local_rank, failure.rank, failure.pid, failure.exitcode) == (2, 2, 1234, -9)
    assert failure.error_file_data == {"message": "<NONE>"}
    assert failure.signal_name() == "SIGKILL"
    # our former order (local_rank, rank, pid, exitcode, error_file) fails loudly
    with pytest.raises(TypeError, match=r"rank must be an int, got .file.; the fields"):
        ProcessFailure(0, 3, 99, 1, "file")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="exitcode must be an int or None"):
        ProcessFailure(0, 1, "1")  # type: ignore[arg-type]


def test_format_msg_takes_torchs_parameter_names():
    error = ChildFailedError("x", {0: ProcessFailure(0, 1, 1)})
    text = error.format_msg(boarder_delim="#", section_delim="~")
    assert text.startswith("#" * 10) and "~" * 10 in text


_TORCH_ERRORS = "torch.distributed.elastic.multiprocessing.errors"


def _params(obj) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(obj).parameters.values()]


@pytest.mark.parametrize(
    "name",
    [
        "record",
        "get_error_handler",
        "ErrorHandler",
        "ChildFailedError",
        "ChildFailedError.get_first_failure",
        "ChildFailedError.format_msg",
        "ProcessFailure.signal_name",
        "ProcessFailure.timestamp_isoformat",
        *(
            f"ErrorHandler.{method}"
            for method in (
                "initialize",
                "record_exception",
                "override_error_code_in_rootcause_data",
                "dump_error_file",
                "_get_error_file_path",
                "_write_error_file",
            )
        ),
    ],
)
def test_signature_matches_torch(name):
    torch_errors = pytest.importorskip(_TORCH_ERRORS)
    ours, theirs = errors, torch_errors
    for part in name.split("."):
        ours, theirs = getattr(ours, part), getattr(theirs, part)
    assert _params(ours) == _params(theirs)


def test_process_failure_starts_with_torchs_fields():
    torch_errors = pytest.importorskip(_TORCH_ERRORS)
    theirs = _params(torch_errors.ProcessFailure)
    assert [name for name, _, _ in _params(ProcessFailure)[: len(theirs)]] == [
        name for name, _, _ in theirs
    ]
    assert set(torch_errors.__all__) <= set(errors.__all__)
