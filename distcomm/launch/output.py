"""Route the output of a node's workers to log files and the agent's console.

Output follows torchrun's flags. For each worker and stream (stdout, stderr):

- ``--redirects``: the stream goes to ``<log_dir>/<local_rank>/stdout.log`` (or
  ``stderr.log``) only; the worker writes the file itself (no copying by the agent).
- ``--tee``: the stream goes to that file and to the agent's console, each console line
  starting with the worker's prefix (e.g. ``[default0]:``).
- neither: the stream reaches the console: the agent copies it line by line, prefixed
  when a prefix is given (stderr also feeds the failure report's tail; see below).
- ``--local_ranks_filter``: ranks left out never reach the console (their stdout goes to
  /dev/null, their stderr only to the agent's tail, unless redirected or teed, which
  still write the files).
- ``--duplicate_stdout_filters`` / ``--duplicate_stderr_filters`` (torchrun's): the lines
  of teed streams shown on the console that contain any of the filter strings are also
  written, prefixed, to ``<log_dir>/filtered_stdout.log`` (``filtered_stderr.log``), one
  file for all the node's workers. As in torchrun, only teed streams are filtered: lines
  of a stream that is not teed, or of a rank left out by ``--local_ranks_filter``, are not.

Lines are written whole under one lock, so lines of different workers never mix within
a line. A partial last line is written once the worker ends, or after
`PARTIAL_LINE_FLUSH_S` without more output, or once it reaches `MAX_LINE_BYTES`. Output
is handled as bytes, so any encoding passes through unchanged.

A worker's stderr always passes through the agent, except where it goes only to its log
file (then the report reads that file): the pump keeps its last lines (a `StderrTail`,
for the failure report) and shows a Python traceback on the console as one unit, from
its ``Traceback (most recent call last):`` line to its exception line
(`TracebackGrouper`), so that the tracebacks of workers failing at once do not interleave.
A traceback is shown as it stands after `PARTIAL_LINE_FLUSH_S` without more output.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import re
import select
import sys
import threading
import time
from collections.abc import Iterable
from typing import IO

from .tracebacks import StderrTail, TracebackGrouper
from .wording import torch_message

__all__ = [
    "MAX_LINE_BYTES",
    "PARTIAL_LINE_FLUSH_S",
    "Duplicate",
    "Pump",
    "Std",
    "parse_local_ranks_filter",
    "parse_std",
]

log = logging.getLogger("distcomm.launch.workers")

#: seconds a partial (unterminated) output line waits for its end before it is shown anyway
PARTIAL_LINE_FLUSH_S = 1.0
#: a prefixed line longer than this is shown in pieces
MAX_LINE_BYTES = 64 * 1024

_READ_SIZE = 64 * 1024

#: serializes whole-line writes to the agent's console across all workers and instances
_CONSOLE_LOCK = threading.Lock()

_STD_FORMS = (
    "one value for every local rank (e.g. 3) or local_rank:value pairs "
    "(e.g. 0:3,1:1), where 0 = none, 1 = stdout, 2 = stderr, 3 = both"
)


class Std(enum.IntEnum):
    """Which of a worker's streams a flag applies to (a bit set: OUT | ERR == ALL)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


