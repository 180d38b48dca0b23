"""The debug level, as torch.distributed exposes it (DebugLevel, get/set_debug_level).

The level comes from DISTCOMM_DEBUG, or from torch's name for it,
TORCH_DISTRIBUTED_DEBUG (DISTCOMM_DEBUG wins when both are set); `set_debug_level`
overrides both in this process until `set_debug_level_from_env` goes back to them.
What each level logs is described with DISTCOMM_DEBUG in the README.
"""

from __future__ import annotations

import enum

from . import config

__all__ = ["DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env"]


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
            "DebugLevel.INFO or DebugLevel.DETAIL") from None
    config.set_debug(chosen.name)


def set_debug_level_from_env() -> None:
    """Go back to the level of DISTCOMM_DEBUG (or TORCH_DISTRIBUTED_DEBUG), read now.

    Raises:
        ValueError: the variable holds an unknown level (the message names it).
    """
    config.set_debug(None)
    config.load()  # report a bad value here, as torch does
