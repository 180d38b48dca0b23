"""A drop-in for the stdlib `multiprocessing` whose numpy arrays travel as shared memory.

``import distcomm.multiprocessing as multiprocessing`` gives every name of the stdlib
module (contexts, Process, Queue, Pipe, Pool, ...) with distcomm's reducers registered on
its ForkingPickler, as torch.multiprocessing does for tensors: an array sent through a
queue, a pipe or a process's arguments arrives as a view of the same shared pages
(plain arrays are copied into shared memory once by the sender). Also here:
`share_memory`, `is_shared`, `empty`, `zeros`, the sharing strategies
(`file_descriptor`, the default, and `file_system`) and torch's `spawn` /
`start_processes`.
"""

from __future__ import annotations

import multiprocessing as _stdlib
from multiprocessing import *  # noqa: F403 - the drop-in re-exports the whole stdlib module

from .reductions import init_reductions
from .sharing import (
    empty,
    get_all_sharing_strategies,
    get_sharing_strategy,
    is_shared,
    set_sharing_strategy,
    share_memory,
    zeros,
)
from .spawn import (
    ProcessContext,
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    spawn,
    start_processes,
)

__all__ = [
    *_stdlib.__all__,
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "empty",
    "get_all_sharing_strategies",
    "get_sharing_strategy",
    "init_reductions",
    "is_shared",
    "set_sharing_strategy",
    "share_memory",
    "spawn",
    "start_processes",
    "zeros",
]

init_reductions()
