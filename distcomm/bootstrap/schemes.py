"""The built-in init_method schemes, env://, tcp:// and file://, registered as handlers.

For ``env://`` and ``tcp://`` rank 0 hosts a TCPStore at the address (the URL's, or the
one the environment gives) and every rank waits until all have joined it; under an MPI
launcher ``env://`` may get the address from rank 0 over MPI instead
(`distcomm.bootstrap.mpi`), and under a launcher that serves the store itself
(DISTCOMM_USE_AGENT_STORE=1) every rank connects to it, for ``env://`` and for a
``tcp://`` URL on MASTER_PORT (`distcomm.bootstrap.stores`).
``file://`` opens a FileStore on the path. Rank and world size come from the caller's
arguments, the URL's query, then the environment (`distcomm.launcher_env`); `require` says
what to set where a value is found nowhere.
"""

from __future__ import annotations

import socket
import warnings
from collections.abc import Mapping

from .. import config
from ..errors import DistStoreError
from ..launcher_env import (
    RANK_VARIABLES,
    SIZE_VARIABLES,
    EnvInfo,
    describe,
    detect,
    elastic_launched,
    mpi_launched,
)
from ..net import format_address, is_loopback
from ..store import FileStore
from .base import InitMethod, Rendezvous
from .mpi import bootstrap_if_launched
from .stores import open_store, open_tcp_store
from .urls import parse_init_method, register_rendezvous_handler

__all__ = ["loopback_warning", "require", "unlaunched_hint"]

#: env://'s variable for each value, in the order torch's env:// handler reads them
_ENV_VARIABLES = (
    ("rank", "RANK"),
    ("world_size", "WORLD_SIZE"),
    ("master_addr", "MASTER_ADDR"),
    ("master_port", "MASTER_PORT"),
)
#: what Slurm gives every process of a job (srun's tasks and the batch script alike)
_SLURM_MARKS = ("SLURM_JOB_ID", "SLURM_PROCID")


def _given(
    method: InitMethod, rank: int | None, world_size: int | None
) -> dict[str, tuple[object, str]]:
    """The values the caller and the URL give, each with where it came from (never both:
    `rendezvous` refuses that first)."""
    given: dict[str, tuple[object, str]] = {}
    for name, arg in (("rank", rank), ("world_size", world_size)):
        in_url = getattr(method, name)
        if arg is not None:
            given[name] = (arg, f"{name}= argument")
        elif in_url is not None:
            given[name] = (in_url, f"?{name}= in the URL")
    if method.scheme == "tcp":
        given["master_addr"] = (method.host, "tcp:// URL")
        given["master_port"] = (method.port, "tcp:// URL")
    return given


def require(info: EnvInfo, name: str, hint: str = "") -> object:
    """`info`'s value `name` (rank, world_size, master_addr, master_port).

    Raises:
        ValueError: it was found nowhere; the message says where it was looked for and
            what to set, followed by `hint`.
    """
    value = getattr(info, name)
    if value is not None:
        return value
    if name in ("rank", "world_size"):
        names = [
            f"{var} ({launcher})"
            for var, launcher in (RANK_VARIABLES if name == "rank" else SIZE_VARIABLES)
        ]
        note = " (PMIx exports no size variable)" if name == "world_size" else ""
        message = (
            f"cannot determine the {name.replace('_', ' ')} ({name[-4:]} parameter missing): "
            f"pass {name}= to "
            f"init_process_group, or set {', '.join(names[:-1])} or {names[-1]}{note}; "
            f"a tcp:// or file:// URL may also carry ?{name}="
        )
    elif name == "master_addr":
        message = (
            "cannot determine the store address: set MASTER_ADDR to the host name or "
            "IP address of rank 0's host (looked for MASTER_ADDR, then for "
            "SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST), or use "
            "init_method='tcp://HOST:PORT'"
        )
    else:
        message = (
            "cannot determine the store port: set MASTER_PORT to a free TCP port on rank "
            "0's host (looked for MASTER_PORT, then for SLURM_JOB_ID to derive one), or "
            "use init_method='tcp://HOST:PORT'"
        )
    raise ValueError(message + hint)


