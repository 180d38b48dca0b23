"""The rendezvous backend registry: backend name -> handler creator, with the built-ins.

One registry, torch's `rendezvous_handler_registry` (`api.RendezvousHandlerRegistry`):
`register_rendezvous_backend` and `get_rendezvous_handler` are its `register` and
`create_handler`, under distcomm's names. Built in: static, c10d, etcd and file (their
state in the rendezvous store itself), and etcd-v2 (torch's name for the dynamic
rendezvous over `EtcdRendezvousBackend`). A package adds one through the entry-point
groups ``distcomm.rendezvous_handlers`` or torch's ``torchrun.handlers`` (an entry point
loads a function that returns the creator), looked up the first time its name is asked.
"""

from __future__ import annotations

import logging

from .api import (
    RendezvousHandler,
    RendezvousHandlerCreator,
    RendezvousParameters,
    _entry_points,
    rendezvous_handler_registry,
)
from .backends import create_c10d_handler, create_etcd_handler, create_file_handler
from .dynamic_rendezvous import create_handler
from .static import create_static_handler

__all__ = [
    "get_rendezvous_handler",
    "register_rendezvous_backend",
    "registered_rendezvous_backends",
]

log = logging.getLogger("distcomm.launch.rendezvous")

#: What a backend provides: RendezvousParameters in, a handler out.
HandlerFactory = RendezvousHandlerCreator


def register_rendezvous_backend(name: str, factory: HandlerFactory) -> None:
    """Make --rdzv_backend=`name` create its handlers with `factory(params)`; the handler's
    `get_backend()` must return `name`. Registering the same factory again does nothing.

    Raises:
        ValueError: `name` is empty, or already registered with another factory.
        TypeError: `factory` is not callable.
    """
    rendezvous_handler_registry.register(name, factory)


def registered_rendezvous_backends() -> list[str]:
    """The names --rdzv_backend accepts, sorted: registered ones and those an installed
    package declares in an entry-point group (loaded when first used)."""
    return rendezvous_handler_registry.names(entry_points=True)


def get_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandler:
    """A handler for `params.backend` (static, c10d, etcd, etcd-v2, file or a registered one).

    Raises:
        ValueError: the backend is unknown (the message lists the known ones) or a
            parameter is bad (the message names the flag).
        RuntimeError: the handler's `get_backend()` is not `params.backend`.
        RendezvousError: the backend's store cannot be set up.
    """
    return rendezvous_handler_registry.create_handler(params)


def _create_etcd_v2_handler(params: RendezvousParameters) -> RendezvousHandler:
    from .etcd_rendezvous_backend import create_backend

    backend, store = create_backend(params)
    try:
        return create_handler(store, backend, params, owned_store=store)
    except BaseException:
        store.close()
        raise


def _register_out_of_tree_handlers() -> None:
    """Register every creator the entry-point groups declare now (torch's eager form; the
    registry otherwise loads one when its name is first asked for). A plug-in that fails
    to load is logged and skipped."""
    for entry in _entry_points():
        try:
            rendezvous_handler_registry.register(entry.name, entry.load()())
        except Exception:
            log.warning(
                "rendezvous plug-in %r (%s, group %s) failed to load: skipped",
                entry.name,
                entry.value,
                entry.group,
                exc_info=True,
            )


register_rendezvous_backend("static", create_static_handler)
register_rendezvous_backend("c10d", create_c10d_handler)
register_rendezvous_backend("etcd", create_etcd_handler)
register_rendezvous_backend("etcd-v2", _create_etcd_v2_handler)
register_rendezvous_backend("file", create_file_handler)
