"""Re-forming a group with another set of processes, in place: torchcomms' init handles
and `reconfigure`.

Every process that is to be in the new group gives an init handle (`init_handle`: a
string naming the process for the transport); someone gathers them (the job's store, a
coordinator, `distcomm.membership`) and every one of those processes calls `reconfigure`
with the same id and the same list. The list's order is the new group's rank order. The
group object stays the same: its backends are replaced by new ones connected under a
store prefix of the id, and the old ones are shut down. Old members that are not in the
list do not call it; their group fails once the others have left it.

Re-forming the default group renumbers the world (`get_rank()`, `get_world_size()`) and
drops every other group, whose ranks no longer mean the same processes, as `shrink_group`
does. The mpi backend cannot re-form (its communicator is MPI's: growing one needs
MPI_Comm_connect/accept or MPI sessions, which this backend does not drive); nccl makes
a new communicator.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from datetime import timedelta
from typing import Any

from .backends.engine.transport import fabric
from .backends.engine.transport.tcp import link_timeout
from .backends.spec import create_backends, parse_backend
from .deadline import to_seconds
from .errors import DistBackendError
from .handle import GroupHandle
from .store import PrefixStore
from .work import Work
from .world import state

__all__ = ["NEWCOMER_RANKS", "InitHandle", "init_handle", "parse_handle", "reconfigure"]

log = logging.getLogger("distcomm.group")

#: process ranks of processes that joined a running job start here (those of the job's
#: start are 0..world_size-1); the transport names a process's connections by it
NEWCOMER_RANKS = 1 << 20
_NONCE = secrets.token_hex(4)  # one per process: a handle is the same every time it is asked
_PREFIX = "dc1"


class InitHandle:
    """A parsed init handle: the process rank, the transport's fabric generation (None
    where the process has none yet), the host and the pid."""

    __slots__ = ("generation", "host", "pid", "prank", "text")

    def __init__(self, text: str, prank: int, generation: int | None, host: str, pid: int):
        self.text, self.prank, self.generation, self.host, self.pid = (
            text,
            prank,
            generation,
            host,
            pid,
        )


def _own_process_rank(group: GroupHandle) -> int:
    """This process's process rank: its rank at the job's start, or the one it was given
    when it joined (`state.process_rank`)."""
    if state.process_rank is not None:
        return state.process_rank
    if group is state.default and state.process_ranks and group.rank() >= 0:
        return state.process_ranks[group.rank()]
    raise ValueError(
        "get_init_handle: this process has no process rank yet; call it on the default "
        "group of an initialized world (init_process_group), or join one "
        "(init_process_group(join=True))"
    )


def init_handle(group: GroupHandle) -> str:
    """This process's init handle for `reconfigure` (torchcomms' `get_init_handle`): the
    same string every time, different in every process of the job."""
    prank = _own_process_rank(group)
    generation = None
    if state.store is not None:
        generation = fabric.generation_of(state.store, prank)
    gen = "-" if generation is None else str(generation)
    return f"{_PREFIX}:{prank}:{gen}:{socket.gethostname()}:{os.getpid()}:{_NONCE}"


def parse_handle(text: Any, where: str = "reconfigure") -> InitHandle:
    """`text` as an `InitHandle`; ValueError naming it when it is not one."""
    parts = text.split(":") if isinstance(text, str) else []
    try:
        if len(parts) != 6 or parts[0] != _PREFIX:
            raise ValueError
        generation = None if parts[2] == "-" else int(parts[2])
        return InitHandle(text, int(parts[1]), generation, parts[3], int(parts[4]))
    except ValueError:
        raise ValueError(
            f"{where}: {text!r} is not an init handle; pass the strings that "
            "pg.get_init_handle() returned on each process of the new group"
        ) from None


def reconfigure(
    group: GroupHandle,
    uuid: str,
    init_handles: list[str],
    timeout: float | timedelta | None = None,
) -> Work:
    """Re-form `group` as the processes of `init_handles`, in that rank order (torchcomms'
    `reconfigure`). Every process of the list calls it with the same `uuid` and list; it
    returns once the new backends are connected, with a completed Work.

    Args:
        group: the group to re-form: the default group, or the group of a process that
            joins (`init_process_group(join=True)` makes one).
        uuid: this re-forming's id, the same on every process and never used before on
            this job's store (an epoch number, a uuid4).
        init_handles: every new member's `get_init_handle()`, in the new rank order.
        timeout: how long connecting may take (default: the group's timeout).

    Raises:
        TypeError, ValueError: a bad uuid or list, or this process's handle is not in it.
        DistBackendError: the group's backend cannot re-form (mpi).
        DistTimeoutError: some process of the list did not come in time.
    """
    where = "reconfigure"
    if not isinstance(uuid, str) or not uuid or "/" in uuid:
        raise ValueError(
            f"{where}: uuid must be a non-empty string without '/', the same on every "
            f"process of the new group (an epoch number, a uuid4), got {uuid!r}"
        )
    if isinstance(init_handles, (str, bytes)) or not isinstance(init_handles, (list, tuple)):
        raise TypeError(
            f"{where}: init_handles must be a list of the new members' get_init_handle() "
            f"strings, got {type(init_handles).__name__}"
        )
    handles = [parse_handle(h, where) for h in init_handles]
    if not handles:
        raise ValueError(f"{where}: init_handles is empty; list every member of the new group")
    if len({h.prank for h in handles}) != len(handles):
        raise ValueError(f"{where}: init_handles names a process twice: {list(init_handles)}")
    mine = init_handle(group)
    if mine not in init_handles:
        raise ValueError(
            f"{where}: this process's init handle {mine!r} is not in init_handles; only the "
            "processes of the new group call reconfigure, each with the same list, which "
            "holds its own get_init_handle()"
        )
    spec = parse_backend(group.name())
    if "mpi" in spec.values():
        raise DistBackendError(
            f"{where}: group '{group.group_name}' uses the mpi backend, which cannot take in "
            "new processes (that needs MPI_Comm_connect/accept or MPI sessions, which "
            "distcomm's mpi backend does not drive); re-form on tcp or gloo, or restart the "
            "job with mpiexec"
        )
    if state.store is None:
        raise ValueError(f"{where}: the world is not initialized; call init_process_group")
    seconds = to_seconds(timeout) or group.timeout.total_seconds()
    rank = list(init_handles).index(mine)
    pranks = [h.prank for h in handles]
    me = handles[rank]
    held = _hold_fabric(me.prank, [h.generation for h in handles], seconds)
    try:
        backends = create_backends(
            spec,
            PrefixStore(f"distcomm/reconf/{uuid}", state.store),
            rank,
            len(handles),
            seconds,
            group.group_name,
            pranks,
            state.store,
        )
    finally:
        if held is not None:
            held.release()  # the new group's transport holds it now, if it needed it
    old = group.backends()
    with state.lock:
        group.rebuild(list(range(len(handles))), rank, backends, f"reconf.{uuid}")
        if group is state.default:
            group.global_rank = rank
            state.process_ranks = pranks
            state.process_rank = me.prank
            for other in list(state.groups.values()):
                if other is not group:
                    _shut(other.backends())
            state.groups = {key: g for key, g in state.groups.items() if g is group}
            state.id_prefix, state.next_id, state.local_ids = f"r{uuid}.", 1, {}
    _shut(old)
    log.info(
        "reconfigure %s: group '%s' is now %d processes (process ranks %s); this one is rank %d",
        uuid,
        group.group_name,
        len(handles),
        pranks,
        rank,
    )
    return Work.completed(f"reconfigure {uuid} of group '{group.group_name}'")


def _hold_fabric(prank: int, generations: list[int | None], seconds: float) -> Any:
    """Open this process's transport fabric with the generation the others use (a process
    that joined has none yet, and one opened with another would be refused by theirs);
    the caller releases it. None where nothing is needed."""
    known = [g for g in generations if g is not None]
    if not known or state.store is None:
        return None
    if fabric.generation_of(state.store, prank) is not None:
        return None
    return fabric.attach(state.store, prank, link_timeout(seconds), known[0])


def _shut(backends: dict[str, Any]) -> None:
    """Shut the backends of a group that was re-formed down; its peers may be gone."""
    for backend in {id(b): b for b in backends.values()}.values():
        try:
            backend.shutdown()
        except Exception as exc:  # a dead peer: nothing to wait for
            log.debug("shutting a re-formed group's old backend down: %s", exc)
