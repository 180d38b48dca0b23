"""The shared-memory path of the gloo backend: collectives among the ranks of one host.

`setup.same_host_setup` finds which ranks share a host and maps each host's segment;
`engine.IntraNode` runs the collectives over it (its gather and scatter, even and with a
size per rank, in `rooted`) and holds the host's `counters.Counters`, the counters and
waits that order them; `primitives` holds the OS calls they use (memfd segments,
futexes, cross-memory attach).
"""

from .counters import FailureWatch
from .engine import IntraNode
from .setup import HostLayout, same_host_setup

__all__ = ["FailureWatch", "HostLayout", "IntraNode", "same_host_setup"]