def unlaunched_hint(info: EnvInfo, environ: Mapping[str, str], name: str) -> str:
    """What an env:// error adds when the value `name` is found nowhere and no launcher
    started this process: torch's sentence for the variable, and how to start the job.

    A launcher is distcomm-run or torchrun (TORCHELASTIC_RUN_ID), an MPI launcher
    (`launcher_env.mpi_launched`) or Slurm (SLURM_JOB_ID or SLURM_PROCID); RANK and the
    other torch-style variables alone are not one, since a user may set some by hand.

    Returns:
        The text to append to `require`'s message, or "" under a launcher (whose own
        variables the message names already).
    """
    if (
        elastic_launched(environ)
        or mpi_launched(environ)
        or any(environ.get(var, "").strip() for var in _SLURM_MARKS)
    ):
        return ""
    variable = dict(_ENV_VARIABLES)[name]
    missing = [var for key, var in _ENV_VARIABLES if getattr(info, key, None) is None]
    listed = ", ".join(missing[:-1]) + " and " + missing[-1] if len(missing) > 1 else variable
    return (
        f". env:// rendezvous: environment variable {variable} expected, but not set, and "
        f"no launcher started this process: start it with "
        f"`distcomm-run --nproc_per_node=N script.py`, `mpiexec -n N python script.py` or "
        f"`srun -n N python script.py`, or set {listed}; a single process also runs "
        f"with init_process_group(rank=0, world_size=1, "
        f"init_method='tcp://127.0.0.1:29500') or init_method='file:///tmp/NAME'"
    )


def _locate(
    url: str,
    rank: int | None,
    world_size: int | None,
    environ: Mapping[str, str],
    with_master: bool,
) -> tuple[InitMethod, EnvInfo, int, int, str]:
    """The parsed URL, what it and the environment say, this process's rank and world
    size, and who rendezvouses how, for messages ("[rank 1/4] env:// rendezvous").

    Raises:
        ValueError: the URL is malformed, a value is malformed or out of range, or the
            rank or the world size is found nowhere.
    """
    method = parse_init_method(url)
    info = detect(environ, _given(method, rank, world_size), with_master)
    values = []
    for name in ("rank", "world_size"):
        hint = unlaunched_hint(info, environ, name) if method.scheme == "env" else ""
        values.append(int(require(info, name, hint)))  # type: ignore[call-overload]
    the_rank, size = values
    return method, info, the_rank, size, f"[rank {the_rank}/{size}] {method.scheme}:// rendezvous"


def loopback_warning(
    host: str, world_size: int, local_world_size: int | None, source: str
) -> str | None:
    """What rank 0 says when the store address `host` resolves to loopback addresses only
    while the job spans hosts (`world_size` > `local_world_size`); None when it does not.

    The master binds exactly the address it is given (torch's listens on every interface),
    so ranks on other hosts could never reach it and would wait out their timeout. A host
    name that maps to 127.0.1.1 in /etc/hosts (Debian's default) is the usual cause.

    Args:
        source: where `host` came from, for the message ("MASTER_ADDR").
    """
    if local_world_size is None or world_size <= local_world_size or not is_loopback(host):
        return None
    try:
        addresses = sorted({info[4][0] for info in socket.getaddrinfo(host, None)})
    except (socket.gaierror, UnicodeError):
        addresses = []
    ours = host in (socket.gethostname(), socket.getfqdn())
    setting = "the tcp:// URL's host" if source == "tcp:// URL" else "MASTER_ADDR"
    why = (
        " (this host's name maps to a loopback address, e.g. Debian's 127.0.1.1 in /etc/hosts)"
        if ours
        else ""
    )
    return (
        f"the store address {host!r} (from {source}) resolves to "
        f"{', '.join(addresses) or 'a loopback address'} on rank 0's host{why}: a loopback "
        f"address, which distcomm's store listens on only, but the job spans hosts "
        f"(world size {world_size} > LOCAL_WORLD_SIZE {local_world_size}), so ranks on the "
        f"other hosts cannot reach it and would time out. Set {setting} to an address of "
        "this host that the others reach (its IP address on the cluster network, e.g. from "
        "`hostname -I`), or map the host name to that address in /etc/hosts"
    )


