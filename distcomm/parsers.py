"""Turning a variable's text (or a flag's) into its value, with messages that name it.

`distcomm.variables` gives each declared variable one of the ``as_*`` parsers: each takes
the variable's name (for its message) and its text, and returns the value `config.get`
returns or raises a ValueError that names the variable, the value and what to write
instead. `parse_bool`, `parse_size` and `positive_seconds` also serve flags and arguments.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta

__all__ = [
    "DEBUG_LEVELS",
    "as_bytes",
    "as_count",
    "as_debug_level",
    "as_flag",
    "as_gloo_transport",
    "as_non_negative",
    "as_stall_seconds",
    "as_text",
    "as_timeout",
    "parse_bool",
    "parse_size",
    "positive_seconds",
]

#: The levels of DISTCOMM_DEBUG and TORCH_DISTRIBUTED_DEBUG.
DEBUG_LEVELS = ("OFF", "INFO", "DETAIL")
_GLOO_TRANSPORTS = ("auto", "tcp")
#: the NCCL bindings the nccl backend can use (DISTCOMM_NCCL_BINDINGS)
NCCL_BINDINGS = ("cupy", "nccl4py")
_SIZE = re.compile(r"(\d+)\s*([KMG]?)", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_size(text: str) -> int | None:
    """A number of bytes written as an integer with an optional K, M or G suffix (powers of
    1024: `256K`, `8M`); None when `text` is not one."""
    match = _SIZE.fullmatch(text.strip())
    return int(match[1]) * _UNITS[match[2].upper()] if match else None


def parse_bool(name: str, text: str, empty: bool | None = False) -> bool:
    """1/0, true/false, yes/no or on/off (any case); a blank `text` is `empty`.

    Args:
        name: what holds the value, for the message: `DISTCOMM_TIMEOUT`, `--rdzv_conf key`.
        empty: the value of a blank text; None: a blank text is an error too.

    Raises:
        ValueError: `text` is none of those.
    """
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    if not lowered and empty is not None:
        return empty
    raise ValueError(f"{name}={text!r} is not a boolean: use 1/0, true/false, yes/no or on/off")


def positive_seconds(
    name: str,
    value: object,
    *,
    zero: bool = False,
    finite: bool = False,
    text: bool = True,
    hint: str = "",
) -> float:
    """A number of seconds > 0 (>= 0 with `zero`), given as a number, a `timedelta` or the
    number's text.

    Args:
        name: what holds the value, for the message: `DISTCOMM_TIMEOUT`, `--flag`, `timeout`.
        finite: also refuse infinity.
        text: whether `value` may be the number's text (else only a number).
        hint: appended to the message, e.g. how to turn the feature off.

    Raises:
        TypeError: `value` is neither a number nor a text.
        ValueError: it is not a number of seconds in that range; the message names `name`.
    """
    if isinstance(value, str) and text:
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, timedelta):
        seconds = value.total_seconds()
    else:
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not (seconds >= 0 if zero else seconds > 0) or (finite and math.isinf(seconds)):
        rule = "a number of seconds >= 0" if zero else "a positive number of seconds"
        raise ValueError(f"{name}={value!r} must be {rule}{hint}")
    return seconds


def as_text(name: str, text: str) -> str | None:
    """The text; None when blank."""
    return text or None


def as_flag(name: str, text: str) -> bool:
    """A boolean, as `parse_bool` reads it (blank: False)."""
    return parse_bool(name, text)


def as_timeout(name: str, text: str) -> float:
    """A positive number of seconds."""
    return positive_seconds(name, text)


def as_non_negative(name: str, text: str) -> float:
    """A number of seconds >= 0."""
    return positive_seconds(name, text, zero=True)


def as_stall_seconds(name: str, text: str) -> float:
    """A finite number of seconds >= 0 (0: the stall warnings are off)."""
    hint = ": write e.g. 30 (the default), or 0 to turn the stall warnings off"
    return positive_seconds(name, text, zero=True, finite=True, hint=hint)


def as_bytes(name: str, text: str) -> int:
    """A size from 1 byte to 4G - 2M (the store's frame limit), with K, M or G."""
    size = parse_size(text)
    if size is None or not 1 <= size <= 0xFFFFFFFF - (1 << 21):
        raise ValueError(
            f"{name}={text!r} is not a size from 1 byte to 4G - 2M: write a number of bytes "
            "with an optional K, M or G suffix, e.g. 64M"
        )
    return size


def as_count(name: str, text: str) -> int:
    """A whole number >= 0."""
    if not text.isdigit():
        raise ValueError(f"{name}={text!r} is not a count: write a whole number >= 0, e.g. 2000")
    return int(text)


def as_debug_level(name: str, text: str) -> str | None:
    """OFF, INFO or DETAIL in any case, upper-cased; None when blank."""
    level = text.upper()
    if level and level not in DEBUG_LEVELS:
        raise ValueError(f"{name}={level!r} is not one of {', '.join(DEBUG_LEVELS)}")
    return level or None


def as_gloo_transport(name: str, text: str) -> str:
    """auto or tcp, in any case."""
    mode = text.lower()
    if mode not in _GLOO_TRANSPORTS:
        raise ValueError(
            f"{name}={mode!r} is not valid: use 'auto' (shared memory between "
            "ranks on one host, TCP otherwise) or 'tcp' (TCP for everything)"
        )
    return mode


def as_nccl_bindings(name: str, text: str) -> str:
    """cupy or nccl4py, in any case."""
    choice = text.lower()
    if choice not in NCCL_BINDINGS:
        raise ValueError(
            f"{name}={text!r} is not valid: use 'cupy' (CuPy's NCCL bindings, the default) "
            "or 'nccl4py' (NVIDIA's nccl4py, non-blocking communicators)"
        )
    return choice
