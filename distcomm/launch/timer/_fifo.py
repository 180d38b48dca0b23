"""The timer server's reading end of its named pipe: create the pipe (or adopt a stale one
of this user that nobody reads), read complete request lines, and remove the pipe when
closed. `file_based_local_timer.FileTimerServer` reads its requests through it; the wire
format of a request is `FileTimerRequest`'s, there."""

from __future__ import annotations

import errno
import logging
import math
import os
import select
import stat
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from .api import RequestQueue, TimerRequest

__all__ = ["FifoRequestQueue"]

# the public module's logger: a user's logging configuration for it covers the pipe too
log = logging.getLogger("distcomm.launch.timer.file_based_local_timer")

R = TypeVar("R", bound=TimerRequest)

#: a partial line longer than this is garbage from a foreign writer, not a request
_MAX_PARTIAL_LINE = 1 << 16


class FifoRequestQueue(RequestQueue, Generic[R]):
    """Reads requests from the named pipe: a non-blocking read end plus a write end of our
    own, so the pipe never reports end-of-file between clients and `wake` can interrupt a
    wait (with an empty line, which parsing skips).

    Args:
        path: the pipe's path.
        parse: one line (without its newline) -> a request; raises `ValueError` on a line
            that is not one (it is logged and skipped).
    """

    def __init__(self, path: str, parse: Callable[[bytes], R]) -> None:
        self._path = path
        self._parse = parse
        self._read_fd = -1
        self._keep_fd = -1
        self._identity: tuple[int, int] | None = None
        self._poller = select.poll()
        self._buffer = bytearray()
        self._pending: deque[R] = deque()
        self._woken = False

    def open(self) -> None:
        """Create the pipe (or adopt a stale one) and open both ends.

        Raises:
            FileExistsError: the path is something else, or another server reads the pipe.
        """
        created = False
        try:
            os.mkfifo(self._path, 0o600)
            created = True
        except FileExistsError:
            self._check_stale()
        try:
            self._read_fd = os.open(self._path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            self._keep_fd = os.open(self._path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            info = os.fstat(self._read_fd)
            if not stat.S_ISFIFO(info.st_mode):
                raise FileExistsError(f"{self._path} was replaced while the server opened it")
            self._poller.register(self._read_fd, select.POLLIN)
        except BaseException:
            self.close()
            if created:
                os.unlink(self._path)
            raise
        self._identity = (info.st_dev, info.st_ino)

    def _check_stale(self) -> None:
        info = os.lstat(self._path)
        if not stat.S_ISFIFO(info.st_mode):
            raise FileExistsError(
                f"timer pipe path {self._path} exists and is not a named pipe; remove it or "
                f"choose another path"
            )
        if info.st_uid != os.getuid():
            raise FileExistsError(
                f"timer pipe {self._path} belongs to uid {info.st_uid}, not to this user"
            )
        try:
            probe = os.open(self._path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nobody reads it: left behind, reuse it
                log.info("reusing the stale timer pipe %s", self._path)
                return
            raise
        os.close(probe)
        raise FileExistsError(
            f"timer pipe {self._path} is in use by another timer server; choose another path"
        )

    @property
    def closed(self) -> bool:
        return self._read_fd < 0

    def close(self) -> None:
        """Close both ends and remove the pipe, unless the path now names something else."""
        if self._identity is not None:
            self._poller.unregister(self._read_fd)
        for fd in (self._read_fd, self._keep_fd):
            if fd >= 0:
                os.close(fd)
        self._read_fd = self._keep_fd = -1
        if self._identity is not None:
            try:
                info = os.lstat(self._path)
                if (info.st_dev, info.st_ino) == self._identity:
                    os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._identity = None

    def wake(self) -> None:
        # the flag covers a wake that comes before `get` polls (a drain may already have
        # eaten the newline); the newline covers one that comes while it polls
        self._woken = True
        if self._keep_fd >= 0:
            try:
                os.write(self._keep_fd, b"\n")
            except OSError:  # pipe full: the reader is awake anyway
                pass

    def size(self) -> int:
        self._drain()
        return len(self._pending)

    def get(self, size: int, timeout: float) -> list[R]:
        self._drain()
        if self._woken:
            self._woken = False
        elif (
            len(self._pending) < size
            and timeout > 0
            and self._poller.poll(math.ceil(timeout * 1000))
        ):
            self._drain()
        return [self._pending.popleft() for _ in range(min(size, len(self._pending)))]

    def _drain(self) -> None:
        if self.closed:
            raise RuntimeError(f"the timer pipe {self._path} is closed (the server was stopped)")
        while True:
            try:
                chunk = os.read(self._read_fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._buffer += chunk
        if b"\n" not in self._buffer:
            if len(self._buffer) > _MAX_PARTIAL_LINE:
                log.warning(
                    "timer pipe %s: discarding %d bytes with no newline",
                    self._path,
                    len(self._buffer),
                )
                self._buffer.clear()
            return
        *lines, rest = bytes(self._buffer).split(b"\n")
        self._buffer[:] = rest
        for line in lines:
            if not line.strip():
                continue
            try:
                self._pending.append(self._parse(line))
            except ValueError as exc:
                log.warning("timer pipe %s: ignoring request %r: %s", self._path, line[:200], exc)
