"""The nccl backend against an in-process CuPy/NCCL stand-in (tests/cuda_standin.py).

Ranks are threads of this process, each on its own fake GPU, each with its own
`NcclBackend` over one shared HashStore. The stand-in moves and reduces the data as NCCL
would, so results are checked against numpy; its call log shows what the backend asked
NCCL to do (datatypes, ops, grouping, streams and events). No GPU or CuPy is needed.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import distcomm as dist
from distcomm.arrays import DTYPES
from distcomm.backends.nccl import NcclBackend
from distcomm.errors import (
    BackendUnavailableError,
    DistBackendError,
    DistError,
    DistTimeoutError,
)
from distcomm.gpu import runtime
from distcomm.group import ProcessGroup
from distcomm.ops import ReduceOp
from tests.cuda_standin import Call, CudaStandin, NcclError
from tests.harness import LOOPBACK_ENV
from tests.test_collectives import OP_DTYPES, expected_reduction, values

SIZES = (1, 2, 3, 4)
COUNTS = (0, 1, 13, 1000)
ALL_DTYPES = [str(d) for d in DTYPES]
NCCL_CALLS = {
    "allReduce",
    "reduce",
    "broadcast",
    "allGather",
    "reduceScatter",
    "send",
    "recv",
    "groupStart",
    "groupEnd",
}
COLLECTIVE_CALLS = {"allReduce", "reduce", "broadcast", "allGather", "reduceScatter"}
NEW_NCCL, OLD_NCCL = 23203, 20906  # 2.32.3 (has ncclAvg) and 2.9.6 (has not)
SUM, AVG = ReduceOp.SUM, ReduceOp.AVG
# NCCL's codes
UINT8, FLOAT32, FLOAT64 = 1, 7, 8
NCCL_SUM, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 2, 3, 4


def nccl_reduces(op: ReduceOp, dtype: str) -> bool:
    """Whether the nccl backend can reduce `dtype` with `op` (a valid pair)."""
    kind = np.dtype(dtype).kind
    if kind == "b":
        return True
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) or dtype in ("int16", "uint16"):
        return False
    return kind != "c" or op in (SUM, AVG)


def same(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if not np.array_equal(actual, expected):
        bad = np.flatnonzero(actual.reshape(-1) != expected.reshape(-1))[:5]
        raise AssertionError(
            f"{what}: mismatch at {bad.tolist()}: got "
            f"{actual.reshape(-1)[bad].tolist()}, expected "
            f"{expected.reshape(-1)[bad].tolist()}"
        )


# -- fixtures and the thread harness ------------------------------------------------------


def installed_standin(monkeypatch: Any, **options: Any) -> Iterator[CudaStandin]:
    """A fixture's body: the stand-in (`CudaStandin(**options)`) installed as `cupy`,
    with no GPU chosen and none of the variables the backend reads; at the end the hung
    initialisations end (as at exit), the GPUs finish what aborts left queued (a freed
    array shows), and any misuse fails the test."""
    standin = CudaStandin(**options).install(monkeypatch)
    monkeypatch.setattr(runtime, "_chosen", None)
    for name in (
        "LOCAL_RANK",
        "DISTCOMM_DEBUG",
        "DISTCOMM_NCCL_BLOCKING_WAIT",
        "CUDA_VISIBLE_DEVICES",
    ):
        monkeypatch.delenv(name, raising=False)
    yield standin
    standin.end_hung_inits()
    standin.settle()
    assert not standin.violations, f"misuse of the CUDA stand-in: {standin.violations}"


def clusters(standin: CudaStandin, **defaults: Any) -> Iterator[Callable[..., Cluster]]:
    """A fixture's body: `make(size, **kwargs)` makes Clusters (`defaults` first), all
    shut down at the end."""
    made: list[Cluster] = []

    def make(size: int, **kwargs: Any) -> Cluster:
        cluster = Cluster(standin, size, **{**defaults, **kwargs})
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.shutdown()


@pytest.fixture
def cuda(monkeypatch):
    """The stand-in installed as `cupy` (4 fake GPUs); fails the test on misuse."""
    yield from installed_standin(monkeypatch, device_count=4)


class Rank:
    """What a rank's thread works with."""

    def __init__(self, cluster: Cluster, rank: int) -> None:
        self.cluster = cluster
        self.rank, self.size = rank, cluster.size
        self.backend: NcclBackend = cluster.backends[rank]
        self.standin: CudaStandin = cluster.standin
        self.cp = cluster.standin.cupy
        self.device = cluster.devices[rank]
        self.thread = threading.current_thread().name

    def array(self, host: np.ndarray) -> Any:
        return self.cp.asarray(host)

    def mark(self) -> int:
        return len(self.standin.calls(thread=self.thread))

    def calls_since(self, mark: int, names: set[str] | None = NCCL_CALLS) -> list[Call]:
        calls = self.standin.calls(thread=self.thread)[mark:]
        return [c for c in calls if names is None or c.name in names]

    def group(self) -> ProcessGroup:
        return ProcessGroup(
            "g",
            list(range(self.size)),
            self.rank,
            {"cuda": self.backend},
            "nccl",
            self.cluster.timeout,
            self.rank,
        )


class Cluster:
    """`size` NcclBackends of one group over one HashStore; `run` drives them in threads."""

    def __init__(
        self,
        standin: CudaStandin,
        size: int,
        timeout: float = 30.0,
        devices: list[int] | None = None,
    ) -> None:
        self.standin, self.size, self.timeout = standin, size, timeout
        self.devices = devices or [r % standin.device_count for r in range(size)]
        self.store = dist.HashStore()
        self.backends = [
            NcclBackend(dist.PrefixStore("nccl", self.store), r, size, timeout, group_name="g")
            for r in range(size)
        ]
        self._runs = 0

    def outcomes(
        self,
        fn: Callable[..., Any],
        *args: Any,
        ranks: list[int] | None = None,
        timeout: float = 60.0,
    ) -> list[tuple[Any, BaseException | None]]:
        """Run `fn(Rank, *args)` on `ranks` (default: all), one thread each; the
        (result, exception) of each, in the order of `ranks`."""
        ranks = list(range(self.size)) if ranks is None else ranks
        self._runs += 1
        out: dict[int, tuple[Any, BaseException | None]] = {}
        self.standin.interrupt(None)

        def body(rank: int) -> None:
            try:
                self.standin.cuda.Device(self.devices[rank]).use()
                out[rank] = (fn(Rank(self, rank), *args), None)
            except (AssertionError, pytest.fail.Exception) as exc:  # a failed check:
                # stop the other ranks' waits in the stand-in
                out[rank] = (None, exc)
                self.standin.interrupt(f"rank {rank} failed: {exc}")
            except BaseException as exc:
                out[rank] = (None, exc)

        threads = [
            threading.Thread(target=body, args=(r,), daemon=True, name=f"rank{r}-run{self._runs}")
            for r in ranks
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout)
        stuck = [r for r, t in zip(ranks, threads, strict=True) if t.is_alive()]
        assert not stuck, f"ranks {stuck} did not finish within {timeout} s"
        return [out[r] for r in ranks]

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        ranks: list[int] | None = None,
        timeout: float = 60.0,
    ) -> list[Any]:
        """As `outcomes`, but re-raise the first rank's exception."""
        results = self.outcomes(fn, *args, ranks=ranks, timeout=timeout)
        for rank, (_, exc) in zip(ranks or range(self.size), results, strict=True):
            if exc is not None:
                raise AssertionError(f"rank {rank} failed: {exc!r}") from exc
        return [result for result, _ in results]

    def shutdown(self) -> None:
        for backend in self.backends:
            backend.shutdown()


@pytest.fixture
def make_cluster(cuda):
    yield from clusters(cuda)


def _errors(outcomes: list[tuple[Any, BaseException | None]]) -> list[BaseException]:
    errors = [exc for _, exc in outcomes]
    assert all(exc is not None for exc in errors), f"some ranks did not raise: {outcomes}"
    return errors


