"""The GPU path where processes meet CUDA, on the CUDA stand-in (tests/cuda_standin.py):
CUDA IPC handles passed on by a process that received them, availability probes that
leave CUDA uninitialised for `os.fork`, and a CUDA-aware MPI that reads and writes CuPy
arrays only after the streams that produce them ran (real mpi4py under mpiexec).

Stand-in processes: `distcomm.gpu.ipc` keeps per-process state (the mappings it opened,
the arrays it sent) and asks `os.getpid()`, so each stand-in process of a test gets a
copy of that module of its own, with its own process id, and makes its calls inside
`standin.as_process(name)`.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import json
import os
import pickle
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import distcomm as dist
from distcomm.backends.nccl import NcclBackend
from distcomm.backends.spec import parse_backend
from distcomm.errors import BackendUnavailableError
from distcomm.gpu import ipc, runtime
from tests.cuda_standin import CUDADriverError, CUDARuntimeError, CudaStandin
from tests.mpijobs import LAUNCHER, SKIP_REASON, job_env, run

pytestmark = pytest.mark.timeout(120)

INIT_ERROR = "cudaErrorInitializationError: initialization error"


@pytest.fixture
def cuda(monkeypatch):
    """The stand-in installed as `cupy` (4 fake GPUs); fails the test on misuse."""
    standin = CudaStandin(device_count=4).install(monkeypatch)
    monkeypatch.setattr(runtime, "_chosen", None)
    for name in ("LOCAL_RANK", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    yield standin
    assert not standin.violations, f"misuse of the CUDA stand-in: {standin.violations}"


# -- CUDA IPC ------------------------------------------------------------------------------


class _ProcessOs:
    """`os` as a stand-in process sees it: its own process id."""

    def __init__(self, pid: int) -> None:
        self._pid = pid

    def getpid(self) -> int:
        return self._pid

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


class _Process:
    """A stand-in process: its own `distcomm.gpu.ipc` (per-process state) and pid."""

    def __init__(self, cuda: CudaStandin, name: str, pid: int) -> None:
        spec = importlib.util.spec_from_file_location(f"distcomm.gpu._ipc_{name}", ipc.__file__)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.os = _ProcessOs(pid)
        module._get_address_range = cuda.libcuda.cuMemGetAddressRange_v2  # ctypes' libcuda
        self.ipc, self.cuda, self.name = module, cuda, name

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self.cuda.as_process(self.name):
            return fn(*args)

    def send(self, array: Any) -> tuple[Any, tuple]:
        """What ForkingPickler sends for `array`: the rebuild function and its arguments."""
        rebuild, args = self.run(self.ipc.reduce_cupy_array, array)
        return rebuild.__name__, pickle.loads(pickle.dumps(args))

    def receive(self, sent: tuple[str, tuple]) -> Any:
        name, args = sent
        return self.run(getattr(self.ipc, name), *args)


def _address_range(cuda: CudaStandin, ptr: int) -> tuple[int, int, int]:
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = cuda.libcuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
    return status, base.value, size.value


def test_standin_ipc_handles_name_an_allocation_of_the_exporting_process(cuda):
    rt = cuda.runtime
    with cuda.as_process("A"):
        x = cuda.cupy.arange(8, dtype=np.float32)
        handle = rt.ipcGetMemHandle(x[2:].data.ptr)  # the whole allocation's
        assert isinstance(handle, bytes) and len(handle) == 64
        assert rt.ipcGetMemHandle(x.data.ptr) == handle
        assert _address_range(cuda, x[2:].data.ptr) == (0, x.data.ptr, 32)
        with pytest.raises(CUDARuntimeError, match="cudaErrorDeviceUninitialized: invalid device"):
            rt.ipcOpenMemHandle(handle)  # CUDA cannot open a handle where it was made
    with cuda.as_process("B"):
        assert _address_range(cuda, x.data.ptr)[0] == 500  # another process's pointer
        with pytest.raises(CUDARuntimeError, match="cudaErrorInvalidValue"):
            rt.ipcGetMemHandle(x.data.ptr)
        with pytest.raises(TypeError):
            rt.ipcOpenMemHandle(bytearray(handle))
        ptr = rt.ipcOpenMemHandle(handle)
        assert _address_range(cuda, ptr + 8) == (0, ptr, 32)
        with pytest.raises(CUDARuntimeError, match="cudaErrorInvalidValue: invalid argument"):
            rt.ipcGetMemHandle(ptr + 8)  # mapped memory cannot be exported again
        with pytest.raises(CUDARuntimeError, match="cudaErrorInvalidValue"):
            rt.ipcOpenMemHandle(handle)  # once per process
        memory = cuda.cuda.UnownedMemory(ptr, 32, None, 0)
        view = cuda.cupy.ndarray((3,), np.float32, memptr=cuda.cuda.MemoryPointer(memory, 8))
        np.testing.assert_array_equal(view.get(), [2, 3, 4])
        assert view.base is None and view[1:].base is view
        rt.ipcCloseMemHandle(ptr)
        with pytest.raises(CUDARuntimeError, match="cudaErrorInvalidValue"):
            rt.ipcCloseMemHandle(ptr)
        assert _address_range(cuda, ptr)[0] == 500
        with pytest.raises(CUDARuntimeError, match="cudaErrorInvalidValue"):
            rt.ipcOpenMemHandle(b"\0" * 64)
    with cuda.as_process("A"):
        y = cuda.cupy.zeros(4)
        freed = rt.ipcGetMemHandle(y.data.ptr)
    del y
    gc.collect()
    with cuda.as_process("B"), pytest.raises(CUDARuntimeError, match="cudaErrorInvalidValue"):
        rt.ipcOpenMemHandle(freed)


def test_an_array_received_over_ipc_is_sent_on_as_the_original_handle(cuda):
    a, b, c = (_Process(cuda, name, 9000 + i) for i, name in enumerate("ABC"))
    with cuda.as_process("A"):
        x = cuda.cupy.arange(12, dtype=np.float32).reshape(3, 4)
    y = b.receive(a.send(x))
    np.testing.assert_array_equal(y.get(), x.get())
    # B passes on what it received: CUDA refuses to export B's mapping, so the original
    # handle goes, with the view's offset in A's allocation
    z = c.receive(b.send(y[1:]))
    np.testing.assert_array_equal(z.get(), x.get()[1:])
    opened = cuda.calls("ipcOpenMemHandle")
    assert [call.args["process"] for call in opened] == ["B", "C"]
    assert opened[0].args["handle"] == opened[1].args["handle"]
    # A gets a view of its own allocation back
    back = a.receive(b.send(y[:, ::2]))
    np.testing.assert_array_equal(back.get(), x.get()[:, ::2])
    assert back.data.ptr == x.data.ptr and len(cuda.calls("ipcOpenMemHandle")) == 2
    with cuda.as_process("A"):
        x[...] = -1
    np.testing.assert_array_equal(z.get(), np.full((2, 4), -1, np.float32))  # shared memory


# -- CUDA initialisation and fork ----------------------------------------------------------


def _in_child(fn: Callable[[], Any]) -> Any:
    """`fn()` in a child made by os.fork(); its result (or its error's text) comes back."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's clean-up
        try:
            os.close(read)
            try:
                result: Any = fn()
            except BaseException as exc:
                result = f"raised {type(exc).__name__}: {exc}"
            os.write(write, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(text)


def _cuda_calls(cuda: CudaStandin) -> list[str]:
    """Each CUDA call's outcome in this process."""
    outcomes = []
    for call in (
        cuda.runtime.getDeviceCount,
        lambda: cuda.runtime.setDevice(1),
        lambda: cuda.cupy.empty(2),
        cuda.cuda.Stream,
        lambda: cuda.runtime.deviceGetPCIBusId(0),
    ):
        try:
            call()
            outcomes.append("ok")
        except CUDARuntimeError as exc:
            outcomes.append(str(exc))
    try:
        cuda.driver.ctxGetCurrent()
        outcomes.append("ok")
    except CUDADriverError as exc:
        outcomes.append(f"status {exc.status}")
    return outcomes


def test_standin_cuda_initialisation_is_visible_to_fork(cuda):
    with pytest.raises(CUDADriverError) as info:
        cuda.driver.ctxGetCurrent()  # asking never initialises
    assert info.value.status == 3 and not cuda.cuda_initialized
    # a child forked before CUDA was initialised can use it
    assert _in_child(lambda: _cuda_calls(cuda)) == ["ok"] * 6
    assert not cuda.cuda_initialized
    cuda.runtime.getDeviceCount()
    assert cuda.cuda_initialized
    assert isinstance(cuda.driver.ctxGetCurrent(), int)  # answers now (0: no context bound)
    # one forked after cannot, and its driver answers "not initialised"
    assert _in_child(lambda: _cuda_calls(cuda)) == [INIT_ERROR] * 5 + ["status 3"]
    assert _cuda_calls(cuda) == ["ok"] * 6  # the parent still can


def test_availability_probes_leave_cuda_uninitialised_for_fork(cuda, monkeypatch):
    monkeypatch.setattr(runtime, "_nvml_device_count", lambda: 4, raising=False)
    assert dist.is_nccl_available()
    assert not cuda.cuda_initialized, "is_nccl_available() initialised CUDA"
    assert NcclBackend.is_available() and NcclBackend.unavailable_reason() == ""
    assert parse_backend(None) == {"cpu": "gloo", "cuda": "nccl"}
    assert not cuda.cuda_initialized, "the probes or the default backend initialised CUDA"
    # so a worker forked now can use CUDA
    assert _in_child(lambda: _cuda_calls(cuda)) == ["ok"] * 6


def test_default_cuda_backend_looks_for_a_gpu_without_initialising_cuda(cuda, monkeypatch):
    listed: list[int | None] = [None]  # what NVML says: None where there is no driver
    monkeypatch.setattr(runtime, "_nvml_device_count", lambda: listed[0])
    assert parse_backend(None)["cuda"] == "gloo"  # no NVIDIA driver: no GPU
    listed[0] = 0
    assert parse_backend(None)["cuda"] == "gloo"
    listed[0] = 2
    assert parse_backend(None)["cuda"] == "nccl"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert parse_backend(None)["cuda"] == "gloo"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,0")  # CUDA stops at the invalid entry
    assert parse_backend(None)["cuda"] == "gloo"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert parse_backend(None)["cuda"] == "nccl"
    assert not cuda.cuda_initialized
    # where CUDA is initialised already, asking it costs nothing more
    cuda.runtime.getDeviceCount()
    listed[0] = None
    assert parse_backend(None)["cuda"] == "nccl"
    cuda.device_count = 0
    assert parse_backend(None)["cuda"] == "gloo"


def test_a_missing_gpu_is_reported_when_the_nccl_backend_is_made(cuda):
    cuda.device_count = 0
    assert NcclBackend.is_available()  # NCCL is there; the probe does not ask CUDA
    with pytest.raises(BackendUnavailableError, match="no device"):
        NcclBackend(dist.PrefixStore("nccl", dist.HashStore()), 0, 1, 10.0, "g")


def test_device_count_without_nvml_is_cudas(cuda, monkeypatch):
    monkeypatch.setattr(runtime, "_nvml_device_count", lambda: None, raising=False)
    assert runtime.device_count() == 4 and cuda.cuda_initialized  # documented: it asks CUDA


# -- a CUDA-aware MPI ------------------------------------------------------------------------


def test_standin_arrays_export_the_cuda_array_interface(cuda):
    cuda.runtime.setDevice(0)  # this thread uses GPUs 0 and 1
    with cuda.cuda.Device(1):
        stream = cuda.cuda.Stream()
        x = cuda.cupy.arange(12, dtype=np.float32).reshape(3, 4)
        with stream:
            face = x.__cuda_array_interface__
        assert x.__cuda_array_interface__["stream"] == 1  # the legacy null stream
    assert face == {
        "shape": (3, 4),
        "typestr": "<f4",
        "descr": [("", "<f4")],
        "data": (x.data.ptr, False),
        "strides": None,
        "version": 3,
        "stream": stream.ptr,
    }
    view = x[:, 1:]
    assert view.__cuda_array_interface__["strides"] == (16, 4)
    assert view.__cuda_array_interface__["data"][0] == x.data.ptr + 4


_MPI_JOB = """
import json
import sys
import threading

import numpy as np

from tests.cuda_standin import CudaStandin

cuda = CudaStandin(device_count=2)
sys.modules.update(cuda.modules())

import distcomm as dist
from distcomm.backends import mpi as mpi_backend
from distcomm.backends.mpi import MpiBackend
from distcomm.backends.staged import StagedBackend
from mpi4py import MPI

# as a CUDA-aware MPI says it is: the stand-in's device memory is host memory MPI can reach
mpi_backend._cuda_aware = lambda MPI: True
backend = MpiBackend(dist.HashStore(), MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size, 60.0, "g")
group = StagedBackend(backend)  # what a group serves CuPy arrays with
rank = backend.rank
cuda.cuda.Device(1).use()  # this thread uses GPUs 1 and 0; 0 is current
cuda.cuda.Device(0).use()


def late(value, shape=4):
    # an array on GPU 1 whose value a kernel writes on this thread's current stream of
    # GPU 1, which is paused: the kernel has not run when the op starts; GPU 0 is current
    with cuda.cuda.Device(1):
        stream = cuda.cuda.Stream()
        stream.use()
        array = cuda.cupy.empty(shape, np.float32)
        cuda.pause(stream)
        array[...] = value
    return array, stream


def resumed_when_waited_for(stream):
    # resume `stream` once someone waits for it, or once the op ended without waiting
    ended = threading.Event()

    def watch():
        while not ended.wait(0.01):
            if any(c.args.get("stream") == stream.ptr for c in cuda.calls("Stream.synchronize")):
                break
        cuda.resume(stream)

    thread = threading.Thread(target=watch)
    thread.start()

    def end():
        ended.set()
        thread.join()

    return end


def values(array):
    with cuda.cuda.Device(array.device.id):
        return array.get().tolist()


out = {"rank": rank}
SCENARIOS
out["violations"] = cuda.violations
with open(f"{sys.argv[1]}/result-{rank}.json", "w") as file:
    json.dump(out, file)
backend.shutdown()
"""


def _mpi_job(tmp_path: Path, scenarios: str, n: int = 2) -> list[dict]:
    if LAUNCHER is None:
        pytest.skip(f"needs mpi4py and mpiexec: {SKIP_REASON}")
    body = textwrap.dedent(_MPI_JOB).replace("SCENARIOS", textwrap.dedent(scenarios))
    script = tmp_path / "job.py"
    script.write_text(body)
    command = LAUNCHER.command(n, sys.executable, str(script), str(tmp_path))
    done = run(command, env=job_env(), timeout=90)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = [json.loads(path.read_text()) for path in tmp_path.glob("result-*.json")]
    assert len(results) == n, done.stdout[-4000:] + done.stderr[-4000:]
    for result in results:
        assert not result["violations"], result
    return sorted(results, key=lambda r: r["rank"])


def test_cuda_aware_mpi_collectives_wait_for_the_arrays_own_device(tmp_path):
    results = _mpi_job(
        tmp_path,
        """
        x, stream = late(rank + 1.0)
        end = resumed_when_waited_for(stream)
        group.all_reduce(x, dist.ReduceOp.SUM)
        end()
        out["all_reduce"] = values(x)

        y, stream = late(5.0 if rank == 0 else 0.0)
        end = resumed_when_waited_for(stream)
        group.broadcast(y, 0)
        end()
        out["broadcast"] = values(y)
        """,
    )
    for result in results:
        assert result["all_reduce"] == [3.0] * 4, result
        assert result["broadcast"] == [5.0] * 4, result


def test_cuda_aware_mpi_point_to_point_waits_for_the_arrays_stream(tmp_path):
    results = _mpi_job(
        tmp_path,
        """
        if rank == 0:
            x, stream = late(7.0)  # the kernel writing what is sent has not run yet
            end = resumed_when_waited_for(stream)
            group.send(x, 1, 3).wait()
            end()
        else:
            # a kernel queued before the receive, writing the buffer, has not run yet: it
            # must run before MPI writes the message, not after
            y, stream = late(-1.0)
            end = resumed_when_waited_for(stream)
            group.recv(y, 0, 3).wait()
            end()
            out["received"] = values(y)
        """,
    )
    assert results[1]["received"] == [7.0] * 4, results


def test_cuda_aware_mpi_gathers_cupy_arrays(tmp_path):
    # numpy's overlap check refuses CuPy arrays; the device addresses are compared instead
    results = _mpi_job(
        tmp_path,
        """
        with cuda.cuda.Device(1):
            output = cuda.cupy.zeros(8, np.float32)
            mine = cuda.cupy.full(4, rank + 1.0, np.float32)
            in_place = cuda.cupy.zeros(8, np.float32)
            in_place[rank * 4 : rank * 4 + 4] = rank + 1.0
            into = cuda.cupy.zeros(4, np.float32)
            scattered = cuda.cupy.arange(8, dtype=np.float32)
        group.all_gather(output, mine)
        group.all_gather(in_place, in_place[rank * 4 : rank * 4 + 4])
        group.reduce_scatter(into, scattered, dist.ReduceOp.AVG)
        out["gathered"] = values(output)
        out["in_place"] = values(in_place)
        out["averaged"] = values(into)
        """,
    )
    for result in results:
        assert result["gathered"] == [1.0] * 4 + [2.0] * 4, result
        assert result["in_place"] == [1.0] * 4 + [2.0] * 4, result
        expected = [0.0, 1.0, 2.0, 3.0] if result["rank"] == 0 else [4.0, 5.0, 6.0, 7.0]
        assert result["averaged"] == expected, result


def test_mpi_buffer_of_a_standin_array_is_its_device_memory(tmp_path):
    results = _mpi_job(
        tmp_path,
        """
        with cuda.cuda.Device(1):
            a = cuda.cupy.arange(6, dtype=np.int64)
        view = MPI.buffer.frombuffer(a) if hasattr(MPI, "buffer") else MPI.memory.frombuffer(a)
        out["buffer"] = [view.address == a.data.ptr, view.nbytes == a.nbytes]
        """,
        n=1,
    )
    assert results[0]["buffer"] == [True, True]
