"""Process groups and the world state: init_process_group, new_group, destroy, rank queries.

The default group and the registry of groups live in one `_World` object: the one
piece of module state distcomm has, set by `init_process_group` and cleared by
`destroy_process_group`. `distcomm.group.WORLD` is the default group (torch's
`dist.group.WORLD`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NewType

from . import config
from .arrays import device_of
from .backend_spec import (
    create_backends,
    get_default_backend_for_device,
    is_backend_available,
    is_gloo_available,
    is_mpi_available,
    is_nccl_available,
    is_ucc_available,
    is_xccl_available,
    parse_backend,
    spec_text,
)
from .backends import registered_backends
from .backends.base import Backend
from .deadline import to_seconds
from .errors import DistError, GroupDestroyedError
from .group_methods import GroupMethods
from .launch.excepthook import install as install_exception_hook
from .store import HashStore, PrefixStore, Store
from .trace import stall
from .trace.recorder import NO_ARRAY, Recorder, install_signal_handlers

__all__ = [
    "GroupMember",
    "GroupName",
    "ProcessGroup",
    "default_pg_timeout",
    "destroy_process_group",
    "get_default_backend_for_device",
    "init_process_group",
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_ucc_available",
    "is_xccl_available",
    "new_group",
]

#: a process group's name, `group.group_name` (torch's NewType of str)
GroupName = NewType("GroupName", str)


class ProcessGroup(GroupMethods):
    """A set of ranks that run collectives together (torch.distributed.ProcessGroup).

    Obtained from `init_process_group` (the default group, `group.WORLD`) or
    `new_group` (which gives ranks outside the group `GroupMember.NON_GROUP_MEMBER`
    instead, as torch does). Its collectives are also methods, as torch's C++ layer has
    them (`pg.allreduce([x], AllreduceOptions())`; see `distcomm.group_methods`).
    """

    def __init__(self, name: str, ranks: list[int], group_rank: int,
                 backends: dict[str, Backend], spec: str, timeout: float,
                 global_rank: int, store_key: str = "0") -> None:
        self.group_name = name
        self._store_key = store_key  # its keys in the job's store: distcomm/<store_key>
        self.ranks = ranks
        self._rank = group_rank
        self._backends = backends
        self._spec = spec
        self.timeout = timedelta(seconds=timeout)
        self._global_rank = global_rank
        self._splits = 0  # split_group/shrink_group calls on it so far (for their ids)
        cfg = config.load()
        #: the flight recorder of the group's operations (distcomm.trace)
        self._trace = Recorder(cfg.trace_buffer if group_rank >= 0 else 0,
                               stack=cfg.debug == "DETAIL")

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

    def backend_for(self, array: Any, where: str) -> Backend:
        """The backend that serves `array`'s device.

        Raises:
            ValueError: this rank is not a member.
            GroupDestroyedError: the group was destroyed (also a RuntimeError).
            ValueError: no backend of the group serves the array's device.
        """
        if not self.is_member:
            raise ValueError(
                f"{where}: this process (global rank {self._global_rank}) is not a member of "
                f"group '{self.group_name}' (ranks {self.ranks}); only members may use it")
        if not self._backends:
            raise GroupDestroyedError(
                f"{where}: group '{self.group_name}' was destroyed; create a new one")
        device = device_of(array)
        backend = self._backends.get(device)
        if backend is None:
            served = ", ".join(sorted(self._backends))
            raise ValueError(
                f"{where}: group '{self.group_name}' uses backend '{self._spec}', which has no "
                f"backend for {device} arrays (it serves: {served}); pass a {served} array or "
                f"create the group with a backend for {device}, e.g. 'cpu:tcp,cuda:nccl'")
        return backend

    def default_backend(self, where: str, device: str | None = None) -> Backend:
        """The group's backend for device-less operations (barrier): `device`'s ("cuda"
        for a barrier given device_ids) when the group has one, else CPU first."""
        if not self.is_member or not self._backends:
            return self.backend_for(None, where)
        if device is not None and device in self._backends:
            return self._backends[device]
        return self._backends.get("cpu") or next(iter(self._backends.values()))

    def _shutdown(self) -> None:
        """Shut every backend down, also when one of them raises (the first error is
        raised once all have been asked)."""
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
        return (f"<ProcessGroup '{self.group_name}' backend='{self._spec}' "
                f"ranks={self.ranks} ({who})>")


@dataclass
class _World:
    """The default group and every group created since (the documented module state)."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    default: ProcessGroup | None = None
    store: Store | None = None
    owns_store: bool = False
    groups: dict[str, ProcessGroup] = field(default_factory=dict)
    next_id: int = 1
    #: groups made with use_local_synchronization, per hash of their ranks
    local_ids: dict[str, int] = field(default_factory=dict)
    spec: dict[str, str] = field(default_factory=dict)
    #: each world rank's rank when the job started (they differ once shrink_group has
    #: shrunk the default group); backends that address processes (mpi) get these
    process_ranks: list[int] = field(default_factory=list)