# -- reductions ------------------------------------------------------------------------------


def _reductions(me: Rank, pairs: list[tuple[ReduceOp, str]]) -> None:
    b, r, n = me.backend, me.rank, me.size
    for op, dtype in pairs:
        for count in COUNTS:
            what = f"{op.name} {dtype} x{count}"
            x = me.array(values(r, count, dtype, op))
            full = me.array(values(r, n * count, dtype, op))
            out = me.cp.empty(count, dtype)
            if not nccl_reduces(op, dtype):
                for fn, args in (
                    (b.all_reduce, (x, op)),
                    (b.reduce, (x, 0, op)),
                    (b.reduce_scatter, (out, full, op)),
                ):
                    with pytest.raises(TypeError, match="NCCL"):
                        fn(*args)
                continue
            assert b.all_reduce(x, op).wait() is True
            same(x.get(), expected_reduction(n, count, dtype, op), f"all_reduce {what}")
            for root in range(n):
                y = me.array(values(r, count, dtype, op))
                b.reduce(y, root, op).wait()
                want = (
                    expected_reduction(n, count, dtype, op)
                    if r == root
                    else values(r, count, dtype, op)
                )
                same(y.get(), want, f"reduce to {root} {what}")
            b.reduce_scatter(out, full, op).wait()
            want = expected_reduction(n, n * count, dtype, op)[r * count : (r + 1) * count]
            same(out.get(), want, f"reduce_scatter {what}")
            same(full.get(), values(r, n * count, dtype, op), f"reduce_scatter input {what}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", SIZES)
def test_reductions(make_cluster, size):
    make_cluster(size).run(_reductions, OP_DTYPES, timeout=200)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", SIZES)
def test_avg_without_nccl_avg(cuda, make_cluster, size):
    cuda.nccl_version = OLD_NCCL  # NCCL 2.9: SUM, then a division on the group's stream
    cluster = make_cluster(size)
    pairs = [(op, d) for op, d in OP_DTYPES if op is AVG]
    cluster.run(_reductions, pairs, timeout=100)
    ops = {c.args["op"] for c in cuda.calls(COLLECTIVE_CALLS - {"broadcast", "allGather"})}
    assert ops == {NCCL_SUM}, "ncclAvg was used on NCCL 2.9"


def _mapping(me: Rank, version: int) -> list[tuple]:
    b, r, cp = me.backend, me.rank, me.cp
    seen = []
    cases = [
        ("bool", ReduceOp.SUM),
        ("bool", ReduceOp.MAX),
        ("bool", ReduceOp.BOR),
        ("bool", ReduceOp.PRODUCT),
        ("bool", ReduceOp.MIN),
        ("bool", ReduceOp.BAND),
        ("bool", ReduceOp.BXOR),
        ("complex64", SUM),
        ("complex128", AVG),
        ("float16", AVG),
        ("int64", ReduceOp.PRODUCT),
    ]
    for dtype, op in cases:
        x = me.array(values(r, 5, dtype, op))
        mark = me.mark()
        b.all_reduce(x, op).wait()
        (call,) = me.calls_since(mark, {"allReduce"})
        seen.append((dtype, op.name, call.args["datatype"], call.args["op"], call.args["count"]))
    x = me.array(values(r, 6, "int16"))
    mark = me.mark()
    b.broadcast(x, 0).wait()
    (call,) = me.calls_since(mark, {"broadcast"})
    seen.append(("int16", "broadcast", call.args["datatype"], None, call.args["count"]))
    x = cp.zeros(3, cp.complex64)
    mark = me.mark()
    # a lone send or receive is posted when something needs it: here its wait()
    (b.send(x, (r + 1) % me.size, 0) if r == 0 else b.recv(x, 0, 0)).wait()
    (call,) = me.calls_since(mark, {"send", "recv"})
    seen.append(("complex64", call.name, call.args["datatype"], None, call.args["count"]))
    return seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version", [NEW_NCCL, OLD_NCCL])
def test_dtype_and_op_mapping(cuda, make_cluster, version):
    cuda.nccl_version = version
    avg = NCCL_AVG if version == NEW_NCCL else NCCL_SUM
    first = make_cluster(2).run(_mapping, version)[0]
    assert first == [
        ("bool", "SUM", UINT8, NCCL_MAX, 5),
        ("bool", "MAX", UINT8, NCCL_MAX, 5),
        ("bool", "BOR", UINT8, NCCL_MAX, 5),
        ("bool", "PRODUCT", UINT8, NCCL_MIN, 5),
        ("bool", "MIN", UINT8, NCCL_MIN, 5),
        ("bool", "BAND", UINT8, NCCL_MIN, 5),
        ("bool", "BXOR", UINT8, NCCL_SUM, 5),  # then only the parity bit is kept
        ("complex64", "SUM", FLOAT32, NCCL_SUM, 10),  # (real, imaginary) float pairs
        ("complex128", "AVG", FLOAT64, avg, 10),
        ("float16", "AVG", 6, avg, 5),
        ("int64", "PRODUCT", 4, 1, 5),
        ("int16", "broadcast", UINT8, None, 12),  # moved as bytes
        ("complex64", "send", UINT8, None, 24),
    ]


def _unsupported(me: Rank) -> None:
    b, cp = me.backend, me.cp
    cases = [
        ("int16", SUM, "no 16-bit integer"),
        ("uint16", ReduceOp.MAX, "no 16-bit integer"),
        ("int32", ReduceOp.BAND, "no bitwise"),
        ("uint64", ReduceOp.BXOR, "no bitwise"),
        ("int8", ReduceOp.BOR, "no bitwise"),
        ("complex64", ReduceOp.PRODUCT, "complex"),
    ]
    for dtype, op, text in cases:
        x = cp.zeros(4, dtype)
        for fn, args in (
            (b.all_reduce, (x, op)),
            (b.reduce, (x, 0, op)),
            (b.reduce_scatter, (x[:2], x, op)),
        ):
            with pytest.raises(TypeError, match=rf"NCCL.*{text}|{text}.*NCCL") as info:
                fn(*args)
            assert "NCCL" in str(info.value)


@pytest.mark.timeout(60)
def test_unsupported_reductions_raise_type_error(cuda, make_cluster):
    make_cluster(2).run(_unsupported)
    assert not cuda.communicators(), "a refused reduction created a communicator"
    assert not cuda.calls(NCCL_CALLS)


# -- data movement --------------------------------------------------------------------------


def _split(src: int, dst: int, m: int) -> int:
    return (src + 2 * dst) % 3 * m  # zero for some pairs


