"""NCCL through NVIDIA's nccl4py (`nccl.bindings.nccl`), shaped like CuPy's `cupy.cuda.nccl`.

The nccl backend uses this module instead of CuPy's bindings when
DISTCOMM_NCCL_BINDINGS=nccl4py (`distcomm.gpu.nccl.import_nccl`). It offers what the
backend calls on CuPy's module: `NcclCommunicator` (with CuPy's method names and argument
order), `groupStart`/`groupEnd`, `get_version`, `get_unique_id` (128 bytes), the
`NCCL_*` datatype and op codes (NCCL's, the same integers as CuPy's), `NcclError` and
`available`.

Its communicators are non-blocking (ncclConfig_t.blocking = 0), which CuPy cannot make:
* ncclCommInitRankConfig returns at once; the caller polls `ready()` (ncclCommGetAsyncError
  until it is not ncclInProgress) and may `abort()` a communicator whose initialisation
  hangs, as `nccl_comm.NcclCommunicator._init_communicator` does.
* every other call returns at once; when the communicator's state is then ncclInProgress,
  the calling thread polls ncclCommGetAsyncError until it is not, as NCCL requires before
  the next call on it: up to the bound `supervise` set (the group timeout), stopping as
  soon as the group failed. Calls inside `groupStart`/`groupEnd` are only queued: the
  outermost `groupEnd` polls every communicator of the group. An error state raises
  `NcclError`.
* `abort()` may be called at any time from any thread (NCCL allows it on non-blocking
  communicators): a poll in progress returns first, and no call reaches NCCL on the
  communicator afterwards (ncclCommAbort frees it).

nccl4py also binds ncclCommShrink (`nccl.bindings.nccl.comm_shrink`: a communicator
without the excluded ranks, made without them); the backend does not use it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import BackendUnavailableError

__all__ = [
    "NcclCommunicator",
    "NcclError",
    "available",
    "get_unique_id",
    "get_version",
    "groupEnd",
    "groupStart",
    "load",
    "nonblocking",
]

INSTALL_HINT = (
    'install NVIDIA\'s nccl4py (pip install nccl4py, or pip install -e ".[nccl4py]" from a '
    "distcomm checkout), or unset DISTCOMM_NCCL_BINDINGS to use CuPy's bindings"
)

#: this module's communicators are non-blocking (the backend and its watchdog ask)
nonblocking = True
#: whether nccl4py was imported (`load`)
available = False

# ncclResult_t
SUCCESS, IN_PROGRESS, TIMEOUT = 0, 7, 8
_RESULT_NAMES = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
    8: "ncclTimeout",
}

# NCCL's datatype and reduction codes (ncclDataType_t, ncclRedOp_t), as CuPy's constants
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32 = 0, 1, 2, 3
NCCL_INT64, NCCL_UINT64, NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 4, 5, 6, 7, 8
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4

#: what an error state's message adds (ncclCommGetAsyncError gives a code, no text)
_STATE_DETAIL = "the communicator's state (ncclCommGetAsyncError); NCCL_DEBUG=WARN logs why"
#: a poll of an operation in progress sleeps this long first, doubling up to the most
_POLL_FIRST, _POLL_MOST = 0.0001, 0.005

_group = threading.local()  # .depth, .comms: this thread's open NCCL group


class NcclError(RuntimeError):
    """An NCCL status code (ncclResult_t) and its text, as CuPy's `NcclError`."""

    def __init__(self, status: int, detail: str = "") -> None:
        self.status = int(status)
        name = _RESULT_NAMES.get(self.status, f"ncclResult {self.status}")
        super().__init__(f"{name} ({self.status})" + (f": {detail}" if detail else ""))

    def __reduce__(self) -> tuple:
        return (type(self), (self.status, ""))


def load() -> Any:
    """`nccl.bindings.nccl`, imported (an import found in sys.modules after the first).

    Raises:
        BackendUnavailableError: nccl4py is not installed or fails to import.
    """
    global available
    try:
        import nccl.bindings.nccl as bindings
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the nccl backend: DISTCOMM_NCCL_BINDINGS=nccl4py, but nccl4py's "
            f"nccl.bindings.nccl failed to import ({exc}); {INSTALL_HINT}"
        ) from exc
    available = True
    return bindings


