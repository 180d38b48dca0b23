"""Rendezvous settings: the --rdzv_conf keys, their defaults and the checks of every flag."""

from __future__ import annotations

from dataclasses import dataclass

from .api import RendezvousParameters

__all__ = ["CONF_KEYS", "RendezvousSettings", "check_node_range", "settings_from_params"]

#: The --rdzv_conf keys every backend accepts.
CONF_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "read_timeout",
    "is_host",
    "keep_alive_interval",
    "keep_alive_max_attempt",
)


@dataclass(frozen=True)
class RendezvousSettings:
    """The --rdzv_conf values, with torch's defaults.

    Attributes:
        join_timeout: seconds `next_rendezvous` may take before it raises
            RendezvousTimeoutError.
        last_call_timeout: seconds a round keeps gathering nodes once it has
            min_nodes (each later arrival restarts the window), unless max_nodes come.
        close_timeout: seconds `set_closed` and `shutdown` may take.
        read_timeout: seconds a c10d client may take to reach the store; also the
            timeout of the store's requests.
        is_host: whether this agent hosts the c10d store (None: decide from the endpoint).
        keep_alive_interval: seconds between this node's heartbeats.
        keep_alive_max_attempt: heartbeats a node may miss before the others drop it.
    """

    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    read_timeout: float = 60.0
    is_host: bool | None = None
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3


def check_node_range(min_nodes: int, max_nodes: int) -> None:
    """Check --nnodes=MIN:MAX.

    Raises:
        ValueError: MIN < 1 or MAX < MIN; the message names --nnodes.
    """
    for value in (min_nodes, max_nodes):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"--nnodes: node counts must be integers, got {value!r}")
    if min_nodes < 1:
        raise ValueError(
            f"--nnodes: the minimum number of nodes ({min_nodes}) must be at least 1"
        )
    if max_nodes < min_nodes:
        raise ValueError(
            f"--nnodes: the maximum number of nodes ({max_nodes}) must be greater than or "
            f"equal to the minimum number of nodes ({min_nodes})"
        )


def settings_from_params(params: RendezvousParameters) -> RendezvousSettings:
    """Check the parameters every backend shares and read the --rdzv_conf values.

    Raises:
        ValueError: --nnodes is not a valid range, --rdzv_id is empty, a --rdzv_conf key
            is unknown (the message lists the known ones) or a value is malformed.
    """
    check_node_range(params.min_nodes, params.max_nodes)
    if not isinstance(params.run_id, str) or not params.run_id:
        raise ValueError(f"--rdzv_id must be a non-empty string, got {params.run_id!r}")
    unknown = sorted(set(params.config) - set(CONF_KEYS))
    if unknown:
        raise ValueError(
            f"--rdzv_conf: unknown key(s) {', '.join(unknown)} for --rdzv_backend="
            f"{params.backend}; the known keys are {', '.join(CONF_KEYS)}"
        )
    defaults = RendezvousSettings()
    return RendezvousSettings(
        join_timeout=params.get_as_float("join_timeout", defaults.join_timeout),
        last_call_timeout=params.get_as_float("last_call_timeout", defaults.last_call_timeout),
        close_timeout=params.get_as_float("close_timeout", defaults.close_timeout),
        read_timeout=params.get_as_float("read_timeout", defaults.read_timeout),
        is_host=params.get_as_bool("is_host"),
        keep_alive_interval=params.get_as_float(
            "keep_alive_interval", defaults.keep_alive_interval
        ),
        keep_alive_max_attempt=params.get_as_int(
            "keep_alive_max_attempt", defaults.keep_alive_max_attempt
        ),
    )