def parse_std(
    spec: str,
    local_world_size: int,
    flag: str = "--redirects/--tee",
) -> dict[int, Std]:
    """Parse a ``--redirects`` or ``--tee`` value into local rank -> Std.

    Args:
        spec: "3" (every local rank), "0:3,1:1" (those ranks; the others NONE) or ""
            (NONE everywhere).
        local_world_size: the number of workers on this node.
        flag: the flag's name, for the error message.

    Returns:
        A Std for every local rank 0..local_world_size-1.

    Raises:
        ValueError: `spec` has another form, a value outside 0..3, a local rank outside
            0..local_world_size-1, or a rank twice.
    """
    text = spec.strip()

    def bad(problem: str) -> ValueError:
        return ValueError(f"{flag}={spec!r}: {problem}; expected {_STD_FORMS}")

    def value(token: str) -> Std:
        if int(token) > Std.ALL:
            raise bad(f"{token} is not a stream selection 0..3")
        return Std(int(token))

    result = dict.fromkeys(range(local_world_size), Std.NONE)
    if not text:
        return result
    if re.fullmatch(r"\d+", text):
        return dict.fromkeys(range(local_world_size), value(text))
    seen: set[int] = set()
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", item)
        if match is None:
            raise bad(f"cannot read {item.strip()!r}")
        local_rank = int(match[1])
        if local_rank >= local_world_size:
            raise bad(
                f"local rank {local_rank} is outside 0..{local_world_size - 1} "
                f"({local_world_size} workers per node)"
            )
        if local_rank in seen:
            raise bad(f"local rank {local_rank} appears twice")
        seen.add(local_rank)
        result[local_rank] = value(match[2])
    return result


def parse_local_ranks_filter(spec: str, local_world_size: int) -> set[int] | None:
    """Parse ``--local_ranks_filter``: the local ranks whose output reaches the console.

    Args:
        spec: comma-separated local ranks ("0,2"), or "" for all.
        local_world_size: the number of workers on this node.

    Returns:
        The set of local ranks, or None for all of them.

    Raises:
        ValueError: an entry is not a local rank in 0..local_world_size-1.
    """
    text = spec.strip()
    if not text:
        return None
    ranks = set()
    for item in text.split(","):
        token = item.strip()
        if not token.isdigit():
            raise ValueError(
                torch_message(
                    "--local_ranks_filter must be a comma-separated list of integers e.g. "
                    "--local_ranks_filter=0,1,2",
                    f"--local_ranks_filter={spec!r}",
                    f"{token!r} is not an integer; give local ranks in "
                    f"0..{local_world_size - 1}, or nothing for all ranks",
                )
            )
        if int(token) >= local_world_size:
            raise ValueError(
                f"--local_ranks_filter={spec!r}: {token!r} is not a local rank in "
                f"0..{local_world_size - 1}; it must be a comma-separated list of integers, "
                f"the local ranks (e.g. 0,2), or nothing for all ranks"
            )
        ranks.add(int(token))
    return ranks


class Duplicate:
    """A ``filtered_<stream>.log`` file: the lines containing any of the filter strings."""

    def __init__(self, path: str, needles: Iterable[str]) -> None:
        self.path = path
        self.needles = [needle.encode("utf-8", "surrogateescape") for needle in needles]
        self.file: IO[bytes] | None = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.lock = threading.Lock()

    def write(self, lines: list[bytes]) -> None:
        """Write the (prefixed, newline-ended) lines that match."""
        chosen = b"".join(line for line in lines if any(n in line for n in self.needles))
        if not chosen:
            return
        with self.lock:
            if self.file is None:
                return
            try:
                self.file.write(chosen)
                self.file.flush()
            except (OSError, ValueError) as exc:
                log.warning("writing %s failed (%s); no more lines go there", self.path, exc)
                self.close_locked()

    def close_locked(self) -> None:
        file, self.file = self.file, None
        if file is not None:
            with contextlib.suppress(OSError, ValueError):
                file.close()

    def close(self) -> None:
        with self.lock:
            self.close_locked()


