"""Host staging of CuPy arrays (distcomm.gpu.staging).

The first part runs everywhere: without CuPy, and against a small stand-in `cupy` module
whose "device memory" is ordinary host memory, so the layout, aliasing, copy and
synchronisation logic is checked on every machine. The second part runs on a real GPU; it
skips without CuPy or a device, and fails instead when DISTCOMM_TEST_REQUIRE_GPU=1.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from distcomm.arrays import DTYPES
from distcomm.errors import BackendUnavailableError
from distcomm.gpu.staging import (
    HostStaging,
    current_stream,
    import_cupy,
    is_cupy_array,
    run_staged,
)

# -- a stand-in cupy: device memory is host memory, every copy and sync is logged ----------


class FakeDevice:
    def __init__(self, fake: FakeCupy, id: int) -> None:
        self.fake, self.id = fake, id

    def __enter__(self) -> FakeDevice:
        self.fake.device_stack.append(self.id)
        return self

    def __exit__(self, *exc: object) -> None:
        self.fake.device_stack.pop()


class FakeStream:
    def __init__(self, fake: FakeCupy, ptr: int) -> None:
        self.fake, self.ptr = fake, ptr

    def synchronize(self) -> None:
        self.fake.log.append(("sync", self.ptr, self.fake.device_stack[-1]))


class FakePointer:
    def __init__(self, array: FakeArray) -> None:
        self.array, self.ptr = array, array.ctypes.data

    def copy_to_host_async(self, mem: ctypes.c_void_p, size: int, stream: FakeStream) -> None:
        self.array.fake.check_device(self.array)
        ctypes.memmove(mem.value, self.ptr, size)
        self.array.fake.log.append(("d2h", stream.ptr, size))

    def copy_from_host_async(self, mem: ctypes.c_void_p, size: int, stream: FakeStream) -> None:
        self.array.fake.check_device(self.array)
        ctypes.memmove(self.ptr, mem.value, size)
        self.array.fake.log.append(("h2d", stream.ptr, size))


class FakeArray(np.ndarray):
    """A "CuPy array": numpy memory standing for device memory, `.data` a device pointer."""

    def __array_finalize__(self, obj: object) -> None:
        self.fake = getattr(obj, "fake", None)
        self.device_id = getattr(obj, "device_id", 0)

    @property
    def data(self) -> FakePointer:  # type: ignore[override]
        return FakePointer(self)

    @property
    def device(self) -> FakeDevice:  # type: ignore[override]
        return FakeDevice(self.fake, self.device_id)


class FakeCupy:
    """The `cupy` module's few names staging uses, and the log of what it did."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.allocations: list[int] = []
        self.device_stack = [0]
        self.current = {0: FakeStream(self, 0), 1: FakeStream(self, 0)}  # the null streams
        self.device_count = 1
        self.module = types.ModuleType("cupy")
        self.module.ndarray = FakeArray
        self.module.cuda = types.SimpleNamespace(
            get_current_stream=lambda: self.current[self.device_stack[-1]],
            alloc_pinned_memory=self._alloc,
            runtime=types.SimpleNamespace(getDeviceCount=lambda: self.device_count),
        )

    def _alloc(self, nbytes: int) -> bytearray:
        self.allocations.append(nbytes)
        return bytearray(nbytes)

    def check_device(self, array: FakeArray) -> None:
        assert self.device_stack[-1] == array.device_id, "copy issued on the wrong device"

    def array(self, values: object, dtype: object = None, device: int = 0) -> FakeArray:
        result = np.array(values, dtype=dtype).view(FakeArray)
        result.fake, result.device_id = self, device
        return result

    def ops(self) -> list[str]:
        return [entry[0] for entry in self.log]


@pytest.fixture
def fake(monkeypatch):
    f = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", f.module)
    return f


# -- without CuPy --------------------------------------------------------------------------


def test_import_does_not_import_cupy():
    code = (
        "import sys, distcomm.gpu.staging as s, numpy; "
        "assert not s.is_cupy_array(numpy.zeros(1)); "
        "assert 'cupy' not in sys.modules, 'staging imported cupy'"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=root)


def test_is_cupy_array_false_without_cupy(monkeypatch):
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    impostor = type("ndarray", (), {"__module__": "cupy"})()
    for obj in (np.zeros(3), [1, 2], None, 1.0, impostor, memoryview(b"x")):
        assert not is_cupy_array(obj)
    assert "cupy" not in sys.modules


def test_is_cupy_array_with_cupy_loaded(fake):
    assert is_cupy_array(fake.array([1, 2]))
    assert not is_cupy_array(np.zeros(2))


