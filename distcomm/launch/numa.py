"""--numa-binding: which CPUs each worker runs on, from the machine's NUMA and cache topology.

torchrun binds the worker of local rank ``r`` to CPUs near GPU ``r``. distcomm's workers
need no GPU, so the node's workers are spread over its NUMA nodes in blocks by local rank
(with 8 workers and 2 NUMA nodes, local ranks 0-3 go to the first node, 4-7 to the
second); within that, each mode picks CPUs as torch's does:

- ``node``: every CPU of the worker's NUMA node;
- ``socket``: every CPU of the NUMA nodes of the socket holding the worker's NUMA node;
- ``exclusive``: a share of the node's physical cores (with their hyperthreads) for each
  of the workers on that node, no core shared; the lowest ranks get one more core when
  they do not divide evenly;
- ``core-complex``: one group of cores sharing the last-level cache (an L3 "core
  complex"), the biggest groups first, a different one per worker on that node while
  there are enough.

Only the CPUs this process may run on (``os.sched_getaffinity``) are used. The topology
comes from ``/sys/devices/system/node/node*/cpulist`` and
``/sys/devices/system/cpu/cpu*/{topology,cache}``; `read_topology` takes another root, so
tests give it a fake tree.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "AFFINITY_MODES",
    "CpuTopology",
    "NumaOptions",
    "numa_affinity",
    "parse_cpu_list",
    "read_topology",
    "worker_cpus",
]

#: torchrun's --numa-binding values
AFFINITY_MODES = ("node", "socket", "exclusive", "core-complex")
SYSFS_ROOT = "/sys/devices/system"


@dataclass(frozen=True)
class NumaOptions:
    """torch's ``NumaOptions``: the --numa-binding mode (one of `AFFINITY_MODES`).

    Attributes:
        affinity_mode: node, socket, exclusive or core-complex.
        should_fall_back_if_binding_fails: leave the workers unbound (with a warning)
            instead of failing when no binding can be computed.
    """

    affinity_mode: str
    should_fall_back_if_binding_fails: bool = False

    def __post_init__(self) -> None:
        mode = getattr(self.affinity_mode, "value", self.affinity_mode)  # torch's AffinityMode
        object.__setattr__(self, "affinity_mode", str(mode))
        if self.affinity_mode not in AFFINITY_MODES:
            raise ValueError(
                f"--numa-binding={self.affinity_mode!r} is not one of {', '.join(AFFINITY_MODES)}"
            )


@dataclass(frozen=True)
class CpuTopology:
    """What the binding needs to know of the machine, for the CPUs it may use.

    Attributes:
        nodes: NUMA node -> its CPUs.
        socket: CPU -> its socket (physical package).
        core: CPU -> its physical core (the lowest CPU among its hyperthreads).
        cache: CPU -> its last-level cache (the lowest CPU sharing it).
    """

    nodes: dict[int, frozenset[int]]
    socket: dict[int, int]
    core: dict[int, int]
    cache: dict[int, int]


def parse_cpu_list(text: str) -> frozenset[int]:
    """A sysfs CPU list ("0-3,8,10-11") as a set of CPU numbers; "" is the empty set.

    Raises:
        ValueError: the text is not such a list.
    """
    cpus: set[int] = set()
    for item in filter(None, (part.strip() for part in text.strip().split(","))):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if match is None:
            raise ValueError(f"{text.strip()!r} is not a CPU list such as 0-3,8")
        low = int(match[1])
        high = int(match[2]) if match[2] is not None else low
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as fp:
            return fp.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _last_level_cache(cpu_dir: str, cpu: int) -> int:
    """The lowest CPU sharing `cpu`'s highest-level data or unified cache (itself if none)."""
    cache_dir = os.path.join(cpu_dir, "cache")
    best_level, sharing = -1, frozenset([cpu])
    try:
        entries = sorted(os.listdir(cache_dir))
    except OSError:
        return cpu
    for entry in entries:
        if not entry.startswith("index"):
            continue
        index = os.path.join(cache_dir, entry)
        if _read(os.path.join(index, "type")) == "Instruction":
            continue
        level_text, shared = (
            _read(os.path.join(index, "level")),
            _read(os.path.join(index, "shared_cpu_list")),
        )
        if level_text is None or not level_text.isdigit() or shared is None:
            continue
        if int(level_text) > best_level:
            try:
                best_level, sharing = int(level_text), parse_cpu_list(shared) or sharing
            except ValueError:
                continue
    return min(sharing)


