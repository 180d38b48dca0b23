"""The flight recorder of each group's last operations and its analyzer.

`recorder` keeps the rings and writes the per-rank dumps; `analyze` lines the dumps of
a run up (`python -m distcomm.trace DIR`).
"""

from __future__ import annotations

from .recorder import dump_trace, record_comm

__all__ = ["dump_trace", "record_comm"]
