"""Rendezvous for the elastic agent: the contract, the static rendezvous and the dynamic
one (c10d, etcd and file stores), reached through `get_rendezvous_handler`."""

from .api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
    RoundView,
)
from .dynamic import DynamicRendezvousHandler, create_handler
from .registry import (
    get_rendezvous_handler,
    register_rendezvous_backend,
    registered_rendezvous_backends,
)
from .settings import RendezvousSettings
from .static import StaticRendezvous

__all__ = [
    "DynamicRendezvousHandler",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousSettings",
    "RendezvousTimeoutError",
    "RoundView",
    "StaticRendezvous",
    "create_handler",
    "get_rendezvous_handler",
    "register_rendezvous_backend",
    "registered_rendezvous_backends",
]
