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
keep-alive write; ours take ``read_timeout``; checked > 0 as torch checks it),
``use_libuv`` (a TCPStore server choice of torch's; ours has one server), and etcd's TLS
files ``ssl_cert``, ``ssl_cert_key``, ``ca_cert``, ``cert``, ``key``, ``cacert``
(refused when set: no TLS).

A bad value raises torch's exception with torch's sentence where torch has one, then the
option (``join_timeout='-1'``), or the flag (``--rdzv_conf join_timeout='-1'``) when the
parameters came from distcomm-run's command line, then what to do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

from ...config import positive_seconds
from ..wording import given, torch_message
from .api import RendezvousParameters, RendezvousTimeout
from .checks import check_run

__all__ = [
    "CONF_KEYS",
    "IGNORED_KEYS",
    "HandlerSettings",
    "RendezvousSettings",
    "check_max_attempt",
    "check_run",
    "check_seconds",
    "conf_node_rank",
    "conf_seconds",
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
    """The option ``rank`` (torch's static node rank), or None when not given.

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
        node_rank = "--node_rank" if params.from_flags else "node_rank"
        raise ValueError(
            f"{given('rank', raw, params.from_flags)} must be a node rank >= 0 (as {node_rank})"
        )
    return value


def _number(value: object) -> float | None:
    """Seconds as torch's options may give them (a number, its text, a timedelta), or None
    when `value` is none of those."""
    if isinstance(value, bool):
        return None
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        try:
            seconds = float(value.strip())
        except ValueError:
            return None
    else:
        return None
    return None if math.isnan(seconds) else seconds


#: the options torch's c10d handler reads as integers (`get_as_int`) and checks; distcomm's
#: messages for these open with torch's
_TORCH_CHECKS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "read_timeout",
    "keep_alive_interval",
)


def _not_positive(key: str, seconds: float) -> str:
    """torch's sentence for timeout option `key` set to `seconds` <= 0 (distcomm's own for
    the options torch does not check)."""
    if key == "read_timeout":
        return "The read timeout must be a positive integer."
    name = key.removesuffix("_timeout")
    if key.endswith("_timeout") and name in RendezvousTimeout._DEFAULTS:
        try:
            shown: object = timedelta(seconds=seconds)
        except OverflowError:
            shown = f"{seconds:g} s"
        return f"The {name} timeout ({shown}) must be positive."
    return f"The rendezvous configuration option '{key}' must be a positive number of seconds."


def conf_seconds(params: RendezvousParameters, key: str, default: float) -> float:
    """Option `key`, a number of seconds > 0 (a number, its text or a timedelta; torch reads
    whole seconds, distcomm also fractions), or `default` when not given.

    Raises:
        ValueError: the value is not a number, or not positive: torch's sentence (its
            `get_as_int`'s, its `RendezvousTimeout`'s, its read timeout's), then the
            option or flag.
    """
    raw = params.get(key)
    if raw is None:
        return default
    where = given(key, raw, params.from_flags)
    seconds = _number(raw)
    if key not in _TORCH_CHECKS:
        if seconds is None or not seconds > 0:
            raise ValueError(f"{where} must be a positive number of seconds")
        return seconds
    if seconds is None:
        raise ValueError(
            torch_message(
                f"The rendezvous configuration option '{key}' does not represent a valid "
                "integer value.",
                where,
                "give a number of seconds > 0",
            )
        )
    if not seconds > 0:
        raise ValueError(torch_message(_not_positive(key, seconds), where, "give a number > 0"))
    return seconds


def settings_from_params(
    params: RendezvousParameters, known_keys_only: bool = True
) -> RendezvousSettings:
    """Check the parameters every backend shares and read the options (--rdzv_conf).

    Args:
        params: the parameters; option values may be text or, as torch takes them, any
            value (numbers, booleans).
        known_keys_only: refuse keys without a meaning here (distcomm's own backends);
            False for a plug-in backend's handler: only the dynamic rendezvous's keys
            (timeouts, keep-alive) are read, the backend's own keys ride along unread.

    Raises:
        ValueError: the node range is invalid, the run id is empty, an option is unknown
            (the message lists the known ones) or its value malformed: torch's sentence
            where torch has one, then the parameter, or the flag when `params` came from
            distcomm-run's command line.
        TypeError: a node count is not an integer.
    """
    ff = params.from_flags
    check_run(params.run_id, params.min_nodes, params.max_nodes, from_flags=ff)
    defaults = RendezvousSettings()
    conf_seconds(params, "heartbeat_timeout", 5.0)  # checked as torch checks it; unused
    if not known_keys_only:
        return RendezvousSettings(
            join_timeout=conf_seconds(params, "join_timeout", defaults.join_timeout),
            last_call_timeout=conf_seconds(params, "last_call_timeout", defaults.last_call_timeout),
            close_timeout=conf_seconds(params, "close_timeout", defaults.close_timeout),
            keep_alive_interval=conf_seconds(
                params, "keep_alive_interval", defaults.keep_alive_interval
            ),
            keep_alive_max_attempt=_max_attempt(params, defaults.keep_alive_max_attempt),
        )
    unknown = sorted(set(params.config) - set(CONF_KEYS) - set(IGNORED_KEYS) - set(TLS_KEYS))
    if unknown:
        keys, known = ", ".join(unknown), ", ".join(CONF_KEYS + IGNORED_KEYS)
        if ff:
            where = f"--rdzv_conf: unknown key(s) {keys} for --rdzv_backend={params.backend}"
        else:
            where = f"unknown key(s) {keys} among the options of backend {params.backend!r}"
        raise ValueError(f"{where}; the known keys are {known}")
    tls = sorted(key for key in set(params.config) & set(TLS_KEYS) if params.get(key))
    protocol = _text(params, "protocol", "http")
    if tls or protocol != "http":
        where = ", ".join(tls) or f"protocol={protocol}"
        raise ValueError(
            f"{'--rdzv_conf ' if ff else ''}{where}: TLS to etcd is not supported; use "
            "protocol=http and no certificate keys (or a c10d rendezvous)"
        )
    store_type = _text(params, "store_type", "tcp")
    if store_type not in STORE_TYPES:
        raise ValueError(
            "Invalid store type given. Currently only supports file and tcp. "
            f"{given('store_type', params.get('store_type'), ff)} is not one of "
            f"{', '.join(STORE_TYPES)}."
        )
    conf_node_rank(params)
    join_default = defaults.join_timeout
    if params.backend in ("static", "etcd"):  # torch's static and etcd handlers read it so
        join_default = conf_seconds(params, "timeout", join_default)
    else:
        conf_seconds(params, "timeout", join_default)  # checked, though unused
    prefix = str(params.get("etcd_prefix") or defaults.etcd_prefix).strip().rstrip("/")
    if not prefix.startswith("/"):
        raise ValueError(f"{given('etcd_prefix', prefix, ff)} must start with '/'")
    return RendezvousSettings(
        store_type=store_type,
        etcd_prefix=prefix,
        join_timeout=conf_seconds(params, "join_timeout", join_default),
        last_call_timeout=conf_seconds(params, "last_call_timeout", defaults.last_call_timeout),
        close_timeout=conf_seconds(params, "close_timeout", defaults.close_timeout),
        read_timeout=conf_seconds(params, "read_timeout", defaults.read_timeout),
        is_host=params.get_as_bool("is_host"),
        keep_alive_interval=conf_seconds(
            params, "keep_alive_interval", defaults.keep_alive_interval
        ),
        keep_alive_max_attempt=_max_attempt(params, defaults.keep_alive_max_attempt),
    )


def _max_attempt(params: RendezvousParameters, default: int) -> int:
    value = params.get_as_int("keep_alive_max_attempt", default)
    if value is None or value < 1:
        raw = params.get("keep_alive_max_attempt")
        where = given("keep_alive_max_attempt", raw, params.from_flags)
        raise ValueError(f"{where} must be a whole number >= 1")
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


def check_seconds(name: str, value: float) -> float:
    """The timeout argument `name` (a number of seconds, or a timedelta), checked > 0.

    Raises:
        ValueError: it is not positive; the message names the argument.
        TypeError: it is not a number.
    """
    return positive_seconds(name, value, text=False)


def check_max_attempt(value: object) -> int:
    """The argument keep_alive_max_attempt given as a number, checked >= 1.

    Raises:
        ValueError: it is not a whole number >= 1.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"keep_alive_max_attempt={value!r} must be a whole number >= 1")
    return value
