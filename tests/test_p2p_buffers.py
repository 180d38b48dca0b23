"""Point-to-point with buffer-protocol objects, as mpi4py's Send and Recv take them.

`send`, `isend` and a `P2POp(isend, ...)` take any C-contiguous buffer (bytes, bytearray,
memoryview, mmap, array.array) besides arrays, since they only read it; `recv`, `irecv`
and a `P2POp(irecv, ...)` take a writable one and refuse a read-only one. Untyped bytes
travel as uint8, a typed buffer as its format's dtype, so bytes sent arrive in a
bytearray, an mmap or a uint8 array of as many bytes. The errors name the function the
caller called (`send`, not the `isend` it is built on), what it got and what to pass.

The transfers run on every CPU backend at 2 ranks, and on mpi under a 2-process mpiexec
job (`test_buffers_on_mpi_under_mpiexec` runs this module there); the argument errors run
in the test process (they are raised before any backend sees the call).
"""

from __future__ import annotations

import array
import functools
import gc
import mmap
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import distcomm as dist
from tests.conftest import UNDER_MPIEXEC, cpu_variants, open_world, world_id

if not UNDER_MPIEXEC:
    from tests.mpijobs import (  # noqa: F401 - the fixture applies to every test here
        LAUNCHER,
        REPO,
        SKIP_REASON,
        job_env,
        no_mpi_segment_left,
        run,
    )

#: byte counts of the transfers: empty, odd, and past the inline and chunk sizes
NBYTES = (0, 7, 100_003)


def _params() -> list[tuple]:
    if UNDER_MPIEXEC:
        return [("mpi", 0, {})]
    return [(b, 2, env) for b, env in cpu_variants()]


@pytest.fixture(scope="module", params=_params(), ids=world_id)
def world(request):
    """gloo (shared memory, TCP only, two pretend hosts) and tcp at 2 ranks; the mpiexec
    job's ranks under `test_buffers_on_mpi_under_mpiexec`."""
    yield from open_world(request.param)


def _payload(rank: int, nbytes: int) -> bytes:
    """What rank `rank` sends: `nbytes` bytes that differ from rank to rank."""
    return ((np.arange(nbytes) * 11 + rank * 37 + 1) % 256).astype(np.uint8).tobytes()


def _mapped(data: bytes) -> mmap.mmap:
    """An anonymous mmap holding `data` (an mmap cannot be empty)."""
    mm = mmap.mmap(-1, len(data))
    mm[:] = data
    return mm


#: how the sender wraps its bytes: each only read by a send
SENDERS = {
    "bytes": bytes,
    "bytearray": bytearray,
    "memoryview of bytes": memoryview,
    "mmap": _mapped,
    "array.array('B')": lambda data: array.array("B", data),
    "2-d memoryview": lambda data: memoryview(bytearray(data)).cast("B", shape=[1, len(data)]),
    "numpy.frombuffer of bytes": lambda data: np.frombuffer(data, np.uint8),
    "memoryview of format 'c'": lambda data: memoryview(data).cast("c"),
}

#: what the receiver posts for `nbytes` bytes: each writable
RECEIVERS = {
    "bytearray": bytearray,
    "numpy uint8": lambda nbytes: np.zeros(nbytes, np.uint8),
    "memoryview of bytearray": lambda nbytes: memoryview(bytearray(nbytes)),
    "mmap": lambda nbytes: mmap.mmap(-1, nbytes),
    "array.array('B')": lambda nbytes: array.array("B", bytes(nbytes)),
    "numpy.frombuffer of bytearray": lambda nbytes: np.frombuffer(bytearray(nbytes), np.uint8),
    "2-d memoryview": lambda nbytes: memoryview(bytearray(nbytes)).cast("B", shape=[nbytes, 1]),
    "memoryview of format 'c'": lambda nbytes: memoryview(bytearray(nbytes)).cast("c"),
}


def _pairs(nbytes: int) -> list[tuple[str, str]]:
    """(sender kind, receiver kind): every sender and every receiver at least once, and
    bytes into each receiver (mpi4py's habit); an mmap or a cast memoryview cannot be
    empty."""
    pairs = list(zip(SENDERS, reversed(RECEIVERS), strict=True))
    pairs += [("bytes", receiver) for receiver in RECEIVERS]
    if nbytes == 0:
        pairs = [p for p in pairs if not {"mmap", "2-d memoryview"} & set(p)]
    return pairs


