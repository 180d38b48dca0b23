"""The ``file_system`` sharing strategy's shared-memory manager: daemon, client, protocol.

A named segment (``/dev/shm/distcomm_*``) outlives a process that crashes before unlinking
it, so each process tree gets one manager daemon that counts references and unlinks what
nobody holds. The family:

- `protocol`: the line protocol, limits and name checks both sides share;
- `table`: the daemon's reference table (no I/O);
- `manager`: the daemon (its event loop and command line), run as
  ``python -m distcomm.multiprocessing.shm_manager`` (that module is the public path);
- `channel`: one client connection to the daemon (line I/O under a deadline);
- `client`: `ManagerClient`, what a process uses, and `start_manager`.

Names are imported from their module on first use: `import distcomm.multiprocessing`
needs only the protocol's, and the client and the daemon load when the ``file_system``
strategy is first used (as `segments` imports them).
"""

from __future__ import annotations

from importlib import import_module

__all__ = [
    "ADDRESS_ENV",
    "NAME_PREFIX",
    "ManagerClient",
    "SegmentTable",
    "ShmManager",
    "StartedManager",
    "start_manager",
]

_HOMES = {
    "ADDRESS_ENV": "protocol",
    "NAME_PREFIX": "protocol",
    "ManagerClient": "client",
    "SegmentTable": "table",
    "ShmManager": "manager",
    "StartedManager": "client",
    "start_manager": "client",
}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{home}", __name__), name)
