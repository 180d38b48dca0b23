"""An in-process stand-in for nccl4py's low-level bindings, `nccl.bindings.nccl`.

`Nccl4pyStandin(cuda)` builds `nccl`, `nccl.bindings` and `nccl.bindings.nccl` modules on a
`CudaStandin` (tests/cuda_standin.py); `install(monkeypatch)` puts them in `sys.modules`.
The functions have the names and parameter names of nccl4py 0.6.0's
(tests/test_nccl4py_standin.py compares them with the real module where it is installed).

What is modelled: NON-BLOCKING communicators (`Config().blocking = 0`; any other value is
refused). Each wraps a communicator of the CUDA stand-in (made with `nonblocking=True`)
and runs its calls, in order, on a thread of its own, so every call returns at once and
`comm_get_async_error` answers ncclInProgress (7) until what was issued so far has run,
then the first error code a call ended with (sticky), the stand-in's injected async error,
or 0. `comm_init_rank_config` likewise: the rendezvous runs on that thread (when a peer
failed, the others' initialisation hangs, as in real NCCL, until `comm_abort`). Calls
between `group_start()` and the outermost `group_end()` (per calling thread) are queued and
run as one stand-in NCCL group. `comm_abort` may be called from any thread at any time: it
aborts the stand-in communicator (ending its hung operations or initialisation) and drops
the calls not run yet. Misuse is recorded in the CUDA stand-in's `violations`: a call on a
communicator still ncclInProgress (NCCL requires polling it first), any call on an aborted
or destroyed one (its memory was freed), a handle that is not a `Comm`.

Not modelled: blocking communicators, argument errors returned synchronously (here they are
the communicator's error state), and every binding distcomm does not call (comm_shrink is
there by name only).
"""

from __future__ import annotations

import enum
import itertools
import queue
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from tests.cuda_standin import CudaStandin, NcclError, StandinError

__all__ = ["Nccl4pyStandin"]

_CONFIG_UNDEF_INT = -2147483648  # NCCL_CONFIG_UNDEF_INT: what Config() holds


#: the functions of nccl.bindings.nccl the stand-in offers (each with the real parameters)
BOUND = (
    "get_version",
    "get_unique_id",
    "comm_init_rank_config",
    "comm_get_async_error",
    "comm_abort",
    "comm_destroy",
    "group_start",
    "group_end",
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "send",
    "recv",
    "comm_shrink",
    "check_status",
)


class Result(enum.IntEnum):
    """ncclResult_t."""

    Success = 0
    UnhandledCudaError = 1
    SystemError = 2
    InternalError = 3
    InvalidArgument = 4
    InvalidUsage = 5
    RemoteError = 6
    InProgress = 7
    Timeout = 8
    NumResults = 9


class NCCLError(Exception):
    """nccl4py's NCCLError(status)."""

    def __init__(self, status: int) -> None:
        self.status = int(status)
        super().__init__(f"{Result(self.status).name} ({self.status})")

    def __reduce__(self) -> tuple:
        return (type(self), (self.status,))


class UniqueId:
    """ncclUniqueId: 128 bytes."""

    def __init__(self) -> None:
        self._data = bytearray(128)

    @staticmethod
    def from_buffer(buffer: Any) -> UniqueId:
        uid = UniqueId()
        data = bytes(buffer)
        if len(data) != 128:
            raise ValueError(f"buf must be a buffer of size 128, got {len(data)}")
        uid._data[:] = data
        return uid

    @staticmethod
    def from_data(data: Any) -> UniqueId:
        return UniqueId.from_buffer(bytes(memoryview(data)))

    @property
    def ptr(self) -> int:
        return id(self._data)

    def __bytes__(self) -> bytes:
        return bytes(self._data)


class Config:
    """ncclConfig_t, with NCCL's defaults (unset fields)."""

    def __init__(self) -> None:
        self.blocking = _CONFIG_UNDEF_INT


class Comm:
    """ncclComm_t: a handle."""

    def __init__(self, handle: int = 0) -> None:
        self.handle = int(handle)

    def __int__(self) -> int:
        return self.handle


class _State:
    """What stands behind a Comm handle: the stand-in communicator and its thread."""

    def __init__(self, rank: int, device: int) -> None:
        self.rank, self.device = rank, device
        self.standin_comm: Any = None  # the CUDA stand-in's communicator, once made
        self.jobs: queue.Queue = queue.Queue()
        self.pending = 0  # calls issued that have not run yet
        self.error = 0  # the first error code a call ended with
        self.released = ""  # "aborted" or "destroyed"
        self.thread: threading.Thread | None = None


