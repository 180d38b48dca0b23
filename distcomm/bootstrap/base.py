"""The bootstrap's data types: `InitMethod`, a parsed init_method URL, and `Rendezvous`, the
outcome (store, rank, world size). What the environment says, `EnvInfo`, is
`distcomm.launcher_env`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..store import Store

__all__ = ["InitMethod", "Rendezvous"]


@dataclass(frozen=True)
class InitMethod:
    """A parsed init_method URL; `url` is the URL without its query, for messages."""

    scheme: str
    url: str
    host: str | None = None
    port: int | None = None
    path: str | None = None
    rank: int | None = None
    world_size: int | None = None


@dataclass(frozen=True)
class Rendezvous:
    """The outcome of a rendezvous: a store shared by the job and this process's place.

    Attributes:
        store: the job's store; the caller owns it and closes it.
        rank, world_size: this process's rank and the number of processes.
        local_rank, local_world_size: the same on this host, None when unknown.
        master_addr, master_port: the TCPStore's address (None for file:// and store=).
        source: how it was found, for messages: "env://", "tcp://h:p", "file:///p",
            "store", the launcher that gave the rank ("Open MPI", "Slurm", ...), or that
            launcher and "(store address bootstrapped over MPI)".

    It is also the iterator torch's ``rendezvous`` returns: ``next(it)`` gives ``(store,
    rank, world_size)`` once; a second ``next`` raises RuntimeError, as torch's handlers
    do, since an init_method cannot rendezvous again.
    """

    store: Store
    rank: int
    world_size: int
    local_rank: int | None = None
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    source: str = "env://"
    _given: list[bool] = field(default_factory=list, init=False, repr=False, compare=False)

    def __iter__(self) -> Rendezvous:
        return self

    def __next__(self) -> tuple[Store, int, int]:
        if self._given:
            raise RuntimeError(
                f"this rendezvous ({self.source}) gave its (store, rank, world_size) "
                "already, and an init_method cannot rendezvous again: call rendezvous anew"
            )
        self._given.append(True)
        return self.store, self.rank, self.world_size
