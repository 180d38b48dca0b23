"""Arrays through distcomm.multiprocessing: shared memory under both strategies, real processes.

Every test here starts real processes (spawn and fork; forkserver too for round trips)
and sends arrays through Queue, Pipe, Pool.map and Process arguments, then checks what
arrived (contents, dtype, shape, strides, flags, sharing) and that nothing is left
behind: no descriptor in the parent, no distcomm_* file in /dev/shm once the processes
involved have exited. Processes that must be killed mid-run (kill -9) run inside a driver
subprocess with its own shared-memory manager, so "once everything exited" can be
observed from here.

The CuPy part runs its device-free checks everywhere (error messages without CuPy, the
fork guard, the dispatch of CuPy arrays to the IPC reducer, with a stand-in `cupy`
module); the real CUDA IPC round trips skip without CuPy or a device, and fail instead
when DISTCOMM_TEST_REQUIRE_GPU=1.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import pickle
import resource
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from multiprocessing import forkserver, resource_tracker
from multiprocessing.reduction import ForkingPickler

import numpy as np
import psutil
import pytest

import distcomm.multiprocessing as mp
from distcomm.errors import BackendUnavailableError
from distcomm.gpu import ipc
from distcomm.multiprocessing import sharing
from distcomm.multiprocessing.shm.client import ManagerClient
from distcomm.multiprocessing.shm.protocol import ADDRESS_ENV

STRATEGIES = sorted(mp.get_all_sharing_strategies())
METHODS = ["spawn", "fork"]
CHANNELS = ["queue", "pipe", "pool", "args"]
TIMEOUT = 30.0  # seconds any single wait on a child may take
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DTYPES = [
    np.dtype(t)
    for t in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
] + [np.dtype([("a", "<i4"), ("b", "<f8", (2,)), ("c", "S3")])]


# -- helpers ------------------------------------------------------------------------------------


def _values(dtype: np.dtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Deterministic, distinct values of any test dtype."""
    n = int(np.prod(shape))
    base = np.arange(seed, seed + n)
    if dtype.names:
        out = np.zeros(n, dtype)
        out["a"] = base
        out["b"] = np.stack([base * 0.5, -base * 0.25], axis=1)
        out["c"] = [f"{i % 1000}".encode() for i in base]
        return out.reshape(shape)
    if dtype == np.bool_:
        return (base % 3 == 0).reshape(shape)
    if dtype.kind == "c":
        return (base + 1j * (base % 7)).astype(dtype).reshape(shape)
    return (base % 100).astype(dtype).reshape(shape)


def _layouts(base: np.ndarray) -> dict[str, np.ndarray]:
    """Views of a 3-d array (4, 5, 6) covering the layouts arrays can have."""
    readonly = base[1:3]
    readonly.flags.writeable = False
    return {
        "3d": base,
        "0d": base[1, 2, 3, ...],
        "1d": base[2, 3],
        "steps": base[::2, 1::3, ::-2],
        "negative": base[::-1, :, ::-1],
        "transpose": base.transpose(2, 0, 1),
        "readonly": readonly,
        "bcast": np.broadcast_to(base[0, 0], (3, 6)),
        "zero-size": base[:, 2:2],
    }


def _cases(shared: bool, seed: int = 0) -> list[np.ndarray]:
    """Arrays of every dtype (C and strided) and every layout (a few dtypes)."""
    out = []
    for i, dtype in enumerate(DTYPES):
        values = _values(dtype, (4, 5, 6), seed + 1000 * i)
        base = mp.share_memory(values) if shared else values
        if dtype in (np.dtype("float64"), np.dtype("int16")) or dtype.names:
            out.extend(_layouts(base).values())
            fortran = (mp.empty if shared else np.empty)((3, 4), dtype, order="F")
            fortran[...] = values[0, :3, :4]
            out.append(fortran)
        else:
            out.extend([base, base[1:, ::2, 1::2]])
    return out


def _describe(array: np.ndarray) -> dict:
    return {
        "dtype": array.dtype.descr if array.dtype.names else array.dtype.str,
        "shape": list(array.shape),
        "strides": list(array.strides),
        "writeable": bool(array.flags.writeable),
        "shared": mp.is_shared(array),
        "bytes": np.ascontiguousarray(array).tobytes().hex(),
    }


def _same_contents(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    )


def _warm_up(strategy: str, method: str | None) -> None:
    """Start what lives for the whole process (resource tracker, resource sharer, manager
    client, forkserver) so that descriptor counts compare like with like."""
    resource_tracker.ensure_running()
    if method == "forkserver":
        forkserver.ensure_running()
    a, b = mp.Pipe()
    a.send(mp.zeros(1))
    b.recv()
    a.close()
    b.close()
    if strategy == "file_system":
        sharing.manager_client()


def _fds() -> int:
    return psutil.Process().num_fds()


def _shm_names(pids) -> list[str]:
    prefixes = tuple(f"distcomm_{pid}_" for pid in pids)
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefixes))
    except FileNotFoundError:
        return []


