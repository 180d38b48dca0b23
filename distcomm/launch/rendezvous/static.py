"""The static rendezvous: a fixed number of nodes with given ranks meeting at node 0's TCPStore.

Node 0 hosts a TCPStore at --master_addr:--master_port; the others connect to it (retrying
until join_timeout, so nodes may start in any order). Every `next_rendezvous` is one round
(a restart): all nodes call it in step and meet at a barrier kept under
``/rdzv/<run_id>/barrier_<round>``. Nobody waits to join a static run, so
`num_nodes_waiting` is always 0.
"""

from __future__ import annotations

from ...deadline import Deadline
from ...errors import DistError, DistStoreTimeoutError
from ...net import format_address
from ...store import TCPStore
from ...store.base import publish
from ..wording import given, torch_message
from .api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from .backends import host_tcp_store, parse_endpoint
from .settings import conf_node_rank, settings_from_params

__all__ = ["DEFAULT_MASTER_ADDR", "StaticRendezvous", "create_static_handler"]

#: --master_addr when not given (torchrun's default)
DEFAULT_MASTER_ADDR = "127.0.0.1"
#: seconds between looks at the closed flag while waiting at the barrier
_BARRIER_SLICE = 1.0


class StaticRendezvous(RendezvousHandler):
    """A rendezvous of exactly `nnodes` nodes, node `node_rank` being this one.

    Args:
        run_id: --rdzv_id.
        nnodes: --nnodes (a single number).
        node_rank: --node_rank; may be left at -1 only when nnodes is 1.
        master_addr: --master_addr: where node 0's store is reached (default 127.0.0.1).
        master_port: --master_port; 0 picks a free port, allowed only when nnodes is 1.
        join_timeout: seconds a round (connecting to node 0 included) may take.
        close_timeout: seconds `set_closed` may take to reach the store.
        auth_key: the key of node 0's store, or None for DISTCOMM_AUTH_KEY.

    Raises:
        ValueError: a bad parameter; the message names it.
    """

    #: how messages name the arguments (`StaticTCPRendezvous` has torch's names)
    _ARGS = {"nnodes": "nnodes", "node_rank": "node_rank", "master_port": "master_port"}

    def __init__(
        self,
        run_id: str,
        nnodes: int,
        node_rank: int = -1,
        master_addr: str | None = None,
        master_port: int = 0,
        join_timeout: float = 600.0,
        close_timeout: float = 30.0,
        auth_key: bytes | None = None,
    ) -> None:
        n, r, p = (self._ARGS[arg] for arg in ("nnodes", "node_rank", "master_port"))
        if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
            raise ValueError(f"{n} must be an integer >= 1, got {nnodes!r}")
        if nnodes > 1 and node_rank < 0:
            raise ValueError(
                f"a static rendezvous of {n}={nnodes} nodes needs this node's {r} "
                f"(0..{nnodes - 1}), given on every node"
            )
        node_rank = 0 if node_rank < 0 else node_rank
        if node_rank >= nnodes:
            raise ValueError(
                f"{r}={node_rank} is out of range for {n}={nnodes}: use 0..{nnodes - 1}"
            )
        if (
            isinstance(master_port, bool)
            or not isinstance(master_port, int)
            or not 0 <= master_port <= 65535
        ):
            raise ValueError(f"{p}={master_port!r} must be an integer in 0..65535")
        if master_port == 0 and nnodes > 1:
            raise ValueError(
                f"a static rendezvous of {n}={nnodes} nodes needs {p}: every node must know "
                "the port of node 0's store (0, a free port, is for a single node)"
            )
        self._run_id = run_id
        self._nnodes = nnodes
        self._node_rank = node_rank
        self._master_addr = master_addr or DEFAULT_MASTER_ADDR
        self._master_port = master_port
        self._join_timeout = join_timeout
        self._close_timeout = close_timeout
        self._auth_key = auth_key
        self._store: TCPStore | None = None
        self._round = 0
        self._closed_key = f"/rdzv/{run_id}/closed"

    @property
    def _address(self) -> str:
        return format_address(self._master_addr, self._master_port)

    def _where(self) -> str:
        return f"the static rendezvous of run {self._run_id!r}"

    def _connect(self, deadline: Deadline) -> TCPStore:
        """Host (node 0) or reach node 0's store, once."""
        if self._store is not None:
            return self._store
        left = deadline.remaining() or 0.0
        try:
            if self._node_rank == 0:
                store = host_tcp_store(
                    self._master_addr, self._master_port, self._join_timeout, self._auth_key
                )
            else:
                store = TCPStore(
                    self._master_addr, self._master_port, timeout=left, auth_key=self._auth_key
                )
                store.set_timeout(self._join_timeout)
        except DistError as exc:
            if self._node_rank == 0:
                raise RendezvousConnectionError(
                    f"{self._where()}: node 0 cannot host the store at {self._address} "
                    f"(--master_addr/--master_port): {exc}"
                ) from exc
            error = RendezvousTimeoutError if deadline.expired() else RendezvousConnectionError
            raise error(
                f"{self._where()}: node {self._node_rank} cannot reach node 0's store at "
                f"{self._address} (--master_addr/--master_port) within {left:.1f} s: {exc}"
            ) from exc
        self._store = store
        return store

    def _check_closed(self, store: TCPStore) -> None:
        if store.check([self._closed_key]):
            raise RendezvousClosedError(
                f"{self._where()} is closed: the run is over or was "
                "stopped, and no new round will form"
            )

    def next_rendezvous(self) -> RendezvousInfo:
        """Meet the other nodes for the next round (every call is one round).

        Raises:
            RendezvousClosedError: the rendezvous was closed.
            RendezvousTimeoutError: not every node arrived within join_timeout.
            RendezvousConnectionError: node 0's store cannot be hosted or reached.
        """
        deadline = Deadline(self._join_timeout)
        store = self._connect(deadline)
        round_ = self._round
        self._round += 1
        base = f"/rdzv/{self._run_id}/barrier_{round_}"
        try:
            self._check_closed(store)
            if store.add(f"{base}/arrived", 1) >= self._nnodes:
                store.set(f"{base}/done", b"1")
            while True:
                try:
                    store.wait([f"{base}/done"], timeout=deadline.slice(_BARRIER_SLICE))
                    break
                except DistStoreTimeoutError as exc:
                    self._check_closed(store)
                    if deadline.expired():
                        arrived = store.add(f"{base}/arrived", 0)
                        raise RendezvousTimeoutError(
                            f"{self._where()}: only {arrived} of {self._nnodes} nodes arrived "
                            f"for round {round_} within join_timeout={self._join_timeout:g} s; "
                            "start every node with the same --nnodes, --master_addr and "
                            "--master_port, or raise join_timeout in --rdzv_conf"
                        ) from exc
        except RendezvousError:
            raise
        except DistError as exc:
            raise RendezvousConnectionError(
                f"{self._where()}: node 0's store at {self._address} failed: {exc}"
            ) from exc
        return RendezvousInfo.for_round(
            store,
            self._run_id,
            round_,
            self._node_rank,
            self._nnodes,
            (self._master_addr, store.port),
        )

    def get_backend(self) -> str:
        """'static'."""
        return "static"

    def get_run_id(self) -> str:
        """The run id (--rdzv_id)."""
        return self._run_id

    def is_closed(self) -> bool:
        """Whether a node closed the rendezvous (False before this node reached the store)."""
        if self._store is None:
            return False
        try:
            return self._store.check([self._closed_key])
        except DistError as exc:
            raise RendezvousConnectionError(f"{self._where()}: is_closed failed: {exc}") from exc

    def set_closed(self) -> None:
        """Close the rendezvous for every node.

        Raises:
            RendezvousConnectionError: node 0's store cannot be reached.
        """
        store = self._connect(Deadline(self._close_timeout))
        try:
            publish(store, self._closed_key, b"1")  # is_closed() anywhere sees it at once
        except DistError as exc:
            raise RendezvousConnectionError(f"{self._where()}: set_closed failed: {exc}") from exc

    def num_nodes_waiting(self) -> int:
        """Always 0: a static run takes no new nodes."""
        return 0

    def shutdown(self) -> bool:
        """Close this node's store (node 0 stops serving it); returns True."""
        store, self._store = self._store, None
        if store is not None:
            store.close()
        return True

    def __repr__(self) -> str:
        return (
            f"StaticRendezvous(run_id={self._run_id!r}, node {self._node_rank} of "
            f"{self._nnodes}, master={self._address})"
        )


