"""The rendezvous contract between the elastic agent and its rendezvous backends.

A `RendezvousHandler` gathers the agents (nodes) of a run into numbered rounds. The
agent calls `next_rendezvous()` to join the next round; it returns once the round is
complete with this node's group rank, the number of nodes and stores for the round and
the run. While its workers run, the agent polls `watch()` (closed? nodes that want to
join: a scale-up? is this node's round over?) and ends with `shutdown()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from ...config import parse_bool, positive_seconds
from ...errors import DistError, DistTimeoutError
from ...store import PrefixStore, Store

__all__ = [
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousTimeoutError",
    "RoundView",
]


class RendezvousError(DistError):
    """A rendezvous could not be formed (bad configuration, unreachable store...)."""


class RendezvousClosedError(RendezvousError):
    """The rendezvous is closed: the run is over and no new round will form."""


class RendezvousTimeoutError(RendezvousError, DistTimeoutError):
    """A round did not complete within the join timeout (also a `DistTimeoutError`, hence a
    `TimeoutError`, like every timeout distcomm raises)."""


class RendezvousConnectionError(RendezvousError, ConnectionError):
    """The rendezvous store could not be reached, hosted or used."""


@dataclass(frozen=True)
class RendezvousInfo:
    """One completed round, as seen by one node.

    Attributes:
        store: a store for this round only (a PrefixStore), shared by the round's nodes.
        run_store: a store shared by every node of the run across rounds.
        rank: this node's group rank in the round, 0..world_size-1.
        world_size: the number of nodes in the round.
        round: the round's number (increases by one for each round formed).
        bootstrap_address: (host, port) of a TCPStore the backend already serves and the
            workers may use (static and c10d), or None (etcd, file).
    """

    store: Store
    run_store: Store
    rank: int
    world_size: int
    round: int
    bootstrap_address: tuple[str, int] | None = None

    @classmethod
    def for_round(
        cls,
        store: Store,
        run_id: str,
        round: int,
        rank: int,
        world_size: int,
        bootstrap_address: tuple[str, int] | None = None,
    ) -> RendezvousInfo:
        """A round's info with the namespaces every backend uses in `store`:
        ``/rdzv/<run_id>/round_<round>`` for the round, ``/rdzv/<run_id>/run`` for the run."""
        root = f"/rdzv/{run_id}"
        return cls(
            store=PrefixStore(f"{root}/round_{round}", store),
            run_store=PrefixStore(f"{root}/run", store),
            rank=rank,
            world_size=world_size,
            round=round,
            bootstrap_address=bootstrap_address,
        )


@dataclass(frozen=True)
class RoundView:
    """What a node running a round needs to know about the rendezvous (one `watch()`).

    Attributes:
        closed: the rendezvous is closed.
        nodes_waiting: `num_nodes_waiting()`: > 0 means the agent should join a new round.
        round_over: this node's round is over for everyone: a newer round began, or a node
            of the round left it (dropped for missed heartbeats, or shut down). Unlike
            nodes waiting to join, this also ends an agent's wait at the exit barrier: the
            round's work cannot complete.
    """

    closed: bool = False
    nodes_waiting: int = 0
    round_over: bool = False


@dataclass
class RendezvousParameters:
    """What the launcher's flags say about the rendezvous.

    Attributes:
        backend: static, c10d, etcd or file.
        endpoint: --rdzv_endpoint ("host:port" for c10d and etcd, a path for file, "" for
            static, which uses master_addr/master_port).
        run_id: --rdzv_id: agents with the same id join the same run.
        min_nodes, max_nodes: from --nnodes=MIN:MAX.
        local_addr: --local_addr: the address other nodes reach this node at, or None.
        config: --rdzv_conf key=value pairs (join_timeout, last_call_timeout,
            close_timeout, read_timeout, is_host, ...), values as given.
        node_rank: --node_rank (static only; -1 when not given).
        master_addr, master_port: --master_addr/--master_port (static only; port 0 when not
            given).
        auth_key: the key of the TCPStores a backend hosts or reaches (static, c10d), or
            None for DISTCOMM_AUTH_KEY (see TCPStore).
    """

    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None = None
    config: dict[str, str] = field(default_factory=dict)
    node_rank: int = -1
    master_addr: str | None = None
    master_port: int = 0
    auth_key: bytes | None = None

    def get(self, key: str, default: str | None = None) -> str | None:
        """The --rdzv_conf value of `key`, or `default`."""
        return self.config.get(key, default)

    def get_as_float(self, key: str, default: float) -> float:
        """A --rdzv_conf value in seconds (> 0).

        Raises:
            ValueError: the value is not a positive number; the message names the key.
        """
        raw = self.config.get(key)
        if raw is None:
            return default
        return positive_seconds(f"--rdzv_conf {key}", raw)

    def get_as_int(self, key: str, default: int) -> int:
        """A --rdzv_conf whole number (>= 1).

        Raises:
            ValueError: the value is not an integer >= 1; the message names the key.
        """
        raw = self.config.get(key)
        if raw is None:
            return default
        try:
            value = int(raw.strip())
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"--rdzv_conf {key}={raw!r} must be a whole number >= 1")
        return value

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        """A --rdzv_conf boolean (1/0, true/false, yes/no, on/off), or `default`.

        Raises:
            ValueError: the value is not a boolean; the message names the key.
        """
        raw = self.config.get(key)
        if raw is None:
            return default
        return parse_bool(f"--rdzv_conf {key}", raw, empty=None)


class RendezvousHandler(ABC):
    """One node's handle on a run's rendezvous (torch's RendezvousHandler)."""

    @abstractmethod
    def get_backend(self) -> str:
        """The backend's name (static, c10d, etcd, file)."""

    @abstractmethod
    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and wait until it is complete.

        Raises:
            RendezvousClosedError: the rendezvous was closed.
            RendezvousTimeoutError: the round did not complete within join_timeout.
            RendezvousError: anything else that stops the round (the message says what).
        """

    @abstractmethod
    def is_closed(self) -> bool:
        """Whether the rendezvous is closed."""

    @abstractmethod
    def set_closed(self) -> None:
        """Close the rendezvous: every node's next `next_rendezvous` raises
        RendezvousClosedError."""

    @abstractmethod
    def num_nodes_waiting(self) -> int:
        """How many nodes wait to join a round after the current one (0 for static)."""

    def watch(self) -> RoundView:
        """The rendezvous as seen while this node's round runs (default: `is_closed()` and
        `num_nodes_waiting()`, the round never over; backends may read it all at once).

        Raises:
            RendezvousError: the store failed.
        """
        return RoundView(closed=self.is_closed(), nodes_waiting=self.num_nodes_waiting())

    @abstractmethod
    def get_run_id(self) -> str:
        """The run id (--rdzv_id)."""

    @abstractmethod
    def shutdown(self) -> bool:
        """Leave the rendezvous and release its resources (heartbeats, owned stores).

        Returns whether this node left cleanly. Does not close the rendezvous for others.
        """
