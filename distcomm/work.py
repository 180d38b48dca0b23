"""Work, the handle of an issued operation, and the Future it completes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .deadline import to_seconds
from .errors import DistTimeoutError

__all__ = ["Future", "Work"]

log = logging.getLogger(__name__)

# what a future completed at creation shares instead of making its own lock (set once,
# never cleared; such a future is never completed again)
_SHARED_LOCK = threading.Lock()


class Future:
    """The eventual result of an operation (the subset of torch.futures.Future it offers).

    `value()` of a collective's future is the list of its output arrays. A future costs a
    lock and a flag; the condition a waiter sleeps on is made by the first one that has
    to wait (most futures are done before anyone looks, or are never waited on).
    """

    __slots__ = ("_callbacks", "_cond", "_done", "_error", "_lock", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False
        self._cond: threading.Condition | None = None
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Future], None]] = []

    @classmethod
    def completed(cls, value: Any) -> Future:
        """A future already completed with `value` (cheap: shares its lock)."""
        future = cls.__new__(cls)
        future._lock, future._done, future._cond = _SHARED_LOCK, True, None
        future._value, future._error, future._callbacks = value, None, []
        return future

    def done(self) -> bool:
        """Whether a result or an error has been set."""
        return self._done

    def exception(self) -> BaseException | None:
        """The error the future completed with; None if it succeeded or is not done yet."""
        return self._error if self._done else None

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until done, up to `timeout` seconds (None: no limit); whether it is done.

        Unlike `wait()` it neither raises the error nor returns the value.
        """
        if self._done:
            return True
        with self._lock:
            if self._done:
                return True
            if self._cond is None:
                self._cond = threading.Condition(self._lock)
            return self._cond.wait_for(lambda: self._done, timeout)

    def wait(self, timeout: float | timedelta | None = None) -> Any:
        """Block until done and return the value (raise the error), up to `timeout`.

        Raises:
            DistTimeoutError: not done within `timeout` (also a `TimeoutError`).
        """
        seconds = to_seconds(timeout)
        if not self.wait_done(seconds):
            raise DistTimeoutError(f"future not completed within {seconds} s")
        return self.value()

    def value(self) -> Any:
        """The result; raises the operation's error if it failed.

        Raises:
            RuntimeError: called before the future is done.
        """
        if not self._done:
            raise RuntimeError("Future.value() called before the future completed; call wait()")
        if self._error is not None:
            try:
                raise self._error
            finally:
                # the error's traceback keeps this frame: not this future, which keeps the
                # error (a cycle only the garbage collector would free)
                self = None
        return self._value

    def then(self, callback: Callable[[Future], Any]) -> Future:
        """A new future completed with `callback(self)` once this one is done."""
        chained = Future()

        def run(fut: Future) -> None:
            try:
                chained.set_result(callback(fut))
            except BaseException as exc:
                chained.set_exception(exc)

        self.add_done_callback(run)
        return chained

    def add_done_callback(self, callback: Callable[[Future], None]) -> None:
        """Call `callback(self)` when done (at once if already done)."""
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self)

    def set_result(self, value: Any) -> None:
        """Complete the future with `value`."""
        self._finish(value, None)

    def set_exception(self, error: BaseException) -> None:
        """Complete the future with `error`."""
        self._finish(None, error)

    def _finish(self, value: Any, error: BaseException | None) -> None:
        with self._lock:
            if self._done:
                raise RuntimeError("this Future is already completed")
            self._value, self._error = value, error
            self._done = True  # after the value: done() readers take no lock
            if self._cond is not None:
                self._cond.notify_all()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)


#: torch's WorkResult codes, the values of `Work.get_future_result()`
WORK_SUCCESS, WORK_TIMEOUT, WORK_COMM_ERROR = 0, 1, 2


