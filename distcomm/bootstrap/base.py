"""The bootstrap's data types, and the helpers that say where a value came from.

`EnvInfo` is what the arguments and the environment say about this process, `InitMethod`
a parsed init_method URL, `Rendezvous` the outcome (store, rank, world size). A value's
source is a variable name or a phrase ("rank= argument"); `launcher_of` names the
launcher behind a variable and `describe` adds it for messages.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass, field

from ..store import Store

__all__ = ["EnvInfo", "InitMethod", "Rendezvous"]

_LAUNCHER_PREFIXES = (
    ("OMPI_", "Open MPI"),
    ("PMIX_", "PMIx"),
    ("PMI_", "MPICH"),
    ("MPI_LOCAL", "MPICH"),
    ("SLURM_", "Slurm"),
)


@dataclass(frozen=True)
class EnvInfo:
    """What the arguments and the environment say about this process's place in the job.

    Attributes:
        rank, world_size, local_rank, local_world_size: None where nothing said.
        master_addr, master_port: where the store is served; None where unknown.
        sources: (value name, where it came from) pairs: a variable name such as
            ``OMPI_COMM_WORLD_RANK``, or ``rank= argument``, ``tcp:// URL``, ...
        srun: srun started this process as one task of its step (see
            `distcomm.bootstrap.slurm`): its values come from Slurm's step variables,
            not from MPI's.
    """

    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    sources: tuple[tuple[str, str], ...] = ()
    srun: bool = False

    def source_of(self, name: str) -> str | None:
        """Where the value `name` (``"rank"``, ``"master_port"``, ...) came from, or None."""
        return dict(self.sources).get(name)

    @property
    def launcher(self) -> str | None:
        """The launcher whose variable gave the rank ("Open MPI", "Slurm", ...), or None."""
        source = self.source_of("rank")
        return None if source is None else launcher_of(source)


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


def launcher_of(source: str) -> str | None:
    """The launcher that exports the variable `source` ("Open MPI", "torch style", ...), or
    None for a source that is no launcher's variable ("rank= argument", ...)."""
    for prefix, launcher in _LAUNCHER_PREFIXES:
        if source.startswith(prefix):
            return launcher
    if source in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        return "torch style"
    return None


def describe(source: str) -> str:
    """`source` for messages: ``OMPI_COMM_WORLD_RANK (Open MPI)``, ``rank= argument``."""
    launcher = launcher_of(source)
    return source if launcher is None else f"{source} ({launcher})"


def parse_int(name: str, raw: str) -> int:
    """The integer a variable `name` holds as `raw` (spaces around it allowed).

    Raises:
        ValueError: `raw` is not a whole number; the message names the variable.
    """
    text = raw.strip()
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        raise ValueError(f"{name}={raw!r} is not an integer: set {name} to a whole number")
    return int(text)


def optional_int(name: str, value: object, lowest: int) -> int | None:
    """An explicit rank/world_size argument: None or -1 mean 'not given'."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value == -1:
        return None
    if value < lowest:
        raise ValueError(
            f"{name}={value} is invalid: pass a value >= {lowest}, or -1 (the "
            f"default) to take it from the environment"
        )
    return int(value)
