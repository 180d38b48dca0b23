"""torch's module path `torch.distributed.elastic.rendezvous.dynamic_rendezvous`: the dynamic
handler, its plug-in backend interface and `create_handler(store, backend, params)`.

The implementation is `dynamic.py` (the handler), `chair.py` and `state.py` (how a round
is formed at O(1) store requests per node), `slot.py` (how a `RendezvousBackend` keeps
the state blob) and `api.py` (the interfaces).
"""

from __future__ import annotations

from .api import RendezvousBackend, RendezvousTimeout, Token
from .dynamic import DynamicRendezvousHandler, create_handler

__all__ = [
    "DynamicRendezvousHandler",
    "RendezvousBackend",
    "RendezvousTimeout",
    "Token",
    "create_handler",
]
