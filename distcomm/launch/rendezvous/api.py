"""The rendezvous contract between the elastic agent and its rendezvous backends.

A `RendezvousHandler` gathers the agents (nodes) of a run into numbered rounds. The
agent calls `next_rendezvous()` to join the next round; it returns once the round is
complete with this node's group rank, the number of nodes and stores for the round and
the run. While its workers run, the agent polls `watch()` (closed? nodes that want to
join: a scale-up? is this node's round over?) and ends with `shutdown()`.

Also here, as in torch's api: `RendezvousParameters` (with torch's checks and option
parsing), `RendezvousHandlerRegistry` and its instance `rendezvous_handler_registry`
(name -> handler creator, entry points looked up by name), and the plug-in interface
`RendezvousBackend` (a state blob swapped by fencing token) with `RendezvousTimeout`.
A backend is called by the chair node only, O(1) times per change of the state.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ...config import positive_seconds
from ...errors import DistError, DistTimeoutError
from ...store import PrefixStore, Store
from ..wording import given, torch_message
from .checks import check_node_counts

__all__ = [
    "RendezvousBackend",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousHandler",
    "RendezvousHandlerCreator",
    "RendezvousHandlerRegistry",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousStateError",
    "RendezvousTimeout",
    "RendezvousTimeoutError",
    "RoundView",
    "Token",
    "check_node_counts",
    "rendezvous_handler_registry",
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


class RendezvousStateError(RendezvousError):
    """The stored rendezvous state is corrupt (bytes that are not one, written by another
    program or a broken backend)."""


class RendezvousGracefulExitError(RendezvousError):
    """This node was left out of the round and should exit without counting as a failure
    (torch's name; distcomm's handlers put a late node on the wait list instead)."""


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


_TRUE_WORDS = ("1", "true", "t", "yes", "y", "on")
_FALSE_WORDS = ("0", "false", "f", "no", "n", "off")


class RendezvousParameters:
    """What a rendezvous handler is built from (torch's RendezvousParameters): the
    launcher's flags, or a caller's own values.

    Args:
        backend: the backend's name (static, c10d, etcd, file or a registered one).
        endpoint: --rdzv_endpoint ("host:port" for c10d and etcd, a path for file; for
            static node 0's "host:port", or "" to use master_addr/master_port).
        run_id: --rdzv_id: agents with the same id join the same run.
        min_nodes, max_nodes: from --nnodes=MIN:MAX.
        local_addr: --local_addr: the address other nodes reach this node at, or None.
        config: --rdzv_conf key=value pairs (join_timeout, last_call_timeout,
            close_timeout, read_timeout, is_host, ...); merged with `kwargs`.
        node_rank: --node_rank (static only; -1 when not given).
        master_addr, master_port: --master_addr/--master_port (static only; None and 0
            when not given).
        auth_key: the key of the TCPStores a backend hosts or reaches (static, c10d), or
            None for DISTCOMM_AUTH_KEY (see TCPStore).
        from_flags: the values came from distcomm-run's command line (the agent sets it):
            errors name the flags (``--nnodes``, ``--rdzv_conf join_timeout=...``) instead
            of the parameters and options (``min_nodes``, ``join_timeout``).
        **kwargs: more backend options, as torch takes them (``rank=0``, ``timeout=60``,
            ``is_host="true"``...): they go into `config`, values of any type.

    Raises:
        ValueError: the backend name is empty, min_nodes < 1 or max_nodes < min_nodes
            (torch's checks and sentences, then the parameter or flag).
        TypeError: a node count is not an integer.
    """

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        *,
        config: dict[str, Any] | None = None,
        node_rank: int = -1,
        master_addr: str | None = None,
        master_port: int = 0,
        auth_key: bytes | None = None,
        from_flags: bool = False,
        **kwargs: Any,
    ) -> None:
        if not backend or not isinstance(backend, str):
            raise ValueError(
                torch_message(
                    "The rendezvous backend name must be a non-empty string.",
                    given("backend", backend, from_flags),
                    "name static, c10d, etcd, etcd-v2, file or a registered backend",
                )
            )
        check_node_counts(min_nodes, max_nodes, from_flags=from_flags)
        self.backend = backend
        self.endpoint = endpoint
        self.run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.local_addr = local_addr
        self.config: dict[str, Any] = {**(config or {}), **kwargs}
        self.node_rank = node_rank
        self.master_addr = master_addr
        self.master_port = master_port
        self.auth_key = auth_key
        self.from_flags = from_flags

    def __repr__(self) -> str:
        return (
            f"RendezvousParameters(backend={self.backend!r}, endpoint={self.endpoint!r}, "
            f"run_id={self.run_id!r}, min_nodes={self.min_nodes}, max_nodes={self.max_nodes}, "
            f"local_addr={self.local_addr!r}, config={self.config!r})"
        )

    def get(self, key: str, default: Any = None) -> Any:
        """The value of option `key` as given (any type), or `default`."""
        return self.config.get(key, default)

    def get_as_float(self, key: str, default: float) -> float:
        """An option in seconds (> 0): a number or its text.

        Raises:
            ValueError: the value is not a positive number; the message names the option.
        """
        raw = self.config.get(key)
        if raw is None:
            return default
        try:
            return positive_seconds(f"--rdzv_conf {key}" if self.from_flags else key, raw)
        except TypeError as exc:
            raise ValueError(str(exc)) from None

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        """An option as an integer (torch's parsing: an int, or text `int()` reads, blanks
        around it allowed), `default` when not given (None stays None).

        Raises:
            ValueError: the value does not represent an integer: torch's sentence, then
                the option.
        """
        value = self.config.get(key, default)
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(
                torch_message(
                    f"The rendezvous configuration option '{key}' does not represent a valid "
                    "integer value.",
                    given(key, value, self.from_flags),
                    "give a whole number",
                )
            ) from None

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        """An option as a boolean, `default` when not given (None stays None). torch's
        parsing: a bool; the int 1 or 0; text 1/0, true/false, t/f, yes/no, y/n in any
        case; and on/off, with blanks around it.

        Raises:
            ValueError: the value is none of those: torch's sentence, then the option.
        """
        value = self.config.get(key, default)
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str):
            word = value.strip().lower()
            if word in _TRUE_WORDS:
                return True
            if word in _FALSE_WORDS:
                return False
        raise ValueError(
            torch_message(
                f"The rendezvous configuration option '{key}' does not represent a valid "
                "boolean value.",
                given(key, value, self.from_flags),
                "use true/false, t/f, yes/no, y/n, 1/0 or on/off",
            )
        )


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


#: What a backend's `get_state`/`set_state` hand back with the state: an opaque fencing
#: token (any value; the backend alone interprets it).
Token = Any


class RendezvousBackend(ABC):
    """Where a dynamic rendezvous keeps its state blob: torch's plug-in interface.

    A backend holds one byte string per run and swaps it by fencing token. Implement it
    to keep the state somewhere distcomm does not (a database, a cloud key-value store),
    and hand it to `DynamicRendezvousHandler.from_backend` or `create_handler` with a
    `Store` for everything else. Only the chair node (see `chair.py`) calls these
    methods, once when it takes the chair and once per write, so a backend costs O(1)
    calls per round whatever the number of nodes; the other nodes never touch it.
    """

    @property
    @abstractmethod
    def name(self) -> str:
        """The backend's name (`get_backend()` of its handlers; the registry checks it
        against the name it was registered under)."""

    @abstractmethod
    def get_state(self) -> tuple[bytes, Token] | None:
        """The stored state and its fencing token, or None when no state is stored.

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
            RendezvousStateError: the stored state is corrupt.
        """

    @abstractmethod
    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Store `state` if `token` is the stored state's token (with None: if no state
        is stored). Returns the stored state, its token and whether this call wrote it
        (a stale or foreign token writes nothing and returns what is stored), or None
        when nothing is stored.

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
            RendezvousStateError: the stored state is corrupt.
        """


class RendezvousTimeout:
    """The timeouts of a dynamic rendezvous (torch's RendezvousTimeout), each a timedelta
    or None for its default.

    Args:
        join: `next_rendezvous` (default 600 s).
        last_call: how long a round with min_nodes keeps gathering (default 30 s).
        close: `set_closed` and `shutdown` (default 30 s).
        heartbeat: one keep-alive write (default 5 s; distcomm's writes take the store's
            timeout, so this one is only checked).

    Raises:
        ValueError: a timeout is not positive (torch's sentence, then the argument).
        TypeError: a timeout is neither a timedelta nor None.
    """

    _DEFAULTS = {"join": 600.0, "last_call": 30.0, "close": 30.0, "heartbeat": 5.0}

    def __init__(
        self,
        join: timedelta | None = None,
        last_call: timedelta | None = None,
        close: timedelta | None = None,
        heartbeat: timedelta | None = None,
    ) -> None:
        timeouts = {"join": join, "last_call": last_call, "close": close, "heartbeat": heartbeat}
        for name, given_value in timeouts.items():
            value = given_value
            if value is None:
                value = timedelta(seconds=self._DEFAULTS[name])
            elif not isinstance(value, timedelta):
                raise TypeError(f"the {name} timeout must be a timedelta, got {value!r}")
            if value <= timedelta(0):
                raise ValueError(
                    torch_message(
                        f"The {name} timeout ({value}) must be positive.",
                        given(name, given_value),
                        f"give a positive timedelta, or None for the default "
                        f"({self._DEFAULTS[name]:g} s)",
                    )
                )
            setattr(self, f"_{name}", value)

    @property
    def join(self) -> timedelta:
        """The join timeout."""
        return self._join  # type: ignore[attr-defined, no-any-return]

    @property
    def last_call(self) -> timedelta:
        """The last-call timeout."""
        return self._last_call  # type: ignore[attr-defined, no-any-return]

    @property
    def close(self) -> timedelta:
        """The close timeout."""
        return self._close  # type: ignore[attr-defined, no-any-return]

    @property
    def heartbeat(self) -> timedelta:
        """The heartbeat timeout."""
        return self._heartbeat  # type: ignore[attr-defined, no-any-return]


#: What a registered backend provides: RendezvousParameters in, a handler out.
RendezvousHandlerCreator = Callable[[RendezvousParameters], RendezvousHandler]

#: The entry-point groups a package declares rendezvous handlers in: each entry point
#: loads a function that returns the creator (torch's shape), registered under the entry
#: point's name the first time that name is asked for. distcomm's own group first.
HANDLER_ENTRY_POINT_GROUPS = ("distcomm.rendezvous_handlers", "torchrun.handlers")


class RendezvousHandlerRegistry:
    """Backend name -> handler creator (torch's RendezvousHandlerRegistry).

    `rendezvous_handler_registry` is the instance distcomm-run uses (the built-ins static,
    c10d, etcd, etcd-v2 and file are registered in it); `register_rendezvous_backend` and
    `get_rendezvous_handler` are its `register` and `create_handler`. A name nobody
    registered is looked up in the entry-point groups `HANDLER_ENTRY_POINT_GROUPS`.
    Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registry: dict[str, RendezvousHandlerCreator] = {}

    def register(self, backend: str, creator: RendezvousHandlerCreator) -> None:
        """Make `backend` create its handlers with `creator(params)`. Registering the same
        creator again does nothing.

        Raises:
            ValueError: the name is empty, or already registered with another creator.
            TypeError: `creator` is not callable.
        """
        if not backend or not isinstance(backend, str):
            raise ValueError(
                torch_message(
                    "The rendezvous backend name must be a non-empty string.",
                    given("backend", backend),
                    "name the backend its handlers' get_backend() returns",
                )
            )
        if not callable(creator):
            raise TypeError(
                f"the creator of rendezvous backend {backend!r} must be callable, "
                f"got {type(creator).__name__}"
            )
        with self._lock:
            current = self._registry.get(backend)
            if current is not None and current != creator:
                raise ValueError(
                    torch_message(
                        f"The rendezvous backend '{backend}' cannot be registered with "
                        f"'{creator}' as it is already registered with '{current}'.",
                        given("backend", backend),
                        "register the new creator under another name",
                    )
                )
            self._registry[backend] = creator

    def names(self, entry_points: bool = False) -> list[str]:
        """The registered names, sorted; with `entry_points`, also the names declared in
        the entry-point groups (not loaded)."""
        with self._lock:
            names = set(self._registry)
        if entry_points:
            names.update(entry.name for entry in _entry_points())
        return sorted(names)

    def load_entry_point(
        self, name: str, from_flags: bool = False
    ) -> RendezvousHandlerCreator | None:
        """Register the creator of entry point `name` (the first group that declares it)
        and return it; None when no group declares the name.

        Args:
            from_flags: `name` came from --rdzv_backend: the message names the flag.

        Raises:
            ValueError: the entry point fails to load or to give a creator.
        """
        for entry in _entry_points():
            if entry.name != name:
                continue
            try:
                creator = entry.load()()
                self.register(name, creator)
            except Exception as exc:  # a broken plug-in: say which
                raise ValueError(
                    f"{given('backend', name, from_flags)}: the entry point {entry.value!r} "
                    f"of group {entry.group!r} failed to give a handler creator: {exc}"
                ) from exc
            return creator  # type: ignore[no-any-return]
        return None

    def create_handler(self, params: RendezvousParameters) -> RendezvousHandler:
        """A handler for `params.backend`.

        Raises:
            ValueError: the backend is not registered (torch's sentence, then the
                registered ones), or a parameter is bad (the message names it).
            RuntimeError: the handler's `get_backend()` is not the name it was asked by.
            TypeError: the creator returned something that is not a RendezvousHandler.
            RendezvousError: the backend cannot be set up.
        """
        with self._lock:
            creator = self._registry.get(params.backend)
        from_flags = getattr(params, "from_flags", False)  # torch's own parameters too
        if creator is None:
            creator = self.load_entry_point(params.backend, from_flags)
        if creator is None:
            raise ValueError(
                torch_message(
                    f"The rendezvous backend '{params.backend}' is not registered. Did you "
                    f"forget to call `{self.register.__name__}`?",
                    given("backend", params.backend, from_flags),
                    f"the registered ones are {', '.join(self.names()) or 'none'} (add one "
                    "with register_rendezvous_backend, rendezvous_handler_registry.register "
                    f"or the entry-point group {HANDLER_ENTRY_POINT_GROUPS[0]!r})",
                )
            )
        handler = creator(params)
        if not isinstance(handler, RendezvousHandler):
            raise TypeError(
                f"rendezvous backend {params.backend!r} returned "
                f"{type(handler).__name__}, not a RendezvousHandler"
            )
        if handler.get_backend() != params.backend:
            raise RuntimeError(
                torch_message(
                    f"The rendezvous backend '{handler.get_backend()}' does not match the "
                    f"requested backend '{params.backend}'.",
                    given("backend", params.backend, from_flags),
                    f"the creator registered as {params.backend!r} must return a handler "
                    "whose get_backend() says so",
                )
            )
        return handler


def _entry_points() -> list[Any]:
    from importlib import metadata  # ~40 ms of imports: only when a plug-in is looked up

    return [
        entry
        for group in HANDLER_ENTRY_POINT_GROUPS
        for entry in metadata.entry_points(group=group)
    ]


#: The registry distcomm-run creates its handlers with.
rendezvous_handler_registry = RendezvousHandlerRegistry()
