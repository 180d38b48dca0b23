"""The nccl backend through nccl4py's bindings (DISTCOMM_NCCL_BINDINGS=nccl4py), against
the CUDA stand-in (tests/cuda_standin.py) and nccl4py's stand-in (tests/nccl4py_standin.py):
non-blocking communicators, polled by the caller, aborted at any time.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import distcomm as dist
from distcomm import config
from distcomm.backends.nccl import NcclBackend
from distcomm.errors import BackendUnavailableError, DistBackendError, DistTimeoutError
from distcomm.gpu import nccl as nccl_types
from distcomm.gpu import nccl4py
from distcomm.ops import ReduceOp
from tests import test_nccl_standin as base
from tests.cuda_standin import CudaStandin
from tests.nccl4py_standin import BOUND, Nccl4pyStandin
from tests.test_collectives import expected_reduction, values

SUM, AVG, MAX = ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX
Rank = base.Rank


@pytest.fixture
def cuda(monkeypatch):
    """The CUDA stand-in as `cupy` and nccl4py's stand-in as `nccl`, with
    DISTCOMM_NCCL_BINDINGS=nccl4py; fails the test on misuse of either."""
    body = base.installed_standin(monkeypatch, device_count=4)
    standin = next(body)
    standin.nccl4py = Nccl4pyStandin(standin).install(monkeypatch)
    monkeypatch.setenv("DISTCOMM_NCCL_BINDINGS", "nccl4py")
    yield standin
    next(body, None)  # the stand-in's end: hung inits ended, misuse checked


@pytest.fixture
def n4p(cuda) -> Nccl4pyStandin:
    """The nccl4py stand-in of the test (its threads, the communicators it aborted)."""
    return cuda.nccl4py


@pytest.fixture
def make_cluster(cuda):
    yield from base.clusters(cuda)


def _eventually(check: Any, what: str, timeout: float = 10.0) -> None:
    """Wait until `check()` holds (what an abort's threads do ends a moment later)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


# -- collectives and point to point ---------------------------------------------------------


def _collectives(me: Rank) -> None:
    b, r, n, cp = me.backend, me.rank, me.size, me.cp
    assert b._nccl is nccl4py and b._comm is None
    for op, dtype in ((SUM, "float32"), (AVG, "float64"), (MAX, "int32"), (SUM, "bool")):
        x = me.array(values(r, 13, dtype, op))
        assert b.all_reduce(x, op).wait() is True
        base.same(x.get(), expected_reduction(n, 13, dtype, op), f"all_reduce {op} {dtype}")
    assert getattr(b._comm, "nonblocking", False)
    for root in range(n):
        y = me.array(values(r, 9, "float32"))
        b.reduce(y, root, SUM).wait()
        want = expected_reduction(n, 9, "float32", SUM) if r == root else values(r, 9, "float32")
        base.same(y.get(), want, f"reduce to {root}")
        z = me.array(values(r, 5, "int64"))
        b.broadcast(z, root).wait()
        base.same(z.get(), values(root, 5, "int64"), f"broadcast from {root}")
    out = cp.empty(n * 4, cp.float32)
    b.all_gather(out, me.array(values(r, 4, "float32"))).wait()
    base.same(out.get(), np.concatenate([values(k, 4, "float32") for k in range(n)]), "gather")
    piece = cp.empty(3, cp.float32)
    b.reduce_scatter(piece, me.array(values(r, 3 * n, "float32")), SUM).wait()
    want = expected_reduction(n, 3 * n, "float32", SUM)[r * 3 : (r + 1) * 3]
    base.same(piece.get(), want, "reduce_scatter")
    b.barrier().wait()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_collectives_give_numpys_results(make_cluster, size):
    make_cluster(size).run(_collectives, timeout=100)


def _sends_and_receives(me: Rank) -> None:
    b, r, n, cp = me.backend, me.rank, me.size, me.cp
    right, left = (r + 1) % n, (r - 1) % n
    # lone sends and receives: a ring, posted together as one NCCL group
    got = cp.empty(6, cp.float32)
    send = b.send(me.array(values(r, 6, "float32")), right, 0)
    recv = b.recv(got, left, 0)
    assert recv.wait() is True and send.wait() is True
    base.same(got.get(), values(left, 6, "float32"), "ring")
    # a batch: a send to and a receive from every other rank
    peers = [p for p in range(n) if p != r]
    slots = {p: cp.empty(4, cp.int32) for p in peers}
    with b.coalesce(got):
        for p in peers:
            b.send(me.array(values(r * n + p, 4, "int32")), p, 0)
            b.recv(slots[p], p, 0)
    b.barrier().wait()
    for p in peers:
        base.same(slots[p].get(), values(p * n + r, 4, "int32"), f"batch from {p}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_sends_and_receives_give_what_was_sent(make_cluster, size):
    make_cluster(size).run(_sends_and_receives, timeout=100)


@pytest.mark.timeout(120)
def test_the_public_api(solo, make_cluster):
    make_cluster(3).run(base._public, "float32", timeout=100)


# -- initialisation: polled, and aborted on a failure or the timeout ------------------------


@pytest.mark.timeout(60)
def test_a_failed_init_aborts_the_others_within_the_timeout(cuda, n4p, make_cluster):
    """Real NCCL leaves the healthy ranks' initialisation hanging when one fails: with
    nccl4py they learn of it through the store, abort their communicators, and nothing
    stays behind inside the initialisation."""
    cuda.fail_init(1)
    errors = base._errors(make_cluster(3, timeout=10.0).outcomes(base._first_op))
    for error in errors:
        assert isinstance(error, DistBackendError), error
        assert "ncclCommInitRank failed" in str(error), error
    assert "ncclSystemError (2)" in str(errors[1]), errors[1]
    for r in (0, 2):
        assert "failed on rank 1:" in str(errors[r]), errors[r]
    assert sorted(n4p.aborted()) == [0, 1, 2]
    _eventually(lambda: cuda.hung_inits == 0, "an initialisation still hangs after its abort")
    _eventually(lambda: not n4p.threads(), "a communicator's thread is still running")
    assert cuda.init_hangs_timed_out == 0


@pytest.mark.timeout(60)
def test_an_init_a_rank_never_joins_times_out_and_is_aborted(cuda, n4p, make_cluster):
    cluster = make_cluster(2, timeout=0.5)
    # rank 1 says which GPU it uses, then never calls NCCL
    cluster.backends[1].store.set("gpu/1", "elsewhere 0000:00:01.0")
    ((_, error),) = cluster.outcomes(base._first_op, ranks=[0])
    assert isinstance(error, DistTimeoutError), error
    assert "ncclCommInitRank did not finish within 0.5 s" in str(error), error
    assert n4p.aborted() == [0]
    _eventually(lambda: not n4p.threads(), "a communicator's thread is still running")


# -- aborts at any time -----------------------------------------------------------------------


def _abort_while_in_progress(me: Rank) -> None:
    b, cp = me.backend, me.cp
    raised: list[BaseException] = []

    def lone_all_reduce() -> None:  # rank 1 never joins it: it stays ncclInProgress
        try:
            b.all_reduce(cp.ones(3, cp.float32), SUM)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=lone_all_reduce, name="rank0-lone")
    me.cp.cuda.Device(me.device).use()
    thread.start()
    standin = me.standin.communicators(0)[0]
    _eventually(lambda: "allReduce" in standin.inside.values(), "the call never started")
    b.abort("stop now")  # NCCL allows it on a non-blocking communicator: no waiting
    thread.join(10)
    assert not thread.is_alive(), "the call in progress did not end on the abort"
    assert len(raised) == 1 and isinstance(raised[0], DistBackendError), raised
    assert "stop now" in str(raised[0]), raised[0]
    assert standin.aborted


@pytest.mark.timeout(60)
def test_an_abort_while_a_call_is_in_progress_is_no_violation(cuda, make_cluster):
    cluster = make_cluster(2)
    cluster.run(base._first_op)
    cluster.run(_abort_while_in_progress, ranks=[0])
    assert [c.rank for c in cuda.calls("abort")][:1] == [0]


def _call_times_out(me: Rank) -> None:
    with pytest.raises(DistTimeoutError, match=r"still in progress|within 0\.5 s"):
        me.backend.all_reduce(me.cp.ones(3, me.cp.float32), SUM)


@pytest.mark.timeout(60)
def test_a_call_in_progress_is_bounded_by_the_group_timeout(cuda, n4p, make_cluster):
    cluster = make_cluster(2, timeout=0.5)
    cluster.run(base._first_op)
    cluster.run(_call_times_out, ranks=[0])  # rank 1 never joins that all_reduce
    _eventually(lambda: 0 in n4p.aborted(), "the communicator was not aborted")


# -- the choice of bindings -------------------------------------------------------------------


def test_the_default_is_cupys_bindings(monkeypatch):
    body = base.installed_standin(monkeypatch, device_count=2)
    standin = next(body)
    try:
        monkeypatch.delenv("DISTCOMM_NCCL_BINDINGS", raising=False)
        assert config.load().nccl_bindings == "cupy"
        module, _ = nccl_types.import_nccl()
        assert module is standin.nccl
        backend = NcclBackend(dist.PrefixStore("nccl", dist.HashStore()), 0, 1, 10.0, "g")
        try:
            assert backend._nccl is standin.nccl
        finally:
            backend.shutdown()
    finally:
        next(body, None)


def test_nccl4py_is_chosen_by_the_variable(cuda):
    module, version = nccl_types.import_nccl()
    assert module is nccl4py and module.available and version == (2, 32, 3)
    assert config.load().nccl_bindings == "nccl4py"


def test_a_bad_value_is_refused_naming_the_choices(cuda, monkeypatch):
    monkeypatch.setenv("DISTCOMM_NCCL_BINDINGS", "nccl5")
    text = "DISTCOMM_NCCL_BINDINGS='nccl5' is not valid: use 'cupy'"
    with pytest.raises(ValueError, match=text):
        config.get("DISTCOMM_NCCL_BINDINGS")
    assert text in NcclBackend.unavailable_reason()
    assert "'nccl4py'" in NcclBackend.unavailable_reason()
    with pytest.raises(BackendUnavailableError, match=text):
        NcclBackend(dist.PrefixStore("nccl", dist.HashStore()), 0, 1, 10.0, "g")


def test_a_missing_nccl4py_says_what_to_install(cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "nccl.bindings.nccl", None)  # import fails
    reason = NcclBackend.unavailable_reason()
    assert "DISTCOMM_NCCL_BINDINGS=nccl4py" in reason and "pip install nccl4py" in reason


# -- the stand-in against the real nccl4py ---------------------------------------------------


def test_the_stand_in_has_the_real_bindings_signatures():
    real = pytest.importorskip("nccl.bindings.nccl", reason="nccl4py is not installed")
    if isinstance(real, type(sys)) and getattr(real, "__file__", None) is None:
        pytest.skip("nccl.bindings.nccl is a stand-in here")
    fake = Nccl4pyStandin(CudaStandin(device_count=1)).bindings
    for name in BOUND:
        want = list(inspect.signature(getattr(real, name)).parameters)
        got = list(inspect.signature(getattr(fake, name)).parameters)
        assert got == want, f"{name}: the stand-in takes {got}, nccl4py {want}"
    for name in ("Result", "NCCLError", "UniqueId", "Config", "Comm"):
        assert hasattr(real, name), name
    assert int(real.Result.InProgress) == 7 and int(real.Result.Success) == 0
    assert hasattr(real.UniqueId, "from_buffer") and hasattr(real.Config(), "blocking")
