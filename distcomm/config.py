"""Reading the environment: `get` one variable through its declaration, `load` the snapshot
`Config` the communication layer reads, and the `distcomm` logger's set-up.

Every variable distcomm reads is declared once in `VARIABLES` (`distcomm.variables`, with
its parsers in `distcomm.parsers`), and this module, the public face of both, re-exports
them. `get(name)` reads one variable through its declaration (a blank value counts as
unset), and `load()` builds a `Config` from the declaration. The docs' table of
variables is `python -m distcomm.config`'s output, and a test keeps the two equal.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .parsers import DEBUG_LEVELS, parse_bool, parse_size, positive_seconds
from .variables import DEFAULT_STORE_TIMEOUT, DEFAULT_TIMEOUT, FLAG_PREFIX, VARIABLES, EnvVar

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
    """The docs' table of environment variables, in Markdown: variables declared one after
    another with the same meaning share a row."""
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
        nccl_bindings: DISTCOMM_NCCL_BINDINGS (default cupy): the NCCL bindings of the nccl
            backend, "cupy" (CuPy's `cupy.cuda.nccl`) or "nccl4py" (NVIDIA's nccl4py,
            non-blocking communicators).
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
    nccl_bindings: str = "cupy"
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
        nccl_bindings=read("DISTCOMM_NCCL_BINDINGS"),
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
    if level is not None and level not in DEBUG_LEVELS:
        raise ValueError(f"debug level {level!r} is not one of {', '.join(DEBUG_LEVELS)}")
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


if __name__ == "__main__":  # python -m distcomm.config: the docs' table
    print(env_table())