def _untyped_round_trips(nbytes: int) -> list[str]:
    """Around the ring: post the receive, send, wait; the receiver sees the exact bytes."""
    r, n = dist.get_rank(), dist.get_world_size()
    right, left = (r + 1) % n, (r - 1) % n
    done = []
    for tag, (sender, receiver) in enumerate(_pairs(nbytes)):
        what = f"{sender} -> {receiver} ({nbytes} bytes)"
        into = RECEIVERS[receiver](nbytes)
        receiving = dist.irecv(into, src=left, tag=tag)
        dist.send(SENDERS[sender](_payload(r, nbytes)), dst=right, tag=tag)
        receiving.wait()
        assert receiving.result()[0] is into, f"{what}: result() is not the caller's buffer"
        assert bytes(into) == _payload(left, nbytes), f"{what}: rank {r} got other bytes"
        done.append(what)
    dist.barrier()
    return done


@pytest.mark.parametrize("nbytes", NBYTES)
def test_untyped_buffers_arrive_byte_for_byte(world, nbytes):
    done = world.run(_untyped_round_trips, nbytes)[0]
    assert len(done) == len(_pairs(nbytes))


def _typed(rank: int) -> list[tuple[object, object, list]]:
    """(what `rank` sends, what its receiver posts, the values that arrive) of each case."""
    floats = [float(rank * 10 + i) for i in range(5)]
    ints = list(range(rank, rank + 6))
    longs = np.arange(rank, rank + 4, dtype=np.int64)
    return [
        (array.array("d", floats), array.array("d", bytes(40)), floats),
        (array.array("i", ints), np.zeros(6, np.int32), ints),
        (memoryview(longs.tobytes()).cast("q"), memoryview(bytearray(32)).cast("q"), longs),
        (np.asarray(floats, np.float32), array.array("f", bytes(20)), floats),
    ]


def _typed_round_trips() -> None:
    """A typed buffer travels as its format's dtype, into any buffer or array of it."""
    r, n = dist.get_rank(), dist.get_world_size()
    right, left = (r + 1) % n, (r - 1) % n
    for tag, ((sent, into, _), (_, _, expected)) in enumerate(
        zip(_typed(r), _typed(left), strict=True)
    ):
        receiving = dist.irecv(into, src=left, tag=tag)
        sending = dist.isend(sent, dst=right, tag=tag)
        receiving.wait()
        sending.wait()
        assert sending.result()[0] is sent
        assert np.asarray(into).tolist() == list(expected), (tag, r)
    dist.barrier()


def test_typed_buffers_keep_their_dtype(world):
    world.run(_typed_round_trips)


