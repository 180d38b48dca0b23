"""The Work of an nccl operation: it completes on a CUDA event recorded after the operation.

`NcclWork` is watched by the group's `NcclWatchdog` (nccl_watch.py), which polls it and
fails it with the group; `wait()` orders the caller's stream after the event, or blocks
the host until it (with a timeout, DISTCOMM_NCCL_BLOCKING_WAIT=1, or a barrier). The
event's status is read with `cudaEventQuery`: CuPy's `Event.done` stays False after a
sticky CUDA error instead of raising.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..deadline import Deadline, to_seconds
from ..errors import DistBackendError
from ..work import Future, Work

if TYPE_CHECKING:
    from .nccl_watch import NcclWatchdog

__all__ = ["NcclWork", "cuda_error_text"]

log = logging.getLogger("distcomm.backends.nccl")

#: how often the watchdog looks at pending operations: from the first to the last, doubling
_WATCH_FIRST, _WATCH_MOST = 0.0005, 0.02
#: a host wait polls the event this often at most
_POLL_MOST = 0.001
#: cudaEventQuery's status for work not finished yet
_CUDA_NOT_READY = 600


def cuda_error_text(cupy: Any, status: int) -> str:
    """A CUDA status code as CuPy's CUDARuntimeError words it ("cudaErrorIllegalAddress:
    an illegal memory access was encountered"), with the code."""
    try:
        text = str(cupy.cuda.runtime.CUDARuntimeError(status))
    except Exception:  # a CuPy without the error type's status constructor
        text = ""
    return f"CUDA error {status}" + (f" ({text})" if text and text != str(status) else "")


#: queues, after an operation, the GPU work `Work.chain` asks for; returns its Work
Then = Callable[["NcclWork", Callable[[], None], list[Any]], Work]


class _PostingFuture(Future):
    """The future of a lone send or receive not posted yet: asking it anything (done,
    value, exception, a wait, `then`) posts it first; a done-callback does not."""

    __slots__ = ("_post",)

    def __init__(self, post: Callable[[], None]) -> None:
        super().__init__()
        self._post: Callable[[], None] | None = post

    def _posted(self) -> None:
        post = self._post
        if post is not None:
            post()

    def done(self) -> bool:
        self._posted()
        return super().done()

    def exception(self) -> BaseException | None:
        self._posted()
        return super().exception()

    def wait_done(self, timeout: float | None = None) -> bool:
        self._posted()
        return super().wait_done(timeout)

    def value(self) -> Any:
        self._posted()
        return super().value()

    def then(self, callback: Callable[[Future], Any]) -> Future:
        self._posted()
        return super().then(callback)