def _movement(me: Rank, dtypes: list[str]) -> None:
    b, r, n, cp = me.backend, me.rank, me.size, me.cp
    for dtype in dtypes:
        for count in COUNTS:
            what = f"{dtype} x{count}"
            for root in range(n):
                x = me.array(values(r, count, dtype))
                assert b.broadcast(x, root).wait() is True
                same(x.get(), values(root, count, dtype), f"broadcast from {root} {what}")
            out = cp.empty(n * count, dtype)
            b.all_gather(out, me.array(values(r, count, dtype))).wait()
            same(
                out.get(),
                np.concatenate([values(k, count, dtype) for k in range(n)]),
                f"all_gather {what}",
            )
            # in place: the input is this rank's slice of the output
            out = me.array(np.concatenate([values(r, count, dtype)] * n))
            b.all_gather(out, out[r * count : (r + 1) * count]).wait()
            same(
                out.get(),
                np.concatenate([values(k, count, dtype) for k in range(n)]),
                f"in-place all_gather {what}",
            )
            for root in range(n):
                mine = me.array(values(r + 10, count, dtype))
                gathered = cp.empty(n * count, dtype) if r == root else None
                b.gather(gathered, mine, root).wait()
                if r == root:
                    same(
                        gathered.get(),
                        np.concatenate([values(k + 10, count, dtype) for k in range(n)]),
                        f"gather to {root} {what}",
                    )
                out = cp.empty(count, dtype)
                parts = (
                    me.array(np.concatenate([values(k + 20, count, dtype) for k in range(n)]))
                    if r == root
                    else None
                )
                b.scatter(out, parts, root).wait()
                same(out.get(), values(r + 20, count, dtype), f"scatter from {root} {what}")
            for m in (0, 1, count):
                send_splits = [_split(r, j, m) for j in range(n)]
                recv_splits = [_split(k, r, m) for k in range(n)]
                inp = me.array(values(r + 30, sum(send_splits), dtype))
                out = cp.empty(sum(recv_splits), dtype)
                b.all_to_all(out, inp, recv_splits, send_splits).wait()
                pieces = []
                for k in range(n):
                    theirs = values(k + 30, sum(_split(k, j, m) for j in range(n)), dtype)
                    at = sum(_split(k, j, m) for j in range(r))
                    pieces.append(theirs[at : at + _split(k, r, m)])
                same(out.get(), np.concatenate(pieces), f"all_to_all m={m} {what}")
            if n > 1:  # rank 0 talks with each other rank: send, then the reply
                peers = range(1, n) if r == 0 else [0]
                for peer in peers:
                    got = cp.empty(count, dtype)
                    if r == 0:
                        b.send(me.array(values(peer + 40, count, dtype)), peer, 0).wait()
                        work = b.recv(got, peer, 0)
                    else:
                        work = b.recv(got, 0, 0)
                    assert work.wait() is True
                    same(got.get(), values((r or peer) + 40, count, dtype), f"recv {what}")
                    if r != 0:
                        b.send(got, 0, 0).wait()
            assert b.barrier().wait() is True


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", SIZES)
def test_data_movement(make_cluster, size):
    make_cluster(size).run(_movement, ALL_DTYPES, timeout=200)


def _recv_any_source(me: Rank) -> None:
    with pytest.raises(ValueError, match="pass src"):
        me.backend.recv(me.cp.zeros(2, me.cp.float32), None, 0)


@pytest.mark.timeout(60)
def test_recv_needs_a_source(cuda, make_cluster):
    make_cluster(2).run(_recv_any_source)
    assert not cuda.calls(NCCL_CALLS)


def _zero_elements(me: Rank) -> list[Call]:
    b, r, n, cp = me.backend, me.rank, me.size, me.cp
    b.barrier().wait()  # creates the communicator
    mark = me.mark()
    empty = cp.empty(0, cp.float32)
    for call in (
        lambda: b.broadcast(empty, 0),
        lambda: b.all_reduce(empty, SUM),
        lambda: b.all_reduce(cp.empty(0, cp.bool_), ReduceOp.BXOR),
        lambda: b.all_reduce(empty, AVG),
        lambda: b.reduce(empty, 1 % n, SUM),
        lambda: b.all_gather(empty, empty),
        lambda: b.reduce_scatter(empty, empty, SUM),
        lambda: b.gather(empty if r == 0 else None, empty, 0),
        lambda: b.scatter(empty, empty if r == 0 else None, 0),
        lambda: b.all_to_all(empty, empty, [0] * n, [0] * n),
        lambda: b.send(empty, (r + 1) % n, 0),
        lambda: b.recv(empty, (r - 1) % n, 0),
    ):
        work = call()
        assert work.wait() is True and work.is_completed()
    calls = me.calls_since(mark)
    b.barrier().wait()
    return calls


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 3])
def test_zero_elements_make_no_nccl_call(cuda, make_cluster, size):
    assert make_cluster(size).run(_zero_elements) == [[]] * size
    assert len(cuda.calls("allReduce")) == 2 * size  # only the barriers


def _grouped(me: Rank) -> dict[str, list[tuple]]:
    b, r, n, cp = me.backend, me.rank, me.size, me.cp
    b.barrier().wait()
    seen: dict[str, list[tuple]] = {}

    def record(name: str, issue: Callable[[], Any]) -> None:
        mark = me.mark()
        issue().wait()
        seen[name] = [(c.name, c.args.get("peer")) for c in me.calls_since(mark)]

    record(
        "gather",
        lambda: b.gather(cp.empty(3 * n, cp.int32) if r == 1 else None, cp.zeros(3, cp.int32), 1),
    )
    record(
        "scatter",
        lambda: b.scatter(cp.empty(2, cp.int32), cp.zeros(2 * n, cp.int32) if r == 0 else None, 0),
    )
    record(
        "all_to_all",
        lambda: b.all_to_all(cp.empty(n, cp.int32), cp.zeros(n, cp.int32), [1] * n, [1] * n),
    )
    return seen


@pytest.mark.timeout(60)
def test_gather_scatter_all_to_all_are_grouped_sends_and_receives(make_cluster):
    seen = make_cluster(3).run(_grouped)
    start, end = ("groupStart", None), ("groupEnd", None)
    assert seen[1]["gather"] == [start, ("recv", 0), ("recv", 2), end]
    for r in (0, 2):
        assert seen[r]["gather"] == [start, ("send", 1), end]
    assert seen[0]["scatter"] == [start, ("send", 1), ("send", 2), end]
    for r in (1, 2):
        assert seen[r]["scatter"] == [start, ("recv", 0), end]
    for r in range(3):
        peers = [p for p in range(3) if p != r]
        assert seen[r]["all_to_all"] == [
            start,
            *[("send", p) for p in peers],
            *[("recv", p) for p in peers],
            end,
        ]


# -- the public list-shaped API over a ProcessGroup ---------------------------------------


def _public(me: Rank, dtype: str) -> list[Call]:
    r, n, cp = me.rank, me.size, me.cp
    pg = me.group()
    count = 7
    # all_gather into a list
    slots = [cp.empty(count, dtype) for _ in range(n)]
    dist.all_gather(slots, me.array(values(r, count, dtype)), group=pg)
    for k in range(n):
        same(slots[k].get(), values(k, count, dtype), f"all_gather[{k}]")
    # gather and scatter, to and from the last rank
    root = n - 1
    slots = [cp.empty(count, dtype) for _ in range(n)] if r == root else None
    dist.gather(me.array(values(r + 1, count, dtype)), slots, dst=root, group=pg)
    if r == root:
        for k in range(n):
            same(slots[k].get(), values(k + 1, count, dtype), f"gather[{k}]")
    out = cp.empty(count, dtype)
    parts = [me.array(values(k + 2, count, dtype)) for k in range(n)] if r == root else None
    dist.scatter(out, parts, src=root, group=pg)
    same(out.get(), values(r + 2, count, dtype), "scatter")
    # reduce_scatter of a list (a dtype NCCL reduces)
    rdtype = "float32" if dtype in ("int16", "complex64") else dtype
    inputs = [me.array(values(r, count, rdtype)) for _ in range(n)]
    out = cp.empty(count, rdtype)
    dist.reduce_scatter(out, inputs, group=pg)
    same(out.get(), expected_reduction(n, count, rdtype, SUM), "reduce_scatter list")
    # all_to_all of lists with uneven sizes: rank r sends k + 1 elements to rank k
    sends = [me.array(values(r * n + k, k + 1, dtype)) for k in range(n)]
    recvs = [cp.empty(r + 1, dtype) for _ in range(n)]
    work = dist.all_to_all(recvs, sends, group=pg, async_op=True)
    assert work.wait() is True
    for k in range(n):
        same(recvs[k].get(), values(k * n + r, r + 1, dtype), f"all_to_all[{k}]")
    # 2-D arrays through all_reduce and broadcast, and a barrier
    grid = me.array(values(r, 12, rdtype).reshape(3, 4))
    dist.all_reduce(grid, group=pg)
    same(grid.get(), expected_reduction(n, 12, rdtype, SUM).reshape(3, 4), "all_reduce 2-D")
    grid = me.array(values(r, 6, dtype).reshape(2, 3))
    dist.broadcast(grid, src=root, group=pg)
    same(grid.get(), values(root, 6, dtype).reshape(2, 3), "broadcast 2-D")
    dist.barrier(group=pg)
    # batch_isend_irecv: a ring exchange as one NCCL group
    if n == 1:
        return []
    right, left = (r + 1) % n, (r - 1) % n
    got = cp.empty(5, dtype)
    mark = me.mark()
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, me.array(values(r + 3, 5, dtype)), right, group=pg),
            dist.P2POp(dist.irecv, got, left, group=pg),
        ]
    )
    for work in works:
        assert work.wait() is True
    calls = me.calls_since(mark)
    same(got.get(), values(left + 3, 5, dtype), "batch_isend_irecv")
    with pytest.raises(ValueError, match="pass src"):
        dist.irecv(got, group=pg)
    return calls


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["float32", "int16", "bool", "complex64"])
@pytest.mark.parametrize("size", SIZES)
def test_public_list_api(solo, make_cluster, size, dtype):
    calls = make_cluster(size).run(_public, dtype)
    for r, seen in enumerate(calls):
        if size == 1:
            continue
        right, left = (r + 1) % size, (r - 1) % size
        assert [(c.name, c.args.get("peer")) for c in seen] == [
            ("groupStart", None),
            ("send", right),
            ("recv", left),
            ("groupEnd", None),
        ]


