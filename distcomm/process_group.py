"""`ProcessGroup`: a group's state (`handle.GroupHandle`) with torch's method API
(`group_methods.GroupMethods`) mixed in.

The class sits above the function layer because its methods call the public functions
(`pg.allreduce([x], opts)` runs `all_reduce(x, op, pg, async_op=True)`), while those
functions need only the state below them; `lifecycle` makes the instances.
"""

from __future__ import annotations

from datetime import timedelta
from typing import NewType

from . import reconfigure
from .group_methods import GroupMethods
from .handle import GroupHandle
from .work import Work

__all__ = ["GroupName", "ProcessGroup"]

#: a process group's name, `group.group_name` (torch's NewType of str)
GroupName = NewType("GroupName", str)


class ProcessGroup(GroupHandle, GroupMethods):
    """A set of ranks that run collectives together (torch.distributed.ProcessGroup).

    Obtained from `init_process_group` (the default group, `group.WORLD`) or
    `new_group` (which gives ranks outside the group `GroupMember.NON_GROUP_MEMBER`
    instead, as torch does). Its collectives are also methods, as torch's C++ layer has
    them (`pg.allreduce([x], AllreduceOptions())`; see `distcomm.group_methods`); its
    state and backend choice are `distcomm.handle.GroupHandle`'s.
    """

    # -- re-forming (torchcomms' shape) ------------------------------------------------------

    def get_init_handle(self) -> str:
        """This process's init handle: what the other processes of a re-formed group pass
        to `reconfigure` to name it (the same string every time it is asked)."""
        return reconfigure.init_handle(self)

    def reconfigure(
        self, uuid: str, init_handles: list[str], timeout: float | timedelta | None = None
    ) -> Work:
        """Re-form this group, the default one, in place, as the processes of
        `init_handles` (their `get_init_handle()`, in the new rank order); every one of
        them calls it with the same `uuid` and list, and old members left out do not. The
        world is renumbered and the other groups are dropped. Returns a completed Work once
        connected. See `distcomm.reconfigure.reconfigure` for the errors."""
        return reconfigure.reconfigure(self, uuid, init_handles, timeout)