def address_rendezvous(
    url: str,
    *,
    rank: int | None,
    world_size: int | None,
    timeout: float,
    environ: Mapping[str, str],
) -> Rendezvous:
    """The handler of env:// and tcp://: a TCPStore at an address, hosted by rank 0.

    Raises:
        ValueError: a value is missing, malformed or out of range.
        DistNetworkError, DistStoreError, DistTimeoutError: the store could not be
            hosted, opened or reached in time.
    """
    method, info, the_rank, size, where = _locate(url, rank, world_size, environ, True)
    cfg = config.load(dict(environ))
    # an explicit tcp:// address is the script's own store, not the launcher's, unless it
    # is on MASTER_PORT, which the launcher's agent serves (torch connects any tcp:// URL
    # to the agent's store then): no rank could host it there
    agent = cfg.use_agent_store and (
        method.scheme == "env" or str(method.port) == (environ.get("MASTER_PORT") or "").strip()
    )
    hint = ""
    if method.scheme == "env" and not agent:
        shared = bootstrap_if_launched(
            environ, info, the_rank, size, timeout, where, cfg.socket_ifname
        )
        if isinstance(shared, Rendezvous):
            return shared
        hint = shared
    hints = {
        name: hint + (unlaunched_hint(info, environ, name) if method.scheme == "env" else "")
        for name in ("master_addr", "master_port")
    }
    host = str(require(info, "master_addr", hints["master_addr"]))
    port = int(require(info, "master_port", hints["master_port"]))  # type: ignore[call-overload]
    origin = (
        f"address from {describe(str(info.source_of('master_addr')))}, port from "
        f"{describe(str(info.source_of('master_port')))}"
    )
    if the_rank == 0 and not agent:  # rank 0 hosts: say at once what remote ranks will hit
        local = info.local_world_size
        message = loopback_warning(host, size, local, str(info.source_of("master_addr")))
        if message is not None:
            warnings.warn(f"{where}: {message}", RuntimeWarning, stacklevel=2)
    store = open_tcp_store(
        host,
        port,
        the_rank,
        size,
        timeout,
        where,
        origin,
        agent=agent,
        prefix=cfg.store_prefix,
        warn_after=cfg.stall_warn_s,
        size_from=describe(str(info.source_of("world_size"))),
    )
    if method.scheme == "tcp":
        source = f"tcp://{format_address(host, port)}"
    else:
        launcher = info.launcher
        source = launcher if launcher not in (None, "torch style") else "env://"
    return Rendezvous(
        store, the_rank, size, info.local_rank, info.local_world_size, host, port, source
    )


def file_rendezvous(
    url: str,
    *,
    rank: int | None,
    world_size: int | None,
    timeout: float,
    environ: Mapping[str, str],
) -> Rendezvous:
    """The handler of file://: a FileStore on the URL's path.

    Raises:
        ValueError: a value is missing, malformed or out of range.
        DistStoreError: the FileStore could not be opened.
    """
    method, info, the_rank, size, where = _locate(url, rank, world_size, environ, False)
    path = str(method.path)
    opened = open_store(
        lambda: FileStore(path, size, timeout=timeout),
        f"{where}: opening the FileStore {path!r}",
        DistStoreError,
    )
    return Rendezvous(
        opened, the_rank, size, info.local_rank, info.local_world_size, source=method.url
    )


register_rendezvous_handler("env", address_rendezvous)
register_rendezvous_handler("tcp", address_rendezvous)
register_rendezvous_handler("file", file_rendezvous)
