"""Re-forming a group with another set of processes, in place: torchcomms' init handles
and `reconfigure`.

Every process that is to be in the new group gives an init handle (`init_handle`: a
string naming the process for the transport); someone gathers them (the job's store, a
coordinator, `distcomm.membership`) and every one of those processes calls `reconfigure`
with the same id and the same list. The list's order is the new group's rank order. The
group object stays the same: its backends are replaced by new ones connected under a
store prefix of the id, and the old ones are shut down. Old members that are not in the
list do not call it; their group fails once the others have left it.

Only the default group (the world) is re-formed: that renumbers the world (`get_rank()`,
`get_world_size()`) and drops every other group, whose ranks no longer mean the same
processes, as `shrink_group` does; subgroups of the new world are made with `new_group`.
nccl makes a new communicator; mpi grows its communicator with MPI's dynamic processes
(`backends/mpi_reform.py`: the members accept MPI singletons that connect through a port
left in the job's store), so it needs a store the processes share.
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
        group: the default group (the world; in a process that joins, the one
            `init_process_group(join=True)` made).
        uuid: this re-forming's id, the same on every process and never used before on
            this job's store (an epoch number, a uuid4).
        init_handles: every new member's `get_init_handle()`, in the new rank order.
        timeout: how long connecting may take (default: the group's timeout).

    Raises:
        TypeError, ValueError: a bad uuid or list, this process's handle is not in it, or
            `group` is not the default group.
        DistBackendError: the group cannot re-form: mpi mixed with another backend, or an
            mpi world without a shared store.
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
    if state.store is None:
        raise ValueError(f"{where}: the world is not initialized; call init_process_group")
    if group is not state.default:
        raise ValueError(
            f"{where}: group '{group.group_name}' is not the default group; re-form the "
            "world (the default group), then make subgroups of the new world with new_group"
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
    seconds = to_seconds(timeout) or group.timeout.total_seconds()
    rank = list(init_handles).index(mine)
    pranks = [h.prank for h in handles]
    me = handles[rank]
    store = PrefixStore(f"distcomm/reconf/{uuid}", state.store)
    if "mpi" in spec.values():
        backends = _mpi_backends(group, spec, handles, rank, store, seconds)
        pranks = list(range(len(handles)))  # MPI ranks of the re-formed world
        me = InitHandle(mine, rank, None, me.host, me.pid)
    else:
        held = _hold_fabric(me.prank, [h.generation for h in handles], seconds)
        try:
            backends = create_backends(
                spec,
                store,
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
    with state.lock:  # the world is renumbered; its other groups mean other processes now
        group.rebuild(list(range(len(handles))), rank, backends, f"reconf.{uuid}")
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


def _mpi_backends(
    group: GroupHandle,
    spec: dict[str, str],
    handles: list[InitHandle],
    rank: int,
    store: Any,
    seconds: float,
) -> dict[str, Any]:
    """The re-formed world's mpi backends: MPI's dynamic processes (`mpi_reform`)."""
    from .backends.mpi import MpiBackend  # mpi4py's MPI is loaded only for an mpi group
    from .backends.mpi_reform import reform_mpi
    from .backends.staged import StagedBackend

    where = "reconfigure"
    if set(spec.values()) != {"mpi"}:
        raise DistBackendError(
            f"{where}: group '{group.group_name}' mixes the mpi backend with others "
            f"({group.name()!r}); re-forming takes one backend family: use 'mpi' alone, or "
            "tcp/gloo with nccl"
        )
    if type(state.store).__name__ == "HashStore":
        raise DistBackendError(
            f"{where}: re-forming an mpi world needs a store its processes share, to meet "
            "the newcomers: init_process_group('mpi', init_method='env://') with "
            "MASTER_ADDR and MASTER_PORT set (the newcomers use the same), not the "
            "process-local store of a bare init_process_group('mpi')"
        )
    # members have process ranks below NEWCOMER_RANKS (their world's); joiners above
    kept = [h.prank for h in handles if h.prank < NEWCOMER_RANKS]
    if not kept:
        raise DistBackendError(
            f"{where}: none of init_handles is a member of the mpi world; an mpi world "
            "grows from its members (MPI_Comm_accept), so list at least one of them"
        )
    old = next((b for b in group.backends().values() if isinstance(b, MpiBackend)), None)
    current = state.process_ranks
    old_ranks = [current.index(p) for p in kept] if group.rank() >= 0 else kept
    newcomers = len(handles) - len(kept)
    backend = reform_mpi(
        old if group.rank() >= 0 else None,
        old_ranks,
        rank,
        newcomers,
        store,
        seconds,
        group.group_name,
    )
    return {d: StagedBackend(backend) if d == "cuda" else backend for d in spec}


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
