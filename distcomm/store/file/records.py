"""The FileStore's file: its magic line, its checksummed records, and its whole-file lock.

The file is a log: a magic line, ``distcomm FileStore v2``, then records::

    record = header (17 bytes) + key (UTF-8) + value
    header = op (u8) + key length (u32 LE) + value length (u32 LE)
             + CRC32 of key + value (u32 LE) + CRC32 of the 13 header bytes before it (u32 LE)
    op: 1 SET, 2 APPEND, 3 DELETE, 4 OPEN (a user registered), 5 CLOSE (a user left),
        6 USERS (value: users open and users closed so far, two i64 LE; sets both counts),
        7 QUEUE_PUSH (the value joins the end of queue `key`),
        8 QUEUE_POP (the oldest item of queue `key` leaves it; no value)

See `store.FileStore` for how the log is locked, replayed and compacted.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import zlib

from ...deadline import Deadline
from ...errors import DistStoreError, DistStoreTimeoutError

__all__ = [
    "MAGIC",
    "OLD_MAGICS",
    "OP_APPEND",
    "OP_CLOSE",
    "OP_DELETE",
    "OP_OPEN",
    "OP_QUEUE_POP",
    "OP_QUEUE_PUSH",
    "OP_SET",
    "OP_USERS",
    "RECORD",
    "USERS",
    "FileLock",
    "RecordHeader",
    "not_a_store_file",
    "pwrite_all",
]

MAGIC = b"distcomm FileStore v2\n"
OLD_MAGICS = {b"distcomm FileStore v1\n": "v1"}
OP_SET, OP_APPEND, OP_DELETE, OP_OPEN, OP_CLOSE, OP_USERS = 1, 2, 3, 4, 5, 6
OP_QUEUE_PUSH, OP_QUEUE_POP = 7, 8
USERS = struct.Struct("<qq")  # the value of a USERS record: users open, users closed


class RecordHeader:
    """The fixed-size header of a record, with its two CRC32s (see `file`'s module docstring)."""

    _FIELDS = struct.Struct("<BIII")  # op, key length, value length, CRC32 of key + value
    _CRC = struct.Struct("<I")
    size = _FIELDS.size + _CRC.size

    def pack(self, op: int, key_size: int, value_size: int, data_crc: int = 0) -> bytes:
        """The header of a record.

        Args:
            op: the record type.
            key_size: the key's length in bytes.
            value_size: the value's length in bytes.
            data_crc: `zlib.crc32(key + value)`; the default 0 is the CRC32 of nothing,
                right for a record with neither key nor value.
        """
        fields = self._FIELDS.pack(op, key_size, value_size, data_crc)
        return fields + self._CRC.pack(zlib.crc32(fields))

    def unpack_from(self, buffer: bytes, offset: int) -> tuple[int, int, int, int] | None:
        """(op, key length, value length, CRC32 of key + value) of the header at `offset`,
        or None when the header's own checksum does not match."""
        (crc,) = self._CRC.unpack_from(buffer, offset + self._FIELDS.size)
        if zlib.crc32(buffer[offset : offset + self._FIELDS.size]) != crc:
            return None
        return self._FIELDS.unpack_from(buffer, offset)


RECORD = RecordHeader()


_LOCK_POLL_FIRST = 0.0002  # seconds between lock attempts: doubles up to _LOCK_POLL_MOST
_LOCK_POLL_MOST = 0.005
_BUSY = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)


class FileLock:
    """A whole-file lock on one open file description, acquired by polling until a deadline.

    Args:
        fd: the open file (read-write).
        path: the file's name, for messages.
        use_ofd: use open-file-description record locks (default: where available),
            else `flock`.
    """

    _FLOCK = struct.Struct("hhqqi")  # struct flock: type, whence, start, len, pid

    def __init__(self, fd: int, path: str, use_ofd: bool | None = None) -> None:
        self.fd = fd
        self.path = path
        self.use_ofd = hasattr(fcntl, "F_OFD_SETLK") if use_ofd is None else use_ofd

    def _ofd(self, kind: int) -> None:
        arg = self._FLOCK.pack(kind, os.SEEK_SET, 0, 0, 0)
        fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, arg + b"\0" * (-len(arg) % 8))

    def acquire(self, exclusive: bool, deadline: Deadline) -> None:
        """Take the lock (exclusive or shared).

        Raises:
            DistStoreTimeoutError: another holder kept it past `deadline`.
        """
        delay = _LOCK_POLL_FIRST
        while True:
            try:
                if self.use_ofd:
                    self._ofd(fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK)
                else:
                    fcntl.flock(
                        self.fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
                    )
                return
            except OSError as exc:
                if exc.errno not in _BUSY:
                    raise DistStoreError(
                        f"cannot lock FileStore file {self.path!r}: {exc}"
                    ) from exc
            if deadline.expired():
                raise DistStoreTimeoutError(
                    f"could not lock FileStore file {self.path!r} within {deadline.seconds:.1f} s: "
                    "another process holds the lock (is one stopped or hung?)"
                )
            delay = deadline.nap(delay, _LOCK_POLL_MOST)

    def release(self) -> None:
        """Drop the lock."""
        if self.use_ofd:
            self._ofd(fcntl.F_UNLCK)
        else:
            fcntl.flock(self.fd, fcntl.LOCK_UN)


def pwrite_all(fd: int, data: bytes | bytearray, offset: int) -> None:
    """Write all of `data` at `offset` (pwrite may write less than asked)."""
    view = memoryview(data)
    written = 0
    while written < len(view):
        written += os.pwrite(fd, view[written:], offset + written)


def not_a_store_file(path: str, data: bytes) -> DistStoreError:
    """The error for a file at `path` that does not start with the magic line."""
    for magic, version in OLD_MAGICS.items():
        if data.startswith(magic):
            return DistStoreError(
                f"{path!r} is not a distcomm FileStore file of this version: it is a "
                f"FileStore {version} file from an older distcomm, and this one reads only "
                "v2 files; pass a new path (or remove the file once no job uses it)"
            )
    return DistStoreError(
        f"{path!r} is not a distcomm FileStore file (v2): it starts with "
        f"{data[: len(MAGIC)]!r}, not {MAGIC!r}; pass a new or unused path"
    )
