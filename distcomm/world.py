"""The world state: the default group and every group made since, and the lookups every
operation starts with (`resolve`, `outside`).

`state` is the one piece of module state distcomm has (CONVENTIONS, "State and time"),
set by `init_process_group` and cleared by `destroy_process_group` (`lifecycle`). It
sits below the function layer, which reads it through `default_group`, `resolve` and
`outside`; only the lifecycle and `regroup` change it, under `state.lock`.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .handle import GroupHandle
from .store import Store

if TYPE_CHECKING:  # the full class, above the function layer: for annotations only
    from .process_group import ProcessGroup

__all__ = [
    "GroupMember",
    "World",
    "default_group",
    "is_available",
    "is_initialized",
    "is_non_member",
    "is_sentinel",
    "outside",
    "resolve",
    "state",
]


@dataclass
class World:
    """The default group and every group created since (the documented module state)."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    default: GroupHandle | None = None
    store: Store | None = None
    owns_store: bool = False
    groups: dict[str, GroupHandle] = field(default_factory=dict)
    next_id: int = 1
    #: heads the ids of groups made since the world was last re-formed (`reconfigure`)
    id_prefix: str = ""
    #: groups made with use_local_synchronization, per hash of their ranks
    local_ids: dict[str, int] = field(default_factory=dict)
    spec: dict[str, str] = field(default_factory=dict)
    #: each world rank's rank when the job started (they differ once shrink_group has
    #: shrunk the default group); backends that address processes (mpi) get these
    process_ranks: list[int] = field(default_factory=list)
    #: this process's process rank where it is not its world rank at the job's start (a
    #: process that joined a running job, or one whose world was re-formed)
    process_rank: int | None = None
    #: the world's epoch: 0 at the job's start, one more at each re-forming (membership)
    epoch: int = 0
    #: whether this process came into the world by joining it (`membership.join`: a
    #: newcomer, or a member that came too late to a re-forming) rather than at the job's
    #: start; its process rank cannot tell, since re-forming an mpi world renumbers them
    joined: bool = False
    #: the `timeout=` (seconds) of the last operation this process called with one, which
    #: the recovery Manager's own collectives take by default; None until one is called
    last_op_timeout: float | None = None

    def every_group(self) -> tuple[GroupHandle | None, list[GroupHandle]]:
        """(the default group or None, every group): what the flight recorder dumps."""
        return self.default, list(self.groups.values())


#: the world of this process
state = World()


class _GroupMemberType(type):
    @property
    def WORLD(cls) -> GroupHandle | None:
        return state.default


class GroupMember(metaclass=_GroupMemberType):
    """torch's sentinels: `GroupMember.WORLD` is the default group (None before init)."""

    NON_GROUP_MEMBER = -100


def is_available() -> bool:
    """Whether distcomm can be used here (always True)."""
    return True


def is_initialized() -> bool:
    """Whether `init_process_group` has been called (and not undone)."""
    return state.default is not None


def default_group(where: str) -> ProcessGroup:
    """The default group.

    Raises:
        RuntimeError: `init_process_group` has not been called.
    """
    group = state.default
    if group is None:
        raise RuntimeError(
            f"{where}: distcomm is not initialised; call distcomm.init_process_group() first"
        )
    return group  # type: ignore[return-value]  (every group made is a ProcessGroup)


def is_sentinel(group: Any) -> bool:
    """Whether `group` is GroupMember.NON_GROUP_MEMBER (what new_group gives a non-member)."""
    return type(group) is int and group == GroupMember.NON_GROUP_MEMBER


def is_non_member(group: Any) -> bool:
    """Whether this rank is outside `group`: the sentinel, or a handle with rank -1."""
    return is_sentinel(group) or (isinstance(group, GroupHandle) and not group.is_member)


_warned_outside: set[tuple[str, Any]] = set()


def outside(group: Any, where: str) -> bool:
    """Whether this rank is not in `group`, so that operation `where` on it does nothing
    (as in torch: it returns None and leaves the arrays alone); warns the first time for
    each operation and group."""
    if group is None or not is_non_member(group):
        return False
    key = (where, group if isinstance(group, GroupHandle) else None)
    if key not in _warned_outside:
        _warned_outside.add(key)
        world = state.default
        rank = -1 if world is None else world.rank()
        warnings.warn(
            f"Running {where} on global rank {rank} which does not belong to the given group.",
            stacklevel=3,
        )
    return True


def resolve(group: ProcessGroup | None, where: str) -> ProcessGroup:
    """`group`, or the default group for None.

    Raises:
        ValueError: `group` is GroupMember.NON_GROUP_MEMBER (this rank is not in it).
        TypeError: `group` is not a ProcessGroup.
        RuntimeError: `init_process_group` has not been called.
    """
    if group is None:
        return default_group(where)
    if not isinstance(group, GroupHandle):
        if is_sentinel(group):
            world = default_group(where)
            raise ValueError(
                f"{where}: this process (global rank {world.rank()}) is not a member of the "
                "group: new_group returned GroupMember.NON_GROUP_MEMBER to it, since its "
                "rank is not in the group's ranks; only members may use the group"
            )
        raise TypeError(
            f"{where}: group must be a ProcessGroup from new_group() or None, got "
            f"{type(group).__name__}"
        )
    default_group(where)
    return group
