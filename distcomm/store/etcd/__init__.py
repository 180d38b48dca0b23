"""EtcdStore: a store kept in an etcd server, spoken to over its v3 JSON API.

- `store`: `EtcdStore`, the public class (how each Store method maps onto etcd);
- `requests`: its mixin `StoreRequests` (key layout, requests, snapshot reads, watches)
  and the builders of etcd's request pieces;
- `client`: the HTTP client under it (endpoints, pooled requests, watch streams, errors).
"""

from .store import EtcdStore

__all__ = ["EtcdStore"]
