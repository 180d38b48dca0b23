"""The GPU glue that needs no device: NCCL type mapping, unique ids, versions, messages.

These run everywhere. The ones marked "real CuPy" check distcomm's use of CuPy's actual
bindings (attribute names, unique-id form, the message without a usable device); they
run where CuPy is installed, device or not, and skip otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

import distcomm as dist
from distcomm import config
from distcomm.arrays import DTYPES
from distcomm.backends import get_backend_record
from distcomm.backends.spec import parse_backend
from distcomm.errors import BackendUnavailableError
from distcomm.gpu import nccl as nt
from distcomm.gpu import runtime
from distcomm.ops import ReduceOp, check_reduce_op

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_CUPY = importlib.util.find_spec("cupy") is not None
NEW = (2, 32, 3)
OLD = (2, 9, 6)  # before ncclAvg


# -- versions and unique ids --------------------------------------------------------------------


@pytest.mark.parametrize(
    "code,version",
    [
        (23203, (2, 32, 3)),
        (21005, (2, 10, 5)),
        (2708, (2, 7, 8)),
        (2406, (2, 4, 6)),
        (20906, (2, 9, 6)),
    ],
)
def test_parse_version(code, version):
    assert nt.parse_version(code) == version


def test_unique_id_forms_round_trip():
    data = bytes(range(128))
    assert nt.unique_id_bytes(data) == data
    assert nt.unique_id_bytes(bytearray(data)) == data
    as_tuple = nt.comm_id(data, tuple)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == 128
    assert all(-128 <= v <= 127 for v in as_tuple)  # CuPy 13 stores signed chars
    assert as_tuple[127] == 127 and nt.comm_id(bytes([200] * 128), tuple)[0] == 200 - 256
    assert nt.unique_id_bytes(as_tuple) == data
    assert nt.unique_id_bytes(list(as_tuple)) == data
    high = bytes([255, 128, 0, 127] * 32)
    assert nt.unique_id_bytes(nt.comm_id(high, tuple)) == high
    assert nt.comm_id(high, bytes) == high


@pytest.mark.parametrize(
    "bad,error,match",
    [
        (b"x" * 127, ValueError, "128 bytes, got 127"),
        (tuple(range(129)), ValueError, "128 bytes, got 129"),
        ((300,) * 128, ValueError, "-128..255"),
        ((1.5,) * 128, TypeError, "ints"),
        ((True,) * 128, TypeError, "ints"),
        ("text", TypeError, "got str"),
        (None, TypeError, "got NoneType"),
    ],
)
def test_unique_id_rejects(bad, error, match):
    with pytest.raises(error, match=match):
        nt.unique_id_bytes(bad)


class _Communicators:
    """What `create_communicator` sees of a CuPy: a constructor that accepts one id form."""

    def __init__(self, accepts: str) -> None:
        self.accepts, self.tried = accepts, []

    def NcclCommunicator(self, size: int, uid: object, rank: int) -> tuple:
        form = (
            "bytes"
            if isinstance(uid, bytes)
            else "signed"
            if any(v < 0 for v in uid)
            else "unsigned"
        )
        self.tried.append(form)
        if form != self.accepts:
            if self.accepts == "unsigned" and form == "signed":  # C char is unsigned
                raise OverflowError("value too large to convert to char")
            raise TypeError(
                f"Argument 'commId' has incorrect type (expected "
                f"{'bytes' if self.accepts == 'bytes' else 'tuple'}, got "
                f"{type(uid).__name__})"
            )
        return (size, uid, rank)


@pytest.mark.parametrize(
    "version,accepts,tried",
    [
        ("14.2.0", "bytes", ["bytes"]),
        ("13.6.0", "signed", ["signed"]),
        ("14.2.0", "signed", ["bytes", "signed"]),  # a CuPy 14 that still takes tuples
        ("13.6.0", "unsigned", ["signed", "unsigned"]),  # CuPy 13 where char is unsigned
        ("13.6.0", "bytes", ["signed", "unsigned", "bytes"]),
    ],
)
def test_create_communicator_finds_the_id_form(monkeypatch, version, accepts, tried):
    monkeypatch.setitem(sys.modules, "cupy", type(sys)("cupy"))
    sys.modules["cupy"].__version__ = version
    data = bytes([200, 1] * 64)  # a byte above 127: signed and unsigned tuples differ
    fake = _Communicators(accepts)
    size, uid, rank = nt.create_communicator(fake, 4, data, 2)
    assert (size, rank) == (4, 2) and nt.unique_id_bytes(uid) == data
    assert fake.tried[: len(tried)] == tried and fake.tried[-1] == accepts


@pytest.mark.parametrize(
    "version,form",
    [
        ("13.6.0", tuple),
        ("14.0.0a1", tuple),  # CuPy 14's alphas and betas still gave tuples
        ("14.0.0b2", tuple),
        ("14.0.0rc1", bytes),  # the switch
        ("14.0.0", bytes),
        ("14.2.0", bytes),
        ("15.0.0.dev0", bytes),
    ],
)
def test_the_unique_id_form_switches_at_cupy_14_rc1(monkeypatch, version, form):
    monkeypatch.setitem(sys.modules, "cupy", type(sys)("cupy"))
    sys.modules["cupy"].__version__ = version
    assert nt._cupy_form() is form


def test_create_communicator_keeps_other_type_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", type(sys)("cupy"))
    sys.modules["cupy"].__version__ = "14.2.0"

    class Broken:
        def NcclCommunicator(self, size, uid, rank):
            raise TypeError("an unrelated bug")

    with pytest.raises(TypeError, match="an unrelated bug"):
        nt.create_communicator(Broken(), 2, bytes(128), 0)


def test_comm_id_rejects_unknown_form():
    with pytest.raises(ValueError, match="bytes or tuple"):
        nt.comm_id(bytes(128), list)


# -- dtypes and reductions ----------------------------------------------------------------------

NATIVE = {"int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_movement_moves_every_dtype(dtype):
    plan = nt.movement(dtype)
    if dtype.name in NATIVE:
        assert plan == nt.Movement(f"NCCL_{dtype.name.upper()}", 1)
    else:  # bool, int16, uint16, complex: as bytes
        assert plan == nt.Movement("NCCL_UINT8", dtype.itemsize)


def _valid(op: ReduceOp, dtype: np.dtype) -> bool:
    try:
        check_reduce_op(op, dtype, "t")
    except TypeError:
        return False
    return True


CASES = [(op, d) for op in ReduceOp for d in DTYPES if _valid(op, d)]


@pytest.mark.parametrize("op,dtype", CASES, ids=[f"{o.name}-{d}" for o, d in CASES])
def test_reduction_plan(op, dtype):
    kind = dtype.kind
    bitwise = op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
    if kind != "b" and (
        bitwise or dtype.name in ("int16", "uint16") or (kind == "c" and op is ReduceOp.PRODUCT)
    ):
        with pytest.raises(TypeError, match="NCCL"):
            nt.reduction(dtype, op, NEW, "all_reduce")
        return
    plan = nt.reduction(dtype, op, NEW, "all_reduce")
    if kind == "b":
        ops = {
            ReduceOp.SUM: "NCCL_MAX",
            ReduceOp.MAX: "NCCL_MAX",
            ReduceOp.BOR: "NCCL_MAX",
            ReduceOp.PRODUCT: "NCCL_MIN",
            ReduceOp.MIN: "NCCL_MIN",
            ReduceOp.BAND: "NCCL_MIN",
            ReduceOp.BXOR: "NCCL_SUM",
        }
        assert plan == nt.Reduction(
            "NCCL_UINT8", 1, ops[op], "parity" if op is ReduceOp.BXOR else ""
        )
    elif kind == "c":
        part = "NCCL_FLOAT32" if dtype == np.complex64 else "NCCL_FLOAT64"
        assert plan == nt.Reduction(part, 2, "NCCL_SUM" if op is ReduceOp.SUM else "NCCL_AVG")
    else:
        names = {
            ReduceOp.SUM: "NCCL_SUM",
            ReduceOp.AVG: "NCCL_AVG",
            ReduceOp.PRODUCT: "NCCL_PROD",
            ReduceOp.MIN: "NCCL_MIN",
            ReduceOp.MAX: "NCCL_MAX",
        }
        assert plan == nt.Reduction(f"NCCL_{dtype.name.upper()}", 1, names[op])


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "complex64", "complex128"])
def test_avg_before_nccl_2_10_is_sum_then_divide(dtype):
    plan = nt.reduction(np.dtype(dtype), ReduceOp.AVG, OLD, "all_reduce")
    assert plan.op == "NCCL_SUM" and plan.post == "divide"
    assert nt.reduction(np.dtype(dtype), ReduceOp.AVG, (2, 10, 0), "x").op == "NCCL_AVG"


@pytest.mark.parametrize("dtype", ["float32", "int64", "complex64"])
def test_avg_on_one_rank_is_sum(dtype):
    # NCCL's one-rank AVG kernel left the tail of an out-of-place result unwritten before
    # 2.29.7 (NVIDIA/nccl#1950; seen on a GPU with 2.28.9): one rank's average is a copy
    for version in (NEW, OLD):
        plan = nt.reduction(np.dtype(dtype), ReduceOp.AVG, version, "reduce_scatter", 1)
        assert (plan.op, plan.post) == ("NCCL_SUM", ""), plan
    assert nt.reduction(np.dtype("float32"), ReduceOp.AVG, NEW, "x", 2).op == "NCCL_AVG"


def test_reduction_messages_say_what_to_do():
    with pytest.raises(
        TypeError,
        match=r"all_reduce: NCCL has no bitwise .*BAND on int32.*"
        r"cpu:gloo,cuda:nccl",
    ):
        nt.reduction(np.dtype("int32"), ReduceOp.BAND, NEW, "all_reduce")
    with pytest.raises(TypeError, match=r"reduce: NCCL cannot reduce int16.*astype"):
        nt.reduction(np.dtype("int16"), ReduceOp.SUM, NEW, "reduce")
    with pytest.raises(TypeError, match=r"PRODUCT of complex.*SUM and AVG work"):
        nt.reduction(np.dtype("complex64"), ReduceOp.PRODUCT, NEW, "all_reduce")


# -- without CuPy -------------------------------------------------------------------------------


def test_importing_gpu_and_the_backend_does_not_import_cupy():
    code = (
        "import sys, distcomm, distcomm.gpu, distcomm.gpu.nccl, distcomm.backends.nccl; "
        "distcomm.gpu.is_cupy_array(1); "
        "assert 'cupy' not in sys.modules, 'imported cupy'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=ROOT)


@pytest.fixture
def no_cupy(monkeypatch):
    """`import cupy` fails as it does where CuPy is not installed."""
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(runtime, "_chosen", None)


def test_without_cupy_everything_says_what_to_install(no_cupy):
    assert runtime.device_count() == 0 and not runtime.is_available()
    reason = get_backend_record("nccl").availability()
    for package in ("cupy-cuda12x", "nvidia-nccl-cu12", "cupy-cuda13x", "nvidia-nccl-cu13"):
        assert package in reason
    assert "nccl backend" in reason
    assert not dist.is_nccl_available()
    for call in (
        lambda: runtime.set_device(0),
        runtime.current_device,
        runtime.synchronize,
        runtime.current_stream,
        nt.import_nccl,
    ):
        with pytest.raises(BackendUnavailableError, match="pip install cupy-cuda12x"):
            call()


def test_without_cupy_init_nccl_fails_with_the_install_hint(no_cupy):
    with pytest.raises(
        BackendUnavailableError,
        match=r"backend 'nccl' is not available: "
        r".*pip install cupy-cuda12x",
    ):
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()


def test_default_cuda_backend_falls_back_to_gloo_without_nccl(no_cupy):
    spec = parse_backend(None)
    assert spec == {"cpu": "gloo", "cuda": "gloo"}
    assert parse_backend("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    with pytest.raises(ValueError, match="does not serve cpu arrays"):
        parse_backend("cpu:nccl")
    assert get_backend_record("nccl").devices == ("cuda",)


def test_barrier_with_device_ids_on_a_cpu_group_uses_the_cpu_backend(solo):
    assert dist.barrier(device_ids=[0]) is None
    assert dist.barrier(device_ids=[0], async_op=True).wait(10) is True


def test_nccl_blocking_wait_flag():
    assert config.load({}).nccl_blocking_wait is False
    assert config.load({"DISTCOMM_NCCL_BLOCKING_WAIT": "1"}).nccl_blocking_wait is True
    with pytest.raises(ValueError, match="DISTCOMM_NCCL_BLOCKING_WAIT='maybe' is not a boolean"):
        config.load({"DISTCOMM_NCCL_BLOCKING_WAIT": "maybe"})


def test_benchmark_refuses_nccl_without_a_gpu_and_bad_pairs(no_cupy, capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import collectives as bench
    finally:
        sys.path.pop(0)
    cases = [
        (["--backend", "nccl"], "not available here: the nccl backend needs CuPy"),
        (["--backend", "gloo", "--compare", "cupy"], "--compare cupy needs --backend nccl"),
        (["--backend", "nosuch"], "unknown backend 'nosuch'"),
    ]
    for argv, message in cases:
        parser = bench.build_parser()
        args = parser.parse_args(argv)
        with pytest.raises(SystemExit) as info:
            bench.check_args(parser, args)
        assert info.value.code == 2
        assert message in capsys.readouterr().err


# -- real CuPy (installed; a device is not needed) ----------------------------------------------

needs_cupy = pytest.mark.skipif(not HAVE_CUPY, reason="CuPy is not installed here")


@needs_cupy
def test_real_bindings_have_every_name_distcomm_uses():
    from cupy.cuda import nccl

    if not getattr(nccl, "available", False):
        pytest.skip("CuPy found no NCCL library (pip install nvidia-nccl-cu12)")
    names = set(nt._NATIVE.values()) | set(nt._BOOL_OPS.values())
    names |= {"NCCL_SUM", "NCCL_PROD", "NCCL_MIN", "NCCL_MAX", "NCCL_AVG"}
    for name in sorted(names):
        assert isinstance(getattr(nccl, name), int), name
    for name in ("get_unique_id", "get_version", "groupStart", "groupEnd", "NcclError"):
        assert callable(getattr(nccl, name)), name
    for method in (
        "allReduce",
        "reduce",
        "broadcast",
        "allGather",
        "reduceScatter",
        "send",
        "recv",
        "abort",
        "destroy",
        "check_async_error",
    ):
        assert callable(getattr(nccl.NcclCommunicator, method)), method
    assert nt.parse_version(nccl.get_version()) >= nt.MIN_VERSION


@needs_cupy
def test_real_runtime_and_driver_have_every_name_distcomm_uses():
    """What the watchdog, the device guard, IPC and the fork probe call beyond NCCL."""
    import cupy

    for name in (
        "eventQuery",  # the event's status (Event.done hides a sticky error)
        "getDevice",
        "deviceGetPCIBusId",
        "ipcGetMemHandle",
        "ipcOpenMemHandle",
        "ipcCloseMemHandle",
    ):
        assert callable(getattr(cupy.cuda.runtime, name)), name
    assert issubclass(cupy.cuda.runtime.CUDARuntimeError, Exception)
    assert callable(cupy.cuda.driver.ctxGetCurrent)
    assert callable(cupy.cuda.get_current_stream)
    assert callable(cupy.cuda.Device.use)


@needs_cupy
def test_real_unique_id_converts(monkeypatch):
    from cupy.cuda import nccl

    if not getattr(nccl, "available", False):
        pytest.skip("CuPy found no NCCL library")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")  # the id's bootstrap address: loopback
    uid = nccl.get_unique_id()
    data = nt.unique_id_bytes(uid)
    assert len(data) == 128
    form = nt._cupy_form()
    assert isinstance(nt.comm_id(data, form), form)
    assert nt.comm_id(data, type(uid)) == uid  # CuPy gets back exactly what it gave


@needs_cupy
def test_real_cupy_without_a_device_names_the_driver():
    if runtime.device_count() > 0:
        pytest.skip("this machine has a GPU")
    # availability does not look for a GPU (asking initialises CUDA, which a process
    # forked afterwards cannot use): making the backend does, and says what to check
    with pytest.raises(BackendUnavailableError) as info:
        nt.import_nccl()
    reason = str(info.value)
    assert "CuPy is installed but CUDA reports no" in reason, reason
    assert "nvidia-smi" in reason and "CUDA_VISIBLE_DEVICES" in reason
    assert "no device" not in get_backend_record("nccl").availability()
    with pytest.raises(BackendUnavailableError, match=r"no usable device|no device"):
        runtime.set_device(0)
