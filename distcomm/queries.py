"""Questions about process groups: ranks, sizes, backends, membership (torch's queries).

Each takes a group (None: the default group) and answers from the group itself or the
world state (`distcomm.world`).
"""

from __future__ import annotations

from .backends import get_backend_record
from .process_group import ProcessGroup
from .world import default_group, is_non_member, resolve, state

__all__ = [
    "get_backend",
    "get_backend_config",
    "get_global_rank",
    "get_group_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
]


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in `group` (default: the world); -1 if not a member."""
    if group is not None and is_non_member(group):
        default_group("get_rank")
        return -1
    return resolve(group, "get_rank").rank()


def get_world_size(group: ProcessGroup | None = None) -> int:
    """The number of ranks in `group` (default: the world); -1 if this rank is not a member."""
    if group is not None and is_non_member(group):
        default_group("get_world_size")
        return -1
    return resolve(group, "get_world_size").size()


def get_backend(group: ProcessGroup | None = None) -> str:
    """The backend of `group` (default: the world), e.g. "tcp"."""
    return resolve(group, "get_backend").name()


def get_backend_config(group: ProcessGroup | None = None) -> str:
    """The backend of each device of `group` (default: the world), as torch writes it:
    "cpu:gloo" or "cpu:gloo,cuda:nccl"."""
    text = resolve(group, "get_backend_config").name()
    if ":" in text:
        return text
    return ",".join(f"{device}:{text}" for device in get_backend_record(text).devices)


def get_pg_count() -> int:
    """How many process groups were created since `init_process_group`, the default group
    included (0 when not initialised)."""
    return state.next_id if state.default is not None else 0


def get_process_group_ranks(group: ProcessGroup | None = None) -> list[int]:
    """The global ranks of `group`'s members, in group-rank order."""
    return list(resolve(group, "get_process_group_ranks").ranks)


def get_global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """The global rank of `group`'s member number `group_rank`.

    Raises:
        ValueError: `group_rank` is not a rank of the group.
    """
    resolved = resolve(group, "get_global_rank")
    if (
        isinstance(group_rank, bool)
        or not isinstance(group_rank, int)
        or not (0 <= group_rank < resolved.size())
    ):
        raise ValueError(
            f"get_global_rank: group rank {group_rank!r} is not in group "
            f"'{resolved.group_name}' of size {resolved.size()}"
        )
    return resolved.ranks[group_rank]


def get_group_rank(group: ProcessGroup | None, global_rank: int) -> int:
    """The rank within `group` of the process with global rank `global_rank`.

    Raises:
        ValueError: that process is not a member of the group.
    """
    resolved = resolve(group, "get_group_rank")
    if global_rank not in resolved.ranks:
        raise ValueError(
            f"get_group_rank: global rank {global_rank!r} is not a member of group "
            f"'{resolved.group_name}' (members: {resolved.ranks})"
        )
    return resolved.ranks.index(global_rank)
