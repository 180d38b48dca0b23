"""A protocol fuzzer for the TCPStore server: hostile frames over many short connections.

`fuzz_server(frames, seed)` starts a server in a spawned process (a
`TCPStore(HOST, 0, is_master=True, wait_for_workers=False)` that reports its port and
pid over a pipe and then waits), runs `run_fuzz` against it, checks that the process
is alive and that a normal `TCPStore` client can still set, get, add and wait, compares
the server's RSS after a warm-up with its peak and its end, and always kills the
process. From a shell::

    python -m tests.store_fuzz --frames 1000000 --seed 1 [--key SECRET] [--exclude timeout]

The stream, fixed by `random.Random(seed)`, mixes these kinds of frame (see `KINDS`):

    valid      every command with random keys and (mostly small) values
    bitflip    a valid frame with 1-4 bits flipped (in the header or in the body)
    garbage    random bytes
    huge       a header declaring up to 0xFFFFFFFF body bytes, or an argument declaring
               more bytes than its frame holds
    timeout    GET, MULTI_GET, WAIT, WAIT_WORKERS with timeouts of inf, nan, -1, 1e300,
               3e6 s (30+ days), 0 ...
    truncated  a frame cut short, then the connection closed
    malformed  unknown command codes, empty or missing arguments, huge argument counts,
               timeouts and numbers that do not parse, oversized keys
    burst      hundreds of pipelined GETs, then a close without reading any answer
    hangup     a connection closed at once (sometimes with a reset), before or after
               the greeting
    handshake  (with `key`) partial, wrong, replayed, bit-flipped or piecemeal proofs
    flood      held phase: 4 connections each declare a ~4 GiB frame and push 32 MiB of
               its body while the server's RSS is sampled
    backlog    held phase: one connection pipelines 1,500 GETs of a 64,000-byte value
               and reads no answer while the server's RSS is sampled

Mixed connections carry 20-100 frames, at most one of them a frame that breaks the
framing or parks the connection (garbage, a huge header, a header bit flip, a long
timeout, a truncated frame), and end with a sentinel (WAIT with timeout 0 on a key never
set) whose TIMEOUT answer marks the end of the answers. The fuzzer never blocks: every
socket is non-blocking, every wait has a short bound, and a parked request or a closed
connection is a normal outcome. What counts as a failure (`FuzzStats.failures`), each
line tagged with its check:

    [liveness]  the server refused a connection, or stopped answering within 30 s; the
                message names the last frame answered and the first left unanswered on
                the last connection; the last 8 mixed connections are then replayed on
                fresh servers to find the frame that stops one; a server process that
                still runs prints every thread's stack to stderr (SIGUSR1, faulthandler)
    [protocol]  a malformed greeting or answer, or answers lost or invented before a
                sentinel
    [auth]      a wrong, partial or replayed proof got an answer, or a right one did not
    [process]   the server process died
    [client]    a normal TCPStore client cannot set/get/add/wait/num_keys afterwards
    [memory]    the server's RSS grew more than the limit after the warm-up

The protocol is written out here (codes, statuses, struct formats), not imported, so
the fuzzer checks the documented wire format whatever the server's modules look like.
SET, APPEND and MULTI_SET may be quiet (answered only when refused); the fuzzer detects
which kind of server it talks to and counts answers accordingly.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import errno
import faulthandler
import logging
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import random
import select
import signal
import socket
import struct
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import psutil

from distcomm import DistStoreTimeoutError, TCPStore, auth
from distcomm.errors import DistNetworkError

__all__ = [
    "HOST",
    "KINDS",
    "FuzzStats",
    "MiB",
    "ServerProcess",
    "check_client",
    "fuzz_server",
    "isolate",
    "main",
    "run_fuzz",
]

HOST = "127.0.0.1"
MiB = 1 << 20

#: Every kind of frame or connection the fuzzer makes (names for `exclude`).
KINDS = (
    "valid",
    "bitflip",
    "garbage",
    "huge",
    "timeout",
    "truncated",
    "malformed",
    "burst",
    "hangup",
    "handshake",
    "flood",
    "backlog",
)

# -- the wire protocol, as documented ---------------------------------------------------------

_HEADER = struct.Struct("<IB")  # body length, command (or status)
_LENGTH = struct.Struct("<I")
_SECONDS = struct.Struct("<d")

REGISTER, SET, GET, ADD, COMPARE_SET, WAIT, CHECK = 1, 2, 3, 4, 5, 6, 7
DELETE_KEY, NUM_KEYS, MULTI_GET, MULTI_SET, APPEND, WAIT_WORKERS = 8, 9, 10, 11, 12, 13
_NAMES = {
    REGISTER: "REGISTER", SET: "SET", GET: "GET", ADD: "ADD", COMPARE_SET: "COMPARE_SET",
    WAIT: "WAIT", CHECK: "CHECK", DELETE_KEY: "DELETE_KEY", NUM_KEYS: "NUM_KEYS",
    MULTI_GET: "MULTI_GET", MULTI_SET: "MULTI_SET", APPEND: "APPEND",
    WAIT_WORKERS: "WAIT_WORKERS",
}  # fmt: skip
_QUIET = frozenset({SET, APPEND, MULTI_SET})  # answered only when refused, on quiet servers
_OK, _TIMEOUT, _ERROR, _LATE_ERROR = 0, 1, 2, 3
_STATUSES = frozenset({_OK, _TIMEOUT, _ERROR, _LATE_ERROR})

# -- bounds of the fuzzer itself (never of what it checks) ------------------------------------

_CONNECT_TIMEOUT = 5.0
_HELLO_TIMEOUT = 2.0  # then a liveness probe decides: slow, or gone
_LIVENESS_TIMEOUT = 30.0  # a round trip slower than this means the server stopped answering
_REPLAY_PATIENCE = 3.0  # the same, for the replays that isolate a liveness failure
_REPLAY_SETTLE = 1.0  # a replay probes this long after its last connection closed
_REPLAY_READ = 0.6  # a replayed connection waits this long for its sentinel's answer
_REPLAYED = 8  # mixed connections kept for those replays
_REPLAY_BUDGET = 120.0  # seconds all the replays of one isolation may take
_READ_IDLE = 0.025  # after a batch: stop reading once nothing came for this long...
_READ_TOTAL = 0.3  # ... or after this long in all
_SEND_PATIENCE = 0.3  # a batch the server does not take within this is cut short
_MAX_READ = 16 * MiB
_DROPPED = "the connection was closed"
_MAX_RESPONSE = 256 * MiB  # a larger declared answer is a protocol failure
_CHECKED_FRAME = MiB  # sentinel accounting only over frames no larger than this

_FLOOD_CONNECTIONS = 4
_FLOOD_BYTES = 32 * MiB  # body pushed per flood connection
_BACKLOG_GETS = 1500
_BACKLOG_VALUE = 64000  # one answer stays under 64 KiB, so a server copying it holds each one

#: Frames that keep the framing, in a mixed connection, and their weights.
_CALM_WEIGHTS = {"valid": 50, "timeout": 8, "malformed": 18, "bitflip": 17, "huge": 5}
_LONG_TIMEOUTS = (math.inf, 1e300, 3e6, 2.6e6, 1e10, sys.float_info.max)
_ODD_TIMEOUTS = (math.nan, -math.nan, -1.0, -math.inf, 0.0, -0.0, 5e-324, -1e300)
_SHORT_TIMEOUTS = (0.0, 0.0, 0.001, 0.005, 0.02)


def _frame(code: int, args: list[bytes]) -> bytes:
    body = b"".join(_LENGTH.pack(len(arg)) + arg for arg in args)
    return _HEADER.pack(len(body), code) + body


def _decode_args(body: bytes) -> list[bytes] | None:
    """The arguments of a response body, or None when the lengths do not add up."""
    args, offset = [], 0
    while offset < len(body):
        if offset + _LENGTH.size > len(body):
            return None
        (size,) = _LENGTH.unpack_from(body, offset)
        offset += _LENGTH.size
        if offset + size > len(body):
            return None
        args.append(body[offset : offset + size])
        offset += size
    return args


def _name(code: int) -> str:
    return _NAMES.get(code, f"code {code}")


class Frame(NamedTuple):
    """One generated frame: its kind (see KINDS), what it is, its bytes."""

    kind: str
    label: str
    data: bytes
    breaks: bool = False  # breaks the framing or may park the connection for long


# -- the results --------------------------------------------------------------------------


@dataclass
class FuzzStats:
    """What a fuzz run did and found; `failures` empty means every check passed."""

    seed: int = 0
    frames: int = 0
    connections: int = 0
    seconds: float = 0.0
    kinds: Counter[str] = field(default_factory=Counter)
    responses: Counter[str] = field(default_factory=Counter)
    closed_by_server: Counter[str] = field(default_factory=Counter)
    slow_hellos: int = 0
    sentinels_checked: int = 0
    quiet_sets: bool | None = None
    rss_start: int | None = None
    rss_before: int | None = None
    rss_after: int | None = None
    rss_peak: int | None = None
    rss_peak_at: str = ""
    rss_rise: int = 0  # the largest rise between two samples after the warm-up
    rss_rise_at: str = ""
    phases: list[str] = field(default_factory=list)
    #: the frames of the last mixed connections (replayed to isolate a liveness failure)
    recent: list[list[Frame]] = field(default_factory=list, repr=False)
    alive: bool | None = None
    client: str | None = None  # "ok", or what a normal client could not do
    failures: list[str] = field(default_factory=list)

    @property
    def rss_growth(self) -> int | None:
        """Bytes the server's RSS grew from after the warm-up to its highest sample."""
        if self.rss_before is None:
            return None
        return max(self.rss_peak or 0, self.rss_after or 0) - self.rss_before

    def summary(self) -> str:
        """One line: frames, connections, seconds, RSS before/after/peak, alive, client."""
        alive = {None: "?", True: "yes", False: "NO"}[self.alive]
        return (
            f"store fuzz seed={self.seed}: frames={self.frames} "
            f"connections={self.connections} seconds={self.seconds:.1f} "
            f"rss_before={_mib(self.rss_before)} rss_after={_mib(self.rss_after)} "
            f"rss_peak={_mib(self.rss_peak)} alive={alive} client={self.client or '?'} "
            f"failures={len(self.failures)}"
        )

    def report(self) -> str:
        """The summary, the mix, what the server closed, and every failure."""
        lines = [self.summary()]
        lines.append("  frames by kind: " + _counts(self.kinds))
        lines.append("  answers by status: " + _counts(self.responses))
        if self.closed_by_server:
            lines.append(
                "  connections the server closed, by the first hostile frame it left "
                "unanswered: " + _counts(self.closed_by_server)
            )
        mode = {None: "unknown", True: "quiet", False: "answered"}[self.quiet_sets]
        lines.append(
            f"  SET/APPEND/MULTI_SET: {mode}; sentinel accounting checked on "
            f"{self.sentinels_checked} connections; slow greetings: {self.slow_hellos}"
        )
        lines += [f"  held phase {line}" for line in self.phases]
        if self.rss_peak_at:
            lines.append(f"  RSS peak sampled during: {self.rss_peak_at}")
        if self.rss_rise_at:
            lines.append(f"  largest RSS rise, {_mib(self.rss_rise)}, during: {self.rss_rise_at}")
        lines += [f"  FAILED {failure}" for failure in self.failures]
        return "\n".join(lines)