def test_import_cupy_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(BackendUnavailableError, match="pip install cupy") as info:
        import_cupy()
    assert isinstance(info.value, ImportError)


def test_import_cupy_without_a_device(fake):
    fake.device_count = 0
    with pytest.raises(BackendUnavailableError, match="no device"):
        import_cupy()
    with pytest.raises(BackendUnavailableError, match="no device"):
        HostStaging().to_host(fake.array([1.0]), 0)


def test_import_cupy_driver_error(fake):
    def no_driver() -> int:
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    fake.module.cuda.runtime.getDeviceCount = no_driver
    with pytest.raises(BackendUnavailableError, match=r"no usable device.*cudaErrorNoDevice"):
        import_cupy()


def test_arguments_are_checked(fake):
    staging = HostStaging()
    with pytest.raises(TypeError, match=r"must be a cupy\.ndarray, got numpy\.ndarray"):
        staging.to_host(np.zeros(4), 0)
    strided = fake.array(np.arange(8.0))[::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        staging.to_host(strided, 0)
    array = fake.array(np.arange(4.0))
    with pytest.raises(ValueError, match="3 elements but the CuPy array has 4"):
        staging.to_device(np.zeros(3), array)
    with pytest.raises(TypeError, match="dtype float64"):
        staging.to_device(np.zeros(4, np.float32), array)
    with pytest.raises(ValueError, match="C-contiguous"):
        staging.to_device(np.zeros(8)[::2], array)
    with pytest.raises(ValueError, match=r"inputs\[1\] must be C-contiguous"):
        run_staged(lambda *a: None, [array], [array, strided], staging)
    assert fake.log == []  # nothing was copied


# -- the logic, against the stand-in ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", [0, 1, 1000])
def test_fake_round_trip(fake, dtype, size):
    staging = HostStaging()
    values = (np.arange(size) % 7).astype(dtype)
    array = fake.array(values.reshape(-1, 1) if size else values)
    host = staging.to_host(array, 0)
    assert host.shape == (size,) and host.dtype == dtype and host.flags.c_contiguous
    np.testing.assert_array_equal(host, values)
    host[...] = values[::-1]
    staging.to_device(host, array)
    np.testing.assert_array_equal(np.asarray(array).reshape(-1), values[::-1])
    assert fake.ops() == (["d2h", "sync", "h2d", "sync"] if size else [])


def test_fake_copy_false_copies_nothing(fake):
    host = HostStaging().to_host(fake.array(np.arange(5.0)), 0, copy=False)
    assert host.shape == (5,) and fake.log == []


def test_fake_buffers_are_reused_and_grown(fake):
    staging = HostStaging()
    small, other = fake.array(np.ones(10)), fake.array(np.ones(20, np.int32))
    first = staging.to_host(small, 0)
    again = staging.to_host(other, 0)
    assert again.ctypes.data == first.ctypes.data
    assert fake.allocations == [HostStaging.MIN_BYTES]
    staging.to_host(small, 1)
    assert fake.allocations == [HostStaging.MIN_BYTES] * 2
    big = fake.array(np.ones(HostStaging.MIN_BYTES // 8 + 1))  # one element too many
    staging.to_host(big, 0)
    assert fake.allocations[-1] == 2 * HostStaging.MIN_BYTES
    assert staging.to_host(small, 0).ctypes.data == staging.buffer(0, 1).ctypes.data
    staging.clear()
    staging.to_host(small, 0)
    assert len(fake.allocations) == 4


def test_fake_in_place_views_share_host_memory(fake):
    # an all_reduce as the backend sees it: output and input are distinct flat views
    array = fake.array(np.arange(12.0).reshape(3, 4))
    seen = []

    def op(out: np.ndarray, inp: np.ndarray) -> str:
        seen.append(np.shares_memory(out, inp) and out.ctypes.data == inp.ctypes.data)
        np.testing.assert_array_equal(inp, np.arange(12.0))
        out *= 2
        return "done"

    result = run_staged(op, [array.reshape(-1)], [array.reshape(-1)], HostStaging())
    assert result == "done" and seen == [True]
    np.testing.assert_array_equal(np.asarray(array).reshape(-1), np.arange(12.0) * 2)
    assert fake.ops() == ["d2h", "sync", "h2d", "sync"]  # one copy each way


def test_fake_in_place_all_gather(fake):
    n, world, rank = 3, 4, 1
    output = fake.array(np.zeros(n * world, np.int64))
    input = output[rank * n : (rank + 1) * n]
    input[...] = 7

    def gather(out: np.ndarray, inp: np.ndarray) -> None:
        assert inp.ctypes.data == out.ctypes.data + rank * n * 8
        np.testing.assert_array_equal(inp, [7, 7, 7])
        out[...] = np.arange(n * world)

    run_staged(gather, [output], [input], HostStaging())
    np.testing.assert_array_equal(np.asarray(output), np.arange(n * world))
    assert fake.log[0] == ("d2h", 0, n * 8)  # only the input's bytes go in


def test_fake_in_place_reduce_scatter(fake):
    n, world, rank = 2, 3, 2
    input = fake.array(np.arange(n * world, dtype=np.float32))
    output = input[rank * n : (rank + 1) * n]

    def reduce_scatter(out: np.ndarray, inp: np.ndarray) -> None:
        out[...] = inp.reshape(world, n).sum(axis=0)

    run_staged(reduce_scatter, [output], [input], HostStaging())
    expected = np.arange(n * world, dtype=np.float32)
    expected[rank * n :] = [6.0, 9.0]
    np.testing.assert_array_equal(np.asarray(input), expected)
    assert fake.log[2] == ("h2d", 0, n * 4)  # only the output's bytes come back


def test_fake_none_and_separate_arrays(fake):
    staging = HostStaging()
    input, output = fake.array([1.0, 2.0]), fake.array([9.0, 9.0, 9.0, 9.0])

    def gather_at_non_root(out: None, inp: np.ndarray) -> None:
        assert out is None
        inp += 1  # an input the op does not return: not copied back

    run_staged(gather_at_non_root, [None], [input], staging)
    np.testing.assert_array_equal(np.asarray(input), [1.0, 2.0])
    assert fake.ops() == ["d2h", "sync"]

    fake.log.clear()

    def scatter_at_non_root(out: np.ndarray, inp: None) -> None:
        assert inp is None and not np.shares_memory(out, input)
        out[...] = [1, 2, 3, 4]

    run_staged(scatter_at_non_root, [output], [None], staging)
    np.testing.assert_array_equal(np.asarray(output), [1, 2, 3, 4])
    assert fake.ops() == ["h2d", "sync"]  # a pure output is not copied in

    fake.log.clear()
    assert run_staged(lambda: 5, [], [], staging) == 5


def test_fake_failure_leaves_outputs_alone(fake):
    array = fake.array([1, 2, 3])

    def failing(out: np.ndarray, inp: np.ndarray) -> None:
        out[...] = 0
        raise RuntimeError("peer died")

    with pytest.raises(RuntimeError, match="peer died"):
        run_staged(failing, [array], [array], HostStaging())
    np.testing.assert_array_equal(np.asarray(array), [1, 2, 3])
    assert "h2d" not in fake.ops()


def test_fake_streams(fake):
    staging = HostStaging()
    array = fake.array(np.arange(4.0))
    fake.current[0] = FakeStream(fake, 77)  # the caller's current stream
    staging.to_host(array, 0)
    assert fake.log == [("d2h", 77, 32), ("sync", 77, 0)]
    assert current_stream(array).ptr == 77
    assert current_stream(array[::2]).ptr == 77  # any layout
    with pytest.raises(TypeError, match=r"cupy\.ndarray"):
        current_stream(np.zeros(2))

    fake.log.clear()
    given = FakeStream(fake, 5)
    run_staged(lambda o, i: None, [array], [array], staging, stream=given)
    assert fake.log == [("d2h", 5, 32), ("sync", 5, 0), ("h2d", 5, 32), ("sync", 5, 0)]


def test_fake_arrays_on_two_devices(fake):
    # each device's null stream is synchronised with that device current
    a, b = fake.array([1.0, 2.0], device=0), fake.array([3.0, 4.0], device=1)
    run_staged(lambda out, inp: None, [a], [b], HostStaging())
    assert fake.log == [("d2h", 0, 16), ("sync", 0, 1), ("h2d", 0, 16), ("sync", 0, 0)]


# -- on a GPU ---------------------------------------------------------------------------------


@pytest.fixture
def cupy():
    """The real CuPy module with a device; skip (or fail, DISTCOMM_TEST_REQUIRE_GPU=1) if not."""
    try:
        return import_cupy()
    except BackendUnavailableError as exc:
        if os.environ.get("DISTCOMM_TEST_REQUIRE_GPU") == "1":
            pytest.fail(f"DISTCOMM_TEST_REQUIRE_GPU=1 but {exc}")
        pytest.skip(str(exc))


def _pinned(cupy, host: np.ndarray) -> bool:
    attrs = cupy.cuda.runtime.pointerGetAttributes(host.ctypes.data)
    kind = getattr(attrs, "type", getattr(attrs, "memoryType", None))  # by CuPy version
    return kind == 1  # cudaMemoryTypeHost: page-locked host memory


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", [0, 1, 1000, (1 << 20) + 3])
def test_gpu_round_trip(cupy, dtype, size):
    rng = np.random.default_rng(size)
    values = (rng.integers(0, 100, size) % (2 if dtype == np.bool_ else 100)).astype(dtype)
    array = cupy.asarray(values.reshape(-1, 1) if size else values)
    staging = HostStaging()
    host = staging.to_host(array, 0)
    assert host.shape == (size,) and host.dtype == dtype
    np.testing.assert_array_equal(host, values)
    if size:
        assert _pinned(cupy, host)
    host[...] = values[::-1]
    staging.to_device(host, array)
    np.testing.assert_array_equal(cupy.asnumpy(array).reshape(-1), values[::-1])


def test_gpu_buffer_reuse(cupy):
    staging = HostStaging()
    a, b = cupy.arange(100, dtype=cupy.float32), cupy.arange(50, dtype=cupy.int64)
    first = staging.to_host(a, 0)
    second = staging.to_host(b, 0)
    assert second.ctypes.data == first.ctypes.data
    np.testing.assert_array_equal(second, np.arange(50))
    assert staging.to_host(a, 1).ctypes.data != first.ctypes.data
    staging.clear()


def test_gpu_in_place_aliasing(cupy):
    staging = HostStaging()
    array = cupy.arange(12, dtype=cupy.float64).reshape(3, 4)

    def all_reduce(out: np.ndarray, inp: np.ndarray) -> None:
        assert out.ctypes.data == inp.ctypes.data
        out *= 3

    run_staged(all_reduce, [array.reshape(-1)], [array.reshape(-1)], staging)
    np.testing.assert_array_equal(cupy.asnumpy(array).reshape(-1), np.arange(12.0) * 3)

    n, world, rank = 1000, 4, 2
    output = cupy.zeros(n * world, dtype=cupy.int32)
    output[rank * n : (rank + 1) * n] = 7

    def all_gather(out: np.ndarray, inp: np.ndarray) -> None:
        assert inp.ctypes.data == out.ctypes.data + rank * n * 4
        np.testing.assert_array_equal(inp, 7)
        out[...] = np.arange(n * world)

    run_staged(all_gather, [output], [output[rank * n : (rank + 1) * n]], staging)
    np.testing.assert_array_equal(cupy.asnumpy(output), np.arange(n * world))

    source = cupy.arange(n * world, dtype=cupy.float32)

    def reduce_scatter(out: np.ndarray, inp: np.ndarray) -> None:
        out[...] = inp.reshape(world, n).sum(axis=0)

    run_staged(reduce_scatter, [source[rank * n : (rank + 1) * n]], [source], staging)
    expected = np.arange(n * world, dtype=np.float32)
    expected[rank * n : (rank + 1) * n] = expected.reshape(world, n).sum(axis=0)
    np.testing.assert_array_equal(cupy.asnumpy(source), expected)


def _produce_on(cupy, stream, rounds: int = 200):
    """Queue `rounds` kernels on `stream` (long enough for the host to run ahead)."""
    with stream:
        x = cupy.zeros(1 << 22, dtype=cupy.float32)
        for _ in range(rounds):
            x += 1
    return x


def test_gpu_stream_ordering(cupy):
    staging = HostStaging()
    stream = cupy.cuda.Stream(non_blocking=True)
    x = _produce_on(cupy, stream)
    with stream:  # the producer's stream is current: to_host waits for it
        host = staging.to_host(x, 0)
    np.testing.assert_array_equal(host, 200)

    y = _produce_on(cupy, stream)
    with stream:
        captured = current_stream(y)  # captured at issue, as an async op would
    with ThreadPoolExecutor(1) as worker:  # the thread an async op runs on
        host = worker.submit(lambda: staging.to_host(y, 1, stream=captured).copy())
        np.testing.assert_array_equal(host.result(timeout=60), 200)

    # the result is on the device when run_staged returns, for any later stream
    z = _produce_on(cupy, stream)
    with stream:
        run_staged(lambda out, inp: np.add(out, 1, out=out), [z], [z], staging)
    reader = cupy.cuda.Stream(non_blocking=True)
    with reader:
        assert bool((z == 201).all())


def test_gpu_current_stream(cupy):
    stream = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(4)
    with stream:
        assert current_stream(x).ptr == stream.ptr
    assert current_stream(x).ptr == cupy.cuda.get_current_stream().ptr