def _node_rank(params: RendezvousParameters) -> int:
    """The node rank, else the option ``rank`` (torch's), else -1 (0 for a single node)."""
    if params.node_rank >= 0:
        return params.node_rank
    rank = conf_node_rank(params)
    return -1 if rank is None else rank


def _master(params: RendezvousParameters) -> tuple[str | None, int]:
    """Node 0's (host, port): master_addr/master_port when given, else the endpoint
    "HOST:PORT" (torch's static handler reads only the endpoint).

    Raises:
        ValueError: the endpoint has no port, or several nodes have no endpoint and no
            master_port (torch's sentences, then the parameter and what to do).
    """
    ff = params.from_flags
    endpoint = (params.endpoint or "").strip()
    if params.master_addr is not None or params.master_port or not endpoint:
        if not endpoint and not params.master_port and params.max_nodes > 1:
            raise ValueError(
                torch_message(
                    "endpoint is absent in RendezvousParametersTry add --master-port and "
                    "--master-addr to the cmd request",
                    given("endpoint", params.endpoint, ff),
                    f"give node 0's {given('endpoint', 'HOST:PORT', ff)}, or "
                    f"{given('master_addr', 'HOST', ff)} and {given('master_port', 'PORT', ff)}",
                )
            )
        return params.master_addr, params.master_port
    host, port = parse_endpoint(endpoint, -1, from_flags=ff)
    if port == -1:
        raise ValueError(
            torch_message(
                f"Port is absent in endpoint: {endpoint}. Try launching with --master-port",
                given("endpoint", params.endpoint, ff),
                "the static rendezvous needs node 0's HOST:PORT (or master_addr and master_port)",
            )
        )
    return host, port


