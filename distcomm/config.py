"""The one declaration of every environment variable distcomm reads or sets, its parsers,
and `Config`, the snapshot of them the communication layer reads.

`VARIABLES` names each variable with its type, default, meaning and who sets it;
`get(name)` reads one through its declaration (a blank value counts as unset), and
`load()` builds a `Config` from the declaration. The README's table of variables is
`python -m distcomm.config`'s output, and a test keeps the two equal.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = [
    "DEFAULT_STORE_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "FLAG_PREFIX",
    "VARIABLES",
    "Config",
    "EnvVar",
    "configure_logging",
    "env_table",
    "get",
    "load",
    "parse_bool",
    "parse_size",
    "positive_seconds",
]

#: Default timeout of a process group's blocking operations, in seconds (torch: 30 minutes).
DEFAULT_TIMEOUT = 1800.0
#: Default timeout of store operations, in seconds (torch's TCPStore: 300 s).
DEFAULT_STORE_TIMEOUT = 300.0
#: `distcomm-run` reads each flag's default from this prefix and the flag's name in capitals.
FLAG_PREFIX = "DISTCOMM_"

_DEBUG_LEVELS = ("OFF", "INFO", "DETAIL")
_GLOO_TRANSPORTS = ("auto", "tcp")
_SIZE = re.compile(r"(\d+)\s*([KMG]?)", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


# -- parsers: each takes the variable's name (for its message) and its text ------------------


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


def _text(name: str, text: str) -> str | None:
    return text or None


def _flag(name: str, text: str) -> bool:
    return parse_bool(name, text)


def _timeout(name: str, text: str) -> float:
    return positive_seconds(name, text)


def _non_negative(name: str, text: str) -> float:
    return positive_seconds(name, text, zero=True)


def _stall(name: str, text: str) -> float:
    hint = ": write e.g. 30 (the default), or 0 to turn the stall warnings off"
    return positive_seconds(name, text, zero=True, finite=True, hint=hint)


def _bytes(name: str, text: str) -> int:
    size = parse_size(text)
    if size is None or not 1 <= size <= 0xFFFFFFFF - (1 << 21):
        raise ValueError(
            f"{name}={text!r} is not a size from 1 byte to 4G - 2M: write a number of bytes "
            "with an optional K, M or G suffix, e.g. 64M"
        )
    return size


def _count(name: str, text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{name}={text!r} is not a count: write a whole number >= 0, e.g. 2000")
    return int(text)


def _debug(name: str, text: str) -> str | None:
    level = text.upper()
    if level and level not in _DEBUG_LEVELS:
        raise ValueError(f"{name}={level!r} is not one of {', '.join(_DEBUG_LEVELS)}")
    return level or None


def _gloo_transport(name: str, text: str) -> str:
    mode = text.lower()
    if mode not in _GLOO_TRANSPORTS:
        raise ValueError(
            f"{name}={mode!r} is not valid: use 'auto' (shared memory between "
            "ranks on one host, TCP otherwise) or 'tcp' (TCP for everything)"
        )
    return mode


# -- the declaration -----------------------------------------------------------------------


@dataclass(frozen=True)
class EnvVar:
    """One environment variable distcomm reads or sets.

    Attributes:
        name: the variable, e.g. `DISTCOMM_TIMEOUT`; `DISTCOMM_<FLAG>` stands for the
            family of `distcomm-run` flag defaults.
        type: what it holds, for the table: bool, seconds, size, count, text, ...
        default: the text used when it is unset or blank ("" : none).
        meaning: what it does, as the README's table says it.
        set_by: who sets it: the user, `distcomm-run`, or both.
        parse: turns (name, text) into the value `get` returns.
    """

    name: str
    type: str
    default: str
    meaning: str
    set_by: str = "user"
    parse: Callable[[str, str], Any] = _text


_RUN = "distcomm-run"
_BOTH = "user or distcomm-run"

#: Every variable distcomm reads or sets, in the README's order.
VARIABLES: tuple[EnvVar, ...] = (
    *(
        EnvVar(name, "text", "", "torch's rendezvous variables (`env://`)", _BOTH)
        for name in (
            "MASTER_ADDR",
            "MASTER_PORT",
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
        )
    ),
    EnvVar(
        "DISTCOMM_AUTH_KEY",
        "text",
        "",
        "a shared secret: every store and backend connection must prove it holds the key "
        "(HMAC-SHA256 challenge) before anything is served. `distcomm-run` makes one for a "
        "single-node job when it is not set",
        _BOTH,
    ),
    EnvVar(
        "DISTCOMM_SOCKET_IFNAME",
        "text",
        "",
        "the network interface backend connections bind, e.g. `eth0` or `lo` (default: "
        "the interface that reaches the store)",
    ),
    EnvVar(
        "GLOO_SOCKET_IFNAME",
        "text",
        "",
        "torch's name for `DISTCOMM_SOCKET_IFNAME`, read when ours is unset (of a "
        "comma-separated list, the first interface)",
    ),
    EnvVar(
        "DISTCOMM_TIMEOUT",
        "seconds",
        f"{DEFAULT_TIMEOUT:g}",
        "default group timeout in seconds",
        parse=_timeout,
    ),
    EnvVar(
        "DISTCOMM_USE_AGENT_STORE",
        "bool",
        "0",
        "`1`: the store at `MASTER_ADDR:MASTER_PORT` is already served by a launcher, so "
        "rank 0 connects to it instead of hosting it. It applies to `env://` and to a "
        '`tcp://` URL on `MASTER_PORT`; an `init_method="tcp://..."` on another port, or '
        "`store=`, is the script's own store",
        _BOTH,
        _flag,
    ),
    EnvVar(
        "TORCHELASTIC_USE_AGENT_STORE",
        "bool",
        "0",
        "torchrun's: `True` in distcomm-run's workers. A master `TCPStore` on "
        "`MASTER_PORT` that cannot bind it then becomes a client of the agent's store, "
        "as torch's does",
        _RUN,
        _flag,
    ),
    EnvVar(
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        "bool",
        "0",
        "torch's: `1` keeps a c10d rendezvous's own TCPStore from the workers; the agent "
        "hosts another store for them",
        _BOTH,
        _flag,
    ),
    EnvVar(
        "DISTCOMM_STORE_PREFIX",
        "text",
        "",
        "with `DISTCOMM_USE_AGENT_STORE`, the key prefix of this round of workers",
        _RUN,
    ),
    EnvVar(
        "DISTCOMM_STORE_MAX_KEY_BYTES",
        "size",
        "8K",
        "read by the process hosting a `TCPStore`: the longest key it accepts. Sizes take "
        "a K, M or G suffix",
        parse=_bytes,
    ),
    EnvVar(
        "DISTCOMM_STORE_MAX_VALUE_BYTES",
        "size",
        "8M",
        "read by the process hosting a `TCPStore`: the largest value it accepts (a request "
        "may carry 1 MiB more). Sizes take a K, M or G suffix",
        parse=_bytes,
    ),
    EnvVar(
        FLAG_PREFIX + "<FLAG>",
        "flag",
        "",
        "any `distcomm-run` flag, e.g. `DISTCOMM_NPROC_PER_NODE=4` (the command line wins); "
        "torchrun's `PET_<FLAG>` too, below ours",
    ),
    *(
        EnvVar(
            name,
            "text",
            "",
            "set by `distcomm-run` in every worker, also as `TORCHELASTIC_*`",
            _RUN,
        )
        for name in ("DISTCOMM_RESTART_COUNT", "DISTCOMM_MAX_RESTARTS", "DISTCOMM_RUN_ID")
    ),
    EnvVar(
        "DISTCOMM_ERROR_FILE",
        "path",
        "",
        "where `@record` writes the worker's exception (else torchelastic's "
        "`TORCHELASTIC_ERROR_FILE`)",
        _RUN,
    ),
    EnvVar(
        "TORCHELASTIC_ERROR_FILE",
        "path",
        "",
        "torchelastic's name for `DISTCOMM_ERROR_FILE`, read when ours is unset",
        _RUN,
    ),
    EnvVar(
        "DISTCOMM_TIMER_FILE",
        "path",
        "",
        "the expiration-timer pipe `timer.expires` uses",
        _RUN,
    ),
    EnvVar(
        "DISTCOMM_SHM_MANAGER",
        "text",
        "",
        "the address of the `file_system` strategy's manager daemon; set by the first "
        "process that starts one, so its children share it",
        "distcomm",
    ),
    EnvVar(
        "DISTCOMM_LAUNCH_VERBOSE",
        "text",
        "",
        "set (e.g. `1`): `distcomm-run` logs each round (node rank, nodes, restart count) "
        "to stderr",
    ),
    EnvVar(
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
        "seconds",
        "30",
        "torchrun's default of `--shutdown_timeout`: seconds workers get after SIGTERM "
        "before SIGKILL",
        parse=_non_negative,
    ),
    EnvVar(
        "DISTCOMM_GLOO_TRANSPORT",
        "auto, tcp",
        "auto",
        "`auto`: gloo uses shared memory when every rank of a group is on one host, TCP "
        "otherwise; `tcp`: TCP for everything. If one rank says `tcp`, the whole group "
        "uses TCP",
        parse=_gloo_transport,
    ),
    EnvVar(
        "DISTCOMM_TUNING",
        "field=size,...",
        "",
        "overrides the algorithm thresholds of a backend, e.g. "
        '`all_reduce_ring_min=1M,shm_chunk=512K` (see "Algorithms and tuning")',
    ),
    EnvVar(
        "DISTCOMM_HOST_ID",
        "text",
        "",
        "overrides the identity gloo uses to decide which ranks share a host (default: "
        "host name, kernel boot id and PID namespace)",
    ),
    *(
        EnvVar(
            name,
            "count",
            "",
            "the default intra-op thread count (`MKL_NUM_THREADS` first), as in torch",
        )
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
    ),
    EnvVar(
        "DISTCOMM_MPI_ABORT_ON_EXCEPTION",
        "bool",
        "1",
        "`1`: under the mpi backend an uncaught exception aborts the whole MPI job "
        "(traceback first), and Ctrl-C ends every rank with one line and status 130; "
        "`0`: off",
        parse=_flag,
    ),
    EnvVar(
        "DISTCOMM_NCCL_BLOCKING_WAIT",
        "bool",
        "0",
        "`1`: `Work.wait()` of an `nccl` operation blocks the host until it finished, "
        "bounded by the group timeout (`0`: it only orders the caller's CUDA stream after "
        "it)",
        parse=_flag,
    ),
    EnvVar(
        "DISTCOMM_DEBUG",
        "OFF, INFO, DETAIL",
        "",
        "`OFF` (default), `INFO` (log group setup, teardown and aborts to stderr, prefixed "
        "with the rank) or `DETAIL` (also every collective with its sequence number and "
        "signature). Aborts are logged as warnings at any level.",
        parse=_debug,
    ),
    EnvVar(
        "TORCH_DISTRIBUTED_DEBUG",
        "OFF, INFO, DETAIL",
        "",
        "torch's name for `DISTCOMM_DEBUG`, read when ours is unset",
        parse=_debug,
    ),
    EnvVar(
        "DISTCOMM_STALL_WARN_S",
        "seconds",
        "30",
        "seconds before a wait that is still waiting says so (`0`: never), then again "
        "after 60 s, 120 s, ...: a collective, send or receive (naming the ranks that have "
        'not entered it and what they do, see "When a job hangs"), `init_process_group` '
        "waiting for ranks that have not joined the store or reached a backend's set-up "
        "(naming them, on every waiting rank), and a TCPStore, FileStore or EtcdStore "
        "`get`/`wait`/`queue_pop` (naming the keys still missing); a TCPStore client "
        "whose server has not greeted it warns after 5 s, or this when shorter",
        parse=_stall,
    ),
    EnvVar(
        "DISTCOMM_TRACE_BUFFER",
        "count",
        "2000",
        "how many of its last operations each group's flight recorder keeps (`0`: off). "
        'See "When a job hangs"',
        parse=_count,
    ),
    EnvVar(
        "DISTCOMM_TRACE_DIR",
        "path",
        "",
        "where each rank writes its flight recorder (`rank-<R>.json`) on a collective "
        "timeout or failure, SIGTERM, SIGUSR1, `dump_trace()` and at an exit with "
        "unfinished operations; unset: no files. `distcomm-run` sets it for its workers "
        "when it is not set",
        _BOTH,
    ),
)

_BY_NAME = {var.name: var for var in VARIABLES}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of variable `name` in `environ` (default: os.environ), parsed as its
    declaration says; a variable that is unset or blank takes the declared default.

    Raises:
        KeyError: `name` is not declared in `VARIABLES`.
        ValueError: the variable holds a value it cannot take, named in the message.
    """
    var = _BY_NAME[name]
    env = os.environ if environ is None else environ
    text = (env.get(name) or "").strip() or var.default
    return var.parse(name, text)


