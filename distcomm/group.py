"""torch's `dist.group` namespace and the names of the group layer in one place.

`distcomm.group.WORLD` is the default group (torch's `dist.group.WORLD`); the other
names are re-exported from the modules that hold them, in import order (each imports
only those above it in this list):

- `handle`: `GroupHandle`, a group's ranks, backends and flight recorder;
- `world`: the world state (the default group and the registry of groups), `GroupMember`,
  and the lookups every operation starts with (`resolve`, `outside`);
- `collectives`, `p2p`, `coalesced`: the public functions, on a `GroupHandle`;
- `group_methods`: torch's method API, which calls those functions;
- `process_group`: `ProcessGroup`, the handle with the method API;
- `lifecycle`: init_process_group, new_group, destroy_process_group.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from . import config
from .backends.spec import (
    get_default_backend_for_device,
    is_backend_available,
    is_gloo_available,
    is_mpi_available,
    is_nccl_available,
    is_ucc_available,
    is_xccl_available,
)
from .lifecycle import destroy_process_group, init_process_group, new_group
from .process_group import GroupName, ProcessGroup
from .world import GroupMember, is_available, is_initialized, state

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


def __getattr__(name: str) -> Any:
    if name == "WORLD":
        return state.default
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: torch's default_pg_timeout: the default timeout of a group's operations
default_pg_timeout = timedelta(seconds=config.DEFAULT_TIMEOUT)
