"""The rendezvous backend registry: backend name -> handler factory, with the built-ins."""

from __future__ import annotations

import threading
from collections.abc import Callable

from .api import RendezvousHandler, RendezvousParameters
from .backends import create_c10d_handler, create_etcd_handler, create_file_handler
from .static import create_static_handler

__all__ = ["get_rendezvous_handler", "register_rendezvous_backend",
           "registered_rendezvous_backends"]

#: What a backend provides: RendezvousParameters in, a handler out.
HandlerFactory = Callable[[RendezvousParameters], RendezvousHandler]

_lock = threading.Lock()
_factories: dict[str, HandlerFactory] = {}


def register_rendezvous_backend(name: str, factory: HandlerFactory) -> None:
    """Make --rdzv_backend=`name` create its handlers with `factory(params)`.

    Registering the same factory again does nothing.

    Raises:
        ValueError: `name` is empty, or already registered with another factory.
        TypeError: `factory` is not callable.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a rendezvous backend needs a non-empty name, got {name!r}")
    if not callable(factory):
        raise TypeError(f"the factory of rendezvous backend {name!r} must be callable, got "
                        f"{type(factory).__name__}")
    with _lock:
        current = _factories.get(name)
        if current is not None and current is not factory:
            raise ValueError(f"rendezvous backend {name!r} is already registered with "
                             f"another factory ({current!r})")
        _factories[name] = factory


def registered_rendezvous_backends() -> list[str]:
    """The names --rdzv_backend accepts, sorted."""
    with _lock:
        return sorted(_factories)


def get_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandler:
    """A handler for `params.backend` (static, c10d, etcd, file or a registered one).

    Raises:
        ValueError: the backend is unknown (the message lists the known ones) or a
            parameter is bad (the message names the flag).
        RendezvousError: the backend's store cannot be set up.
    """
    with _lock:
        factory = _factories.get(params.backend)
        known = ", ".join(sorted(_factories))
    if factory is None:
        raise ValueError(f"--rdzv_backend={params.backend!r} is not a known rendezvous backend; "
                         f"the known ones are {known} (register others with "
                         "register_rendezvous_backend)")
    handler = factory(params)
    if not isinstance(handler, RendezvousHandler):
        raise TypeError(f"rendezvous backend {params.backend!r} returned "
                        f"{type(handler).__name__}, not a RendezvousHandler")
    return handler


register_rendezvous_backend("static", create_static_handler)
register_rendezvous_backend("c10d", create_c10d_handler)
register_rendezvous_backend("etcd", create_etcd_handler)
register_rendezvous_backend("file", create_file_handler)
