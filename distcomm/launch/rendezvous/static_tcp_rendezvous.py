"""torch's module path `torch.distributed.elastic.rendezvous.static_tcp_rendezvous`: the static
rendezvous (`static.py`) under torch's names."""

from __future__ import annotations

from .static import StaticRendezvous
from .static import create_static_handler as create_rdzv_handler

__all__ = ["StaticTCPRendezvous", "create_rdzv_handler"]


class StaticTCPRendezvous(StaticRendezvous):
    """`StaticRendezvous` with torch's constructor: node `rank` of `world_size`, node 0's
    store at `master_addr:master_port`, `timeout` seconds for a round.

    Raises:
        ValueError: a bad parameter (named).
    """

    _ARGS = {"nnodes": "world_size", "node_rank": "rank", "master_port": "master_port"}

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        run_id: str,
        timeout: float,
    ) -> None:
        super().__init__(
            run_id,
            world_size,
            node_rank=rank,
            master_addr=master_addr,
            master_port=master_port,
            join_timeout=float(timeout),
        )
