"""`python -m distcomm.multiprocessing.shm_manager ADDRESS`: the shared-memory manager daemon.

The ``file_system`` sharing strategy's daemon (torch's ``torch_shm_manager``), started on
first use by `shm.client.start_manager`. This public module keeps the documented path and
command; the daemon itself lives in `shm.manager` (reference counting in `shm.table`, the
line protocol in `shm.protocol`), whose docstring describes what it does and how long it
lives.
"""

from __future__ import annotations

import sys

from .shm.manager import SegmentTable, ShmManager, main

__all__ = ["SegmentTable", "ShmManager", "main"]

if __name__ == "__main__":
    sys.exit(main())