def _batch_of_buffers() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    right, left = (r + 1) % n, (r - 1) % n
    from_left, from_right = bytearray(9), mmap.mmap(-1, 9)
    ops = [
        dist.P2POp(dist.isend, _payload(r, 9), right, tag=4),
        dist.P2POp(dist.isend, memoryview(bytearray(_payload(r + 20, 9))), left, tag=5),
        dist.P2POp(dist.irecv, from_left, left, tag=4),
        dist.P2POp(dist.irecv, from_right, right, tag=5),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert bytes(from_left) == _payload(left, 9)
    assert bytes(from_right) == _payload(right + 20, 9)
    dist.barrier()


def test_batch_isend_irecv_takes_buffers(world):
    world.run(_batch_of_buffers)


def _typed_into_bytes() -> str | None:
    """Rank 0 sends 2 float64 as an array.array("d"), which rank 1 cannot receive into a
    bytearray of 16; then as its bytes (memoryview.cast("B")), which it can."""
    message = None
    if dist.get_rank() == 0:
        dist.send(array.array("d", [1.0, 2.0]), dst=1, tag=1)
        dist.send(memoryview(array.array("d", [3.0, 4.0])).cast("B"), dst=1, tag=2)
    elif dist.get_rank() == 1:
        try:
            dist.recv(bytearray(16), src=0, tag=1)
        except dist.DistBackendError as exc:
            message = str(exc)
        into = bytearray(16)
        dist.recv(into, src=0, tag=2)
        assert np.frombuffer(into, np.float64).tolist() == [3.0, 4.0]
    dist.barrier()
    return message


def test_a_typed_buffer_received_as_bytes_is_a_dtype_mismatch(world):
    # tcp and gloo check dtype and count at the receiver, as for arrays; MPI does not
    if world.backend == "mpi":
        pytest.skip("MPI matches messages by byte count only")
    message = world.run(_typed_into_bytes)[1]
    assert message is not None, "a float64 message was received into a bytearray"
    assert "expects 16 uint8" in message and "sent 2 float64" in message, message
    assert "same size and dtype" in message, message


# -- argument errors (in the test process: a 1-rank group) ------------------------------------

in_process = pytest.mark.skipif(
    UNDER_MPIEXEC, reason="runs in a 1-rank group of the test process, not in the mpiexec job"
)


def _read_only_mmap(tmp_path: Path) -> mmap.mmap:
    path = tmp_path / "data"
    path.write_bytes(b"\0" * 8)
    with open(path, "rb") as fp:
        return mmap.mmap(fp.fileno(), 8, access=mmap.ACCESS_READ)


@in_process
@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda tmp: b"\0" * 8, "bytes"),
        (lambda tmp: memoryview(bytearray(8)).toreadonly(), "memoryview"),
        (_read_only_mmap, "mmap"),
    ],
    ids=["bytes", "read-only memoryview", "read-only mmap"],
)
@pytest.mark.parametrize("op", ["recv", "irecv", "P2POp(irecv)"])
def test_a_read_only_buffer_is_refused_where_written(solo, tmp_path, make, kind, op):
    buffer = make(tmp_path)
    call = {
        "recv": lambda: dist.recv(buffer),
        "irecv": lambda: dist.irecv(buffer),
        "P2POp(irecv)": lambda: dist.batch_isend_irecv([dist.P2POp(dist.irecv, buffer, 0)]),
    }[op]
    where = "recv" if op == "recv" else "irecv"
    with pytest.raises(ValueError) as caught:
        call()
    message = str(caught.value)
    assert message.startswith(f"{where}: tensor is a read-only {kind}, but {where} writes"), message
    assert "bytearray" in message and "numpy.frombuffer(bytearray(nbytes)" in message, message


@in_process
def test_a_read_only_array_is_refused_by_recv_naming_recv(solo):
    frozen = np.frombuffer(b"\0" * 8, np.uint8)
    with pytest.raises(ValueError, match=r"^recv: tensor is read-only") as caught:
        dist.recv(frozen)
    assert "irecv" not in str(caught.value)


@in_process
@pytest.mark.parametrize("op", ["send", "isend", "recv", "irecv"])
def test_a_non_contiguous_buffer_is_refused(solo, op):
    strided = memoryview(bytearray(8))[::2]
    call = getattr(dist, op)
    with pytest.raises(ValueError) as caught:
        call(strided, 1) if op.endswith("send") else call(strided)
    message = str(caught.value)
    assert message.startswith(f"{op}: tensor is a non-contiguous memoryview"), message
    assert "numpy.ascontiguousarray(tensor)" in message and "numpy.frombuffer" in message


@in_process
@pytest.mark.parametrize("op", ["send", "isend"])
def test_a_non_contiguous_array_is_refused_naming_the_op_called(solo, op):
    with pytest.raises(ValueError, match=rf"^{op}: tensor must be C-contiguous") as caught:
        getattr(dist, op)(np.arange(8)[::2], dst=1)
    assert "numpy.ascontiguousarray(tensor)" in str(caught.value)


@in_process
@pytest.mark.parametrize(
    ("value", "kind"), [([1, 2, 3], "list"), ("text", "str"), ({"a": 1}, "dict")]
)
@pytest.mark.parametrize("op", ["send", "isend", "recv", "irecv"])
def test_a_non_buffer_gets_a_type_error_naming_frombuffer(solo, value, kind, op):
    call = getattr(dist, op)
    with pytest.raises(TypeError) as caught:
        call(value, 1) if op.endswith("send") else call(value)
    message = str(caught.value)
    assert message.startswith(f"{op}: tensor must be a numpy.ndarray"), message
    assert f"got {kind};" in message and "bytes, bytearray, memoryview, mmap" in message
    assert "numpy.asarray(tensor)" in message and "numpy.frombuffer(buffer" in message


