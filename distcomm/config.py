"""The one place where distcomm reads its own DISTCOMM_* environment variables."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

__all__ = [
    "DEFAULT_STORE_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "Config",
    "configure_logging",
    "load",
    "parse_size",
]

#: Default timeout of a process group's blocking operations, in seconds (torch: 30 minutes).
DEFAULT_TIMEOUT = 1800.0
#: Default timeout of store operations, in seconds (torch's TCPStore: 300 s).
DEFAULT_STORE_TIMEOUT = 300.0

_DEBUG_LEVELS = ("OFF", "INFO", "DETAIL")
_SIZE = re.compile(r"(\d+)\s*([KMG]?)", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int | None:
    """A number of bytes written as an integer with an optional K, M or G suffix (powers of
    1024: `256K`, `8M`); None when `text` is not one."""
    match = _SIZE.fullmatch(text.strip())
    return int(match[1]) * _UNITS[match[2].upper()] if match else None


@dataclass(frozen=True)
class Config:
    """A snapshot of the DISTCOMM_* environment.

    Attributes:
        auth_key: DISTCOMM_AUTH_KEY as bytes, or None: when set, every store and
            backend connection must prove it holds the same key.
        socket_ifname: DISTCOMM_SOCKET_IFNAME: the network interface whose IPv4
            address backend connections bind (default: the route to the store).
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
            exception calls MPI.COMM_WORLD.Abort(1) once `mpiutil.install_abort_hook` ran.
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


def _flag(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r} is not a boolean: use 1/0, true/false, yes/no or on/off")


def _bytes(env: dict[str, str] | os._Environ, name: str, default: int) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    size = parse_size(text)
    if size is None or not 1 <= size <= 0xFFFFFFFF - (1 << 21):
        raise ValueError(
            f"{name}={text!r} is not a size from 1 byte to 4G - 2M: write a number of bytes "
            "with an optional K, M or G suffix, e.g. 64M"
        )
    return size


def _count(env: dict[str, str] | os._Environ, name: str, default: int) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise ValueError(f"{name}={text!r} is not a count: write a whole number >= 0, e.g. 2000")
    return int(text)


def load(environ: dict[str, str] | None = None) -> Config:
    """Read the DISTCOMM_* variables from `environ` (default: os.environ).

    Raises:
        ValueError: a variable holds a value it cannot take, named in the message.
    """
    env = os.environ if environ is None else environ
    key = env.get("DISTCOMM_AUTH_KEY")
    timeout = DEFAULT_TIMEOUT
    if env.get("DISTCOMM_TIMEOUT"):
        try:
            timeout = float(env["DISTCOMM_TIMEOUT"])
        except ValueError:
            raise ValueError(
                f"DISTCOMM_TIMEOUT={env['DISTCOMM_TIMEOUT']!r} is not a number of seconds"
            ) from None
        if timeout <= 0:
            raise ValueError(f"DISTCOMM_TIMEOUT must be > 0 seconds, got {timeout}")
    stall_text = env.get("DISTCOMM_STALL_WARN_S", "").strip() or "30"
    try:
        stall_warn_s = float(stall_text)
    except ValueError:
        stall_warn_s = -1.0
    if not 0 <= stall_warn_s < float("inf"):
        raise ValueError(
            f"DISTCOMM_STALL_WARN_S={stall_text!r} is not a number of seconds >= 0: write e.g."
            " 30 (the default), or 0 to turn the stall warnings off"
        )
    debug = _debug_level(env) if _debug_override is None else _debug_override
    return Config(
        auth_key=key.encode() if key else None,
        socket_ifname=env.get("DISTCOMM_SOCKET_IFNAME") or None,
        timeout=timeout,
        stall_warn_s=stall_warn_s,
        debug=debug,
        use_agent_store=_flag(
            "DISTCOMM_USE_AGENT_STORE", env.get("DISTCOMM_USE_AGENT_STORE", "")
        ),
        store_prefix=env.get("DISTCOMM_STORE_PREFIX", ""),
        mpi_abort_on_exception=_flag(
            "DISTCOMM_MPI_ABORT_ON_EXCEPTION", env.get("DISTCOMM_MPI_ABORT_ON_EXCEPTION") or "1"
        ),
        nccl_blocking_wait=_flag(
            "DISTCOMM_NCCL_BLOCKING_WAIT", env.get("DISTCOMM_NCCL_BLOCKING_WAIT", "")
        ),
        store_max_key_bytes=_bytes(env, "DISTCOMM_STORE_MAX_KEY_BYTES", 8 << 10),
        store_max_value_bytes=_bytes(env, "DISTCOMM_STORE_MAX_VALUE_BYTES", 8 << 20),
        trace_buffer=_count(env, "DISTCOMM_TRACE_BUFFER", 2000),
        trace_dir=env.get("DISTCOMM_TRACE_DIR") or None,
    )


def _debug_level(env: object) -> str:
    """DISTCOMM_DEBUG, else TORCH_DISTRIBUTED_DEBUG (its torch name), else OFF."""
    for name in ("DISTCOMM_DEBUG", "TORCH_DISTRIBUTED_DEBUG"):
        text = (env.get(name) or "").strip().upper()  # type: ignore[attr-defined]
        if text:
            if text not in _DEBUG_LEVELS:
                raise ValueError(f"{name}={text!r} is not one of {', '.join(_DEBUG_LEVELS)}")
            return text
    return "OFF"


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
