"""Re-forming an mpi group with processes MPI's launcher did not start: MPI's dynamic
processes (MPI_Comm_accept / MPI_Comm_connect, then MPI_Intercomm_merge), driven through
the job's store.

The members that stay make a communicator of themselves (`Create_group`, collective over
them alone: the others may be gone); their rank 0 opens an MPI port and leaves its name in
the store. Each newcomer (an MPI singleton: a process started without mpiexec) connects
to it once every newcomer said it is ready, so MPI's blocking accept and connect only run
when every party is known to be there. Each accept takes in one newcomer, and the merged
communicator accepts the next; the result is split into the rank order the caller asked
for. Under MPICH this works between an mpiexec job and singletons (Hydra serves the
singletons' PMI); Open MPI needs its PRRTE runtime to connect separate jobs.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from ..errors import DistBackendError, DistTimeoutError
from ..mpiutil import load_mpi
from ..store.base import Store
from .mpi import WORLD, MpiBackend

__all__ = ["reform_mpi"]

log = logging.getLogger("distcomm.group")


def reform_mpi(
    old: MpiBackend | None,
    old_ranks: list[int],
    order: int,
    newcomers: int,
    store: Store,
    timeout: float,
    name: str,
) -> MpiBackend:
    """The mpi backend of the re-formed world, rank `order` of the new order.

    Args:
        old: this process's backend of the world being re-formed (None in a newcomer).
        old_ranks: the ranks, in `old`'s communicator, of the members that stay, in the
            new order's relative order.
        order: this process's rank in the new world.
        newcomers: how many processes join.
        store: the re-forming's store (keys of its own).
        timeout: bound of the waits the store can bound.
        name: the group's name.

    Raises:
        DistTimeoutError: a newcomer or the port did not come in time.
        DistBackendError: MPI refused (the message is MPI's).
    """
    MPI = load_mpi()
    end = time.monotonic() + timeout
    members = len(old_ranks)
    if old is not None:
        everyone = old.comm.Get_group()
        kept = everyone.Incl(old_ranks)
        try:
            current = old.comm.Create_group(kept)
        finally:
            kept.Free()
            everyone.Free()
        taken = 0
    else:
        current, taken = None, -1
    port = None
    try:
        if current is not None and current.rank == 0 and newcomers:
            port = MPI.Open_port()
            store.set("mpi/port", port)
        if old is None:
            store.add("mpi/ready", 1)
            _wait(store, ["mpi/port"], end, "the members' MPI port")
            name_of_port = store.get("mpi/port").decode()
            inter = MPI.COMM_SELF.Connect(name_of_port, root=0)
            current = inter.Merge(high=True)
            inter.Free()
            taken = current.size - members
        elif newcomers:
            _until(store, "mpi/ready", newcomers, end)
        while taken < newcomers:
            inter = current.Accept(port, root=0)  # port is read on rank 0 only
            merged = inter.Merge(high=False)
            inter.Free()
            current.Free()
            current, taken = merged, taken + 1
        world = current.Split(0, order)
        current.Free()
        current = None
    except MPI.Exception as exc:
        raise DistBackendError(f"re-forming group '{name}' on mpi failed: {exc}") from exc
    finally:
        if current is not None:
            current.Free()
        if port is not None:
            MPI.Close_port(port)
    WORLD[:] = [world.Dup()]  # later groups are made from the re-formed world
    return MpiBackend(store, world.rank, world.size, timeout, name, comm=world)


def _wait(store: Store, keys: list[str], end: float, what: str) -> None:
    left = end - time.monotonic()
    try:
        store.wait(keys, timedelta(seconds=max(0.1, left)))
    except TimeoutError:
        raise DistTimeoutError(f"re-forming on mpi: {what} did not come in time") from None


def _until(store: Store, key: str, count: int, end: float) -> None:
    while int(store.add(key, 0)) < count:
        if time.monotonic() > end:
            raise DistTimeoutError(
                f"re-forming on mpi: {count - int(store.add(key, 0))} newcomer(s) did not "
                "come in time"
            )
        time.sleep(0.01)
