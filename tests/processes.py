"""Process bookkeeping for tests: which descendants run, a check that none is left, and
what the daemons tests start need (free loopback ports, death with the test, a stop)."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import socket
import subprocess
from collections.abc import Iterator

import psutil

__all__ = ["descendants", "die_with_parent", "free_ports", "no_process_left", "stop"]


def descendants(ignore: tuple[str, ...] = ()) -> dict[int, float]:
    """This process's live descendants as {pid: create_time}, zombies and processes whose
    command line contains one of `ignore` left out."""
    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if ignore and any(mark in " ".join(proc.cmdline()) for mark in ignore):
                continue
            found[proc.pid] = proc.create_time()
        except psutil.Error:
            pass
    return found


@contextlib.contextmanager
def no_process_left(ignore: tuple[str, ...] = ()) -> Iterator[None]:
    """Fail (AssertionError) if the block leaves a descendant it started running; the
    leftovers are killed first, so one test's leak does not break the next."""
    before = descendants(ignore)
    yield
    left = {pid: t for pid, t in descendants(ignore).items() if before.get(pid) != t}
    for pid in left:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert not left, f"processes left behind: {sorted(left)}"


def stop(process: subprocess.Popen, grace: float) -> None:
    """End a process the test started: SIGTERM, up to `grace` seconds, then SIGKILL and up
    to `grace` seconds more (a process that survives even that raises TimeoutExpired)."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(grace)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now on `host` (the race until it is bound again
    is accepted)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free TCP ports on `host` (bound together, then released)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]


def die_with_parent() -> None:
    """A `preexec_fn`: the child gets SIGTERM when the test process dies (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass
