"""torch's module path `torch.distributed.elastic.rendezvous.utils`: `parse_rendezvous_endpoint`
(distcomm's `backends.parse_endpoint`: the same results, fuller messages)."""

from __future__ import annotations

from .backends import parse_endpoint as parse_rendezvous_endpoint

__all__ = ["parse_rendezvous_endpoint"]