class Work:
    """The handle of an issued operation, as returned with `async_op=True`.

    Args:
        description: what the operation is, for messages ("all_reduce on 'tcp' ...").
        outputs: the arrays the operation writes, returned by `result()`.
        on_timeout: called with the seconds waited when `wait(timeout)` expires; it
            cancels or aborts the operation and returns the exception to raise.
        timeout: what `wait()` without a timeout waits at most (the group's timeout;
            `set_default_timeout` sets a call's own).
        settle: after `on_timeout` aborted the operation, how long `wait` waits at most
            for it to stop (it may still be moving bytes into its arrays on another
            thread, and stops at its next look at the abort) before raising, so that
            the caller never gets back arrays the operation still writes. 0: do not
            wait (an operation that cannot be stopped, such as an MPI collective).
    """

    #: `wait()` returns once the operation finished; False where it only orders a device
    #: stream after it (nccl), so the flight recorder settles the op on its completion
    finished_on_wait = True

    def __init__(
        self,
        description: str,
        outputs: list[Any] | None = None,
        on_timeout: Callable[[float], BaseException] | None = None,
        timeout: float | None = None,
        settle: float = 0.0,
    ) -> None:
        self.description = description
        self._default_timeout = timeout
        self._settle = settle
        self._outputs = outputs if outputs is not None else []
        self._on_timeout = on_timeout
        self._future = Future()
        self._source_rank = -1
        #: the group's global ranks, set by the caller so `source_rank` can translate
        self.global_ranks: list[int] | None = None

    @staticmethod
    def completed(description: str, outputs: list[Any] | None = None) -> Work:
        """The Work of an operation that already finished successfully (a synchronous call;
        every synchronous collective makes one, so it is built without `__init__`, and its
        Future only if asked for)."""
        work = _Completed.__new__(_Completed)
        work.description = description
        work._outputs = outputs if outputs is not None else []
        return work

    # -- completion, called by backends -----------------------------------------------------

    def complete(self, source_rank: int = -1) -> None:
        """Mark the operation successful (`source_rank`: sender of an any-source recv)."""
        self._source_rank = source_rank
        self._future.set_result(self._outputs)

    def fail(self, error: BaseException) -> None:
        """Mark the operation failed with `error`."""
        self._future.set_exception(error)

    def set_outputs(self, outputs: list[Any]) -> None:
        """Make `outputs` what `result()` and the future's value hold (the caller's arrays
        in place of the views a backend saw); in place, so a future already completed by
        another thread shows them too."""
        self._outputs[:] = outputs

    def set_default_timeout(self, seconds: float) -> None:
        """Make `seconds` what `wait()` without a timeout waits at most, in place of the
        group's timeout: a call's own `timeout=` (`all_reduce(x, async_op=True,
        timeout=5)`), or an option's in the method API (`ProcessGroup.allreduce(..., opts)`)."""
        self._default_timeout = seconds

    def add_timeout_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(error)` when a `wait(timeout)` expires, once the operation was
        cancelled or its group aborted and before `error` is raised (the flight recorder
        settles the operation then, so its dump is written before the raise). Nothing is
        called for a Work that has no timeout handler (one that has finished, say)."""
        expire = self._on_timeout
        if expire is None:
            return

        def on_timeout(seconds: float) -> BaseException:
            error = expire(seconds)
            callback(error)
            return error

        self._on_timeout = on_timeout

    # -- the public handle ------------------------------------------------------------------

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        """Block until the operation completes; True on success.

        Without `timeout`, or with a zero one (``timedelta(0)``, torch's ``kNoTimeout``:
        "no explicit timeout", never "give up at once"), the operation's own timeout (the
        `timeout=` it was called with) or else the group's bounds the wait. When the wait
        expires the operation is cancelled (a pending receive) or its group aborted (a
        collective, which cannot be abandoned half-way), and `DistTimeoutError` is raised.

        Raises:
            DistError: the operation failed; the error names the op, the group and the peers.
        """
        seconds = to_seconds(timeout)
        if not seconds:  # None or 0: no explicit timeout, as in torch
            seconds = self._default_timeout
        if not self._future.wait_done(seconds):
            if self._on_timeout is None:
                raise DistTimeoutError(f"{self.description} did not complete within {seconds} s")
            error = self._on_timeout(seconds)
            if self._settle and not self._future.wait_done(self._settle):
                log.warning(
                    "%s: still running %.0f s after its abort; its arrays may still change "
                    "until is_completed() is True",
                    self.description,
                    self._settle,
                )
            if not self._future.done() or self._future.exception() is not None:
                raise error
        future = self._future
        # the error raised keeps this frame (its traceback): not this Work nor its future,
        # which keep the error (a cycle only the garbage collector would free)
        self = None
        try:
            future.value()
        finally:
            future = None
        return True

    def is_completed(self) -> bool:
        """Whether the operation has finished, successfully or not."""
        return self._future.done()

    def is_success(self) -> bool:
        """Whether the operation has finished successfully.

        Raises:
            RuntimeError: the operation has not finished yet.
        """
        if not self._future.done():
            raise RuntimeError(f"{self.description} has not completed yet; call wait() first")
        return self._future.exception() is None

    def exception(self) -> BaseException | None:
        """The error the operation failed with, or None."""
        return self._future.exception()

    def get_future(self) -> Future:
        """A Future whose value is the list of output arrays."""
        return self._future

    def result(self) -> list[Any]:
        """The output arrays (waits for completion)."""
        self.wait()
        return list(self._outputs)

    def synchronize(self) -> None:
        """Block until the operation finished (torch's Work.synchronize), up to the group's
        timeout.

        Raises:
            DistTimeoutError: it did not finish in time (the group is aborted).
            DistError: it failed.
        """
        self.wait()

    def get_future_result(self) -> Future:
        """A Future completed with torch's WorkResult code once the operation finished:
        0 (SUCCESS), 1 (TIMEOUT: it, or the abort of its group that failed it, timed out)
        or 2 (COMM_ERROR: any other failure); it never completes with an error."""

        def code(future: Future) -> int:
            error = future.exception()
            if error is None:
                return WORK_SUCCESS
            return WORK_TIMEOUT if isinstance(error, DistTimeoutError) else WORK_COMM_ERROR

        return self._future.then(code)

    def chain(self, finalize: Callable[[], None], outputs: list[Any]) -> Work:
        """A Work over `outputs` that completes after this one and then `finalize()` (the
        copy of results out of a joined buffer); it fails with this one's error, or
        `finalize`'s. A device Work queues `finalize` on its stream instead."""
        outer = Work(
            self.description,
            outputs,
            on_timeout=self._on_timeout,
            timeout=self._default_timeout,
            settle=self._settle,
        )

        def done(future: Future) -> None:
            error = future.exception()
            if error is not None:
                outer.fail(error)
                return
            try:
                finalize()
            except BaseException as exc:
                outer.fail(exc)
                return
            outer.complete()

        self._future.add_done_callback(done)
        return outer

    def source_rank(self) -> int:
        """For a receive: the global rank that sent the message (-1 before completion)."""
        if self._source_rank < 0 or self.global_ranks is None:
            return self._source_rank
        return self.global_ranks[self._source_rank]

    def __repr__(self) -> str:
        state = "pending"
        if self._future.done():
            state = "ok" if self._future.exception() is None else "failed"
        return f"<Work {self.description} [{state}]>"


class _Completed(Work):
    """A Work made finished (`Work.completed`): nothing to wait for, and its Future is
    made the first time something asks for it."""

    _default_timeout = None
    _on_timeout = None
    _settle = 0.0
    _source_rank = -1
    global_ranks = None
    _made: Future | None = None

    @property
    def _future(self) -> Future:  # type: ignore[override]
        if self._made is None:
            self._made = Future.completed(self._outputs)
        return self._made

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        to_seconds(timeout)  # the argument is still checked
        return True

    def chain(self, finalize: Callable[[], None], outputs: list[Any]) -> Work:
        try:
            finalize()
        except BaseException as exc:
            outer = Work(self.description, outputs)
            outer.fail(exc)
            return outer
        return Work.completed(self.description, outputs)