@in_process
def test_send_errors_say_send_not_isend(solo):
    calls = [
        (lambda: dist.send([1], dst=1), TypeError, "send: tensor must be"),
        (lambda: dist.send(b"abc", dst=0), ValueError, "send: dst 0 is this process itself"),
        (lambda: dist.send(b"abc", dst=1, tag=-1), ValueError, "send: tag must be"),
        (lambda: dist.send(b"abc", dst=5), ValueError, "send:"),
        (lambda: dist.recv(bytearray(3), src=0), ValueError, "recv: src 0 is this process"),
    ]
    for call, error, start in calls:
        with pytest.raises(error, match="^" + re.escape(start)) as caught:
            call()
        assert "isend" not in str(caught.value) and "irecv" not in str(caught.value)


@in_process
def test_a_buffer_format_numpy_cannot_read_names_frombuffer(solo):
    pointers = memoryview(bytearray(16)).cast("P")
    with pytest.raises(TypeError, match=r"^send: tensor is a memoryview of buffer format 'P'"):
        dist.send(pointers, dst=1)
    with pytest.raises(TypeError, match=r"^send: tensor has dtype <U1"):
        dist.send(array.array("u", "ab"), dst=1)


@in_process
def test_collectives_still_take_arrays_and_name_frombuffer(solo):
    with pytest.raises(TypeError) as caught:
        dist.all_reduce(bytearray(8))
    message = str(caught.value)
    assert message.startswith("all_reduce: tensor must be a numpy.ndarray"), message
    assert "got bytearray" in message and "numpy.frombuffer(tensor, dtype=...)" in message
    with pytest.raises(TypeError) as caught:
        dist.all_reduce([1.0])
    assert "numpy.frombuffer" not in str(caught.value)  # not a buffer: nothing to view
    # the remedy the message gives: a zero-copy view, written in place
    data = bytearray(np.arange(2.0).tobytes())
    dist.all_reduce(np.frombuffer(data, np.float64))
    assert np.frombuffer(data, np.float64).tolist() == [0.0, 1.0]


# -- the mpi backend ----------------------------------------------------------------------------


