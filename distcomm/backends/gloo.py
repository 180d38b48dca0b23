"""The `gloo` backend: the fast CPU path.

The same backend as `tcp` (transport, runner, op set) with the tuned algorithm table,
and a path chosen once, when the group is made (`_choose_path`, `engine/paths.py`):

- every rank of the group on this host: collectives in shared memory (`engine/shm/`: one
  synchronisation per collective and single-copy transfers between the ranks' arrays);
- the group spans hosts and some share one: `HierPath`, shared memory within each host
  and TCP between one rank per host for all_reduce, reduce, broadcast and barrier, TCP
  between all ranks for the other ops;
- otherwise, or with `DISTCOMM_GLOO_TRANSPORT=tcp`: TCP for everything.

Point-to-point messages and the failure signals always use the TCP connections. CuPy
arrays are staged through pinned host memory (copied in, reduced on the CPU, copied
back), as the original gloo did for CUDA tensors: the group wraps this backend in a
`StagedBackend` for them (`stages_device_arrays`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from .. import config
from ..deadline import Deadline
from ..gpu.runtime import is_cupy_array
from ..store.base import Store
from ..work import Work
from .engine import algorithms as algo
from .engine.paths import HierPath
from .engine.shm import IntraNode, same_host_setup
from .tcp import TcpBackend

__all__ = ["GlooBackend", "transport_mode"]

log = logging.getLogger(__name__)


def transport_mode(environ: Mapping[str, str] | None = None) -> str:
    """DISTCOMM_GLOO_TRANSPORT in `environ` (default: os.environ): "auto" (shared memory
    on one host, the default) or "tcp".

    Raises:
        ValueError: another value.
    """
    return config.get("DISTCOMM_GLOO_TRANSPORT", environ)


class GlooBackend(TcpBackend):
    """Fast CPU backend: tuned algorithms, shared memory within a host, TCP across hosts."""

    name = "gloo"
    devices = ("cpu", "cuda")
    stages_device_arrays = True
    tuning_preset = algo.Tuning.tuned()

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: float,
        group_name: str = "",
        *,
        global_ranks: Sequence[int] | None = None,
        process_store: Store | None = None,
        setup_round: int | None = None,
    ) -> None:
        self._mode = transport_mode()
        super().__init__(
            store,
            rank,
            size,
            timeout,
            group_name,
            global_ranks=global_ranks,
            process_store=process_store,
            setup_round=setup_round,
        )

    def _choose_path(self, store: Store) -> Any:
        if self.size == 1:
            return self._tcp
        fabric = self._transport.fabric
        layout = same_host_setup(
            store,
            self.rank,
            self.size,
            Deadline(self.timeout),
            self._mode,
            self.describe("setup"),
            self._transport.generation,
            fabric.address if fabric is not None else "",
        )
        if isinstance(layout, str):
            log.info("%s: collectives over TCP: %s", self.describe("setup"), layout)
            return self._tcp
        self._transport.know_local_peers(
            dict(zip(layout.local, layout.pids, strict=True)),
            dict(zip(layout.local, layout.addresses, strict=True)),
        )
        engine = None
        if layout.segment is not None:
            engine = IntraNode(
                layout.segment,
                layout.pids,
                layout.local.index(self.rank),
                len(layout.local),
                layout.local,
                self.size,
                self._transport.mailbox,
                inline_max=self.tuning.shm_inline_max,
                chunk=self.tuning.shm_chunk,
            )
        if len(layout.hosts) == 1:
            path: Any = engine
        else:
            path = HierPath(self._tcp, engine, layout, self.rank, self.size)
        log.info(
            "%s: collectives over %s (hosts: %s)", self.describe("setup"), path.name, layout.hosts
        )
        return path

    def send(self, array: Any, dst: int, tag: int) -> Work:
        self._host_only(array, "send")
        return super().send(array, dst, tag)

    def recv(self, array: Any, src: int | None, tag: int) -> Work:
        self._host_only(array, "recv")
        return super().recv(array, src, tag)

    def _host_only(self, array: Any, op: str) -> None:
        if is_cupy_array(array):
            raise TypeError(
                f"{self.describe(op)}: the gloo backend does not {op} CuPy arrays; copy the "
                "array to the host (array.get()) or use a group with the nccl backend"
            )
