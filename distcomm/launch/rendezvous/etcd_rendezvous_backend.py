"""torch's etcd-v2 backend (`torch.distributed.elastic.rendezvous.etcd_rendezvous_backend`)
over distcomm's `EtcdStore` (etcd's v3 JSON API; the python-etcd client torch uses is not
needed): `EtcdRendezvousBackend` keeps the state under ``<key_prefix>/<run_id>`` and
`create_backend(params)` makes it with an EtcdStore for the rest (``--rdzv_backend=etcd-v2``).

`--rdzv_backend=etcd` does not go through here: its handler keeps the state in its
EtcdStore directly (`backends.create_etcd_handler`).
"""

from __future__ import annotations

from ...errors import DistError
from ...store import Store
from .api import RendezvousConnectionError, RendezvousParameters
from .store_backend import StoreStateBackend

__all__ = ["EtcdRendezvousBackend", "create_backend"]

#: the etcd prefix of create_backend's store, and the state's key prefix under it: the
#: state is at /torch/elastic/rendezvous/<run_id>, as torch's; the rendezvous's other keys
#: (all starting with "/") at /torch/elastic/rdzv/<run_id>/...
PREFIX = "/torch/elastic"
STATE_KEY_PREFIX = "/rendezvous"


class EtcdRendezvousBackend(StoreStateBackend):
    """The state of run `run_id` under ``<key_prefix>/<run_id>`` (just `run_id` without a
    prefix) of `client`, an `EtcdStore` (or any distcomm Store; keys are under its
    own prefix). Name "etcd-v2".

    Args:
        client: the store (torch: an etcd client).
        run_id: the run's id.
        key_prefix: the key's prefix, or None.
        ttl: accepted for torch's signature; distcomm's EtcdStore keeps keys without a
            lease, so the state stays until deleted (use a new run id per run).

    Raises:
        ValueError: `run_id` is empty.
        TypeError: `client` is not a distcomm Store.
    """

    def __init__(
        self, client: Store, run_id: str, key_prefix: str | None = None, ttl: int | None = None
    ) -> None:
        if not run_id or not isinstance(run_id, str):
            raise ValueError(f"The run id must be a non-empty string, got {run_id!r} (--rdzv_id)")
        key = f"{key_prefix.rstrip('/')}/{run_id}" if key_prefix else run_id
        super().__init__(client, key, "etcd-v2", "etcd")
        self.ttl = ttl


def create_backend(params: RendezvousParameters) -> tuple[EtcdRendezvousBackend, Store]:
    """An EtcdRendezvousBackend and an EtcdStore at --rdzv_endpoint (torch's
    `create_backend`): one EtcdStore under the prefix /torch/elastic holds the state at
    /torch/elastic/rendezvous/<run_id> and the rendezvous's keys.

    Options: ``read_timeout`` (seconds, default 60), ``protocol`` (http; https and the TLS
    keys are refused: distcomm's EtcdStore speaks plain HTTP).

    Raises:
        ValueError: an invalid endpoint, protocol or read timeout.
        RendezvousConnectionError: etcd cannot be reached.
    """
    from ...store.etcd import EtcdStore  # only when used

    read_timeout = params.get_as_int("read_timeout", 60)
    if read_timeout is None or read_timeout <= 0:
        raise ValueError(
            f"--rdzv_conf read_timeout={params.get('read_timeout')!r}: The read timeout must "
            "be a positive integer (seconds)"
        )
    protocol = str(params.get("protocol", "http")).strip().lower()
    if protocol not in ("http", "https"):
        raise ValueError(
            f"--rdzv_conf protocol={protocol!r}: The protocol must be HTTP or "
            "HTTPS (distcomm supports http only)"
        )
    if protocol == "https" or any(params.get(key) for key in ("ssl_cert", "ca_cert")):
        raise ValueError(
            "--rdzv_conf protocol=https / ssl_cert / ca_cert: TLS to etcd is not "
            "supported by distcomm's EtcdStore; use protocol=http"
        )
    endpoint = (params.endpoint or "").strip()
    if not endpoint:
        raise ValueError(
            "--rdzv_backend=etcd-v2 needs --rdzv_endpoint=HOST[:PORT] of an etcd "
            "server (port 2379 when left out)"
        )
    try:
        store = EtcdStore(endpoint, prefix=PREFIX, timeout=float(read_timeout))
    except DistError as exc:
        raise RendezvousConnectionError(
            f"The connection to etcd has failed: {exc}; check --rdzv_endpoint={endpoint}"
        ) from exc
    return EtcdRendezvousBackend(store, params.run_id, key_prefix=STATE_KEY_PREFIX), store
