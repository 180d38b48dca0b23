"""Groups made from a group: torch's split_group and shrink_group.

`split_group` cuts a group into disjoint subgroups in one call by all its ranks;
`shrink_group` makes a group of the ranks that remain after some failed, called by the
survivors alone (fault tolerance: a rank that died does not have to take part).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from .backends.spec import parse_backend
from .errors import GroupDestroyedError
from .lifecycle import make_group, resolve_timeout
from .process_group import ProcessGroup
from .world import default_group, is_sentinel, state

__all__ = ["SHRINK_ABORT", "SHRINK_DEFAULT", "shrink_group", "split_group"]

log = logging.getLogger("distcomm.group")

#: shrink_group: make the new group and leave the old one's operations as they are
SHRINK_DEFAULT = 0
#: shrink_group: first abort the old group's operations (those waiting for a dead rank fail)
SHRINK_ABORT = 1


def _parent(group: ProcessGroup | None, where: str) -> ProcessGroup:
    world = default_group(where)
    parent = world if group is None else group
    if is_sentinel(parent) or not isinstance(parent, ProcessGroup) or not parent.is_member:
        raise ValueError(
            f"{where}: this process (global rank {world.rank()}) is not a member "
            f"of the group {parent!r}; only its members call {where}"
        )
    if not parent.backends():
        raise GroupDestroyedError(f"{where}: group '{parent.group_name}' was destroyed")
    return parent


def _group_ranks(value: Any, size: int, where: str, name: str) -> list[int]:
    """`value` as a list of distinct group ranks of a group of `size`."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{where}: {name} must be a list of group ranks, got {value!r}")
    ranks = list(value)
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"{where}: {name} holds {rank!r}; group ranks are ints")
        if not 0 <= rank < size:
            raise ValueError(
                f"{where}: rank {rank} in {name} is out of range for a group of "
                f"{size} (group ranks 0..{size - 1}, not global ranks)"
            )
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{where}: {name} {ranks} names a rank twice")
    return ranks


def split_group(
    parent_pg: ProcessGroup | None = None,
    split_ranks: list | None = None,
    timeout: float | timedelta | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
    backend: str | None = None,
) -> ProcessGroup | None:
    """Split `parent_pg` (default: the world) into disjoint groups (torch.distributed.split_group).

    Every rank of the parent calls it, with the same `split_ranks`, in the same order
    relative to other split_group calls on the parent. Unlike torch's (nccl only, and only
    with a device bound to the default group), it works on every backend; an nccl group
    gets a communicator of its own, made like any group's (CuPy 14 binds ncclCommSplit as
    `commSplit`, CuPy 13 does not; a split through it is collective over the parent).

    Args:
        parent_pg: the group to split (default: the default group).
        split_ranks: lists of the parent's group ranks (not global ranks), one per new
            group, disjoint; ranks in none of them get None.
        timeout: the new group's timeout (default: the parent's).
        pg_options: accepted for torch compatibility.
        group_desc: the new group's name in messages (default: "<parent>:split:<n>").
        backend: keep only some of the parent's per-device backends ("cpu:gloo"); each
            must be the parent's for that device (default: all of them).

    Returns:
        This rank's new group, or None when it is in no list (as torch).

    Raises:
        ValueError: this rank is not in the parent; `split_ranks` is empty, has an empty,
            out-of-range, repeated or overlapping list; `backend` is not a part of the
            parent's.
        TypeError: `split_ranks` is not a list of lists of ints.
    """
    del pg_options
    where = "split_group"
    with state.lock:
        parent = _parent(parent_pg, where)
        if not split_ranks:
            raise ValueError(
                f"{where}: split_ranks must list the new groups' ranks, e.g. "
                f"[[0, 1], [2, 3]]; got {split_ranks!r}"
            )
        splits = [
            sorted(_group_ranks(ranks, parent.size(), where, f"split_ranks[{i}]"))
            for i, ranks in enumerate(_group_ranks_lists(split_ranks, where))
        ]
        seen: dict[int, int] = {}
        for i, ranks in enumerate(splits):
            if not ranks:
                raise ValueError(f"{where}: split_ranks[{i}] is empty; each new group needs a rank")
            for rank in ranks:
                if rank in seen:
                    raise ValueError(
                        f"{where}: rank {rank} is in split_ranks[{seen[rank]}] "
                        f"and split_ranks[{i}]; the new groups must not overlap"
                    )
                seen[rank] = i
        spec = parse_backend(parent.name())
        if backend is not None:
            spec = _kept_backends(spec, parse_backend(backend), parent, where)
        seconds = parent.timeout.total_seconds() if timeout is None else resolve_timeout(timeout)
        count = parent.next_split()  # every parent rank counts the call, in or out of a split
        index = seen.get(parent.rank())
        if index is None:
            return None
        members = [parent.ranks[r] for r in splits[index]]
        group_id = f"{parent.store_key}.split{count}.{index}"
        name = group_desc or f"{parent.group_name}:split:{count}"
        group = make_group(members, default_group(where).rank(), group_id, name, spec, seconds)
        state.groups[f"{group_id}:{name}"] = group
        return group


def _group_ranks_lists(value: Any, where: str) -> list[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"{where}: split_ranks must be a list of lists of group ranks, got {value!r}"
        )
    return list(value)


