"""The thresholds that pick a collective's algorithm: `Tuning`, its presets and
DISTCOMM_TUNING.

`Tuning.simple()` is the `tcp` backend's table, `Tuning.tuned()` gloo's; a backend reads
DISTCOMM_TUNING once, when its group is made (`Tuning.from_env`). The algorithms
themselves are in `algorithms.py`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from ... import config
from ...config import parse_size

__all__ = ["ENV_VAR", "NEVER", "Tuning"]

#: The environment variable `Tuning.from_env` reads.
ENV_VAR = "DISTCOMM_TUNING"
#: A threshold no array reaches: the algorithm it enables is never chosen.
NEVER = sys.maxsize


@dataclass(frozen=True)
class Tuning:
    """Which algorithm each collective uses: thresholds in bytes, one per algorithm boundary.

    A `*_min` field is the smallest array (in bytes) that the algorithm it names takes;
    all_reduce tries ring, then halving-doubling, then recursive doubling, and otherwise
    reduces to rank 0 and broadcasts (binomial trees). Ops without a field use one
    algorithm everywhere: binomial-tree broadcast and reduce, ring all_gather and
    reduce_scatter, pairwise all_to_all, dissemination barrier. Every rank of a group must
    use the same tuning (the backend's preset, adjusted by the same DISTCOMM_TUNING).

    DISTCOMM_TUNING overrides fields of the backend's preset: comma-separated
    `field=value` entries, each value a number of bytes with an optional K, M or G suffix
    (powers of 1024) or `never` (`NEVER`), e.g. `all_reduce_ring_min=4M,ring_chunk=256K`.

    Attributes:
        all_reduce_doubling_min: all_reduce of at least this many bytes uses recursive
            doubling: log2(n) rounds in which partners swap whole arrays (latency-bound
            sizes; a non-power-of-two n costs two extra whole-array messages).
        all_reduce_halving_doubling_min: all_reduce of at least this many bytes, with at
            least one element per rank of the largest power of two <= n, uses recursive
            halving-doubling (Rabenseifner): reduce-scatter by recursive halving, then
            all-gather by recursive doubling; 2 log2(n) rounds moving 2(n-1)/n of the data.
        all_reduce_ring_min: all_reduce of at least this many bytes, with at least one
            element per rank, uses the ring: ring reduce-scatter, then ring all-gather;
            2(n-1) steps moving 2(n-1)/n of the data (bandwidth-bound sizes).
        ring_chunk: each step of a ring reduce-scatter (all_reduce's and reduce_scatter's)
            is split into pieces of this many bytes, all received into place while the
            previous piece is reduced, so reduction overlaps transfer; 0: one message per
            step.
        gather_flat_min: gather and scatter of at least this many bytes per rank move each
            rank's block directly between it and the root; smaller blocks travel through a
            binomial tree (log2(n) rounds, inner ranks forwarding their subtree's blocks)
            in groups of at least `gather_tree_min_ranks`.
        gather_tree_min_ranks: a number of ranks, not bytes: the smallest group whose
            gather and scatter use the binomial tree (the root's n - 1 messages against
            log2(n) rounds: the tree pays off only in large groups).
        shm_inline_max: (gloo's shared-memory path, ranks on one host) payloads up to this
            many bytes travel inline in the shared segment (capped at its slot size);
            larger ones are copied directly between the ranks' arrays.
        shm_chunk: (gloo's shared-memory path) bytes reduced per step of a large
            reduction, so the pieces stay in cache.
    """

    all_reduce_doubling_min: int = NEVER
    all_reduce_halving_doubling_min: int = NEVER
    all_reduce_ring_min: int = 512 * 1024  # measured crossover at 2-4 ranks: 256 KiB-1 MiB
    ring_chunk: int = 0
    gather_flat_min: int = 0
    gather_tree_min_ranks: int = NEVER
    shm_inline_max: int = 32 * 1024
    shm_chunk: int = 256 * 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Tuning.{f.name} must be an integer >= 0, got {value!r}")

    @classmethod
    def simple(cls) -> Tuning:
        """The `tcp` backend's algorithms: tree or ring all_reduce, flat gather and scatter."""
        return cls()

    @classmethod
    def tuned(cls) -> Tuning:
        """The `gloo` backend's algorithms.

        The all_reduce crossovers and `ring_chunk` were measured over loopback TCP at 2, 3
        and 4 ranks (benchmarks/collectives.py, float32): recursive doubling beat the tree
        at every size up to 512 KiB, halving-doubling took over near 1 MiB and the
        pipelined ring near 2 MiB; ring pieces below 1 MiB cost more than they overlapped.
        The gather/scatter tree boundary is not measured: at 4 and 8 ranks on one host the
        flat algorithms were as fast or faster at every size.
        """
        return cls(
            all_reduce_doubling_min=0,
            all_reduce_halving_doubling_min=1 << 20,
            all_reduce_ring_min=2 << 20,
            ring_chunk=2 << 20,
            gather_flat_min=4 << 10,
            gather_tree_min_ranks=16,
        )

    @classmethod
    def from_env(cls, preset: Tuning, environ: Mapping[str, str] | None = None) -> Tuning:
        """`preset` with the overrides of DISTCOMM_TUNING in `environ` (default: os.environ)
        applied.

        Raises:
            ValueError: an entry is not `field=value`, names no field of Tuning, or holds a
                value that is not a size; the message names the variable, the entry and the
                valid fields.
        """
        text = config.get(ENV_VAR, environ) or ""
        names = [f.name for f in fields(cls)]
        changes: dict[str, int] = {}
        for raw in text.split(","):
            entry = raw.strip()
            if not entry:
                continue
            name, equals, value = (part.strip() for part in entry.partition("="))
            valid = f"valid fields: {', '.join(names)}"
            if not equals:
                raise ValueError(f"{ENV_VAR}: {entry!r} is not a 'field=value' entry; {valid}")
            if name not in names:
                raise ValueError(
                    f"{ENV_VAR}: {entry!r}: {name!r} is not a field of the tuning; {valid}"
                )
            size = parse_size(value)
            if value.lower() == "never":
                changes[name] = NEVER
            elif size is not None:
                changes[name] = size
            else:
                raise ValueError(
                    f"{ENV_VAR}: {entry!r}: {value!r} is not a size in bytes "
                    "(an integer with an optional K, M or G suffix, e.g. 256K, "
                    f"or 'never'); {valid}"
                )
        return replace(preset, **changes) if changes else preset
