"""Rendezvous for the elastic agent: the contract, the static rendezvous and the dynamic
one (c10d, etcd and file stores, or a plug-in `RendezvousBackend`), reached through
`get_rendezvous_handler` / `rendezvous_handler_registry`.

torch's module paths are here too, for ported code: `dynamic_rendezvous`,
`c10d_rendezvous_backend`, `etcd_rendezvous_backend`, `static_tcp_rendezvous`, `utils`.
"""

from .api import (
    RendezvousBackend,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousHandlerCreator,
    RendezvousHandlerRegistry,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeout,
    RendezvousTimeoutError,
    RoundView,
    rendezvous_handler_registry,
)
from .dynamic import DynamicRendezvousHandler
from .dynamic_rendezvous import create_handler
from .registry import (
    _register_out_of_tree_handlers,  # noqa: F401  (torch's name, for ported code)
    get_rendezvous_handler,
    register_rendezvous_backend,
    registered_rendezvous_backends,
)
from .settings import RendezvousSettings
from .static import StaticRendezvous

__all__ = [
    "DynamicRendezvousHandler",
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
    "RendezvousSettings",
    "RendezvousStateError",
    "RendezvousTimeout",
    "RendezvousTimeoutError",
    "RoundView",
    "StaticRendezvous",
    "create_handler",
    "get_rendezvous_handler",
    "register_rendezvous_backend",
    "registered_rendezvous_backends",
    "rendezvous_handler_registry",
]