def _kept_backends(
    parent: dict[str, str], wanted: dict[str, str], group: ProcessGroup, where: str
) -> dict[str, str]:
    for device, name in wanted.items():
        if parent.get(device) != name:
            raise ValueError(
                f"{where}: backend {name!r} for {device} arrays is not the parent's (group "
                f"'{group.group_name}' uses {group.name()!r}); choose among the parent's "
                "backends"
            )
    return wanted


def shrink_group(
    ranks_to_exclude: list[int],
    group: ProcessGroup | None = None,
    shrink_flags: int = SHRINK_DEFAULT,
    pg_options: Any = None,
) -> ProcessGroup:
    """A group of `group`'s ranks without `ranks_to_exclude` (torch.distributed.shrink_group).

    Only the remaining ranks call it (the excluded ones may be dead), each once per shrink,
    in the same order relative to other split_group/shrink_group calls on `group`. The old
    group is destroyed. Shrinking the default group makes the new group the default one:
    the remaining ranks are numbered again from 0 in their old order (`get_rank()` and
    `get_world_size()` change), and every other group is destroyed, since its ranks no
    longer mean the same processes.

    A TCPStore hosted by an excluded rank's process is gone with it: a job that must
    survive rank 0 keeps its store elsewhere (distcomm-run's agent store, an etcd or file
    store). Under the mpi backend the excluded ranks must still be alive (MPI ends the job
    when a process dies).

    Args:
        ranks_to_exclude: group ranks of `group` to leave out.
        group: the group to shrink (default: the default group).
        shrink_flags: SHRINK_DEFAULT, or SHRINK_ABORT to first abort the old group's
            operations (those waiting for an excluded rank then fail at once).
        pg_options: accepted for torch compatibility.

    Raises:
        TypeError: `ranks_to_exclude` is not a list of ints.
        ValueError: it is empty, out of range, repeated or names every rank; the group
            has one rank; `shrink_flags` is not one of the two.
        RuntimeError: this rank is one of those excluded.
    """
    del pg_options
    where = "shrink_group"
    if not isinstance(ranks_to_exclude, list):
        raise TypeError(
            f"{where}: ranks_to_exclude must be a list of group ranks, e.g. "
            f"[3], got {ranks_to_exclude!r}"
        )
    if not ranks_to_exclude:
        raise ValueError(
            f"{where}: ranks_to_exclude is empty; name the ranks to leave out, e.g. [failed_rank]"
        )
    if isinstance(shrink_flags, bool) or shrink_flags not in (SHRINK_DEFAULT, SHRINK_ABORT):
        raise ValueError(
            f"{where}: shrink_flags must be SHRINK_DEFAULT ({SHRINK_DEFAULT}) or "
            f"SHRINK_ABORT ({SHRINK_ABORT}), got {shrink_flags!r}"
        )
    with state.lock:
        old = _parent(group, where)
        if old.size() < 2:
            raise ValueError(
                f"{where}: group '{old.group_name}' has {old.size()} rank; "
                "there is nothing to shrink"
            )
        excluded = set(_group_ranks(ranks_to_exclude, old.size(), where, "ranks_to_exclude"))
        if len(excluded) == old.size():
            raise ValueError(
                f"{where}: ranks_to_exclude names all {old.size()} ranks of "
                f"group '{old.group_name}'; at least one must remain"
            )
        if old.rank() in excluded:
            raise RuntimeError(
                f"{where}: this rank (group rank {old.rank()}) is in ranks_to_exclude "
                f"{sorted(excluded)}; only the remaining ranks call shrink_group, and the "
                "excluded ones should stop"
            )
        if shrink_flags == SHRINK_ABORT:
            for backend in old.backends().values():
                backend.abort(
                    f"aborted by shrink_group(SHRINK_ABORT) excluding group ranks "
                    f"{sorted(excluded)}"
                )
        count = old.next_split()
        kept = [old.ranks[r] for r in range(old.size()) if r not in excluded]
        group_id = f"{old.store_key}.shrink{count}"
        name = f"{old.group_name}:shrink:{count}"
        spec = parse_backend(old.name())
        seconds = old.timeout.total_seconds()
        if old is not state.default:
            new = make_group(kept, old.global_rank, group_id, name, spec, seconds)
            _drop(old)
            state.groups[f"{group_id}:{name}"] = new
            return new
        # the default group: the world is numbered again, 0..len(kept)-1
        process_ranks = [state.process_ranks[g] for g in kept]
        new = make_group(
            list(range(len(kept))),
            kept.index(old.rank()),
            group_id,
            name,
            spec,
            seconds,
            process_ranks=process_ranks,
        )
        for other in list(state.groups.values()):
            _drop(other)
        state.default, state.groups = new, {name: new}
        state.process_ranks = process_ranks
        log.info(
            "shrink_group: the default group is now ranks %s of the job's start (this "
            "process: rank %d of %d)",
            process_ranks,
            new.rank(),
            new.size(),
        )
        return new


def _drop(group: ProcessGroup) -> None:
    """Shut `group` down and forget it (its peers may be dead: nothing waits for them)."""
    try:
        group.shutdown()
    except Exception as exc:  # a broken group's teardown must not stop the shrink
        log.warning("shrink_group: shutting down group %r failed: %s", group.group_name, exc)
    for key, value in list(state.groups.items()):
        if value is group:
            del state.groups[key]
