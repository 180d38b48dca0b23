"""What a FileStore's log says once replayed: its keys, its queues and its user counts.

`LogState` applies the log's records in file order (checking each one, see `records`),
keeps how far the file has been replayed and the size a compaction would write now, and
writes that live state as a new log when the file is compacted.
"""

from __future__ import annotations

import zlib
from collections import deque

from ...errors import DistStoreError
from ..hash import Values
from .records import (
    MAGIC,
    OP_APPEND,
    OP_CLOSE,
    OP_DELETE,
    OP_OPEN,
    OP_QUEUE_POP,
    OP_QUEUE_PUSH,
    OP_SET,
    OP_USERS,
    RECORD,
    USERS,
    pwrite_all,
)

__all__ = ["LIVE_BASE", "LogState"]

LIVE_BASE = len(MAGIC) + RECORD.size + USERS.size  # a compacted file without keys
_WRITE_CHUNK = 1 << 20  # compaction writes the new file in pieces of about this size


class LogState:
    """The state a FileStore has replayed from its file, and how far it has read.

    Args:
        path: the file's path, for messages.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.data = Values()
        self.queues: dict[str, deque[bytes]] = {}  # only non-empty queues
        self.pos = 0  # how far the file has been replayed
        self.live = LIVE_BASE  # the size a compaction would write now
        self.users = 0
        self.finished = 0

    def corrupt(self, where: int, why: str) -> DistStoreError:
        return DistStoreError(
            f"FileStore file {self.path!r} is corrupt at byte {where}: {why} (was it written "
            "by something else, or damaged?); the store's contents cannot be trusted: start "
            "the job again with a new file"
        )

    def replay(self, data: bytes, offset: int) -> bool:
        """Apply the complete records of `data[offset:]`, the bytes of the file from `pos` on.

        `pos` ends after the last record applied, even when one is corrupt.

        Returns:
            Whether a torn record (a writer died mid-write) is left at the end.

        Raises:
            DistStoreError: a record is corrupt (the message names its byte offset).
        """
        start = self.pos  # the file offset of data[0]
        view = memoryview(data)
        header = RECORD.size
        try:
            while len(data) - offset >= header:
                fields = RECORD.unpack_from(data, offset)
                if fields is None:
                    raise self.corrupt(start + offset, "a record header fails its checksum")
                op, key_size, value_size, data_crc = fields
                end = offset + header + key_size + value_size
                if end > len(data):
                    break  # a torn record: a writer died mid-write
                body = view[offset + header : end]
                if zlib.crc32(body) != data_crc:
                    raise self.corrupt(
                        start + offset, "a record's key and value fail their checksum"
                    )
                try:
                    key = str(body[:key_size], "utf-8")
                except UnicodeDecodeError:
                    raise self.corrupt(start + offset, "a record's key is not UTF-8") from None
                self.apply(op, key, key_size, bytes(body[key_size:]), start + offset)
                offset = end
        finally:
            self.pos = start + offset  # after the last record applied, even on error
        return offset < len(data)

    def apply(self, op: int, key: str, key_size: int, value: bytes, where: int) -> None:
        """Apply one record to the state, keeping the live size up to date."""
        data = self.data
        if op == OP_SET:
            if key in data:
                self.live -= RECORD.size + key_size + data.size(key)
            data[key] = value
            self.live += RECORD.size + key_size + len(value)
        elif op == OP_APPEND:
            if key not in data:
                self.live += RECORD.size + key_size
            data.append(key, value)
            self.live += len(value)
        elif op == OP_DELETE:
            if key in data:
                self.live -= RECORD.size + key_size + data.size(key)
                data.delete(key)
        elif op == OP_OPEN:
            self.users += 1
        elif op == OP_CLOSE:
            self.users -= 1
            self.finished += 1
        elif op == OP_QUEUE_PUSH:
            self.queues.setdefault(key, deque()).append(value)
            self.live += RECORD.size + key_size + len(value)
        elif op == OP_QUEUE_POP:
            items = self.queues.get(key)
            if not items:
                raise self.corrupt(where, f"a QUEUE_POP record pops the empty queue {key!r}")
            self.live -= RECORD.size + key_size + len(items.popleft())
            if not items:
                del self.queues[key]
        elif op == OP_USERS and len(value) == USERS.size:
            self.users, self.finished = USERS.unpack(value)
        elif op == OP_USERS:
            raise self.corrupt(where, f"a USERS record holds {len(value)} bytes, not 16")
        else:
            raise self.corrupt(where, f"unknown record type {op}")

    def write(self, fd: int, op: int, key: str, key_bytes: bytes, value: bytes) -> None:
        """Append one record to `fd` where the replay ended (the exclusive lock is held), and
        apply it."""
        crc = zlib.crc32(value, zlib.crc32(key_bytes))
        record = RECORD.pack(op, len(key_bytes), len(value), crc) + key_bytes + value
        pwrite_all(fd, record, self.pos)
        self.apply(op, key, len(key_bytes), value, self.pos)
        self.pos += len(record)

    def write_compacted(self, fd: int) -> int:
        """Write the live state as a new log to `fd`: the magic line, a USERS record, one SET
        per key and one QUEUE_PUSH per queued item; returns the bytes written."""
        users = USERS.pack(self.users, self.finished)
        out = bytearray(MAGIC)
        out += RECORD.pack(OP_USERS, 0, len(users), zlib.crc32(users)) + users
        written = 0
        records = [(OP_SET, key, self.data[key]) for key in list(self.data.keys())]
        records += [
            (OP_QUEUE_PUSH, key, value) for key, items in self.queues.items() for value in items
        ]
        for op, key, value in records:
            key_bytes = key.encode()
            crc = zlib.crc32(value, zlib.crc32(key_bytes))
            out += RECORD.pack(op, len(key_bytes), len(value), crc)
            out += key_bytes
            out += value
            if len(out) >= _WRITE_CHUNK:
                pwrite_all(fd, out, written)
                written += len(out)
                out = bytearray()
        pwrite_all(fd, out, written)
        return written + len(out)
