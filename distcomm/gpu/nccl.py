"""NCCL through CuPy: the guarded import, versions, unique ids, and dtype/op mapping.

Bindings: CuPy's `cupy.cuda.nccl` by default; DISTCOMM_NCCL_BINDINGS=nccl4py picks NVIDIA's
nccl4py instead, behind the same interface (`distcomm.gpu.nccl4py`: non-blocking
communicators).

Unique ids: `cupy.cuda.nccl.get_unique_id()` returns 128 `bytes` from CuPy 14.0.0rc1 on
(its alphas and betas still used the old form) and a tuple of 128 signed ints before;
`NcclCommunicator` takes the same form back. Ids travel
as bytes (`unique_id_bytes`) and are turned into the installed CuPy's form by
`create_communicator`.

Types: NCCL moves int8/uint8/int32/uint32/int64/uint64/float16/float32/float64 natively.
Data movement (broadcast, gathers, all_to_all, send/recv) of any other dtype goes as
bytes. Reductions: bool as uint8 (SUM and MAX are OR, PRODUCT and MIN are AND, BXOR is a
SUM whose parity is kept), complex SUM/AVG as (real, imaginary) float pairs, AVG as SUM
then a division where NCCL predates ncclAvg (2.10), and as SUM on one rank. NCCL has no
bitwise reductions and no 16-bit integers; those raise `TypeError` saying what to do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import config
from ..errors import BackendUnavailableError
from ..ops import NCCL_OP_NAMES, ReduceOp
from . import runtime
from .runtime import INSTALL_HINT, import_cupy

__all__ = [
    "UNIQUE_ID_BYTES",
    "Movement",
    "Reduction",
    "bindings_choice",
    "build_version",
    "comm_id",
    "create_communicator",
    "cupy_version_key",
    "import_nccl",
    "movement",
    "parse_version",
    "reduction",
    "unique_id_bytes",
    "version_text",
]

UNIQUE_ID_BYTES = 128
#: the oldest NCCL with ncclSend/ncclRecv (point-to-point, grouped gathers, all_to_all)
MIN_VERSION = (2, 7, 0)
#: the first NCCL with ncclAvg
AVG_VERSION = (2, 10, 0)

_NATIVE = {
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32",
    "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64",
    "uint64": "NCCL_UINT64",
    "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
}
_BOOL_OPS = {
    ReduceOp.SUM: "NCCL_MAX",
    ReduceOp.MAX: "NCCL_MAX",
    ReduceOp.BOR: "NCCL_MAX",
    ReduceOp.PRODUCT: "NCCL_MIN",
    ReduceOp.MIN: "NCCL_MIN",
    ReduceOp.BAND: "NCCL_MIN",
    ReduceOp.BXOR: "NCCL_SUM",
}


def parse_version(code: int) -> tuple[int, int, int]:
    """(major, minor, patch) of an NCCL version code (2.32.3 is 23203; 2.7.8 is 2708)."""
    if code >= 10000:  # from 2.9 on: major * 10000 + minor * 100 + patch
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def _text(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


def import_nccl(*, need_device: bool = True) -> tuple[Any, tuple[int, int, int]]:
    """`cupy.cuda.nccl` and the NCCL runtime version, checked usable.

    Args:
        need_device: also check that CUDA sees a device, which initialises CUDA in this
            process (a process forked afterwards cannot use it). False: only CuPy and the
            NCCL library are checked (NCCL's version query does not touch CUDA), as the
            availability probes do.

    With DISTCOMM_NCCL_BINDINGS=nccl4py the module is `distcomm.gpu.nccl4py`, NVIDIA's
    nccl4py behind CuPy's interface (non-blocking communicators); CuPy is still needed
    for the arrays, streams and events.

    Raises:
        BackendUnavailableError: CuPy, a device (`need_device`), nccl4py (when chosen) or
            the NCCL library is missing, NCCL is older than 2.7, or DISTCOMM_NCCL_BINDINGS
            names no bindings; the message says what to install or set (`_nccl_missing`).
    """
    bindings = bindings_choice()
    cupy = import_cupy("the nccl backend", need_device=need_device)
    nccl: Any
    if bindings == "nccl4py":
        from . import nccl4py as nccl

        nccl.load()
    else:
        try:
            from cupy.cuda import nccl
        except ImportError as exc:
            raise BackendUnavailableError(
                _nccl_missing(cupy, f"cupy.cuda.nccl fails to import ({exc})", need_device)
            ) from exc
    if not getattr(nccl, "available", False):
        bindings_module = "nccl4py" if bindings == "nccl4py" else "cupy.cuda.nccl"
        raise BackendUnavailableError(
            _nccl_missing(cupy, f"{bindings_module} found no NCCL library", need_device)
        )
    try:
        version = parse_version(int(nccl.get_version()))
    except Exception as exc:  # NcclError from a broken library
        raise BackendUnavailableError(
            f"the nccl backend: the NCCL library does not answer ncclGetVersion ({exc}); "
            f"reinstall it: {INSTALL_HINT}"
        ) from exc
    if version < MIN_VERSION:
        raise BackendUnavailableError(
            f"the nccl backend needs NCCL >= {_text(MIN_VERSION)} (for send/recv), found "
            f"{_text(version)}; upgrade: pip install -U nvidia-nccl-cu12"
        )
    built = build_version(nccl)
    if built is not None and built < MIN_VERSION:  # CuPy's bindings lack what it lacked
        raise BackendUnavailableError(
            f"the nccl backend needs a CuPy built against NCCL >= {_text(MIN_VERSION)} (for "
            f"send/recv), but this CuPy was built against NCCL {_text(built)} (it runs "
            f"{_text(version)}); install a newer CuPy: {INSTALL_HINT}"
        )
    return nccl, version


def _nccl_missing(cupy: Any, what: str, device_checked: bool) -> str:
    """Why the nccl backend cannot run where CuPy imports but its NCCL does not load
    (`what`): no GPU first, where none is visible (installing NCCL would not help then),
    else the NCCL wheel to install. `device_checked`: CUDA saw a device already."""
    installed = f"CuPy {getattr(cupy, '__version__', '?')} is installed"
    absent = "" if device_checked else runtime.no_gpu_reason()
    if absent:
        return (
            f"the nccl backend: {installed} but no GPU is visible to this process ({absent}), "
            f"and {what}. {runtime.no_gpu_remedy()}; on a host with a GPU, install NCCL: "
            f"{runtime.nccl_install_hint()}"
        )
    return (
        f"the nccl backend: {installed} but its NCCL bindings are not available: {what}; "
        f"install the NCCL wheel for your CUDA version: {runtime.nccl_install_hint()}"
    )


def bindings_choice() -> str:
    """DISTCOMM_NCCL_BINDINGS: "cupy" (the default) or "nccl4py".

    Raises:
        BackendUnavailableError: it names neither; the message names the choices.
    """
    try:
        return str(config.get("DISTCOMM_NCCL_BINDINGS"))
    except ValueError as exc:
        raise BackendUnavailableError(f"the nccl backend: {exc}") from exc


def build_version(nccl: Any) -> tuple[int, int, int] | None:
    """The NCCL version CuPy was built against (`get_build_version`), or None where this
    CuPy cannot say."""
    getter = getattr(nccl, "get_build_version", None)
    if getter is None:
        return None
    try:
        return parse_version(int(getter()))
    except Exception:  # a CuPy whose getter fails: nothing to check against
        return None


def version_text(code: Any) -> str:
    """An NCCL version code as text: 22809 -> "2.28.9"."""
    return _text(parse_version(int(code)))


# -- unique ids -------------------------------------------------------------------------------


def unique_id_bytes(uid: Any) -> bytes:
    """An NCCL unique id as 128 bytes, from CuPy 14's bytes or CuPy 13's tuple of ints.

    Raises:
        TypeError: not bytes or a sequence of ints.
        ValueError: not 128 long, or an int outside -128..255.
    """
    if isinstance(uid, (bytes, bytearray, memoryview)):
        data = bytes(uid)
    elif isinstance(uid, (tuple, list)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in uid):
            raise TypeError("an NCCL unique id tuple must hold ints (CuPy 13's form)")
        if any(not -128 <= v <= 255 for v in uid):
            raise ValueError("an NCCL unique id tuple holds bytes: every int must be in -128..255")
        data = bytes(v & 0xFF for v in uid)
    else:
        raise TypeError(
            f"an NCCL unique id is bytes (CuPy >= 14) or a tuple of ints "
            f"(CuPy 13), got {type(uid).__name__}"
        )
    if len(data) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(data)}")
    return data


def comm_id(data: bytes, form: type) -> bytes | tuple[int, ...]:
    """`data` (128 bytes) in the form a CuPy's `NcclCommunicator` takes: `bytes` (CuPy >= 14)
    or `tuple` of signed chars (CuPy 13)."""
    if form is bytes:
        return bytes(data)
    if form is tuple:
        return tuple(b - 256 if b > 127 else b for b in data)
    raise ValueError(f"comm_id: form must be bytes or tuple, got {form!r}")


#: the first CuPy whose unique ids are bytes: 14.0.0rc1 (its alphas and betas: tuples)
_BYTES_IDS_FROM = (14, 0, 0, 2, 1)
_PRE_RELEASE = {"a": 0, "b": 1, "rc": 2}


def cupy_version_key(text: str) -> tuple[int, ...] | None:
    """A CuPy version ("14.0.0rc1", "13.6.0") as a sortable key: (major, minor, patch,
    stage, number), where a final release's stage (3) sorts after a, b and rc (0, 1, 2);
    None for a version this cannot read."""
    found = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?(?:(a|b|rc)(\d+))?", text.strip())
    if found is None:
        return None
    major, minor, patch, stage, number = found.groups()
    return (
        int(major),
        int(minor),
        int(patch or 0),
        _PRE_RELEASE[stage] if stage else 3,
        int(number or 0),
    )


def _cupy_form() -> type:
    cupy = import_cupy("the nccl backend", need_device=False)
    key = cupy_version_key(str(cupy.__version__))
    if key is None:  # an unreadable version: a recent CuPy, probably; others are tried too
        return bytes
    return bytes if key >= _BYTES_IDS_FROM else tuple


def create_communicator(nccl: Any, size: int, data: bytes, rank: int) -> Any:
    """`nccl.NcclCommunicator(size, id, rank)` with the id in the installed CuPy's form.

    The form follows CuPy's version; if CuPy refuses it (a TypeError naming commId, or an
    OverflowError where C `char` is unsigned, as on aarch64) the others are tried: bytes,
    a tuple of signed chars, a tuple of unsigned chars. nccl4py's communicators
    (`distcomm.gpu.nccl4py`, non-blocking: their initialisation is under way when this
    returns) take the bytes.
    """
    if getattr(nccl, "nonblocking", False):
        return nccl.NcclCommunicator(size, bytes(data), rank)
    signed, unsigned = comm_id(data, tuple), tuple(data)
    forms = (
        [bytes(data), signed, unsigned]
        if _cupy_form() is bytes
        else [signed, unsigned, bytes(data)]
    )
    refused: BaseException | None = None
    for form in forms:
        try:
            return nccl.NcclCommunicator(size, form, rank)
        except TypeError as exc:  # raised converting the argument, before NCCL is called
            if "commId" not in str(exc):
                raise
            refused = exc
        except OverflowError as exc:
            refused = exc
    assert refused is not None
    raise refused


# -- dtypes and reductions --------------------------------------------------------------------


@dataclass(frozen=True)
class Movement:
    """How arrays of a dtype travel: NCCL type name and NCCL elements per array element."""

    dtype: str
    factor: int


@dataclass(frozen=True)
class Reduction:
    """How a reduction runs: NCCL type and op names, elements per array element, and what
    to do to the result afterwards ("" nothing, "divide" by the group size, "parity" keep
    the lowest bit)."""

    dtype: str
    factor: int
    op: str
    post: str = ""


def movement(dtype: np.dtype) -> Movement:
    """The NCCL type that moves arrays of `dtype` unchanged (bytes for the others)."""
    name = _NATIVE.get(np.dtype(dtype).name)
    if name is not None:
        return Movement(name, 1)
    return Movement("NCCL_UINT8", np.dtype(dtype).itemsize)


def reduction(
    dtype: np.dtype, op: ReduceOp, version: tuple[int, int, int], where: str, ranks: int = 2
) -> Reduction:
    """How NCCL reduces arrays of `dtype` with `op` (already validated by check_reduce_op)
    in a communicator of `ranks` ranks.

    Raises:
        TypeError: NCCL cannot do it (bitwise ops on integers, 16-bit integers, complex
            PRODUCT); the message says what to use instead.
    """
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return Reduction("NCCL_UINT8", 1, _BOOL_OPS[op], "parity" if op is ReduceOp.BXOR else "")
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        raise TypeError(
            f"{where}: NCCL has no bitwise reductions (ReduceOp.{op.name} on {dt}); reduce "
            "on a CPU backend (a group created with backend='cpu:gloo,cuda:nccl' and "
            "numpy arrays), or use bool arrays, for which BAND/BOR/BXOR work on NCCL"
        )
    if dt.kind == "c":
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise TypeError(
                f"{where}: ReduceOp.{op.name} of complex arrays cannot run on NCCL, which "
                "has no complex type (SUM and AVG work, as sums of the real and imaginary "
                "parts); multiply on a CPU backend instead"
            )
        part = _NATIVE["float32" if dt.itemsize == 8 else "float64"]
        return _with_avg(Reduction(part, 2, NCCL_OP_NAMES[op]), version, ranks)
    name = _NATIVE.get(dt.name)
    if name is None:
        raise TypeError(
            f"{where}: NCCL cannot reduce {dt} arrays (it has no 16-bit integer type); "
            "cast to int32 (array.astype(cupy.int32)) and back"
        )
    return _with_avg(Reduction(name, 1, NCCL_OP_NAMES[op]), version, ranks)


def _with_avg(plan: Reduction, version: tuple[int, int, int], ranks: int) -> Reduction:
    if plan.op == "NCCL_AVG" and ranks == 1:
        # the average of one rank's array is that array. NCCL's AVG on one rank runs a
        # kernel of its own, which before 2.29.7 leaves the last (count % blocks) elements
        # of an out-of-place result unwritten (NVIDIA/nccl#1950, seen with 2.28.9 on an
        # H200); SUM on one rank is a plain copy
        return Reduction(plan.dtype, plan.factor, "NCCL_SUM")
    if plan.op == "NCCL_AVG" and version < AVG_VERSION:
        return Reduction(plan.dtype, plan.factor, "NCCL_SUM", "divide")
    return plan
