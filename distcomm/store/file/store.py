"""FileStore: a store kept in a locked, append-only file on a (possibly shared) filesystem.

The file is a log, as in torch's FileStore: a magic line, then checksummed records
(`records` describes them) that every FileStore object replays incrementally from where it
last stopped into a `state.LogState`.

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
from collections.abc import Sequence
from datetime import timedelta

from ... import config
from ...config import DEFAULT_STORE_TIMEOUT
from ...deadline import Deadline, StallClock, to_seconds
from ...errors import DistStoreError, DistStoreTimeoutError
from ..base import CloseOnCollect, Store, check_block, check_key, to_bytes
from ..hash import (
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
from .records import (
    MAGIC,
    OP_APPEND,
    OP_CLOSE,
    OP_DELETE,
    OP_OPEN,
    OP_QUEUE_POP,
    OP_QUEUE_PUSH,
    OP_SET,
    FileLock,
    not_a_store_file,
    pwrite_all,
)
from .state import LogState

__all__ = ["FileStore"]

log = logging.getLogger("distcomm.store")

_COMPACT_MIN = 1 << 20  # bytes: smaller files are never compacted
_COMPACT_RATIO = 4  # compact once the file is this many times larger than the live data
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


class FileStore(CloseOnCollect, Store):
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
        self._state = LogState(self.path)

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
                self._state.write(self._fd, OP_OPEN, "", b"", b"")
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
            state = self._state
            if compact and state.pos > max(self._compact_above, _COMPACT_RATIO * state.live):
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
        pos = self._state.pos
        while pos < size:
            chunk = os.pread(self._fd, size - pos, pos)
            if not chunk:
                break
            chunks.append(chunk)
            pos += len(chunk)
        return b"".join(chunks)

    def _replay(self, exclusive: bool) -> None:
        """Apply the records written since the last replay (the file lock is held).

        Under the exclusive lock a torn record at the end is cut off.
        """
        size = os.fstat(self._fd).st_size
        if size < self._state.pos:
            raise DistStoreError(
                f"FileStore file {self.path!r} is {size} bytes long, but this FileStore "
                f"already read {self._state.pos} bytes of it: it was truncated (by another program "
                "or a person?), so the store's contents are lost; start the job again with a "
                "new file"
            )
        data = self._read_new(size)
        offset = 0
        if self._state.pos == 0:
            if not data.startswith(MAGIC):
                if not MAGIC.startswith(data):
                    raise not_a_store_file(self.path, data)
                if exclusive:  # new, or its creator died while writing the magic line
                    pwrite_all(self._fd, MAGIC, 0)
                    self._state.pos = len(MAGIC)
                return  # else being created by another process
            offset = len(MAGIC)
        if self._state.replay(data, offset) and exclusive:  # cut off a torn record
            os.ftruncate(self._fd, self._state.pos)

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
            size = self._state.write_compacted(fd)
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
            self._compact_above = 2 * self._state.pos
            log.warning(
                "could not compact FileStore file %r (%s); it keeps growing, next attempt "
                "at %d bytes",
                self.path,
                exc,
                self._compact_above,
            )
            return
        self._attach(fd)
        self._state.pos = size

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
                state = self._state
                data = KeysOrQueues(state.data, state.queues) if queues else state.data
                first = _first_missing(keys, first, data)
                if first == len(keys):
                    first = _first_missing(keys, 0, data)
                    if first == len(keys):
                        return [] if queues else [self._state.data[key] for key in keys]
                if deadline.expired():
                    missing = [key for key in keys if key not in data]
                    raise timeout_error(missing, timeout, f"the FileStore {self.path!r}")
            waited = stall.due()
            if waited is not None:
                log_still_waiting(
                    log,
                    f"a wait on the FileStore {self.path!r}",
                    waited,
                    [key for key in keys if key not in data],
                    timeout,
                    stall.next,
                )
            delay = deadline.nap(delay, _KEY_POLL_MOST)

    # -- the Store methods ----------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        """Store `value` under `key`, replacing any previous value."""
        check_key(key)
        data = to_bytes(value)
        with self._locked(True):
            self._state.write(self._fd, OP_SET, key, key.encode(), data)

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
            value = add_value(key, self._state.data.get(key), amount)
            self._state.write(self._fd, OP_SET, key, key.encode(), value)
        return int(value)

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Atomically set `key` to `desired_value` if it holds `expected_value` (see Store)."""
        check_key(key)
        expected = to_bytes(expected_value, "expected_value")
        desired = to_bytes(desired_value, "desired_value")
        with self._locked(True):
            new, result = compare_set_value(self._state.data.get(key), expected, desired)
            if new is not None:
                self._state.write(self._fd, OP_SET, key, key.encode(), new)
        return result

    def wait(self, keys: Sequence[str], timeout: float | timedelta | None = None) -> None:
        """Block until every key in `keys` is set, up to `timeout` (default: the store's).

        Raises:
            DistStoreTimeoutError: names the keys still missing.
        """
        names = check_keys(keys)
        self._wait_for(
            names, self._timeout if timeout is None else to_seconds(timeout), queues=True
        )

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in `keys` is set (or its queue holds an item), without waiting."""
        names = check_keys(keys)
        with self._locked(False):
            return all(key in self._state.data or key in self._state.queues for key in names)

    def delete_key(self, key: str) -> bool:
        """Delete `key`; returns whether it existed."""
        check_key(key)
        with self._locked(True):
            if key not in self._state.data:
                return False
            self._state.write(self._fd, OP_DELETE, key, key.encode(), b"")
            return True

    def num_keys(self) -> int:
        """The number of keys in the store."""
        with self._locked(False):
            return len(self._state.data)

    def append(self, key: str, value: str | bytes) -> None:
        """Append `value` to the value of `key` (created empty)."""
        check_key(key)
        data = to_bytes(value)
        with self._locked(True):
            self._state.write(self._fd, OP_APPEND, key, key.encode(), data)

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
                self._state.write(self._fd, OP_SET, key, key.encode(), data)

    # -- the extended API -----------------------------------------------------------------

    def has_extended_api(self) -> bool:
        """True: distcomm's FileStore has queues and lists its keys (torch's has neither)."""
        return True

    def list_keys(self) -> list[str]:
        """Every key, in the order the log holds them (queues are not keys)."""
        with self._locked(False):
            return list(self._state.data.keys())

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Append `value` to the queue `key` (see Store.queue_push)."""
        check_key(key)
        data = to_bytes(value)
        with self._locked(True):
            self._state.write(self._fd, OP_QUEUE_PUSH, key, key.encode(), data)

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
                seen = key in self._state.queues
            if seen:
                with self._locked(True, deadline):
                    items = self._state.queues.get(key)
                    if items:
                        value = items[0]
                        self._state.write(self._fd, OP_QUEUE_POP, key, key.encode(), b"")
                        return value
                continue  # another popper took it first: look again at once
            if not block:
                raise queue_empty_error(key, where)
            if deadline.expired():
                raise queue_timeout_error(key, self._timeout, where)
            waited = stall.due()
            if waited is not None:
                log_still_waiting(
                    log, f"queue_pop({key!r}) on {where}", waited, [key], self._timeout, stall.next
                )
            delay = deadline.nap(delay, _KEY_POLL_MOST)

    def queue_len(self, key: str) -> int:
        """The number of items in queue `key` (0 when it has none)."""
        check_key(key)
        with self._locked(False):
            items = self._state.queues.get(key)
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
                    self._state.write(self._fd, OP_CLOSE, "", b"", b"")
                    if self._state.users <= 0 and 0 < self.world_size <= self._state.finished:
                        try:
                            os.unlink(self.path)
                        except FileNotFoundError:
                            pass  # removed already (by hand?)
                finally:
                    self._unlock(compact=False)
            finally:
                os.close(self._fd)
                self._fd = -1

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
