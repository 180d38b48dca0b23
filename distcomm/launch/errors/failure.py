"""`ProcessFailure`: one failed worker as the agent saw it, read from its error file (or,
when it recorded nothing, from the tail of its stderr), and `exit_description`.

The error file is the one torchelastic uses, so a script decorated with torch's
`@record` works under distcomm-run and ours under torchrun::

    {"message": {"message": "ValueError: bad input",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1718000000",
                               "timestamp_ns": "1718000000123456789"}}}

``timestamp_ns`` is our addition (torch reads and ignores extra keys): two ranks that fail
within the same second are still told apart when the agent picks the root cause. A file
whose ``message`` is a plain string (torch's C++ error layout, with a top-level
``timestamp``) is read too. A file that is JSON but has no ``message`` was not written by
an error handler and is refused (`ValueError`), as torch refuses it; one that is not JSON
(a torch worker killed while writing it) is reported as unreadable instead.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ...procutil import signal_name
from ..error_handler import ERROR_FILE_ENV, TORCH_ERROR_FILE_ENV
from ..tracebacks import (
    TAIL_LINES,
    exception_lines,
    last_traceback,
    peer_failure_in,
    peer_failure_in_traceback,
)

__all__ = [
    "NOT_AVAILABLE",
    "NOT_KEPT",
    "NO_RECORDED_TRACEBACK",
    "NO_TRACEBACK",
    "ProcessFailure",
    "exit_description",
]

#: the lines of a worker's stderr the report shows when it recorded no traceback and
#: its stderr holds none either
_TAIL_LINES = 20
#: the traceback shown for a worker that wrote neither an error file nor to stderr
NO_TRACEBACK = "(no traceback: the worker wrote no error file and nothing to stderr)"
#: the traceback shown for a worker whose error file holds a message but no traceback
NO_RECORDED_TRACEBACK = "(the worker's error file holds no traceback; see message)"
#: the report's value for a log or error file in the launcher's temporary directory
NOT_KEPT = "<not kept: pass --log_dir to keep it>"
#: `ProcessFailure.error_file` of a worker that wrote no error file (torch's value)
NOT_AVAILABLE = "<N/A>"


#: the most characters of a traceback passed to the other nodes (its end is kept)
_RECORD_TRACEBACK_CHARS = 64 * 1024


def exit_description(code: int | None) -> str:
    """Describe a process's exit status the way Popen reports it.

    Args:
        code: the exit code; negative for "killed by signal -code"; None while running.

    Returns:
        "exit code 1", "signal SIGKILL (-9)" or "still running". A code above 128 that is
        128 plus a signal number (what a shell reports for a child killed by that signal)
        names the signal too: "exit code 137 (128+SIGKILL)".
    """
    if code is None:
        return "still running"
    if code < 0:
        return f"signal {signal_name(-code) or -code} ({code})"
    name = signal_name(code - 128) if 128 < code < 256 else ""
    return f"exit code {code} (128+{name})" if name else f"exit code {code}"


@dataclass
class ProcessFailure:
    """One worker that failed (or that the agent had to end), as the agent observed it.

    The recorded error (message, traceback, time) is read from `error_file` once, when the
    object is made, so the report survives the file's removal. The first four fields
    are torch's, in torch's order.

    Attributes:
        local_rank: the worker's rank on this node.
        pid: its process id.
        exitcode: its exit status as Popen reports it (negative: killed by that signal;
            None: still running when observed, e.g. ended by the agent afterwards).
        error_file: the file its `@record` writes to; "<N/A>" (`NOT_AVAILABLE`) when it
            wrote none (given as "" or a path that does not exist), as in torch.
        rank: its global rank; default: `local_rank` (one node).
        host: the node's host name.
        role: the worker group's role.
        log_files: its kept output, by stream name ("stdout", "stderr") -> path.
        reason: why the agent counts it as failed, beyond the exit status (e.g.
            "expiration timer 'stuck' expired").
        timestamp: whole seconds since the epoch (an int, as torch's): the recorded
            failure time if the error file has one, else the given time of observation (a
            float may be given), else the time this was made. The root cause is chosen
            on the finer time behind it (the file's ``timestamp_ns``, the given float), so
            ranks failing within one second are still told apart.
        files_kept: whether `error_file` and `log_files` outlive the launcher. False when
            they are in its temporary directory (no --log_dir), which it removes on exit:
            the report then names none of them.
        stderr_tail: the last lines of its stderr (without line ends) as the agent kept
            them; None: read them from the stderr log of `log_files`, if there is one.

    Without a recorded error, the message and traceback come from the last traceback in
    the stderr tail.

    Raises:
        TypeError: a field of torch's has the wrong type.
        ValueError: the error file is JSON without a ``message`` (torch refuses it too):
            it was not written by an `ErrorHandler`.
    """

    local_rank: int
    pid: int
    exitcode: int | None
    error_file: str = ""
    rank: int = None  # type: ignore[assignment] - set to local_rank when not given
    host: str = ""
    role: str = "default"
    log_files: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    timestamp: int = None  # type: ignore[assignment] - set in __post_init__
    files_kept: bool = True
    stderr_tail: list[str] | None = None
    error_data: dict[str, Any] | None = field(default=None, init=False, repr=False)
    _error_problem: str = field(default="", init=False, repr=False)
    _time: float = field(default=0.0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.rank is None:
            self.rank = self.local_rank
        for name, value, types, what in (
            ("local_rank", self.local_rank, int, "an int"),
            ("rank", self.rank, int, "an int"),
            ("pid", self.pid, int, "an int"),
            ("exitcode", self.exitcode, (int, type(None)), "an int or None"),
            ("error_file", self.error_file, str, "a str"),
        ):
            if isinstance(value, bool) or not isinstance(value, types):
                raise TypeError(
                    f"ProcessFailure.{name} must be {what}, got {value!r}; the fields are "
                    f"(local_rank, pid, exitcode, error_file, rank, ...), torch's order first"
                )
        if self.timestamp is not None and (
            isinstance(self.timestamp, bool) or not isinstance(self.timestamp, (int, float))
        ):
            raise TypeError(
                f"ProcessFailure.timestamp must be seconds since the epoch (int or float) or "
                f"None, got {self.timestamp!r}"
            )
        if not self.error_file or not os.path.isfile(self.error_file):
            self.error_file = NOT_AVAILABLE
        recorded = self._read_error_file()
        if recorded is not None:
            self._time = recorded
        elif self.timestamp is not None:
            self._time = float(self.timestamp)
        else:
            self._time = time.time()
        self.timestamp = int(self._time)

    def _read_error_file(self) -> float | None:
        """Load `error_file`; return the failure time it records, if any.

        Raises:
            ValueError: the file is JSON but has no ``message``.
        """
        if self.error_file == NOT_AVAILABLE or not os.path.isfile(self.error_file):
            return None
        try:
            with open(self.error_file, encoding="utf-8") as fp:
                data = json.load(fp)
        except (OSError, ValueError) as exc:
            self._error_problem = f"error file {self.error_file} is unreadable ({exc!r})"
            return None
        if not isinstance(data, dict) or "message" not in data:
            raise ValueError(
                f"error file {self.error_file} of rank {self.rank} (pid {self.pid}) has no "
                f"'message' field, so no error handler wrote it; an error file holds "
                f'{{"message": ...}} as ErrorHandler.record_exception writes it (use '
                f"@record), and nothing else may write to the file named by "
                f"{ERROR_FILE_ENV} or {TORCH_ERROR_FILE_ENV}"
            )
        try:
            message = data["message"]
            info = message.get("extraInfo", {}) if isinstance(message, dict) else data
            if isinstance(message, dict) and "message" not in message:
                raise KeyError("message.message")
        except (KeyError, TypeError, AttributeError) as exc:
            self._error_problem = f"error file {self.error_file} is unreadable ({exc!r})"
            return None
        self.error_data = data
        try:
            if "timestamp_ns" in info:
                return int(info["timestamp_ns"]) / 1e9
            if "timestamp" in info:
                return float(int(info["timestamp"]))
        except (TypeError, ValueError):
            pass
        return None

    @property
    def error_file_data(self) -> dict[str, Any]:
        """The error file's content (torch's name), or torch's ``{"message": "<NONE>"}``."""
        return self.error_data if self.error_data is not None else {"message": "<NONE>"}

    def signal_name(self) -> str:
        """The name of the signal that ended the worker ("SIGKILL"), or "<N/A>" (torch's)."""
        if self.exitcode is not None and self.exitcode < 0:
            return signal_name(-self.exitcode) or str(-self.exitcode)
        return "<N/A>"

    def _recorded(self) -> tuple[str, dict[str, Any]] | None:
        """The recorded message and extraInfo, when the error file was read."""
        if self.error_data is None:
            return None
        message = self.error_data["message"]
        if isinstance(message, dict):
            info = message.get("extraInfo")
            return str(message["message"]), info if isinstance(info, dict) else {}
        return str(message), {}

    @property
    def message(self) -> str:
        """The recorded exception ("ValueError: bad input"), else the exception line of
        the last traceback on its stderr, else a description of the exit."""
        recorded = self._recorded()
        if recorded is not None:
            return recorded[0]
        raised = exception_lines(self._stderr_traceback())
        if raised:
            text = raised[-1]
        elif self.exitcode is None:
            text = f"process {self.pid} was still running"
        else:
            text = f"process {self.pid} ended with {exit_description(self.exitcode)}"
        return f"{text}; {self._error_problem}" if self._error_problem else text

    @property
    def peer_ranks(self) -> tuple[int, ...] | None:
        """The ranks whose failure caused this one (() when unknown), or None: it failed
        on its own account.

        Read from the error file (``peer_ranks``, written by the exception hook and
        `@record`), else recognised in the recorded error's text or the stderr's last
        traceback (distcomm's messages for a peer that closed its connection, left or
        aborted the group, or a store that closed its connection).
        """
        recorded = self._recorded()
        if recorded is not None:
            message, info = recorded
            ranks = info.get("peer_ranks")
            if isinstance(ranks, list):
                return tuple(r for r in ranks if isinstance(r, int))
            stack = str(info.get("py_callstack") or "").splitlines()
            bounds = last_traceback(stack)
            if bounds is not None:
                found = peer_failure_in_traceback(stack[bounds[0] : bounds[1]])
                if found is not None:
                    return found
            return peer_failure_in(message)
        block = self._stderr_traceback()
        return peer_failure_in_traceback(block) if block else None

    def _stderr_lines(self) -> list[str]:
        """`stderr_tail`, or the end of the stderr log when there is none ([] without).

        Raises:
            OSError: the log exists but cannot be read.
        """
        if self.stderr_tail is not None:
            return self.stderr_tail
        stderr = self.log_files.get("stderr", "")
        if not stderr or not os.path.isfile(stderr):
            return []
        with open(stderr, encoding="utf-8", errors="replace") as fp:
            return [line.rstrip("\r\n") for line in deque(fp, maxlen=TAIL_LINES)]

    def _stderr_traceback(self) -> list[str]:
        """The last traceback on its stderr (with those chained before it), or []."""
        try:
            lines = self._stderr_lines()
        except OSError:
            return []
        bounds = last_traceback(lines)
        return [] if bounds is None else lines[bounds[0] : bounds[1]]

    def capture_logs(self) -> None:
        """Read the end of the stderr log now into `stderr_tail`, for the report once the
        log is removed (the agent calls it before it removes its temporary directory).
        Nothing happens when the tail is already kept, or the log is missing or unreadable."""
        if self.stderr_tail is not None:
            return
        try:
            lines = self._stderr_lines()
        except OSError:
            return  # traceback_text tries again, and says why it cannot
        if lines:
            self.stderr_tail = lines

    def traceback_text(self, tail: int = _TAIL_LINES) -> str:
        """The traceback the worker recorded; else the last traceback on its stderr; else
        the last `tail` lines of its stderr.

        Args:
            tail: how many lines of stderr to show when it holds no traceback.

        Returns:
            The text; when there is nothing, a line saying so.
        """
        recorded = self._recorded()
        if recorded is not None and recorded[1].get("py_callstack"):
            return str(recorded[1]["py_callstack"]).rstrip("\n")
        stderr = self.log_files.get("stderr", "")
        try:
            lines = self._stderr_lines()
        except OSError as exc:
            return f"(could not read {stderr}: {exc})"
        where = stderr if stderr and self.files_kept else "its stderr"
        bounds = last_traceback(lines)
        if bounds is not None:
            block = lines[bounds[0] : bounds[1]]
            return f"(no recorded traceback; the last one in {where})\n" + "\n".join(block)
        if lines:
            shown = lines[-max(tail, 1) :]
            return f"(no recorded traceback; last {len(shown)} lines of {where})\n" + "\n".join(
                shown
            )
        if self.error_data is not None or self._error_problem:
            return NO_RECORDED_TRACEBACK
        return NO_TRACEBACK

    def to_record(self, tail: int = 20) -> dict[str, Any]:
        """This failure as JSON-ready data, for the agents of other nodes (`from_record`).

        The message and the traceback (or the stderr tail) are read here, where the files
        are; the paths are kept only to be shown.
        """
        peers = self.peer_ranks
        return {
            "local_rank": self.local_rank,
            "rank": self.rank,
            "pid": self.pid,
            "exitcode": self.exitcode,
            "error_file": self.error_file,
            "host": self.host,
            "role": self.role,
            "log_files": dict(self.log_files),
            "reason": self.reason,
            "timestamp": self._time,
            "files_kept": self.files_kept,
            "message": self.message,
            "traceback": self.traceback_text(tail)[-_RECORD_TRACEBACK_CHARS:],
            "peer_ranks": None if peers is None else list(peers),
        }

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> ProcessFailure:
        """A failure observed on another node, from its `to_record()` data.

        Raises:
            KeyError, TypeError, ValueError: `data` is not such a record.
        """
        failure = cls(
            local_rank=int(data["local_rank"]),
            rank=int(data["rank"]),
            pid=int(data["pid"]),
            exitcode=None if data["exitcode"] is None else int(data["exitcode"]),
            host=str(data["host"]),
            role=str(data["role"]),
            reason=str(data["reason"]),
            timestamp=float(data["timestamp"]),
        )
        # set after __post_init__: the files are on the other node, not to be read here
        failure.error_file = str(data["error_file"])
        failure.log_files = {str(k): str(v) for k, v in data["log_files"].items()}
        failure.files_kept = bool(data.get("files_kept", True))
        info: dict[str, Any] = {"py_callstack": str(data["traceback"])}
        peers = data.get("peer_ranks")
        if peers is not None:
            info["peer_ranks"] = [int(rank) for rank in peers]
        failure.error_data = {"message": {"message": str(data["message"]), "extraInfo": info}}
        return failure

    def timestamp_isoformat(self) -> str:
        """The failure time as local "YYYY-MM-DD_HH:MM:SS" (torch's format)."""
        return datetime.fromtimestamp(self.timestamp or 0).isoformat(sep="_", timespec="seconds")