_world = _World()
log = logging.getLogger(__name__)


class _GroupMemberType(type):
    @property
    def WORLD(cls) -> ProcessGroup | None:
        return _world.default


class GroupMember(metaclass=_GroupMemberType):
    """torch's sentinels: `GroupMember.WORLD` is the default group (None before init)."""

    NON_GROUP_MEMBER = -100


def __getattr__(name: str) -> Any:
    if name == "WORLD":
        return _world.default
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- initialisation and teardown --------------------------------------------------------------

def is_available() -> bool:
    """Whether distcomm can be used here (always True)."""
    return True


def is_initialized() -> bool:
    """Whether `init_process_group` has been called (and not undone)."""
    return _world.default is not None


def _resolve_timeout(timeout: float | timedelta | None) -> float:
    seconds = to_seconds(timeout)
    if seconds is None:
        return config.load().timeout
    return config.positive_seconds("timeout", seconds)


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: float | timedelta | None = None, world_size: int = -1,
                       rank: int = -1, store: Store | None = None,
                       group_name: str = "", pg_options: Any = None,
                       device_id: Any = None) -> None:
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

    Raises:
        RuntimeError: the default group already exists.
        ValueError: bad arguments or environment; the message lists what was looked for.
        DistError: rendezvous or connection setup failed or timed out.
    """
    from .bootstrap import rendezvous

    del pg_options
    if device_id is not None:
        from .gpu import runtime

        runtime.set_device(device_id)  # raises, saying what to install, without CuPy or a GPU
    with _world.lock:
        if _world.default is not None:
            raise RuntimeError(
                "init_process_group was already called in this process; call "
                "destroy_process_group() before initialising again")
        cfg = config.load()
        seconds = _resolve_timeout(timeout)
        spec = parse_backend(backend)
        if not spec:
            raise ValueError(
                "no backend is available for any device; registered: "
                + ", ".join(sorted(registered_backends())))
        if set(spec.values()) == {"mpi"} and store is None and init_method is None:
            rdzv = _mpi_world(rank, world_size)
        else:
            rdzv = rendezvous(init_method, rank=rank, world_size=world_size, store=store,
                              timeout=seconds)
        config.configure_logging(cfg, rdzv.rank)
        owns = store is None
        name = group_name or "default"
        try:
            backends = create_backends(spec, PrefixStore("distcomm/0", rdzv.store),
                                        rdzv.rank, rdzv.world_size, seconds, name,
                                        list(range(rdzv.world_size)), rdzv.store)
        except BaseException:
            if owns:
                rdzv.store.close()
            raise
        group = ProcessGroup(name, list(range(rdzv.world_size)), rdzv.rank, backends,
                             spec_text(spec), seconds, rdzv.rank)
        log.info("initialised: rank %d of %d, backend %s, rendezvous %s, timeout %.0f s",
                 rdzv.rank, rdzv.world_size, spec_text(spec), rdzv.source, seconds)
        _world.default, _world.store, _world.owns_store = group, rdzv.store, owns
        _world.groups = {name: group}
        _world.next_id = 1
        _world.local_ids = {}
        _world.spec = spec
        _world.process_ranks = list(range(rdzv.world_size))
        install_signal_handlers()
        # last, in front of any hook a backend installed (mpi's aborts the job)
        install_exception_hook()
        cuda = backends.get("cuda")
        if device_id is not None and hasattr(cuda, "connect"):
            cuda.connect()  # nccl: the communicator now, on the chosen GPU
        stall.start(cfg.stall_warn_s, rdzv.store, lambda: list(_world.groups.values()))


def _mpi_world(rank: int, world_size: int) -> Any:
    """Rank and world size from MPI.COMM_WORLD (the mpi backend needs no store).

    Raises:
        ValueError: `rank` or `world_size` was given and disagrees with MPI's.
    """
    from .backends.mpi import mpi
    from .bootstrap import Rendezvous

    world = mpi().COMM_WORLD
    for name, given, actual in (("world_size", world_size, world.size),
                                ("rank", rank, world.rank)):
        if given not in (-1, None) and given != actual:
            raise ValueError(
                f"init_process_group('mpi'): {name}={given} but MPI.COMM_WORLD says "
                f"{actual}; leave {name} out under mpiexec/srun (MPI gives it), or start the "
                "job with the matching number of processes")
    return Rendezvous(HashStore(), world.rank, world.size, source="MPI.COMM_WORLD")


def default_group(where: str) -> ProcessGroup:
    """The default group.

    Raises:
        RuntimeError: `init_process_group` has not been called.
    """
    group = _world.default
    if group is None:
        raise RuntimeError(
            f"{where}: distcomm is not initialised; call distcomm.init_process_group() first")
    return group


def _is_sentinel(group: Any) -> bool:
    """Whether `group` is GroupMember.NON_GROUP_MEMBER (what new_group gives a non-member)."""
    return type(group) is int and group == GroupMember.NON_GROUP_MEMBER


def _is_non_member(group: Any) -> bool:
    """Whether this rank is outside `group`: the sentinel, or a handle with rank -1."""
    return _is_sentinel(group) or (isinstance(group, ProcessGroup) and not group.is_member)


_warned_outside: set[tuple[str, Any]] = set()


def outside(group: Any, where: str) -> bool:
    """Whether this rank is not in `group`, so that operation `where` on it does nothing
    (as in torch: it returns None and leaves the arrays alone); warns the first time for
    each operation and group."""
    if group is None or not _is_non_member(group):
        return False
    key = (where, group if isinstance(group, ProcessGroup) else None)
    if key not in _warned_outside:
        _warned_outside.add(key)
        world = _world.default
        rank = -1 if world is None else world.rank()
        warnings.warn(f"Running {where} on global rank {rank} which does not belong to the "
                      "given group.", stacklevel=3)
    return True


def resolve(group: ProcessGroup | None, where: str) -> ProcessGroup:
    """`group`, or the default group for None.

    Raises:
        ValueError: `group` is GroupMember.NON_GROUP_MEMBER (this rank is not in it).
        TypeError: `group` is not a ProcessGroup.
    """
    if group is None:
        return default_group(where)
    if not isinstance(group, ProcessGroup):
        if _is_sentinel(group):
            world = default_group(where)
            raise ValueError(
                f"{where}: this process (global rank {world.rank()}) is not a member of the "
                "group: new_group returned GroupMember.NON_GROUP_MEMBER to it, since its "
                "rank is not in the group's ranks; only members may use the group")
        raise TypeError(
            f"{where}: group must be a ProcessGroup from new_group() or None, got "
            f"{type(group).__name__}")
    default_group(where)
    return group


def _check_ranks(ranks: Iterable[int] | None, world_size: int,
                 sort: bool = True) -> list[int]:
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
                f"(ranks go from 0 to {world_size - 1})")
    if len(set(values)) != len(values):
        raise ValueError(f"new_group: ranks {values} name a rank twice")
    if not values:
        raise ValueError("new_group: ranks must name at least one rank")
    return sorted(values) if sort else values


def new_group(ranks: Iterable[int] | None = None, timeout: float | timedelta | None = None,
              backend: str | None = None, pg_options: Any = None,
              use_local_synchronization: bool = False,
              group_desc: str | None = None, device_id: Any = None,
              sort_ranks: bool = True) -> ProcessGroup | int:
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
    with _world.lock:
        world = default_group("new_group")
        members = _check_ranks(ranks, world.size(), sort=sort_ranks)
        seconds = (world.timeout.total_seconds() if timeout is None
                   else _resolve_timeout(timeout))
        spec = _world.spec if backend is None else parse_backend(backend)
        me = world.rank()
        group_rank = members.index(me) if me in members else -1
        if use_local_synchronization:
            if group_rank < 0:  # only members call it: a non-member that does gets nothing
                return GroupMember.NON_GROUP_MEMBER
            group_id = _local_group_id(members)  # agreed by the members alone
        else:
            group_id = str(_world.next_id)  # agreed by every rank calling in the same order
            _world.next_id += 1
        name = group_desc or group_id
        if not use_local_synchronization:
            _every_rank_is_there(world, members, name)
        group = _make_group(members, me, group_id, name, spec, seconds)
        _world.groups[f"{group_id}:{name}"] = group
        return group if group_rank >= 0 else GroupMember.NON_GROUP_MEMBER


def _make_group(members: list[int], me: int, group_id: str, name: str, spec: dict[str, str],
                seconds: float, process_ranks: list[int] | None = None) -> ProcessGroup:
    """A group of the world ranks `members` as seen from world rank `me`, with backends
    connected (members only) under the store prefix distcomm/<group_id>. `process_ranks`:
    each world rank's rank at the job's start (default: the world's)."""
    process_ranks = _world.process_ranks if process_ranks is None else process_ranks
    group_rank = members.index(me) if me in members else -1
    backends: dict[str, Backend] = {}
    if group_rank >= 0:
        backends = create_backends(spec, PrefixStore(f"distcomm/{group_id}", _world.store),
                                    group_rank, len(members), seconds, name,
                                    [process_ranks[m] for m in members], _world.store)
    log.info("group %r: ranks %s, this rank %s", name, members,
             group_rank if group_rank >= 0 else "not a member")
    return ProcessGroup(name, members, group_rank, backends, spec_text(spec), seconds, me,
                        store_key=group_id)


def _local_group_id(members: list[int]) -> str:
    """The id of a group made with use_local_synchronization: from its ranks (in order)
    and how many such groups of these ranks this process made before, which its members
    agree on without the other ranks (torch hashes the ranks alone, so the same ranks
    twice collide); it leaves the numbering of the other groups alone."""
    digest = hashlib.sha1(",".join(map(str, members)).encode()).hexdigest()[:16]
    count = _world.local_ids.get(digest, 0)
    _world.local_ids[digest] = count + 1
    return f"local-{digest}-{count}"


def _every_rank_is_there(world: ProcessGroup, members: list[int], name: str) -> None:
    """A barrier of the default group's CPU backend, which every rank's `new_group` call
    reaches: a rank that died before it fails the call at once (its connections closed),
    naming it, where the new group's connection setup would wait for it up to the timeout.

    Raises:
        DistError: the default group failed or timed out; the message names the rank.
    """
    backend = world._backends.get("cpu")
    if backend is None or world.size() == 1:
        return
    entry = world._trace.record("new_group", NO_ARRAY)  # the stall inspector watches it too
    try:
        backend.barrier(async_op=True).wait()
        world._trace.settle(entry)
    except DistError as exc:
        world._trace.settle(entry, exc)
        try:
            error = type(exc)(
                f"new_group {name!r} (ranks {members}): a rank of the default group failed "
                f"before every rank called new_group, so the group cannot be created (see "
                f"that rank's output for why it stopped): {exc}")
        except Exception:  # an error type with a constructor of its own: keep it as it is
            raise exc from None
        raise error from exc


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroy `group`, or every group and the default one when None.

    Afterwards no thread, socket or listening port of the destroyed groups is left.

    Raises:
        RuntimeError: distcomm is not initialised.
    """
    with _world.lock:
        default = default_group("destroy_process_group")
        if _is_sentinel(group):
            return  # a group this rank is not in: nothing of it lives here
        if group is not None and group is not default:
            log.info("destroying group %r", group.group_name)
            group._shutdown()
            for key, value in list(_world.groups.items()):
                if value is group:
                    del _world.groups[key]
            return
        log.info("destroying every group")
        errors: list[Exception] = []
        try:
            stall.stop()
            for value in [*(g for g in _world.groups.values() if g is not default), default]:
                try:
                    value._shutdown()
                except Exception as exc:  # a backend's shutdown failed: finish the rest
                    log.warning("destroy_process_group: group %r did not shut down cleanly: "
                                "%s", value.group_name, exc)
                    errors.append(exc)
        finally:  # the store and the module state go whatever happened above
            try:
                if _world.owns_store and _world.store is not None:
                    _world.store.close()
            finally:
                _world.default, _world.store, _world.owns_store = None, None, False
                _world.groups = {}
                _world.spec = {}
                _world.process_ranks = []
        if errors:
            raise errors[0]


#: torch's default_pg_timeout: the default timeout of a group's operations
default_pg_timeout = timedelta(seconds=config.DEFAULT_TIMEOUT)
