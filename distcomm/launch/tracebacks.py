"""What a worker's stderr says about its failure: its last traceback, and whether a peer caused it.

The agent reads a worker's stderr (its pump, or its log file) for the failure report when
the worker wrote no error file: a script without `@record` that failed before
`init_process_group` installed the exception hook (`excepthook.py`), or one that never
imports distcomm. This module holds the text side of that, without processes:

- `StderrTail`: the last lines of one worker's stderr, bounded in lines and bytes, each
  with the time the agent read it;
- `last_traceback`: where the last ``Traceback (most recent call last):`` block of some
  lines is, with the exceptions chained before it;
- `peer_failure_in` and `peer_failure_in_traceback`: the ranks a distcomm error message
  names as the cause of the failure (a peer that closed its connection, left or aborted
  the group), the same errors that carry `errors.DistError.peer_ranks`;
- `TracebackGrouper`: holds a traceback's console lines back until its exception line,
  so that two workers' tracebacks reach the console one after the other, not line by line
  in turn.
"""

from __future__ import annotations

import re
import threading
from collections import deque
from collections.abc import Iterable

__all__ = [
    "MAX_BLOCK_BYTES",
    "TAIL_BYTES",
    "TAIL_LINES",
    "StderrTail",
    "TracebackGrouper",
    "exception_lines",
    "last_traceback",
    "peer_failure_in",
    "peer_failure_in_traceback",
]

#: the most lines and bytes of a worker's stderr the agent keeps for the report
TAIL_LINES = 200
TAIL_BYTES = 64 * 1024
#: a longer line is kept cut to this many bytes
_TAIL_LINE_BYTES = 4096
#: a traceback held back for the console longer than this is shown as it stands
MAX_BLOCK_BYTES = 256 * 1024

_HEADER = "Traceback (most recent call last):"
_HEADER_BYTES = _HEADER.encode()
_CHAINED = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)

#: distcomm's messages for a failure that follows from a peer's: the first that matches
#: names the peer (group) rank, when the message says which
_PEER_FAILURE = re.compile(
    r"rank (?P<closed>\d+) closed the connection"
    r"|rank (?P<aborted>\d+) aborted the group"
    r"|rank (?P<left>\d+) has left the group"
    r"|rank (?P<ended>\d+)'s process ended"
    r"|rank (?P<gone>\d+) is gone"
    r"|the link to rank (?P<link>\d+)(?: \([^)]*\))? failed"
    r"|the connection to rank (?P<connection>\d+) failed"
    r"|another rank aborted the group \((?:rank (?P<notice>\d+))?"
    r"|store at \S+ closed the connection"
)


def _indented(line: str) -> bool:
    return line[:1] in (" ", "\t")


def _block_end(lines: list[str], start: int) -> int:
    """The end (exclusive) of the traceback whose header is `lines[start]`: after its
    indented frame lines, its exception line (the first line that is not indented)."""
    end = start + 1
    while end < len(lines) and _indented(lines[end]):
        end += 1
    if end < len(lines) and lines[end].strip():
        end += 1
    return end


def last_traceback(lines: list[str]) -> tuple[int, int] | None:
    """Where the last traceback in `lines` (no line ends) is: (start, end), a slice.

    It runs from its ``Traceback (most recent call last):`` header through its indented
    frame lines to its exception line, and starts at the first of the tracebacks chained
    before it ("During handling of the above exception ..."). None when there is none.
    """
    starts = [i for i, line in enumerate(lines) if line.rstrip() == _HEADER]
    if not starts:
        return None
    start = starts[-1]
    end = _block_end(lines, start)
    earlier = {_block_end(lines, i): i for i in starts[:-1]}
    while (
        start >= 3
        and lines[start - 1].strip() == ""
        and lines[start - 2].strip() in _CHAINED
        and lines[start - 3].strip() == ""
        and start - 3 in earlier
    ):
        start = earlier[start - 3]
    return start, end


def exception_lines(block: list[str]) -> list[str]:
    """The exception lines of a traceback `block` (`last_traceback`'s lines), the last
    (the one that ended the process) last."""
    found = []
    for i, line in enumerate(block):
        if line.rstrip() == _HEADER or _indented(line) or not line.strip():
            continue
        if line.strip() in _CHAINED and i + 1 < len(block) and not block[i + 1].strip():
            continue
        found.append(line)
    return found


