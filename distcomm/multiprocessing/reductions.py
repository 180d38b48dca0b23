"""Pickling of numpy and CuPy arrays between processes as shared memory (ForkingPickler reducers).

`init_reductions()` teaches `multiprocessing.reduction.ForkingPickler` -- what Queue,
Pipe/Connection, Pool and spawned Process arguments pickle with -- to send arrays by
reference:

- An exact `numpy.ndarray` in one of our shared segments (see `segments`) travels as the
  segment's handle plus (byte offset of its first element, shape, strides, dtype,
  writeable): the receiver maps the same pages and builds the same view with
  `numpy.ndarray(shape, dtype, buffer=segment, offset=offset, strides=strides)`, so any
  view (negative, zero or non-contiguous strides, a read-only one) arrives as itself.
  A plain array is first copied into a new segment by the sender (one memcpy instead of
  pickle + pipe + unpickle) and arrives as a shared array. Arrays with an object dtype
  and zero-size arrays are pickled the ordinary way (copied).
- Subclasses (np.memmap, np.matrix, masked and record arrays) are not matched: the
  dispatch table is keyed on the exact type, so they keep their own pickling (copied).
- CuPy arrays travel as CUDA IPC handles (`distcomm.gpu.ipc`). CuPy is never imported
  here: a `reducer_override` on ForkingPickler recognises `cupy.ndarray` only once the
  program has imported CuPy itself (`sys.modules`), and costs one dictionary lookup per
  pickled object otherwise.

Handles per strategy:

- ``file_descriptor``: the segment's descriptor. For the arguments of a spawn/forkserver
  Process it goes through `multiprocessing.reduction.DupFd` and is passed when the
  child starts; otherwise (Queue, Pipe, Pool) the sender's resource sharer thread hands
  a duplicate over when the receiver unpickles (the same `resource_sharer.DupFd` handle,
  subclassed to learn when it was collected). So the sender must still be running when
  the receiver unpickles (torch has the same rule); a receiver that finds it gone raises
  `DistNetworkError` (a ConnectionError) saying so. Unlike torch, a child process
  started by multiprocessing does not exit before its arrays are collected: at exit it
  finishes its queues' feeder threads and waits until the descriptors it sent were
  collected, at most `SENDER_EXIT_TIMEOUT` seconds (a child that puts a result on a
  queue and returns is the common case). The main process does not wait: its children,
  the usual receivers, are joined or terminated before. Caveat: a child whose queue
  cannot be flushed (nobody reads it, `cancel_join_thread()` was called) now exits
  after that timeout instead of at once. A message that is never received keeps a duplicate
  descriptor in the sender's resource sharer until the sender exits (after that wait);
  the kernel frees the memory when the last descriptor and mapping are gone.
- ``file_system``: the segment's name and the shm manager's address (a receiver not yet
  connected to a manager connects to that one: a forkserver started before the manager
  does not have it in its environment). Pickling registers one reference in flight with
  the shm manager (`shm.client.ManagerClient.send`); the receiver takes it over
  (`claim`). A message that is never received (dropped, or its receiver killed) leaves
  that reference in the manager, which unlinks the segment once all its clients have
  exited. A sender may exit (or be killed) right after sending.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import sys
import threading
import time
from multiprocessing import context, reduction, resource_sharer, util
from typing import Any

import numpy as np

from ..errors import DistNetworkError
from . import segments, sharing

__all__ = [
    "SENDER_EXIT_TIMEOUT",
    "init_reductions",
    "rebuild_ndarray_fd",
    "rebuild_ndarray_named",
    "reduce_ndarray",
]

#: Seconds a child process waits at exit for receivers to collect arrays it sent
#: (``file_descriptor``); see the module docstring.
SENDER_EXIT_TIMEOUT = 10.0

_SENDER_GONE = (ConnectionRefusedError, ConnectionResetError, FileNotFoundError, BrokenPipeError)


def _dtype_arg(dtype: np.dtype) -> np.dtype | str:
    # a plain dtype travels as its string ('<f4'); structured ones as the dtype itself
    if dtype.fields is None and dtype.subdtype is None and dtype.metadata is None:
        return dtype.str
    return dtype


# tokens of descriptors this process's resource sharer still has to hand over
_pending: set[object] = set()
_pending_lock = threading.Lock()


class _TrackedDupFd(resource_sharer.DupFd):
    """`resource_sharer.DupFd` that also knows when the receiver has collected the fd.

    The same handle on the wire (`detach()` is inherited); only the sender's bookkeeping
    differs: the token leaves `_pending` once the sharer thread has sent the descriptor.
    """

    def __init__(self, fd: int) -> None:  # replaces DupFd.__init__ (not called)
        new_fd = os.dup(fd)
        token = object()

        def send(conn: Any, pid: int) -> None:
            reduction.send_handle(conn, new_fd, pid)

        def close() -> None:
            os.close(new_fd)
            with _pending_lock:
                _pending.discard(token)

        _install_exit_wait()
        with _pending_lock:
            _pending.add(token)
        try:
            self._id = resource_sharer._resource_sharer.register(send, close)
        except BaseException:
            close()
            raise


def _wait_for_receivers() -> None:
    """At a child's exit: let the receivers collect the descriptors still pending.

    Runs at exitpriority 5: after the Queue finalizers (10) told their feeder threads to
    finish, before the resource sharer's socket path is unlinked (0). Joins the feeder
    threads first (they may still be pickling the last arrays put), then waits for the
    pending descriptors, `SENDER_EXIT_TIMEOUT` seconds in all.
    """
    if multiprocessing.parent_process() is None:
        # the main process joins or terminates its children (the usual receivers)
        # before its exit finalizers run: waiting could only delay its exit
        return
    end = time.monotonic() + SENDER_EXIT_TIMEOUT
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread.name == "QueueFeederThread" and thread is not current:
            thread.join(max(0.0, end - time.monotonic()))
    while True:
        with _pending_lock:
            left = len(_pending)
        if not left:
            return
        if time.monotonic() >= end:
            util.info(
                "distcomm: %d shared arrays sent by this process were not received "
                "within %.0f s; exiting anyway",
                left,
                SENDER_EXIT_TIMEOUT,
            )
            return
        time.sleep(0.005)


_exit_wait_pid: int | None = None


class _AfterFork:
    """Anchor for `util.register_after_fork` (it needs a weak-referenceable object)."""


_after_fork_anchor = _AfterFork()


def _install_exit_wait(*, force: bool = False) -> None:
    """Register `_wait_for_receivers` as an exit finalizer of this process (once)."""
    global _exit_wait_pid
    if _exit_wait_pid == os.getpid() and not force:
        return
    _exit_wait_pid = os.getpid()
    util.Finalize(None, _wait_for_receivers, exitpriority=5)


def _after_os_fork() -> None:
    global _pending_lock
    _pending_lock = threading.Lock()
    _pending.clear()  # the parent's descriptors are the parent's to hand over
    _install_exit_wait()


def _fd_handle(segment: segments.SharedSegment) -> Any:
    popen = context.get_spawning_popen()
    try:
        if popen is None:
            # Queue, Pipe, Pool: this process's resource sharer hands a duplicate over
            # when the receiver unpickles (reduction.DupFd's path, tracked)
            return _TrackedDupFd(segment.fd)
        # a spawn/forkserver child receives the descriptor when it starts: keep a
        # duplicate open until then (the segment itself may be a temporary copy)
        fd = os.dup(segment.fd)
    except OSError as exc:
        raise segments.fd_limit_error(exc, "send a shared array") from exc
    util.Finalize(popen, os.close, (fd,))
    return reduction.DupFd(fd)


def reduce_ndarray(array: np.ndarray) -> tuple[Any, tuple[Any, ...]]:
    """ForkingPickler's reducer for numpy.ndarray: a shared-memory handle and the layout.

    Raises:
        OSError: a segment could not be created or its descriptor duplicated (the
            message names the descriptor limit under ``file_descriptor``).
    """
    if array.dtype.hasobject or array.size == 0:
        return array.__reduce__()
    found = sharing.find_segment(array)
    if found is None:
        array = sharing.share_memory(array)
        found = sharing.find_segment(array)
        if found is None:  # pragma: no cover - share_memory always returns a shared array
            raise RuntimeError("share_memory() returned an array outside shared memory")
    segment, offset = found
    layout = (
        offset,
        array.shape,
        array.strides,
        _dtype_arg(array.dtype),
        bool(array.flags.writeable),
    )
    if segment.name is not None:
        manager = segments.send_reference(segment)
        return rebuild_ndarray_named, (segment.name, segment.size, manager, *layout)
    return rebuild_ndarray_fd, (_fd_handle(segment), segment.size, *layout)


def _detach(handle: Any) -> int:
    try:
        return handle.detach()
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise segments.fd_limit_error(exc, "receive a shared array") from exc
        if isinstance(exc, _SENDER_GONE):
            raise _sender_gone(exc) from exc
        raise
    except EOFError as exc:
        raise _sender_gone(exc) from exc
    except RuntimeError as exc:  # recvfds: the descriptor was dropped (MSG_CTRUNC)
        if "ancdata" in str(exc):
            raise segments.fd_limit_error(
                OSError(errno.EMFILE, str(exc)), "receive a shared array"
            ) from exc
        raise


def _sender_gone(exc: BaseException) -> DistNetworkError:
    return DistNetworkError(
        "cannot receive a shared array: the process that sent it exited before this one "
        f"unpickled it ({type(exc).__name__}: {exc}). Under the 'file_descriptor' sharing "
        "strategy the sender hands the descriptor over when the array is received, so it "
        "must stay alive until then (e.g. wait on an Event or join it only after the "
        "receiver got everything); the 'file_system' strategy has no such rule "
        "(distcomm.multiprocessing.set_sharing_strategy('file_system') in the sender)"
    )


def rebuild_ndarray_fd(
    handle: Any,
    size: int,
    offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: Any,
    writeable: bool,
) -> np.ndarray:
    """Receiver side of a ``file_descriptor`` handle: map the segment, build the view.

    Raises:
        DistNetworkError: the sender exited before the descriptor could be handed over.
        OSError: too many open descriptors here (the message names the limit).
    """
    segment = segments.open_fd_segment(_detach(handle), size)
    return sharing.array_in(segment, offset, shape, strides, dtype, writeable)


def rebuild_ndarray_named(
    name: str,
    size: int,
    manager: str,
    offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: Any,
    writeable: bool,
) -> np.ndarray:
    """Receiver side of a ``file_system`` handle: map the named segment, build the view.

    `manager` is the address of the shm manager that tracks the segment: a receiver not
    yet connected to one connects there.
    """
    segment = segments.open_named_segment(name, size, manager)
    return sharing.array_in(segment, offset, shape, strides, dtype, writeable)


def _reducer_override(self: Any, obj: Any) -> Any:
    # the exact type, as the dispatch table matches np.ndarray: a subclass pickles its own
    # way (gpu.runtime.is_cupy_array, which takes subclasses, is the test elsewhere)
    cupy = sys.modules.get("cupy")
    if cupy is not None and type(obj) is getattr(cupy, "ndarray", None):
        from ..gpu import ipc

        return ipc.reduce_cupy_array(obj)
    previous = _previous_override
    return NotImplemented if previous is None else previous(self, obj)


_previous_override: Any = None


def init_reductions() -> None:
    """Register the array reducers on ForkingPickler (idempotent)."""
    global _previous_override
    from ..gpu import ipc  # noqa: F401  (installs the CUDA fork guard; imports no CuPy)

    reduction.ForkingPickler.register(np.ndarray, reduce_ndarray)
    if _exit_wait_pid is None:  # first call in this interpreter
        _install_exit_wait()
        # a forkserver child keeps what the fork copied; a fork-started child's registry is
        # cleared by Process._bootstrap, after which multiprocessing's after-fork hooks run
        os.register_at_fork(after_in_child=_after_os_fork)
        util.register_after_fork(_after_fork_anchor, lambda _: _install_exit_wait(force=True))
    current = getattr(reduction.ForkingPickler, "reducer_override", None)
    if current is not _reducer_override:
        _previous_override = current
        reduction.ForkingPickler.reducer_override = _reducer_override
