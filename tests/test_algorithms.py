"""Every algorithm of every op, forced through DISTCOMM_TUNING on `tcp` worlds of 1-4 ranks.

Each world runs one tuning that forces one algorithm per op (tree, recursive doubling,
halving-doubling, ring, pipelined ring; flat or binomial gather/scatter) over odd counts,
zero-size arrays and counts smaller than the world size, in several dtypes and reduce
ops. Integer results are checked exactly, floating ones with allclose against a float64
reference, and floating all_reduce results must be bit-identical on every rank.
Also checks `Tuning.from_env` and the algorithm choice of each preset.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import numpy as np
import pytest

import distcomm as dist
from distcomm.backends.engine import algorithms as algo
from distcomm.backends.engine.algorithms import NEVER, Tuning
from distcomm.backends.tcp import TcpBackend
from distcomm.ops import ReduceOp
from tests.harness import run_ranks

_TREE_GATHER = "gather_flat_min=never,gather_tree_min_ranks=0"

#: name -> (DISTCOMM_TUNING, the all_reduce algorithm, the gather algorithm it forces)
TUNINGS = {
    "tree": ("all_reduce_ring_min=never", "all_reduce_tree", "gather_flat"),
    "doubling": (
        "all_reduce_doubling_min=0,all_reduce_ring_min=never," + _TREE_GATHER,
        "all_reduce_recursive_doubling",
        "gather_binomial",
    ),
    "halving_doubling": (
        "all_reduce_halving_doubling_min=0,all_reduce_ring_min=never," + _TREE_GATHER,
        "all_reduce_halving_doubling",
        "gather_binomial",
    ),
    "ring": ("all_reduce_ring_min=0", "all_reduce_ring", "gather_flat"),
    # 24-byte pieces: every ring step of the larger arrays goes in many messages
    "ring_pieces": (
        "all_reduce_ring_min=0,ring_chunk=24,gather_flat_min=0",
        "all_reduce_ring",
        "gather_flat",
    ),
}

_UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}

REDUCTIONS = [
    ("float32", ReduceOp.SUM),
    ("float64", ReduceOp.AVG),
    ("float32", ReduceOp.MAX),
    ("int64", ReduceOp.SUM),
    ("int64", ReduceOp.PRODUCT),
    ("int64", ReduceOp.MIN),
    ("uint8", ReduceOp.BXOR),
    ("uint8", ReduceOp.BAND),
    ("int64", ReduceOp.BOR),
]


def data(
    rank: int, count: int, dtype: str, op: ReduceOp = ReduceOp.SUM, salt: int = 0
) -> np.ndarray:
    """Rank `rank`'s input: random floats, or integers whose reduction is exact."""
    rng = np.random.default_rng([rank, count, salt, int(op)])
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(count).astype(dtype)
    if op is ReduceOp.PRODUCT:
        return rng.integers(-3, 4, count).astype(dtype)
    return rng.integers(0, 200, count).astype(dtype)


def reference(n: int, count: int, dtype: str, op: ReduceOp, salt: int = 0) -> np.ndarray:
    """The reduction of every rank's `data`, in float64 for floating dtypes."""
    wide = "float64" if np.dtype(dtype).kind == "f" else dtype
    inputs = [data(r, count, dtype, op, salt).astype(wide) for r in range(n)]
    result = functools.reduce(_UFUNC[op], inputs)
    return result / n if op is ReduceOp.AVG else result


