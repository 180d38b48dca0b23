"""The values of distcomm-run's flags, parsed and checked: --nnodes, --nproc_per_node,
--rdzv_conf, --signals_to_handle and the --duplicate-*-filters lists."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Sequence

from .agent.config import DEFAULT_SIGNALS_TO_HANDLE, FORWARDED_SIGNALS
from .wording import given, torch_message

__all__ = [
    "RDZV_BACKENDS",
    "START_METHODS",
    "NnodesFormatError",
    "check_max_restarts",
    "comma_separated_list",
    "determine_local_world_size",
    "parse_filters",
    "parse_min_max_nnodes",
    "parse_rdzv_conf",
    "parse_signals",
    "signal_names",
]

RDZV_BACKENDS = ("static", "c10d", "etcd", "file")
START_METHODS = ("spawn", "fork", "forkserver")


def signal_names(signals: Sequence[int]) -> str:
    return ",".join(signal.Signals(sig).name for sig in signals)


def parse_signals(text: str) -> tuple[int, ...]:
    """--signals_to_handle as signal numbers: "SIGTERM,SIGUSR1" (the SIG prefix and case
    are optional).

    Raises:
        ValueError: an entry is not a signal name, or names one that cannot be caught.
    """
    signals: list[int] = []
    for item in filter(None, (part.strip() for part in str(text).split(","))):
        name = item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()
        sig = getattr(signal.Signals, name, None)
        if sig is None:
            raise ValueError(
                f"--signals_to_handle: {item!r} is not a signal name; give "
                f"names such as {signal_names(DEFAULT_SIGNALS_TO_HANDLE)},"
                f"{signal_names(FORWARDED_SIGNALS)}"
            )
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGCONT):
            raise ValueError(
                f"--signals_to_handle: {sig.name} cannot be handled to stop the "
                "run (it cannot be caught, or the agent needs its default)"
            )
        if sig not in signals:
            signals.append(sig)
    return tuple(int(sig) for sig in signals)


def comma_separated_list(value: str) -> list[str]:
    """torchrun's --duplicate-*-filters value: comma-separated strings, ",," for a comma."""
    placeholder = "\x00"
    items = str(value).replace(",,", placeholder).split(",")
    return [item.replace(placeholder, ",") for item in items if item]


class NnodesFormatError(ValueError, RuntimeError):
    """--nnodes is not N or MIN:MAX. A `ValueError` like every bad flag value here, and a
    `RuntimeError`, which torch's ``parse_min_max_nnodes`` raises for a malformed value."""


def parse_min_max_nnodes(nnodes: str, *, from_flags: bool = False) -> tuple[int, int]:
    """--nnodes as (min, max): "2" -> (2, 2), "1:4" -> (1, 4).

    Args:
        from_flags: the value came from the --nnodes flag: messages name it (else the
            argument, ``nnodes``).

    Raises:
        NnodesFormatError: not N or MIN:MAX (also a RuntimeError, as in torch).
        ValueError: MIN:MAX without 1 <= MIN <= MAX (torch's launcher refuses it too).
    """
    where = given("nnodes", nnodes, from_flags, flag="--nnodes")
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(nnodes))
    if not match:
        raise NnodesFormatError(
            torch_message(
                f'nnodes={nnodes} is not in "MIN:MAX" format',
                where,
                "give a number of nodes (2) or an elastic range MIN:MAX (1:4)",
            )
        )
    low = int(match.group(1))
    high = int(match.group(2)) if match.group(2) is not None else low
    if not 1 <= low <= high:
        raise ValueError(
            torch_message(
                f"min_nodes must be > 0 and <= max_nodes, got min_nodes={low}, max_nodes={high}",
                where,
                "give 1 <= MIN <= MAX",
            )
        )
    return low, high


def check_max_restarts(value: int | str) -> int:
    """--max_restarts as a number of restarts >= 0.

    Raises:
        ValueError: it is negative (torch's sentence, then the flag; torch raises an
            AssertionError).
    """
    restarts = int(value)
    if restarts < 0:
        raise ValueError(
            torch_message(
                "max_restarts must be >= 0",
                f"--max_restarts={restarts!r}",
                "give how many times a failed group may restart, 0 for none",
            )
        )
    return restarts


def _gpu_count() -> int:
    from ..gpu import device_count  # imports CuPy, if installed, only when asked

    return device_count()


def determine_local_world_size(nproc_per_node: str, *, from_flags: bool = False) -> int:
    """--nproc_per_node as a number of workers.

    Args:
        from_flags: the value came from the --nproc_per_node flag: messages name it (else
            the argument, ``nproc_per_node``).

    Raises:
        ValueError: not a positive integer, cpu, gpu or auto; or gpu without a GPU
            (torch's sentences, then the argument or flag and what to do).
    """
    where = given("nproc_per_node", nproc_per_node, from_flags, flag="--nproc_per_node")
    value = str(nproc_per_node).strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    if value == "cpu":
        return os.cpu_count() or 1
    if value in ("gpu", "auto"):
        gpus = _gpu_count()
        if gpus:
            return gpus
        if value == "gpu":
            raise ValueError(
                torch_message(
                    "Cuda is not available.",
                    where,
                    "no GPU here, or CuPy is not installed: give a number of workers or 'cpu'",
                )
            )
        return os.cpu_count() or 1
    raise ValueError(
        torch_message(
            f"Unsupported nproc_per_node value: {nproc_per_node}",
            where,
            "give a positive integer, 'cpu', 'gpu' or 'auto'",
        )
    )


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """--rdzv_conf "key=value,..." as a dict. One pair of quotes around the whole value is
    dropped: ``--rdzv_conf='join_timeout=5'`` in an argument list, where no shell removed
    them, means what it means on a shell's command line.

    Raises:
        ValueError: an item is not key=value with a key and a value.
    """
    text = str(text).strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"--rdzv_conf item {item!r} is not key=value "
                f"(e.g. join_timeout=600,last_call_timeout=30)"
            )
        if not value.strip():
            raise ValueError(
                f"--rdzv_conf item {item!r}: the option {key.strip()!r} must have a value "
                "specified (key=value)"
            )
        conf[key.strip()] = value.strip()
    return conf


def parse_filters(value: object) -> list[str]:
    """A --duplicate-*-filters value: a list already, or a string from a variable."""
    if isinstance(value, str):
        return comma_separated_list(value)
    return [str(item) for item in (value or []) if str(item)]
