"""Rendezvous settings: the --rdzv_conf keys, their defaults and the checks of every flag,
and the dynamic handler's settings (`HandlerSettings`, torch's handler's ``settings``).

Every key a torch rendezvous handler reads is accepted. Those with a meaning here:

- ``join_timeout``, ``last_call_timeout``, ``close_timeout``, ``read_timeout``,
  ``is_host``, ``keep_alive_interval``, ``keep_alive_max_attempt``: as in torch's c10d
  (dynamic) rendezvous, for every backend;
- ``timeout``: the join timeout of the static and etcd backends when ``join_timeout`` is
  not given (torch's static and etcd-v1 handlers read it so; its c10d handler ignores it,
  and so does ours for c10d and file). torch's ``LaunchConfig`` always sets it (900 s);
- ``rank``: the static backend's node rank when --node-rank is not given (torchrun passes
  --node-rank this way);
- ``store_type``: ``tcp`` (the default) or ``file`` for c10d; ``file`` makes it the file
  backend, with --rdzv-endpoint the file's path;
- ``etcd_prefix``: the etcd backend's key prefix (default ``/distcomm/rdzv``);
- ``protocol``: ``http`` for etcd (``https`` is refused: TLS is not supported).

Accepted with no effect (`IGNORED_KEYS`): ``heartbeat_timeout`` (the time torch gives one
keep-alive write; ours take ``read_timeout``), ``use_libuv`` (a TCPStore server choice of
torch's; ours has one server), and etcd's TLS files ``ssl_cert``, ``ssl_cert_key``,
``ca_cert``, ``cert``, ``key``, ``cacert`` (refused when set: no TLS).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from ...config import positive_seconds
from .api import RendezvousParameters, RendezvousTimeout, check_node_counts

__all__ = [
    "CONF_KEYS",
    "IGNORED_KEYS",
    "HandlerSettings",
    "RendezvousSettings",
    "check_max_attempt",
    "check_run",
    "check_seconds",
    "conf_node_rank",
    "effective_backend",
    "settings_from_params",
]

#: The --rdzv_conf keys with a meaning here (see the module's docstring).
CONF_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "read_timeout",
    "is_host",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "timeout",
    "rank",
    "store_type",
    "etcd_prefix",
    "protocol",
)
#: torch's keys accepted without effect.
IGNORED_KEYS = ("heartbeat_timeout", "use_libuv")
#: torch's etcd TLS keys: refused when given, since TLS is not supported.
TLS_KEYS = ("ssl_cert", "ssl_cert_key", "ca_cert", "cert", "key", "cacert")
STORE_TYPES = ("tcp", "file")


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
        store_type: c10d's store: tcp, or file (the file backend).
        etcd_prefix: the etcd backend's key prefix.
    """

    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    read_timeout: float = 60.0
    is_host: bool | None = None
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    store_type: str = "tcp"
    etcd_prefix: str = "/distcomm/rdzv"


def _text(params: RendezvousParameters, key: str, default: str) -> str:
    """Option `key` as lower-case text (torch's options may be given as any value)."""
    value = params.get(key)
    return default if value is None else str(value).strip().lower()


def effective_backend(backend: str, config: dict[str, str]) -> str:
    """The backend that runs: c10d with ``store_type=file`` is the file backend."""
    store_type = str(config.get("store_type") or "tcp").strip().lower()
    return "file" if backend == "c10d" and store_type == "file" else backend


def conf_node_rank(params: RendezvousParameters) -> int | None:
    """The --rdzv_conf ``rank`` (torch's static node rank), or None when not given.

    Raises:
        ValueError: it is not an integer >= 0.
    """
    raw = params.get("rank")
    if raw is None:
        return None
    try:
        value = -1 if isinstance(raw, bool) else int(str(raw).strip())
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"--rdzv_conf rank={raw!r} must be a node rank >= 0 (as --node-rank)")
    return value


