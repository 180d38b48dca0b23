"""The TCPStore wire protocol: frames, commands, statuses and the server's size limits.

Every connection starts with the handshake of `distcomm.auth`, then carries frames,
requests answered in order::

    request  = body length (u32 LE) + command (u8) + body
    response = body length (u32 LE) + status  (u8) + body
    body     = zero or more arguments, each a length (u32 LE) + bytes

Keys and values are raw bytes; the server never unpickles or evaluates anything.
SET, APPEND, MULTI_SET and QUEUE_PUSH are quiet, as in torch: the server answers them only to refuse
them (status LATE_ERROR), and the client reads that answer before the answer of its next
request, so a client writes without waiting for a round trip. Waiting commands (GET,
MULTI_GET, WAIT, WAIT_WORKERS) carry their timeout in seconds as their first argument
(f64 LE; any size, `inf` for none). A REGISTER answer carries the server's `Limits`, so
clients refuse an oversized request before sending it. A keyless client sends REGISTER
without waiting for the greeting; the server reads it as it accepts the connection and
sends its answer with the greeting, in one packet.

QUEUE_POP (timeout, key) answers OK with the item, OK with no argument when the queue
is empty and the timeout is 0, or TIMEOUT with the key; a pop that waits is parked at
the server and handed the next item pushed, so several poppers never share one.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from ...config import load as load_config
from ...errors import DistStoreError

__all__ = [
    "HEADER",
    "LENGTH",
    "QUIET",
    "SECONDS",
    "Cmd",
    "Limits",
    "ProtocolError",
    "Status",
    "decode_args",
    "encode_frame",
]

HEADER = struct.Struct("<IB")
LENGTH = struct.Struct("<I")
SECONDS = struct.Struct("<d")
_COALESCE = 1 << 16  # frames smaller than this go out as one buffer


class Cmd(IntEnum):
    """Request commands."""

    REGISTER = 1  # a client announces itself (counted once per connection); answers Limits
    SET = 2
    GET = 3
    ADD = 4
    COMPARE_SET = 5
    WAIT = 6
    CHECK = 7
    DELETE_KEY = 8
    NUM_KEYS = 9
    MULTI_GET = 10
    MULTI_SET = 11
    APPEND = 12
    WAIT_WORKERS = 13  # wait until N clients have registered
    LIST_KEYS = 14
    QUEUE_PUSH = 15
    QUEUE_POP = 16
    QUEUE_LEN = 17


class Status(IntEnum):
    """Response statuses: OK (results follow), TIMEOUT (missing keys follow), ERROR (message),
    LATE_ERROR (a quiet request was refused; message)."""

    OK = 0
    TIMEOUT = 1
    ERROR = 2
    LATE_ERROR = 3


#: Requests answered only when refused.
QUIET = frozenset({Cmd.SET, Cmd.APPEND, Cmd.MULTI_SET, Cmd.QUEUE_PUSH})


class ProtocolError(DistStoreError):
    """A frame that does not follow the protocol."""


@dataclass(frozen=True)
class Limits:
    """What one request may carry; the server refuses more (torch's libuv store: 8 KiB keys,
    8 MiB values, 128 Ki keys per request).

    Attributes:
        max_key: bytes in one key (DISTCOMM_STORE_MAX_KEY_BYTES).
        max_value: bytes in one value (DISTCOMM_STORE_MAX_VALUE_BYTES).
        max_keys: keys in one request (multi_get, multi_set, wait, check).
    """

    max_key: int = 8 << 10
    max_value: int = 8 << 20
    max_keys: int = 128 << 10

    #: Room for keys and framing beside the values, in `max_request`.
    OVERHEAD = 1 << 20

    @classmethod
    def from_env(cls) -> Limits:
        """The limits DISTCOMM_STORE_MAX_KEY_BYTES and DISTCOMM_STORE_MAX_VALUE_BYTES set."""
        cfg = load_config()
        return cls(max_key=cfg.store_max_key_bytes, max_value=cfg.store_max_value_bytes)

    @property
    def max_request(self) -> int:
        """Bytes in one request body: its values together, plus `OVERHEAD` for the rest."""
        return min(0xFFFFFFFF, self.max_value + self.OVERHEAD)

    def encode(self) -> list[bytes]:
        """The limits as the tail of a REGISTER answer."""
        return [str(n).encode() for n in (self.max_key, self.max_value, self.max_keys)]

    @classmethod
    def decode(cls, args: Sequence[bytes]) -> Limits:
        """The limits a REGISTER answer carries (the defaults where it carries none)."""
        if len(args) < 3:
            return cls()
        return cls(*(int(arg) for arg in args[:3]))

    def check_request(
        self, what: str, keys: Sequence[bytes], values: Sequence[bytes], body: int
    ) -> None:
        """Refuse, before sending, a request the server would refuse.

        Raises:
            ValueError: a key, a value, the number of keys or the whole request is over its
                limit; the message names the request, the size, the limit and the variable
                that raises it.
        """
        where = "on the process that hosts the store (the master)"
        for key in keys:
            if len(key) > self.max_key:
                raise ValueError(
                    f"{what}: a key of {len(key):,} bytes is over the store's limit of "
                    f"{self.max_key:,} bytes per key; use shorter keys or raise "
                    f"DISTCOMM_STORE_MAX_KEY_BYTES {where}"
                )
        for value in values:
            if len(value) > self.max_value:
                raise ValueError(
                    f"{what}: a value of {len(value):,} bytes is over the store's limit of "
                    f"{self.max_value:,} bytes per value; keep large data out of the store "
                    f"(a file, a collective) or raise DISTCOMM_STORE_MAX_VALUE_BYTES {where}"
                )
        if len(keys) > self.max_keys:
            raise ValueError(
                f"{what}: {len(keys):,} keys in one request is over the store's limit of "
                f"{self.max_keys:,}; split the request"
            )
        if body > self.max_request:
            raise ValueError(
                f"{what}: a request of {body:,} bytes is over the store's limit of "
                f"{self.max_request:,} bytes (DISTCOMM_STORE_MAX_VALUE_BYTES plus "
                f"{self.OVERHEAD >> 20} MiB); split it or raise DISTCOMM_STORE_MAX_VALUE_BYTES "
                f"{where}"
            )


def encode_frame(code: int, args: Sequence[bytes]) -> list[bytes]:
    """A frame as buffers to send in order (one buffer when it is small).

    Raises:
        ValueError: the body is over the 4 GiB a frame can declare.
    """
    if len(args) == 1:  # the common answer: one value
        arg = args[0]
        size = len(arg)
        if size < _COALESCE:
            return [HEADER.pack(size + 4, code) + LENGTH.pack(size) + arg]
    parts: list[bytes] = []
    size = 0
    for arg in args:
        parts += (LENGTH.pack(len(arg)), arg)
        size += 4 + len(arg)
    if size > 0xFFFFFFFF:
        raise ValueError(f"store frame of {size:,} bytes exceeds the 4 GiB a frame can declare")
    parts.insert(0, HEADER.pack(size, code))
    return [b"".join(parts)] if size < _COALESCE else parts


def decode_args(buffer: bytes | bytearray, start: int = 0, end: int | None = None) -> list[bytes]:
    """The arguments of a frame body held in `buffer[start:end]`.

    Raises:
        ProtocolError: the lengths do not add up.
    """
    end = len(buffer) if end is None else end
    args = []
    unpack = LENGTH.unpack_from
    offset = start
    if type(buffer) is bytes:  # slices of bytes are copies already: no view needed
        while offset < end:
            if offset + 4 > end:
                raise ProtocolError("truncated argument length in store frame")
            stop = offset + 4 + unpack(buffer, offset)[0]
            if stop > end:
                raise ProtocolError("argument longer than its store frame")
            args.append(buffer[offset + 4 : stop])
            offset = stop
        return args
    with memoryview(buffer) as view:
        while offset < end:
            if offset + 4 > end:
                raise ProtocolError("truncated argument length in store frame")
            stop = offset + 4 + unpack(view, offset)[0]
            if stop > end:
                raise ProtocolError("argument longer than its store frame")
            args.append(view[offset + 4 : stop].tobytes())
            offset = stop
    return args
