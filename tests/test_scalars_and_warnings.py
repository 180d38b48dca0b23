"""0-d arrays in every collective, the error a numpy scalar gets, and reductions that
overflow or make nan without a numpy warning.

A 0-d array is what a 0-d torch tensor is: every op takes one (all_to_all_single, which
splits along dim 0, refuses it as torch does). A numpy scalar (`np.mean(x)`, `x.sum()`)
is immutable, so no collective can write into it; the TypeError says what to pass.
Reductions give what numpy's ufuncs give (inf on overflow, nan for inf - inf, wrapped
integers) and, like torch and MPI, say nothing: the ranks run them with every warning
turned into an error, on every path (shared memory inline and chunked, TCP trees and
rings, the intra-op threads, the hierarchical path, mpi's float16 reductions).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest

import distcomm as dist
from distcomm.ops import ReduceOp
from distcomm.parallel import threads
from tests.conftest import UNDER_MPIEXEC, cpu_variants, open_world, world_id
from tests.test_collectives import ALL_DTYPES, check, expected_reduction, valid, values

SIZES = (2, 3)


def _params() -> list[tuple]:
    if UNDER_MPIEXEC:
        return [("mpi", 0, {})]
    return [(b, n, env) for b, env in cpu_variants() for n in SIZES]


@pytest.fixture(scope="module", params=_params(), ids=world_id)
def world(request):
    """gloo (shared memory, TCP only, two pretend hosts) and tcp at 2 and 3 ranks; the
    mpiexec job's ranks under tests/test_mpi.py."""
    yield from open_world(request.param)


def _zero_d(dtype: str, r: int, op: ReduceOp = ReduceOp.SUM) -> np.ndarray:
    return values(r, 1, dtype, op).reshape(())


# -- 0-d arrays through every op ----------------------------------------------------------------


