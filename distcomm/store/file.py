"""FileStore: a store kept in a locked, append-only file on a (possibly shared) filesystem.

The file is a log, as in torch's FileStore: a magic line, then records that every
FileStore object replays incrementally from where it last stopped::

    record = op (u8) + key length (u32 LE) + value length (u32 LE) + key + value
    op: 1 SET, 2 APPEND, 3 DELETE, 4 OPEN (a user registered), 5 CLOSE (a user left)

Every access holds a lock on the whole file: a shared one to read, an exclusive one
to append. Linux's open-file-description locks (F_OFD_SETLK) are used where the
platform has them: they work over NFS and, unlike POSIX record locks, separate two
FileStore objects of one process; `flock` is the fallback. Locks are taken by
polling with a short sleep so that every wait honours a deadline. A record left
half-written by a crashed writer is ignored by readers and cut off by the next writer.

The OPEN/CLOSE records count users as torch does: once `world_size` users have
closed and none remains open, the last one to close removes the file.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
from collections.abc import Sequence
from datetime import timedelta

from ..config import DEFAULT_STORE_TIMEOUT
from ..deadline import Deadline, to_seconds
from ..errors import DistStoreError, DistStoreTimeoutError
from .base import Store, check_key, to_bytes
from .hash import (
    add_value,
    check_amount,
    check_keys,
    check_values,
    compare_set_value,
    timeout_error,
)

__all__ = ["FileStore"]

MAGIC = b"distcomm FileStore v1\n"
RECORD = struct.Struct("<BII")
OP_SET, OP_APPEND, OP_DELETE, OP_OPEN, OP_CLOSE = 1, 2, 3, 4, 5

_LOCK_POLL_FIRST = 0.0002  # seconds between lock attempts: doubles up to _LOCK_POLL_MOST
_LOCK_POLL_MOST = 0.005
_KEY_POLL_FIRST = 0.001  # seconds between looks for a missing key: doubles up to _KEY_POLL_MOST
_KEY_POLL_MOST = 0.05
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


class FileStore(Store):
    """A store shared through a file that every process of the job can reach (torch's FileStore).

    Args:
        file_name: the file (created if missing); on a shared filesystem for multi-host jobs.
        world_size: how many FileStore users the job has; once that many have closed, the
            last one removes the file. -1 (default) keeps the file.
        timeout: default timeout of waiting operations (seconds or timedelta).

    Raises:
        DistStoreError: the file cannot be opened or is not a FileStore file (the message
            names the path).
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
        self._data: dict[str, bytes] = {}
        self._pos = 0
        self._users = 0
        self._finished = 0
        self._fd = -1
        self._open(Deadline(self._timeout))

    # -- the log --------------------------------------------------------------------------

    def _open(self, deadline: Deadline) -> None:
        """Open the file and register as a user; reopen if the last user just removed it."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise _open_error(self.path, exc) from exc
            self._fd, self._lock = fd, FileLock(fd, self.path)
            try:
                self._lock.acquire(True, deadline)
                try:
                    if os.fstat(fd).st_nlink > 0:
                        self._replay(exclusive=True)
                        self._write(OP_OPEN, b"", b"")
                        return
                finally:
                    self._lock.release()
            except BaseException:
                os.close(fd)
                self._fd = -1
                raise
            os.close(fd)  # the last user removed it between our open and our lock: again
            self._fd = -1

    def _read_new(self) -> bytes:
        size = os.fstat(self._fd).st_size
        chunks = []
        pos = self._pos
        while pos < size:
            chunk = os.pread(self._fd, size - pos, pos)
            if not chunk:
                break
            chunks.append(chunk)
            pos += len(chunk)
        return b"".join(chunks)

    def _replay(self, exclusive: bool) -> None:
        """Apply the records written since the last replay (the file lock is held)."""
        data = self._read_new()
        offset = 0
        if self._pos == 0:
            if exclusive and MAGIC.startswith(data):  # new (or its creator died mid-write)
                os.pwrite(self._fd, MAGIC, 0)
                self._pos = len(MAGIC)
                return
            if len(data) < len(MAGIC) and MAGIC.startswith(data):
                return  # being created by another process
            if not data.startswith(MAGIC):
                raise DistStoreError(
                    f"{self.path!r} is not a distcomm FileStore file; pass a new or unused path"
                )
            offset = len(MAGIC)
        view = memoryview(data)
        while offset + RECORD.size <= len(data):
            op, key_size, value_size = RECORD.unpack_from(data, offset)
            end = offset + RECORD.size + key_size + value_size
            if end > len(data):
                break  # a torn record: a writer died mid-write
            key = bytes(view[offset + RECORD.size : offset + RECORD.size + key_size]).decode()
            value = bytes(view[end - value_size : end])
            self._apply(op, key, value, self._pos + offset)
            offset = end
        self._pos += offset
        if exclusive and offset < len(data):
            os.ftruncate(self._fd, self._pos)

    def _apply(self, op: int, key: str, value: bytes, where: int) -> None:
        if op == OP_SET:
            self._data[key] = value
        elif op == OP_APPEND:
            self._data[key] = self._data.get(key, b"") + value
        elif op == OP_DELETE:
            self._data.pop(key, None)
        elif op == OP_OPEN:
            self._users += 1
        elif op == OP_CLOSE:
            self._users -= 1
            self._finished += 1
        else:
            raise DistStoreError(
                f"FileStore file {self.path!r} is corrupt at byte {where} (record type {op}); "
                "was it written by something else?"
            )

    def _write(self, op: int, key: bytes, value: bytes) -> None:
        """Append one record after a replay under the exclusive lock, and apply it."""
        record = RECORD.pack(op, len(key), len(value)) + key + value
        written = 0
        while written < len(record):
            written += os.pwrite(self._fd, record[written:], self._pos + written)
        self._apply(op, key.decode(), value, self._pos)
        self._pos += len(record)

    def _locked(self, exclusive: bool, deadline: Deadline | None = None) -> _Locked:
        if self._fd < 0:
            raise DistStoreError(f"FileStore {self.path!r} is closed")
        return _Locked(self, exclusive, deadline or Deadline(self._timeout))

    def _wait_for(self, keys: list[str], timeout: float) -> list[bytes]:
        """The values of `keys` once all are set, polling with a growing sleep until `timeout`."""
        deadline = Deadline(timeout)
        delay = _KEY_POLL_FIRST
        while True:
            with self._locked(False, deadline):
                missing = [key for key in keys if key not in self._data]
                if not missing:
                    return [self._data[key] for key in keys]
            if deadline.expired():
                raise timeout_error(missing, timeout, f"the FileStore {self.path!r}")
            delay = deadline.nap(delay, _KEY_POLL_MOST)

    # -- the Store methods ----------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        """Store `value` under `key`, replacing any previous value."""
        data = to_bytes(value)
        with self._locked(True):
            self._write(OP_SET, check_key(key).encode(), data)

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
            self._write(OP_SET, key.encode(), value)
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
                self._write(OP_SET, key.encode(), new)
        return result

    def wait(self, keys: Sequence[str], timeout: float | timedelta | None = None) -> None:
        """Block until every key in `keys` is set, up to `timeout` (default: the store's).

        Raises:
            DistStoreTimeoutError: names the keys still missing.
        """
        names = check_keys(keys)
        self._wait_for(names, self._timeout if timeout is None else to_seconds(timeout))

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in `keys` is set, without waiting."""
        names = check_keys(keys)
        with self._locked(False):
            return all(key in self._data for key in names)

    def delete_key(self, key: str) -> bool:
        """Delete `key`; returns whether it existed."""
        check_key(key)
        with self._locked(True):
            if key not in self._data:
                return False
            self._write(OP_DELETE, key.encode(), b"")
            return True

    def num_keys(self) -> int:
        """The number of keys in the store."""
        with self._locked(False):
            return len(self._data)

    def append(self, key: str, value: str | bytes) -> None:
        """Append `value` to the value of `key` (created empty)."""
        data = to_bytes(value)
        with self._locked(True):
            self._write(OP_APPEND, check_key(key).encode(), data)

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
                self._write(OP_SET, key.encode(), data)

    def close(self) -> None:
        """Unregister from the file (removing it if this is the last of `world_size` users)."""
        mutex = getattr(self, "_mutex", None)
        if mutex is None or getattr(self, "_fd", -1) < 0:
            return
        with mutex:
            if self._fd < 0:
                return
            try:
                self._lock.acquire(True, Deadline(self._timeout))
                try:
                    self._replay(exclusive=True)
                    self._write(OP_CLOSE, b"", b"")
                    if self._users <= 0 and 0 < self.world_size <= self._finished:
                        os.unlink(self.path)
                finally:
                    self._lock.release()
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
    """Holds the object's mutex and the file lock, replayed up to date, for one operation."""

    __slots__ = ("deadline", "exclusive", "store")

    def __init__(self, store: FileStore, exclusive: bool, deadline: Deadline) -> None:
        self.store, self.exclusive, self.deadline = store, exclusive, deadline

    def __enter__(self) -> None:
        store = self.store
        left = self.deadline.remaining()
        if not store._mutex.acquire(timeout=1.0 + (left or 0.0)):
            raise DistStoreTimeoutError(
                f"FileStore {store.path!r} is busy in another thread of this process"
            )
        try:
            if store._fd < 0:
                raise DistStoreError(f"FileStore {store.path!r} is closed")
            store._lock.acquire(self.exclusive, self.deadline)
            try:
                store._replay(self.exclusive)
            except BaseException:
                store._lock.release()
                raise
        except BaseException:
            store._mutex.release()
            raise

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.store._lock.release()
        finally:
            self.store._mutex.release()