def check(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    ok = (
        np.allclose(actual, expected, rtol=1e-5, atol=1e-5)
        if actual.dtype.kind == "f"
        else np.array_equal(actual, expected)
    )
    if actual.shape != expected.shape or not ok:
        raise AssertionError(
            f"{what} on rank {dist.get_rank()}/{dist.get_world_size()}: "
            f"got {actual[:8]}, expected {expected[:8]}"
        )


def _counts(n: int) -> list[int]:
    return sorted({0, 1, max(n - 1, 0), 7, 1001})


def _all_ops(expected_all_reduce: str, expected_gather: str) -> list[str]:
    """Run every op under this world's tuning; returns digests of floating all_reduce results."""
    r, n = dist.get_rank(), dist.get_world_size()
    backend = dist.group.WORLD.default_backend("test")
    tuning = backend.tuning
    if tuning != Tuning.from_env(TcpBackend.tuning_preset):
        raise AssertionError(f"backend tuning {tuning} ignores DISTCOMM_TUNING")
    probe = np.zeros(1001, dtype=np.float64)
    if n > 1:
        chosen = algo.choose_all_reduce(tuning, probe, n)
        assert getattr(chosen, "func", chosen).__name__ == expected_all_reduce, chosen
    assert algo.choose_gather(tuning, probe, n).__name__ == expected_gather

    digests = []
    for dtype, op in REDUCTIONS:
        for count in _counts(n):
            x = data(r, count, dtype, op)
            dist.all_reduce(x, op=op)
            check(x, reference(n, count, dtype, op), f"all_reduce {op.name} {dtype} x{count}")
            if x.dtype.kind == "f":
                digests.append(hashlib.sha256(x.tobytes()).hexdigest())
    for dtype, op in (
        ("float64", ReduceOp.SUM),
        ("int64", ReduceOp.MAX),
        ("float32", ReduceOp.AVG),
    ):
        for root in sorted({0, n - 1}):
            for count in (0, n - 1, 1001):
                x = data(r, count, dtype, op, salt=1)
                dist.reduce(x, dst=root, op=op)
                want = (
                    reference(n, count, dtype, op, salt=1)
                    if r == root
                    else data(r, count, dtype, op, salt=1)
                )
                check(x, want, f"reduce {op.name} {dtype} x{count} to {root}")
    for dtype, op in (
        ("float32", ReduceOp.SUM),
        ("float64", ReduceOp.AVG),
        ("int64", ReduceOp.PRODUCT),
        ("uint8", ReduceOp.BOR),
    ):
        for count in (0, 1, 333):
            full = data(r, n * count, dtype, op, salt=2)
            before = full.copy()
            out = np.empty(count, dtype=dtype)
            dist.reduce_scatter_single(out, full, op=op)
            want = reference(n, n * count, dtype, op, salt=2)[r * count : (r + 1) * count]
            check(out, want, f"reduce_scatter {op.name} {dtype} x{count}")
            check(full, before, "reduce_scatter input untouched")
    for root in range(n):
        for dtype in ("float64", "uint8"):
            for count in (0, 1001):
                x = data(r, count, dtype, salt=3)
                dist.broadcast(x, src=root)
                check(x, data(root, count, dtype, salt=3), f"broadcast {dtype} from {root}")
        for count in (0, 1, 3, 257):
            mine = data(r, count, "int64", salt=4)
            slots = np.empty(n * count, dtype="int64") if r == root else None
            dist.gather(
                mine,
                [slots[k * count : (k + 1) * count] for k in range(n)] if r == root else None,
                dst=root,
            )
            if r == root:
                check(
                    slots,
                    np.concatenate([data(k, count, "int64", salt=4) for k in range(n)]),
                    f"gather x{count} to {root}",
                )
            out = np.empty(count, dtype="float32")
            parts = (
                [data(k + 10, count, "float32", salt=5) for k in range(n)] if r == root else None
            )
            dist.scatter(out, parts, src=root)
            check(out, data(r + 10, count, "float32", salt=5), f"scatter x{count} from {root}")
    for count in (0, 1, 257):
        out = np.empty(n * count, dtype="float32")
        dist.all_gather_single(out, data(r, count, "float32", salt=6))
        check(
            out,
            np.concatenate([data(k, count, "float32", salt=6) for k in range(n)]),
            f"all_gather x{count}",
        )
    splits = [(r + j) % 3 for j in range(n)]  # rank r sends (r + j) % 3 elements to rank j
    received = [(k + r) % 3 for k in range(n)]
    out = np.empty(sum(received), dtype="int64")
    dist.all_to_all_single(out, np.arange(sum(splits), dtype="int64") + 100 * r, received, splits)
    want = [
        np.arange(
            sum((k + j) % 3 for j in range(r)),
            sum((k + j) % 3 for j in range(r + 1)),
            dtype="int64",
        )
        + 100 * k
        for k in range(n)
    ]
    check(out, np.concatenate(want), "all_to_all")
    for _ in range(2):
        dist.barrier()
    return digests


#: every algorithm at 2, 3 and 4 ranks; one rank runs no algorithm, so one tuning there
ALGORITHM_CASES = [(1, "tree")] + [(n, name) for n in (2, 3, 4) for name in TUNINGS]


@pytest.mark.parametrize(
    "nprocs,name", ALGORITHM_CASES, ids=[f"{n}-{name}" for n, name in ALGORITHM_CASES]
)
def test_every_algorithm(nprocs, name):
    env, all_reduce_name, gather_name = TUNINGS[name]
    digests = run_ranks(
        _all_ops,
        nprocs,
        all_reduce_name,
        gather_name,
        backend="tcp",
        env={"DISTCOMM_TUNING": env},
        timeout=90,
    )
    for rank, theirs in enumerate(digests[1:], 1):
        assert theirs == digests[0], f"rank {rank}'s floating all_reduce results differ"


# -- choosing --------------------------------------------------------------------------------


def _name(fn) -> str:
    return getattr(fn, "func", fn).__name__


@pytest.mark.parametrize(
    "nbytes,size,expected",
    [
        (0, 4, "all_reduce_recursive_doubling"),
        (8, 3, "all_reduce_recursive_doubling"),
        (512 << 10, 4, "all_reduce_recursive_doubling"),
        (1 << 20, 2, "all_reduce_halving_doubling"),
        (1 << 20, 3, "all_reduce_halving_doubling"),
        (2 << 20, 4, "all_reduce_ring"),
    ],
)
def test_tuned_all_reduce_choice(nbytes, size, expected):
    chosen = algo.choose_all_reduce(Tuning.tuned(), np.empty(nbytes, np.uint8), size)
    assert _name(chosen) == expected
    if expected == "all_reduce_ring":
        assert chosen.keywords == {"piece_bytes": Tuning.tuned().ring_chunk}


def test_simple_preset_is_the_tcp_behaviour():
    simple = Tuning.simple()
    assert simple == Tuning() and TcpBackend.tuning_preset == simple
    assert _name(algo.choose_all_reduce(simple, np.empty(512 * 1024 - 1, np.uint8), 4)) == (
        "all_reduce_tree"
    )
    ring = algo.choose_all_reduce(simple, np.empty(512 * 1024, np.uint8), 4)
    assert _name(ring) == "all_reduce_ring" and ring.keywords == {"piece_bytes": 0}
    for block in (np.empty(0, np.uint8), np.broadcast_to(np.uint8(0), 1 << 30)):
        assert algo.choose_gather(simple, block, 1 << 20) is algo.gather_flat
        assert algo.choose_scatter(simple, block, 1 << 20) is algo.scatter_flat


def test_small_counts_fall_back():
    """A split that would leave a rank without an element falls back to a simpler algorithm."""
    ring_everywhere = Tuning(all_reduce_ring_min=0)
    assert _name(algo.choose_all_reduce(ring_everywhere, np.empty(3), 4)) == "all_reduce_tree"
    assert _name(algo.choose_all_reduce(ring_everywhere, np.empty(4), 4)) == "all_reduce_ring"
    halving = Tuning(all_reduce_halving_doubling_min=0, all_reduce_doubling_min=0)
    assert _name(algo.choose_all_reduce(halving, np.empty(4), 5)) == "all_reduce_halving_doubling"
    assert _name(algo.choose_all_reduce(halving, np.empty(3), 5)) == (
        "all_reduce_recursive_doubling"
    )


def test_tuned_gather_uses_trees_in_large_groups_only():
    tuned = Tuning.tuned()
    small = np.empty(16, np.uint8)
    assert algo.choose_gather(tuned, small, tuned.gather_tree_min_ranks) is algo.gather_binomial
    assert algo.choose_scatter(tuned, small, tuned.gather_tree_min_ranks) is (algo.scatter_binomial)
    assert algo.choose_gather(tuned, small, 4) is algo.gather_flat
    big = np.empty(tuned.gather_flat_min, np.uint8)
    assert algo.choose_gather(tuned, big, 1024) is algo.gather_flat


# -- Tuning.from_env ---------------------------------------------------------------------------


def test_from_env_applies_overrides():
    preset = Tuning.tuned()
    assert Tuning.from_env(preset, {}) is preset
    assert Tuning.from_env(preset, {"DISTCOMM_TUNING": " , "}) is preset
    got = Tuning.from_env(
        preset,
        {
            "DISTCOMM_TUNING": " all_reduce_ring_min = 4M,ring_chunk=256k,"
            "gather_flat_min=12, all_reduce_doubling_min=never,"
            "shm_chunk=1G,"
        },
    )
    assert got == dataclasses.replace(
        preset,
        all_reduce_ring_min=4 << 20,
        ring_chunk=256 << 10,
        gather_flat_min=12,
        all_reduce_doubling_min=NEVER,
        shm_chunk=1 << 30,
    )


def test_from_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("DISTCOMM_TUNING", "ring_chunk=64")
    assert Tuning.from_env(Tuning.simple()).ring_chunk == 64


@pytest.mark.parametrize(
    "value,bad",
    [
        ("bogus=1", "'bogus'"),
        ("ring_chunk=12Q", "'12Q'"),
        ("ring_chunk=-5", "'-5'"),
        ("ring_chunk=1.5M", "'1.5M'"),
        ("ring_chunk=", "''"),
        ("ring_chunk", "'ring_chunk'"),
        ("all_reduce_ring_min=1M;ring_chunk=2", "'1M;ring_chunk=2'"),
    ],
)
def test_from_env_rejects_bad_entries(value, bad):
    with pytest.raises(ValueError) as info:
        Tuning.from_env(Tuning.simple(), {"DISTCOMM_TUNING": value})
    message = str(info.value)
    assert "DISTCOMM_TUNING" in message and bad in message
    assert "valid fields: " + ", ".join(f.name for f in dataclasses.fields(Tuning)) in message


def test_tuning_is_frozen_and_validated():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Tuning().ring_chunk = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="ring_chunk"):
        Tuning(ring_chunk=-1)
    for field in dataclasses.fields(Tuning):
        assert field.name in Tuning.__doc__, f"Tuning's docstring does not document {field.name}"


def test_bad_tuning_fails_init_process_group(monkeypatch):
    monkeypatch.setenv("DISTCOMM_TUNING", "ring_chunk=lots")
    with pytest.raises(ValueError, match=r"DISTCOMM_TUNING.*'lots'"):
        dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1, timeout=10)
    assert not dist.is_initialized()