@pytest.mark.timeout(400)
@pytest.mark.skipif(UNDER_MPIEXEC, reason="this test starts the mpiexec job")
def test_buffers_on_mpi_under_mpiexec():
    if LAUNCHER is None:
        pytest.skip(f"the mpi backend tests need mpi4py and mpiexec: {SKIP_REASON}")
    module = str(Path(__file__).resolve().relative_to(REPO))
    argv = [sys.executable, "-m", "tests.mpi_world", module, "-q", "-x", "-p", "no:cacheprovider"]
    done = run(LAUNCHER.command(2, *argv), env=job_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    assert " passed" in done.stdout and "failed" not in done.stdout, done.stdout[-3000:]


# -- a completed operation lets go of the buffer (close it, resize it: as with mpi4py) ------


def _let_go(what: str, step: Callable[[], None]) -> None:
    """Run `step`, which closes or resizes a buffer whose operation completed."""
    try:
        step()
    except BufferError as exc:
        raise AssertionError(f"{what}: distcomm still holds a view of it ({exc})") from None


def _without_collector(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run with Python's cyclic garbage collector off, so that a view kept alive by a
    reference cycle stays alive, every time, instead of until the collector happens to run."""

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args)
        finally:
            if enabled:
                gc.enable()

    return run


def _send_then_let_go(peer: int, nbytes: int) -> list[str]:
    """Send with each call shape, then close the mmap or resize the bytearray at once."""
    payload = _payload(dist.get_rank(), nbytes)
    cases = []
    if nbytes:  # an mmap cannot be empty
        with mmap.mmap(-1, nbytes) as mm:  # the with-block's close must not raise
            mm[:] = payload
            dist.send(mm, peer, tag=1)
        cases.append("send(mmap) in a with-block")
        with mmap.mmap(-1, nbytes) as mm:
            mm[:] = payload
            dist.isend(mm, peer, tag=2).wait()
        cases.append("isend(mmap).wait() in a with-block")
        mm = _mapped(payload)
        work = dist.isend(mm, peer, tag=3)
        work.wait()  # the Work stays alive: it must not hold the view either
        _let_go("mmap.close() after isend's wait, its Work kept", mm.close)
        assert work.result()[0] is mm
        cases.append("isend(mmap), Work kept")
    buf = bytearray(payload)
    dist.send(buf, peer, tag=4)
    _let_go("bytearray.extend after send", lambda: buf.extend(b"x"))
    buf = bytearray(payload)
    work = dist.isend(buf, peer, tag=5)
    work.wait()
    _let_go("bytearray.extend after isend's wait", lambda: buf.extend(b"x"))
    typed = array.array("B", payload)
    dist.send(typed, peer, tag=6)
    _let_go("array.array.append after send", lambda: typed.append(1))
    # the message is read on the other side before its receive is posted
    buf = bytearray(payload)
    work = dist.isend(buf, peer, tag=7)
    dist.barrier()
    work.wait()
    _let_go("bytearray.extend after an isend received late", lambda: buf.extend(b"x"))
    # the receive is posted before the message is sent
    dist.barrier()
    buf = bytearray(payload)
    dist.send(buf, peer, tag=8)
    _let_go("bytearray.extend after a send received in place", lambda: buf.extend(b"x"))
    return [*cases, "bytearray", "array.array"]


def _recv_then_let_go(peer: int, nbytes: int) -> list[str]:
    """Receive with each call shape, then read, and close the mmap or resize the bytearray."""
    expected = _payload(peer, nbytes)
    cases = []
    if nbytes:
        mm = mmap.mmap(-1, nbytes)
        dist.recv(mm, peer, tag=1)
        data = bytes(mm)
        _let_go("mmap.close() after recv", mm.close)
        assert data == expected, "recv into an mmap"
        mm = mmap.mmap(-1, nbytes)
        dist.irecv(mm, peer, tag=2).wait()
        data = bytes(mm)
        _let_go("mmap.close() after irecv's wait", mm.close)
        assert data == expected, "irecv into an mmap"
        mm = mmap.mmap(-1, nbytes)
        work = dist.irecv(mm, tag=3)  # from any rank, the Work kept
        work.wait()
        data = bytes(mm)
        _let_go("mmap.close() after an any-source irecv's wait, its Work kept", mm.close)
        assert data == expected and work.source_rank() == peer, "any-source irecv"
        cases += ["recv(mmap)", "irecv(mmap)", "irecv(mmap), any source, Work kept"]
    buf = bytearray(nbytes)
    dist.recv(buf, peer, tag=4)
    _let_go("bytearray.extend after recv", lambda: buf.extend(b"x"))
    assert bytes(buf[:nbytes]) == expected, "recv into a bytearray"
    buf = bytearray(nbytes)
    work = dist.irecv(buf, peer, tag=5)
    work.wait()
    _let_go("bytearray.extend after irecv's wait, its Work kept", lambda: buf.extend(b"x"))
    assert bytes(buf[:nbytes]) == expected, "irecv into a bytearray"
    typed = array.array("B", bytes(nbytes))
    dist.recv(typed, peer, tag=6)
    _let_go("array.array.append after recv", lambda: typed.append(1))
    assert typed.tobytes()[:nbytes] == expected, "recv into an array.array"
    dist.barrier()  # the message arrived (or is arriving) before the receive is posted
    buf = bytearray(nbytes)
    dist.recv(buf, peer, tag=7)
    _let_go("bytearray.extend after a late recv", lambda: buf.extend(b"x"))
    assert bytes(buf[:nbytes]) == expected, "a message received late"
    buf = bytearray(nbytes)
    work = dist.irecv(buf, peer, tag=8)  # posted before the message is sent
    dist.barrier()
    work.wait()
    _let_go("bytearray.extend after an irecv posted first", lambda: buf.extend(b"x"))
    assert bytes(buf[:nbytes]) == expected, "a message received in place"
    return [*cases, "bytearray", "array.array"]


@_without_collector
def _buffers_free_once_complete(nbytes: int) -> list[str]:
    """Ranks 0 and 1 take turns: one sends, the other receives, and each closes or resizes
    its buffer the moment its operation completed. Other ranks wait."""
    r = dist.get_rank()
    done = []
    for sender in (0, 1):
        if r == sender:
            done += _send_then_let_go(1 - r, nbytes)
        elif r == 1 - sender:
            done += _recv_then_let_go(1 - r, nbytes)
        else:
            dist.barrier()
            dist.barrier()
    dist.barrier()
    return done


@pytest.mark.parametrize("nbytes", NBYTES)
def test_a_buffer_can_be_closed_or_resized_once_its_operation_completed(world, nbytes):
    done = world.run(_buffers_free_once_complete, nbytes)
    assert done[0] and done[1], done


@_without_collector
def _batch_lets_go(nbytes: int) -> None:
    """batch_isend_irecv between ranks 0 and 1: once every Work completed, each buffer can
    be closed or resized, the Works kept."""
    r = dist.get_rank()
    if r <= 1:
        peer = 1 - r
        out, into = bytearray(_payload(r, nbytes)), bytearray(nbytes)
        ops = [
            dist.P2POp(dist.isend, out, peer, tag=9),
            dist.P2POp(dist.irecv, into, peer, tag=9),
        ]
        if nbytes:
            mapped_out, mapped_into = _mapped(_payload(r + 20, nbytes)), mmap.mmap(-1, nbytes)
            ops += [
                dist.P2POp(dist.irecv, mapped_into, peer, tag=10),
                dist.P2POp(dist.isend, mapped_out, peer, tag=10),
            ]
        works = dist.batch_isend_irecv(ops)
        for work in works:
            work.wait()
        _let_go("bytearray.extend of a batch's send", lambda: out.extend(b"x"))
        _let_go("bytearray.extend of a batch's receive", lambda: into.extend(b"x"))
        assert bytes(into[:nbytes]) == _payload(peer, nbytes)
        if nbytes:
            data = bytes(mapped_into)
            _let_go("mmap.close() of a batch's send", mapped_out.close)
            _let_go("mmap.close() of a batch's receive", mapped_into.close)
            assert data == _payload(peer + 20, nbytes)
        assert len(works) == len(ops)
    dist.barrier()


@pytest.mark.parametrize("nbytes", NBYTES)
def test_batch_isend_irecv_lets_go_of_buffers_once_complete(world, nbytes):
    world.run(_batch_lets_go, nbytes)


@_without_collector
def _failed_operations_let_go() -> list[str]:
    """Sends and receives that fail (their group aborted here) let go of their buffers
    too, their Works and errors kept."""
    r = dist.get_rank()
    group = dist.new_group([0, 1])
    errors = []
    if r <= 1:
        peer = 1 - r
        group.abort(f"test: rank {r} aborts the group")
        mm = _mapped(_payload(r, 100_003))
        sending = dist.isend(mm, peer, group=group, tag=1)
        with pytest.raises(dist.DistError) as caught:
            sending.wait()
        errors.append(str(caught.value))
        _let_go("mmap.close() after a failed isend, its Work and error kept", mm.close)
        buf = bytearray(100_003)
        receiving = dist.irecv(buf, peer, group=group, tag=1)
        with pytest.raises(dist.DistError) as caught:
            receiving.wait()
        errors.append(str(caught.value))
        _let_go("bytearray.extend after a failed irecv", lambda: buf.extend(b"x"))
        assert sending.exception() is not None and receiving.exception() is not None
        # the blocking calls: their errors (kept here) hold no view either
        blocking = _mapped(_payload(r, 100_003))
        with pytest.raises(dist.DistError) as failed_send:
            dist.send(blocking, peer, group=group, tag=2)
        _let_go("mmap.close() after a failed send, its error kept", blocking.close)
        into = bytearray(100_003)
        with pytest.raises(dist.DistError) as failed_recv:
            dist.recv(into, peer, group=group, tag=2)
        _let_go("bytearray.extend after a failed recv, its error kept", lambda: into.extend(b"x"))
        assert "aborts the group" in str(failed_send.value) + str(failed_recv.value)
    dist.destroy_process_group(group)
    dist.barrier()
    return errors


@_without_collector
def _withdrawn_receive_lets_go() -> None:
    """A receive whose wait timed out is withdrawn (tcp, gloo): its buffer is free, its
    Work kept; the group goes on."""
    r = dist.get_rank()
    if r <= 1:
        buf = bytearray(64)
        receiving = dist.irecv(buf, 1 - r, tag=77)  # nobody sends it
        with pytest.raises(dist.DistTimeoutError):
            receiving.wait(timeout=0.2)
        _let_go("bytearray.extend after a withdrawn irecv", lambda: buf.extend(b"x"))
        assert not receiving.is_completed()
    dist.barrier()


def test_a_withdrawn_receive_lets_go_of_its_buffer(world):
    if world.backend == "mpi":
        pytest.skip("a timed-out MPI receive aborts the group")
    world.run(_withdrawn_receive_lets_go)


def test_failed_operations_let_go_of_buffers(world):
    if world.backend == "mpi":
        pytest.skip("aborting an MPI group ends the job")
    errors = world.run(_failed_operations_let_go)
    for messages in errors[:2]:
        assert len(messages) == 2 and all("aborts the group" in m for m in messages), messages
