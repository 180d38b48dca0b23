"""The exception hierarchy of distcomm.

Every error distcomm raises on its own account derives from `DistError`;
each subclass also inherits the builtin exception a caller would catch anyway::

    RuntimeError
    └── DistError
        ├── DistBackendError               a backend op failed: desync, aborted group, library error
        │   ├── BackendUnavailableError    (also ImportError) its library or device is missing
        │   └── GroupDestroyedError        the group was destroyed (or shut down) before the op ran
        ├── DistNetworkError               (also ConnectionError) a peer or store connection failed
        ├── DistStoreError                 a store request failed
        │   ├── DistStoreTimeoutError      (also DistTimeoutError) a key did not appear in time
        │   └── QueueEmptyError            (also queue.Empty) queue_pop(block=False) found none
        └── DistTimeoutError               (also TimeoutError) a blocking wait ran out of time

The launcher and the multiprocessing module add their own branches under `DistError`:
`launch.rendezvous.RendezvousError` (closed, connection, and timeout, which is also a
`DistTimeoutError`),
`launch.errors.ChildFailedError` (the failure report of a run), `launch.timer`'s
`TimerServerUnavailableError`, `multiprocessing.ProcessException` (raised, exited) and
`multiprocessing.base.ShmManagerError`.

Bad arguments raise plain `ValueError`/`TypeError`; using the API before
`init_process_group` raises `RuntimeError`.
"""

from __future__ import annotations

import queue

__all__ = [
    "BackendUnavailableError",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistStoreTimeoutError",
    "DistTimeoutError",
    "GroupDestroyedError",
    "QueueEmptyError",
]


class DistError(RuntimeError):
    """Base class of every distcomm error."""


class DistBackendError(DistError):
    """A backend operation failed: mismatched collectives, an aborted group, a library error."""


class BackendUnavailableError(DistBackendError, ImportError):
    """A backend cannot run here: its library is not installed or its device is absent."""


class GroupDestroyedError(DistBackendError):
    """An operation was issued on, or was still queued in, a destroyed process group."""


class DistNetworkError(DistError, ConnectionError):
    """A connection to a peer rank or to the store failed or was refused."""


class DistTimeoutError(DistError, TimeoutError):
    """A blocking operation did not complete within its timeout."""


class DistStoreError(DistError):
    """A store request failed."""


class DistStoreTimeoutError(DistStoreError, DistTimeoutError):
    """A store wait (a `get` of a missing key, `wait`) ran out of time."""


class QueueEmptyError(DistStoreError, queue.Empty):
    """`Store.queue_pop(key, block=False)` found the queue empty (torch's QueueEmptyError).

    Also a `queue.Empty`, which is what a non-blocking get of a stdlib queue raises.
    """
