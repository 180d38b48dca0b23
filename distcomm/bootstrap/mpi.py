"""The MPI side of the bootstrap: the store address shared over MPI, MPI.COMM_WORLD as the
world of the mpi backend, and the world-size check.

Bootstrap over MPI: with ``env://``, no agent store, MASTER_ADDR or MASTER_PORT unset, and
an MPI launcher (the first rank variable set is OMPI_COMM_WORLD_RANK, PMIX_RANK or
PMI_RANK, and srun did not start the process), the rendezvous imports mpi4py (which
initialises MPI; nowhere else does it). If MPI.COMM_WORLD holds the world size's
processes, rank 0 hosts the TCPStore at MASTER_ADDR, else at DISTCOMM_SOCKET_IFNAME's
address, else at 127.0.0.1 when every rank runs on its host, else at its host name's
address (or its first non-loopback IPv4 address), on MASTER_PORT or a free port, and
broadcasts "host:port" with ``MPI.COMM_WORLD.bcast``; the others connect. Every process
must reach the rendezvous within the timeout (a non-blocking barrier is polled), and an
error of rank 0's is broadcast, so no rank waits forever. It installs
`mpiutil.install_abort_hook`, so a rank's uncaught exception later aborts the job instead of
leaving that rank in MPI_Finalize while the others wait, and Ctrl-C ends every rank with one
line instead of hanging the job the same way. If mpi4py is missing, or its MPI
library is not the launcher's (its COMM_WORLD has another size), the Slurm values apply
where complete, else the error says to install mpi4py or set MASTER_ADDR and MASTER_PORT.

The mpi backend takes rank and world size from MPI.COMM_WORLD, and `check_mpi_world_size`
compares that size with the one the launcher announced (the world size above, from the
environment only): N processes that each see an MPI world of one are N separate jobs, not
one, when the launcher's PMI never reached mpi4py's MPI (plain srun with MpiDefault=none)
or the launcher belongs to another MPI library. The error names both sizes and the remedy.
`world_mpi` loads mpi4py for the backend and runs that check; `world_rendezvous` is what
`init_process_group("mpi")` without a store or init_method uses: rank and world size from
MPI.COMM_WORLD (a rank or world_size given is ignored with torch's warning), and a
process-local store (the mpi backend needs none).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import warnings
from collections.abc import Mapping
from typing import Any

import psutil

from .. import mpiutil
from ..deadline import Deadline
from ..errors import BackendUnavailableError, DistBackendError, DistNetworkError
from ..launcher_env import EnvInfo, describe, detect, launcher_of, srun_mpi_plugin
from ..net import format_address, interface_address
from ..store import HashStore, Store
from .base import Rendezvous
from .stores import open_store, tcp_store

__all__ = ["MPI_BACKEND_NEEDS", "check_mpi_world_size", "world_mpi", "world_rendezvous"]

#: why the mpi backend is unavailable without mpi4py, and what to install
MPI_BACKEND_NEEDS = (
    "mpi4py is not installed: pip install 'distcomm[mpi]' (mpi4py and the mpich "
    "wheel), or build mpi4py against your cluster's MPI library"
)

log = logging.getLogger("distcomm.rendezvous")  # the name users and tests filter on


def _host_address(one_host: bool, ifname: str | None) -> str:
    """The address rank 0 serves the store at when it picks one (see the module docstring).

    Raises:
        ValueError: DISTCOMM_SOCKET_IFNAME names no usable interface, or no address of this
            host is usable from other hosts.
    """
    if ifname:
        return interface_address(ifname)
    if one_host:
        return "127.0.0.1"
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = ""
    if address and not ipaddress.ip_address(address).is_loopback:
        return address
    stats = psutil.net_if_stats()
    for name, addresses in psutil.net_if_addrs().items():
        if name in stats and stats[name].isup:
            for addr in addresses:
                if (
                    addr.family == socket.AF_INET
                    and not ipaddress.ip_address(addr.address).is_loopback
                ):
                    return addr.address
    raise ValueError(
        "this host's name resolves to a loopback address and no interface has "
        "another IPv4 address: set DISTCOMM_SOCKET_IFNAME to the interface the "
        "other hosts reach (e.g. eth0), or MASTER_ADDR"
    )


def bootstrap_over_mpi(
    mpi: Any,
    info: EnvInfo,
    rank: int,
    size: int,
    seconds: float,
    launcher: str,
    where: str,
    ifname: str | None,
) -> Rendezvous:
    """Rank 0 hosts the TCPStore and broadcasts its address over MPI.COMM_WORLD.

    Raises:
        ValueError: the ranks do not map one to one onto MPI.COMM_WORLD's processes.
        DistTimeoutError: not every process reached the rendezvous in time.
        DistNetworkError, DistStoreError: the store could not be hosted or reached.
    """
    comm = mpi.COMM_WORLD
    where = f"{where} (store address bootstrapped over MPI)"
    mpiutil.wait_all(comm, Deadline(seconds), where)
    shared = comm.Split_type(mpi.COMM_TYPE_SHARED)
    try:
        one_host = shared.Get_size() == size
    finally:
        shared.Free()
    ranks = comm.allgather(rank)
    if sorted(ranks) != list(range(size)):
        raise ValueError(
            f"{where}: the processes of MPI.COMM_WORLD have ranks {ranks} (in MPI "
            f"rank order), not each of 0..{size - 1} once: pass rank= so that "
            f"every process gets its own, or leave it out under mpiexec"
        )
    root = ranks.index(0)
    fixed_addr = info.source_of("master_addr") == "MASTER_ADDR"
    fixed_port = info.source_of("master_port") == "MASTER_PORT"
    origin = (
        f"address from {'MASTER_ADDR' if fixed_addr else 'rank 0'}, port from "
        f"{'MASTER_PORT' if fixed_port else 'rank 0'}, shared over MPI"
    )
    if rank == 0:
        try:
            host = str(info.master_addr) if fixed_addr else _host_address(one_host, ifname)
            port = int(info.master_port) if fixed_port else 0  # type: ignore[arg-type]
            context = f"{where}: hosting the store at {format_address(host, port)} ({origin})"
            store = tcp_store(host, port, size, seconds, hosting=True, context=context)
        except BaseException as exc:
            comm.bcast(("error", f"{type(exc).__name__}: {exc}"), root=root)
            raise
        port = store.port
        comm.bcast(("ok", host, port), root=root)

        def wait_for_workers() -> Store:  # TCPStore(wait_for_workers=True)'s wait, run
            store._wait_for_workers(size, Deadline(seconds))  # once the address is out
            return store

        try:
            open_store(
                wait_for_workers,
                f"{where}: hosting the store at {format_address(host, port)} ({origin})",
                DistNetworkError,
            )
        except BaseException:
            store.close()
            raise
    else:
        reply = comm.bcast(None, root=root)
        if reply[0] != "ok":
            raise DistNetworkError(f"{where}: rank 0 could not host the store: {reply[1]}")
        host, port = reply[1], reply[2]
        context = f"{where}: connecting to the store at {format_address(host, port)} ({origin})"
        store = tcp_store(host, port, size, seconds, hosting=False, context=context)
    return Rendezvous(
        store,
        rank,
        size,
        info.local_rank,
        info.local_world_size,
        host,
        port,
        f"{launcher} (store address bootstrapped over MPI)",
    )


def bootstrap_if_launched(
    env: Mapping[str, str],
    info: EnvInfo,
    rank: int,
    size: int,
    seconds: float,
    where: str,
    ifname: str | None,
) -> Rendezvous | str:
    """Under an MPI launcher, with MASTER_ADDR or MASTER_PORT unset, share the store's
    address over MPI (see the module docstring).

    Args:
        info: what the environment says; `rank` and `size` are its rank and world size.
        where: who rendezvouses how, for messages ("[rank 1/4] env:// rendezvous").
        ifname: DISTCOMM_SOCKET_IFNAME, the interface whose address rank 0 serves at.

    Returns:
        The rendezvous, when MPI shared the address; else a hint for the error raised if
        the address stays unknown, saying why MPI could not share it and what to do ("":
        no MPI launcher, or both variables are set).

    Raises:
        ValueError, DistTimeoutError, DistNetworkError, DistStoreError: as
            `bootstrap_over_mpi`.
    """
    launched = info.mpi_launcher
    if launched is None or (
        info.source_of("master_addr") == "MASTER_ADDR"
        and info.source_of("master_port") == "MASTER_PORT"
    ):
        return ""
    var, launcher = launched
    if not mpiutil.is_mpi4py_available():
        why, remedy = "mpi4py is not installed", f"install it ({mpiutil.INSTALL_HINT})"
    else:
        try:
            mpi = mpiutil.load_mpi()
        except ImportError as exc:
            why, remedy = str(exc), "repair mpi4py"
        else:
            if mpi.COMM_WORLD.Get_size() == size:
                # MPI is initialised now: a rank that raises would sit in MPI_Finalize
                # and the others wait for the group timeout unless the error aborts
                mpiutil.install_abort_hook()
                return bootstrap_over_mpi(mpi, info, rank, size, seconds, launcher, where, ifname)
            library = (mpi.Get_library_version().strip().splitlines() or ["?"])[0]
            why = (
                f"MPI.COMM_WORLD has {mpi.COMM_WORLD.Get_size()} process(es), not the "
                f"world size {size} (from {describe(str(info.source_of('world_size')))})"
                f": mpi4py's MPI library ({library.strip()}) did not start this job"
            )
            remedy = "start the job with that library's mpiexec"
            if info.master_addr is not None and info.master_port is not None:
                log.warning(
                    "%s: not bootstrapping the store over MPI: %s; using %s and %s",
                    where,
                    why,
                    info.source_of("master_addr"),
                    info.source_of("master_port"),
                )
    return (
        f"; under {launcher} ({var}) rank 0 shares the store address over MPI "
        f"instead, but {why}: {remedy} or set MASTER_ADDR and MASTER_PORT"
    )


def check_mpi_world_size(
    mpi_size: int, library: str = "", environ: Mapping[str, str] | None = None
) -> None:
    """Raise when MPI.COMM_WORLD's size is not the world size the launcher announced.

    The announced size is the world size of `distcomm.launcher_env`'s table,
    from the environment alone (WORLD_SIZE, OMPI_COMM_WORLD_SIZE, PMI_SIZE,
    SLURM_STEP_NUM_TASKS, SLURM_NTASKS); nothing announced, nothing to check. A
    disagreement means the launcher started processes that MPI does not connect: `srun`
    without an MPI plugin mpi4py's MPI speaks, the batch script of a job of several
    tasks, another MPI library's mpiexec, or a torch-style launcher.

    Args:
        mpi_size: MPI.COMM_WORLD's size.
        library: MPI.Get_library_version(), for the message (its first line is shown).
        environ: the environment to read (default: os.environ).

    Raises:
        DistBackendError: the sizes disagree; the message names both, where the announced
            one came from, and what to do.
        ValueError: a launcher variable holds no integer.
    """
    env = os.environ if environ is None else environ
    info = detect(env, {}, False)
    size, source = info.world_size, str(info.source_of("world_size"))
    if size is None or size == mpi_size:
        return
    name = " ".join((library.strip().splitlines() or ["its MPI library"])[0].split())
    launcher = launcher_of(source)
    head = (
        f"init_process_group('mpi'): MPI.COMM_WORLD has {mpi_size} process(es), but the "
        f"launcher announced a world of {size} ({source}={size}, {launcher})"
    )
    apart = "; each process is an MPI world of its own" if mpi_size == 1 else ""
    plugin = srun_mpi_plugin(env)
    if launcher == "Slurm" and info.srun and plugin is None:
        why = (
            f"srun started {size} tasks with no MPI plugin (--mpi=none, the default unless "
            f"slurm.conf sets MpiDefault), so mpi4py's MPI ({name}) found no PMI to join "
            f"them{apart}. Start "
            f"the tasks with 'srun --mpi=pmi2' (MPICH, Intel MPI and MVAPICH speak PMI-2; "
            f"'srun --mpi=list' shows this Slurm's plugins), or have the administrator set "
            f"MpiDefault=pmi2 in slurm.conf"
        )
    elif launcher == "Slurm" and info.srun:
        why = (
            f"srun started {size} tasks with its {plugin} plugin, which mpi4py's MPI "
            f"({name}) did not use{apart}: start them with a plugin that library speaks "
            f"('srun --mpi=pmi2' for MPICH, Intel MPI and MVAPICH, 'srun --mpi=pmix' for "
            f"Open MPI; 'srun --mpi=list' shows this Slurm's plugins)"
        )
    elif launcher == "Slurm":
        why = (
            f"this process is not one of the tasks of a job step (the batch script runs "
            f"once, whatever the job's task count): start the {size} tasks with "
            f"'srun --mpi=pmi2 python ...' from the batch script, or set WORLD_SIZE=1 "
            f"to run this one process on its own"
        )
    elif launcher == "torch style":
        why = (
            "WORLD_SIZE comes from a torch-style launcher (distcomm-run, torchrun), which "
            "starts processes that MPI does not connect: under it use the gloo or tcp "
            "backend, or start the job with mpiexec (or srun --mpi=pmi2) for the mpi backend"
        )
    else:
        why = (
            f"the {launcher} launcher that started this job is not the MPI library that "
            f"mpi4py loaded ({name}){apart}: start the job with the mpiexec of mpi4py's MPI "
            f"library, or rebuild mpi4py against the launcher's MPI (pip install "
            f"--no-binary mpi4py mpi4py, with its mpicc on PATH)"
        )
    raise DistBackendError(f"{head}: {why}")


def world_mpi() -> Any:
    """mpi4py's MPI module (importing it initialises MPI), once MPI.COMM_WORLD is known to
    hold the processes the launcher started.

    Raises:
        BackendUnavailableError: mpi4py is not installed.
        DistBackendError: MPI.COMM_WORLD's size is not the world size the launcher announced
            (plain srun without an MPI plugin: every task a world of one); the message
            says what to do (`check_mpi_world_size`).
    """
    try:
        mpi = mpiutil.load_mpi()
    except ImportError as exc:
        # the import's own words, not load_mpi's summary of them
        reason = exc.__cause__ if exc.__cause__ is not None else exc
        raise BackendUnavailableError(
            f"the mpi backend needs mpi4py: {MPI_BACKEND_NEEDS} ({reason})"
        ) from None
    check_mpi_world_size(mpi.COMM_WORLD.Get_size(), mpi.Get_library_version())
    return mpi


def world_rendezvous(rank: int, world_size: int) -> Rendezvous:
    """Rank and world size from MPI.COMM_WORLD, with a process-local store: the world of
    `init_process_group("mpi")` given neither a store nor an init_method.

    A `rank` or `world_size` given (anything but -1 or None) is ignored with torch's
    warning for the mpi backend, which this one extends with what MPI assigned: the
    tutorial recipe ``init_process_group("mpi", rank=0, world_size=0)`` runs under mpiexec
    as it does with torch.

    Warns:
        UserWarning: `rank` or `world_size` was given; it names what MPI.COMM_WORLD says.

    Raises:
        BackendUnavailableError, DistBackendError: as `world_mpi`.
    """
    world = world_mpi().COMM_WORLD
    if rank not in (-1, None) or world_size not in (-1, None):
        warnings.warn(
            f"For MPI backend, world_size ({world_size}) and rank ({rank}) are ignored "
            f"since they are assigned by the MPI runtime. distcomm uses rank {world.rank} "
            f"and world size {world.size} from MPI.COMM_WORLD; leave rank and world_size "
            f"out to silence this warning",
            UserWarning,
            stacklevel=3,  # the caller of init_process_group
        )
    return Rendezvous(HashStore(), world.rank, world.size, source="MPI.COMM_WORLD")
