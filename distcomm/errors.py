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

An error that follows from another rank's failure (it exited, crashed, left the group or
aborted it, or was too late for a collective's timeout) says so in ``peer_ranks``: the
ranks of the group it names as the cause, or ``()`` when it cannot tell which.
`peer_failure` finds that mark on an exception or on the exceptions it was raised from, so
a launcher can tell such a rank from the one that failed first (distcomm-run's failure
report does).
"""

from __future__ import annotations

import queue
from collections.abc import Iterable
from typing import TypeVar

__all__ = [
    "BackendUnavailableError",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistStoreTimeoutError",
    "DistTimeoutError",
    "GroupDestroyedError",
    "JobFinishedError",
    "QueueEmptyError",
    "caused_by_peers",
    "peer_failure",
]

_E = TypeVar("_E", bound=BaseException)


class DistError(RuntimeError):
    """Base class of every distcomm error.

    Attributes:
        peer_ranks: None, or, when this error follows from other ranks' failure, those
            ranks of the group (() when it cannot tell which): a peer that closed its
            connection, ended, left the group or aborted it. After a collective's
            timeout, the late ranks (those that had not called it, or did not answer:
            hung, stopped or dead), on the ranks whose own wait expired and on those told
            of the abort alike; None when the timeout named none (every rank had called
            it; on mpi, which cannot tell). A late rank's own error has None: it is the
            cause, not a consequence (its message says the others blamed it). Set with
            `caused_by_peers`.
    """

    peer_ranks: tuple[int, ...] | None = None


class DistBackendError(DistError):
    """A backend operation failed: mismatched collectives, an aborted group, a library error."""


class BackendUnavailableError(DistBackendError, ImportError):
    """A backend cannot run here: its library is not installed or its device is absent."""


class GroupDestroyedError(DistBackendError):
    """An operation was issued on, or was still queued in, a destroyed process group."""


class JobFinishedError(DistError):
    """A process that was to join a running job found it finished: its members ended
    their loop (`distcomm.recovery.Manager.close`) before taking it in. Nothing is left
    to do: a replacement exits 0 on it."""


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


def caused_by_peers(error: _E, ranks: Iterable[int] = ()) -> _E:
    """Mark `error` as following from the failure of the group ranks `ranks` (() when
    unknown) and return it: ``raise caused_by_peers(DistNetworkError(...), [peer])``."""
    error.peer_ranks = tuple(ranks)  # type: ignore[attr-defined]
    return error


def peer_failure(exc: BaseException | None) -> tuple[int, ...] | None:
    """The ranks whose failure `exc` follows from (() when unknown), or None when it does
    not: the mark `caused_by_peers` left on `exc` or on an exception it was raised from
    or during (``__cause__``, ``__context__``)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        ranks = getattr(exc, "peer_ranks", None)
        if ranks is not None:
            return tuple(ranks)
        if exc.__cause__ is None and exc.__suppress_context__:
            return None  # `raise ... from None`: not a consequence of what it handled
        exc = exc.__cause__ or exc.__context__
    return None
