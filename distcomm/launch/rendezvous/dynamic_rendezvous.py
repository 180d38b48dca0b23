"""torch's module path `torch.distributed.elastic.rendezvous.dynamic_rendezvous`: the dynamic
handler, its plug-in backend interface, and the functions that build a handler from
`RendezvousParameters`: torch's `create_handler(store, backend, params)` and
`create_store_handler` (distcomm's c10d, etcd and file backends).

The implementation is `dynamic.py` (the handler), `client.py` and `keeper.py` (what a node
asks and reads; its heartbeat thread), `chair.py` and `state.py` (how a round is formed at
O(1) store requests per node), `slot.py` (how a `RendezvousBackend` keeps the state blob)
and `api.py` (the interfaces).
"""

from __future__ import annotations

from datetime import timedelta

from ...store import Store
from .api import RendezvousBackend, RendezvousParameters, RendezvousTimeout, Token
from .dynamic import DynamicRendezvousHandler
from .settings import conf_seconds, settings_from_params

__all__ = [
    "DynamicRendezvousHandler",
    "RendezvousBackend",
    "RendezvousTimeout",
    "Token",
    "create_handler",
    "create_store_handler",
]


def create_store_handler(
    store: Store,
    params: RendezvousParameters,
    bootstrap_address: tuple[str, int] | None = None,
    *,
    owned_store: Store | None = None,
    hosts_store: bool = False,
) -> DynamicRendezvousHandler:
    """A DynamicRendezvousHandler for `params` (the --rdzv_conf values checked) whose state
    lives in `store` itself (distcomm's c10d, etcd and file backends).

    Raises:
        ValueError: a bad parameter; the message names the flag.
    """
    settings = settings_from_params(params)
    return DynamicRendezvousHandler(
        run_id=params.run_id,
        store=store,
        backend_name=params.backend,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        join_timeout=settings.join_timeout,
        last_call_timeout=settings.last_call_timeout,
        close_timeout=settings.close_timeout,
        keep_alive_interval=settings.keep_alive_interval,
        keep_alive_max_attempt=settings.keep_alive_max_attempt,
        bootstrap_address=bootstrap_address,
        owned_store=owned_store,
        hosts_store=hosts_store,
    )


def create_handler(
    store: Store,
    backend: RendezvousBackend,
    params: RendezvousParameters,
    *,
    owned_store: Store | None = None,
) -> DynamicRendezvousHandler:
    """A handler for `params` whose state `backend` keeps (torch's `create_handler`):
    the options join_timeout, last_call_timeout, close_timeout, heartbeat_timeout,
    keep_alive_interval and keep_alive_max_attempt are read from `params` (other keys
    are the backend's and pass unread); see `DynamicRendezvousHandler.from_backend`.
    `owned_store` (distcomm's addition): a store the handler's `shutdown` closes.

    Raises:
        ValueError: a bad parameter; the message names the option.
        TypeError: `store` or `backend` is of the wrong kind.
    """
    settings = settings_from_params(params, known_keys_only=False)
    heartbeat = params.get("heartbeat_timeout")
    return DynamicRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        RendezvousTimeout(
            timedelta(seconds=settings.join_timeout),
            timedelta(seconds=settings.last_call_timeout),
            timedelta(seconds=settings.close_timeout),
            None
            if heartbeat is None
            else timedelta(seconds=conf_seconds(params, "heartbeat_timeout", 5.0)),
        ),
        keep_alive_interval=settings.keep_alive_interval,
        keep_alive_max_attempt=settings.keep_alive_max_attempt,
        owned_store=owned_store,
    )
