"""The shared segments behind shared arrays: created, mapped, received, reference-counted.

A `SharedSegment` owns one MAP_SHARED mapping made with libc `mmap` and unmaps it (and
closes its descriptor, or releases this process's reference to its name) when collected.
``file_descriptor`` segments are `memfd_create` files sent as descriptors; ``file_system``
segments are named files in /dev/shm whose names the shm manager reference-counts
(`manager_client`). A process maps a segment once however often it receives it.
`sharing` describes both strategies and chooses between them.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
import re
import resource
import secrets
import weakref
from typing import Any

from .shm.protocol import NAME_PREFIX

__all__ = [
    "FILE_DESCRIPTOR",
    "FILE_SYSTEM",
    "SHM_DIR",
    "SharedSegment",
    "create_fd_segment",
    "create_named_segment",
    "fd_limit_error",
    "manager_client",
    "open_fd_segment",
    "open_named_segment",
    "send_reference",
]

FILE_DESCRIPTOR = "file_descriptor"
FILE_SYSTEM = "file_system"
SHM_DIR = "/dev/shm"
#: Prefix of every file_system segment's name in /dev/shm.
_NAME_RE = re.compile(re.escape(NAME_PREFIX) + r"[0-9]+_[0-9]+_[0-9a-f]+\Z")


_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value

_counter = itertools.count()
# mappings this process holds, so a segment received twice is mapped once:
# (st_dev, st_ino) for descriptor segments, the name for named ones
_mapped: weakref.WeakValueDictionary[Any, SharedSegment] = weakref.WeakValueDictionary()


# -- segments ---------------------------------------------------------------------------------


def fd_limit_error(exc: OSError, action: str) -> OSError:
    """An OSError for EMFILE/ENFILE that names the limit and the remedy (`exc` otherwise).

    Args:
        exc: the error a descriptor-creating call raised.
        action: what was being done, for the message ("create a shared segment").
    """
    if exc.errno not in (errno.EMFILE, errno.ENFILE):
        return exc
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        count = f"{len(os.listdir('/proc/self/fd'))} open"
    except OSError:
        count = "the limit reached"
    scope = (
        "the system-wide limit (fs.file-max)"
        if exc.errno == errno.ENFILE
        else f"this process's RLIMIT_NOFILE (soft {soft}, hard {hard}; {count})"
    )
    return OSError(
        exc.errno,
        f"cannot {action}: too many open file descriptors: {scope}. The "
        f"'{FILE_DESCRIPTOR}' sharing strategy keeps one descriptor open for every shared "
        "array's segment in every process that maps it. Raise the limit (ulimit -n, "
        "resource.setrlimit(resource.RLIMIT_NOFILE, ...)) or call "
        f"distcomm.multiprocessing.set_sharing_strategy('{FILE_SYSTEM}') before sharing "
        "arrays",
    )


def _map(fd: int, size: int) -> int:
    address = _mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map a shared segment of {size} bytes: {os.strerror(err)}")
    return address


def _finalize(address: int, size: int, fd: int | None) -> None:
    _munmap(address, size)
    if fd is not None:
        os.close(fd)


def _release(name: str, pid: int) -> None:
    if os.getpid() != pid:  # a forked child holds no reference of its own
        return
    from .shm.client import ManagerClient

    client = ManagerClient.current()  # never start a manager from a finalizer
    if client is not None:
        try:
            client.release(name)
        except Exception:  # the manager dropped this client's references already
            pass


class SharedSegment:
    """One shared mapping, owned by this object and unmapped when it is collected.

    Arrays over the segment keep it alive through their `.base` chain (numpy builds them
    from this object's `__array_interface__`). Not created directly: use `empty`,
    `share_memory` or the `open_*_segment` functions.

    Attributes:
        address: the mapping's first byte in this process.
        size: bytes mapped.
        strategy: the strategy it was created with (how it is sent).
        fd: its open descriptor (``file_descriptor``), None otherwise.
        name: its /dev/shm name (``file_system``), None otherwise.
        key: what identifies it across processes: (st_dev, st_ino) or the name.
        pid: the process that created or received it (after a fork, not this one).
    """

    __slots__ = ("__weakref__", "address", "fd", "key", "name", "pid", "size", "strategy")

    def __init__(
        self, address: int, size: int, *, fd: int | None = None, name: str | None = None, key: Any
    ) -> None:
        self.address, self.size, self.fd, self.name, self.key = address, size, fd, name, key
        self.strategy = FILE_SYSTEM if name is not None else FILE_DESCRIPTOR
        self.pid = os.getpid()
        weakref.finalize(self, _finalize, address, size, fd).atexit = False
        if name is not None:
            weakref.finalize(self, _release, name, self.pid).atexit = False
        _mapped[key] = self

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {
            "data": (self.address, False),
            "shape": (self.size,),
            "typestr": "|u1",
            "version": 3,
        }

    def __repr__(self) -> str:
        where = f"name={self.name!r}" if self.name else f"fd={self.fd}"
        return f"SharedSegment({self.strategy}, {where}, size={self.size})"


def manager_client(address: str | None = None) -> Any:
    """This process's shm manager client (file_system only; the module is imported lazily).

    Args:
        address: the manager a received handle names. A process not yet connected adopts
            it (a forkserver started before the manager never saw DISTCOMM_SHM_MANAGER).

    Raises:
        ShmManagerError: this process is connected to another manager than `address`.
    """
    from .shm.client import ManagerClient, ShmManagerError
    from .shm.protocol import ADDRESS_ENV

    current = ManagerClient.current()
    if current is None:
        if address:
            os.environ[ADDRESS_ENV] = address
        return ManagerClient.instance()
    if address and current.address != address:
        raise ShmManagerError(
            f"process {os.getpid()} received a shared array whose segment is tracked by the "
            f"shm manager {address!r}, but it already uses the manager {current.address!r}: "
            "one process tree must share one manager. Call "
            f"set_sharing_strategy('{FILE_SYSTEM}') in the main process before starting "
            "other processes (the forkserver included), so that they all find its manager"
        )
    return current


def _fd_key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def create_fd_segment(size: int) -> SharedSegment:
    try:
        fd = os.memfd_create("distcomm-shared", os.MFD_CLOEXEC)
    except OSError as exc:
        raise fd_limit_error(exc, "create a shared segment") from exc
    try:
        os.ftruncate(fd, size)
        address = _map(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return SharedSegment(address, size, fd=fd, key=_fd_key(fd))


def create_named_segment(size: int) -> SharedSegment:
    name = f"{NAME_PREFIX}{os.getpid()}_{next(_counter)}_{secrets.token_hex(4)}"
    path = os.path.join(SHM_DIR, name)
    client = manager_client()
    client.register(name)  # first: a crash right after creating the file cannot leak it
    fd = address = None
    try:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise fd_limit_error(exc, f"create shared segment {path}") from exc
        try:  # reserve the pages now: a full /dev/shm is an error here, not a SIGBUS later
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            stat = os.statvfs(SHM_DIR)
            raise OSError(
                errno.ENOSPC,
                f"cannot create a {size}-byte shared segment: {SHM_DIR} is full "
                f"({stat.f_bavail * stat.f_frsize} of {stat.f_blocks * stat.f_frsize} bytes "
                f"free); enlarge it (docker run --shm-size) or use "
                f"set_sharing_strategy('{FILE_DESCRIPTOR}')",
            ) from exc
        address = _map(fd, size)
    except BaseException:
        if fd is not None:
            os.unlink(path)
        client.release(name)
        raise
    finally:
        if fd is not None:
            os.close(fd)
    return SharedSegment(address, size, name=name, key=name)


def open_fd_segment(fd: int, size: int) -> SharedSegment:
    """The segment behind a received descriptor, mapped once per process.

    Takes ownership of `fd`: it becomes the segment's descriptor, or is closed when this
    process already maps the segment.

    Raises:
        ValueError: the descriptor's file is smaller than `size` (not what was sent).
    """
    try:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        segment = _mapped.get(key)
        if segment is not None:
            if segment.fd != fd:  # spawn hands one fd number to two handles of a segment
                os.close(fd)
            return segment
        actual = st.st_size
        if actual < size:
            raise ValueError(f"received a shared segment of {actual} bytes, expected {size}")
        address = _map(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return SharedSegment(address, size, fd=fd, key=key)


def open_named_segment(name: str, size: int, manager: str | None = None) -> SharedSegment:
    """The named segment a message refers to; takes over the message's reference.

    Args:
        name: the segment's name.
        size: its size in bytes.
        manager: the address of the shm manager tracking it (the sender's).

    Raises:
        ValueError: `name` is not a distcomm segment name, or the file is too small.
        FileNotFoundError: the segment no longer exists.
        ShmManagerError: this process uses another manager (see `manager_client`).
    """
    if not _NAME_RE.match(name):
        raise ValueError(f"{name!r} is not a distcomm shared segment name")
    client = manager_client(manager)
    segment = _mapped.get(name)
    if segment is not None and segment.pid == os.getpid():
        client.claim(name)  # this mapping already holds this process's reference
        client.release(name)
        return segment
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            exc.errno,
            f"shared segment {path} no longer exists: the shm manager unlinked it "
            "because no process held a reference to it (was the manager restarted?)",
        ) from exc
    except OSError as exc:
        raise fd_limit_error(exc, f"open shared segment {path}") from exc
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            raise ValueError(f"shared segment {path} has {actual} bytes, expected {size}")
        address = _map(fd, size)
    finally:
        os.close(fd)
    try:
        client.claim(name)
    except BaseException:
        _munmap(address, size)
        raise
    return SharedSegment(address, size, name=name, key=name)


def send_reference(segment: SharedSegment) -> str:
    """Count one reference in flight to a named segment, about to be pickled.

    In a forked child that inherited the segment, first registers a reference of this
    process's own (the parent may release its own at any time).

    Returns:
        The address of the manager that tracks it, for the receiver.
    """
    client = manager_client()
    if segment.pid != os.getpid():
        client.register(segment.name)
        segment.pid = os.getpid()
        weakref.finalize(segment, _release, segment.name, segment.pid).atexit = False
    client.send(segment.name)
    return client.address