def settings_from_params(
    params: RendezvousParameters, known_keys_only: bool = True
) -> RendezvousSettings:
    """Check the parameters every backend shares and read the --rdzv_conf values.

    Args:
        params: the parameters; option values may be text or, as torch takes them, any
            value (numbers, booleans).
        known_keys_only: refuse keys without a meaning here (distcomm's own backends);
            False for a plug-in backend's handler: only the dynamic rendezvous's keys
            (timeouts, keep-alive) are read, the backend's own keys ride along unread.

    Raises:
        ValueError: --nnodes is not a valid range, --rdzv_id is empty, a --rdzv_conf key
            is unknown (the message lists the known ones) or a value is malformed.
        TypeError: a node count is not an integer.
    """
    check_run(params.run_id, params.min_nodes, params.max_nodes)
    defaults = RendezvousSettings()
    if not known_keys_only:
        return RendezvousSettings(
            join_timeout=params.get_as_float("join_timeout", defaults.join_timeout),
            last_call_timeout=params.get_as_float("last_call_timeout", defaults.last_call_timeout),
            close_timeout=params.get_as_float("close_timeout", defaults.close_timeout),
            keep_alive_interval=params.get_as_float(
                "keep_alive_interval", defaults.keep_alive_interval
            ),
            keep_alive_max_attempt=_max_attempt(params, defaults.keep_alive_max_attempt),
        )
    unknown = sorted(set(params.config) - set(CONF_KEYS) - set(IGNORED_KEYS) - set(TLS_KEYS))
    if unknown:
        raise ValueError(
            f"--rdzv_conf: unknown key(s) {', '.join(unknown)} for --rdzv_backend="
            f"{params.backend}; the known keys are {', '.join(CONF_KEYS + IGNORED_KEYS)}"
        )
    tls = sorted(key for key in set(params.config) & set(TLS_KEYS) if params.get(key))
    protocol = _text(params, "protocol", "http")
    if tls or protocol != "http":
        raise ValueError(
            f"--rdzv_conf {', '.join(tls) or f'protocol={protocol}'}: TLS to etcd is not "
            "supported; use protocol=http and no certificate keys (or a c10d rendezvous)"
        )
    store_type = _text(params, "store_type", "tcp")
    if store_type not in STORE_TYPES:
        raise ValueError(
            f"--rdzv_conf store_type={store_type!r} is not one of {', '.join(STORE_TYPES)}"
        )
    conf_node_rank(params)
    join_default = defaults.join_timeout
    if params.backend in ("static", "etcd"):  # torch's static and etcd handlers read it so
        join_default = params.get_as_float("timeout", join_default)
    elif params.get("timeout") is not None:
        params.get_as_float("timeout", join_default)  # checked, though unused
    prefix = str(params.get("etcd_prefix") or defaults.etcd_prefix).strip().rstrip("/")
    if not prefix.startswith("/"):
        raise ValueError(f"--rdzv_conf etcd_prefix={prefix!r} must start with '/'")
    return RendezvousSettings(
        store_type=store_type,
        etcd_prefix=prefix,
        join_timeout=params.get_as_float("join_timeout", join_default),
        last_call_timeout=params.get_as_float("last_call_timeout", defaults.last_call_timeout),
        close_timeout=params.get_as_float("close_timeout", defaults.close_timeout),
        read_timeout=params.get_as_float("read_timeout", defaults.read_timeout),
        is_host=params.get_as_bool("is_host"),
        keep_alive_interval=params.get_as_float(
            "keep_alive_interval", defaults.keep_alive_interval
        ),
        keep_alive_max_attempt=_max_attempt(params, defaults.keep_alive_max_attempt),
    )


def _max_attempt(params: RendezvousParameters, default: int) -> int:
    value = params.get_as_int("keep_alive_max_attempt", default)
    if value is None or value < 1:
        raise ValueError(
            f"--rdzv_conf keep_alive_max_attempt={params.get('keep_alive_max_attempt')!r} "
            "must be a whole number >= 1"
        )
    return value


# -- the dynamic handler's arguments --------------------------------------------------------


@dataclass(frozen=True)
class HandlerSettings:
    """A dynamic handler's settings (torch's handler has them as ``settings``)."""

    run_id: str
    min_nodes: int
    max_nodes: int
    timeout: RendezvousTimeout
    keep_alive_interval: timedelta
    keep_alive_max_attempt: int


def check_run(run_id: object, min_nodes: object, max_nodes: object) -> None:
    """Check the run id and the node range (--rdzv_id, --nnodes=MIN:MAX).

    Raises:
        ValueError: --rdzv_id is empty or not a string, or --nnodes is not a valid range.
        TypeError: a node count is not an integer.
    """
    check_node_counts(min_nodes, max_nodes)
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"--rdzv_id must be a non-empty string, got {run_id!r}")


def check_seconds(name: str, value: float) -> float:
    """The --rdzv_conf timeout `name` (a number of seconds, or a timedelta), checked > 0.

    Raises:
        ValueError: it is not positive; the message names the key.
        TypeError: it is not a number.
    """
    return positive_seconds(f"--rdzv_conf {name}", value, text=False)


def check_max_attempt(value: object) -> int:
    """The --rdzv_conf keep_alive_max_attempt given as a number, checked >= 1.

    Raises:
        ValueError: it is not a whole number >= 1.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"--rdzv_conf keep_alive_max_attempt={value!r} must be a whole number >= 1"
        )
    return value