class Nccl4pyStandin:
    """`nccl.bindings.nccl` on the CUDA stand-in `cuda`.

    Args:
        cuda: the CUDA stand-in whose NCCL the communicators use.
    """

    def __init__(self, cuda: CudaStandin) -> None:
        self.cuda = cuda
        self._lock = threading.Lock()  # the states below and their counters
        self._states: dict[int, _State] = {}
        self._handles = itertools.count(0x1000, 0x10)
        self._group = threading.local()  # .depth, .ops: the calling thread's group
        bindings = types.ModuleType("nccl.bindings.nccl")
        bindings.Result = Result
        bindings.NCCLError = NCCLError
        bindings.UniqueId = UniqueId
        bindings.Config = Config
        bindings.Comm = Comm
        for name in BOUND:
            setattr(bindings, name, getattr(self, name))
        package = types.ModuleType("nccl.bindings")
        package.__path__ = []
        package.nccl = bindings
        top = types.ModuleType("nccl")
        top.__path__ = []
        top.bindings = package
        self.bindings = bindings
        self._modules = {"nccl": top, "nccl.bindings": package, "nccl.bindings.nccl": bindings}

    def install(self, monkeypatch: Any) -> Nccl4pyStandin:
        """Put the modules in sys.modules for the test (monkeypatch restores them)."""
        for name, module in self._modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        return self

    # -- inspection ----------------------------------------------------------------------------

    def threads(self) -> list[threading.Thread]:
        """The communicators' threads still running."""
        with self._lock:
            states = list(self._states.values())
        return [s.thread for s in states if s.thread is not None and s.thread.is_alive()]

    def aborted(self) -> list[int]:
        """The ranks of the communicators aborted so far."""
        with self._lock:
            return [s.rank for s in self._states.values() if s.released == "aborted"]

    # -- the bindings ---------------------------------------------------------------------------

    def get_version(self) -> int:
        return int(self.cuda.nccl_version)

    def get_unique_id(self) -> UniqueId:
        data = self.cuda.nccl.get_unique_id()
        return UniqueId.from_buffer(bytes(v & 0xFF for v in data))

    def check_status(self, status: int) -> None:
        if int(status) not in (Result.Success, Result.InProgress):
            raise NCCLError(int(status))

    def comm_init_rank_config(self, nranks: int, comm_id: Any, rank: int, config: Any) -> Comm:
        if not isinstance(comm_id, UniqueId):
            raise TypeError(f"comm_id must be a UniqueId, got {type(comm_id).__name__}")
        if not isinstance(config, Config) or config.blocking != 0:
            self.cuda._violation(
                "nccl4py stand-in: ncclCommInitRankConfig without blocking = 0 (only "
                "non-blocking communicators are modelled)"
            )
            raise NCCLError(Result.InvalidUsage)
        cuda = self.cuda
        state = _State(int(rank), cuda._current_device())
        handle = next(self._handles)
        with self._lock:
            self._states[handle] = state
        data = bytes(comm_id)
        uid = (
            data
            if cuda._comm_id_form() is bytes
            else tuple(b - 256 if b > 127 else b for b in data)
        )

        def init() -> None:
            comm = cuda.NcclCommunicator(int(nranks), uid, int(rank), nonblocking=True)
            with self._lock:
                state.standin_comm = comm
                released = state.released
            if released:
                comm.abort()
                raise NcclError(4, "aborted before its initialisation")
            comm.join()

        state.thread = threading.Thread(
            target=self._run, args=(state,), daemon=True, name=f"nccl4py-comm-rank{rank}"
        )
        self._submit([state], init)
        state.thread.start()
        return Comm(handle)

    def comm_get_async_error(self, comm: Comm) -> int:
        state = self._state(comm, "comm_get_async_error")
        with self._lock:
            if state.pending:
                return int(Result.InProgress)
            if state.error:
                return state.error
        standin = state.standin_comm
        if standin is not None and standin.async_error is not None:
            return int(standin.async_error.status)
        return int(Result.Success)

    def comm_abort(self, comm: Comm) -> None:
        state = self._state(comm, "comm_abort")
        with self._lock:
            state.released = "aborted"
            standin = state.standin_comm
        state.jobs.put(None)
        if standin is not None:
            standin.abort()  # from any thread: NCCL allows it on non-blocking communicators

    def comm_destroy(self, comm: Comm) -> None:
        state = self._state(comm, "comm_destroy")
        self._idle(state, "comm_destroy")
        with self._lock:
            state.released = "destroyed"
            standin = state.standin_comm
        state.jobs.put(None)
        if standin is not None:
            standin.destroy()

    def comm_shrink(
        self,
        comm: Comm,
        exclude_ranks_list: Any,
        exclude_ranks_count: int,
        config: Any,
        shrink_flags: int,
    ) -> Comm:
        raise NCCLError(Result.InvalidUsage)  # not modelled

    def group_start(self) -> None:
        group = self._group
        if not getattr(group, "depth", 0):
            group.ops = []
        group.depth = getattr(group, "depth", 0) + 1

    def group_end(self) -> None:
        group = self._group
        depth = getattr(group, "depth", 0)
        if not depth:
            self.cuda._violation("nccl4py stand-in: group_end without group_start")
            raise NCCLError(Result.InvalidUsage)
        group.depth = depth - 1
        if depth > 1:
            return
        ops, group.ops = group.ops, []
        if not ops:
            return
        states = list({id(s): s for s, _ in ops}.values())
        nccl = self.cuda.nccl

        def run() -> None:
            nccl.groupStart()
            try:
                for state, call in ops:
                    call(state.standin_comm)
            finally:
                nccl.groupEnd()

        self._submit(states, run)

    def all_reduce(
        self,
        sendbuff: int,
        recvbuff: int,
        count: int,
        datatype: int,
        op: int,
        comm: Comm,
        stream: int,
    ) -> None:
        self._call(comm, "all_reduce", lambda c: c.allReduce(
            sendbuff, recvbuff, count, datatype, op, stream))  # fmt: skip

    def reduce(
        self,
        sendbuff: int,
        recvbuff: int,
        count: int,
        datatype: int,
        op: int,
        root: int,
        comm: Comm,
        stream: int,
    ) -> None:
        self._call(comm, "reduce", lambda c: c.reduce(
            sendbuff, recvbuff, count, datatype, op, root, stream))  # fmt: skip

    def broadcast(
        self,
        sendbuff: int,
        recvbuff: int,
        count: int,
        datatype: int,
        root: int,
        comm: Comm,
        stream: int,
    ) -> None:
        self._call(comm, "broadcast", lambda c: c.broadcast(
            sendbuff, recvbuff, count, datatype, root, stream))  # fmt: skip

    def all_gather(
        self, sendbuff: int, recvbuff: int, sendcount: int, datatype: int, comm: Comm, stream: int
    ) -> None:
        self._call(comm, "all_gather", lambda c: c.allGather(
            sendbuff, recvbuff, sendcount, datatype, stream))  # fmt: skip

    def reduce_scatter(
        self,
        sendbuff: int,
        recvbuff: int,
        recvcount: int,
        datatype: int,
        op: int,
        comm: Comm,
        stream: int,
    ) -> None:
        self._call(comm, "reduce_scatter", lambda c: c.reduceScatter(
            sendbuff, recvbuff, recvcount, datatype, op, stream))  # fmt: skip

    def send(
        self, sendbuff: int, count: int, datatype: int, peer: int, comm: Comm, stream: int
    ) -> None:
        self._call(comm, "send", lambda c: c.send(sendbuff, count, datatype, peer, stream))

    def recv(
        self, recvbuff: int, count: int, datatype: int, peer: int, comm: Comm, stream: int
    ) -> None:
        self._call(comm, "recv", lambda c: c.recv(recvbuff, count, datatype, peer, stream))

    # -- the machinery --------------------------------------------------------------------------

    def _state(self, comm: Any, name: str) -> _State:
        if not isinstance(comm, Comm):
            raise TypeError(f"Cannot convert {type(comm).__name__} to nccl.bindings.nccl.Comm")
        with self._lock:
            state = self._states.get(comm.handle)
        if state is None:
            self.cuda._violation(f"nccl4py stand-in: {name} on an unknown communicator")
            raise NCCLError(Result.InvalidArgument)
        if state.released:
            self.cuda._violation(
                f"nccl4py stand-in: rank {state.rank}: {name} on a communicator already "
                f"{state.released} (its memory was freed)"
            )
            raise NCCLError(Result.InvalidArgument)
        return state

    def _idle(self, state: _State, name: str) -> None:
        """NCCL requires a communicator not ncclInProgress before the next call on it."""
        with self._lock:
            pending = state.pending
        if pending:
            self.cuda._violation(
                f"nccl4py stand-in: rank {state.rank}: {name} while the communicator is "
                "ncclInProgress (poll ncclCommGetAsyncError until it is not first)"
            )

    def _call(self, comm: Comm, name: str, call: Callable[[Any], None]) -> None:
        """Issue `call(stand-in communicator)`: queued in an open group, else run on the
        communicator's thread; returns at once."""
        state = self._state(comm, name)
        group = self._group
        if getattr(group, "depth", 0):
            group.ops.append((state, call))
            return
        self._idle(state, name)
        self._submit([state], lambda: call(state.standin_comm))

    def _submit(self, states: list[_State], fn: Callable[[], None]) -> None:
        """Run `fn` on the first communicator's thread; each of `states` is ncclInProgress
        until it ran."""
        with self._lock:
            for state in states:
                state.pending += 1
        states[0].jobs.put((states, fn))

    def _run(self, state: _State) -> None:
        """A communicator's thread: its calls, in order, on its device."""
        self.cuda.Device(state.device).use()
        while True:
            job = state.jobs.get()
            if job is None:
                return
            states, fn = job
            status = 0
            if any(s.released for s in states):
                status = int(Result.InvalidArgument)  # dropped by the abort
            else:
                try:
                    fn()
                except NcclError as exc:
                    status = int(exc.status)
                except StandinError:
                    status = int(Result.InternalError)
                except Exception as exc:  # a fault of the stand-in itself: shows as misuse
                    self.cuda._violation(f"nccl4py stand-in: a call failed: {exc!r}")
                    status = int(Result.InternalError)
            with self._lock:
                for s in states:
                    s.pending -= 1
                    if status and not s.error:
                        s.error = status
