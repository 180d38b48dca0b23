"""The backend contract: one op set on flat contiguous arrays, each op returning Work."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import GroupDestroyedError
from ..ops import ReduceOp
from ..store.base import Store
from ..work import Work

__all__ = ["Backend", "BackendOptions", "OpQueue", "setup_round"]


class OpQueue:
    """Runs one group's operations one at a time, in the order they were issued.

    A synchronous call runs in the calling thread once everything issued before it has
    finished (no thread hand-off on the common path); asynchronous calls are queued for
    a worker thread started on first use. Whoever runs an operation holds `_running`; the
    worker takes it before it takes an operation off the queue, so a caller that finds
    the queue empty and takes the lock runs after everything queued before it.

    An operation lets go of its arrays before its Work completes, whether it succeeded or
    failed: the caller may close or resize a buffer (an mmap, a bytearray, whose numpy
    view the operation was given) the moment `wait()` returns, and an export still held
    makes that raise `BufferError`. So the queue holds each operation as a job, `[fn,
    work]`, that `_run` empties before it calls `fn`: no frame of the queue keeps `fn`
    (whose closure holds the arrays) once it returned; and the error of one that failed
    has its finished frames cleared (`_forget_locals`) before the Work keeps it. A frame
    keeps its function, and so its closure, even cleared: an `fn` that may fail takes its
    arrays out of a holder it empties (`held.pop()`) rather than from its closure.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._running = threading.Lock()  # held while an operation runs
        self._cond = threading.Condition()  # guards the queue, `_closed` and `_thread`
        self._queue: deque[list[Any]] = deque()  # jobs, [fn, work]
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], Any], work: Work, async_op: bool) -> Work:
        """Run `fn` after the operations issued before it; complete `work` with its outcome.

        `fn` returns the source rank for `work.complete` (or None).
        """
        with self._cond:
            self._refuse_if_closed(work)
            if async_op:
                self._queue.append([fn, work])
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                    self._thread.start()
                self._cond.notify_all()
                return work
            while self._queue:
                # queued operations carry their own deadlines, so these waits end
                self._cond.wait(1.0)
                self._refuse_if_closed(work)
        while not self._running.acquire(timeout=1.0):  # the operation running now
            self._refuse_if_closed(work)
        # (this frame's `fn` outlives the run, but the Work is nobody else's until returned)
        self._run([fn, work])
        return work

    def _refuse_if_closed(self, work: Work) -> None:
        if self._closed:
            raise GroupDestroyedError(f"{work.description}: the process group was destroyed")

    def run_now(
        self,
        description: str,
        outputs: list[Any],
        timeout: float,
        fn: Callable[[str, Any, Any], Any],
        first: Any,
        second: Any,
    ) -> Work | None:
        """Run a synchronous call `fn(description, first, second)` here and now if nothing
        runs or waits ahead of it: the common case, with no thread hand-off and nothing
        queued.

        Every backend with an `OpQueue` takes this fast path the same way (the tcp and
        gloo runner, mpi), so a synchronous call fails the same way on each: `fn`'s error
        becomes the returned Work's failure, which the caller's `wait` raises. (Two
        arguments, not *args: this is every synchronous operation's path, and a call
        with a fixed number of arguments costs less.)

        Args:
            description: the Work's description (names the op in messages), also handed
                to `fn`.
            outputs: the Work's output arrays.
            timeout: the failed Work's default wait (the group timeout).
            fn, first, second: the call.

        Returns:
            The finished Work (completed, or failed with `fn`'s error); None, with nothing
            run, when other operations run or wait ahead: `submit` it instead.
        """
        running = self._running
        if self._queue or self._closed or not running.acquire(False):
            return None
        try:
            fn(description, first, second)
        except BaseException as exc:
            _forget_locals(exc)
            work = Work(description, outputs, timeout=timeout)
            work.fail(exc)
            return work
        finally:
            running.release()
        return Work.completed(description, outputs)

    def _run(self, job: list[Any]) -> None:
        """Run one operation, `job` = [fn, work] (`_running` is held), and complete its
        Work; `job` is emptied first, so that nothing here holds `fn` once it returned."""
        work = job.pop()
        try:
            source = job.pop()()
        except BaseException as exc:
            _forget_locals(exc)
            work.fail(exc)
        else:
            work.complete(-1 if source is None else source)
        finally:
            self._running.release()
            # a failed operation's traceback keeps this frame: not the Work that keeps the
            # error (a reference cycle, which only the garbage collector would free)
            work = None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._queue:
                    self._cond.wait()
                if self._closed and not self._queue:
                    return
            while not self._running.acquire(timeout=1.0):
                pass  # a synchronous call runs now; its own deadline ends it
            with self._cond:
                if not self._queue:  # failed and cleared by close() meanwhile
                    self._running.release()
                    continue
                job = self._queue.popleft()
                self._cond.notify_all()  # synchronous callers wait for an empty queue
            self._run(job)  # empties `job`: this frame keeps nothing of the operation

    def close(self, error: BaseException | None = None, timeout: float = 10.0) -> None:
        """Stop accepting work; fail what is still queued with `error`; join the worker."""
        with self._cond:
            self._closed = True
            pending = [work for _, work in self._queue] if error is not None else []
            if error is not None:
                self._queue.clear()  # the operations, and their arrays, go with their jobs
            self._cond.notify_all()
        for work in pending:
            work.fail(error)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)


