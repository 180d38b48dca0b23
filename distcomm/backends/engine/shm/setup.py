"""Setting up the shared-memory path: which ranks share a host, and their segment.

`same_host_setup` runs once, when a gloo group is made: every rank publishes its host
identity, process id and the address of a probe buffer through the group's store; the
ranks of each host map one segment (its lowest rank creates it and passes the file
descriptor by pidfd) and check that they can read each other's memory (cross-memory
attach). Every rank gets the same answer: the layout, or why shared memory is not used.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field

import numpy as np

from ....deadline import Deadline
from ....errors import DistBackendError
from ....store.base import Store
from ....store.ranks import wait_for_ranks
from ...base import setup_round
from .engine import IntraNode
from .primitives import Segment, allow_peer_access, cma_read, host_identity

__all__ = ["HostLayout", "same_host_setup"]

#: its counters are published with plain stores, which these CPUs never reorder (TSO);
#: weakly ordered CPUs (aarch64, ppc64) would need fences Python cannot issue
_ORDERED_CPUS = ("x86_64", "amd64", "i386", "i686")
_PROBE = np.frombuffer(b"distcomm", dtype=np.uint8).copy()


@dataclass
class HostLayout:
    """Which ranks of a group share a host, and this rank's shared segment.

    Attributes:
        hosts: the group ranks on each host (hosts in order of their lowest rank).
        local: the ranks on this rank's host (one of `hosts`).
        segment: this host's shared segment; None when this rank is alone on its host.
        pids: the process ids of `local`.
        addresses: the transport addresses of `local` ("" where a rank gave none).
    """

    hosts: list[list[int]]
    local: list[int]
    segment: Segment | None
    pids: list[int]
    addresses: list[str] = field(default_factory=list)


def same_host_setup(
    store: Store,
    rank: int,
    size: int,
    deadline: Deadline,
    mode: str,
    label: str = "",
    generation: int | None = None,
    address: str = "",
) -> HostLayout | str:
    """Agree with the peers which ranks share a host, and map each host's segment.

    Returns the layout, or the reason shared memory is not used at all (every rank gets
    the same answer). `mode` is "auto", or "tcp" to decline; `label` says who sets up
    what, for messages ("[rank 1/4] setup on 'gloo' (group 'default')"). `generation`:
    the number of this set-up of the group on `store`, where the caller already counted
    it (else it is counted here). `address`: this rank's transport address, handed to
    the ranks of its host (`HostLayout.addresses`).

    Raises:
        DistTimeoutError: a peer did not take its part in time; the message names it.
    """
    if generation is None:
        generation = setup_round(store, "gloo/joined", size)
    key = f"gloo/{generation}"
    label = label or f"[rank {rank}/{size}] gloo set-up"
    hint = (
        "did every rank of the group call init_process_group (or new_group) with the "
        "gloo backend? Look at the missing ranks' output for an error"
    )
    allow_peer_access()
    store.set(
        f"{key}/who/{rank}",
        f"{mode}|{host_identity()}|{os.getpid()}|{_PROBE.ctypes.data}|{address}",
    )

    def gather(name: str, arrived: str) -> list[str]:
        keys = {r: f"{key}/{name}/{r}" for r in range(size)}
        wait_for_ranks(store, keys, deadline, label, arrived=arrived, hint=hint)
        return [value.decode() for value in store.multi_get(list(keys.values()))]

    who = []
    for text in gather("who", "said which host they are on"):
        peer_mode, rest = text.split("|", 1)
        who.append([peer_mode, *rest.rsplit("|", 3)])  # the host id may hold "|"
    if any(w[0] != "auto" for w in who):
        return "DISTCOMM_GLOO_TRANSPORT=tcp"
    if platform.machine().lower() not in _ORDERED_CPUS:
        return (
            f"the shared-memory path needs a CPU that keeps stores in order (x86-64); "
            f"this is {platform.machine()}"
        )
    by_host: dict[str, list[int]] = {}
    for r, w in enumerate(who):
        by_host.setdefault(w[1], []).append(r)
    hosts = list(by_host.values())
    if all(len(members) == 1 for members in hosts):
        return "every rank is alone on its host"
    local = by_host[who[rank][1]]
    pids = [int(who[r][2]) for r in local]
    segment: Segment | None = None
    reason = ""
    try:
        if len(local) > 1:
            nbytes = IntraNode.segment_bytes(len(local))
            name = f"{key}/segment/{local[0]}"
            if rank == local[0]:
                segment = Segment(nbytes)
                store.set(name, f"{os.getpid()} {segment.fd}")
            else:
                wait_for_ranks(
                    store,
                    {local[0]: name},
                    deadline,
                    label,
                    hint=hint,
                    arrived="created this host's shared-memory segment",
                )
                pid, fd = map(int, store.get(name).split())
                segment = Segment(nbytes, owner=(pid, fd))
            right = local[(local.index(rank) + 1) % len(local)]
            probe = np.zeros_like(_PROBE)
            cma_read(int(who[right][2]), probe.ctypes.data, int(who[right][3]), probe.nbytes)
            if not np.array_equal(probe, _PROBE):
                reason = f"rank {rank} read unexpected bytes from rank {right}"
    except (OSError, DistBackendError) as exc:
        reason = f"rank {rank}: {exc}"
    store.set(f"{key}/ok/{rank}", reason)
    reasons = gather("ok", "mapped their host's shared-memory segment")
    if segment is not None:
        segment.release_fd()  # every rank has attached (or failed to) by now
    failed = [r for r in reasons if r]
    if failed:
        if segment is not None:
            segment.close()
        return failed[0]
    return HostLayout(hosts, local, segment, pids, [who[r][4] for r in local])
