"""Many groups at once: torch's new_subgroups and new_subgroups_by_enumeration.

Both are collective over the default group, as `new_group` is: every rank calls them
with the same arguments, and each subgroup is made by one `new_group` call, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from .lifecycle import new_group
from .process_group import ProcessGroup
from .queries import get_process_group_ranks, get_rank, get_world_size

__all__ = ["new_subgroups", "new_subgroups_by_enumeration"]


def new_subgroups(
    group_size: int | None = None,
    group: ProcessGroup | None = None,
    timeout: float | timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup | int, list[ProcessGroup | int]]:
    """Split `group` (default: the world) into subgroups of `group_size` consecutive ranks
    (torch.distributed.new_subgroups), e.g. one per node.

    Args:
        group_size: ranks per subgroup; must divide the group's size (default: the number
            of GPUs CuPy sees, one subgroup per node of one rank per GPU).
        group, timeout, backend, pg_options, group_desc: as for `new_group`.

    Returns:
        (this rank's subgroup, every subgroup in order); the subgroups this rank is not in
        are `GroupMember.NON_GROUP_MEMBER`, as `new_group` gives them.

    Raises:
        ValueError: `group_size` is not positive, exceeds the group's size or does not
            divide it; or it is left out where no GPU is visible.
    """
    if group_size is None:
        from .gpu import runtime

        if not runtime.is_available():
            raise ValueError(
                "new_subgroups: group_size defaults to the number of GPUs on a node, and "
                "none is visible here (CuPy and a GPU are needed): pass group_size, e.g. "
                "new_subgroups(group_size=int(os.environ['LOCAL_WORLD_SIZE']))"
            )
        group_size = runtime.device_count()
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"new_subgroups: group_size must be a positive int, got {group_size!r}")
    world_size = get_world_size(group)
    if group_size > world_size:
        raise ValueError(
            f"new_subgroups: group_size ({group_size}) must not exceed the group's size "
            f"({world_size})"
        )
    if world_size % group_size:
        raise ValueError(
            f"new_subgroups: the group's size ({world_size}) must be divisible by group_size "
            f"({group_size}); use new_subgroups_by_enumeration for subgroups of other sizes"
        )
    ranks = get_process_group_ranks(group)
    return new_subgroups_by_enumeration(
        [ranks[i : i + group_size] for i in range(0, world_size, group_size)],
        timeout=timeout,
        backend=backend,
        pg_options=pg_options,
        group_desc=group_desc,
    )


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: float | timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup | int | None, list[ProcessGroup | int]]:
    """One subgroup per list of global ranks (torch.distributed.new_subgroups_by_enumeration).

    The lists must not share a rank; every rank checks that before any group is made
    (torch makes the groups first, so a bad list fails half-way).

    Returns:
        (this rank's subgroup, or None when no list names it; every subgroup in order);
        the subgroups this rank is not in are `GroupMember.NON_GROUP_MEMBER`.

    Raises:
        ValueError: the list is empty, or a rank appears in two lists.
    """
    if not ranks_per_subgroup_list:
        raise ValueError(
            "new_subgroups_by_enumeration: ranks_per_subgroup_list must name at least one "
            "subgroup, e.g. [[0, 2], [1, 3]]"
        )
    owner: dict[int, list[int]] = {}
    for ranks in ranks_per_subgroup_list:
        for rank in ranks:
            if rank in owner:
                raise ValueError(
                    f"new_subgroups_by_enumeration: rank {rank} appears in both subgroup "
                    f"{owner[rank]} and {list(ranks)}; each rank belongs to one subgroup"
                )
            owner[rank] = list(ranks)
    me = get_rank()
    current: ProcessGroup | int | None = None
    subgroups: list[ProcessGroup | int] = []
    for ranks in ranks_per_subgroup_list:
        subgroup = new_group(
            ranks=ranks,
            timeout=timeout,
            backend=backend,
            pg_options=pg_options,
            group_desc=group_desc,
        )
        subgroups.append(subgroup)
        if me in ranks:
            current = subgroup
    return current, subgroups
