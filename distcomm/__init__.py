"""distcomm: torch.distributed's model for numpy and CuPy arrays (public API, re-exported).

The public modules are listed on the API page (docs/api.md, "Public modules", kept in step
by tests/test_public_modules.py); every other module of the package is internal.

The names below are imported on first use (PEP 562), not at `import distcomm`: a process
that only needs a store or the launcher (`distcomm-run`'s agent) does not pay for numpy and
the collectives, and a worker pays for them once, when it first touches them.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._version import __version__ as __version__

#: where each public name lives: module (relative to this package) -> names
_EXPORTS: dict[str, tuple[str, ...]] = {
    ".backends.names": ("Backend", "BackendConfig"),
    ".bootstrap.urls": ("register_rendezvous_handler",),
    ".coalesced": ("all_gather_coalesced", "all_reduce_coalesced"),
    ".collectives": (
        "P2POp",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "all_reduce",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "batch_isend_irecv",
        "broadcast",
        "gather",
        "irecv",
        "isend",
        "monitored_barrier",
        "recv",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "scatter",
        "send",
    ),
    ".debug": (
        "DebugLevel",
        "breakpoint",
        "get_debug_level",
        "set_debug_level",
        "set_debug_level_from_env",
    ),
    ".errors": (
        "BackendUnavailableError",
        "DistBackendError",
        "DistError",
        "DistNetworkError",
        "DistStoreError",
        "DistStoreTimeoutError",
        "DistTimeoutError",
        "GroupDestroyedError",
        "QueueEmptyError",
    ),
    ".group": (
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
    ),
    ".group_methods": (
        "AllreduceCoalescedOptions",
        "AllreduceOptions",
        "AllToAllOptions",
        "BarrierOptions",
        "BroadcastOptions",
        "GatherOptions",
        "ReduceOptions",
        "ReduceScatterOptions",
        "ScatterOptions",
    ),
    ".launched": ("get_node_local_rank", "is_torchelastic_launched"),
    ".objects": (
        "all_gather_object",
        "broadcast_object_list",
        "gather_object",
        "recv_object_list",
        "scatter_object_list",
        "send_object_list",
    ),
    ".ops": ("ReduceOp", "reduce_op", "supports_complex"),
    ".parallel": (
        "fork",
        "get_num_interop_threads",
        "get_num_threads",
        "parallel_info",
        "set_num_interop_threads",
        "set_num_threads",
        "wait",
    ),
    ".queries": (
        "get_backend",
        "get_backend_config",
        "get_global_rank",
        "get_group_rank",
        "get_pg_count",
        "get_process_group_ranks",
        "get_rank",
        "get_world_size",
    ),
    ".regroup": ("shrink_group", "split_group"),
    ".store": ("EtcdStore", "FileStore", "HashStore", "PrefixStore", "Store", "TCPStore"),
    ".subgroups": ("new_subgroups", "new_subgroups_by_enumeration"),
    ".trace": ("dump_trace", "record_comm"),
    ".uneven": ("all_gather_v", "reduce_scatter_v"),
    ".work": ("Work",),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

#: submodules reached as attributes: torch's dist.group namespace, and dist.rendezvous,
#: the module that is also torch's function (it is callable)
_SUBMODULES = ("group", "rendezvous")

__all__ = sorted([*_HOME, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        if name in _SUBMODULES:
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