# -- Work: streams, events, futures -------------------------------------------------------


def _stream_semantics(me: Rank) -> None:
    b, r, n, cp, standin = me.backend, me.rank, me.size, me.cp, me.standin
    caller = cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(4, cp.float32)
    b.all_reduce(x, SUM).wait()  # the communicator and the group's stream exist now
    with caller:
        x[...] = r + 1
        mark = me.mark()
        work = b.all_reduce(x, SUM, async_op=True)
        issued = me.calls_since(mark, {"Event.record", "Stream.wait_event", "allReduce"})
        # the group's stream waits for the caller's stream, then runs the op, then an
        # event is recorded after it
        names = [c.name for c in issued]
        assert names == ["Event.record", "Stream.wait_event", "allReduce", "Event.record"]
        before, follow, op, after = issued
        group_stream = op.args["stream"]
        assert before.args["stream"] == caller.ptr and group_stream not in (0, caller.ptr)
        assert follow.args == {
            "stream": group_stream,
            "device": me.device,
            "event": before.args["event"],
        }
        assert after.args["stream"] == group_stream
        mark = me.mark()
        assert work.wait() is True  # no timeout: the caller's stream waits for the event
        waits = me.calls_since(mark, {"Stream.wait_event"})
        assert [(c.args["stream"], c.args["event"]) for c in waits] == [
            (caller.ptr, after.args["event"])
        ]
        same(x.get(), np.full(4, n * (n + 1) / 2, np.float32), "after wait")
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert work.get_future().value()[0] is x
    # a real ordering check: the caller's stream is held, so the value the op must
    # reduce is not written yet when the op is issued
    with caller:
        standin.pause(caller)
        x[...] = 10 * (r + 1)
        work = b.all_reduce(x, SUM, async_op=True)
        assert not work.is_completed()
    standin.resume(caller)
    with caller:
        work.wait()
        same(x.get(), np.full(4, 10 * n * (n + 1) / 2, np.float32), "ordered after caller")
    assert work.is_completed()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2])
def test_work_orders_streams_with_events(make_cluster, size):
    make_cluster(size).run(_stream_semantics)


def _blocking_wait(me: Rank) -> None:
    b, cp = me.backend, me.cp
    assert b._blocking_wait
    x = cp.ones(3, cp.float64)
    work = b.all_reduce(x, SUM, async_op=True)
    mark = me.mark()
    assert work.wait() is True
    assert not me.calls_since(mark, {"Stream.wait_event"}), "a blocking wait used the stream"
    assert work.is_completed()
    same(x.get(), np.full(3, float(me.size)), "blocking wait")


@pytest.mark.timeout(60)
def test_blocking_wait_waits_on_the_host(monkeypatch, make_cluster):
    monkeypatch.setenv("DISTCOMM_NCCL_BLOCKING_WAIT", "1")
    make_cluster(2).run(_blocking_wait)


# -- failures: timeouts, asynchronous errors, aborts, shutdown -------------------------------


def _first_op(me: Rank) -> None:
    me.backend.all_reduce(me.cp.ones(2, me.cp.float32), SUM).wait()


def _issue_hung(me: Rank) -> Any:
    x = me.cp.full(3, 7.0)
    return x, me.backend.all_reduce(x, SUM, async_op=True)


def _hung(cuda: CudaStandin, cluster: Cluster) -> list:
    """Every rank's (array, Work) of an all_reduce that never completes, issued after a
    first operation made the communicators."""
    cluster.run(_first_op)
    cuda.hang()
    return cluster.run(_issue_hung)


def _wait_timeout(me: Rank, issued: list) -> None:
    b, cp = me.backend, me.cp
    x, work = issued[me.rank]
    assert not work.is_completed()
    with pytest.raises(
        DistTimeoutError,
        match=r"all_reduce #2 on 'nccl' \(group 'g'\) did "
        r"not complete within 0\.2 s",
    ) as info:
        work.wait(timeout=0.2)
    assert "aborted" in str(info.value)
    _wait_for_aborts(me.standin, {me.rank})  # on a thread of its own
    assert [c.name for c in me.standin.calls("abort", rank=me.rank)] == ["abort"]
    same(x.get(), np.full(3, 7.0), "a hung operation wrote no data")
    assert work.is_completed() and isinstance(work.exception(), DistTimeoutError)
    with pytest.raises(DistTimeoutError):
        work.wait()
    y = cp.ones(2, cp.float32)
    for call in (
        lambda: b.all_reduce(y, SUM),
        lambda: b.broadcast(y, 0),
        lambda: b.send(y, 0, 0),
        lambda: b.barrier(),
        lambda: b.all_gather(cp.empty(2 * me.size, cp.float32), y),
    ):
        with pytest.raises(DistTimeoutError, match="aborted"):
            call()


@pytest.mark.timeout(60)
def test_wait_timeout_aborts_the_communicator(cuda, make_cluster):
    cluster = make_cluster(2)
    issued = _hung(cuda, cluster)
    ops = len(cuda.calls(NCCL_CALLS))
    # one rank at a time: when both waited at once, a rank descheduled past the other's
    # timeout could read its abort notice first (an error naming that rank, not a timeout)
    cluster.run(_wait_timeout, issued, ranks=[0])
    cluster.run(_timed_out_or_told, issued, ranks=[1])
    assert len(cuda.calls(NCCL_CALLS)) == ops, "an aborted group reached NCCL"
    cluster.shutdown()
    assert not cuda.calls("destroy"), "an aborted communicator was destroyed"


def _timed_out_or_told(me: Rank, issued: list) -> None:
    """The rank after the first to time out: its own wait times out, or its watchdog read
    the first one's abort notice first; either way the group refuses new operations."""
    _, work = issued[me.rank]
    with pytest.raises(DistError, match=r"did not complete within 0\.2 s|another rank aborted"):
        work.wait(timeout=0.2)
    with pytest.raises(DistError, match="aborted"):
        me.backend.all_reduce(me.cp.ones(1, me.cp.float32), SUM)


def _wait_for_failure(me: Rank, issued: list, error: type, text: str | None) -> str:
    """What wait() raised (the Work's own error may be set a moment after the abort that
    wait() saw)."""
    _, work = issued[me.rank]
    with pytest.raises(error, match=text) as info:
        work.wait(timeout=30)
    with pytest.raises(error, match="aborted"):
        me.backend.all_reduce(me.cp.ones(1, me.cp.float32), SUM)
    return str(info.value)


@pytest.mark.timeout(60)
def test_async_error_fails_the_group_on_every_rank(cuda, make_cluster):
    cluster = make_cluster(2)
    issued = _hung(cuda, cluster)
    cuda.inject_async_error(rank=0)
    # rank 0's watchdog sees the error; rank 1's sees rank 0's abort notice in the store
    (said0, exc0), (said1, exc1) = cluster.outcomes(
        _wait_for_failure, issued, DistBackendError, None
    )
    assert exc0 is None and exc1 is None, (exc0, exc1)
    assert "asynchronous error" in said0 and "NCCL_ERROR_REMOTE_ERROR" in said0, said0
    assert "another rank aborted the group" in said1, said1
    _wait_for_aborts(cuda, {0, 1})