def peer_failure_in(text: str) -> tuple[int, ...] | None:
    """The peer a distcomm error message names as the cause of the failure: (rank,),
    () when it does not say which, None when the message is not of such a failure."""
    match = _PEER_FAILURE.search(text)
    if match is None:
        return None
    ranks = [int(value) for value in match.groupdict().values() if value is not None]
    return tuple(ranks[:1])


def peer_failure_in_traceback(block: list[str]) -> tuple[int, ...] | None:
    """`peer_failure_in` for a traceback: its last exception line that names a peer's
    failure (an exception raised from or while handling one counts as caused by it)."""
    for line in reversed(exception_lines(block)):
        ranks = peer_failure_in(line)
        if ranks is not None:
            return ranks
    return None


class StderrTail:
    """The last lines of one worker's stderr, as the agent read them (thread-safe).

    At most `max_lines` lines and `max_bytes` bytes are kept (a line longer than 4 KiB, or
    than `max_bytes`, is kept cut); each line keeps the time (`time.time()`) it was read.
    """

    def __init__(self, max_lines: int = TAIL_LINES, max_bytes: int = TAIL_BYTES) -> None:
        self._max_lines, self._max_bytes = max_lines, max_bytes
        self._entries: deque[tuple[float, bytes]] = deque()
        self._bytes = 0
        self._lock = threading.Lock()

    def add(self, lines: Iterable[bytes], when: float) -> None:
        """Keep `lines` (without their line ends), read at `when`."""
        with self._lock:
            for line in lines:
                line = line[: min(_TAIL_LINE_BYTES, self._max_bytes)].rstrip(b"\r")
                self._entries.append((when, line))
                self._bytes += len(line)
                while len(self._entries) > self._max_lines or self._bytes > self._max_bytes:
                    self._bytes -= len(self._entries.popleft()[1])

    def lines(self) -> list[str]:
        """The kept lines, decoded (undecodable bytes replaced), without line ends."""
        with self._lock:
            return [line.decode("utf-8", "replace") for _, line in self._entries]

    def failure_time(self) -> float | None:
        """When the exception line of the last traceback kept was read, or None."""
        with self._lock:
            entries = list(self._entries)
        bounds = last_traceback([line.decode("utf-8", "replace") for _, line in entries])
        return None if bounds is None else entries[bounds[1] - 1][0]


class TracebackGrouper:
    """Holds the lines of a traceback back until its exception line (for the console).

    `feed` takes complete lines (without their line ends) and returns those to show now:
    every line, except that from a ``Traceback (most recent call last):`` line on they
    are kept until the line that ends the traceback, and then returned together. The
    caller shows what it holds (`flush`) when the worker writes nothing for a while
    (`idle_since`), when its output ends, and when more than `max_bytes` are held.
    """

    def __init__(self, max_bytes: int = MAX_BLOCK_BYTES) -> None:
        self._max_bytes = max_bytes
        self._held: list[bytes] = []
        self._size = 0
        #: the monotonic time of the last line held, or None when nothing is held
        self.idle_since: float | None = None

    def feed(self, lines: Iterable[bytes], now: float) -> list[bytes]:
        """Take the next lines of the stream; the lines to show now, in order."""
        out: list[bytes] = []
        for line in lines:
            text = line.rstrip(b"\r")
            if not self._held:
                if text.rstrip() == _HEADER_BYTES:
                    self._hold(line, now)
                else:
                    out.append(line)
                continue
            self._hold(line, now)
            if text[:1] not in (b" ", b"\t") or self._size >= self._max_bytes:
                out += self.flush()  # its exception line (or the cap): show it whole
        return out

    def _hold(self, line: bytes, now: float) -> None:
        self._held.append(line)
        self._size += len(line)
        self.idle_since = now

    def flush(self) -> list[bytes]:
        """The lines held (held no longer)."""
        held, self._held, self._size, self.idle_since = self._held, [], 0, None
        return held