def read_topology(allowed: Iterable[int], root: str = SYSFS_ROOT) -> CpuTopology:
    """The topology of the CPUs in `allowed`, read from the sysfs tree at `root`.

    Without ``<root>/node`` (a kernel without NUMA), all CPUs form NUMA node 0. A missing
    topology or cache file makes a CPU its own core, its own cache and socket 0.
    """
    allowed = frozenset(allowed)
    nodes: dict[int, frozenset[int]] = {}
    node_root = os.path.join(root, "node")
    try:
        names = os.listdir(node_root)
    except OSError:
        names = []
    for name in names:
        match = re.fullmatch(r"node(\d+)", name)
        text = _read(os.path.join(node_root, name, "cpulist")) if match else None
        if match is None or text is None:
            continue
        try:
            cpus = parse_cpu_list(text) & allowed
        except ValueError:
            continue
        if cpus:  # memory-only nodes and nodes this process may not use are left out
            nodes[int(match[1])] = cpus
    listed = frozenset().union(*nodes.values()) if nodes else frozenset()
    if allowed - listed:  # no NUMA information for some CPUs: one more node of their own
        nodes[max(nodes, default=-1) + 1] = allowed - listed
    socket, core, cache = {}, {}, {}
    for cpu in sorted(allowed):
        cpu_dir = os.path.join(root, "cpu", f"cpu{cpu}")
        package = _read(os.path.join(cpu_dir, "topology", "physical_package_id"))
        socket[cpu] = int(package) if package and package.lstrip("-").isdigit() else 0
        siblings = _read(os.path.join(cpu_dir, "topology", "thread_siblings_list"))
        try:
            core[cpu] = min(parse_cpu_list(siblings or "") | {cpu})
        except ValueError:
            core[cpu] = cpu
        cache[cpu] = _last_level_cache(cpu_dir, cpu)
    return CpuTopology(nodes=dict(sorted(nodes.items())), socket=socket, core=core, cache=cache)


def _group(cpus: Iterable[int], key: dict[int, int]) -> dict[int, frozenset[int]]:
    groups: dict[int, set[int]] = {}
    for cpu in cpus:
        groups.setdefault(key[cpu], set()).add(cpu)
    return {k: frozenset(v) for k, v in sorted(groups.items())}


def worker_cpus(mode: str, nproc: int, topology: CpuTopology) -> dict[int, frozenset[int]]:
    """The CPUs of each local rank's worker under `mode` (see the module's docstring).

    Raises:
        ValueError: `mode` is unknown, `nproc` < 1, no CPU is known, or ``exclusive`` has
            fewer physical cores on a NUMA node than workers there.
    """
    if mode not in AFFINITY_MODES:
        raise ValueError(f"--numa-binding={mode!r} is not one of {', '.join(AFFINITY_MODES)}")
    if nproc < 1:
        raise ValueError(f"--numa-binding needs at least one worker, got nproc_per_node={nproc}")
    node_ids = list(topology.nodes)
    if not node_ids:
        raise ValueError("--numa-binding: no CPU of this process was found in the topology")
    home = {rank: node_ids[rank * len(node_ids) // nproc] for rank in range(nproc)}
    on_node = {node: [r for r in range(nproc) if home[r] == node] for node in node_ids}
    result: dict[int, frozenset[int]] = {}
    for rank in range(nproc):
        node = home[rank]
        cpus = topology.nodes[node]
        relative = on_node[node].index(rank)
        sharing = len(on_node[node])
        if mode == "node":
            result[rank] = cpus
        elif mode == "socket":
            sockets = {topology.socket[cpu] for cpu in cpus}
            result[rank] = frozenset(
                cpu
                for other in topology.nodes.values()
                for cpu in other
                if topology.socket[cpu] in sockets
            )
        elif mode == "exclusive":
            cores = list(_group(cpus, topology.core).values())
            if len(cores) < sharing:
                raise ValueError(
                    f"--numa-binding=exclusive: NUMA node {node} has {len(cores)} physical "
                    f"core(s) for {sharing} workers; use fewer workers per node or "
                    f"--numa-binding=node"
                )
            each, extra = divmod(len(cores), sharing)
            start = relative * each + min(relative, extra)
            end = start + each + (1 if relative < extra else 0)
            result[rank] = frozenset().union(*cores[start:end])
        else:  # core-complex
            complexes = sorted(
                _group(cpus, topology.cache).items(), key=lambda item: (-len(item[1]), item[0])
            )
            result[rank] = complexes[relative % len(complexes)][1]
    return result


def numa_affinity(
    options: NumaOptions | str,
    nproc: int,
    root: str = SYSFS_ROOT,
    allowed: Iterable[int] | None = None,
) -> tuple[dict[int, frozenset[int]] | None, str]:
    """The CPU set of each local rank for --numa-binding, or None when it changes nothing.

    Args:
        options: the mode, or torch-style `NumaOptions`.
        nproc: workers on this node.
        root: the sysfs root (tests pass a fake tree).
        allowed: the CPUs this process may use (default: ``os.sched_getaffinity(0)``).

    Returns:
        (local rank -> CPUs, "") when the binding restricts some worker; else (None, a
        one-line message saying why affinity is left alone: a flat topology, where every
        worker would get every CPU).

    Raises:
        ValueError: as `worker_cpus`, unless the options say to fall back (then the
            message says binding was skipped).
    """
    if isinstance(options, str):
        options = NumaOptions(options)
    mode = options.affinity_mode
    cpus = frozenset(os.sched_getaffinity(0) if allowed is None else allowed)
    topology = read_topology(cpus, root)
    try:
        sets = worker_cpus(mode, nproc, topology)
    except ValueError as exc:
        if options.should_fall_back_if_binding_fails:
            return None, f"distcomm-run: {exc}; workers left unbound (fall back requested)"
        raise
    if all(each == cpus for each in sets.values()):
        return None, (
            f"distcomm-run: --numa-binding={mode}: this machine's topology is flat for "
            f"it ({len(topology.nodes)} NUMA node(s), {len(cpus)} CPUs usable): every "
            f"worker would get every CPU, so CPU affinity is left alone"
        )
    return sets, ""
