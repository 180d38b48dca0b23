"""Backends: the plug-in base class, its options, and the registry of named backends.

`Backend` (base.py) is the class a backend subclasses; the registry (registry.py) maps
names to lazy factories: the built-ins `tcp`, `gloo`, `mpi` and `nccl`, `register_backend`
for third-party ones, and the `distcomm.backends` entry-point group. The CPU engine behind
tcp and gloo lives in `engine/`. (torch's backend-name type, `distcomm.Backend`, is
another class: see names.py.)
"""

from .base import Backend, BackendOptions
from .registry import (
    BackendRecord,
    create_backend,
    get_backend_record,
    register_backend,
    registered_backends,
)

__all__ = [
    "Backend",
    "BackendOptions",
    "BackendRecord",
    "create_backend",
    "get_backend_record",
    "register_backend",
    "registered_backends",
]