def _call(bindings: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` with nccl4py's NCCLError as this module's `NcclError`."""
    try:
        return fn(*args)
    except bindings.NCCLError as exc:
        status = getattr(exc, "status", None)
        if status is None and exc.args and isinstance(exc.args[0], int):
            status = exc.args[0]
        raise NcclError(TIMEOUT if status is None else int(status), str(exc)) from exc


def get_version() -> int:
    """ncclGetVersion: the NCCL library's version code."""
    bindings = load()
    return int(_call(bindings, bindings.get_version))


def get_unique_id() -> bytes:
    """ncclGetUniqueId, as 128 bytes."""
    bindings = load()
    return bytes(_call(bindings, bindings.get_unique_id))


def groupStart() -> None:
    """ncclGroupStart: the calls that follow on this thread are one NCCL group."""
    bindings = load()
    _call(bindings, bindings.group_start)
    if not getattr(_group, "depth", 0):
        _group.comms = []
    _group.depth = getattr(_group, "depth", 0) + 1


def groupEnd() -> None:
    """ncclGroupEnd; the outermost one waits until no communicator of the group is
    ncclInProgress (each polled as its calls outside a group are)."""
    depth = getattr(_group, "depth", 0)
    _group.depth = max(depth - 1, 0)
    bindings = load()
    try:
        _call(bindings, bindings.group_end)
    finally:
        comms = _group.comms if depth == 1 else []
        if depth == 1:
            _group.comms = []
    for comm in comms:
        comm._settle()


class NcclCommunicator:
    """A non-blocking NCCL communicator with the methods of CuPy's `NcclCommunicator`.

    `NcclCommunicator(ndev, commId, rank)` starts ncclCommInitRankConfig (blocking = 0) on
    the current CUDA device and returns at once: `ready()` says when it is done.

    Args:
        ndev: the number of ranks.
        commId: the unique id, 128 bytes.
        rank: this rank.
    """

    nonblocking = True

    def __init__(self, ndev: int, commId: bytes, rank: int) -> None:
        self._b = bindings = load()
        if not isinstance(commId, (bytes, bytearray)) or len(commId) != 128:
            raise TypeError("an NCCL unique id for nccl4py is 128 bytes")
        self._ndev, self._rank = int(ndev), int(rank)
        self._device = int(sys.modules["cupy"].cuda.runtime.getDevice())
        self._lock = threading.Lock()  # one call at a time; an abort waits for it
        self._released = ""  # "aborted" or "destroyed" once released
        #: the bound of a poll (seconds; None: none), and what stops it (`supervise`)
        self._timeout: float | None = None
        self._failed: Callable[[], bool] = lambda: False
        self._expired: Callable[[float], None] = lambda seconds: None
        self._uid_buffer = bytearray(commId)  # the UniqueId may view this memory
        uid = bindings.UniqueId.from_buffer(self._uid_buffer)
        config = bindings.Config()
        config.blocking = 0
        self._comm = _call(
            bindings, bindings.comm_init_rank_config, self._ndev, uid, self._rank, config
        )

    def supervise(
        self,
        timeout: float | None,
        failed: Callable[[], bool],
        expired: Callable[[float], None],
    ) -> None:
        """Bound the polls of operations in progress: by `timeout` seconds (`expired` is
        called with it before the poll raises), and `failed()` (the group failed) ends
        them at once."""
        self._timeout, self._failed, self._expired = timeout, failed, expired

    # -- the state -------------------------------------------------------------------------

    def _state(self) -> int:
        """ncclCommGetAsyncError: ncclSuccess, ncclInProgress or an error code.

        Raises:
            NcclError: the communicator was released (never asked: it was freed).
        """
        with self._lock:
            if self._released:
                raise NcclError(4, f"the communicator was {self._released}")
            return int(_call(self._b, self._b.comm_get_async_error, self._comm))

    def ready(self) -> bool:
        """Whether the initialisation (or the last call) is done: False while
        ncclInProgress.

        Raises:
            NcclError: it failed (the error state), or the communicator was released.
        """
        state = self._state()
        if state == IN_PROGRESS:
            return False
        if state != SUCCESS:
            raise NcclError(state, _STATE_DETAIL)
        return True

    def _settle(self) -> None:
        """Poll until the communicator is not ncclInProgress, up to the bound `supervise`
        set; raise for an error state."""
        start = time.monotonic()
        delay = _POLL_FIRST
        while True:
            state = self._state()
            if state != IN_PROGRESS:
                break
            if self._failed():
                raise NcclError(IN_PROGRESS, "the group failed while an NCCL call was in progress")
            timeout = self._timeout
            if timeout is not None and time.monotonic() - start > timeout:
                self._expired(timeout)
                raise NcclError(
                    IN_PROGRESS,
                    f"an NCCL call was still in progress after {timeout:g} s (ncclInProgress)",
                )
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MOST)
        if state != SUCCESS:
            raise NcclError(state, _STATE_DETAIL)

    def _issue(self, name: str, *args: Any) -> None:
        """Call nccl4py's `name` with `args` (in its order), then wait out ncclInProgress
        (at the outermost groupEnd inside a group)."""
        fn = getattr(self._b, name)
        with self._lock:
            if self._released:
                raise NcclError(4, f"the communicator was {self._released}")
            _call(self._b, fn, *args)
        if getattr(_group, "depth", 0):
            if self not in _group.comms:
                _group.comms.append(self)
            return
        self._settle()

    # -- CuPy's methods ----------------------------------------------------------------------

    def device_id(self) -> int:
        return self._device

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._ndev

    def check_async_error(self) -> None:
        """Raise `NcclError` if the communicator is in an error state (ncclInProgress and
        ncclSuccess are not errors)."""
        state = self._state()
        if state not in (SUCCESS, IN_PROGRESS):
            raise NcclError(state, _STATE_DETAIL)

    def abort(self) -> None:
        """ncclCommAbort, from any thread, at any time; once (later calls do nothing)."""
        with self._lock:  # a call or poll under way returns first
            if self._released:
                return
            self._released = "aborted"
        _call(self._b, self._b.comm_abort, self._comm)

    def destroy(self) -> None:
        """ncclCommDestroy; once (later calls do nothing)."""
        with self._lock:
            if self._released:
                return
            self._released = "destroyed"
        _call(self._b, self._b.comm_destroy, self._comm)

    def allReduce(
        self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int
    ) -> None:
        self._issue("all_reduce", sendbuf, recvbuf, count, datatype, op, self._comm, stream)

    def reduce(
        self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int, stream: int
    ) -> None:
        self._issue("reduce", sendbuf, recvbuf, count, datatype, op, root, self._comm, stream)

    def broadcast(
        self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int, stream: int
    ) -> None:
        self._issue("broadcast", sendbuff, recvbuff, count, datatype, root, self._comm, stream)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:
        self._issue("all_gather", sendbuf, recvbuf, count, datatype, self._comm, stream)

    def reduceScatter(
        self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int, stream: int
    ) -> None:
        self._issue("reduce_scatter", sendbuf, recvbuf, recvcount, datatype, op, self._comm, stream)

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._issue("send", sendbuf, count, datatype, peer, self._comm, stream)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._issue("recv", recvbuf, count, datatype, peer, self._comm, stream)