@pytest.mark.timeout(60)
def test_watchdog_enforces_the_group_timeout(cuda, make_cluster):
    cluster = make_cluster(2, timeout=0.5)
    issued = _hung(cuda, cluster)
    cluster.run(_wait_for_failure, issued, DistTimeoutError, r"all_reduce #2 .*within 0\.5 s")
    _wait_for_aborts(cuda, {0, 1})


def _wait_for_aborts(cuda: Any, ranks: set[int], timeout: float = 10.0) -> None:
    """The communicators of `ranks` get aborted (the abort runs on a thread of its own, and
    a watchdog may abort its one just after wait() saw the group fail)."""
    deadline = time.monotonic() + timeout
    while not ranks <= {c.rank for c in cuda.calls("abort")}:
        assert time.monotonic() < deadline, [c.rank for c in cuda.calls("abort")]
        time.sleep(0.01)


def _abort(me: Rank, issued: list) -> None:
    _, work = issued[me.rank]
    me.backend.abort(f"stop {me.rank}")
    assert isinstance(work.exception(), DistBackendError)
    with pytest.raises(DistBackendError, match=f"stop {me.rank}"):
        work.wait()
    with pytest.raises(DistBackendError, match=f"aborted: stop {me.rank}"):
        me.backend.broadcast(me.cp.ones(1, me.cp.float32), 0)
    me.backend.abort("again")  # a second abort changes nothing


@pytest.mark.timeout(60)
def test_abort_fails_pending_and_later_operations(cuda, make_cluster):
    cluster = make_cluster(2)
    issued = _hung(cuda, cluster)
    cluster.run(_abort, issued)
    _wait_for_aborts(cuda, {0, 1})
    assert sorted(c.rank for c in cuda.calls("abort")) == [0, 1]
    assert cluster.store.check(["nccl/g0/abort"])


def _timeout_while_the_abort_waits(me: Rank, issued: list) -> None:
    x, work = issued[me.rank]
    with pytest.raises(DistTimeoutError, match=r"all_reduce #2 .* within 0\.2 s"):
        work.wait(timeout=0.2)
    # raised while ncclCommAbort is still waiting for the device (the stand-in holds it)
    assert me.standin.aborts_in_progress == 1
    with pytest.raises(DistTimeoutError, match="aborted"):
        me.backend.all_reduce(x, SUM)
    assert isinstance(work.exception(), DistTimeoutError)


@pytest.mark.timeout(60)
def test_a_timed_out_wait_raises_while_the_abort_waits_for_the_device(cuda, make_cluster):
    # seen on an H200 (NCCL 2.28.9): ncclCommAbort returned only when a kernel queued on
    # the GPU before the op ended, and wait(timeout=1) raised after 8 s instead of 1 s
    cluster = make_cluster(1)
    issued = _hung(cuda, cluster)
    cuda.hold_aborts()
    safety = threading.Timer(20.0, cuda.release_aborts)  # the old code blocks in wait()
    safety.start()
    try:
        cluster.run(_timeout_while_the_abort_waits, issued)
    finally:
        cuda.release_aborts()
        safety.cancel()
    cluster.shutdown()  # waits for the abort to return
    assert cuda.aborts_in_progress == 0
    assert [c.name for c in cuda.calls("abort")] == ["abort"]


def _after_shutdown(me: Rank) -> None:
    with pytest.raises(RuntimeError, match="destroyed") as info:
        me.backend.all_reduce(me.cp.ones(1, me.cp.float32), SUM)
    assert isinstance(info.value, dist.GroupDestroyedError)
    with pytest.raises(RuntimeError, match="destroyed") as info:
        me.backend.barrier()
    assert isinstance(info.value, dist.GroupDestroyedError)


@pytest.mark.timeout(60)
def test_shutdown_releases_once_with_abort(cuda, make_cluster):
    """ncclCommDestroy is a collective of the node's ranks (the stand-in's, too): ranks
    shut down one after another, as here, would hang in it. Shutdown aborts instead."""
    cluster = make_cluster(2)
    cluster.run(_first_op)
    cluster.shutdown()
    cluster.shutdown()
    assert sorted(c.rank for c in cuda.calls("abort")) == [0, 1]
    assert not cuda.calls("destroy")
    cluster.run(_after_shutdown)
    assert all(c.aborted for c in cuda.communicators())


@pytest.mark.timeout(60)
def test_shutdown_with_hung_work_aborts(cuda, make_cluster):
    cluster = make_cluster(2, timeout=1.0)
    issued = _hung(cuda, cluster)
    cluster.shutdown()
    assert not cuda.calls("destroy")
    assert {c.rank for c in cuda.calls("abort")} == {0, 1}
    for _, work in issued:
        assert isinstance(work.exception(), RuntimeError)
        assert "destroy" in str(work.exception()) or "within" in str(work.exception())
        expected = (
            dist.GroupDestroyedError
            if "was destroyed" in str(work.exception())
            else DistTimeoutError
        )
        assert isinstance(work.exception(), expected), repr(work.exception())
    assert all(c.aborted for c in cuda.communicators())


def test_shutdown_without_operations(make_cluster):
    cluster = make_cluster(2)
    cluster.shutdown()
    cluster.shutdown()


# -- DISTCOMM_DEBUG=DETAIL ------------------------------------------------------------------


def _detail(me: Rank) -> list[str]:
    b, r, n, cp = me.backend, me.rank, me.size, me.cp
    assert b._detail
    x = cp.ones(10, cp.float32)
    b.all_reduce(x, SUM).wait()
    same(x.get(), np.full(10, float(n), np.float32), "matching all_reduce")
    messages = []
    mark = me.mark()
    with pytest.raises(DistBackendError, match="collective mismatch") as info:
        b.all_reduce(cp.ones(10 if r == 0 else 12, cp.float32), SUM)
    messages.append(str(info.value))
    y = cp.ones(10, cp.float32)
    with pytest.raises(DistBackendError, match="collective mismatch") as info:
        b.broadcast(y, 0) if r == 0 else b.all_reduce(y, SUM)
    messages.append(str(info.value))
    assert not me.calls_since(mark), "a mismatched collective reached NCCL"
    b.broadcast(y, n - 1).wait()
    b.reduce_scatter(cp.empty(2, cp.float32), cp.ones(2 * n, cp.float32), SUM).wait()
    b.barrier().wait()
    return messages


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 3])
def test_detail_catches_mismatched_collectives(monkeypatch, make_cluster, size):
    monkeypatch.setenv("DISTCOMM_DEBUG", "DETAIL")
    messages = make_cluster(size).run(_detail)
    for r, (count, kind) in enumerate(messages):
        assert "all_reduce(SUM) of 10 float32" in count
        assert "all_reduce(SUM) of 12 float32" in count
        assert f"[rank {r}/{size}]" in count
        assert "broadcast of 10 float32 with root 0" in kind
        assert "all_reduce(SUM) of 10 float32" in kind


def _detail_missing(me: Rank) -> None:
    with pytest.raises(DistTimeoutError, match=r"ranks \[1\] did not reach collective #2"):
        me.backend.all_reduce(me.cp.ones(3, me.cp.float32), SUM)


@pytest.mark.timeout(60)
def test_detail_names_a_rank_that_does_not_arrive(monkeypatch, cuda, make_cluster):
    monkeypatch.setenv("DISTCOMM_DEBUG", "DETAIL")
    cluster = make_cluster(2, timeout=1.0)
    cluster.run(_first_op)
    calls = len(cuda.calls(NCCL_CALLS))
    cluster.run(_detail_missing, ranks=[0])
    assert len(cuda.calls(NCCL_CALLS)) == calls


# -- communicator creation -----------------------------------------------------------------


