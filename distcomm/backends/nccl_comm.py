"""The NCCL communicator of an `nccl` group (a mixin of `nccl.NcclBackend`).

Communicator: created on a group's first operation (every rank of the group issues it),
on the device of that operation's array. Rank 0 makes the unique id and puts it in the
group's store; the others read it; then every rank registers itself in the store and
waits (with the group timeout) until all have, so a missing rank is reported instead of
hanging in ncclCommInitRank. Each group, subgroups included, has its own unique id and
communicator (CuPy 14's `commSplit`, absent from CuPy 13, would need every rank of the
parent, members or not).

With DISTCOMM_DEBUG=DETAIL every collective first compares its signature (op, dtype,
count, reduce op, root) with every rank's through the store, so a mismatch raises
`DistBackendError` naming both sides instead of hanging in NCCL.

Initialisation is bounded: before NCCL is called every rank's host and GPU are compared
(two ranks on one GPU fail on every rank, naming them, where NCCL would fail the sharing
ranks and leave the others hanging), and ncclCommInitRank, which has no time limit and
hangs the healthy ranks when one fails, runs on a thread of its own: the caller waits
up to the group timeout and learns through the store of a rank whose initialisation
failed. A thread left inside a hung ncclCommInitRank stays blocked until the process
exits (CuPy's blocking communicators cannot be aborted before they exist). With
DISTCOMM_NCCL_BINDINGS=nccl4py the communicator is non-blocking: its initialisation is
polled in the caller's thread and aborted on a failure or the timeout, leaving no thread
behind.

Teardown: destroying a group fails its pending operations with `GroupDestroyedError`
and releases the communicator with ncclCommAbort, never ncclCommDestroy: destroy is a
collective of the node's ranks, which hangs after a peer's abort or when a peer never
destroys. Communicators of groups never destroyed are aborted at interpreter exit, before
CuPy's garbage collection would destroy them. The arrays of failed operations are kept
until the group's stream has run the work an abort leaves queued behind them.

This module holds the communicator's life: creating it (`connect`, `_ensure`: the unique
id, the roll call of GPUs, an init failure's message), the DETAIL signature check, and
`abort` and `shutdown`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from ..deadline import Deadline
from ..errors import DistBackendError, DistError, DistTimeoutError, GroupDestroyedError
from ..gpu import nccl as nccl_types
from ..gpu import runtime
from ..store.base import Store
from ..store.ranks import wait_for_ranks
from .engine.protocol import Signature, mismatch_message
from .nccl_watch import NcclWatchdog

__all__ = ["NcclCommunicator"]

# the backend's logger: the communicator's messages are the backend's
log = logging.getLogger("distcomm.backends.nccl")

#: where ranks whose ncclCommInitRank failed append what NCCL said, each ended by the mark
_FAILED_KEY, _FAILED_SEP = "initfail", "\n"
#: how long destroying a group waits for an abort under way (it waits for the GPU)
_ABORT_WAIT = 60.0


class NcclCommunicator:
    """A group's NCCL communicator: making it, the DETAIL signature check, aborting and
    destroying it (a mixin of `nccl.NcclBackend`).

    Uses the backend's identity (`store`, `rank`, `size`, `timeout`, `describe`), its
    CuPy and NCCL modules, its issue lock and watchdog; sets `_comm`, `_device` and
    `_stream` when the communicator is made, and drops them and the operations' cached
    buffers (`_barrier_buffer`, `_caller_event`) at shutdown.
    """

    store: Store
    rank: int
    size: int
    timeout: float
    group_name: str
    _nccl: Any
    _version: tuple[int, ...]
    _cupy: Any
    _issue: threading.RLock
    _watch: NcclWatchdog
    _comm: Any
    _device: Any
    _stream: Any
    _barrier_buffer: Any
    _caller_event: Any

    # -- making the communicator ----------------------------------------------------------

    def connect(self) -> None:
        """Create the communicator now, on the current GPU (init_process_group(device_id=)),
        instead of at the first operation."""
        with self._issue:
            self._ensure(runtime.current_device(), "init_process_group(device_id=...)")

    def _ensure(self, device_id: int, what: str) -> Any:
        """The communicator (created on `device_id` on first use); checks the device."""
        if self._comm is not None:
            if device_id != self._device.id:
                raise ValueError(
                    f"{self.describe(what)}: the array is on GPU {device_id}, but this "
                    f"group's NCCL communicator was created on GPU {self._device.id} (its "
                    "first operation's device); use arrays on one GPU per process "
                    "(distcomm.gpu.set_device)"
                )
            return self._comm
        cupy = self._cupy
        device = cupy.cuda.Device(device_id)
        deadline = Deadline(self.timeout)
        uid = self._unique_id(deadline)
        bus = self._register(device_id, deadline)
        comm = self._init_communicator(device_id, uid, deadline)
        with runtime.with_device(device):
            stream = cupy.cuda.Stream(non_blocking=True)
        self._comm, self._device, self._stream = comm, device, stream
        self._watch.start(comm, device)
        log.info(
            "%s: NCCL %s communicator of %d ranks on GPU %d (%s)",
            self.describe("init"),
            ".".join(map(str, self._version)),
            self.size,
            device_id,
            bus,
        )
        return comm

    def _unique_id(self, deadline: Deadline) -> bytes:
        if self.rank == 0:
            data = nccl_types.unique_id_bytes(self._nccl.get_unique_id())
            self.store.set("uid", data)
            return data
        self._wait_for_ranks({0: "uid"}, deadline, "published the NCCL unique id")
        return nccl_types.unique_id_bytes(self.store.get("uid"))

    def _register(self, device_id: int, deadline: Deadline) -> str:
        """Say which GPU this rank uses, wait until every rank has said so, and refuse,
        on every rank, a group where two ranks share a GPU (before NCCL is called: NCCL
        fails only the sharing ranks, and the others would hang in ncclCommInitRank)."""
        bus = str(self._cupy.cuda.runtime.deviceGetPCIBusId(device_id))
        self.store.set(f"gpu/{self.rank}", f"{socket.gethostname()} {bus}")
        keys = [f"gpu/{r}" for r in range(self.size)]
        self._wait_for_ranks(
            dict(enumerate(keys)),
            deadline,
            "said which GPU it joins the NCCL communicator with",
        )
        gpus = [v.decode() for v in self.store.multi_get(keys)]
        users: dict[str, list[int]] = {}
        for r, gpu in enumerate(gpus):
            users.setdefault(gpu, []).append(r)
        shared = {gpu: ranks for gpu, ranks in users.items() if len(ranks) > 1}
        if shared:
            mine = [r for r in users[gpus[self.rank]] if r != self.rank]
            who = (
                f"ranks {mine} use the same GPU ({bus}) as this rank"
                if mine
                else "; ".join(
                    f"ranks {ranks} share the GPU {gpu.split()[-1]} of {gpu.split()[0]}"
                    for gpu, ranks in shared.items()
                )
            )
            raise DistBackendError(
                f"{self.describe('init')}: {who}; NCCL needs one GPU per rank: call "
                "distcomm.gpu.set_device(local_rank) before the first operation, set "
                "CUDA_VISIBLE_DEVICES per rank, or start at most as many ranks per node as "
                "it has GPUs"
            )
        return bus

    def _init_communicator(self, device_id: int, uid: bytes, deadline: Deadline) -> Any:
        """ncclCommInitRank on a thread of its own, waited for up to `deadline` (a
        non-blocking communicator's, nccl4py's, is polled instead: `_init_nonblocking`).

        NCCL's initialisation has no time limit, and when one rank fails it the others
        hang in it. A rank whose initialisation failed says so in the store (one counter
        and its message); the others, waiting, look at the counter and raise naming it.

        Raises:
            DistBackendError: this rank's initialisation failed, or another rank's did.
            DistTimeoutError: it did not finish within the group timeout.
        """
        if getattr(self._nccl, "nonblocking", False):
            return self._init_nonblocking(device_id, uid, deadline)
        outcome: dict[str, Any] = {}
        abandoned = threading.Event()
        nccl, size, rank = self._nccl, self.size, self.rank

        def init() -> None:
            try:
                self._cupy.cuda.Device(device_id).use()  # a new thread: its device is 0
                comm = nccl_types.create_communicator(nccl, size, uid, rank)
            except BaseException as exc:  # NcclError (or the hung init ended at exit)
                outcome["error"] = exc
                return
            outcome["comm"] = comm
            if abandoned.is_set():  # the caller gave up meanwhile: nothing will use it
                comm.abort()

        thread = threading.Thread(
            target=init, daemon=True, name=f"distcomm-nccl-init-{self.group_name}"
        )
        thread.start()
        delay = 0.025  # a look at the store each 25, 50, 100, 200, 200... ms
        while True:
            thread.join(delay)
            if not thread.is_alive():
                break
            failed = self._failed_inits()
            if failed or deadline.expired():
                abandoned.set()
                error = self._init_abandoned(failed)
                log.error(
                    "%s; a thread stays blocked inside ncclCommInitRank until the process "
                    "exits (CuPy's communicators cannot be aborted before they exist)",
                    error,
                )
                raise error
            delay = min(delay * 2, 0.2)
        if "comm" in outcome:
            return outcome["comm"]
        raise self._init_failed(outcome["error"]) from outcome["error"]

    def _init_nonblocking(self, device_id: int, uid: bytes, deadline: Deadline) -> Any:
        """A non-blocking communicator (nccl4py's): ncclCommInitRankConfig returns at once,
        and its state is polled in this thread until it is not ncclInProgress, looking at
        the store for other ranks' failures as `_init_communicator` does; on a failure or
        the timeout the communicator is aborted, leaving nothing behind. Its later calls'
        polls are bounded by the group timeout and end when the group failed."""
        device = self._cupy.cuda.Device(device_id)
        try:
            with runtime.with_device(device):
                comm = nccl_types.create_communicator(self._nccl, self.size, uid, self.rank)
        except Exception as exc:  # NcclError
            raise self._init_failed(exc) from exc
        delay, look, looked = 0.0005, 0.025, time.monotonic()
        while True:
            try:
                if comm.ready():
                    break
            except Exception as exc:  # NcclError: the initialisation failed
                comm.abort()
                raise self._init_failed(exc) from exc
            failed: list[str] = []
            if time.monotonic() - looked >= look or deadline.expired():
                failed = self._failed_inits()  # a look at the store each 25, 50... 200 ms
                looked, look = time.monotonic(), min(look * 2, 0.2)
            if failed or deadline.expired():
                comm.abort()
                error = self._init_abandoned(failed)
                log.error("%s; the communicator was aborted", error)
                raise error
            delay = deadline.nap(delay, 0.01)

        def expired(seconds: float) -> None:
            self._watch.fail(
                DistTimeoutError(
                    f"{self.describe('nccl')}: an NCCL call was still in progress "
                    f"(ncclInProgress) after {seconds:g} s (it waits for a peer that never "
                    "connected?); the communicator was aborted: destroy the group and "
                    "create a new one"
                )
            )

        comm.supervise(self.timeout, lambda: self._watch.failure is not None, expired)
        return comm

    def _init_abandoned(self, failed: list[str]) -> DistError:
        """The error of an initialisation given up on: other ranks' failed (`failed`,
        what they said), or none did and the timeout expired."""
        if failed:
            return DistBackendError(
                f"{self.describe('init')}: ncclCommInitRank failed on "
                + "; ".join(failed)
                + "; this rank's initialisation waits for them"
            )
        return DistTimeoutError(
            f"{self.describe('init')}: ncclCommInitRank did not finish within "
            f"{self.timeout:g} s and no rank reported a failure (a rank stuck "
            "before it, or a network NCCL cannot cross: NCCL_DEBUG=INFO says more)"
        )

    def _init_failed(self, exc: BaseException) -> DistBackendError:
        """Tell the other ranks, through the store, that this rank's initialisation failed
        with `exc`; the error to raise."""
        text = f"rank {self.rank}: {exc}".replace(_FAILED_SEP, " ")
        try:
            self.store.append(_FAILED_KEY, text + _FAILED_SEP)
        except Exception:  # the store is gone: the others time out instead
            pass
        return DistBackendError(f"{self.describe('init')}: ncclCommInitRank failed: {exc}")

    def _failed_inits(self) -> list[str]:
        """What the ranks whose ncclCommInitRank failed said: one store request while none
        did, two once some did (each appends its message to one key)."""
        if not self.store.check([_FAILED_KEY]):
            return []
        said = self.store.get(_FAILED_KEY).decode(errors="replace")
        return [text for text in said.split(_FAILED_SEP) if text]

    def _wait_for_ranks(self, keys: dict[int, str], deadline: Deadline, arrived: str) -> None:
        """Wait for the ranks of `keys` to set them, warning while some are late and
        naming them (not the keys) at the timeout."""
        wait_for_ranks(
            self.store,
            keys,
            deadline,
            self.describe("init"),
            arrived=arrived,
            hint="did every rank of the group issue the same first GPU operation (the "
            "NCCL communicator is made by a group's first operation on a CuPy array)?",
        )

    # -- the DETAIL signature check --------------------------------------------------------

    def _check_signature(self, seq: int, signature: Signature, description: str) -> None:
        """DETAIL mode: compare this collective's signature with every rank's, by store."""
        self.store.set(f"sig/{seq}/{self.rank}", signature.to_text())
        keys = [f"sig/{seq}/{r}" for r in range(self.size)]
        try:
            self.store.wait(keys, self.timeout)
        except DistTimeoutError as exc:
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            error = DistTimeoutError(
                f"{description}: ranks {missing} did not reach collective #{seq} within "
                f"{self.timeout:.0f} s (DISTCOMM_DEBUG=DETAIL signature check); the group "
                "is aborted, so a late rank cannot enter NCCL alone"
            )
            self.store.delete_key(f"sig/{seq}/{self.rank}")  # a late rank waits, then fails
            self._watch.fail(error)
            raise error from exc
        if self._watch.abort_notice():  # another rank gave up on this group meanwhile
            self._watch.raise_if_failed(description)
        for peer, value in enumerate(self.store.multi_get(keys)):
            theirs = Signature.from_text(value.decode())
            if theirs != signature:
                raise DistBackendError(
                    mismatch_message(self.rank, self.size, seq, signature, peer, theirs)
                )
        if seq > 1:  # every rank has passed collective seq - 1's check: its key is read
            self.store.delete_key(f"sig/{seq - 1}/{self.rank}")

    # -- teardown -----------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        self._watch.fail(DistBackendError(reason))

    def abort_reason(self) -> str | None:
        failure = self._watch.failure
        return None if failure is None else str(failure)

    def shutdown(self) -> None:
        pending = self._watch.stop()
        if pending is None:  # shut down already
            return
        # always ncclCommAbort, never ncclCommDestroy: destroy is a collective of the
        # node's ranks, which hangs after a peer's abort (that this rank may not have
        # seen) or when a peer never destroys, and it would wait for stuck operations;
        # with every operation finished, abort releases the same resources, locally
        self._watch.release()
        self._watch.finish_abort(_ABORT_WAIT)
        self._comm = None
        self._watch.keep_until_settled(pending)
        for work in pending:
            try:
                work.fail(
                    GroupDestroyedError(
                        f"{work.description}: the process group was destroyed before the "
                        "operation finished"
                    )
                )
            except RuntimeError:  # it completed meanwhile
                pass
        self._watch.forget(self._stream)
        self._barrier_buffer = None
        self._caller_event = None
        self._stream = None
