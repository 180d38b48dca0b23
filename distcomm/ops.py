"""ReduceOp, which dtypes each op accepts, its numpy, MPI and NCCL counterparts, and the
numpy reduction kernels, which run without numpy's floating-point warnings."""

from __future__ import annotations

import contextvars
import enum
import numbers
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .parallel import parallel_for

__all__ = [
    "MPI_OP_NAMES",
    "NCCL_OP_NAMES",
    "UFUNCS",
    "PremulSum",
    "ReduceOp",
    "average_into",
    "check_reduce_op",
    "finish_average",
    "quiet",
    "reduce_into",
    "reduce_op",
    "reduces_as",
    "scaled",
    "supports_complex",
]


class ReduceOp(enum.IntEnum):
    """How a reduction combines the ranks' arrays (torch.distributed.ReduceOp).

    AVG is SUM divided by the group size and needs a floating or complex dtype.
    BAND, BOR and BXOR need an integer or bool dtype. MIN and MAX reject complex.
    """

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7

    def __str__(self) -> str:
        return self.name


_SUM = ReduceOp.SUM  # a module global: faster to reach than the enum's attribute


@dataclass(frozen=True)
class PremulSum:
    """`ReduceOp.PREMUL_SUM(factor)`: each rank's array is multiplied by `factor`, then the
    products are summed (NCCL's ncclPreMulSum; torch's `_make_nccl_premul_sum`). Every
    backend runs it, as a scaling on the caller's device followed by SUM."""

    factor: float | complex

    @property
    def name(self) -> str:
        return "PREMUL_SUM"

    def __str__(self) -> str:
        return f"PREMUL_SUM({self.factor})"


class _PremulSumOp:
    """`ReduceOp.PREMUL_SUM`, which is called with its factor: `ReduceOp.PREMUL_SUM(0.5)`."""

    name = "PREMUL_SUM"

    def __call__(self, factor: Any) -> PremulSum:
        """The op that sums `factor` x each rank's array; `factor` a real or complex number
        (or a one-element array holding one)."""
        value = factor
        if hasattr(value, "size") and hasattr(value, "item"):  # numpy or CuPy scalar/array
            if value.size != 1:
                raise ValueError(
                    f"ReduceOp.PREMUL_SUM: factor must be one number, got an "
                    f"array of {value.size} elements"
                )
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Number):
            raise TypeError(
                f"ReduceOp.PREMUL_SUM: factor must be a real or complex number, got {factor!r}"
            )
        return PremulSum(value)

    def __repr__(self) -> str:
        return "ReduceOp.PREMUL_SUM"


#: Not an enum member: it carries its factor, so it is made by a call; `list(ReduceOp)`
#: stays the eight plain reductions.
ReduceOp.PREMUL_SUM = _PremulSumOp()  # type: ignore[attr-defined]


UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}

#: mpi4py attribute names (MPI.<name>); AVG is SUM followed by a division.
MPI_OP_NAMES = {
    ReduceOp.SUM: "SUM",
    ReduceOp.AVG: "SUM",
    ReduceOp.PRODUCT: "PROD",
    ReduceOp.MIN: "MIN",
    ReduceOp.MAX: "MAX",
    ReduceOp.BAND: "BAND",
    ReduceOp.BOR: "BOR",
    ReduceOp.BXOR: "BXOR",
}

#: cupy.cuda.nccl attribute names; NCCL has no bitwise reductions.
NCCL_OP_NAMES = {
    ReduceOp.SUM: "NCCL_SUM",
    ReduceOp.AVG: "NCCL_AVG",
    ReduceOp.PRODUCT: "NCCL_PROD",
    ReduceOp.MIN: "NCCL_MIN",
    ReduceOp.MAX: "NCCL_MAX",
}


class _DeprecatedReduceOp:
    """`reduce_op`, torch's deprecated name of ReduceOp: `reduce_op.SUM` warns and gives
    `ReduceOp.SUM`."""

    def __getattr__(self, name: str) -> ReduceOp:
        if name not in ReduceOp.__members__:
            raise AttributeError(f"reduce_op has no {name!r}; use distcomm.ReduceOp")
        warnings.warn(
            "distcomm.reduce_op is deprecated (as torch.distributed.reduce_op); "
            "use distcomm.ReduceOp",
            FutureWarning,
            stacklevel=2,
        )
        return ReduceOp[name]


reduce_op = _DeprecatedReduceOp()


def supports_complex(reduceOp: ReduceOp) -> bool:  # torch's argument name
    """Whether `reduceOp` takes complex arrays on every backend (torch's answer: MAX, MIN,
    PRODUCT and the bitwise ops do not; the CPU backends multiply complex arrays, nccl
    does not)."""
    return reduceOp not in (
        ReduceOp.MAX,
        ReduceOp.MIN,
        ReduceOp.PRODUCT,
        ReduceOp.BAND,
        ReduceOp.BOR,
        ReduceOp.BXOR,
    )