def _comm_info(me: Rank) -> tuple:
    _first_op(me)
    (comm,) = me.standin.communicators(me.rank)
    return comm.uid, comm.device, comm.rank_id(), comm.size(), comm.device_id()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version", ["14.2.0", "13.6.0"])
def test_unique_id_travels_through_the_store(cuda, make_cluster, version):
    cuda.cupy.__version__ = version
    cluster = make_cluster(3)
    infos = cluster.run(_comm_info)
    assert len(cuda.unique_ids) == 1
    uid = cuda.unique_ids[0]
    assert [c.rank for c in cuda.calls("get_unique_id")] == [None]
    assert cluster.store.get("nccl/g0/uid") == uid
    assert infos == [(uid, r, r, 3, r) for r in range(3)]
    kind = "bytes" if version.startswith("14") else "tuple"
    assert {c.args["id_type"] for c in cuda.calls("NcclCommunicator")} == {kind}
    for r in range(3):
        assert cluster.store.get(f"nccl/g0/gpu/{r}").decode().endswith(f"0000:{r:02x}:00.0")


@pytest.mark.timeout(60)
def test_unique_id_form_falls_back_when_cupy_refuses_it(cuda, make_cluster):
    cuda.comm_id_form = tuple  # a CuPy that says 14 but takes CuPy 13's tuples
    make_cluster(2).run(_first_op)
    kinds = [c.args["id_type"] for c in cuda.calls("NcclCommunicator", rank=0)]
    assert kinds == ["bytes", "tuple"] or kinds == ["tuple"]
    assert len(cuda.communicators()) == 2


@pytest.mark.timeout(60)
def test_a_missing_rank_times_out_naming_the_rank(cuda, make_cluster):
    cluster = make_cluster(2, timeout=1.0)
    ((_, exc),) = cluster.outcomes(_first_op, ranks=[0])
    assert isinstance(exc, DistTimeoutError), exc
    assert "rank(s) 1 never did" in str(exc) and "said which GPU" in str(exc), exc
    assert "gpu/" not in str(exc), exc
    cluster = make_cluster(2, timeout=1.0)
    ((_, exc),) = cluster.outcomes(_first_op, ranks=[1])
    assert isinstance(exc, DistTimeoutError), exc
    assert "rank(s) 0 never did" in str(exc) and "NCCL unique id" in str(exc), exc
    assert "uid" not in str(exc), exc
    assert not cuda.communicators()


@pytest.mark.timeout(60)
def test_two_ranks_on_one_gpu_are_named(cuda, make_cluster):
    """Checked before NCCL is called, on every rank: NCCL fails only the two sharing
    ranks, and the third would hang in ncclCommInitRank."""
    cluster = make_cluster(3, devices=[0, 0, 2])
    errors = [exc for _, exc in cluster.outcomes(_first_op)]
    for r, other in ((0, 1), (1, 0)):
        assert isinstance(errors[r], DistBackendError), errors[r]
        text = str(errors[r])
        assert f"ranks [{other}] use the same GPU (0000:00:00.0) as this rank" in text
        assert "set_device" in text
    assert isinstance(errors[2], DistBackendError), errors[2]
    assert "ranks [0, 1] share the GPU 0000:00:00.0" in str(errors[2]), errors[2]
    assert not cuda.calls("NcclCommunicator")
    assert cuda.init_hangs_timed_out == 0


@pytest.mark.timeout(60)
def test_an_injected_init_failure_is_a_backend_error(cuda, make_cluster):
    """Real NCCL leaves the healthy ranks hanging in ncclCommInitRank when one fails (the
    stand-in too): they learn of the failure through the store, within the timeout."""
    cuda.fail_init(1)
    errors = _errors(make_cluster(3, timeout=10.0).outcomes(_first_op))
    for error in errors:
        assert isinstance(error, DistBackendError), error
        assert "ncclCommInitRank failed" in str(error) and "same GPU" not in str(error)
    assert "injected by the test" in str(errors[1])
    for r in (0, 2):
        assert "failed on rank 1:" in str(errors[r]) and "injected" in str(errors[r])
    assert cuda.init_hangs_timed_out == 0


def _other_device(me: Rank) -> None:
    _first_op(me)
    with me.cp.cuda.Device((me.device + 1) % 4):
        y = me.cp.ones(2, me.cp.float32)
    with pytest.raises(
        ValueError,
        match=rf"on GPU {(me.device + 1) % 4}.*created on GPU "
        rf"{me.device}",
    ):
        me.backend.all_reduce(y, SUM)
    _first_op(me)  # the group still works


@pytest.mark.timeout(60)
def test_an_array_on_another_gpu_is_refused(make_cluster):
    make_cluster(2).run(_other_device)


@pytest.mark.timeout(60)
def test_backend_under_a_launcher_picks_local_rank(cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "6")
    backend = NcclBackend(dist.PrefixStore("nccl", dist.HashStore()), 0, 1, 10.0, "g")
    try:
        assert runtime.chosen_device() == 2  # 6 % 4 GPUs
    finally:
        backend.shutdown()


# -- availability and distcomm.gpu.runtime -------------------------------------------------


def test_backend_availability(cuda):
    assert NcclBackend.is_available() and NcclBackend.unavailable_reason() == ""
    cuda.nccl_version = 2604
    assert "needs NCCL >= 2.7.0" in NcclBackend.unavailable_reason()
    cuda.nccl_version = NEW_NCCL
    cuda.nccl.available = False
    assert "found no NCCL library" in NcclBackend.unavailable_reason()
    cuda.nccl.available = True
    cuda.device_count = 0
    # the probe does not ask CUDA (that would initialise it); making the backend does
    assert NcclBackend.is_available() and not cuda.cuda_initialized
    with pytest.raises(BackendUnavailableError, match="no device"):
        NcclBackend(dist.PrefixStore("nccl", dist.HashStore()), 0, 1, 10.0, "g")


def test_a_cupy_built_against_an_old_nccl_is_refused(cuda):
    cuda.nccl_build_version = 2604  # CuPy's bindings lack what NCCL 2.6 lacked
    reason = NcclBackend.unavailable_reason()
    assert "built against NCCL 2.6.4" in reason and "install a newer CuPy" in reason, reason
    cuda.nccl_build_version = None
    assert NcclBackend.unavailable_reason() == ""


def test_info_names_the_nccl_version_and_says_why_there_is_none(cuda):
    from distcomm import info

    cuda.nccl_version, cuda.nccl_build_version = 22809, 22707
    found = info.collect()
    assert found["gpu"]["nccl_version"] == "2.28.9" and found["gpu"]["nccl_built"] == "2.27.7"
    assert "NCCL version: 2.28.9 (CuPy built against 2.27.7)" in info.render(found)
    cuda.nccl.available = False
    found = info.collect()
    assert found["gpu"]["nccl"] is None
    assert "NCCL version: N/A (ImportError: CuPy found no NCCL library)" in info.render(found)


def test_backend_unavailable_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert not NcclBackend.is_available()
    assert "pip install cupy" in NcclBackend.unavailable_reason()
    with pytest.raises(BackendUnavailableError):
        NcclBackend(dist.PrefixStore("nccl", dist.HashStore()), 0, 1, 10.0, "g")


def test_runtime_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(runtime, "_chosen", None)
    assert runtime.device_count() == 0
    assert not runtime.is_available()
    assert not runtime.is_cupy_array(np.zeros(2))
    with pytest.raises(BackendUnavailableError, match="pip install cupy"):
        runtime.current_device()
    with pytest.raises(BackendUnavailableError):
        runtime.set_device(0)


def test_runtime_device_count(cuda):
    assert runtime.device_count() == 4 and runtime.is_available()
    cuda.device_count = 0
    assert runtime.device_count() == 0 and not runtime.is_available()

    def broken() -> int:
        raise cuda.runtime.CUDARuntimeError("cudaErrorInsufficientDriver")

    cuda.runtime.getDeviceCount = broken
    assert runtime.device_count() == 0 and not runtime.is_available()
    with pytest.raises(BackendUnavailableError, match="cudaErrorInsufficientDriver"):
        runtime.current_device()