def _poll(condition, timeout: float = 15.0):
    """`condition()` once it is truthy, or its last value after `timeout` seconds."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > end:
            return value
        time.sleep(0.05)


def _fd_targets() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
    return out


@contextlib.contextmanager
def _reaped(*procs):
    """Kill whatever is still running on the way out (a failing test must not hang)."""
    try:
        yield
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(TIMEOUT)


@pytest.fixture(scope="module", autouse=True)
def _own_shm_manager():
    """This module's file_system tests use one shm manager of their own, started before
    any process of theirs (a forkserver inherits DISTCOMM_SHM_MANAGER when it starts, as
    in a program that chooses its strategy first), and disconnected at the end so that it
    exits (after its linger time) before other modules run."""
    saved = os.environ.pop(ADDRESS_ENV, None)
    forkserver._forkserver._stop()  # one started earlier would not know this manager
    sharing.manager_client()
    yield
    forkserver._forkserver._stop()  # nor would a later module's manager be known to it
    client = ManagerClient.current()
    if client is not None:
        client.close()
    os.environ.pop(ADDRESS_ENV, None)
    if saved is not None:
        os.environ[ADDRESS_ENV] = saved


@pytest.fixture(params=STRATEGIES)
def strategy(request):
    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy(request.param)
    yield request.param
    mp.set_sharing_strategy(previous)


@pytest.fixture
def no_leaks(request, strategy):
    """After the test (its arrays collected): no descriptor left open here, no /dev/shm
    file of this process or of the pids the test adds to the yielded set."""
    callspec = getattr(request.node, "callspec", None)
    _warm_up(strategy, callspec.params.get("method") if callspec else None)
    gc.collect()
    before = _fds()
    pids = {os.getpid()}
    yield pids
    # finalizers may run on other threads (queue feeders, the pool's handlers): poll
    _poll(lambda: gc.collect() >= 0 and _fds() <= before, 10.0)
    after = _fds()
    assert after <= before, f"{after - before} file descriptors leaked: {_fd_targets()}"
    gone = _poll(lambda: not _shm_names(pids))
    assert gone, f"left in /dev/shm: {_shm_names(pids)}"


# -- functions run in children (module level: spawn pickles them by reference) -------------------


def _echo_queue(strategy, inbox, outbox):
    mp.set_sharing_strategy(strategy)
    arrays = inbox.get(timeout=TIMEOUT)
    outbox.put(([_describe(a) for a in arrays], arrays, os.getpid()))
    inbox.get(timeout=TIMEOUT)  # stay alive until the parent is done


def _echo_pipe(strategy, conn):
    mp.set_sharing_strategy(strategy)
    if not conn.poll(TIMEOUT):
        raise TimeoutError("nothing received")
    arrays = conn.recv()
    conn.send(([_describe(a) for a in arrays], arrays, os.getpid()))
    conn.poll(TIMEOUT)


def _echo_args(strategy, arrays, outbox, done):
    mp.set_sharing_strategy(strategy)
    outbox.put(([_describe(a) for a in arrays], arrays, os.getpid()))
    done.wait(TIMEOUT)


def _echo_one(args):
    strategy, array = args
    mp.set_sharing_strategy(strategy)
    return _describe(array), array, os.getpid()


def _round_trip(channel: str, method: str, strategy: str, arrays: list[np.ndarray]):
    """Send `arrays` to a child over `channel`; the child's descriptions, the arrays it
    sent back, and the pids involved."""
    ctx = mp.get_context(method)
    if channel == "pool":
        with ctx.Pool(2) as pool:
            results = pool.map(_echo_one, [(strategy, a) for a in arrays], chunksize=7)
            pool.close()
            pool.join()
        descriptions, echoed, pids = zip(*results, strict=True)
        return list(descriptions), list(echoed), set(pids)
    if channel == "pipe":
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_echo_pipe, args=(strategy, there))
        with _reaped(proc):
            proc.start()
            there.close()
            here.send(arrays)
            assert here.poll(TIMEOUT), "no answer from the child"
            descriptions, echoed, pid = here.recv()
            here.send(None)
            proc.join(TIMEOUT)
        here.close()
        return descriptions, echoed, {pid}
    outbox, done = ctx.Queue(), ctx.Event()
    if channel == "queue":
        inbox = ctx.Queue()
        proc = ctx.Process(target=_echo_queue, args=(strategy, inbox, outbox))
    else:
        proc = ctx.Process(target=_echo_args, args=(strategy, arrays, outbox, done))
    with _reaped(proc):
        proc.start()
        if channel == "queue":
            inbox.put(arrays)
        descriptions, echoed, pid = outbox.get(timeout=TIMEOUT)
        if channel == "queue":
            inbox.put(None)
        done.set()
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
    return descriptions, echoed, {pid}


# -- the strategies API ---------------------------------------------------------------------------


def test_strategies_api():
    assert mp.get_all_sharing_strategies() == {"file_descriptor", "file_system"}
    assert isinstance(mp.get_all_sharing_strategies(), set)
    assert mp.get_sharing_strategy() == "file_descriptor"  # torch's default on Linux
    with pytest.raises(ValueError, match="'file_descriptor', 'file_system'") as info:
        mp.set_sharing_strategy("shm_open")
    assert "'shm_open'" in str(info.value)
    try:
        mp.set_sharing_strategy("file_system")
        assert mp.get_sharing_strategy() == "file_system"
    finally:
        mp.set_sharing_strategy("file_descriptor")
    assert mp.get_sharing_strategy() == "file_descriptor"


# -- share_memory, is_shared, empty, zeros (one process) --------------------------------------


def test_share_memory_identity_and_views(strategy, no_leaks):
    plain = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert not mp.is_shared(plain)
    shared = mp.share_memory(plain)
    assert shared is not plain and mp.is_shared(shared)
    assert mp.share_memory(shared) is shared
    assert _same_contents(shared, plain)
    shared[0, 0, 0] = 100  # a copy: the plain array is untouched
    assert plain[0, 0, 0] == 0
    for view in (
        shared[1],
        shared[:, ::2, ::-1],
        shared.T,
        shared.reshape(-1),
        np.asarray(memoryview(shared)),
        shared.view(np.int32),
        np.broadcast_to(shared[0, 0], (5, 4)),
    ):
        assert mp.is_shared(view)
        assert mp.share_memory(view) is view
    segment, offset = sharing.find_segment(shared[1, 2, ::-1])
    assert offset == (1 * 12 + 2 * 4 + 3) * 4
    assert segment.strategy == strategy
    assert not mp.is_shared(np.asarray(shared.tolist()))


@pytest.mark.parametrize("layout", ["C", "F", "transpose", "negative", "steps"])
def test_share_memory_keeps_layout_and_flags(strategy, no_leaks, layout):
    base = np.arange(60, dtype=np.int64).reshape(3, 4, 5)
    array = {
        "C": base,
        "F": np.asfortranarray(base),
        "transpose": base.transpose(1, 2, 0),
        "negative": base[::-1],
        "steps": base[:, ::2],
    }[layout]
    shared = mp.share_memory(array)
    assert _same_contents(shared, array)
    assert shared.flags.c_contiguous == array.flags.c_contiguous or layout in ("negative", "steps")
    assert shared.flags.f_contiguous == array.flags.f_contiguous or layout in ("negative", "steps")
    # the axes keep their order in memory (numpy's order="K"), compacted
    assert list(np.argsort(shared.strides)) == list(np.argsort(np.abs(array.strides)))
    readonly = array.copy()
    readonly.flags.writeable = False
    assert not mp.share_memory(readonly).flags.writeable


def test_empty_zeros(strategy, no_leaks):
    z = mp.zeros((3, 4), np.int32)
    assert z.shape == (3, 4) and z.dtype == np.int32 and mp.is_shared(z)
    assert not z.any() and z.flags.c_contiguous and z.flags.writeable
    f = mp.empty((3, 4), "f8", order="F")
    assert f.flags.f_contiguous and mp.is_shared(f)
    assert mp.zeros(5).dtype == np.float64 and mp.zeros(5).shape == (5,)
    assert mp.empty(()).shape == () and mp.is_shared(mp.empty(()))
    assert mp.zeros((0, 3)).shape == (0, 3)
    structured = mp.zeros(4, DTYPES[-1])
    assert structured.dtype == DTYPES[-1] and mp.is_shared(structured["b"])
    with pytest.raises(ValueError, match="negative"):
        mp.empty((2, -1))
    with pytest.raises(ValueError, match="order"):
        mp.empty(3, order="K")


def test_object_dtype_and_non_arrays():
    with pytest.raises(TypeError, match="object"):
        mp.share_memory(np.array([1, "a"], dtype=object))
    with pytest.raises(TypeError, match="object"):
        mp.empty(3, dtype=[("x", object)])
    with pytest.raises(TypeError, match="numpy"):
        mp.share_memory([1, 2, 3])
    with pytest.raises(TypeError, match="numpy or CuPy"):
        mp.is_shared([1, 2, 3])
    sub = mp.share_memory(np.arange(4).view(_Sub))  # subclasses give plain arrays
    assert type(sub) is np.ndarray and mp.is_shared(sub) and sub.tolist() == [0, 1, 2, 3]


class _Sub(np.ndarray):
    pass


def test_pickling_in_process(strategy, no_leaks):
    """The reducer's own cases: object and zero-size arrays pickle the ordinary way,
    subclasses keep their own pickling, a segment received by its creator is the same
    mapping."""
    objects = np.array([{"a": 1}, None, "x"], dtype=object)
    back = pickle.loads(ForkingPickler.dumps(objects))
    assert back.tolist() == objects.tolist()
    for empty in (np.zeros((0, 3)), mp.zeros((2, 0))):
        out = pickle.loads(ForkingPickler.dumps(empty))
        assert out.shape == empty.shape and not mp.is_shared(out)
    masked = np.ma.masked_array([1, 2, 3], mask=[0, 1, 0])
    out = pickle.loads(ForkingPickler.dumps(masked))
    assert type(out) is np.ma.MaskedArray and out.mask.tolist() == [False, True, False]
    a, b = mp.Pipe()
    shared = mp.zeros((4, 4), np.int16)
    a.send(shared[1:, ::-1])
    view = b.recv()
    assert sharing.find_segment(view)[0] is sharing.find_segment(shared)[0]
    view[0, 0] = 7
    assert shared[1, 3] == 7
    a.close()
    b.close()


# -- round trips between processes ----------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize("method", [*METHODS, "forkserver"])
def test_round_trip(strategy, no_leaks, method, channel):
    """Shared arrays arrive as views of the same pages with their layout and flags; plain
    ones arrive shared (except in fork-started Process arguments, which are inherited)."""
    pids = no_leaks
    shared, plain = _cases(shared=True), _cases(shared=False, seed=7)
    descriptions, echoed, child_pids = _round_trip(channel, method, strategy, shared + plain)
    pids |= child_pids
    inherited = channel == "args" and method == "fork"
    for i, (sent, got, back) in enumerate(zip(shared + plain, descriptions, echoed, strict=True)):
        is_shared = i < len(shared)
        where = f"array {i} ({'shared' if is_shared else 'plain'}), {got['dtype']}"
        expected = _describe(sent)
        assert got["bytes"] == expected["bytes"], where
        assert got["shape"] == expected["shape"] and got["dtype"] == expected["dtype"], where
        assert got["writeable"] == expected["writeable"], where
        if sent.size == 0:  # pickled the ordinary way (nothing to share)
            assert back.shape == sent.shape and back.dtype == sent.dtype, where
            continue
        assert got["shared"] == (is_shared or not inherited), where
        if is_shared:
            assert got["strides"] == expected["strides"], where
            # sent back: a view of the very mapping the parent holds
            assert back.strides == sent.strides, where
            assert np.shares_memory(back, sent), where
        assert _same_contents(back, sent), where
        assert back.flags.writeable == sent.flags.writeable, where
        assert mp.is_shared(back), where


def _write_then_check(strategy, array, index, ready, check, outbox):
    mp.set_sharing_strategy(strategy)
    array[index] = 1000 + index  # the parent checks it sees this
    ready.set()
    check.wait(TIMEOUT)
    outbox.put(int(array[-1 - index]))  # the parent wrote this meanwhile


def _write_queue(strategy, inbox, index, ready, check, outbox):
    _write_then_check(strategy, inbox.get(timeout=TIMEOUT), index, ready, check, outbox)


def _write_pipe(strategy, conn, index, ready, check, outbox):
    if not conn.poll(TIMEOUT):
        raise TimeoutError("nothing received")
    _write_then_check(strategy, conn.recv(), index, ready, check, outbox)


def _pool_write(args):
    array, index = args
    array[index] = 1000 + index
    return os.getpid()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("channel", ["queue", "pipe", "args"])
@pytest.mark.parametrize("method", METHODS)
def test_writes_seen_both_ways(strategy, no_leaks, method, channel):
    ctx = mp.get_context(method)
    pids = no_leaks
    array = mp.zeros(8, np.int64)
    ready, check, outbox = ctx.Event(), ctx.Event(), ctx.Queue()
    here = there = inbox = None
    if channel == "queue":
        inbox = ctx.Queue()
        args = (strategy, inbox, 2, ready, check, outbox)
        target = _write_queue
    elif channel == "pipe":
        here, there = ctx.Pipe()
        args = (strategy, there, 2, ready, check, outbox)
        target = _write_pipe
    else:
        args = (strategy, array[::-1][::-1], 2, ready, check, outbox)
        target = _write_then_check
    proc = ctx.Process(target=target, args=args)
    with _reaped(proc):
        proc.start()
        pids.add(proc.pid)
        if inbox is not None:
            inbox.put(array)
        if here is not None:
            there.close()
            here.send(array)
        assert ready.wait(TIMEOUT)
        assert array[2] == 1002
        array[-3] = 77
        check.set()
        assert outbox.get(timeout=TIMEOUT) == 77
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
    if here is not None:
        here.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", METHODS)
def test_pool_writes_seen_by_parent(strategy, no_leaks, method):
    pids = no_leaks
    array = mp.zeros((6,), np.int32)
    with mp.get_context(method).Pool(3) as pool:
        pids |= set(pool.map(_pool_write, [(array, i) for i in range(6)]))
        pool.close()
        pool.join()
    assert array.tolist() == [1000 + i for i in range(6)]


def _put_and_return(strategy, queue, n):
    mp.set_sharing_strategy(strategy)
    for i in range(n):
        queue.put(np.full(1000 + i, i, dtype=np.int32))  # plain: copied into a segment
    queue.put(mp.share_memory(np.arange(5)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", [*METHODS, "forkserver"])
def test_child_that_returns_right_after_put(strategy, method):
    """A child that puts arrays and returns stays until they were received (torch would
    lose them under file_descriptor when the child is gone before the parent's get)."""
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    proc = ctx.Process(target=_put_and_return, args=(strategy, queue, 20))
    with _reaped(proc):
        proc.start()
        time.sleep(0.2)  # let the child finish putting and start exiting
        got = [queue.get(timeout=TIMEOUT) for _ in range(21)]
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
    for i, array in enumerate(got[:-1]):
        assert array.shape == (1000 + i,) and (array == i).all() and mp.is_shared(array)
    assert got[-1].tolist() == [0, 1, 2, 3, 4]


def _without_manager_env(inbox, outbox):
    mp.set_sharing_strategy("file_system")
    received = inbox.get(timeout=TIMEOUT)
    outbox.put((ManagerClient.current().address, received.tolist(), mp.share_memory(np.arange(4))))
    inbox.get(timeout=TIMEOUT)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["file_system"], indirect=True)