def check_reduce_op(op: object, dtype: np.dtype, where: str) -> ReduceOp | PremulSum:
    """Validate `op` for arrays of `dtype`; returns it.

    Args:
        where: the calling function, for messages ("all_reduce").

    Raises:
        TypeError: `op` is not a ReduceOp (or `ReduceOp.PREMUL_SUM(factor)`), or it is not
            defined for `dtype`.
    """
    if op is _SUM:  # every call's default, defined for every dtype
        return op
    kind = dtype.kind
    if isinstance(op, PremulSum):
        if kind not in "fc":
            raise TypeError(
                f"{where}: ReduceOp.PREMUL_SUM needs a floating or complex "
                f"array, got {dtype}; scale integers and use ReduceOp.SUM"
            )
        if isinstance(op.factor, complex) and kind != "c":
            raise TypeError(
                f"{where}: ReduceOp.PREMUL_SUM({op.factor}) has a complex "
                f"factor for a {dtype} array; use a real factor"
            )
        return op
    if isinstance(op, _PremulSumOp):
        raise TypeError(
            f"{where}: ReduceOp.PREMUL_SUM needs its factor: pass ReduceOp.PREMUL_SUM(factor)"
        )
    if not isinstance(op, ReduceOp):
        raise TypeError(
            f"{where}: op must be a distcomm.ReduceOp (SUM, AVG, PRODUCT, MIN, MAX, BAND, "
            f"BOR, BXOR, or PREMUL_SUM(factor)), got {op!r}"
        )
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and kind not in "biu":
        raise TypeError(
            f"{where}: ReduceOp.{op.name} needs an integer or bool array, got {dtype}; "
            "bitwise reductions are not defined for floating or complex values"
        )
    if op in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c":
        raise TypeError(
            f"{where}: ReduceOp.{op.name} is not defined for complex arrays ({dtype}): "
            "complex numbers have no order; reduce the real and imaginary parts separately"
        )
    if op is ReduceOp.AVG and kind not in "fc":
        raise TypeError(
            f"{where}: ReduceOp.AVG needs a floating or complex array, got {dtype}; "
            "use ReduceOp.SUM and divide by the group size yourself"
        )
    return op


def _run_with_errstate(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with np.errstate(all="ignore"):
        return fn(*args, **kwargs)


class _Quiet(threading.local):
    """`quiet.run(fn, *args, **kwargs)`: `fn(*args, **kwargs)` with numpy's floating-point
    warnings off, in this thread's copy of a context where they are.

    Reductions give what numpy computes, silently, as torch and MPI reduce: inf on
    overflow, nan for inf - inf or an invalid division, wrapped integers. numpy keeps its
    error state (np.errstate) in a context variable, so running a ufunc in a context copied
    once with that state costs one `Context.run` (measured on 2 float32 elements: 30-80 ns
    more than the bare call, where entering and leaving np.errstate costs about 0.9 us,
    more than the reduction itself). A context is entered by one thread at a time, hence
    one per thread, and `fn` must not call `quiet.run` itself. Other context variables
    inside hold the values of the moment the copy was made: pass numpy calls only. Where
    numpy keeps the error state elsewhere (numpy 1.x), the copy would not carry it and
    np.errstate is entered instead.
    """

    def __init__(self) -> None:
        with np.errstate(all="ignore"):
            context = contextvars.copy_context()
        carried = context.run(np.geterr)["over"] == "ignore"
        self.run: Callable[..., Any] = context.run if carried else _run_with_errstate


quiet = _Quiet()


def average_into(array: Any, size: int) -> None:
    """array <- array / size, in place (AVG's last step), with numpy's floating-point
    warnings off."""
    if type(array) is np.ndarray:
        quiet.run(np.divide, array, size, out=array)
    else:  # a CuPy array (mpi's CUDA-aware path): CuPy's kernels do not warn
        array /= size


def reduces_as(op: ReduceOp) -> ReduceOp:
    """The op a reduction's steps apply: SUM for AVG, whose division comes once, last
    (`finish_average`); `op` itself for every other op."""
    return ReduceOp.SUM if op is ReduceOp.AVG else op


def finish_average(array: Any, op: ReduceOp, size: int) -> None:
    """AVG as sum-then-divide, its last step: `array /= size` in place when `op` is AVG
    (`average_into`: numpy's warnings off; a CuPy array divides on its device); nothing
    for any other op. Call it where the sum is complete: on every rank after an
    all_reduce or reduce_scatter, on the root only after a reduce."""
    if op is ReduceOp.AVG:
        average_into(array, size)


def scaled(array: Any, factor: float | complex, in_place: bool) -> Any:
    """`array` x `factor` (PREMUL_SUM's first step), in place or as a new array, with
    numpy's floating-point warnings off; CuPy arrays too (through their operators)."""
    with np.errstate(all="ignore"):  # not quiet.run: a CuPy array may come here
        if in_place:
            array *= factor
            return array
        return array * factor


#: Arrays of at least this many bytes are reduced by several threads: measured with
#: benchmarks/threads.py, waking a thread costs about as much as reducing 1 MiB, so two
#: threads break even near 4 MiB and are 1.5-1.9x faster from 8 MiB on.
PARALLEL_REDUCE_BYTES = 4 << 20
#: The fewest bytes one thread reduces (worth more than waking it).
_PARALLEL_REDUCE_CHUNK = 1 << 20


def reduce_into(acc: np.ndarray, incoming: np.ndarray, op: ReduceOp) -> None:
    """acc <- acc (op) incoming, elementwise and in place (AVG accumulates as SUM), with
    numpy's floating-point warnings off (see `quiet`).

    From PARALLEL_REDUCE_BYTES on, contiguous pieces are reduced on the intra-op threads
    (see distcomm.parallel.set_num_threads); elementwise, so the result is the same.
    """
    ufunc = UFUNCS[op]
    if (
        acc.nbytes < PARALLEL_REDUCE_BYTES
        or acc.shape != incoming.shape
        or not (acc.flags.c_contiguous and incoming.flags.c_contiguous)
    ):
        quiet.run(ufunc, acc, incoming, out=acc)
        return
    a, b = acc.reshape(-1), incoming.reshape(-1)

    def piece(start: int, stop: int) -> None:  # on the intra-op threads: each its own context
        quiet.run(ufunc, a[start:stop], b[start:stop], out=a[start:stop])

    parallel_for(a.size, piece, min_chunk=max(1, _PARALLEL_REDUCE_CHUNK // acc.itemsize))
