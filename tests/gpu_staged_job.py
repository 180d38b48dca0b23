"""CuPy arrays through a CPU backend (host staging), every op, checked against numpy.

`staged_collectives(xp_name)` runs on every rank of an initialised default group; every
rank's arrays live on the same GPU (ranks sharing a GPU is the point: staging, unlike
NCCL, allows it). `xp_name` is "cupy", or "numpy" to check the same bodies on the CPU
where no GPU is present. The tests of tests/test_gpu_device.py run it on gloo ranks
(`RankPool`) and under mpiexec::

    mpiexec -n 4 python -m tests.gpu_staged_job mpi cupy

which initialises the `mpi` backend, runs the checks and prints one line per rank.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

import distcomm as dist
from distcomm.ops import ReduceOp
from tests.test_collectives import check, expected_reduction, values

__all__ = ["main", "staged_collectives"]

#: dtypes every CPU backend reduces, by the ops tried on them
_REDUCTIONS = {
    "float32": (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG),
    "float64": (ReduceOp.SUM, ReduceOp.PRODUCT),
    "int64": (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.BXOR),
    "int16": (ReduceOp.SUM,),
    "complex64": (ReduceOp.SUM,),
    "bool": (ReduceOp.BOR, ReduceOp.BAND),
}
_COUNTS = (0, 1, 1000, (1 << 20) + 3)


def _module(xp_name: str) -> Any:
    if xp_name == "cupy":
        import cupy

        return cupy
    if xp_name == "numpy":
        return np
    raise ValueError(f"xp_name must be 'cupy' or 'numpy', got {xp_name!r}")


def _host(xp: Any, array: Any) -> np.ndarray:
    return xp.asnumpy(array) if xp is not np else np.asarray(array)


def staged_collectives(xp_name: str = "cupy") -> int:
    """Every collective (and p2p where the backend stages it) on `xp` arrays; the number of
    results checked. Raises AssertionError naming the op, dtype and size on a mismatch."""
    xp = _module(xp_name)
    r, n = dist.get_rank(), dist.get_world_size()
    checked = 0

    def ok(array: Any, expected: np.ndarray, what: str) -> None:
        nonlocal checked
        check(_host(xp, array), expected, f"{dist.get_backend()} {xp_name} {what}")
        checked += 1

    for dtype, ops in _REDUCTIONS.items():
        for count in _COUNTS:
            for op in ops:
                x = xp.asarray(values(r, count, dtype, op))
                dist.all_reduce(x, op=op)
                ok(
                    x,
                    expected_reduction(n, count, dtype, op),
                    f"all_reduce {op.name} {dtype} x{count}",
                )
            root = count % n
            x = xp.asarray(values(r, count, dtype))
            dist.broadcast(x, src=root)
            ok(x, values(root, count, dtype), f"broadcast {dtype} x{count}")
            x = xp.asarray(values(r, count, dtype, ops[0]))
            dist.reduce(x, dst=root, op=ops[0])
            want = (
                expected_reduction(n, count, dtype, ops[0])
                if r == root
                else values(r, count, dtype, ops[0])
            )
            ok(x, want, f"reduce {dtype} x{count}")

    for dtype in ("float32", "int16", "complex128", "bool"):
        for count in (0, 7, 300_001):
            mine = xp.asarray(values(r, count, dtype))
            flat = xp.empty(n * count, dtype=dtype)
            dist.all_gather_single(flat, mine)
            ok(
                flat,
                np.concatenate([values(k, count, dtype) for k in range(n)]),
                f"all_gather_single {dtype} x{count}",
            )
            parts = [xp.empty(count, dtype=dtype) for _ in range(n)]
            dist.all_gather(parts, mine)
            for k in range(n):
                ok(parts[k], values(k, count, dtype), f"all_gather[{k}] {dtype} x{count}")
            root = (count + 1) % n
            slots = [xp.empty(count, dtype=dtype) for _ in range(n)] if r == root else None
            dist.gather(mine, slots, dst=root)
            if slots is not None:
                for k in range(n):
                    ok(slots[k], values(k, count, dtype), f"gather[{k}] {dtype} x{count}")
            got = xp.empty(count, dtype=dtype)
            sent = (
                [xp.asarray(values(k + 10, count, dtype)) for k in range(n)] if r == root else None
            )
            dist.scatter(got, sent, src=root)
            ok(got, values(r + 10, count, dtype), f"scatter {dtype} x{count}")
            if dtype != "bool":
                big = values(r, n * count, dtype)
                out = xp.empty(count, dtype=dtype)
                dist.reduce_scatter_single(out, xp.asarray(big))
                ok(
                    out,
                    expected_reduction(n, n * count, dtype, ReduceOp.SUM)[
                        r * count : (r + 1) * count
                    ],
                    f"reduce_scatter_single {dtype} x{count}",
                )

    # all_to_all with uneven splits: rank q sends (q + j) % 3 rows of 2 to rank j
    sizes = [[(q + j) % 3 for j in range(n)] for q in range(n)]
    rows = np.concatenate([np.full((sizes[r][j], 2), 10 * r + j) for j in range(n)])
    out = xp.empty((sum(sizes[q][r] for q in range(n)), 2), dtype="int32")
    dist.all_to_all_single(
        out, xp.asarray(rows.astype("int32")), [sizes[q][r] for q in range(n)], sizes[r]
    )
    ok(
        out,
        np.concatenate([np.full((sizes[q][r], 2), 10 * q + r) for q in range(n)]).astype("int32"),
        "all_to_all_single uneven",
    )

    # an async op and a producer on a stream of its own (CuPy): the op waits for it
    if xp is not np:
        stream = xp.cuda.Stream(non_blocking=True)
        with stream:
            x = xp.arange(1 << 22, dtype=xp.float32)
            for _ in range(50):
                x += 1  # still queued when the collective is issued
            work = dist.all_reduce(x, async_op=True)
            assert work.wait() is True
            ok(
                x,
                (np.arange(1 << 22, dtype=np.float32) + 50) * n,
                "all_reduce after a producer stream",
            )

    if n > 1 and dist.get_backend() == "mpi":  # mpi stages point-to-point itself
        got = xp.empty(1000, dtype="float64")
        works = [
            dist.isend(xp.asarray(values(r, 1000, "float64")), (r + 1) % n),
            dist.irecv(got, (r - 1) % n),
        ]
        for w in works:
            w.wait()
        ok(got, values((r - 1) % n, 1000, "float64"), "isend/irecv ring")
    dist.barrier()
    return checked


def main(argv: list[str]) -> int:
    """`python -m tests.gpu_staged_job BACKEND [cupy|numpy]` under a launcher."""
    backend = argv[0] if argv else "mpi"
    xp_name = argv[1] if len(argv) > 1 else "cupy"
    dist.init_process_group(backend, timeout=120)
    try:
        checked = staged_collectives(xp_name)
        print(
            f"rank {dist.get_rank()}/{dist.get_world_size()} {backend} {xp_name}: "
            f"{checked} results checked",
            flush=True,
        )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
