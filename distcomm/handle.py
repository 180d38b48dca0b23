"""The state of one process group: its ranks, its backends (one per device) and its flight
recorder, and the choice of the backend that serves an array.

`GroupHandle` is the part of `distcomm.ProcessGroup` the operations need, so that the
function layer (`collectives`, `p2p`, `coalesced`) and the world state (`world`) import
it from below, while the method API (`group_methods`), which calls those functions, is
mixed in above them (`process_group.ProcessGroup`): no import goes up.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from . import config
from .arrays import device_of
from .backends.base import Backend
from .errors import GroupDestroyedError
from .trace.recorder import Recorder

__all__ = ["GroupHandle"]

log = logging.getLogger("distcomm.group")
_HOOKS_LOCK = threading.Lock()  # guards every group's abort state and hooks (rarely taken)


class GroupHandle:
    """A set of ranks that run collectives together, as seen by this process.

    Args:
        name: the group's name in messages (`group_name`).
        ranks: the global ranks of its members, in group-rank order.
        group_rank: this process's rank in the group, -1 when it is not a member.
        backends: device ("cpu", "cuda") -> the backend serving it (empty for a
            non-member).
        spec: the backend as given ("tcp", "cpu:gloo,cuda:nccl"), returned by `name()`.
        timeout: the bound of its blocking operations, in seconds.
        global_rank: this process's global rank.
        store_key: its keys in the job's store live under distcomm/<store_key>.
    """

    def __init__(
        self,
        name: str,
        ranks: list[int],
        group_rank: int,
        backends: dict[str, Backend],
        spec: str,
        timeout: float,
        global_rank: int,
        store_key: str = "0",
    ) -> None:
        self.group_name = name
        #: its keys in the job's store live under distcomm/<store_key> (and its groups')
        self.store_key = store_key
        self.ranks = ranks
        self._rank = group_rank
        self._backends = backends
        self._spec = spec
        self.timeout = timedelta(seconds=timeout)
        #: this process's global rank (also when it is not a member)
        self.global_rank = global_rank
        self._splits = 0  # split_group/shrink_group calls on it so far (for their ids)
        cfg = config.load()
        #: the flight recorder of the group's operations (distcomm.trace); the function
        #: layer records and settles every operation in it
        self.recorder = Recorder.create(
            cfg.trace_buffer if group_rank >= 0 else 0, stack=cfg.debug == "DETAIL"
        )
        self._abort_hooks: list[Callable[[str], None]] = []
        self._aborted: str | None = None  # why, once the group failed or was aborted
        self._listen(backends)

    def _listen(self, backends: dict[str, Backend]) -> None:
        for backend in {id(b): b for b in backends.values()}.values():

            def heard(reason: str, backend: Backend = backend) -> None:
                # a backend re-forming replaced may still report its shutdown: not ours
                if any(b is backend for b in self._backends.values()):
                    self._on_abort(reason)

            backend.add_abort_listener(heard)

    def _on_abort(self, reason: str) -> None:
        """(any thread) A backend of the group failed: remember it and run the hooks, once."""
        with _HOOKS_LOCK:
            if self._aborted is not None:
                return
            self._aborted = reason
            hooks = list(self._abort_hooks)
        for hook in hooks:
            try:
                hook(reason)
            except Exception:  # a hook's error must not stop the others or the abort
                log.exception("group '%s': an abort hook raised", self.group_name)

    def rank(self) -> int:
        """This process's rank in the group, or -1 when it is not a member."""
        return self._rank

    def size(self) -> int:
        """The number of ranks in the group."""
        return len(self.ranks)

    def name(self) -> str:
        """The group's backend, as given to init_process_group/new_group ("tcp")."""
        return self._spec

    @property
    def is_member(self) -> bool:
        """Whether this process belongs to the group."""
        return self._rank >= 0

    def backends(self) -> dict[str, Backend]:
        """Device ("cpu", "cuda") -> the backend that serves it; empty once the group was
        destroyed, or on a rank that is not a member. A copy: changing it changes nothing."""
        return dict(self._backends)

    def next_split(self) -> int:
        """Count a split_group/shrink_group call on this group and return its number (0
        first), from which every rank derives the same id for the new group."""
        count = self._splits
        self._splits += 1
        return count

    def backend_for(self, array: Any, where: str) -> Backend:
        """The backend that serves `array`'s device.

        Raises:
            ValueError: this rank is not a member.
            GroupDestroyedError: the group was destroyed (also a RuntimeError).
            ValueError: no backend of the group serves the array's device.
        """
        if not self.is_member:
            raise ValueError(
                f"{where}: this process (global rank {self.global_rank}) is not a member of "
                f"group '{self.group_name}' (ranks {self.ranks}); only members may use it"
            )
        if not self._backends:
            raise GroupDestroyedError(
                f"{where}: group '{self.group_name}' was destroyed; create a new one"
            )
        device = device_of(array)
        backend = self._backends.get(device)
        if backend is None:
            served = ", ".join(sorted(self._backends))
            raise ValueError(
                f"{where}: group '{self.group_name}' uses backend '{self._spec}', which has no "
                f"backend for {device} arrays (it serves: {served}); pass a {served} array or "
                f"create the group with a backend for {device}, e.g. 'cpu:tcp,cuda:nccl'"
            )
        return backend

    def default_backend(self, where: str, device: str | None = None) -> Backend:
        """The group's backend for device-less operations (barrier): `device`'s ("cuda"
        for a barrier given device_ids) when the group has one, else CPU first."""
        if not self.is_member or not self._backends:
            return self.backend_for(None, where)
        if device is not None and device in self._backends:
            return self._backends[device]
        return self._backends.get("cpu") or next(iter(self._backends.values()))

    def abort(self, reason: str | None = None) -> None:
        """Abort the group, from any thread: every pending and later operation of it
        fails, here and (tcp, gloo, nccl) on every other rank, which hear of it at once
        instead of waiting out a timeout. The abort hooks run. Re-form the group to go on
        (`reconfigure`, `distcomm.recovery`) or destroy it.

        Args:
            reason: said in every error the abort causes (default: that abort was called).
        """
        why = reason or f"ProcessGroup.abort() was called on rank {self.global_rank}"
        for backend in {id(b): b for b in self._backends.values()}.values():
            backend.abort(why)
        self._on_abort(why)  # also for a plug-in that tells no listener

    def is_aborted(self) -> bool:
        """Whether the group was aborted or failed (an abort here or on another rank, a
        timeout, a lost peer): its operations fail until it is re-formed or destroyed."""
        return self.abort_reason() is not None

    def abort_reason(self) -> str | None:
        """Why the group was aborted or failed, or None while it is well."""
        if self._aborted is not None:
            return self._aborted
        for backend in self._backends.values():
            reason = backend.abort_reason()
            if reason is not None:
                return reason
        return None

    def register_abort_hook(self, hook: Callable[[str], None]) -> None:
        """Call `hook(reason)` once when the group is aborted or fails, from the thread
        that saw it (a reader or watchdog thread, or the caller of `abort`): keep it short
        and issue no operation of the group in it (set a flag, wake a thread). A hook
        registered after the failure runs at once."""
        if not callable(hook):
            raise TypeError(f"register_abort_hook: hook must be callable, got {hook!r}")
        with _HOOKS_LOCK:
            reason = self._aborted
            if reason is None:
                self._abort_hooks.append(hook)
                return
        hook(reason)

    def rebuild(
        self, ranks: list[int], group_rank: int, backends: dict[str, Backend], store_key: str
    ) -> None:
        """Make this object the group `ranks` with `backends` (a reconfigure): the old
        backends are shut down by the caller; the recorder and the hooks stay, the abort
        state is cleared."""
        self.ranks = ranks
        self._rank = group_rank
        self._backends = backends
        self.store_key = store_key
        self._splits = 0
        with _HOOKS_LOCK:
            self._aborted = None
        self._listen(backends)

    def shutdown(self) -> None:
        """Release the group's connections: shut every backend down, also when one of them
        raises (the first error is raised once all have been asked).
        `destroy_process_group(pg)` also forgets the group."""
        backends, self._backends = self._backends, {}
        errors = []
        for backend in backends.values():
            try:
                backend.shutdown()
            except Exception as exc:  # a plug-in's shutdown: the others still shut down
                errors.append(exc)
        if errors:
            raise errors[0]

    def __repr__(self) -> str:
        who = f"rank {self._rank}" if self.is_member else "not a member"
        return (
            f"<ProcessGroup '{self.group_name}' backend='{self._spec}' ranks={self.ranks} ({who})>"
        )