def _runtime_in_thread(cuda: CudaStandin, monkeypatch: Any) -> None:
    assert runtime.current_device() == 0  # CUDA's current device of this thread
    cuda.cuda.Device(3).use()
    assert runtime.current_device() == 3
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert runtime.current_device() == 1  # 5 % 4 GPUs
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK='x'"):
        runtime.current_device()
    monkeypatch.setenv("LOCAL_RANK", "5")
    runtime.set_device(2)  # set_device wins over LOCAL_RANK
    assert runtime.current_device() == 2 and runtime.chosen_device() == 2
    assert cuda.runtime.getDevice() == 2
    runtime.set_device("cuda:1")
    assert runtime.current_device() == 1 and cuda.runtime.getDevice() == 1
    runtime.set_device(cuda.cuda.Device(3))
    assert runtime.current_device() == 3
    runtime.set_device("cuda")
    assert runtime.current_device() == 3
    with pytest.raises(ValueError, match=r"device 4 does not exist: CUDA sees 4 device\(s\)"):
        runtime.set_device(4)
    with pytest.raises(ValueError, match="CUDA sees 4 device"):
        runtime.set_device("cuda:9")
    with pytest.raises(ValueError, match="is not 'cuda' or 'cuda:N'"):
        runtime.set_device("gpu:1")
    with pytest.raises(TypeError):
        runtime.set_device(True)
    assert runtime.current_device() == 3  # unchanged by the failures
    # streams and synchronisation
    assert runtime.current_stream() is cuda.cuda.Stream.null
    stream = cuda.cuda.Stream(non_blocking=True)
    with stream:
        assert runtime.current_stream() is stream
        assert runtime.current_stream("cuda:3") is stream
        assert runtime.current_stream(1) is cuda.cuda.Stream.null
        x = cuda.cupy.zeros(4, cuda.cupy.float32)
        cuda.pause(stream)
        x += 2
        done = threading.Timer(0.05, cuda.resume, args=(stream,))
        done.start()
        runtime.synchronize()  # waits for the held work
        same(x.get(), np.full(4, 2, np.float32), "after synchronize")
        done.join()
    assert [c.args["device"] for c in cuda.calls("Device.synchronize")] == [3]
    runtime.synchronize("cuda:0")
    assert [c.args["device"] for c in cuda.calls("Device.synchronize")] == [3, 0]
    assert runtime.device_of(x) == 3 and runtime.is_cupy_array(x)
    assert not runtime.is_cupy_array(np.zeros(2))


@pytest.mark.timeout(60)
def test_runtime_with_the_standin(cuda, monkeypatch):
    # CUDA's current device is per thread: run in a fresh thread
    failure: list[BaseException] = []

    def body() -> None:
        try:
            _runtime_in_thread(cuda, monkeypatch)
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    if failure:
        raise failure[0]


# -- the stand-in itself ---------------------------------------------------------------------


def test_standin_refuses_misuse(cuda):
    cp = cuda.cupy
    x = cp.zeros(4, cp.float32)
    assert dist.arrays.device_of(x) == "cuda"
    with pytest.raises(TypeError, match=r"\.get\(\)"):
        np.asarray(x)
    with cp.cuda.Device(1):
        y = cp.zeros(4, cp.float32)
        stream = cp.cuda.Stream()
    with pytest.raises(ValueError, match="current device"):
        y[...] = 1
    with pytest.raises(RuntimeError, match="does not match"):
        stream.__enter__()
    uid = cuda.nccl.get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    with pytest.raises(TypeError, match="expected bytes"):
        cuda.nccl.NcclCommunicator(1, tuple(uid), 0)
    cuda.cupy.__version__ = "13.6.0"
    uid13 = cuda.nccl.get_unique_id()
    assert isinstance(uid13, tuple) and min(uid13) >= -128 and max(uid13) <= 127
    with pytest.raises(TypeError, match="expected tuple"):
        cuda.nccl.NcclCommunicator(1, bytes(v & 0xFF for v in uid13), 0)
    comm = cuda.nccl.NcclCommunicator(1, uid13, 0)
    with pytest.raises(NcclError, match="INVALID_ARGUMENT"):  # memory of another GPU
        comm.allReduce(y.data.ptr, y.data.ptr, 4, 7, 0, 0)
    with pytest.raises(NcclError, match="INVALID_ARGUMENT"):  # past the allocation
        comm.allReduce(x.data.ptr, x.data.ptr, 5, 7, 0, 0)
    cuda.nccl_version = OLD_NCCL
    with pytest.raises(NcclError, match="ncclAvg"):
        comm.allReduce(x.data.ptr, x.data.ptr, 4, 7, 4, 0)
    comm.allReduce(x.data.ptr, x.data.ptr, 4, 7, 0, 0)
    comm.destroy()
    with pytest.raises(NcclError, match="destroyed"):
        comm.check_async_error()
    assert len(cuda.violations) == 3
    cuda.violations.clear()


# -- regressions: distcomm bugs the stand-in found ---------------------------------------


class _CompletesFirst:
    """A backend whose Works have already been polled complete when they are returned,
    as the nccl watchdog (which polls a Work the moment it is tracked) may do."""

    def __init__(self, backend: NcclBackend) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def all_reduce(self, *args: Any, **kwargs: Any) -> Any:
        work = self._backend.all_reduce(*args, **kwargs)
        assert work.is_completed()
        return work


def _future_value(me: Rank) -> None:
    pg = ProcessGroup(
        "g",
        list(range(me.size)),
        me.rank,
        {"cuda": _CompletesFirst(me.backend)},
        "nccl",
        30.0,
        me.rank,
    )
    grid = me.array(np.ones((2, 3), np.float32))
    work = dist.all_reduce(grid, group=pg, async_op=True)
    work.synchronize()
    value = work.get_future().value()
    assert value[0] is grid, f"the future holds {value[0]!r}, not the caller's array"


@pytest.mark.timeout(60)
def test_future_value_is_the_callers_array_when_completed_early(solo, make_cluster):
    make_cluster(2).run(_future_value)


def _source_rank(me: Rank) -> None:
    b, cp = me.backend, me.cp
    x = cp.ones(4, cp.float32)
    if me.rank == 0:
        b.send(x, 1, 0).wait()
        return
    work = b.recv(x, 0, 0)
    assert work.wait() is True  # orders the current stream only: the host does not wait
    assert work.source_rank() == 0  # before the watchdog polled it (usually)
    work.synchronize()  # blocks the host until the recv finished on the GPU
    assert work.is_completed()
    assert work.source_rank() == 0, "source_rank() changed to -1 when the recv completed"


@pytest.mark.timeout(60)
def test_recv_source_rank_survives_completion(make_cluster):
    make_cluster(2).run(_source_rank)


def _monitored_barrier(me: Rank) -> None:
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        dist.monitored_barrier(group=me.group(), timeout=5)


@pytest.mark.timeout(60)
def test_monitored_barrier_on_an_nccl_group_fails_clearly(solo, make_cluster):
    make_cluster(2).run(_monitored_barrier)


@pytest.mark.timeout(60)
def test_a_new_group_on_the_same_store_ignores_the_old_unique_id(cuda, make_cluster):
    old = make_cluster(2)
    old.run(_first_op)
    old.shutdown()
    new = make_cluster(2, timeout=1.0)
    new.store = old.store
    new.backends = [
        NcclBackend(dist.PrefixStore("nccl", old.store), r, 2, 1.0, group_name="g")
        for r in range(2)
    ]
    ((_, exc),) = new.outcomes(_first_op, ranks=[1])  # rank 0 of the new group never comes
    assert isinstance(exc, DistTimeoutError), f"rank 1 did not wait for a new id: {exc!r}"


def _hung_wait(me: Rank, issued: list) -> None:
    _, work = issued[me.rank]
    with pytest.raises(DistTimeoutError, match=r"all_reduce #2"):
        work.wait(timeout=3)


