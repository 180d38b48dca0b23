"""One connection to the shared-memory manager: line I/O under a deadline, and the greeting.

`connect` opens the manager's abstract unix socket, says ``HELLO <version> <pid>`` and
checks the answer; `Channel` then sends requests and reads answer lines under the
caller's deadline. `client.ManagerClient` runs its requests over them.
"""

from __future__ import annotations

import os
import socket
import sys
import time

from ...deadline import Deadline
from ..base import (
    ShmManagerConnectionError,
    ShmManagerError,
    ShmManagerTimeoutError,
)
from .protocol import ADDRESS_ENV, MAX_LINE, PROTOCOL_VERSION

__all__ = ["Channel", "connect", "left", "require_linux"]


def require_linux() -> None:
    """Raise `ShmManagerError` off Linux."""
    if not sys.platform.startswith("linux"):
        raise ShmManagerError(
            f"the shared-memory manager needs Linux (abstract unix sockets), not "
            f"{sys.platform}; use the file_descriptor sharing strategy"
        )


class Channel:
    """Line I/O on a connected socket under a deadline; socket errors pass through."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._rbuf = bytearray()

    def send(self, data: bytes, deadline: Deadline) -> None:
        self.sock.settimeout(left(deadline))
        self.sock.sendall(data)

    def read_line(self, deadline: Deadline) -> str:
        while True:
            end = self._rbuf.find(b"\n")
            if end >= 0:
                line = bytes(self._rbuf[:end])
                del self._rbuf[: end + 1]
                return line.decode("ascii", "replace")
            if len(self._rbuf) > MAX_LINE:
                raise ConnectionError("answer line too long: not a distcomm manager")
            self.sock.settimeout(left(deadline))
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("connection closed by the manager")
            self._rbuf += chunk


def left(deadline: Deadline) -> float:
    left = deadline.remaining()
    if not left:
        raise TimeoutError("timed out")
    return left


def connect(address: str, deadline: Deadline) -> tuple[socket.socket, Channel, int]:
    """Connect and greet; the socket, its channel and the manager's pid.

    Raises:
        ShmManagerConnectionError: nobody listens, or the manager hung up during the greeting
            (it was exiting, or it serves another user).
        ShmManagerTimeoutError: no answer within the deadline.
        ShmManagerError: something else answers, or the manager speaks another version.
    """
    require_linux()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = Channel(sock)
    try:
        while True:
            try:
                sock.settimeout(left(deadline))
                sock.connect("\0" + address)
                break
            except BlockingIOError:  # backlog full: retry
                time.sleep(min(0.01, deadline.remaining() or 0.0))
        channel.send(f"HELLO {PROTOCOL_VERSION} {os.getpid()}\n".encode(), deadline)
        reply = channel.read_line(deadline)
    except TimeoutError as exc:
        sock.close()
        raise ShmManagerTimeoutError(
            f"the shared-memory manager at {address!r} did not answer within "
            f"{deadline.seconds} s; it may be hung: find it with `pgrep -f {address}`"
        ) from exc
    except (ConnectionRefusedError, FileNotFoundError) as exc:
        sock.close()
        raise ShmManagerConnectionError(f"no shared-memory manager listens at {address!r}") from exc
    except OSError as exc:
        sock.close()
        raise ShmManagerConnectionError(
            f"the shared-memory manager at {address!r} hung up during the greeting "
            f"({exc}): it is exiting, or serves another user"
        ) from exc
    parts = reply.split()
    if len(parts) == 3 and parts[0] == "OK" and parts[1] == str(PROTOCOL_VERSION):
        try:
            return sock, channel, int(parts[2])
        except ValueError:
            pass
    sock.close()
    raise ShmManagerError(
        f"the process at {address!r} answered {reply!r} to distcomm's greeting: it is not a "
        f"distcomm shared-memory manager of protocol version {PROTOCOL_VERSION} (a different "
        f"distcomm version?); unset {ADDRESS_ENV} to start a new manager"
    )