def create_static_handler(params: RendezvousParameters) -> StaticRendezvous:
    """The static backend for `params`: node 0's store at master_addr:master_port, or at
    the endpoint "HOST:PORT" when those are not given; this node's rank from node_rank,
    or the option ``rank`` (torch's), which a single node may leave out (0).

    Raises:
        ValueError: an elastic node range, a missing rank, an endpoint without a port, or
            another bad parameter (torch's sentence where torch has one, then the
            parameter, or the flag when `params` came from distcomm-run's command line).
    """
    settings = settings_from_params(params)
    ff = params.from_flags
    if params.min_nodes != params.max_nodes:
        where = (
            given("min_nodes", f"{params.min_nodes}:{params.max_nodes}", ff)
            if ff
            else f"min_nodes={params.min_nodes}, max_nodes={params.max_nodes}"
        )
        raise ValueError(
            f"{where}: the static rendezvous needs a fixed number of nodes; use the c10d, "
            "etcd or file backend for an elastic range"
        )
    node_rank = _node_rank(params)
    if node_rank < 0 and params.max_nodes > 1:
        raise ValueError(
            torch_message(
                "rank is absent in RendezvousParameters.Try add --node-rank to the cmd request",
                "no --node_rank" if ff else "no node_rank, nor option rank",
                f"give each node its rank, 0..{params.max_nodes - 1}",
            )
        )
    master_addr, master_port = _master(params)
    return StaticRendezvous(
        run_id=params.run_id,
        nnodes=params.min_nodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        join_timeout=settings.join_timeout,
        close_timeout=settings.close_timeout,
        auth_key=params.auth_key,
    )