def env_table() -> str:
    """The README's table of environment variables, in Markdown: variables declared one
    after another with the same meaning share a row."""
    rows: list[tuple[list[str], EnvVar]] = []
    for var in VARIABLES:
        if rows and (
            rows[-1][1].meaning,
            rows[-1][1].type,
            rows[-1][1].default,
            rows[-1][1].set_by,
        ) == (var.meaning, var.type, var.default, var.set_by):
            rows[-1][0].append(var.name)
        else:
            rows.append(([var.name], var))
    lines = ["| variable | type | default | set by | meaning |", "|---|---|---|---|---|"]
    for names, var in rows:
        shown = ", ".join(f"`{name}`" for name in names)
        default = f"`{var.default}`" if var.default else ""
        lines.append(f"| {shown} | {var.type} | {default} | {var.set_by} | {var.meaning} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Config:
    """A snapshot of the DISTCOMM_* environment.

    Attributes:
        auth_key: DISTCOMM_AUTH_KEY as bytes, or None: when set, every store and
            backend connection must prove it holds the same key.
        socket_ifname: DISTCOMM_SOCKET_IFNAME (or torch's GLOO_SOCKET_IFNAME, the first
            of its list): the network interface whose IPv4 address backend connections
            bind (default: the route to the store).
        timeout: DISTCOMM_TIMEOUT: default process-group timeout in seconds.
        stall_warn_s: DISTCOMM_STALL_WARN_S (default 30; 0: off): seconds after which
            `init_process_group`, still waiting for ranks, warns which ranks are missing,
            then again after twice as long each time.
        debug: DISTCOMM_DEBUG (or its torch name TORCH_DISTRIBUTED_DEBUG; ours wins when
            both are set, and `set_debug_level` over both): OFF, INFO (log group setup,
            teardown and aborts to stderr) or DETAIL (also every collective, with its
            sequence number and signature).
        use_agent_store: DISTCOMM_USE_AGENT_STORE: the store at MASTER_ADDR:MASTER_PORT
            is already served (by a launcher), so rank 0 connects instead of hosting it.
        store_prefix: DISTCOMM_STORE_PREFIX: with use_agent_store, the key prefix this
            run of the workers uses in the agent's store (the launcher sets one per round).
        mpi_abort_on_exception: DISTCOMM_MPI_ABORT_ON_EXCEPTION (default on): an uncaught
            exception calls MPI.COMM_WORLD.Abort(1), and Ctrl-C MPI.COMM_WORLD.Abort(130)
            after each rank said so, once `mpiutil.install_abort_hook` ran.
        nccl_blocking_wait: DISTCOMM_NCCL_BLOCKING_WAIT (default off): `Work.wait()` of an
            nccl operation blocks the host until it finished (bounded by the group
            timeout) instead of only ordering the caller's CUDA stream after it.
        store_max_key_bytes: DISTCOMM_STORE_MAX_KEY_BYTES (default 8K): the longest key a
            TCPStore server hosted by this process accepts.
        store_max_value_bytes: DISTCOMM_STORE_MAX_VALUE_BYTES (default 8M): the largest
            value (and, with 1 MiB more, request) a TCPStore server hosted by this process
            accepts.
        trace_buffer: DISTCOMM_TRACE_BUFFER (default 2000): how many of its last operations
            each group's flight recorder keeps (0: none).
        trace_dir: DISTCOMM_TRACE_DIR: where each rank writes its flight recorder (on a
            timeout, an abort, SIGTERM, SIGUSR1 or `dump_trace()`); unset: no files.
    """

    auth_key: bytes | None = None
    socket_ifname: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    stall_warn_s: float = 30.0
    debug: str = "OFF"
    use_agent_store: bool = False
    store_prefix: str = ""
    mpi_abort_on_exception: bool = True
    nccl_blocking_wait: bool = False
    store_max_key_bytes: int = 8 << 10
    store_max_value_bytes: int = 8 << 20
    trace_buffer: int = 2000
    trace_dir: str | None = None


def load(environ: Mapping[str, str] | None = None) -> Config:
    """Read the variables `Config` holds from `environ` (default: os.environ), each through
    its declaration in `VARIABLES`.

    Raises:
        ValueError: a variable holds a value it cannot take, named in the message.
    """

    def read(name: str) -> Any:
        return get(name, environ)

    key = read("DISTCOMM_AUTH_KEY")
    debug = _debug_override
    if debug is None:  # ours, else its torch name
        debug = read("DISTCOMM_DEBUG") or read("TORCH_DISTRIBUTED_DEBUG") or "OFF"
    return Config(
        auth_key=key.encode() if key else None,
        socket_ifname=read("DISTCOMM_SOCKET_IFNAME")
        or (read("GLOO_SOCKET_IFNAME") or "").split(",")[0].strip()
        or None,
        timeout=read("DISTCOMM_TIMEOUT"),
        stall_warn_s=read("DISTCOMM_STALL_WARN_S"),
        debug=debug,
        use_agent_store=read("DISTCOMM_USE_AGENT_STORE"),
        store_prefix=read("DISTCOMM_STORE_PREFIX") or "",
        mpi_abort_on_exception=read("DISTCOMM_MPI_ABORT_ON_EXCEPTION"),
        nccl_blocking_wait=read("DISTCOMM_NCCL_BLOCKING_WAIT"),
        store_max_key_bytes=read("DISTCOMM_STORE_MAX_KEY_BYTES"),
        store_max_value_bytes=read("DISTCOMM_STORE_MAX_VALUE_BYTES"),
        trace_buffer=read("DISTCOMM_TRACE_BUFFER"),
        trace_dir=read("DISTCOMM_TRACE_DIR"),
    )


#: the level `distcomm.set_debug_level` chose, over the environment's (None: none chosen)
_debug_override: str | None = None


def set_debug(level: str | None) -> None:
    """Make `level` (OFF, INFO, DETAIL) the debug level of this process, over DISTCOMM_DEBUG
    and TORCH_DISTRIBUTED_DEBUG; None goes back to the environment's. Loggers follow."""
    global _debug_override
    if level is not None and level not in _DEBUG_LEVELS:
        raise ValueError(f"debug level {level!r} is not one of {', '.join(_DEBUG_LEVELS)}")
    _debug_override = level
    if _rank >= 0:  # initialised: the loggers follow now (else init_process_group sets them)
        configure_logging(load(), _rank)


_handler: logging.Handler | None = None
_rank = -1  # the rank in log lines, from the last configure_logging


def configure_logging(cfg: Config, rank: int) -> None:
    """Send the `distcomm` logger to stderr at the level DISTCOMM_DEBUG asks for.

    With OFF nothing is configured: warnings (aborted groups) still reach stderr through
    logging's last-resort handler, and applications may configure the logger themselves.
    """
    global _handler, _rank
    _rank = rank
    logger = logging.getLogger("distcomm")
    if cfg.debug == "OFF":
        if _handler is not None:  # switched off after it was on
            logger.setLevel(logging.WARNING)
        return
    if _handler is None:
        _handler = logging.StreamHandler()
        logger.addHandler(_handler)
    _handler.setFormatter(logging.Formatter(f"[rank {rank}] %(name)s %(levelname)s: %(message)s"))
    logger.setLevel(logging.DEBUG if cfg.debug == "DETAIL" else logging.INFO)


if __name__ == "__main__":  # python -m distcomm.config: the README's table
    print(env_table())