class NcclWork(Work):
    """The Work of an NCCL operation: completes on a CUDA event recorded after it.

    Args:
        watch: the group's watchdog (its device, failure state and timeout).
        cupy: the `cupy` module.
        description: what the operation is, for messages.
        outputs: the arrays `result()` returns.
        keep: the arrays the GPU may still touch, kept alive until the event has passed.
        host_wait: `wait()` blocks the host until the operation finished (a barrier, or
            every op with DISTCOMM_NCCL_BLOCKING_WAIT=1).
        source_rank: for a receive, the rank it names.
        then: queues `chain()`'s GPU work after this operation.
    """

    def __init__(
        self,
        watch: NcclWatchdog,
        cupy: Any,
        description: str,
        outputs: list[Any],
        keep: list[Any],
        *,
        host_wait: bool,
        source_rank: int,
        then: Then,
    ) -> None:
        super().__init__(description, outputs, timeout=watch.timeout)
        self._source_rank = source_rank
        self._watch = watch
        self._cupy = cupy
        self._then = then
        self._event: Any = None
        self._keep: list[Any] | None = keep  # the arrays the GPU may still touch
        self._host_wait = host_wait
        self.finished_on_wait = host_wait
        self._issued = time.monotonic()

    def defer(self, post: Callable[[], None]) -> None:
        """The operation is held back (a lone send or receive not posted yet): asking this
        Work anything (done, value, exception, a wait, `then`) runs `post` first, which
        posts it; a done-callback does not."""
        self._future = _PostingFuture(post)

    def undefer(self) -> None:
        """The held-back operation is being posted: asking no longer posts anything."""
        future = self._future
        if isinstance(future, _PostingFuture):
            future._post = None

    def _record(self, stream: Any) -> None:
        event = self._cupy.cuda.Event(disable_timing=True)
        event.record(stream)
        self._event = event

    def _poll(self, here: bool = False) -> bool:
        """Whether the operation has finished (completing the future when it has).

        The event is queried with the operation's device current (`here`: the caller
        knows it is, as the watchdog does; else `on_device` makes it so without binding a
        CUDA context of another device in this thread).
        """
        if self._future.done():
            return True
        event = self._event
        if event is None:
            return False
        watch = self._watch
        if not here:
            with watch.on_device():
                return self._query(event)
        return self._query(event)

    def _query(self, event: Any) -> bool:
        """`_poll`'s look at the event, on a thread whose current device is the op's."""
        watch = self._watch
        # CuPy's Event.done is eventQuery() == 0: after a sticky CUDA error (an illegal
        # address, a kernel that faulted) it stays False for ever and never raises, so
        # the status itself is read: 0 done, cudaErrorNotReady pending, else an error
        status = watch.query(event)
        if status == _CUDA_NOT_READY:
            return False
        if status:
            watch.fail(
                DistBackendError(
                    f"{self.description}: CUDA failed on GPU {watch.device.id}: "
                    f"{cuda_error_text(self._cupy, status)}. A sticky CUDA error leaves the "
                    "GPU unusable in this process: end it and restart the job (e.g. from a "
                    "checkpoint)"
                )
            )
            return True
        failure = self._watch.failure
        if failure is not None:  # ended by the abort, not by finishing: no result there
            try:
                self.fail(failure)
            except RuntimeError:  # failed (or completed) by another thread meanwhile
                pass
            return True
        self._keep = None
        try:
            self.complete(self._source_rank)
        except Exception as exc:  # done by another thread meanwhile, or a callback raised
            if not str(exc).startswith("this Future is already completed"):
                log.warning("%s: a done-callback raised: %r", self.description, exc)
        return True

    def wait(self, timeout: Any = None) -> bool:
        """Order the caller's current stream after the operation; True on success.

        With `timeout` (or DISTCOMM_NCCL_BLOCKING_WAIT=1, or for a barrier) block the host
        until the operation finished, up to `timeout` (default: the group's).

        Raises:
            DistTimeoutError: `timeout` expired; the group's communicator was aborted.
            GroupDestroyedError: the group was destroyed.
            DistError: the operation failed, or the group was aborted.
        """
        seconds = to_seconds(timeout)
        watch = self._watch
        done = self._future.done()
        if done:
            self._future.value()  # raises the operation's failure
        else:
            watch.raise_if_failed(self.description)
        if seconds is None and not self._host_wait:
            # torch orders the caller's stream even when the watchdog already saw the
            # event complete: the same calls either way
            if self._event is not None:
                with watch.on_device():
                    self._cupy.cuda.get_current_stream().wait_event(self._event)
            return True
        if done:
            return True
        deadline = Deadline(self._default_timeout if seconds is None else seconds)
        delay = _WATCH_FIRST
        while not self._poll():
            watch.raise_if_failed(self.description)
            if deadline.expired():
                raise watch.timed_out(self, deadline.seconds or 0.0)
            delay = deadline.nap(delay, _POLL_MOST)
        self._future.value()
        return True

    def synchronize(self) -> None:
        """Block the host until the operation finished (torch's Work.synchronize)."""
        self.wait(self._default_timeout)

    def is_completed(self) -> bool:
        """Whether the operation has finished on the GPU, successfully or not."""
        return self._poll()

    def chain(self, finalize: Callable[[], None], outputs: list[Any]) -> Work:
        """A Work that completes after this one and `finalize()`, which queues GPU work
        (copies out of a joined buffer) on the group's stream, after this operation."""
        return self._then(self, finalize, outputs)
