"""FileStore: a store kept in a locked, append-only file on a (possibly shared) filesystem.

The file is a log, as in torch's FileStore: a magic line, ``distcomm FileStore v2``, then
records that every FileStore object replays incrementally from where it last stopped::

    record = header (17 bytes) + key (UTF-8) + value
    header = op (u8) + key length (u32 LE) + value length (u32 LE)
             + CRC32 of key + value (u32 LE) + CRC32 of the 13 header bytes before it (u32 LE)
    op: 1 SET, 2 APPEND, 3 DELETE, 4 OPEN (a user registered), 5 CLOSE (a user left),
        6 USERS (value: users open and users closed so far, two i64 LE; sets both counts),
        7 QUEUE_PUSH (the value joins the end of queue `key`),
        8 QUEUE_POP (the oldest item of queue `key` leaves it; no value)

Every access holds a lock on the whole file: a shared one to read, an exclusive one
to append. Linux's open-file-description locks (F_OFD_SETLK) are used where the
platform has them: they work over NFS and, unlike POSIX record locks, separate two
FileStore objects of one process; `flock` is the fallback. Locks are taken by
polling with a short sleep so that every wait honours a deadline.

A record is verified before it is applied. An incomplete header at the end of the file,
or fewer bytes than a verified header declares, is a record left half-written by a
writer that died: readers ignore it and the next writer cuts it off. A complete record
whose checksums fail, of an unknown type or with a key that is not UTF-8 is corruption
and raises `DistStoreError` naming its byte offset; so does a file shorter than what an
object already replayed (it was truncated), and a file that does not start with the
magic line (v1 files included) is refused.

The log is compacted: a writer that finds the file over 1 MiB and more than four times
the size of the live data writes the live state (a USERS record, then one SET per key)
to a temporary file in the same directory and renames it over the path while it still
holds the exclusive lock on the old file. Every locked access checks that the path
still names the file it has open and otherwise reopens the path and replays the new
file from the start. Compaction costs amortised O(1) per byte written, and a new opener
reads at most about four times the live data.

Queues come from the same log: a pop is a QUEUE_POP record written under the exclusive
lock right after the replay that found the item, so each item goes to exactly one
popper whichever process it runs in (torch's FileStore has no queues). A blocking pop
polls with the shared lock, as `get` does, and takes the exclusive one once it sees an
item.

The OPEN/CLOSE records count users as torch does: once `world_size` users have
closed and none remains open, the last one to close removes the file.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading
import zlib
from collections import deque
from collections.abc import Sequence
from datetime import timedelta

from .. import config
from ..config import DEFAULT_STORE_TIMEOUT
from ..deadline import Deadline, StallClock, to_seconds
from ..errors import DistStoreError, DistStoreTimeoutError
from .base import Store, check_block, check_key, to_bytes
from .filelog import (
    MAGIC,
    OLD_MAGICS,
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
    FileLock,
    pwrite_all,
)
from .hash import (
    KeysOrQueues,
    Values,
    add_value,
    check_amount,
    check_keys,
    check_values,
    compare_set_value,
    log_still_waiting,
    queue_empty_error,
    queue_timeout_error,
    timeout_error,
)

__all__ = ["FileStore"]

log = logging.getLogger("distcomm.store")

_COMPACT_MIN = 1 << 20  # bytes: smaller files are never compacted
_COMPACT_RATIO = 4  # compact once the file is this many times larger than the live data
_LIVE_BASE = len(MAGIC) + RECORD.size + USERS.size  # a compacted file without keys
_WRITE_CHUNK = 1 << 20  # compaction writes the new file in pieces of about this size
_KEY_POLL_FIRST = 0.001  # seconds between looks for a missing key: doubles up to _KEY_POLL_MOST
_KEY_POLL_MOST = 0.05


def _open_error(path: str, exc: OSError) -> DistStoreError:
    folder = os.path.dirname(os.path.abspath(path))
    if exc.errno == errno.ENOENT:
        why = f"directory {folder!r} does not exist; create it first"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = "permission denied; pick a file in a directory every process can write"
    elif exc.errno == errno.EISDIR:
        why = "it is a directory; pass the name of a file (it is created if missing)"
    elif exc.errno == errno.ENOTDIR:
        why = f"a component of {folder!r} is not a directory"
    else:
        why = exc.strerror or str(exc)
    return DistStoreError(f"cannot open FileStore file {path!r}: {why}")


def _first_missing(keys: list[str], start: int, data: Values) -> int:
    """The index of the first key from `start` on that `data` lacks (len(keys) if none)."""
    while start < len(keys) and keys[start] in data:
        start += 1
    return start


class FileStore(Store):
    """A store shared through a file that every process of the job can reach (torch's FileStore).

    Args:
        file_name: the file (created with mode 0600 if missing); on a shared filesystem for
            multi-host jobs.
        world_size: how many FileStore users the job has; once that many have closed, the
            last one removes the file. -1 (default) keeps the file.
        timeout: default timeout of waiting operations (seconds or timedelta).

    Raises:
        DistStoreError: the file cannot be opened, is not a FileStore v2 file or is
            corrupt (the message names the path).
    """

    def __init__(
        self,
        file_name: str | os.PathLike[str],
        world_size: int = -1,
        timeout: float | timedelta = DEFAULT_STORE_TIMEOUT,
    ) -> None:
        super().__init__(timeout)
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"FileStore world_size must be an int, got {type(world_size).__name__}")
        if world_size == 0 or world_size < -1:
            raise ValueError(f"FileStore world_size must be -1 (unknown) or >= 1, got {world_size}")
        self.path = os.fspath(file_name)
        self.world_size = world_size
        self._mutex = threading.Lock()  # one user of this object's file offset at a time
        self._stall_warn = config.load().stall_warn_s  # a wait still waiting says so then
        self._fd = -1
        self._compact_above = _COMPACT_MIN  # raised after a compaction failed
        self._reset()
        self._open(Deadline(self._timeout))

    # -- the open file --------------------------------------------------------------------

    def _reset(self) -> None:
        """Forget everything replayed: the next replay starts at the beginning of the file."""
        self._data = Values()
        self._queues: dict[str, deque[bytes]] = {}  # only non-empty queues
        self._pos = 0  # how far the file has been replayed
        self._live = _LIVE_BASE  # the size a compaction would write now
        self._users = 0
        self._finished = 0

    def _attach(self, fd: int) -> None:
        """Make `fd` the open file (the caller closes the previous one)."""
        info = os.fstat(fd)
        self._fd = fd
        self._ident = (info.st_dev, info.st_ino)
        self._lock = FileLock(fd, self.path)

    def _open(self, deadline: Deadline) -> None:
        """Open (or create) the file and register as a user."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise _open_error(self.path, exc) from exc
        self._attach(fd)
        try:
            self._acquire(True, deadline, create=True)
            written = False
            try:
                self._write(OP_OPEN, "", b"", b"")
                written = True
            finally:
                self._unlock(compact=written)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise

    def _names_our_file(self) -> bool | None:
        """Whether the path names the open file; None when the path no longer exists."""
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise DistStoreError(f"cannot look up FileStore file {self.path!r}: {exc}") from exc
        return (info.st_dev, info.st_ino) == self._ident

    def _reopen(self, create: bool) -> None:
        """Switch to the file the path names now, to be replayed from the start.

        Without `create`, a path that vanished meanwhile leaves the open file in use.
        """
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            if exc.errno == errno.ENOENT and not create:
                return
            raise _open_error(self.path, exc) from exc
        os.close(self._fd)
        self._attach(fd)
        self._reset()

    def _acquire(self, exclusive: bool, deadline: Deadline, create: bool = False) -> None:
        """Lock the file the path names and replay it up to date.

        When another user compacted the log, the path names a new file: reopen it and
        replay it from the start. When the path no longer exists (the last user removed
        it), keep using the open file, or with `create` (while registering) make a new one.

        Raises:
            DistStoreTimeoutError: the lock was not free before `deadline`.
            DistStoreError: the file is corrupt, truncated or not a FileStore file.
        """
        while True:
            self._lock.acquire(exclusive, deadline)
            try:
                current = self._names_our_file()
                if current or (current is None and not create):
                    self._replay(exclusive)
                    return
            except BaseException:
                self._lock.release()
                raise
            self._lock.release()
            self._reopen(create)

    def _unlock(self, compact: bool) -> None:
        """Release the file lock, first compacting the log if `compact` and it is too large."""
        lock, fd = self._lock, self._fd
        try:
            if compact and self._pos > max(self._compact_above, _COMPACT_RATIO * self._live):
                self._compact()
        finally:
            try:
                lock.release()  # after a compaction: the lock on the replaced file
            finally:
                if self._fd != fd:
                    os.close(fd)

    # -- the log --------------------------------------------------------------------------

    def _read_new(self, size: int) -> bytes:
        chunks = []
        pos = self._pos
        while pos < size:
            chunk = os.pread(self._fd, size - pos, pos)
            if not chunk:
                break
            chunks.append(chunk)
            pos += len(chunk)
        return b"".join(chunks)

    def _corrupt(self, where: int, why: str) -> DistStoreError:
        return DistStoreError(
            f"FileStore file {self.path!r} is corrupt at byte {where}: {why} (was it written "
            "by something else, or damaged?); the store's contents cannot be trusted: start "
            "the job again with a new file"
        )

    def _not_ours(self, data: bytes) -> DistStoreError:
        for magic, version in OLD_MAGICS.items():
            if data.startswith(magic):
                return DistStoreError(
                    f"{self.path!r} is not a distcomm FileStore file of this version: it is a "
                    f"FileStore {version} file from an older distcomm, and this one reads only "
                    "v2 files; pass a new path (or remove the file once no job uses it)"
                )
        return DistStoreError(
            f"{self.path!r} is not a distcomm FileStore file (v2): it starts with "
            f"{data[: len(MAGIC)]!r}, not {MAGIC!r}; pass a new or unused path"
        )

    def _replay(self, exclusive: bool) -> None:
        """Apply the records written since the last replay (the file lock is held).

        Under the exclusive lock a torn record at the end is cut off.
        """
        size = os.fstat(self._fd).st_size
        if size < self._pos:
            raise DistStoreError(
                f"FileStore file {self.path!r} is {size} bytes long, but this FileStore "
                f"already read {self._pos} bytes of it: it was truncated (by another program "
                "or a person?), so the store's contents are lost; start the job again with a "
                "new file"
            )
        data = self._read_new(size)
        offset = 0
        if self._pos == 0:
            if not data.startswith(MAGIC):
                if not MAGIC.startswith(data):
                    raise self._not_ours(data)
                if exclusive:  # new, or its creator died while writing the magic line
                    pwrite_all(self._fd, MAGIC, 0)
                    self._pos = len(MAGIC)
                return  # else being created by another process
            offset = len(MAGIC)
        start = self._pos  # the file offset of data[0]
        view = memoryview(data)
        header = RECORD.size
        try:
            while len(data) - offset >= header:
                fields = RECORD.unpack_from(data, offset)
                if fields is None:
                    raise self._corrupt(start + offset, "a record header fails its checksum")
                op, key_size, value_size, data_crc = fields
                end = offset + header + key_size + value_size
                if end > len(data):
                    break  # a torn record: a writer died mid-write
                body = view[offset + header : end]
                if zlib.crc32(body) != data_crc:
                    raise self._corrupt(
                        start + offset, "a record's key and value fail their checksum"
                    )
                try:
                    key = str(body[:key_size], "utf-8")
                except UnicodeDecodeError:
                    raise self._corrupt(start + offset, "a record's key is not UTF-8") from None
                self._apply(op, key, key_size, bytes(body[key_size:]), start + offset)
                offset = end
        finally:
            self._pos = start + offset  # after the last record applied, even on error
        if exclusive and offset < len(data):
            os.ftruncate(self._fd, self._pos)

    def _apply(self, op: int, key: str, key_size: int, value: bytes, where: int) -> None:
        """Apply one record to the state, keeping the live size up to date."""
        data = self._data
        if op == OP_SET:
            if key in data:
                self._live -= RECORD.size + key_size + data.size(key)
            data[key] = value
            self._live += RECORD.size + key_size + len(value)
        elif op == OP_APPEND:
            if key not in data:
                self._live += RECORD.size + key_size
            data.append(key, value)
            self._live += len(value)
        elif op == OP_DELETE:
            if key in data:
                self._live -= RECORD.size + key_size + data.size(key)
                data.delete(key)
        elif op == OP_OPEN:
            self._users += 1
        elif op == OP_CLOSE:
            self._users -= 1
            self._finished += 1
        elif op == OP_QUEUE_PUSH:
            self._queues.setdefault(key, deque()).append(value)
            self._live += RECORD.size + key_size + len(value)
        elif op == OP_QUEUE_POP:
            items = self._queues.get(key)
            if not items:
                raise self._corrupt(where, f"a QUEUE_POP record pops the empty queue {key!r}")
            self._live -= RECORD.size + key_size + len(items.popleft())
            if not items:
                del self._queues[key]
        elif op == OP_USERS and len(value) == USERS.size:
            self._users, self._finished = USERS.unpack(value)
        elif op == OP_USERS:
            raise self._corrupt(where, f"a USERS record holds {len(value)} bytes, not 16")
        else:
            raise self._corrupt(where, f"unknown record type {op}")

    def _write(self, op: int, key: str, key_bytes: bytes, value: bytes) -> None:
        """Append one record after a replay under the exclusive lock, and apply it."""
        crc = zlib.crc32(value, zlib.crc32(key_bytes))
        record = RECORD.pack(op, len(key_bytes), len(value), crc) + key_bytes + value
        pwrite_all(self._fd, record, self._pos)
        self._apply(op, key, len(key_bytes), value, self._pos)
        self._pos += len(record)

    def _compact(self) -> None:
        """Replace the file by one holding only the live state (the exclusive lock is held).

        The new file is written next to the old one and renamed over the path; this
        object then uses it. Other users notice the new inode at their next access. A
        failure (a full disk, a read-only directory) leaves the log as it was, logs a
        warning and postpones the next attempt until the file has doubled.
        """
        target = os.path.realpath(self.path)  # a symbolic link keeps pointing at the store
        folder, name = os.path.split(target)
        temp = os.path.join(folder, f".{name}.compact-{os.getpid()}-{secrets.token_hex(4)}")
        fd = -1
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            old = os.fstat(self._fd)
            os.fchmod(fd, old.st_mode & 0o777)  # a file shared on purpose stays shared
            size = self._write_state(fd)
            os.fsync(fd)  # whole on the server before any client can open it by name
            os.replace(temp, target)
        except BaseException as exc:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(temp)
            except OSError:
                pass
            if not isinstance(exc, OSError):
                raise
            self._compact_above = 2 * self._pos
            log.warning(
                "could not compact FileStore file %r (%s); it keeps growing, next attempt "
                "at %d bytes",
                self.path,
                exc,
                self._compact_above,
            )
            return
        self._attach(fd)
        self._pos = size

    def _write_state(self, fd: int) -> int:
        """Write the magic line, a USERS record, one SET per key and one QUEUE_PUSH per queued
        item to `fd`; the bytes written."""
        users = USERS.pack(self._users, self._finished)
        out = bytearray(MAGIC)
        out += RECORD.pack(OP_USERS, 0, len(users), zlib.crc32(users)) + users
        written = 0
        records = [(OP_SET, key, self._data[key]) for key in list(self._data.keys())]
        records += [(OP_QUEUE_PUSH, key, value)
                    for key, items in self._queues.items() for value in items]
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

    def _locked(self, exclusive: bool, deadline: Deadline | None = None) -> _Locked:
        if self._fd < 0:
            raise DistStoreError(f"FileStore {self.path!r} is closed")
        return _Locked(self, exclusive, deadline or Deadline(self._timeout))

    def _wait_for(self, keys: list[str], timeout: float, queues: bool = False) -> list[bytes]:
        """The values of `keys` once all are set, polling with a growing sleep until `timeout`.

        With `queues` (wait, not get) a key also counts as set while its queue holds an
        item, and nothing is returned. Each poll resumes at the first key found missing
        before, so a wait on many keys does not look at every key each time; a full look
        confirms before returning, since a key seen earlier may have been deleted since.
        """
        deadline = Deadline(timeout)
        stall = StallClock(self._stall_warn)
        delay = _KEY_POLL_FIRST
        first = 0  # keys before it were set at the last look
        while True:
            with self._locked(False, deadline):
                data = KeysOrQueues(self._data, self._queues) if queues else self._data
                first = _first_missing(keys, first, data)
                if first == len(keys):
                    first = _first_missing(keys, 0, data)
                    if first == len(keys):
                        return [] if queues else [self._data[key] for key in keys]
                if deadline.expired():
                    missing = [key for key in keys if key not in data]
                    raise timeout_error(missing, timeout, f"the FileStore {self.path!r}")
            waited = stall.due()
            if waited is not None:
                log_still_waiting(log, f"a wait on the FileStore {self.path!r}", waited,
                                  [key for key in keys if key not in data], timeout,
                                  stall.next)
            delay = deadline.nap(delay, _KEY_POLL_MOST)

    # -- the Store methods ----------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        """Store `value` under `key`, replacing any previous value."""
        check_key(key)
        data = to_bytes(value)
        with self._locked(True):
            self._write(OP_SET, key, key.encode(), data)

    def get(self, key: str) -> bytes:
        """The value of `key`, waiting up to the store timeout for it to be set.

        Raises:
            DistStoreTimeoutError: the key was not set in time.
        """
        return self._wait_for([check_key(key)], self._timeout)[0]

    def add(self, key: str, amount: int) -> int:
        """Add `amount` to the counter `key` (created at 0); returns the new value.

        Raises:
            DistStoreError: the key holds something other than an integer.
        """
        check_key(key)
        check_amount(amount)
        with self._locked(True):
            value = add_value(key, self._data.get(key), amount)
            self._write(OP_SET, key, key.encode(), value)
        return int(value)

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Atomically set `key` to `desired_value` if it holds `expected_value` (see Store)."""
        check_key(key)
        expected = to_bytes(expected_value, "expected_value")
        desired = to_bytes(desired_value, "desired_value")
        with self._locked(True):
            new, result = compare_set_value(self._data.get(key), expected, desired)
            if new is not None:
                self._write(OP_SET, key, key.encode(), new)
        return result

    def wait(self, keys: Sequence[str], timeout: float | timedelta | None = None) -> None:
        """Block until every key in `keys` is set, up to `timeout` (default: the store's).

        Raises:
            DistStoreTimeoutError: names the keys still missing.
        """
        names = check_keys(keys)
        self._wait_for(names, self._timeout if timeout is None else to_seconds(timeout),
                       queues=True)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in `keys` is set (or its queue holds an item), without waiting."""
        names = check_keys(keys)
        with self._locked(False):
            return all(key in self._data or key in self._queues for key in names)

    def delete_key(self, key: str) -> bool:
        """Delete `key`; returns whether it existed."""
        check_key(key)
        with self._locked(True):
            if key not in self._data:
                return False
            self._write(OP_DELETE, key, key.encode(), b"")
            return True

    def num_keys(self) -> int:
        """The number of keys in the store."""
        with self._locked(False):
            return len(self._data)

    def append(self, key: str, value: str | bytes) -> None:
        """Append `value` to the value of `key` (created empty)."""
        check_key(key)
        data = to_bytes(value)
        with self._locked(True):
            self._write(OP_APPEND, key, key.encode(), data)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of `keys`, waiting up to the store timeout for all of them.

        Raises:
            DistStoreTimeoutError: names the keys still missing.
        """
        return self._wait_for(check_keys(keys), self._timeout)

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Set each key of `keys` to the value at the same position of `values`, atomically."""
        names = check_keys(keys)
        datas = check_values(names, values)
        with self._locked(True):
            for key, data in zip(names, datas, strict=True):
                self._write(OP_SET, key, key.encode(), data)

    # -- the extended API -----------------------------------------------------------------

    def has_extended_api(self) -> bool:
        """True: distcomm's FileStore has queues and lists its keys (torch's has neither)."""
        return True

    def list_keys(self) -> list[str]:
        """Every key, in the order the log holds them (queues are not keys)."""
        with self._locked(False):
            return list(self._data.keys())

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Append `value` to the queue `key` (see Store.queue_push)."""
        check_key(key)
        data = to_bytes(value)
        with self._locked(True):
            self._write(OP_QUEUE_PUSH, key, key.encode(), data)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest item of queue `key`, removed (see Store.queue_pop).

        Several processes popping one queue each get distinct items: the pop is written to
        the log under the exclusive lock, after the replay that found the item.

        Raises:
            QueueEmptyError: `block` is False and the queue is empty.
            DistStoreTimeoutError: no item came within the store timeout.
        """
        check_key(key)
        check_block(block)
        where = f"the FileStore {self.path!r}"
        deadline = Deadline(self._timeout)
        stall = StallClock(self._stall_warn)
        delay = _KEY_POLL_FIRST
        while True:
            with self._locked(False, deadline):
                seen = key in self._queues
            if seen:
                with self._locked(True, deadline):
                    items = self._queues.get(key)
                    if items:
                        value = items[0]
                        self._write(OP_QUEUE_POP, key, key.encode(), b"")
                        return value
                continue  # another popper took it first: look again at once
            if not block:
                raise queue_empty_error(key, where)
            if deadline.expired():
                raise queue_timeout_error(key, self._timeout, where)
            waited = stall.due()
            if waited is not None:
                log_still_waiting(log, f"queue_pop({key!r}) on {where}", waited, [key],
                                  self._timeout, stall.next)
            delay = deadline.nap(delay, _KEY_POLL_MOST)

    def queue_len(self, key: str) -> int:
        """The number of items in queue `key` (0 when it has none)."""
        check_key(key)
        with self._locked(False):
            items = self._queues.get(key)
            return 0 if items is None else len(items)

    def close(self) -> None:
        """Unregister from the file (removing it if this is the last of `world_size` users)."""
        mutex = getattr(self, "_mutex", None)
        if mutex is None or getattr(self, "_fd", -1) < 0:
            return
        with mutex:
            if self._fd < 0:
                return
            try:
                self._acquire(True, Deadline(self._timeout))
                try:
                    self._write(OP_CLOSE, "", b"", b"")
                    if self._users <= 0 and 0 < self.world_size <= self._finished:
                        try:
                            os.unlink(self.path)
                        except FileNotFoundError:
                            pass  # removed already (by hand?)
                finally:
                    self._unlock(compact=False)
            finally:
                os.close(self._fd)
                self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"FileStore({self.path!r}, world_size={self.world_size})"


class _Locked:
    """Holds the object's mutex and the file lock, replayed up to date, for one operation.

    Leaving an exclusive section without an error may compact the log.
    """

    __slots__ = ("deadline", "exclusive", "store")

    def __init__(self, store: FileStore, exclusive: bool, deadline: Deadline) -> None:
        self.store, self.exclusive, self.deadline = store, exclusive, deadline

    def __enter__(self) -> None:
        store = self.store
        left = self.deadline.remaining()
        wait = -1 if left is None else min(1.0 + left, threading.TIMEOUT_MAX)
        if not store._mutex.acquire(timeout=wait):
            raise DistStoreTimeoutError(
                f"FileStore {store.path!r} is busy in another thread of this process"
            )
        try:
            if store._fd < 0:
                raise DistStoreError(f"FileStore {store.path!r} is closed")
            store._acquire(self.exclusive, self.deadline)
        except BaseException:
            store._mutex.release()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        try:
            self.store._unlock(compact=self.exclusive and exc_type is None)
        finally:
            self.store._mutex.release()