def _mib(value: int | None) -> str:
    return "?" if value is None else f"{value / MiB:.1f}MiB"


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{name} {count}" for name, count in counter.most_common()) or "none"


class _ServerGone(Exception):
    """The server stopped accepting or answering; the failure is recorded."""


# -- frame generation ---------------------------------------------------------------------


class _Maker:
    """Frames of every kind from one `random.Random`."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.keys = [b"k%d" % i for i in range(40)] + [b"\x00\xff", "ключ".encode(), b"/" * 100]
        self.counters = [b"c%d" % i for i in range(8)]
        self.logs = [b"log%d" % i for i in range(4)]
        self.bigs = [b"big%d" % i for i in range(4)]

    # the pieces

    def key(self) -> bytes:
        rng = self.rng
        pool = rng.choices((self.keys, self.counters, self.logs, self.bigs), (80, 8, 6, 6))[0]
        return rng.choice(pool)

    def absent(self) -> bytes:
        return b"absent/%d" % self.rng.randrange(1000)  # never set by the stream

    def value(self) -> bytes:
        rng = self.rng
        roll = rng.random()
        size = rng.randrange(33) if roll < 0.7 else rng.randrange(33, 1025)
        if roll < 0.06:
            size = 0  # empty values are where buffer bookkeeping slips
        elif roll > 0.97:
            size = rng.randrange(1025, 16385)
        return rng.randbytes(size)

    def big(self) -> bytes:
        """A value of 64-256 KiB, often right at the 64 KiB a server may copy frames below."""
        rng = self.rng
        size = rng.choice((65527, 65531, 65532, 65535, 65536, 65537, 1 << 17))
        return rng.randbytes(size if rng.random() < 0.5 else rng.randrange(64 << 10, 256 << 10))

    def seconds(self, choices: tuple[float, ...]) -> tuple[bytes, float]:
        value = self.rng.choice(choices)
        return _SECONDS.pack(value), value

    def wait_keys(self, most: int) -> list[bytes]:
        rng = self.rng
        return [
            self.absent() if rng.random() < 0.2 else self.key() for _ in range(rng.randint(1, most))
        ]

    # the kinds

    def valid(self) -> Frame:
        rng = self.rng
        code = rng.choices(
            (SET, GET, ADD, COMPARE_SET, WAIT, CHECK, DELETE_KEY, NUM_KEYS, MULTI_GET,
             MULTI_SET, APPEND, REGISTER, WAIT_WORKERS),
            (15, 12, 10, 6, 8, 6, 3, 4, 6, 6, 5, 2, 3),
        )[0]  # fmt: skip
        label = _name(code)
        if code == SET:
            roll = rng.random()
            if roll < 0.03:
                args = [b"empty", b""]  # a key whose value is always empty
            else:
                key = rng.choice(self.bigs) if roll < 0.05 else self.key()
                args = [key, self.big() if key in self.bigs else self.value()]
        elif code in (GET, WAIT, MULTI_GET):
            seconds, timeout = self.seconds(_SHORT_TIMEOUTS)
            keys = self.wait_keys(1 if code == GET else 5)
            if code == MULTI_GET and rng.random() < 0.3:  # a large answer of several values
                keys.insert(rng.randrange(len(keys) + 1), rng.choice(self.bigs))
                if rng.random() < 0.5:  # and an empty one, often last
                    keys.insert(rng.choice((len(keys), rng.randrange(len(keys)))), b"empty")
            args = [seconds, *keys]
            label += f" timeout={timeout!r} keys={len(keys)}"
            if any(key in self.bigs for key in keys):
                where = "last" if keys[-1] == b"empty" else "too" if b"empty" in keys else ""
                label += f" (a 64+ KiB value{', an empty one ' + where if where else ''})"
        elif code == ADD:
            args = [rng.choice(self.counters), str(rng.randint(-1000, 1000)).encode()]
        elif code == COMPARE_SET:
            expected = rng.choice((b"", b"1", self.value()))
            args = [self.key(), expected, self.value()]
        elif code == CHECK:
            args = [self.key() for _ in range(rng.randrange(6))]
        elif code == DELETE_KEY:
            args = [self.key()]
        elif code == MULTI_SET:
            args = []
            for _ in range(rng.randint(1, 5)):
                args += (rng.choice(self.keys), self.value())
        elif code == APPEND:
            args = [rng.choice(self.logs), rng.randbytes(rng.randrange(17))]
        elif code == WAIT_WORKERS:
            seconds, timeout = self.seconds(_SHORT_TIMEOUTS)
            args = [seconds, str(rng.randint(0, 3)).encode()]
            label += f" timeout={timeout!r}"
        else:  # REGISTER, NUM_KEYS
            args = []
        return Frame("valid", label, _frame(code, args))

    def timeout(self) -> Frame:
        """A waiting command with an extreme timeout; long ones park (so they break)."""
        rng = self.rng
        code = rng.choice((GET, MULTI_GET, WAIT, WAIT_WORKERS))
        long = rng.random() < 0.5
        seconds, timeout = self.seconds(_LONG_TIMEOUTS if long else _ODD_TIMEOUTS)
        if code == WAIT_WORKERS:
            args = [seconds, b"1000000" if long else str(rng.randint(0, 3)).encode()]
        else:
            keys = [self.absent()] if long else self.wait_keys(1 if code == GET else 4)
            if code != GET and long and rng.random() < 0.5:
                keys += self.wait_keys(3)
            args = [seconds, *keys]
        return Frame("timeout", f"{_name(code)} timeout={timeout!r}", _frame(code, args), long)

    def malformed(self) -> Frame:
        rng = self.rng
        variant = rng.randrange(9)
        if variant == 0:
            code = rng.choice((0, *range(14, 256)))
            args = [rng.randbytes(rng.randrange(9)) for _ in range(rng.randrange(4))]
            return Frame("malformed", f"unknown command code {code}", _frame(code, args))
        if variant == 1:
            code = rng.randint(1, 13)
            return Frame("malformed", f"{_name(code)} with no arguments", _frame(code, []))
        if variant == 2:
            code = rng.randint(1, 13)
            args = [rng.randbytes(rng.randrange(5)) for _ in range(rng.randint(1, 7))]
            label = f"{_name(code)} with {len(args)} random arguments"
            return Frame("malformed", label, _frame(code, args))
        if variant == 3:  # huge argument counts
            count = rng.randint(500, 20000)
            code = rng.choice((CHECK, WAIT, MULTI_GET, MULTI_SET, CHECK))
            if code == CHECK:
                args = [b""] * count
            elif code == MULTI_SET:
                count //= 10
                args = []
                for _ in range(count):
                    args += (rng.choice(self.keys), rng.randbytes(rng.randrange(4)))
                if rng.random() < 0.3:
                    args.append(b"odd")
            else:
                count //= 4
                args = [_SECONDS.pack(0.0), *(self.absent() for _ in range(count))]
            label = f"{_name(code)} with {len(args)} arguments"
            return Frame("malformed", label, _frame(code, args))
        if variant == 4:  # a timeout that is not 8 bytes
            code = rng.choice((GET, WAIT, MULTI_GET, WAIT_WORKERS))
            size = rng.choice((0, 1, 4, 7, 9, 16))
            args = [rng.randbytes(size), b"1" if code == WAIT_WORKERS else self.key()]
            return Frame("malformed", f"{_name(code)} timeout of {size} bytes", _frame(code, args))
        if variant == 5:  # numbers that do not parse
            text = rng.choice((b"", b"abc", b"1" * 5000, b"0x10", b" 5", b"1e3", b"-", b"\xff"))
            if rng.random() < 0.5:
                args, code = [rng.choice(self.counters), text], ADD
            else:
                args, code = [_SECONDS.pack(0.0), text], WAIT_WORKERS
            return Frame("malformed", f"{_name(code)} number {text[:12]!r}", _frame(code, args))
        if variant == 6:  # odd keys: empty, or beyond any sensible key limit
            size = rng.choice((0, 9000, 70000))
            code = rng.choice((SET, GET, ADD, DELETE_KEY, APPEND))
            key = b"x" * size
            args = {
                SET: [key, b"v"],
                GET: [_SECONDS.pack(0.0), key],
                ADD: [key, b"1"],
                DELETE_KEY: [key],
                APPEND: [key, b"v"],
            }[code]
            return Frame("malformed", f"{_name(code)} with a {size}-byte key", _frame(code, args))
        if variant == 7:  # a body ending inside an argument length
            code = rng.randint(1, 13)
            body = _LENGTH.pack(1) + b"a" + rng.randbytes(rng.randint(1, 3))
            data = _HEADER.pack(len(body), code) + body
            return Frame("malformed", f"{_name(code)} ending inside a length", data)
        code = rng.randint(1, 13)  # empty arguments where content is expected
        args = [b""] * rng.randint(1, 4)
        return Frame(
            "malformed", f"{_name(code)} with {len(args)} empty arguments", _frame(code, args)
        )

    def bitflip(self, header: bool) -> Frame:
        base = self.valid()
        data = bytearray(base.data)
        rng = self.rng
        where = range(4) if header else range(4, len(data))
        spots = [rng.choice(where) for _ in range(rng.randint(1, 2 if header else 4))]
        for spot in spots:
            data[spot] ^= 1 << rng.randrange(8)
        label = f"{base.label} with bits flipped at bytes {sorted(spots)}"
        return Frame("bitflip", label, bytes(data), header)

    def huge_header(self) -> Frame:
        rng = self.rng
        size = rng.choice(
            (0xFFFFFFFF, 0xFFFFFFFE, 0x80000000, 1 << 30, 9 << 20, rng.randrange(1 << 20, 1 << 32))
        )
        code = rng.randint(0, 14)
        data = _HEADER.pack(size, code) + rng.randbytes(rng.randrange(65))
        return Frame("huge", f"header declaring {size:#x} bytes, code {code}", data, True)

    def huge_argument(self) -> Frame:
        rng = self.rng
        code = rng.randint(1, 13)
        tail = rng.randbytes(rng.randrange(17))
        declared = rng.choice((0xFFFFFFFF, 0x80000000, 1 << 24, len(tail) + 1))
        body = _LENGTH.pack(declared) + tail
        if rng.random() < 0.5:  # a good argument first
            body = _LENGTH.pack(2) + b"ok" + body
        data = _HEADER.pack(len(body), code) + body
        return Frame("huge", f"{_name(code)} argument declaring {declared:#x} bytes", data)

    def garbage(self) -> Frame:
        rng = self.rng
        size = rng.choice((rng.randint(1, 16), rng.randint(17, 256), rng.randint(257, 4096)))
        return Frame("garbage", f"{size} random bytes", rng.randbytes(size), True)

    def truncated(self) -> Frame:
        base = self.valid() if self.rng.random() < 0.7 else self.malformed()
        cut = self.rng.randrange(1, max(2, len(base.data)))
        return Frame("truncated", f"{base.label} cut to {cut} bytes", base.data[:cut], True)


def _sentinel_key(nonce: str, number: int) -> bytes:
    return f"fuzz-sentinel/{nonce}/{number}".encode()


def _sentinel(key: bytes) -> Frame:
    return Frame("sentinel", "sentinel WAIT timeout=0", _frame(WAIT, [_SECONDS.pack(0.0), key]))


# -- framing as the server sees it ------------------------------------------------------


class _Batch:
    """A connection's frames, and how a server following the protocol splits their bytes."""

    def __init__(self, frames: list[Frame]) -> None:
        self.frames = frames
        self.data = b"".join(frame.data for frame in frames)
        self.starts: list[int] = []
        offset = 0
        for frame in frames:
            self.starts.append(offset)
            offset += len(frame.data)
        #: (start, end, code) of every complete request a server reads from `data`
        self.requests: list[tuple[int, int, int]] = []
        pos = 0
        while pos + _HEADER.size <= len(self.data):
            size, code = _HEADER.unpack_from(self.data, pos)
            end = pos + _HEADER.size + size
            if end > len(self.data):
                break
            self.requests.append((pos, end, code))
            pos = end
        self.incomplete_at = pos if pos < len(self.data) else None

    def index_at(self, offset: int) -> int:
        return bisect.bisect_right(self.starts, offset) - 1

    def origin(self, index: int) -> str:
        frame = self.frames[index]
        return f"frame {index + 1}/{len(self.frames)} ({frame.kind}: {frame.label})"

    def blame(self, statuses: list[int], quiet: bool) -> tuple[str, str]:
        """(the kind to blame, a description) for a connection that ended after `statuses`:
        the first unanswered frame, and the first hostile one from there."""
        offset, answered = self.unanswered(statuses, quiet)
        if offset is None:
            return "none", "all its requests answered"
        first = self.index_at(offset)
        text = f"first unanswered: {self.origin(first)}"
        if answered is not None:
            text = f"last answered: {self.origin(self.index_at(answered))}; {text}"
        for index in range(first, len(self.frames)):
            if self.frames[index].kind not in ("valid", "sentinel"):
                if index != first:
                    text += f"; first hostile frame from there: {self.origin(index)}"
                return self.frames[index].kind, text
        return self.frames[first].kind, text

    def unanswered(self, statuses: list[int], quiet: bool) -> tuple[int | None, int | None]:
        """Offsets of the first request the answers in `statuses` leave unanswered (or of the
        incomplete tail; None when all were answered) and of the last one answered (None for
        none). On a quiet server, valid quiet requests after the last answer are passed over:
        they were most likely served."""
        index, answered = 0, None
        for status in statuses:
            if quiet and status == _LATE_ERROR:
                continue  # belongs to a quiet request, which the walk passes over anyway
            while quiet and index < len(self.requests) and self.requests[index][2] in _QUIET:
                index += 1
            if index < len(self.requests):
                answered = self.requests[index][0]
            index += 1
        while quiet and index < len(self.requests):  # passed over silently: likely served
            start, _, code = self.requests[index]
            if code not in _QUIET or self.frames[self.index_at(start)].kind != "valid":
                break
            index += 1
        if index < len(self.requests):
            return self.requests[index][0], answered
        return self.incomplete_at, answered

    def sentinel_problem(self, before: int, quiet: bool) -> str | None:
        """Whether `before` answers ahead of the sentinel (the last frame) add up."""
        start = self.starts[-1]
        ahead = [req for req in self.requests if req[0] < start]
        if not any(req[0] == start for req in self.requests):
            return None  # the sentinel is not framed as sent: nothing to check
        if any(end - begin > _CHECKED_FRAME for begin, end, _ in ahead):
            return None
        least = sum(1 for req in ahead if not (quiet and req[2] in _QUIET))
        if least <= before <= len(ahead):
            return None
        expected = str(least) if least == len(ahead) else f"{least} to {len(ahead)}"
        return (
            f"{before} answers came before the sentinel's, for {len(ahead)} requests "
            f"({expected} expected): answers were lost or invented"
        )