@pytest.mark.timeout(60)
def test_an_old_abort_notice_does_not_abort_a_new_group(cuda, make_cluster):
    old = make_cluster(2)
    old.run(_first_op)
    old.run(lambda me: me.backend.abort("the old group failed"))
    old.shutdown()
    for key in ("nccl/g0/uid", "nccl/g0/gpu/0", "nccl/g0/gpu/1"):  # only the notice stays
        old.store.delete_key(key)
    new = make_cluster(2)
    new.store = old.store
    new.backends = [
        NcclBackend(dist.PrefixStore("nccl", old.store), r, 2, 30.0, group_name="g")
        for r in range(2)
    ]
    issued = _hung(cuda, new)
    # one rank at a time: the first to time out leaves the new group's notice, which the
    # other's watchdog may read before that one's own wait ends (an error naming rank 0)
    new.run(_hung_wait, issued, ranks=[0])  # its watchdog read the store meanwhile
    new.run(_told_by_rank_0, issued, ranks=[1])


def _told_by_rank_0(me: Rank, issued: list) -> None:
    _, work = issued[me.rank]
    with pytest.raises(DistBackendError, match="another rank aborted the group") as info:
        work.wait(timeout=30)
    message = str(info.value)
    assert "rank 0: [rank 0/2] all_reduce #2" in message, message
    assert "the old group failed" not in message, message


def _late_collective(me: Rank) -> None:
    with pytest.raises(DistError):
        me.backend.all_reduce(me.cp.ones(3, me.cp.float32), SUM, async_op=True)


@pytest.mark.timeout(60)
def test_detail_timeout_does_not_let_a_late_rank_into_nccl(monkeypatch, cuda, make_cluster):
    monkeypatch.setenv("DISTCOMM_DEBUG", "DETAIL")
    cluster = make_cluster(2, timeout=1.0)
    cluster.run(_first_op)
    cluster.run(_detail_missing, ranks=[0])  # rank 0 gives up on collective #2
    cuda.hang(ranks=[1])  # so that rank 1, if it gets into NCCL, does not block
    calls = len(cuda.calls("allReduce", rank=1))
    try:
        cluster.run(_late_collective, ranks=[1])
    finally:
        entered = len(cuda.calls("allReduce", rank=1)) > calls
        cluster.shutdown()
    assert not entered


def _list_gather_from_another_device(me: Rank) -> None:
    cp = me.cp
    with cp.cuda.Device(me.device):
        mine = me.array(np.full(5, me.rank, np.int32))
        out = [cp.empty(5, np.int32) for _ in range(me.size)]
    cp.cuda.Device((me.device + 1) % me.standin.device_count).use()  # not the group's GPU
    dist.all_gather(out, mine, group=me.group())
    with cp.cuda.Device(me.device):
        for k in range(me.size):
            same(out[k].get(), np.full(5, k, np.int32), f"all_gather[{k}]")


@pytest.mark.timeout(60)
def test_list_variants_from_a_thread_on_another_device(solo, make_cluster):
    # the copy-out's event is recorded with the group's GPU current, whatever the caller's
    make_cluster(2).run(_list_gather_from_another_device)


def _watched_while_pending(me: Rank) -> None:
    b = me.backend
    b.all_reduce(me.cp.ones(3, me.cp.float32), SUM).wait()  # the communicator exists
    stream = b._stream
    me.standin.pause(stream)  # the next operation stays pending for a while
    work = b.all_gather(me.cp.empty(2 * me.size, me.cp.float32), me.cp.ones(2, me.cp.float32))
    time.sleep(0.3)  # the watchdog polls the pending operation meanwhile
    assert not work.is_completed()
    me.standin.resume(stream)
    assert work.wait(timeout=30) is True


@pytest.mark.timeout(60)
def test_events_are_queried_on_their_own_device(cuda, make_cluster):
    # ranks on GPUs 2 and 3: the watchdog (a new thread, device 0) and waiters must make
    # the group's GPU current before querying its events (the stand-in flags it otherwise)
    cluster = make_cluster(2, devices=[2, 3])
    cluster.run(_watched_while_pending)
    assert not cuda.violations


def test_arrays_on_two_gpus_are_refused(solo, cuda, make_cluster):
    cluster = make_cluster(1)
    cp = cuda.cupy
    with cp.cuda.Device(0):
        out = cp.empty(4, np.float32)
    with cp.cuda.Device(1):
        mine = cp.ones(4, np.float32)
    group = ProcessGroup("g", [0], 0, {"cuda": cluster.backends[0]}, "nccl", 30.0, 0)
    with pytest.raises(ValueError, match=r"different GPUs \(0, 1\)"):
        dist.all_gather_single(out, mine, group=group)


def test_recorder_settles_a_synchronous_op_when_the_device_finishes_it(solo, cuda, make_cluster):
    """A synchronous nccl collective returns once the caller's stream is ordered after it:
    the flight recorder (and so the stall inspector) keeps it running until its event
    completes on the device."""
    cluster = make_cluster(1)
    cp = cuda.cupy
    backend = cluster.backends[0]
    group = ProcessGroup("g", [0], 0, {"cuda": backend}, "nccl", 30.0, 0)
    x = cp.ones(4, np.float32)
    dist.all_reduce(x, group=group)  # the communicator and the group's stream exist now
    backend._stream.synchronize()
    deadline = time.monotonic() + 10
    while group.recorder.unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not group.recorder.unfinished()
    cuda.pause(backend._stream)
    try:
        dist.all_reduce(x, group=group)  # returns: the op waits on the held stream
        time.sleep(0.3)  # the watchdog polls meanwhile
        states = [e["state"] for e in group.recorder.as_dicts([0])]
        assert states == ["completed", "started"], states
    finally:
        cuda.resume(backend._stream)
    while group.recorder.unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [e["state"] for e in group.recorder.as_dicts([0])] == ["completed", "completed"]


def test_init_with_device_id_creates_the_communicator_there(cuda, monkeypatch):
    """init_process_group(device_id=) makes the GPU current and creates the nccl
    communicator at once, on it, as torch's eager init does."""
    from distcomm.gpu import runtime

    monkeypatch.setattr(runtime, "_chosen", None)
    dist.init_process_group(
        "cpu:tcp,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1, device_id="cuda:2"
    )
    try:
        backend = dist.group.WORLD._backends["cuda"]
        assert backend._comm is not None and backend._device.id == 2
        assert runtime.current_device() == 2
        x = cuda.cupy.ones(3, np.float32)  # the current device: 2
        dist.all_reduce(x)
        assert x.get().tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_split_group_and_premul_sum_on_one_rank(cuda, monkeypatch):
    # the body tests/test_gpu_device.py runs on a GPU, here on the stand-in
    from tests import test_gpu_device

    for key, value in LOOPBACK_ENV.items():
        monkeypatch.setenv(key, value)
    got = test_gpu_device._split_and_premul()
    assert got == {
        "x": [k * 0.5 for k in range(8)],
        "z": [complex(2 * k, 2 * k) for k in range(6)],
        "out": [0.0, 3.0, 6.0, 9.0],
        "h": [k * 0.5 for k in range(5)],
        "sub": 1,
    }


def test_avg_on_one_rank_runs_as_a_sum(cuda, monkeypatch):
    # NCCL's one-rank AVG kernel left the tail of an out-of-place result unwritten before
    # 2.29.7 (NVIDIA/nccl#1950; seen on an H200 with 2.28.9): one rank's average is a copy
    for key, value in LOOPBACK_ENV.items():
        monkeypatch.setenv(key, value)
    cp = cuda.cupy
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=30)
    try:
        out = cp.empty(9001, cp.float32)
        dist.reduce_scatter_single(out, cp.asarray(np.arange(9001, dtype=np.float32)), ReduceOp.AVG)
        same(out.get(), np.arange(9001, dtype=np.float32), "one rank's AVG")
    finally:
        dist.destroy_process_group()
    assert [c.args["op"] for c in cuda.calls("reduceScatter")] == [NCCL_SUM]