class Pump:
    """Copies one worker stream from its pipe to a log file and/or the agent's console.

    With `tail`, it also keeps the stream's last lines there; with `group_tracebacks`,
    tracebacks reach the console (and the duplicate file) whole (see the module doc).
    """

    def __init__(
        self,
        source: IO[bytes],
        file: IO[bytes] | None,
        console: str | None,
        prefix: str,
        wake_fd: int,
        name: str,
        duplicate: Duplicate | None = None,
        *,
        tail: StderrTail | None = None,
        group_tracebacks: bool = False,
    ) -> None:
        self.source, self.file, self.console = source, file, console
        self.duplicate = duplicate
        self.tail = tail
        self.grouper = TracebackGrouper() if group_tracebacks else None
        self.prefix = prefix.encode("utf-8", "surrogateescape")
        self.wake_fd, self.name = wake_fd, name
        self.thread = threading.Thread(target=self._run, name=f"distcomm-{name}", daemon=True)

    def _run(self) -> None:
        fd = self.source.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(self.wake_fd, select.POLLIN)
        pending, pending_since = b"", 0.0
        try:
            while True:
                due = [pending_since + PARTIAL_LINE_FLUSH_S] if pending else []
                held = self.grouper.idle_since if self.grouper is not None else None
                if held is not None:
                    due.append(held + PARTIAL_LINE_FLUSH_S)
                timeout_ms = None
                if due:
                    timeout_ms = max(0, int((min(due) - time.monotonic()) * 1000) + 1)
                ready = {ready_fd for ready_fd, _ in poller.poll(timeout_ms)}
                if not ready:  # a partial line, or a traceback held back, waited long enough
                    now = time.monotonic()
                    if pending and now >= pending_since + PARTIAL_LINE_FLUSH_S:
                        self._lines(pending + b"\n")
                        pending = b""
                    if held is not None and now >= held + PARTIAL_LINE_FLUSH_S:
                        self._show(self.grouper.flush())  # type: ignore[union-attr]
                    continue
                if fd in ready:
                    chunk = os.read(fd, _READ_SIZE)
                    if not chunk:
                        break
                    self._save(chunk)
                    if any(x is not None for x in (self.console, self.duplicate, self.tail)):
                        now = time.monotonic()
                        if not pending:
                            pending_since = now
                        pending += chunk
                        cut = pending.rfind(b"\n") + 1
                        if cut:
                            self._lines(pending[:cut])
                            pending, pending_since = pending[cut:], now
                        if len(pending) >= MAX_LINE_BYTES:
                            self._lines(pending + b"\n")
                            pending = b""
                if self.wake_fd in ready:  # close() gave up waiting for end-of-file
                    break
        except OSError as exc:
            log.warning("%s: reading the worker's output failed: %s", self.name, exc)
        finally:
            if pending:
                self._lines(pending + b"\n")
            if self.grouper is not None:
                self._show(self.grouper.flush())
            self.source.close()
            if self.file is not None:
                self.file.close()

    def _save(self, chunk: bytes) -> None:
        if self.file is None:
            return
        try:
            self.file.write(chunk)
            self.file.flush()
        except (OSError, ValueError) as exc:
            log.warning(
                "%s: writing %s failed (%s); its output reaches the file no more",
                self.name,
                getattr(self.file, "name", "the log file"),
                exc,
            )
            with contextlib.suppress(OSError, ValueError):
                self.file.close()
            self.file = None

    def _lines(self, data: bytes) -> None:
        """Take complete lines (each ending in newline): keep them in the tail, and show
        them (a traceback once it is whole)."""
        lines = data.split(b"\n")[:-1]
        if self.tail is not None:
            self.tail.add(lines, time.time())
        if self.grouper is not None:
            lines = self.grouper.feed(lines, time.monotonic())
        self._show(lines)

    def _show(self, lines: list[bytes]) -> None:
        """Write lines (without their newlines) to the console, prefixed, at once; and
        those that match to the duplicate file."""
        if not lines or (self.console is None and self.duplicate is None):
            return
        each = [self.prefix + line + b"\n" for line in lines]
        if self.duplicate is not None:
            self.duplicate.write(each)
        if self.console is None:
            return
        data = b"".join(each)
        try:
            with _CONSOLE_LOCK:
                stream = sys.stdout if self.console == "stdout" else sys.stderr
                buffer = getattr(stream, "buffer", None)
                stream.flush()
                if buffer is not None:
                    buffer.write(data)
                    buffer.flush()
                else:
                    stream.write(data.decode("utf-8", "replace"))
                    stream.flush()
        except (OSError, ValueError, AttributeError) as exc:
            log.warning(
                "%s: the agent's %s is unusable (%s); this worker's output reaches "
                "the console no more",
                self.name,
                self.console,
                exc,
            )
            self.console = None