class _Answers:
    """Responses parsed from a connection's bytes."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.items: list[tuple[int, list[bytes]]] = []
        self.problem: str | None = None

    def feed(self, data: bytes) -> None:
        self.buffer += data
        buffer = self.buffer
        while self.problem is None and len(buffer) >= _HEADER.size:
            size, status = _HEADER.unpack_from(buffer)
            if status not in _STATUSES:
                self.problem = f"an answer with status {status} (not a protocol status)"
            elif size > _MAX_RESPONSE:
                self.problem = f"an answer declaring {size:#x} bytes"
            if self.problem is not None or len(buffer) < _HEADER.size + size:
                return
            args = _decode_args(bytes(buffer[_HEADER.size : _HEADER.size + size]))
            del buffer[: _HEADER.size + size]
            if args is None:
                self.problem = f"an answer (status {status}) whose argument lengths do not add up"
                return
            self.items.append((status, args))


# -- non-blocking socket helpers ------------------------------------------------------------


def _send(sock: socket.socket, data: bytes | memoryview, patience: float) -> tuple[int, bool]:
    """Send what the server takes within `patience`; (bytes sent, connection closed)."""
    view = memoryview(data)
    sent, deadline = 0, time.monotonic() + patience
    while sent < len(view):
        try:
            sent += sock.send(view[sent:])
            continue
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            return sent, True
        left = deadline - time.monotonic()
        if left <= 0:
            break
        select.select([], [sock], [], left)
    return sent, False


def _recv(sock: socket.socket, size: int, timeout: float) -> tuple[bytes, bool]:
    """Read up to `size` bytes, waiting at most `timeout`; (data, closed)."""
    ready, _, _ = select.select([sock], [], [], timeout)
    if not ready:
        return b"", False
    try:
        data = sock.recv(size)
    except (BlockingIOError, InterruptedError):
        return b"", False
    except OSError:
        return b"", True
    return data, not data


def _recv_exact(sock: socket.socket, size: int, timeout: float) -> tuple[bytes, bool]:
    """Read `size` bytes within `timeout`; fewer when the peer closed or time ran out."""
    data, deadline = b"", time.monotonic() + timeout
    while len(data) < size:
        left = deadline - time.monotonic()
        if left <= 0:
            return data, False
        chunk, closed = _recv(sock, size - len(data), left)
        data += chunk
        if closed:
            return data, True
    return data, False


def _close(sock: socket.socket, reset: bool = False) -> None:
    if reset:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


# -- the fuzzer ---------------------------------------------------------------------------


class _Fuzzer:
    """One run: the stream of connections, the checks, the statistics (see `run_fuzz`)."""

    def __init__(
        self,
        host: str,
        port: int,
        seed: int,
        key: bytes | None,
        server_pid: int | None,
        exclude: Collection[str],
        progress: Callable[[str], None] | None,
    ) -> None:
        unknown = set(exclude) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown frame kinds {sorted(unknown)}: choose from {KINDS}")
        self.host, self.port, self.key = host, port, key
        self.rng = random.Random(seed)
        self.make = _Maker(self.rng)
        self.enabled = {kind: kind not in exclude for kind in KINDS}
        self.stats = FuzzStats(seed=seed)
        self.process = psutil.Process(server_pid) if server_pid is not None else None
        self.progress = progress
        self.nonce = uuid.uuid4().hex[:8]
        self.numbers = iter(range(1, 1 << 62))
        self.sync_sock: socket.socket | None = None
        self.last: tuple[str, _Batch | None, list[int], bool] | None = None
        self.old_proof = b""
        self.previous_rss: int | None = None
        self.patience = _LIVENESS_TIMEOUT  # for liveness round trips

    # -- bookkeeping

    def fail(self, check: str, message: str) -> None:
        self.stats.failures.append(f"[{check}] {message}")

    def count(self, kind: str, frames: int = 1) -> None:
        self.stats.kinds[kind] += frames
        self.stats.frames += frames

    def sample(self, during: str) -> int | None:
        if self.process is None:
            return None
        try:
            rss = self.process.memory_info().rss
        except psutil.Error:
            return None
        stats = self.stats
        if stats.rss_before is not None:
            if stats.rss_peak is None or rss > stats.rss_peak:
                stats.rss_peak, stats.rss_peak_at = rss, during
            rise = rss - (self.previous_rss or rss)
            if rise > stats.rss_rise:
                stats.rss_rise, stats.rss_rise_at = rise, during
        self.previous_rss = rss
        return rss

    def remember(
        self,
        what: str,
        batch: _Batch | None = None,
        statuses: list[int] | None = None,
        closed: bool = False,
    ) -> None:
        """Note the connection just finished, for the failure message if the next fails."""
        self.last = (what, batch, statuses or [], closed)
        if batch is not None:
            self.stats.recent = [*self.stats.recent[1 - _REPLAYED :], batch.frames]

    def last_words(self) -> str:
        """What the previous connection left unanswered, for a liveness failure."""
        if self.last is None:
            return "before any fuzz connection"
        what, batch, statuses, closed = self.last
        text = f"after {what}"
        if batch is None:
            return text
        how = "closed by the server" if closed else "closed by the fuzzer"
        _, where = batch.blame(statuses, bool(self.stats.quiet_sets))
        return text + f" ({how} after {len(statuses)} answers; {where})"

    # -- connections

    def connect(self, what: str) -> socket.socket:
        """A connection past the greeting (and, with a key, the handshake).

        Raises:
            _ServerGone: the server refused it or stopped answering (failure recorded).
        """
        sock, hello = self.open(what)
        if self.key is not None:
            problem = self.handshake(sock, hello)
            if problem is not None:
                _close(sock)
                self.gone_or_fail(
                    "auth", f"{what}: the handshake with the right key failed: {problem}"
                )
                raise _ServerGone
        return sock

    def open(self, what: str, retries: int = 3) -> tuple[socket.socket, bytes]:
        """A connection whose greeting was read and checked, and the greeting."""
        try:
            sock = socket.create_connection((self.host, self.port), timeout=_CONNECT_TIMEOUT)
        except OSError as exc:
            if retries and exc.errno != errno.ECONNREFUSED and self.probe() is None:
                return self.open(what, retries - 1)  # slow to accept, but alive
            reason = "refused" if exc.errno == errno.ECONNREFUSED else f"failed ({exc})"
            self.fail("liveness", f"the server {reason} {what}, {self.last_words()}")
            raise _ServerGone from None
        sock.setblocking(False)
        self.stats.connections += 1
        hello, closed = _recv_exact(sock, auth.HELLO_SIZE, _HELLO_TIMEOUT)
        if len(hello) < auth.HELLO_SIZE:
            _close(sock)
            problem = self.probe() or ("" if retries else "it answered, but greeted no new one")
            if problem:
                state = "closed it" if closed else f"sent {len(hello)} bytes"
                self.fail(
                    "liveness",
                    f"the server {state} instead of greeting {what} within "
                    f"{_HELLO_TIMEOUT:.0f} s, then failed a liveness round trip ({problem}), "
                    f"{self.last_words()}",
                )
                raise _ServerGone
            self.stats.slow_hellos += 1
            return self.open(what, retries - 1)
        flag = 1 if self.key is not None else 0
        if not hello.startswith(auth.MAGIC) or hello[len(auth.MAGIC)] != flag:
            _close(sock)
            self.fail(
                "protocol", f"{what}: greeting {hello[:5]!r}... is not {auth.MAGIC!r} + {flag}"
            )
            raise _ServerGone
        return sock, hello

    def handshake(self, sock: socket.socket, hello: bytes) -> str | None:
        peer = f"the store at {self.host}:{self.port}"
        try:
            proof, expected = auth.proof_message(self.key, hello, peer)
        except DistNetworkError as exc:
            return str(exc)
        self.old_proof = proof
        _send(sock, proof, _SEND_PATIENCE)
        accept, closed = _recv_exact(sock, auth.ACCEPT_SIZE, self.patience)
        try:
            auth.verify_accept(expected, accept, peer)
        except DistNetworkError as exc:
            return f"{exc} (got {len(accept)} bytes{', then the close' if closed else ''})"
        return None

    def gone_or_fail(self, check: str, message: str) -> None:
        """Record `message`, or a liveness failure when the server is gone altogether."""
        problem = self.probe()
        if problem is not None:
            self.fail("liveness", f"{message}; the server then failed a round trip: {problem}")
        else:
            self.fail(check, message)

    # -- the synchronising connection: liveness probes and sync points

    def roundtrip(self, sock: socket.socket, extra: bytes = b"", skip: int = 0) -> str | None:
        """Send `extra` then NUM_KEYS; wait for NUM_KEYS's answer, passing over LATE_ERRORs
        and the `skip` answers that `extra` gets."""
        _, closed = _send(sock, extra + _frame(NUM_KEYS, []), self.patience)
        if closed:
            return _DROPPED
        answers = _Answers()
        deadline = time.monotonic() + self.patience
        while True:
            while answers.items:
                status, args = answers.items.pop(0)
                if status == _LATE_ERROR:
                    continue
                if skip:
                    skip -= 1
                    continue
                if status != _OK or len(args) != 1:
                    return f"NUM_KEYS was answered with status {status}, {len(args)} arguments"
                return None
            if answers.problem:
                return answers.problem
            left = deadline - time.monotonic()
            if left <= 0:
                return f"no answer to NUM_KEYS within {self.patience:.0f} s"
            data, closed = _recv(sock, 1 << 16, left)
            answers.feed(data)
            if closed and not answers.items:
                return _DROPPED

    def sync(self, extra: bytes = b"", skip: int = 0) -> str | None:
        """One round trip on the synchronising connection (reopened once if dropped)."""
        for attempt in range(2):
            if self.sync_sock is None:
                try:
                    self.sync_sock = self.connect_quietly()
                except OSError as exc:
                    return f"cannot connect: {exc}"
                if self.sync_sock is None:
                    return "no greeting or handshake"
            problem = self.roundtrip(self.sync_sock, extra, skip)
            if problem is None:
                return None
            _close(self.sync_sock)
            self.sync_sock = None
            if attempt or problem != _DROPPED:  # a server that went quiet gets no second wait
                return problem
        return None

    def connect_quietly(self) -> socket.socket | None:
        """A ready connection, or None; records nothing (the probe's own connection)."""
        sock = socket.create_connection((self.host, self.port), timeout=self.patience)
        sock.setblocking(False)
        hello, _ = _recv_exact(sock, auth.HELLO_SIZE, self.patience)
        if len(hello) < auth.HELLO_SIZE:
            _close(sock)
            return None
        if self.key is not None and self.handshake(sock, hello) is not None:
            _close(sock)
            return None
        return sock

    def probe(self) -> str | None:
        """None if the server answers a round trip within the liveness bound."""
        return self.sync()

    def settle(self) -> None:
        """Two round trips: whatever the server had read before is processed."""
        for _ in range(2):
            problem = self.sync()
            if problem is not None:
                self.fail("liveness", f"a sync round trip failed ({problem}), {self.last_words()}")
                raise _ServerGone

    def detect_quiet(self) -> None:
        """Whether SET is answered: send SET then the sentinel, count the answers before it."""
        key = _sentinel_key(self.nonce, 0)
        sock = self.connect("the mode probe")
        try:
            _send(sock, _frame(SET, [b"fuzz-mode", b"1"]) + _sentinel(key).data, self.patience)
            answers = _Answers()
            deadline = time.monotonic() + self.patience
            while time.monotonic() < deadline and answers.problem is None:
                if any(args == [key] for _, args in answers.items):
                    break
                data, closed = _recv(sock, 4096, deadline - time.monotonic())
                answers.feed(data)
                if closed:
                    break
            found = [i for i, (status, args) in enumerate(answers.items) if args == [key]]
            if not found:
                self.fail("protocol", "SET then WAIT(timeout 0): no TIMEOUT answer for the WAIT")
                raise _ServerGone
            self.stats.quiet_sets = found[0] == 0
        finally:
            _close(sock)

    # -- connection kinds

    def mixed(self) -> int:
        rng, make = self.rng, self.make
        calm = [k for k in ("valid", "timeout", "malformed", "bitflip", "huge") if self.enabled[k]]
        breakers = [
            k for k in ("garbage", "huge", "bitflip", "timeout", "truncated") if self.enabled[k]
        ]
        frames: list[Frame] = []
        clean = self.enabled["valid"] and rng.random() < 0.25  # valid frames only
        if clean:
            calm, breakers = ["valid"], []
        for _ in range(rng.randint(20, 100)):
            kind = rng.choices(calm, [_CALM_WEIGHTS[k] for k in calm])[0] if calm else None
            if kind == "valid":
                frames.append(make.valid())
            elif kind == "timeout":
                frame = make.timeout()
                while frame.breaks:
                    frame = make.timeout()
                frames.append(frame)
            elif kind == "malformed":
                frames.append(make.malformed())
            elif kind == "bitflip":
                frames.append(make.bitflip(header=False))
            elif kind == "huge":
                frames.append(make.huge_argument())
        if breakers and rng.random() < 0.7:
            kind = rng.choice(breakers)
            at = rng.randint(0, len(frames))
            if kind == "truncated":
                at = len(frames)
            frame = {
                "garbage": make.garbage,
                "huge": make.huge_header,
                "bitflip": lambda: make.bitflip(header=True),
                "timeout": self.long_timeout,
                "truncated": make.truncated,
            }[kind]()
            frames.insert(at, frame)
        if not frames:
            return 0
        key = _sentinel_key(self.nonce, next(self.numbers))
        if frames[-1].kind != "truncated":
            frames.append(_sentinel(key))
        for frame in frames:
            if frame.kind != "sentinel":
                self.count(frame.kind)
        batch = _Batch(frames)
        style = "clean" if clean else "mixed"
        what = f"connection {self.stats.connections + 1} ({style}, {len(frames)} frames)"
        sock = self.connect(what)
        statuses: list[int] = []
        closed = False
        try:
            _, closed = _send(sock, batch.data, _SEND_PATIENCE)
            if frames[-1].kind == "truncated" and rng.random() < 0.5:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
            answers, closed_reading = self.read_answers(sock, key)
            closed = closed or closed_reading
            statuses = [status for status, _ in answers.items]
            for status in statuses:
                self.stats.responses[_STATUS_NAMES.get(status, str(status))] += 1
            if answers.problem is not None:
                self.fail(
                    "protocol", f"{what}: {answers.problem}; {self.describe(batch, statuses)}"
                )
            found = [i for i, (status, args) in enumerate(answers.items) if args == [key]]
            if found and frames[-1].kind == "sentinel":
                status = answers.items[found[0]][0]
                problem = batch.sentinel_problem(found[0], bool(self.stats.quiet_sets))
                if status != _TIMEOUT:
                    problem = f"the sentinel WAIT(timeout 0) was answered with status {status}"
                if problem is not None:
                    self.fail("protocol", f"{what}: {problem}")
                self.stats.sentinels_checked += 1
            elif closed:
                kind, _ = batch.blame(statuses, bool(self.stats.quiet_sets))
                self.stats.closed_by_server[kind] += 1
        finally:
            _close(sock, reset=rng.random() < 0.1)
            self.remember(what, batch, statuses, closed)
        return sum(1 for frame in frames if frame.kind != "sentinel")

    def long_timeout(self) -> Frame:
        frame = self.make.timeout()
        while not frame.breaks:
            frame = self.make.timeout()
        return frame

    def describe(self, batch: _Batch, statuses: list[int]) -> str:
        _, where = batch.blame(statuses, bool(self.stats.quiet_sets))
        return f"{len(statuses)} answers; {where}"

    def read_answers(
        self, sock: socket.socket, sentinel: bytes, patience: float | None = None
    ) -> tuple[_Answers, bool]:
        """Answers until the sentinel's, a close, a quiet spell or the total bound (both
        `patience`, when given: the sentinel's answer is then required)."""
        answers = _Answers()
        idle = _READ_IDLE if patience is None else patience
        end = time.monotonic() + (_READ_TOTAL if patience is None else patience)
        read = 0
        while read < _MAX_READ and answers.problem is None:
            left = min(idle, end - time.monotonic())
            if left <= 0:
                break
            data, closed = _recv(sock, 1 << 18, left)
            read += len(data)
            answers.feed(data)
            if closed:
                return answers, True
            if not data:
                break
            if answers.items and answers.items[-1][1] == [sentinel]:
                break
        return answers, False

    def burst(self) -> int:
        rng = self.rng
        count = rng.randint(50, 250)
        seconds = _SECONDS.pack(rng.choice((0.0, 0.5)))
        data = b"".join(_frame(GET, [seconds, self.make.key()]) for _ in range(count))
        what = f"connection {self.stats.connections + 1} (burst of {count} GETs, unread)"
        sock = self.connect(what)
        try:
            _send(sock, data, _SEND_PATIENCE)
        finally:
            _close(sock, reset=rng.random() < 0.5)
            self.remember(what)
        self.count("burst", count)
        return count

    def hangup(self) -> int:
        rng = self.rng
        what = f"connection {self.stats.connections + 1} (hang-up)"
        if rng.random() < 0.5:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=_CONNECT_TIMEOUT)
            except OSError as exc:
                self.fail("liveness", f"the server refused {what} ({exc}), {self.last_words()}")
                raise _ServerGone from None
            self.stats.connections += 1
        else:
            sock, _ = self.open(what)
        _close(sock, reset=rng.random() < 0.5)
        self.remember(what)
        self.count("hangup")
        return 1

    def bad_handshake(self) -> int:
        """One connection that fuzzes the proof; a server must never accept a wrong one."""
        rng = self.rng
        variant = rng.choice(("partial", "random", "wrong key", "flipped", "replayed",
                              "frames first", "piecemeal", "pipelined"))  # fmt: skip
        what = f"connection {self.stats.connections + 1} (handshake: {variant} proof)"
        sock, hello = self.open(what)
        self.remember(what)
        self.count("handshake")
        peer = f"the store at {self.host}:{self.port}"
        proof, expected = auth.proof_message(self.key, hello, peer)
        try:
            if variant in ("piecemeal", "pipelined"):
                key = _sentinel_key(self.nonce, next(self.numbers))
                if variant == "piecemeal":
                    at = 0
                    while at < len(proof):
                        step = rng.randint(1, 8)
                        _send(sock, proof[at : at + step], _SEND_PATIENCE)
                        at += step
                    tail = _sentinel(key).data
                else:
                    proof += _frame(NUM_KEYS, []) + _sentinel(key).data
                    tail = b""
                    _send(sock, proof, _SEND_PATIENCE)
                _send(sock, tail, _SEND_PATIENCE)
                accept, _ = _recv_exact(sock, auth.ACCEPT_SIZE, self.patience)
                try:
                    auth.verify_accept(expected, accept, peer)
                except DistNetworkError as exc:
                    _close(sock)
                    self.gone_or_fail("auth", f"{what}: a right proof was not accepted: {exc}")
                    raise _ServerGone from None
                answers, _ = self.read_answers(sock, key, patience=self.patience)
                if not any(args == [key] for _, args in answers.items):
                    _close(sock)
                    self.gone_or_fail("auth", f"{what}: no answers after an accepted proof")
                    raise _ServerGone
                return 1
            if variant == "partial":
                junk = proof[: rng.randrange(auth.PROOF_SIZE)]
                if rng.random() < 0.5:
                    junk = rng.randbytes(len(junk))
            elif variant == "random":
                junk = rng.randbytes(auth.PROOF_SIZE + rng.choice((0, 0, 1, 100)))
            elif variant == "wrong key":
                junk = auth.proof_message((self.key or b"") + b"?", hello, peer)[0]
            elif variant == "flipped":
                spot = rng.randrange(auth.PROOF_SIZE)
                junk = bytearray(proof)
                junk[spot] ^= 1 << rng.randrange(8)
                junk = bytes(junk)
            elif variant == "replayed":
                junk = self.old_proof or rng.randbytes(auth.PROOF_SIZE)
            else:  # frames first: a request where the proof belongs
                junk = b"".join(self.make.valid().data for _ in range(4)) + _frame(NUM_KEYS, [])
            _send(sock, junk, _SEND_PATIENCE)
            if variant == "partial":
                return 1  # and hang up mid-proof
            data, _ = _recv_exact(sock, 1, 0.1)
            if data:
                self.fail("auth", f"{what}: the server answered a wrong proof ({data!r}...)")
            return 1
        finally:
            _close(sock, reset=rng.random() < 0.2)

    # -- held phases: memory under hostile load, sampled while the connections are open

    def flood(self) -> None:
        rng = self.rng
        size = rng.choice((0xFFFFFFFF, 0xFFFFFFF0, 0x80000001))
        socks: list[socket.socket | None] = []
        before = self.sample("before a flood phase")
        during, held = "a flood phase", None
        try:
            for number in range(_FLOOD_CONNECTIONS):
                sock = self.connect(f"flood connection {number + 1}")
                socks.append(sock)
                _send(sock, _HEADER.pack(size, rng.randint(1, 13)), _SEND_PATIENCE)
            self.count("flood", _FLOOD_CONNECTIONS)
            chunk = memoryview(bytes(MiB))
            pushed = [0] * len(socks)
            stalls, deadline = 0, time.monotonic() + 30.0
            while stalls < 3 and time.monotonic() < deadline:
                progress = False
                for index, sock in enumerate(socks):
                    while sock is not None and pushed[index] < _FLOOD_BYTES:
                        want = min(len(chunk), _FLOOD_BYTES - pushed[index])
                        try:
                            sent = sock.send(chunk[:want])
                        except (BlockingIOError, InterruptedError):
                            break
                        except OSError:  # the server refused the frame and closed
                            _close(sock)
                            socks[index] = sock = None
                            break
                        pushed[index] += sent
                        progress = True
                if all(s is None or p >= _FLOOD_BYTES for s, p in zip(socks, pushed, strict=True)):
                    break
                stalls = 0 if progress else stalls + 1
                self.settle()
            self.settle()
            during = (
                f"flood: {len(socks)} connections each declaring a {size:#x}-byte frame, "
                f"{sum(pushed) / MiB:.0f} MiB of body pushed, "
                f"{sum(s is not None for s in socks)} still open"
            )
            held = self.sample(during)
        finally:
            for sock in socks:
                if sock is not None:
                    _close(sock, reset=True)
            self.remember("a flood phase")
        self.settle()
        self.phase(during, before, held, self.sample(f"after the {during}"))

    def backlog(self) -> None:
        value = self.rng.randbytes(_BACKLOG_VALUE)
        answered = 0 if self.stats.quiet_sets else 1
        problem = self.sync(_frame(SET, [b"fuzz-backlog", value]), answered)
        if problem is not None:
            self.fail("liveness", f"SET of the backlog value failed: {problem}")
            raise _ServerGone
        data = b"".join(
            _frame(GET, [_SECONDS.pack(1.0), b"fuzz-backlog"]) for _ in range(_BACKLOG_GETS)
        )
        before = self.sample("before a backlog phase")
        sock = self.connect("the backlog connection")
        try:
            sent, _ = _send(sock, data, 2.0)
            self.count("backlog", _BACKLOG_GETS)
            self.settle()
            self.settle()
            during = (
                f"backlog: {_BACKLOG_GETS} GETs of a {_BACKLOG_VALUE}-byte value pipelined on "
                f"one connection ({sent * 100 // len(data)}% of them taken), no answer read"
            )
            held = self.sample(during)
        finally:
            _close(sock, reset=True)
            self.remember("the backlog phase")
        self.settle()
        self.phase(during, before, held, self.sample(f"after the {during}"))

    def phase(self, during: str, *rss: int | None) -> None:
        before, held, after = (_mib(value) for value in rss)
        self.stats.phases.append(f"{during}: RSS {before} before, {held} held, {after} after")

    # -- the run

    def run(self, frames: int) -> FuzzStats:
        stats, rng = self.stats, self.rng
        warmup = min(max(frames // 10, 200), 20000)
        step = min(max((frames - warmup) // 4, 2500), 50000)
        held = [kind for kind in ("flood", "backlog") if self.enabled[kind]]
        next_held, held_count = warmup, 0
        types = {"mixed": 85, "burst": 4, "hangup": 3, "handshake": 8}
        if self.key is None:
            types.pop("handshake")
        for kind in ("burst", "hangup", "handshake"):
            if not self.enabled[kind]:
                types.pop(kind, None)
        names, weights = list(types), list(types.values())
        started = time.monotonic()
        reported = 0
        try:
            stats.rss_start = self.sample("start")
            self.detect_quiet()
            while stats.frames < frames:
                if stats.rss_before is None and stats.frames >= warmup:
                    self.settle()
                    stats.rss_before = self.sample("after the warm-up")
                    stats.rss_peak, stats.rss_peak_at = stats.rss_before, "after the warm-up"
                if held and stats.rss_before is not None and stats.frames >= next_held:
                    kind = held[held_count % len(held)]
                    held_count += 1
                    next_held += step
                    if kind == "flood":
                        self.flood()
                    else:
                        self.backlog()
                    continue
                kind = rng.choices(names, weights)[0]
                what = f"connection {stats.connections + 1} ({kind})"
                sent = {
                    "mixed": self.mixed,
                    "burst": self.burst,
                    "hangup": self.hangup,
                    "handshake": self.bad_handshake,
                }[kind]()
                if not sent:
                    stats.frames += 1  # nothing enabled to send: still move on
                if stats.rss_before is not None:
                    self.sample(what)
                if self.progress is not None and stats.frames * 10 // frames > reported:
                    reported = stats.frames * 10 // frames
                    self.progress(
                        f"{stats.frames}/{frames} frames, {stats.connections} connections, "
                        f"{time.monotonic() - started:.0f} s"
                    )
            self.settle()
            stats.rss_after = self.sample("the end")
        except _ServerGone:
            pass
        finally:
            if self.sync_sock is not None:
                _close(self.sync_sock)
            stats.seconds = time.monotonic() - started
        return stats


_STATUS_NAMES = {_OK: "OK", _TIMEOUT: "TIMEOUT", _ERROR: "ERROR", _LATE_ERROR: "LATE_ERROR"}


def run_fuzz(
    host: str,
    port: int,
    frames: int,
    seed: int,
    key: bytes | str | None = None,
    *,
    server_pid: int | None = None,
    exclude: Collection[str] = (),
    progress: Callable[[str], None] | None = None,
) -> FuzzStats:
    """Send about `frames` fuzzed frames to the TCPStore server at `host:port`.

    Args:
        host: the server's address.
        port: its port.
        frames: how many frames to send (held phases and hang-ups count too).
        seed: fixes every random choice.
        key: the server's DISTCOMM_AUTH_KEY, or None for an open server; with a key, some
            connections fuzz the handshake.
        server_pid: the server's process, to sample its RSS (None: no sampling).
        exclude: kinds of `KINDS` to leave out.
        progress: called with a line of progress every tenth of the run.

    Returns:
        The statistics; `failures` lists what went wrong (the run stops at the first
        sign that the server is gone).

    Raises:
        ValueError: `exclude` names an unknown kind.
    """
    if isinstance(key, str):
        key = key.encode()
    return _Fuzzer(host, port, seed, key or None, server_pid, exclude, progress).run(frames)


# -- the server process and the checks around a run ---------------------------------------


def _serve(pipe: multiprocessing.connection.Connection, key: str | None) -> None:
    """Child: host a TCPStore server, report (port, pid), wait for the pipe to close."""
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # ServerProcess.dump_stacks
    logging.basicConfig(
        level=logging.ERROR, format="[store server pid %(process)d] %(levelname)s %(message)s"
    )
    if key is None:
        os.environ.pop("DISTCOMM_AUTH_KEY", None)
    else:
        os.environ["DISTCOMM_AUTH_KEY"] = key
    store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=30)
    pipe.send((store.port, os.getpid()))
    with contextlib.suppress(EOFError, OSError):
        pipe.recv()
    store.close()


class ServerProcess:
    """A TCPStore server in a spawned process; a context manager that always kills it.

    Args:
        key: DISTCOMM_AUTH_KEY for the server, or None for an open one.
        timeout: seconds to wait for the child to report its port.

    Raises:
        RuntimeError: the child did not report its port in time (it is killed).
    """

    def __init__(self, key: bytes | str | None = None, timeout: float = 60.0) -> None:
        self.key = key.decode() if isinstance(key, bytes) else key
        self.timeout = timeout
        self.port = self.pid = 0
        self._process: multiprocessing.process.BaseProcess | None = None
        self._pipe: multiprocessing.connection.Connection | None = None

    def __enter__(self) -> ServerProcess:
        ctx = multiprocessing.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_serve, args=(child, self.key), name="store-fuzz-server", daemon=True
        )
        try:
            self._process.start()
            child.close()
            if not self._pipe.poll(self.timeout):
                raise RuntimeError(
                    f"the fuzz server process did not report its port within {self.timeout} s "
                    f"(exit code {self._process.exitcode})"
                )
            self.port, self.pid = self._pipe.recv()
        except BaseException:
            self.kill()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()

    def alive(self) -> bool:
        """Whether the server process is still running (not exited, not a zombie)."""
        if self._process is None or not self._process.is_alive():
            return False
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def dump_stacks(self, wait: float = 1.0) -> None:
        """Have the server process print every thread's stack to its stderr (a hung loop)."""
        if self.alive():
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGUSR1)
                time.sleep(wait)

    def kill(self) -> None:
        """SIGKILL the server process and reap it (idempotent)."""
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None
        process, self._process = self._process, None
        if process is None:
            return
        if process.pid is not None:
            process.kill()
            process.join(30)
        process.close()


@contextlib.contextmanager
def _auth_env(key: bytes | str | None) -> Iterator[None]:
    """DISTCOMM_AUTH_KEY set to `key` (unset for None) for the block; restored after."""
    before = os.environ.get("DISTCOMM_AUTH_KEY")
    if key is None:
        os.environ.pop("DISTCOMM_AUTH_KEY", None)
    else:
        os.environ["DISTCOMM_AUTH_KEY"] = key.decode() if isinstance(key, bytes) else key
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("DISTCOMM_AUTH_KEY", None)
        else:
            os.environ["DISTCOMM_AUTH_KEY"] = before


def check_client(
    host: str, port: int, key: bytes | str | None = None, timeout: float = 10.0
) -> str:
    """Whether a normal TCPStore client can set/get/add/wait/num_keys: "ok", or what failed."""
    name = f"fuzz-check/{uuid.uuid4().hex[:8]}"
    step = "connect"
    try:
        with _auth_env(key):
            store = TCPStore(host, port, timeout=timeout)
        try:
            step = "set"
            store.set(name, b"ok")
            step = "get"
            if store.get(name) != b"ok":
                return "get returned a wrong value"
            step = "add"
            if (store.add(f"{name}/n", 3), store.add(f"{name}/n", 4)) != (3, 7):
                return "add counted wrong"
            step = "wait"
            store.wait([name, f"{name}/n"], timeout=5)
            step = "num_keys"
            if store.num_keys() < 2:
                return "num_keys is below the keys just set"
            step = "wait for a missing key"
            try:
                store.wait([f"{name}/absent"], timeout=0.2)
            except DistStoreTimeoutError:
                pass
            else:
                return "wait for a missing key returned"
        finally:
            store.close()
    except Exception as exc:
        return f"{step} failed: {type(exc).__name__}: {exc}"
    return "ok"


def _survives(connections: list[list[Frame]], key: bytes | None) -> bool:
    """Whether a fresh server still answers after `connections` (each a list of frames)
    were sent to it one after another, each on its own connection."""
    with ServerProcess(key) as server:
        fuzzer = _Fuzzer(HOST, server.port, 0, key, None, (), None)
        fuzzer.patience = _REPLAY_PATIENCE
        try:
            for number, frames in enumerate(connections):
                sentinel = _sentinel_key("replay", number)
                kept = [frame for frame in frames if frame.kind != "sentinel"]
                data = b"".join(frame.data for frame in [*kept, _sentinel(sentinel)])
                sock = fuzzer.connect("the replay")
                try:  # served as far as it goes: short parks end, the sentinel comes back
                    _send(sock, data, _SEND_PATIENCE)
                    fuzzer.read_answers(sock, sentinel, patience=_REPLAY_READ)
                finally:
                    _close(sock)
            time.sleep(_REPLAY_SETTLE)  # requests parked, then dropped, leave their timers
            return fuzzer.probe() is None
        except _ServerGone:
            return False
        finally:
            if fuzzer.sync_sock is not None:
                _close(fuzzer.sync_sock)


def _shortest(count: int, fails: Callable[[int], bool]) -> int:
    """The least n in 1..count with fails(n), given fails(count) and that it is monotonic."""
    low, high = 0, count
    while high - low > 1:
        middle = (low + high) // 2
        if fails(middle):
            high = middle
        else:
            low = middle
    return high


def isolate(connections: list[list[Frame]], key: bytes | str | None = None) -> str:
    """Replay the last `connections` on fresh servers to find the frame after which a server
    stops answering; a sentence naming it.

    The shortest run of whole connections that stops a server is found first, then the
    shortest prefix of its last connection.
    """
    if isinstance(key, str):
        key = key.encode()
    total = len(connections)
    if not total:
        return "no mixed connection to replay"
    deadline = time.monotonic() + _REPLAY_BUDGET

    def fails(replay: list[list[Frame]]) -> bool:
        if time.monotonic() > deadline:
            raise TimeoutError
        return not _survives(replay, key)

    try:
        if not fails(connections):
            return (
                f"replaying the last {total} mixed connections on a fresh server leaves it "
                "answering (the cause lies in earlier traffic, or in timing)"
            )
        count = _shortest(total, lambda n: fails(connections[:n]))
        before, frames = connections[: count - 1], connections[count - 1]
        length = _shortest(len(frames), lambda n: fails([*before, frames[:n]]))
    except TimeoutError:
        return f"replays to isolate it gave up after {_REPLAY_BUDGET:.0f} s"
    culprit = frames[length - 1]
    after = f" after the {count - 1} before it" if count > 1 else " alone"
    return (
        f"replayed on fresh servers, connection {count} of the last {total} mixed ones stops "
        f"a server{after}, at its frame {length}/{len(frames)} ({culprit.kind}: "
        f"{culprit.label})"
    )


def fuzz_server(
    frames: int,
    seed: int,
    key: bytes | str | None = None,
    *,
    rss_growth_limit: int = 64 * MiB,
    exclude: Collection[str] = (),
    progress: Callable[[str], None] | None = None,
) -> FuzzStats:
    """Fuzz a fresh server process, then check it: alive, usable, memory bounded.

    Args:
        frames: frames to send (see `run_fuzz`).
        seed: fixes the stream.
        key: run the server with this DISTCOMM_AUTH_KEY (and fuzz the handshake).
        rss_growth_limit: the most the server's RSS may grow after the warm-up.
        exclude: kinds of `KINDS` to leave out.
        progress: called with lines of progress.

    Returns:
        The statistics, with `alive`, `client` and every failure filled in.
    """
    with ServerProcess(key) as server:
        stats = run_fuzz(
            HOST, server.port, frames, seed, key,
            server_pid=server.pid, exclude=exclude, progress=progress,
        )  # fmt: skip
        stats.alive = server.alive()
        liveness = [i for i, text in enumerate(stats.failures) if text.startswith("[liveness]")]
        if liveness:
            server.dump_stacks()
            stats.failures[liveness[0]] += "; " + isolate(stats.recent, key)
        if not stats.alive:
            stats.failures.append("[process] the server process died")
        stats.client = check_client(HOST, server.port, key) if stats.alive else "not tried"
        if stats.client != "ok" and stats.alive:
            stats.failures.append(f"[client] a normal TCPStore client: {stats.client}")
        growth = stats.rss_growth
        if growth is None:
            if server.alive() and stats.rss_before is None:
                stats.failures.append("[memory] not measured: the run ended before the warm-up did")
        elif growth > rss_growth_limit:
            stats.failures.append(
                f"[memory] the server's RSS grew by {growth / MiB:.1f} MiB after the warm-up "
                f"({stats.rss_before / MiB:.1f} MiB), more than {rss_growth_limit / MiB:.0f} MiB; "
                f"the largest rise between two samples, {stats.rss_rise / MiB:.1f} MiB, came "
                f"during {stats.rss_rise_at}"
            )
    return stats


def main(argv: list[str] | None = None) -> int:
    """The command line: fuzz a fresh server, print the summary; exit 1 on any failure."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.store_fuzz", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--frames", type=int, default=100_000, help="frames to send")
    parser.add_argument("--seed", type=int, default=1, help="fixes the stream")
    parser.add_argument("--key", help="run the server with this DISTCOMM_AUTH_KEY")
    parser.add_argument(
        "--exclude", default="", help=f"comma-separated kinds from {', '.join(KINDS)}"
    )
    parser.add_argument("--rss-limit-mib", type=float, default=64.0, help="allowed RSS growth")
    parser.add_argument("--verbose", action="store_true", help="progress and the full report")
    args = parser.parse_args(argv)
    exclude = [kind for kind in args.exclude.split(",") if kind]
    unknown = sorted(set(exclude) - set(KINDS))
    if unknown:
        parser.error(
            f"--exclude: unknown kinds {', '.join(unknown)}; choose from {', '.join(KINDS)}"
        )
    progress = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else None
    try:
        stats = fuzz_server(
            args.frames, args.seed, args.key,
            rss_growth_limit=int(args.rss_limit_mib * MiB), exclude=exclude, progress=progress,
        )  # fmt: skip
    except KeyboardInterrupt:
        print("store fuzz: interrupted (the server process was killed)", file=sys.stderr)
        return 130
    print(stats.report() if args.verbose or stats.failures else stats.summary(), flush=True)
    return 1 if stats.failures else 0


if __name__ == "__main__":
    sys.exit(main())
