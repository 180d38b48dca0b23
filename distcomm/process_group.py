"""`ProcessGroup`: a group's state (`handle.GroupHandle`) with torch's method API
(`group_methods.GroupMethods`) mixed in.

The class sits above the function layer because its methods call the public functions
(`pg.allreduce([x], opts)` runs `all_reduce(x, op, pg, async_op=True)`), while those
functions need only the state below them; `lifecycle` makes the instances.
"""

from __future__ import annotations

from typing import NewType

from .group_methods import GroupMethods
from .handle import GroupHandle

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