def test_child_adopts_the_senders_manager(strategy, no_leaks, monkeypatch):
    """A child that does not know the manager (like the children of a forkserver started
    before it; here a spawned child without DISTCOMM_SHM_MANAGER) connects to the one
    named by the first array it receives."""
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_without_manager_env, args=(inbox, outbox))
    with _reaped(proc):
        monkeypatch.delenv(ADDRESS_ENV)
        proc.start()
        monkeypatch.undo()
        no_leaks.add(proc.pid)
        inbox.put(mp.share_memory(np.arange(5)))
        address, values, created = outbox.get(timeout=TIMEOUT)
        assert address == ManagerClient.current().address
        assert values == [0, 1, 2, 3, 4]
        assert created.tolist() == [0, 1, 2, 3] and mp.is_shared(created)
        inbox.put(None)
        proc.join(TIMEOUT)
        assert proc.exitcode == 0


_TWO_MANAGERS = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import distcomm.multiprocessing as mp
    from distcomm.multiprocessing.shm.protocol import ADDRESS_ENV

    def child(inbox, outbox):
        mp.set_sharing_strategy("file_system")
        mine = mp.share_memory(np.arange(3))  # no manager known: it starts its own
        try:
            inbox.get(timeout=30)
            outbox.put("no error")
        except Exception as exc:
            outbox.put(f"{type(exc).__name__}: {exc}")

    if __name__ == "__main__":
        mp.set_sharing_strategy("file_system")
        ctx = mp.get_context("spawn")
        inbox, outbox = ctx.Queue(), ctx.Queue()
        address = os.environ.pop(ADDRESS_ENV)
        proc = ctx.Process(target=child, args=(inbox, outbox))
        proc.start()
        os.environ[ADDRESS_ENV] = address
        inbox.put(mp.share_memory(np.arange(5)))  # never claimed: the child refuses it
        answer = outbox.get(timeout=30)
        proc.join(30)
        print(json.dumps({"pids": [os.getpid(), proc.pid], "outcome": answer}))
