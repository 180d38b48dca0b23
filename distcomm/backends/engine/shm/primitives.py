"""Shared memory between the ranks of one host: a control segment, futex waits, direct copies.

The segment is created by the lowest rank with `memfd_create` and mapped by the others
through `/proc/<pid>/fd/<fd>`: it never has a name in `/dev/shm`, so nothing outlives the
processes however they end (`kill -9` included). It holds one arrival and one completion
counter per rank, and two generations of per-rank slots (a collective's signature, the
addresses of its arrays, and small payloads inline).

Bulk data never passes through the segment: a rank publishes the addresses of its arrays
and its peers read straight from its address space into theirs with `process_vm_readv`
(Linux cross-memory attach: one copy, as MPICH and Open MPI do within a node). Only
reads: no rank ever writes into another's memory, so a rank woken long after the others
gave it up cannot touch arrays they have reused (see the engine). That needs ptrace
permission between the ranks; where Yama restricts ptrace to descendants, each rank
allows its peers with `PR_SET_PTRACER` (as Open MPI does), and where that is not enough
`probe` reports why and the backend uses TCP.

Waits block in the kernel on futex words (after a short poll): four ranks on two cores
never spin for long. Counters have a single writer each (their rank), so no atomic
read-modify-write is needed. That relies on the CPU keeping plain stores in order
(x86-64); the backend uses TCP elsewhere. A rank about to sleep raises a flag of its own
first, and a rank that raises a counter wakes sleepers only when a flag is up: both
sides put a `store_load_fence` between their store and their load, so one of them always
sees the other's (no lost wake-up) and the common case, nobody asleep, costs no system
call.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import threading
import time

import numpy as np

from .... import config
from ....errors import DistBackendError

__all__ = [
    "Segment",
    "allow_peer_access",
    "cma_read",
    "futex_wait",
    "futex_wake",
    "host_identity",
    "store_load_fence",
]

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

# futex(2) syscall numbers; other architectures fall back to sleeping polls
_SYS_FUTEX = {
    "x86_64": 202,
    "aarch64": 98,
    "arm64": 98,
    "riscv64": 98,
    "ppc64le": 221,
    "s390x": 238,
}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_INT_MAX = 0x7FFFFFFF
_PR_SET_PTRACER, _PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1).value


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_readv = _libc.process_vm_readv
_readv.restype = ctypes.c_ssize_t
_readv.argtypes = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_ulong,
]


def futex_wait(address: int, expected: int, timeout: float) -> None:
    """Sleep while the int32 at `address` equals `expected`, at most `timeout` seconds.

    Returns early on a wake-up, a changed value or a signal; the caller re-checks.
    """
    if _SYS_FUTEX is None:
        time.sleep(min(timeout, 0.0005))
        return
    timeout = max(timeout, 0.0)
    spec = _Timespec(int(timeout), int((timeout % 1.0) * 1e9))
    _syscall(
        _SYS_FUTEX,
        ctypes.c_void_p(address),
        _FUTEX_WAIT,
        ctypes.c_int(expected),
        ctypes.byref(spec),
        None,
        0,
    )


_fence_lock = threading.Lock()


def store_load_fence() -> None:
    """Make this thread's earlier stores visible to other CPUs before its later loads.

    x86-64 may satisfy a load before an earlier store to another address leaves the store
    buffer; a locked instruction is a full fence. An uncontended lock's acquire and
    release each run one (glibc's semaphores and CPython's own locks both take and give
    with atomic compare-exchange or fetch-add), with no system call.
    """
    _fence_lock.acquire()
    _fence_lock.release()


def futex_wake(address: int) -> None:
    """Wake every thread, in any process, sleeping on the int32 at `address`."""
    if _SYS_FUTEX is not None:
        _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _INT_MAX, None, None, 0)


def cma_read(pid: int, local: int, remote: int, nbytes: int) -> None:
    """Copy `nbytes` from address `remote` of process `pid` to `local` of this process."""
    while nbytes > 0:
        lvec, rvec = _Iovec(local, nbytes), _Iovec(remote, nbytes)
        done = _readv(pid, ctypes.byref(lvec), 1, ctypes.byref(rvec), 1, 0)
        if done <= 0:
            err = ctypes.get_errno()
            if done < 0 and err == 4:  # EINTR
                continue
            raise DistBackendError(
                f"shared-memory transport: cannot read {nbytes} bytes of process {pid}: "
                f"{os.strerror(err) if done < 0 else 'no progress'} (has it exited?)"
            )
        local, remote, nbytes = local + done, remote + done, nbytes - done


def host_identity() -> str:
    """Who can share memory with whom: the same kernel boot and the same PID namespace.

    `DISTCOMM_HOST_ID` overrides it (tests use it to place ranks on pretend hosts).
    """
    override = config.get("DISTCOMM_HOST_ID")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return f"{platform.node()}/no-proc"
    return f"{platform.node()}/{boot}/{namespace}"


def allow_peer_access() -> None:
    """Let sibling processes use cross-memory attach on this one under Yama ptrace_scope 1."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return
    if scope == 1:
        _libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0)


class Segment:
    """A shared mapping of `size` bytes: created here, or attached from another process.

    Args:
        size: bytes (rounded up to a page).
        owner: (pid, fd) of the creating process to attach to; None creates it.
    """

    def __init__(self, size: int, owner: tuple[int, int] | None = None) -> None:
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        self.size = size
        self.fd: int | None = None
        if owner is None:
            fd = os.memfd_create("distcomm-gloo", getattr(os, "MFD_CLOEXEC", 1))
            try:
                os.ftruncate(fd, size)
                self._map = mmap.mmap(fd, size)
            except BaseException:
                os.close(fd)
                raise
            self.fd = fd
        else:
            pid, fd = owner
            opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
            try:
                self._map = mmap.mmap(opened, size)
            finally:
                os.close(opened)
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.address = self.bytes.ctypes.data

    def release_fd(self) -> None:
        """Close the creating descriptor once every peer has mapped the segment."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.release_fd()
        if self._map is not None:
            self.bytes = np.empty(0, np.uint8)
            try:
                self._map.close()
            except BufferError:  # a view is still alive somewhere; the GC unmaps it
                pass
            self._map = None