def _zero_d_reductions(dtype: str) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    for op in (o for o in ReduceOp if valid(o, dtype)):
        want = expected_reduction(n, 1, dtype, op).reshape(())
        for async_op in (False, True):
            what = f"{op.name}{' async' if async_op else ''}"
            x = _zero_d(dtype, r, op)
            work = dist.all_reduce(x, op=op, async_op=async_op)
            if async_op:
                assert work.wait() and work.result()[0] is x
            check(x, want, f"all_reduce {what}")
            for root in range(n):
                x = _zero_d(dtype, r, op)
                work = dist.reduce(x, dst=root, op=op, async_op=async_op)
                if async_op:
                    work.wait()
                check(x, want if r == root else _zero_d(dtype, r, op), f"reduce {what} to {root}")
            # rank r's slot i holds element i of its n-element input
            full = values(r, n, dtype, op)
            mine = expected_reduction(n, n, dtype, op)[r, ...]
            out = np.empty((), dtype=dtype)
            work = dist.reduce_scatter(
                out, [full[i, ...].copy() for i in range(n)], op=op, async_op=async_op
            )
            if async_op:
                work.wait()
            check(out, mine, f"reduce_scatter {what}")
            out = np.empty((), dtype=dtype)
            work = dist.reduce_scatter_single(out, full, op=op, async_op=async_op)
            if async_op:
                work.wait()
            check(out, mine, f"reduce_scatter_single {what}")
            out = np.empty((), dtype=dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # the deprecated name
                work = dist.reduce_scatter_tensor(out, full, op=op, async_op=async_op)
            if async_op:
                work.wait()
            check(out, mine, f"reduce_scatter_tensor {what}")
    if np.dtype(dtype).kind in "fc":
        x = _zero_d(dtype, r)
        dist.all_reduce(x, op=ReduceOp.PREMUL_SUM(2))
        check(
            x,
            (expected_reduction(n, 1, dtype, ReduceOp.SUM) * 2).astype(dtype).reshape(()),
            "all_reduce PREMUL_SUM",
        )


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_zero_d_arrays_in_every_reduction(world, dtype):
    world.run(_zero_d_reductions, dtype)


def _zero_d_data_movement(dtype: str) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    for async_op in (False, True):
        what = " async" if async_op else ""

        def done(work, async_op=async_op):
            if async_op:
                work.wait()

        for root in range(n):
            x = _zero_d(dtype, r)
            done(dist.broadcast(x, src=root, async_op=async_op))
            check(x, _zero_d(dtype, root), f"broadcast{what} from {root}")

        outs = [np.empty((), dtype=dtype) for _ in range(n)]
        done(dist.all_gather(outs, _zero_d(dtype, r), async_op=async_op))
        for k in range(n):
            check(outs[k], _zero_d(dtype, k), f"all_gather{what}[{k}]")
        # torch's all_gather_into_tensor: n 0-d inputs fill a 1-d output of n elements
        stacked = np.stack([_zero_d(dtype, k) for k in range(n)])
        out = np.empty(n, dtype=dtype)
        done(dist.all_gather_single(out, _zero_d(dtype, r), async_op=async_op))
        check(out, stacked, f"all_gather_single{what}")
        out = np.empty(n, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the deprecated name
            work = dist.all_gather_into_tensor(out, _zero_d(dtype, r), async_op=async_op)
        done(work)
        check(out, stacked, f"all_gather_into_tensor{what}")

        for root in range(n):
            slots = [np.empty((), dtype=dtype) for _ in range(n)] if r == root else None
            done(dist.gather(_zero_d(dtype, r), slots, dst=root, async_op=async_op))
            if r == root:
                for k in range(n):
                    check(slots[k], _zero_d(dtype, k), f"gather{what}[{k}] to {root}")
            out = np.empty((), dtype=dtype)
            parts = [_zero_d(dtype, k + 10) for k in range(n)] if r == root else None
            done(dist.scatter(out, parts, src=root, async_op=async_op))
            check(out, _zero_d(dtype, r + 10), f"scatter{what} from {root}")

        send = [_zero_d(dtype, r * n + j) for j in range(n)]
        recv = [np.empty((), dtype=dtype) for _ in range(n)]
        done(dist.all_to_all(recv, send, async_op=async_op))
        for k in range(n):
            check(recv[k], _zero_d(dtype, k * n + r), f"all_to_all{what} from {k}")


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint64", "float16", "float64", "complex64"])
def test_zero_d_arrays_in_every_data_movement(world, dtype):
    world.run(_zero_d_data_movement, dtype)


def _zero_d_point_to_point(dtype: str) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    right, left = (r + 1) % n, (r - 1) % n
    # send/recv around the ring: even ranks send first, odd ranks receive first
    got = np.empty((), dtype=dtype)
    if r % 2 == 0:
        dist.send(_zero_d(dtype, r), dst=right)
        assert dist.recv(got, src=left) == left
    else:
        assert dist.recv(got, src=left) == left
        dist.send(_zero_d(dtype, r), dst=right)
    check(got, _zero_d(dtype, left), "recv")
    # isend/irecv, the receive from any source
    got = np.empty((), dtype=dtype)
    receiving = dist.irecv(got, tag=3)
    sending = dist.isend(_zero_d(dtype, r), dst=right, tag=3)
    receiving.wait()
    sending.wait()
    assert receiving.source_rank() == left
    check(got, _zero_d(dtype, left), "irecv")
    # batch_isend_irecv both ways round the ring
    from_left, from_right = np.empty((), dtype=dtype), np.empty((), dtype=dtype)
    ops = [
        dist.P2POp(dist.isend, _zero_d(dtype, r), right, tag=4),
        dist.P2POp(dist.isend, _zero_d(dtype, r + 20), left, tag=5),
        dist.P2POp(dist.irecv, from_left, left, tag=4),
        dist.P2POp(dist.irecv, from_right, right, tag=5),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    check(from_left, _zero_d(dtype, left), "batch_isend_irecv from the left")
    check(from_right, _zero_d(dtype, right + 20), "batch_isend_irecv from the right")
    dist.barrier()


@pytest.mark.parametrize("dtype", ["bool", "int32", "float16", "complex128"])
def test_zero_d_arrays_point_to_point(world, dtype):
    world.run(_zero_d_point_to_point, dtype)


def _all_to_all_single_refuses_zero_d() -> str:
    x, out = np.zeros(()), np.zeros(())
    try:
        dist.all_to_all_single(out, x)
    except ValueError as exc:
        return str(exc)
    raise AssertionError("all_to_all_single took a 0-d array")


def test_all_to_all_single_refuses_zero_d_arrays_as_torch_does(world):
    # torch's all_to_all_single reads dim 0 of both tensors (tensor.size(0)), which a 0-d
    # tensor lacks; all_to_all with lists of 0-d arrays is the way to swap scalars
    for message in world.run(_all_to_all_single_refuses_zero_d):
        assert "all_to_all_single: output is a 0-d array" in message
        assert "dim 0" in message and "reshape(1)" in message and "all_to_all" in message


# -- numpy scalars ------------------------------------------------------------------------------

SCALARS = [np.float64(1.5), np.int64(3), 1.5]
SCALAR_IDS = ["numpy.float64", "numpy.int64", "float"]


def _scalar_errors(index: int) -> list[tuple[str, str, bool, str]]:
    """(op, argument, whether the op writes into it, the TypeError's message) for
    SCALARS[index] passed in each place."""
    value = SCALARS[index]
    calls = [
        ("all_reduce", "tensor", True, lambda: dist.all_reduce(value)),
        ("broadcast", "tensor", True, lambda: dist.broadcast(value, src=0)),
        (
            "all_gather",
            "tensor",
            False,
            lambda: dist.all_gather([np.zeros(())] * dist.get_world_size(), value),
        ),
        (
            "all_gather",
            "tensor_list[0]",
            True,
            lambda: dist.all_gather([value] * dist.get_world_size(), np.zeros(())),
        ),
    ]
    found = []
    for where, name, written, call in calls:
        try:
            call()
        except TypeError as exc:
            found.append((where, name, written, str(exc)))
        else:
            raise AssertionError(f"{where} took {value!r} as {name}")
    return found


@pytest.mark.parametrize("index", range(len(SCALARS)), ids=SCALAR_IDS)
def test_a_scalar_gets_a_type_error_that_says_what_to_pass(world, index):
    value = SCALARS[index]
    kind = (
        f"a numpy scalar (numpy.{type(value).__name__})"
        if isinstance(value, np.generic)
        else f"a Python {type(value).__name__}"
    )
    for where, name, written, message in world.run(_scalar_errors, index)[0]:
        assert message.startswith(f"{where}: {name} is {kind}, which is immutable"), message
        if written:
            assert f"so {where} cannot write its result into it" in message, message
        assert "pass numpy.asarray(value), a 0-d array" in message, message
        assert "or a 1-element array" in message, message


def _mean_then_asarray() -> None:
    x = np.arange(4.0) + dist.get_rank()
    with pytest.raises(TypeError, match=r"^all_reduce: tensor is a numpy scalar \(numpy.float64"):
        dist.all_reduce(np.mean(x))
    mean = np.asarray(np.mean(x))  # the remedy the message gives
    dist.all_reduce(mean, op=ReduceOp.AVG)
    n = dist.get_world_size()
    check(mean, np.asarray(1.5 + (n - 1) / 2), "the all_reduced mean")


def test_np_mean_is_refused_and_np_asarray_is_the_remedy(world):
    world.run(_mean_then_asarray)


# -- reductions stay quiet ------------------------------------------------------------------------


def _numpy_result(inputs: list[np.ndarray], op: ReduceOp, n: int) -> np.ndarray:
    """What numpy computes for these inputs, in rank order (warnings off, as we reduce)."""
    with np.errstate(all="ignore"):
        ufunc = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PRODUCT: np.multiply}[op]
        result = functools.reduce(lambda a, b: ufunc(a, b), inputs)
        if op is ReduceOp.AVG:
            result = np.divide(result, n).astype(result.dtype)
    return result


def _check_same(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if not np.array_equal(actual, expected, equal_nan=expected.dtype.kind in "fc"):
        raise AssertionError(
            f"{what}: got {actual.reshape(-1)[:3]}, expected "
            f"{expected.reshape(-1)[:3]} (rank {dist.get_rank()})"
        )


#: element counts that take every reduction path: 0-d, the shared-memory engine's inline
#: payloads (<= 32 KiB) and chunked owner reduction, the TCP trees, halving-doubling and
#: rings (from 512 KiB on tcp, 1 and 2 MiB on gloo over TCP)
_COUNTS = ((), (1000,), (40_000,), (1_200_001,))
#: float32 elements whose per-rank share passes 4 MiB at 3 ranks: with two intra-op threads
#: the reductions are split between threads (the shared-memory engine's and ops.reduce_into's)
_THREADED = (3_200_000,)


def _quiet_reductions() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    f16_big = 60000.0  # float16's largest finite value is 65504
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning raises, on our threads too
        for shape in _COUNTS:
            for op in (ReduceOp.SUM, ReduceOp.AVG):
                x = np.full(shape, f16_big, dtype=np.float16)
                dist.all_reduce(x, op=op)
                _check_same(
                    x,
                    np.full(shape, np.inf, dtype=np.float16),
                    f"float16 all_reduce {op.name} x{shape}",
                )
            x = np.full(shape, f16_big, dtype=np.float16)
            dist.all_reduce(x, async_op=True).wait()
            _check_same(x, np.full(shape, np.inf, dtype=np.float16), f"async x{shape}")
            for root in (0, n - 1):
                x = np.full(shape, f16_big, dtype=np.float16)
                dist.reduce(x, dst=root)
                want = np.inf if r == root else f16_big
                _check_same(
                    x, np.full(shape, want, dtype=np.float16), f"float16 reduce to {root} x{shape}"
                )
            # PREMUL_SUM: the scaling itself overflows
            x = np.full(shape, 40000.0, dtype=np.float16)
            dist.all_reduce(x, op=ReduceOp.PREMUL_SUM(2.0))
            _check_same(x, np.full(shape, np.inf, dtype=np.float16), f"PREMUL_SUM x{shape}")
            # inf + -inf is nan (numpy's 'invalid value'), averaged or not
            for dtype in ("float32", "complex64"):
                for op in (ReduceOp.SUM, ReduceOp.AVG):
                    inputs = [
                        np.full(shape, np.inf if k == 0 else -np.inf if k == 1 else 1, dtype=dtype)
                        for k in range(n)
                    ]
                    x = inputs[r].copy()
                    dist.all_reduce(x, op=op)
                    _check_same(
                        x, _numpy_result(inputs, op, n), f"{dtype} inf - inf {op.name} x{shape}"
                    )
            # AVG of complex infinities: the division makes nan parts
            inputs = [np.full(shape, complex(np.inf, 0), dtype=np.complex64)] * n
            x = inputs[r].copy()
            dist.all_reduce(x, op=ReduceOp.AVG)
            _check_same(x, _numpy_result(inputs, ReduceOp.AVG, n), f"complex AVG x{shape}")
            # MIN and MAX: numpy 2.4 deprecates a positional `out` for these two
            for op, want in ((ReduceOp.MIN, 1), (ReduceOp.MAX, n)):
                x = np.full(shape, r + 1, dtype=np.float16)
                dist.all_reduce(x, op=op)
                _check_same(x, np.full(shape, want, dtype=np.float16), f"{op.name} x{shape}")
            x = np.full(shape, 1e30, dtype=np.float32)
            dist.all_reduce(x, op=ReduceOp.PRODUCT)
            _check_same(x, np.full(shape, np.inf, dtype=np.float32), f"PRODUCT x{shape}")
        count = int(np.prod(_COUNTS[2]))
        full = np.full(n * count, f16_big, dtype=np.float16)
        for size in (1, count):
            out = np.empty(size, dtype=np.float16)
            dist.reduce_scatter_single(out, full[: n * size])
            _check_same(out, np.full(size, np.inf, dtype=np.float16), f"reduce_scatter x{size}")
            out = np.empty(size, dtype=np.float16)
            dist.reduce_scatter(
                out, [full[k * size : (k + 1) * size] for k in range(n)], op=ReduceOp.AVG
            )
            _check_same(out, np.full(size, np.inf, dtype=np.float16), f"reduce_scatter AVG x{size}")
        with threads(2):
            for shape in _THREADED:
                x = np.full(shape, 3e38, dtype=np.float32)
                dist.all_reduce(x)
                _check_same(x, np.full(shape, np.inf, dtype=np.float32), "threaded all_reduce")
                x = np.full(shape, 3e38, dtype=np.float32)
                dist.reduce(x, dst=0, op=ReduceOp.AVG)
                want = np.inf if r == 0 else 3e38
                _check_same(x, np.full(shape, want, dtype=np.float32), "threaded reduce")


def _raising_errstate_of_the_caller() -> None:
    # a caller's np.errstate(all="raise") neither reaches the reduction nor is changed by it
    with np.errstate(all="raise"):
        for shape in _COUNTS[:3]:
            x = np.full(shape, 60000.0, dtype=np.float16)
            dist.all_reduce(x)
            _check_same(x, np.full(shape, np.inf, dtype=np.float16), f"raise x{shape}")
        assert np.geterr()["over"] == "raise"
        with pytest.raises(FloatingPointError):
            np.add(np.float16(60000), np.float16(60000))


def test_float_overflow_and_nan_give_numpys_values_without_a_warning(world):
    world.run(_quiet_reductions, timeout=180)
    world.run(_raising_errstate_of_the_caller)


def _wrapping_integers() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for shape in _COUNTS[:3]:
            for dtype, op, value in (
                ("int8", ReduceOp.SUM, 100),
                ("uint8", ReduceOp.SUM, 200),
                ("int64", ReduceOp.SUM, 2**62),
                ("int32", ReduceOp.PRODUCT, 70000),
                ("uint64", ReduceOp.PRODUCT, 2**40),
            ):
                inputs = [np.full(shape, value + k, dtype=dtype) for k in range(n)]
                x = inputs[r].copy()
                dist.all_reduce(x, op=op)
                _check_same(x, _numpy_result(inputs, op, n), f"{dtype} {op.name} x{shape}")


def test_integer_overflow_wraps_as_numpy_does_without_a_warning(world):
    world.run(_wrapping_integers)