""")


@pytest.mark.timeout(90)
def test_child_with_another_manager_gets_an_error():
    """A child that started its own manager before receiving an array tracked by its
    parent's gets an error naming the remedy; the message it could not claim is cleaned
    up once every process has exited."""
    report = _run_driver(_TWO_MANAGERS)
    assert report["outcome"].startswith("ShmManagerError: process "), report
    assert "set_sharing_strategy('file_system') in the main process" in report["outcome"]
    assert report["shm_left"] == [], report


# -- killed processes, leaks --------------------------------------------------------------------


def _hold_until_killed(strategy, inbox, ready):
    mp.set_sharing_strategy(strategy)
    arrays = inbox.get(timeout=TIMEOUT)
    mine = mp.share_memory(np.ones(1000))  # a segment of its own, too
    ready.set()
    time.sleep(TIMEOUT)
    del arrays, mine


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", METHODS)
def test_kill_child_holding_shared_arrays(strategy, no_leaks, method):
    ctx = mp.get_context(method)
    pids = no_leaks
    inbox, ready = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_hold_until_killed, args=(strategy, inbox, ready))
    with _reaped(proc):
        proc.start()
        pids.add(proc.pid)
        arrays = [mp.zeros(1 << 16), np.ones(1 << 16), mp.zeros((64, 64))[::2]]
        inbox.put(arrays)
        assert ready.wait(TIMEOUT)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(TIMEOUT)
        assert proc.exitcode == -signal.SIGKILL
    arrays[0][:] = 1  # the parent's mappings are intact
    assert arrays[0].sum() == 1 << 16
    del arrays
    inbox.close()
    inbox.join_thread()


_DRIVER = textwrap.dedent("""
    import json, os, signal, sys, time, gc
    import numpy as np, psutil
    import distcomm.multiprocessing as mp

    def sender(strategy, queue, flushed, shared):
        mp.set_sharing_strategy(strategy)
        array = np.arange(1 << 18, dtype=np.float64)  # 2 MiB
        queue.put(mp.share_memory(array) if shared else array)
        queue.close()
        queue.join_thread()  # the message is in the pipe
        flushed.set()
        time.sleep(60)

    def main(strategy, method, shared, receive):
        mp.set_sharing_strategy(strategy)
        ctx = mp.get_context(method)
        from multiprocessing import forkserver, resource_tracker
        resource_tracker.ensure_running()  # warm up what lives as long as the process
        a, b = mp.Pipe(); a.send(mp.zeros(1)); b.recv(); a.close(); b.close()
        gc.collect()
        fds = psutil.Process().num_fds()
        queue, flushed = ctx.Queue(), ctx.Event()
        proc = ctx.Process(target=sender, args=(strategy, queue, flushed, shared))
        proc.start()
        sender_pid = proc.pid
        if not flushed.wait(30):
            proc.kill()
            raise SystemExit("the sender did not flush its message")
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        outcome = "not received"
        if receive:
            try:
                array = queue.get(timeout=30)
            except Exception as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            else:
                ok = array.shape == (1 << 18,) and (array == np.arange(1 << 18)).all()
                outcome = f"received {'ok' if ok else 'WRONG'} shared={mp.is_shared(array)}"
                del array
        queue.close()
        queue.join_thread()
        del queue, proc
        # descriptors are closed as their objects are collected, some by threads that
        # end a moment later: wait (bounded) for them, then report what is still open
        deadline = time.monotonic() + 10
        while gc.collect() >= 0 and psutil.Process().num_fds() > fds:
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        print(json.dumps({"pids": [os.getpid(), sender_pid], "outcome": outcome,
                          "fds_leaked": psutil.Process().num_fds() - fds}))

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2], sys.argv[3] == "shared", sys.argv[4] == "receive")
""")


def _run_script(
    source: str, *args: str, tmp: str, env: dict[str, str] | None = None, timeout: float = 90.0
) -> subprocess.CompletedProcess:
    """Run `source` as a script file (spawn re-imports it) in a fresh interpreter, without
    this process's shm manager (it starts its own); fails the test on a non-zero exit."""
    script = os.path.join(tmp, "script.py")
    with open(script, "w") as f:
        f.write(source)
    full_env = {k: v for k, v in os.environ.items() if k != "DISTCOMM_SHM_MANAGER"}
    full_env.update(PYTHONPATH=ROOT, **(env or {}))
    proc = subprocess.run(
        [sys.executable, script, *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def _run_driver(source: str, *args: str) -> dict:
    """Run `source` in a fresh interpreter with its own shm manager and temp dir (where a
    killed sender's pymp-* directory lands).

    Returns:
        Its JSON report (the last line of its output) plus "shm_left": the /dev/shm files
        of the pids it reported, once its manager had time to see everyone exit.
    """
    with tempfile.TemporaryDirectory(prefix="distcomm-test-") as tmp:
        proc = _run_script(source, *args, tmp=tmp, env={"TMPDIR": tmp})
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    pids = set(report["pids"])
    gone = _poll(lambda: not _shm_names(pids), 20.0)
    report["shm_left"] = [] if gone else _shm_names(pids)
    return report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("receive", ["receive", "never"])
@pytest.mark.parametrize("shared", ["shared", "plain"])
@pytest.mark.parametrize("method", METHODS)
def test_kill_sender_mid_transfer(strategy, method, shared, receive):
    """The sender is killed right after its message reached the pipe. file_system: the
    array is still received (the manager kept the segment for it); file_descriptor: a
    clear DistNetworkError. Either way, no descriptor leaks in the receiver, and no /dev/shm file
    survives once everything exited -- received or not."""
    report = _run_driver(_DRIVER, strategy, method, shared, receive)
    if receive == "receive":
        if strategy == "file_system":
            assert report["outcome"] == "received ok shared=True", report
        else:
            assert report["outcome"].startswith(
                "DistNetworkError: cannot receive a shared array: the process that sent it exited"
            ), report
            assert "file_system" in report["outcome"]
    assert report["fds_leaked"] <= 0, report
    assert report["shm_left"] == [], report


# -- descriptor limits -------------------------------------------------------------------------


def _exhaust_descriptors(conn):
    try:
        used = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (used + 24, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        )
        mp.set_sharing_strategy("file_descriptor")
        kept = []
        error = None
        for _ in range(100):
            try:
                kept.append(mp.share_memory(np.arange(10)))
            except OSError as exc:
                error = exc
                break
        result = {
            "created": len(kept),
            "errno": getattr(error, "errno", None),
            "message": str(error),
        }
        del kept
        mp.set_sharing_strategy("file_system")  # what the message suggests: no fd each
        kept = [mp.share_memory(np.arange(10)) for _ in range(200)]
        result["file_system"] = len(kept)
        conn.send(result)
    except BaseException as exc:
        conn.send({"error": repr(exc)})


def _receive_until_exhausted(inbox, conn):
    try:
        used = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (used + 24, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        )
        kept, error = [], None
        for _ in range(100):
            try:
                kept.append(inbox.get(timeout=TIMEOUT))
            except OSError as exc:
                error = exc
                break
        conn.send(
            {"received": len(kept), "errno": getattr(error, "errno", None), "message": str(error)}
        )
    except BaseException as exc:
        conn.send({"error": repr(exc)})


@pytest.mark.timeout(60)
def test_descriptor_limit_error_names_limit_and_remedy():
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_exhaust_descriptors, args=(there,))
    with _reaped(proc):
        proc.start()
        assert here.poll(TIMEOUT)
        result = here.recv()
        proc.join(TIMEOUT)
    assert "error" not in result, result
    assert 0 < result["created"] < 100
    assert result["errno"] == errno.EMFILE
    assert "RLIMIT_NOFILE" in result["message"] and "soft" in result["message"]
    assert "set_sharing_strategy('file_system')" in result["message"]
    assert result["file_system"] == 200


@pytest.mark.timeout(60)
def test_descriptor_limit_on_receive():
    ctx = mp.get_context("spawn")
    inbox = ctx.Queue()
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_receive_until_exhausted, args=(inbox, there))
    with _reaped(proc):
        proc.start()
        for _ in range(100):
            inbox.put(mp.zeros(3))
        assert here.poll(TIMEOUT)
        result = here.recv()
        proc.join(TIMEOUT)
    inbox.cancel_join_thread()  # the rest stays unread
    assert "error" not in result, result
    assert 0 < result["received"] < 100
    assert result["errno"] == errno.EMFILE
    assert "RLIMIT_NOFILE" in result["message"]
    assert "set_sharing_strategy('file_system')" in result["message"]


