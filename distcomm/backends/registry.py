"""The backend registry: built-ins, `register_backend`, and `distcomm.backends` entry points.

A record holds a backend's name, a lazy factory and the devices it serves. Built-ins
import their libraries only when used. Third-party packages register through the
`distcomm.backends` entry-point group: the entry point names a `Backend` subclass
(registered under its `name` and `devices`) or a callable taking no arguments that
calls `register_backend` itself. A plug-in that fails to load logs a warning.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import BackendUnavailableError
from ..store.base import Store
from .base import Backend, BackendOptions

__all__ = [
    "BackendRecord",
    "create_backend",
    "get_backend_record",
    "register_backend",
    "registered_backends",
]

log = logging.getLogger("distcomm.backends")  # the name users filter on, as before

ENTRY_POINT_GROUP = "distcomm.backends"
_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class BackendRecord:
    """One registered backend.

    Attributes:
        name: lower-case name ("tcp").
        factory: "module:Class" for a built-in (imported on first use) or a callable
            returning a Backend; a `Backend` subclass is made by its `from_options`.
        devices: the devices it serves ("cpu", "cuda").
        extended_api: how the factory is called, as in torch: with `BackendOptions` and
            the group's `pg_options` (True), or with `(store, rank, size, timeout)`.
    """

    name: str
    factory: str | Callable[..., Backend]
    devices: tuple[str, ...]
    extended_api: bool = False

    def load(self) -> Callable[..., Backend]:
        """The factory, importing a built-in's module if needed."""
        if callable(self.factory):
            return self.factory
        module, _, attr = self.factory.partition(":")
        return getattr(importlib.import_module(module), attr)

    def availability(self) -> str:
        """'' when the backend can run here, else why not and what to install."""
        try:
            factory = self.load()
        except ImportError as exc:  # a module of the backend is missing: a broken install
            return (
                f"its factory {self.factory} cannot be imported ({type(exc).__name__}: "
                f"{exc}): the package that provides it is installed incompletely; "
                f"reinstall it (`pip install --force-reinstall distcomm` for a built-in)"
            )
        if inspect.isclass(factory) and issubclass(factory, Backend):
            return "" if factory.is_available() else factory.unavailable_reason()
        return ""

    def create(self, options: BackendOptions, pg_options: Any = None) -> Backend:
        """Call the factory for one group, the way it was registered."""
        factory = self.load()
        if inspect.isclass(factory) and issubclass(factory, Backend):  # built-ins, plug-ins
            return factory.from_options(options, pg_options)
        if self.extended_api:
            return factory(options, pg_options)
        return factory(options.store, options.group_rank, options.group_size, options.timeout)


class _Registry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: dict[str, BackendRecord] = {}
        self.plugins_loaded = False


_registry = _Registry()


def _normalise_devices(devices: str | Sequence[str] | None) -> tuple[str, ...]:
    if devices is None:
        return _DEVICES
    items = (devices,) if isinstance(devices, str) else tuple(devices)
    for device in items:
        if device not in _DEVICES:
            raise ValueError(f"unknown device {device!r} for a backend: use 'cpu' and/or 'cuda'")
    if not items:
        raise ValueError("a backend must serve at least one device ('cpu' or 'cuda')")
    return items


def register_backend(
    name: str,
    func: Callable[..., Backend],
    extended_api: bool = False,
    devices: str | Sequence[str] | None = None,
) -> None:
    """Register a backend under `name` (torch.distributed.Backend.register_backend).

    Args:
        name: the name `init_process_group(backend=...)` will accept (case-insensitive).
        func: returns a `distcomm.backends.Backend` for one group: called as
            `func(store, rank, size, timeout)` (timeout in seconds), or with
            `extended_api=True` as `func(options, pg_options)` where `options` is a
            `BackendOptions` (store, group rank and size, timeout, group id, the group's
            global ranks), as torch calls its backends.
        extended_api: which of the two calls (torch's flag of the same name).
        devices: "cpu", "cuda" or both (default both).

    Raises:
        ValueError: the name is empty, malformed or already registered, or a device is unknown.
        TypeError: `func` is not callable.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"backend name must be an identifier such as 'mybackend', got {name!r}")
    if not callable(func):
        raise TypeError(f"backend factory for {name!r} must be callable, got {func!r}")
    record = BackendRecord(name.lower(), func, _normalise_devices(devices), bool(extended_api))
    with _registry.lock:
        if record.name in _registry.records:
            raise ValueError(f"a backend named {record.name!r} is already registered")
        _registry.records[record.name] = record


def _register_builtin(name: str, factory: str, devices: tuple[str, ...]) -> None:
    _registry.records[name] = BackendRecord(name, factory, devices, extended_api=True)


def _load_plugins() -> None:
    with _registry.lock:
        if _registry.plugins_loaded:
            return
        _registry.plugins_loaded = True
    from importlib.metadata import entry_points  # ~40 ms of imports: only when needed

    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            target = entry.load()
            if inspect.isclass(target) and issubclass(target, Backend):
                register_backend(target.name or entry.name, target, devices=target.devices)
            else:
                target()
        except Exception as exc:  # a broken plug-in must not break distcomm
            log.warning(
                "distcomm: backend plug-in %r (%s) failed to load: %s", entry.name, entry.value, exc
            )


def registered_backends() -> dict[str, BackendRecord]:
    """Every registered backend by name, plug-ins included."""
    _load_plugins()
    with _registry.lock:
        return dict(_registry.records)


def get_backend_record(name: str) -> BackendRecord:
    """The record of backend `name`.

    Raises:
        ValueError: no backend has that name; lists the registered ones.
    """
    key = name.lower() if isinstance(name, str) else None
    with _registry.lock:
        record = _registry.records.get(key)  # a built-in or already registered: no plug-in scan
    if record is not None:
        return record
    records = registered_backends()
    record = records.get(key)
    if record is None:
        raise ValueError(
            f"unknown backend {name!r}; registered backends: {', '.join(sorted(records))}"
        )
    return record


def create_backend(
    name: str,
    store: Store,
    rank: int,
    size: int,
    timeout: float,
    group_name: str,
    global_ranks: Sequence[int] | None = None,
    process_store: Store | None = None,
    setup_round: int | None = None,
) -> Backend:
    """Instantiate backend `name` for one group (`BackendRecord.create`).

    `global_ranks`: the group's ranks in the world, in group-rank order (default: 0..size-1);
    `process_store`: the job's store (`BackendOptions.process_store`); `setup_round`: the
    roll call's number of this set-up (`BackendOptions.setup_round`).

    Raises:
        BackendUnavailableError: the backend cannot run here; says what to install.
    """
    record = get_backend_record(name)
    reason = record.availability()
    if reason:
        raise BackendUnavailableError(f"backend {record.name!r} is not available: {reason}")
    ranks = tuple(global_ranks) if global_ranks is not None else tuple(range(size))
    backend = record.create(
        BackendOptions(store, rank, size, timeout, group_name, ranks, process_store, setup_round)
    )
    if not isinstance(backend, Backend):
        raise TypeError(
            f"backend {record.name!r} factory returned {type(backend).__name__}, "
            "not a distcomm.backends.Backend"
        )
    return backend


_register_builtin("tcp", "distcomm.backends.tcp:TcpBackend", ("cpu",))
_register_builtin("gloo", "distcomm.backends.gloo:GlooBackend", ("cpu", "cuda"))
_register_builtin("mpi", "distcomm.backends.mpi:MpiBackend", ("cpu", "cuda"))
_register_builtin("nccl", "distcomm.backends.nccl:NcclBackend", ("cuda",))