def _forget_locals(error: BaseException) -> None:
    """Clear the variables of the finished frames that `error` was raised through below
    the frame that caught it (those the failed operation ran), and of the frames of the
    errors raised or handled there (its `__cause__` and `__context__`, caught in them).

    A failed operation's Work keeps its error and raises it to the caller, and the error's
    traceback keeps those frames alive, with their variables: the operation's arrays, a
    view of the caller's buffer. Cleared, the traceback still names every file, line and
    function. The frame that caught `error` is still running and is left alone (it drops
    what it holds itself); so are the frames of an error that came from outside the
    operation (one the caller was handling when it called), which are the caller's.
    """
    tb = error.__traceback__
    if tb is None:
        return
    inside: set[int] = set()  # the frames the operation ran
    seen = {id(error)}
    todo: list[tuple[BaseException, Any]] = [(error, tb.tb_next)]
    while todo:
        exc, tb = todo.pop()
        while tb is not None:
            frame = tb.tb_frame
            inside.add(id(frame))
            try:
                frame.clear()
            except RuntimeError:  # still running: its thread keeps it, and drops it
                pass
            tb = tb.tb_next
        for chained in (exc.__cause__, exc.__context__):
            if chained is None or id(chained) in seen:
                continue
            seen.add(id(chained))
            first = chained.__traceback__
            if first is not None and id(first.tb_frame) in inside:
                todo.append((chained, first))


def setup_round(store: Store, name: str, size: int) -> int:
    """The number of this set-up of a group's backend on `store`: every rank adds 1 to key
    `name`, so the `size` ranks of one set-up share a number, and a later set-up on the
    same store (a group made again under the same name) gets the next one and keys of
    its own."""
    return (store.add(name, 1) - 1) // size


@dataclass(frozen=True)
class BackendOptions:
    """Everything a backend factory is given for one group, in one object (torch's
    `_DistributedBackendOptions`, which it passes to backends registered with
    `extended_api=True`).

    Attributes:
        store: the group's own store (a prefix of the job's).
        group_rank, group_size: this rank within the group, and the group's size.
        timeout: seconds every blocking wait of the group may take.
        group_id: the group's name ("default" for the default group).
        global_ranks_in_group: the group's ranks in the world, in group-rank order: the
            processes' ranks when the job started (a shrunk world renumbers its groups,
            not its processes).
        process_store: the job's store, the same for every group of the job (None: the
            group was made outside a job's world), where a backend may keep what is per
            process rather than per group (tcp and gloo publish each process's address
            there once). Not in torch.
        setup_round: the number of this set-up of the group on `store`, the same on every
            rank: the roll call's that checked the ranks' backends (None where none ran,
            a store private to each process). Keys a backend writes under it are its own
            however often the group is made again on the store. Not in torch.
    """

    store: Store
    group_rank: int
    group_size: int
    timeout: float
    group_id: str = ""
    global_ranks_in_group: tuple[int, ...] = ()
    process_store: Store | None = None
    setup_round: int | None = None


