"""Debugging as torch.distributed offers it: the debug level (DebugLevel,
get/set_debug_level) and `breakpoint` (pdb on one rank while the others wait).

The level comes from DISTCOMM_DEBUG, or from torch's name for it,
TORCH_DISTRIBUTED_DEBUG (DISTCOMM_DEBUG wins when both are set); `set_debug_level`
overrides both in this process until `set_debug_level_from_env` goes back to them.
What each level logs is described with DISTCOMM_DEBUG on the environment-variables page
(docs/environment.md).
"""

from __future__ import annotations

import enum
import logging
import pdb
import sys
from typing import Any

from . import config

__all__ = [
    "DebugLevel",
    "breakpoint",
    "get_debug_level",
    "set_debug_level",
    "set_debug_level_from_env",
]

log = logging.getLogger(__name__)


class DebugLevel(enum.IntEnum):
    """torch.distributed.DebugLevel: OFF, INFO (group setup, teardown and aborts) or DETAIL
    (also every collective with its sequence number and signature, and the Python stack
    of each in the flight recorder)."""

    OFF = 0
    INFO = 1
    DETAIL = 2


def get_debug_level() -> DebugLevel:
    """The debug level in effect in this process.

    Raises:
        ValueError: DISTCOMM_DEBUG or TORCH_DISTRIBUTED_DEBUG holds an unknown level.
    """
    return DebugLevel[config.load().debug]


def set_debug_level(level: DebugLevel) -> None:
    """Use `level` in this process, over the environment (groups created later keep
    Python stacks in their flight recorder when it is DETAIL).

    Raises:
        ValueError: `level` is not a DebugLevel (or its value 0, 1, 2).
    """
    try:
        chosen = DebugLevel(level)
    except ValueError:
        raise ValueError(
            f"set_debug_level: {level!r} is not a DebugLevel; use DebugLevel.OFF, "
            "DebugLevel.INFO or DebugLevel.DETAIL"
        ) from None
    config.set_debug(chosen.name)


def set_debug_level_from_env() -> None:
    """Go back to the level of DISTCOMM_DEBUG (or TORCH_DISTRIBUTED_DEBUG), read now.

    Raises:
        ValueError: the variable holds an unknown level (the message names it).
    """
    config.set_debug(None)
    config.load()  # report a bad value here, as torch does


_breakpoint_calls: dict[tuple[str, int], int] = {}  # call site -> calls so far, for `skip`


class _Pdb(pdb.Pdb):
    """pdb reading the terminal even where sys.stdin is closed (a spawned child)."""

    def interaction(self, *args: Any, **kwargs: Any) -> None:
        if sys.stdin is not None and not sys.stdin.closed:
            pdb.Pdb.interaction(self, *args, **kwargs)
            return
        saved = sys.stdin
        try:
            with open("/dev/stdin") as sys.stdin:
                pdb.Pdb.interaction(self, *args, **kwargs)
        finally:
            sys.stdin = saved


def breakpoint(rank: int = 0, skip: int = 0, timeout_s: float | None = 3600) -> None:
    """Stop in pdb on global rank `rank` only; every other rank waits in a barrier of the
    default group until it continues (torch.distributed.breakpoint). distcomm-run sends
    its own stdin to rank 0 (`--tee` aside), so the debugger of rank 0 is usable from the
    terminal that started the job.

    Args:
        rank: the rank that stops.
        skip: pass this call site the first `skip` times.
        timeout_s: how long the others wait (the default group's timeout is raised to it
            for the wait, so a long session does not time the group out); None keeps it.
    """
    from .collectives import barrier
    from .world import default_group

    world = default_group("breakpoint")
    if skip > 0:
        caller = sys._getframe(1)
        site = (caller.f_code.co_filename, caller.f_lineno)
        calls = _breakpoint_calls.get(site, 0) + 1
        _breakpoint_calls[site] = calls
        if calls <= skip:
            log.warning("breakpoint: skipped, call %d of the %d to skip", calls, skip)
            return
    if world.rank() == rank:
        debugger = _Pdb()
        debugger.message(
            "\n!!! ATTENTION !!!\n\nType 'up' to get to the frame that called "
            f"dist.breakpoint(rank={rank})\n"
        )
        debugger.set_trace()  # stops on the next line, here; 'up' reaches the caller
    backends = list(world.backends().values())
    before = [backend.timeout for backend in backends]
    try:
        if timeout_s is not None:
            for backend in backends:
                backend.timeout = max(backend.timeout, float(timeout_s))
        barrier(timeout=timeout_s)
    finally:
        for backend, timeout in zip(backends, before, strict=True):
            backend.timeout = timeout
