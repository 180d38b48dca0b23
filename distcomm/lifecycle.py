"""The group lifecycle: init_process_group, new_group and destroy_process_group.

They create and destroy `ProcessGroup`s and keep the world state (`world.state`) that
the rest of the package reads. `make_group` is also what `regroup` (split_group,
shrink_group) builds its groups with. Above the group handle, the method API and the
function layer; the default group's flight recorder and stall inspector are handed the
world's groups from here (`trace.recorder.install_signal_handlers`, `trace.stall.start`),
and so is the MPI abort hook (`mpiutil.call_before_abort`), so none of them imports this.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from . import config, membership, mpiutil
from .backends import registered_backends
from .backends.base import Backend
from .backends.spec import create_backends, parse_backend, spec_text
from .deadline import to_seconds
from .errors import DistError
from .launch.excepthook import install as install_exception_hook
from .process_group import ProcessGroup
from .store import PrefixStore, Store
from .trace import stall
from .trace.recorder import NO_ARRAY, dump, install_signal_handlers
from .world import GroupMember, default_group, is_sentinel, state

__all__ = [
    "check_ranks",
    "destroy_process_group",
    "init_process_group",
    "make_group",
    "new_group",
    "resolve_timeout",
]

log = logging.getLogger("distcomm.group")  # the name users and tests filter on


def resolve_timeout(timeout: float | timedelta | None) -> float:
    """`timeout` in seconds, checked positive; None: DISTCOMM_TIMEOUT (or 30 minutes)."""
    seconds = to_seconds(timeout)
    if seconds is None:
        return config.load().timeout
    return config.positive_seconds("timeout", seconds)


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: float | timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Store | None = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
    join: bool | None = None,
) -> None:
    """Initialise the default process group (torch.distributed.init_process_group).

    Under distcomm-run (or torchrun) it also installs an exception hook: from then on an
    uncaught exception is written to the worker's error file for the failure report, as
    `@record` would (`distcomm.launch.excepthook`).

    Args:
        backend: "tcp", another registered backend, "cpu:tcp,cuda:nccl" (one backend per
            device), or None for the default of each device.
        init_method: "env://" (default), "tcp://host:port" or "file:///path"; not with `store`.
        timeout: bound of every blocking operation of the group (seconds or timedelta;
            default DISTCOMM_TIMEOUT or 30 minutes).
        world_size, rank: required with `store` or when the environment does not give them.
        store: a Store shared by all ranks, instead of `init_method`.
        group_name: the default group's name in messages.
        pg_options: accepted for torch compatibility.
        device_id: the GPU of this rank (an index, "cuda:N", a cupy.cuda.Device or a
            torch.device): made current, and an nccl backend creates its communicator
            there now instead of at the first collective.
        join: join a running job instead of starting one (not in torch): register with
            its store and return once its members have taken this process in (they do
            between steps: `distcomm.recovery`). Default: True in a replacement that
            distcomm-run --on-failure=replace started (DISTCOMM_REPLACEMENT is set).

    Raises:
        RuntimeError: the default group already exists.
        ValueError: bad arguments or environment; the message lists what was looked for.
        DistError: rendezvous or connection setup failed or timed out.
    """
    from .bootstrap import rendezvous  # not at import: it loads psutil and the stores
    from .bootstrap.mpi import world_rendezvous

    del pg_options
    if device_id is not None:
        from .gpu import runtime

        runtime.set_device(device_id)  # raises, saying what to install, without CuPy or a GPU
    with state.lock:
        if state.default is not None:
            raise RuntimeError(
                "init_process_group was already called in this process; call "
                "destroy_process_group() before initialising again"
            )
        cfg = config.load()
        seconds = resolve_timeout(timeout)
        spec = parse_backend(backend)
        if not spec:
            raise ValueError(
                "no backend is available for any device; registered: "
                + ", ".join(sorted(registered_backends()))
            )
        if join is None:
            join = bool(os.environ.get("DISTCOMM_REPLACEMENT"))
        if set(spec.values()) == {"mpi"} and store is None and init_method is None and not join:
            rdzv = world_rendezvous(rank, world_size)
        else:
            # a process joining a running job connects to its store as a client, as a
            # launcher's worker does (no roll call: the job's ranks met long ago)
            environ = {**os.environ, "DISTCOMM_USE_AGENT_STORE": "1"} if join else None
            rdzv = rendezvous(
                init_method,
                rank=rank,
                world_size=world_size,
                store=store,
                timeout=seconds,
                environ=environ,
            )
        config.configure_logging(cfg, rdzv.rank)
        owns = store is None
        name = group_name or "default"
        if join:
            _start_joining(rdzv.store, owns, name, spec, seconds)
    if join:
        _join(seconds)
        return
    with state.lock:
        try:
            backends = create_backends(
                spec,
                PrefixStore("distcomm/0", rdzv.store),
                rdzv.rank,
                rdzv.world_size,
                seconds,
                name,
                list(range(rdzv.world_size)),
                rdzv.store,
            )
        except BaseException:
            if owns:
                rdzv.store.close()
            raise
        group = ProcessGroup(
            name,
            list(range(rdzv.world_size)),
            rdzv.rank,
            backends,
            spec_text(spec),
            seconds,
            rdzv.rank,
        )
        log.info(
            "initialised: rank %d of %d, backend %s, rendezvous %s, timeout %.0f s",
            rdzv.rank,
            rdzv.world_size,
            spec_text(spec),
            rdzv.source,
            seconds,
        )
        state.default, state.store, state.owns_store = group, rdzv.store, owns
        state.groups = {name: group}
        state.next_id = 1
        state.local_ids = {}
        state.spec = spec
        state.process_ranks = list(range(rdzv.world_size))
        install_signal_handlers(state.every_group)  # the groups its dumps write
        mpiutil.call_before_abort(dump)  # an MPI abort skips exit handlers: dump first
        # last, in front of any hook a backend installed (mpi's aborts the job)
        install_exception_hook()
        cuda = backends.get("cuda")
        if device_id is not None and hasattr(cuda, "connect"):
            cuda.connect()  # nccl: the communicator now, on the chosen GPU
        stall.start(cfg.stall_warn_s, rdzv.store, lambda: list(state.groups.values()))


def _start_joining(
    store: Store, owns: bool, name: str, spec: dict[str, str], seconds: float
) -> None:
    """The world of a process that joins a running job: a default group with no member
    yet, which `_join` re-forms once the members take this process in."""
    group = ProcessGroup(name, [], -1, {}, spec_text(spec), seconds, -1)
    state.default, state.store, state.owns_store = group, store, owns
    state.groups = {name: group}
    state.next_id, state.local_ids, state.spec = 1, {}, spec
    state.process_ranks = []


def _join(seconds: float) -> None:
    group = state.default
    assert group is not None
    try:
        decision = membership.join(group, timeout=seconds)
    except BaseException:
        destroy_process_group()
        raise
    install_signal_handlers(state.every_group)
    mpiutil.call_before_abort(dump)
    install_exception_hook()
    log.info(
        "joined the job at epoch %d: rank %d of %d",
        decision.epoch,
        group.rank(),
        group.size(),
    )


def check_ranks(ranks: Iterable[int] | None, world_size: int, sort: bool = True) -> list[int]:
    """`ranks` checked as new_group's members (default: every rank), sorted unless
    `sort` is False.

    Raises:
        TypeError: not a list of ints.
        ValueError: a rank out of range or named twice, or no rank.
    """
    if ranks is None:
        return list(range(world_size))
    try:
        values = list(ranks)
    except TypeError:
        raise TypeError(f"new_group: ranks must be a list of ints, got {ranks!r}") from None
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"new_group: ranks must be ints, got {value!r}")
        if not 0 <= value < world_size:
            raise ValueError(
                f"new_group: rank {value} is out of range for world size {world_size} "
                f"(ranks go from 0 to {world_size - 1})"
            )
    if len(set(values)) != len(values):
        raise ValueError(f"new_group: ranks {values} name a rank twice")
    if not values:
        raise ValueError("new_group: ranks must name at least one rank")
    return sorted(values) if sort else values


def new_group(
    ranks: Iterable[int] | None = None,
    timeout: float | timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: Any = None,
    sort_ranks: bool = True,
) -> ProcessGroup | int:
    """Create a group of a subset of ranks (torch.distributed.new_group).

    Every rank of the world must call it, in the same order relative to other
    `new_group` calls, even ranks that are not members (unless
    `use_local_synchronization`).

    Args:
        ranks: global ranks of the members (default: all); order does not matter.
        timeout: the group's timeout (default: the default group's).
        backend: as in `init_process_group` (default: the default group's).
        pg_options: accepted for torch compatibility.
        use_local_synchronization: False (the default): every rank calls new_group, and
            it starts with a barrier of the default group, so that a rank that died before
            calling it fails the call at once, naming it, instead of leaving the others
            waiting for it up to the timeout. True: only the members call it (a non-member
            that does gets NON_GROUP_MEMBER and nothing happens), and the later calls by
            every rank still agree on which group is which.
        group_desc: the group's name in messages (default: its number).
        device_id: accepted for torch compatibility (the GPU of an nccl group is that of
            its first CuPy array, or the one `init_process_group(device_id=)` chose).
        sort_ranks: True (default): group ranks follow the global ranks' order; False: the
            order of `ranks` as given (the same on every rank).

    Returns:
        The group; on a rank not in it, `GroupMember.NON_GROUP_MEMBER`, as in torch:
        collectives on that do nothing (they warn once and return None), and `get_rank`
        and `get_world_size` of it are -1.
    """
    del pg_options, device_id
    with state.lock:
        world = default_group("new_group")
        members = check_ranks(ranks, world.size(), sort=sort_ranks)
        seconds = world.timeout.total_seconds() if timeout is None else resolve_timeout(timeout)
        spec = state.spec if backend is None else parse_backend(backend)
        me = world.rank()
        group_rank = members.index(me) if me in members else -1
        if use_local_synchronization:
            if group_rank < 0:  # only members call it: a non-member that does gets nothing
                return GroupMember.NON_GROUP_MEMBER
            group_id = _local_group_id(members)  # agreed by the members alone
        else:
            # agreed by every rank calling in the same order (since the last re-forming)
            group_id = f"{state.id_prefix}{state.next_id}"
            state.next_id += 1
        name = group_desc or group_id
        if not use_local_synchronization:
            _every_rank_is_there(world, members, name)
        group = make_group(members, me, group_id, name, spec, seconds)
        state.groups[f"{group_id}:{name}"] = group
        return group if group_rank >= 0 else GroupMember.NON_GROUP_MEMBER


def make_group(
    members: list[int],
    me: int,
    group_id: str,
    name: str,
    spec: dict[str, str],
    seconds: float,
    process_ranks: list[int] | None = None,
) -> ProcessGroup:
    """A group of the world ranks `members` as seen from world rank `me`, with backends
    connected (members only) under the store prefix distcomm/<group_id>. `process_ranks`:
    each world rank's rank at the job's start (default: the world's)."""
    process_ranks = state.process_ranks if process_ranks is None else process_ranks
    group_rank = members.index(me) if me in members else -1
    backends: dict[str, Backend] = {}
    if group_rank >= 0:
        backends = create_backends(
            spec,
            PrefixStore(f"distcomm/{group_id}", state.store),
            group_rank,
            len(members),
            seconds,
            name,
            [process_ranks[m] for m in members],
            state.store,
        )
    log.info(
        "group %r: ranks %s, this rank %s",
        name,
        members,
        group_rank if group_rank >= 0 else "not a member",
    )
    return ProcessGroup(
        name, members, group_rank, backends, spec_text(spec), seconds, me, store_key=group_id
    )


def _local_group_id(members: list[int]) -> str:
    """The id of a group made with use_local_synchronization: from its ranks (in order)
    and how many such groups of these ranks this process made before, which its members
    agree on without the other ranks (torch hashes the ranks alone, so the same ranks
    twice collide); it leaves the numbering of the other groups alone."""
    digest = hashlib.sha1(",".join(map(str, members)).encode()).hexdigest()[:16]
    count = state.local_ids.get(digest, 0)
    state.local_ids[digest] = count + 1
    return f"{state.id_prefix}local-{digest}-{count}"


def _every_rank_is_there(world: ProcessGroup, members: list[int], name: str) -> None:
    """A barrier of the default group's CPU backend, which every rank's `new_group` call
    reaches: a rank that died before it fails the call at once (its connections closed),
    naming it, where the new group's connection setup would wait for it up to the timeout.

    Raises:
        DistError: the default group failed or timed out; the message names the rank.
    """
    backend = world.backends().get("cpu")
    if backend is None or world.size() == 1:
        return
    entry = world.recorder.record("new_group", NO_ARRAY)  # the stall inspector watches it too
    try:
        backend.barrier(async_op=True).wait()
        world.recorder.settle(entry)
    except DistError as exc:
        world.recorder.settle(entry, exc)
        try:
            error = type(exc)(
                f"new_group {name!r} (ranks {members}): a rank of the default group failed "
                f"before every rank called new_group, so the group cannot be created (see "
                f"that rank's output for why it stopped): {exc}"
            )
        except Exception:  # an error type with a constructor of its own: keep it as it is
            raise exc from None
        raise error from exc


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroy `group`, or every group and the default one when None.

    Afterwards no thread, socket or listening port of the destroyed groups is left.

    Raises:
        RuntimeError: distcomm is not initialised.
    """
    with state.lock:
        default = default_group("destroy_process_group")
        if is_sentinel(group):
            return  # a group this rank is not in: nothing of it lives here
        if group is not None and group is not default:
            log.info("destroying group %r", group.group_name)
            group.shutdown()
            for key, value in list(state.groups.items()):
                if value is group:
                    del state.groups[key]
            return
        log.info("destroying every group")
        errors: list[Exception] = []
        try:
            stall.stop()
            for value in [*(g for g in state.groups.values() if g is not default), default]:
                try:
                    value.shutdown()
                except Exception as exc:  # a backend's shutdown failed: finish the rest
                    log.warning(
                        "destroy_process_group: group %r did not shut down cleanly: %s",
                        value.group_name,
                        exc,
                    )
                    errors.append(exc)
        finally:  # the store and the module state go whatever happened above
            try:
                if state.owns_store and state.store is not None:
                    state.store.close()
            finally:
                if "mpi" in state.spec.values():
                    from .backends import mpi  # loaded already: the world used it

                    for comm in mpi.WORLD:  # a re-formed world's communicator
                        comm.Free()
                    mpi.WORLD.clear()
                state.default, state.store, state.owns_store = None, None, False
                state.groups = {}
                state.spec = {}
                state.process_ranks = []
                state.process_rank = None
                state.epoch = 0
                state.joined = False
                state.id_prefix, state.next_id = "", 1
                state.local_ids = {}
        if errors:
            raise errors[0]