class Backend(ABC):
    """A communication backend for one process group: the class every backend subclasses.

    Not `distcomm.Backend`, torch's backend-name type (a `str`, in `names.py`, spelled
    `BackendName` inside the package).

    Every method takes flat (1-D), C-contiguous arrays and group ranks, and returns a
    `Work`. Collective methods run in issue order; with `async_op=False` the returned
    Work may already be complete. `send`/`recv` are always posted without blocking.

    Subclasses set `name` and `devices` and are constructed as
    `cls(store, rank, size, timeout, group_name)`: `store` is private to the group,
    `timeout` (seconds) bounds every blocking wait. The registry makes them with
    `from_options`, which a subclass needing more of the `BackendOptions` overrides.
    """

    TCP: ClassVar[str] = "tcp"
    GLOO: ClassVar[str] = "gloo"
    MPI: ClassVar[str] = "mpi"
    NCCL: ClassVar[str] = "nccl"

    name: ClassVar[str] = ""
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    #: serves CUDA arrays by host staging: its group wraps it in a `StagedBackend` for them
    stages_device_arrays: ClassVar[bool] = False

    def __init__(
        self, store: Store, rank: int, size: int, timeout: float, group_name: str = ""
    ) -> None:
        self.store = store
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.group_name = group_name or "default"
        self._abort_listeners: list[Callable[[str], None]] = []
        self._abort_told: str | None = None

    @classmethod
    def from_options(cls, options: BackendOptions, pg_options: Any = None) -> Backend:
        """The backend of one group (the registry's factory for a built-in backend)."""
        return cls(
            options.store,
            options.group_rank,
            options.group_size,
            options.timeout,
            options.group_id,
        )

    @classmethod
    def is_available(cls) -> bool:
        """Whether this backend can run here (its library imports, its device exists)."""
        return True

    @classmethod
    def unavailable_reason(cls) -> str:
        """Why `is_available()` is False, and what to install or change."""
        return ""

    def takes_device_arrays(self) -> bool:
        """Whether this CPU backend takes CuPy arrays' device memory itself (a CUDA-aware
        MPI), so a `StagedBackend` passes them through instead of staging them."""
        return False

    def label(self) -> str:
        """`[rank r/n]`, the prefix of this backend's messages."""
        return f"[rank {self.rank}/{self.size}]"

    def describe(self, op: str) -> str:
        """An operation as messages name it: "[rank 1/4] all_reduce on 'tcp' (group 'default')"."""
        return f"{self.label()} {op} on '{self.name}' (group '{self.group_name}')"

    # -- the op set --------------------------------------------------------------------------

    @abstractmethod
    def broadcast(self, array: Any, root: int, *, async_op: bool = False) -> Work:
        """Copy `root`'s `array` into every rank's `array`."""

    @abstractmethod
    def all_reduce(self, array: Any, op: ReduceOp, *, async_op: bool = False) -> Work:
        """Reduce `array` over all ranks; every rank gets the result in place."""

    @abstractmethod
    def reduce(self, array: Any, root: int, op: ReduceOp, *, async_op: bool = False) -> Work:
        """Reduce `array` over all ranks into `root`'s `array`; other ranks' stay unchanged."""

    @abstractmethod
    def all_gather(self, output: Any, input: Any, *, async_op: bool = False) -> Work:
        """Concatenate every rank's `input` (in rank order) into every rank's `output`."""

    @abstractmethod
    def gather(self, output: Any | None, input: Any, root: int, *, async_op: bool = False) -> Work:
        """Concatenate every rank's `input` into `root`'s `output` (None elsewhere)."""

    @abstractmethod
    def scatter(self, output: Any, input: Any | None, root: int, *, async_op: bool = False) -> Work:
        """Give rank i the i-th equal slice of `root`'s `input` (None elsewhere)."""

    @abstractmethod
    def reduce_scatter(
        self, output: Any, input: Any, op: ReduceOp, *, async_op: bool = False
    ) -> Work:
        """Reduce `input` (size x len(output)) over ranks; rank i gets slice i in `output`."""

    @abstractmethod
    def all_to_all(
        self,
        output: Any,
        input: Any,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        *,
        async_op: bool = False,
    ) -> Work:
        """Send slice j of `input` (sizes `input_splits`, in elements) to rank j; receive
        rank j's slice into slice j of `output` (sizes `output_splits`)."""

    @abstractmethod
    def send(self, array: Any, dst: int, tag: int) -> Work:
        """Post a send of `array` to rank `dst`."""

    @abstractmethod
    def recv(self, array: Any, src: int | None, tag: int) -> Work:
        """Post a receive into `array` from `src` (None: any rank); `Work.source_rank` tells."""

    @abstractmethod
    def barrier(self, *, async_op: bool = False) -> Work:
        """Complete once every rank has entered the barrier."""

    def barrier_on(self, device_id: int, *, async_op: bool = False) -> Work:
        """A barrier on device `device_id` (torch's `barrier(device_ids=[i])`); backends
        without devices of their own run `barrier()`."""
        return self.barrier(async_op=async_op)

    def coalesce(self, array: Any) -> AbstractContextManager[None]:
        """A context in which the operations posted are issued together (one NCCL group);
        `array` is the first one's. Backends that post each at once need nothing."""
        return nullcontext()

    def flush(self) -> None:
        """Post the operations the backend holds back (nccl defers lone sends and
        receives, to post them together as one NCCL group). Backends that post each at
        once need nothing."""
        return None

    # -- optional: uneven collectives (MPI's v-calls); counts[i] is rank i's elements --------
    # A backend with native calls overrides these (mpi). The defaults return None: no
    # native call, and distcomm runs the operation on the op set above instead.

    def all_gather_v(
        self, output: Any, input: Any, counts: Sequence[int], *, async_op: bool = False
    ) -> Work | None:
        """Concatenate every rank's `input` (rank i's: counts[i] elements) into `output`."""
        return None

    def gather_v(
        self,
        output: Any | None,
        input: Any,
        counts: Sequence[int] | None,
        root: int,
        *,
        async_op: bool = False,
    ) -> Work | None:
        """As `all_gather_v` into `root`'s `output` only (`output` and `counts`: None on
        the other ranks, which know their own count alone)."""
        return None

    def scatter_v(
        self,
        output: Any,
        input: Any | None,
        counts: Sequence[int] | None,
        root: int,
        *,
        async_op: bool = False,
    ) -> Work | None:
        """Give rank i piece i (counts[i] elements) of `root`'s `input` in `output`
        (`input` and `counts`: None on the other ranks)."""
        return None

    def reduce_scatter_v(
        self,
        output: Any,
        input: Any,
        counts: Sequence[int],
        op: ReduceOp,
        *,
        async_op: bool = False,
    ) -> Work | None:
        """Reduce `input` (pieces of counts[i] elements) over ranks; rank i gets piece i."""
        return None

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Fail every pending and future operation, and tell the peers, with `reason`."""

    def abort_reason(self) -> str | None:
        """Why the group failed here (this rank's abort, a peer's, a timeout or a lost
        peer), or None while it is well. A plug-in that cannot tell returns None; the
        group layer then knows only of `ProcessGroup.abort()` calls."""
        return None

    def add_abort_listener(self, fn: Callable[[str], None]) -> None:
        """Call `fn(reason)` once, from any thread, when the group fails here. Built-in
        backends call it for every failure they see (`notify_abort`); a plug-in that
        never calls `notify_abort` leaves it to `ProcessGroup.abort()`."""
        listeners = getattr(self, "_abort_listeners", None)
        if listeners is None:  # a plug-in that did not call Backend.__init__
            listeners = self._abort_listeners = []
        listeners.append(fn)

    def notify_abort(self, reason: str) -> None:
        """Tell the listeners (`add_abort_listener`) that the group failed, once."""
        # (attributes, not self.__dict__: reading that makes CPython give up the fast
        # attribute access of every later operation on this backend)
        listeners = getattr(self, "_abort_listeners", None)
        if not listeners or getattr(self, "_abort_told", None) is not None:
            return
        self._abort_told = reason  # two threads failing at once may both tell: hooks run once
        for fn in list(listeners):
            fn(reason)

    @abstractmethod
    def shutdown(self) -> None:
        """Release every thread, socket and segment; idempotent."""