# -- CuPy without a device ---------------------------------------------------------------------


_STAND_IN_CUPY = textwrap.dedent("""
    import sys, types

    class CUDADriverError(Exception):
        def __init__(self, status):
            super().__init__(f"CUDA_ERROR {status}")
            self.status = status

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(driver=types.SimpleNamespace())
    def ctx_get_current():
        if INITIALISED:
            return 0
        raise CUDADriverError(3)  # CUDA_ERROR_NOT_INITIALIZED, as before cuInit
    cupy.cuda.driver.ctxGetCurrent = ctx_get_current
    class ndarray:
        pass
    cupy.ndarray = ndarray
    sys.modules["cupy"] = cupy
""")

_FORK_GUARD = _STAND_IN_CUPY + textwrap.dedent("""
    import json, os
    import distcomm.multiprocessing as mp
    from multiprocessing.reduction import ForkingPickler
    from distcomm.gpu import ipc

    INITIALISED = sys.argv[1] == "initialised"

    def child(conn):
        out = {}
        for what, call in (
            ("rebuild", lambda: ipc.rebuild_cupy_array(b"h", 1, 0, (1,), (4,), "<f4", "x", 1)),
            ("send", lambda: ForkingPickler.dumps(cupy.ndarray())),
        ):
            try:
                call()
                out[what] = "no error"
            except Exception as exc:
                out[what] = f"{type(exc).__name__}: {exc}"
        conn.send(out)

    if __name__ == "__main__":
        results = {}
        for method in ("fork", "spawn"):
            here, there = mp.Pipe()
            p = mp.get_context(method).Process(target=child, args=(there,))
            p.start()
            results[method] = here.recv() if here.poll(30) else "no answer"
            p.join(30)
        print(json.dumps(results))
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("parent", ["initialised", "not initialised"])
def test_cupy_fork_guard(parent):
    """A child forked after the parent initialised CUDA refuses CuPy arrays both ways,
    naming spawn/forkserver; one forked before CUDA was initialised, or spawned, passes the
    guard (and here, with a stand-in CuPy that cannot import for real, fails further on)."""
    with tempfile.TemporaryDirectory(prefix="distcomm-test-") as tmp:
        proc = _run_script(_FORK_GUARD, parent, tmp=tmp)
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    guarded = "RuntimeError: cannot {} a CuPy array in process"
    for what in ("rebuild", "send"):
        verb = "receive" if what == "rebuild" else "send"
        forked = results["fork"][what]
        if parent == "initialised":
            assert forked.startswith(guarded.format(verb)), forked
            assert "does not survive fork" in forked and "'spawn'" in forked
            assert "'forkserver'" in forked
        else:
            assert not forked.startswith("RuntimeError"), forked
        # spawned children never inherit CUDA state; the stand-in then fails on use
        assert not results["spawn"][what].startswith("RuntimeError"), results["spawn"]
    # ForkingPickler handed the stand-in cupy.ndarray to the IPC reducer (which then
    # looked for its dtype): CuPy arrays are recognised without distcomm importing CuPy
    assert "has no attribute 'dtype'" in results["spawn"]["send"]


def test_cupy_missing_gives_install_hint():
    if "cupy" in sys.modules or _cupy_importable():
        pytest.skip("CuPy is installed: the message without it cannot be produced here")
    with pytest.raises(BackendUnavailableError, match="pip install cupy-cuda12x") as info:
        ipc.rebuild_cupy_array(b"\0" * 64, 1, 0, (1,), (4,), "<f4", "0000:00:00.0", 1)
    assert "cannot receive a CuPy array" in str(info.value)
    assert isinstance(info.value, ImportError)
    ipc.check_fork_safe("send")  # this process was not forked from a CUDA one


def test_numpy_pickling_does_not_import_cupy():
    code = (
        "import sys, pickle; import numpy as np; import distcomm.multiprocessing as mp; "
        "from multiprocessing.reduction import ForkingPickler as P; "
        "pickle.loads(P.dumps([np.arange(3), mp.zeros(2), {'x': 1}])); "
        "print('cupy' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def _cupy_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("cupy") is not None


# -- CuPy on a GPU ----------------------------------------------------------------------------


@pytest.fixture
def cupy():
    """The real CuPy module with a device; skip (or fail, DISTCOMM_TEST_REQUIRE_GPU=1) if not."""
    from distcomm.gpu.staging import import_cupy

    try:
        return import_cupy()
    except BackendUnavailableError as exc:
        reason = f"CUDA IPC of CuPy arrays needs CuPy and a GPU: {exc}"
        if os.environ.get("DISTCOMM_TEST_REQUIRE_GPU") == "1":
            pytest.fail(f"DISTCOMM_TEST_REQUIRE_GPU=1 but {reason}")
        pytest.skip(reason)


def _gpu_child(inbox, outbox):
    import cupy

    arrays = inbox.get(timeout=TIMEOUT)
    outbox.put([(a.dtype.str, a.shape, a.strides, cupy.asnumpy(a).tobytes().hex()) for a in arrays])
    inbox.get(timeout=TIMEOUT)  # the parent has compared what this process saw
    arrays[0][0] = 99  # written through the IPC mapping
    cupy.cuda.Device(arrays[0].device.id).synchronize()
    outbox.put("written")
    inbox.get(timeout=TIMEOUT)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_gpu_round_trip(cupy, method):
    ctx = mp.get_context(method)
    base = cupy.arange(4 * 5 * 6, dtype=cupy.float32).reshape(4, 5, 6)
    arrays = [
        base[0],
        base,
        base[::2, 1::2, ::-1],
        base.transpose(2, 0, 1),
        cupy.arange(10, dtype=cupy.int64)[::-1],
        cupy.zeros((0, 3)),
    ]
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_gpu_child, args=(inbox, outbox))
    with _reaped(proc):
        proc.start()
        inbox.put(arrays)
        described = outbox.get(timeout=TIMEOUT)
        for array, (dtype, shape, strides, data) in zip(arrays, described, strict=True):
            host = cupy.asnumpy(array)
            assert (dtype, tuple(shape)) == (array.dtype.str, array.shape)
            assert tuple(strides) == array.strides or array.size == 0
            assert data == host.tobytes().hex()
        inbox.put("write")
        assert outbox.get(timeout=TIMEOUT) == "written"
        assert float(base[0, 0, 0]) == 99  # the child's write, seen here
        inbox.put(None)
        proc.join(TIMEOUT)
        assert proc.exitcode == 0


def test_gpu_same_process_pipe(cupy):
    a, b = mp.Pipe()
    array = cupy.arange(12, dtype=cupy.float64).reshape(3, 4)
    a.send(array[1:, ::-1])
    view = b.recv()
    assert (cupy.asnumpy(view) == cupy.asnumpy(array)[1:, ::-1]).all()
    view[0, 0] = -1
    assert float(array[1, 3]) == -1
    assert mp.is_shared(array) and mp.share_memory(array) is array


def _gpu_holder(inbox, outbox):
    import cupy

    array = inbox.get(timeout=TIMEOUT)  # opens the IPC mapping
    outbox.put(float(array[0]))
    inbox.get(timeout=TIMEOUT)  # the parent has written through its own array since
    outbox.put(float(array[1]))
    array[2] = 42  # and this process writes through the mapping
    cupy.cuda.Device(array.device.id).synchronize()
    outbox.put(os.getpid())
    inbox.get(timeout=10 * TIMEOUT)  # holds the mapping until it is killed


def _gpu_pids(cupy) -> set[int] | None:
    """The pids NVML lists on this process's GPU, or None where NVML cannot say."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            bus = cupy.cuda.runtime.deviceGetPCIBusId(cupy.cuda.Device().id)
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus.encode())
            return {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None


@pytest.mark.timeout(180)
def test_gpu_writes_both_ways_and_kill_9_leaves_nothing(cupy):
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    cupy.cuda.Device().synchronize()
    free_before = cupy.cuda.runtime.memGetInfo()[0]
    array = cupy.arange(1 << 20, dtype=cupy.float32)  # its own 4 MiB allocation
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_gpu_holder, args=(inbox, outbox))
    with _reaped(proc):
        proc.start()
        inbox.put(array)
        assert outbox.get(timeout=TIMEOUT) == 0.0
        array[1] = -7  # the parent writes after the child mapped the memory
        cupy.cuda.Device().synchronize()
        inbox.put("look")
        assert outbox.get(timeout=TIMEOUT) == -7.0  # seen there
        pid = outbox.get(timeout=TIMEOUT)
        assert float(array[2]) == 42  # the child's write, seen here
        on_gpu = _gpu_pids(cupy)
        os.kill(pid, signal.SIGKILL)
        proc.join(TIMEOUT)
        assert proc.exitcode == -signal.SIGKILL
    # the exporter's array outlives the killed importer, unchanged and usable
    array += 1
    assert cupy.asnumpy(array[:4]).tolist() == [1.0, -6.0, 43.0, 4.0]
    if on_gpu is not None and pid in on_gpu:  # NVML sees this machine's processes
        deadline = time.monotonic() + TIMEOUT
        while pid in (_gpu_pids(cupy) or set()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid not in (_gpu_pids(cupy) or set()), "the killed child still holds the GPU"
    del array
    gc.collect()
    pool.free_all_blocks()
    cupy.cuda.Device().synchronize()
    deadline = time.monotonic() + TIMEOUT  # the driver reclaims a killed context by itself
    while cupy.cuda.runtime.memGetInfo()[0] < free_before - (2 << 20):
        assert time.monotonic() < deadline, (
            f"device memory not returned after the child was killed: "
            f"{free_before - cupy.cuda.runtime.memGetInfo()[0]} bytes less free than before"
        )
        time.sleep(0.1)
