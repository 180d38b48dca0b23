"""A first run's mistakes fail at once and say what to fix, instead of waiting in silence.

Ranks started with different world sizes, the same rank twice, or different backends fail
every rank at once, naming both sides; a set-up wait for a rank that does not come says
which rank while it waits and when it gives up, never only an internal key; a store
client pointed at a port another program holds says so. A script run with plain
`python` says how to start it; the tutorial's `init_process_group("mpi", rank=0,
world_size=0)` warns as torch does and runs; `nccl` on a host without a GPU says so
rather than to install CuPy.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import distcomm as dist
from distcomm.backends.engine.shm.setup import same_host_setup
from distcomm.deadline import Deadline
from distcomm.rendezvous import rendezvous
from distcomm.store import HashStore, PrefixStore, TCPStore
from distcomm.store.ranks import wait_for_ranks
from tests.harness import run_ranks
from tests.mpijobs import (  # noqa: F401 - the fixture checks the MPI job's /dev/shm
    LAUNCHER,
    SKIP_REASON,
    job_env,
    no_mpi_segment_left,
    run,
)
from tests.processes import free_port

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(180)

INIT_TIMEOUT = 20.0  # a hang shows as a timeout error, not as a passing test


def _init(backend: str = "gloo") -> tuple[str, str]:
    """init_process_group from the environment: ("ok", "") or (error type, message)."""
    backend = os.environ.get("TEST_BACKEND", backend)
    try:
        dist.init_process_group(backend, timeout=INIT_TIMEOUT)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    dist.destroy_process_group()
    return "ok", ""


def _init_rank1_last() -> tuple[str, str]:
    """`_init`, on rank 1 once the join's outcome is in the store: it comes last."""
    if os.environ["RANK"] == "1":
        probe = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=30)
        try:
            probe.wait(["distcomm/rendezvous/joined/outcome"])
        finally:
            probe.close()
    return _init()


def _sizes(sizes: dict[int, int], **more: str):
    return lambda rank: {"WORLD_SIZE": str(sizes[rank]), **more}


def test_a_rank_with_another_world_size_fails_every_rank_at_once():
    port = str(free_port())
    results = run_ranks(
        _init, 3, timeout=120, env={"MASTER_PORT": port}, rank_env=_sizes({0: 3, 1: 2, 2: 3})
    )
    for kind, message in results:
        assert kind == "ValueError", results
        assert (
            "rank 1 was started with world size 2 (from WORLD_SIZE (torch style)), but "
            "rank 0 with world size 3 (from WORLD_SIZE (torch style)): set the same "
            "WORLD_SIZE on every rank"
        ) in message, results
        assert "distcomm/" not in message, results  # no internal key
    assert [message.split("]")[0] for _, message in results] == [
        "[rank 0/3",
        "[rank 1/2",
        "[rank 2/3",
    ]


def test_an_extra_rank_with_a_larger_world_size_is_named_to_every_rank():
    # ranks 0 and 1 are a job of two; a third process thinks the job has three. Rank 1
    # comes last, after the third was refused: it learns why too, not "missing rank 2"
    port = str(free_port())
    results = run_ranks(
        _init_rank1_last,
        3,
        timeout=120,
        env={"MASTER_PORT": port},
        rank_env=_sizes({0: 2, 1: 2, 2: 3}),
    )
    for kind, message in results:
        assert kind == "ValueError", results
        assert (
            "rank 2 was started with world size 3 (from WORLD_SIZE (torch style)), but "
            "rank 0 with world size 2"
        ) in message, results
        assert "missing rank" not in message, results


def test_the_same_rank_twice_fails_every_rank_at_once():
    port = str(free_port())
    results = run_ranks(
        _init,
        3,
        timeout=120,
        env={"MASTER_PORT": port},
        rank_env=lambda r: {"RANK": str(min(r, 1))},
    )
    for kind, message in results:
        assert kind == "ValueError", results
        assert "rank 1 was started twice (pid " in message, results
        assert "give every process its own rank" in message, results


def test_ranks_asking_for_different_backends_fail_at_once():
    port = str(free_port())
    results = run_ranks(
        _init,
        2,
        timeout=120,
        env={"MASTER_PORT": port},
        rank_env=lambda r: {"TEST_BACKEND": "gloo" if r == 0 else "tcp"},
    )
    for kind, message in results:
        assert kind == "ValueError", results
        assert (
            "rank 1 asked for backend 'tcp' ('tcp' for cpu arrays), but rank 0 for "
            "'gloo' ('gloo'): pass the same backend"
        ) in message, results


# -- set-up waits name ranks, not keys ----------------------------------------------------


@pytest.fixture
def server():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=30)
    yield store
    store.close()


@pytest.fixture
def warnings(monkeypatch, caplog):
    monkeypatch.setenv("DISTCOMM_STALL_WARN_S", "0.3")
    caplog.set_level(logging.WARNING)
    return caplog


def _still_waiting(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]


def test_the_shared_memory_setup_names_the_rank_it_waits_for(server, warnings):
    store = PrefixStore("distcomm/0/gloo", server)
    with pytest.raises(dist.DistTimeoutError) as caught:
        same_host_setup(store, 0, 2, Deadline(1.5), "auto", "[rank 0/2] setup on 'gloo'")
    message = str(caught.value)
    assert message.startswith("[rank 0/2] setup on 'gloo': only 1 of 2 ranks"), message
    assert "rank(s) 1 never did" in message and "gloo backend?" in message, message
    assert "distcomm/" not in message and "who" not in message, message
    lines = _still_waiting(warnings)
    assert lines and all("missing rank(s) 1." in line for line in lines), lines
    assert not [r for r in warnings.records if "has waited" in r.getMessage()]  # no raw key


def test_a_wait_whose_ranks_have_all_come_warns_of_no_missing_rank(warnings):
    """Every rank has set its key, but the last has not yet written the step's outcome
    (it is descheduled, say): the wait goes on and names no missing rank, since there is
    none to name; it used to warn 'still waiting ... missing rank(s) none'."""
    store = HashStore()
    keys = {r: f"joined/{r}" for r in range(3)}
    for key in keys.values():
        store.set(key, "here")
    waits = 0
    real_wait = store.wait

    def wait(wanted, timeout=None):
        nonlocal waits
        waits += 1
        if waits == 4:  # three steps of waiting, each long enough for a warning, then done
            store.set("outcome", "ok")
        return real_wait(wanted, timeout)

    store.wait = wait
    wait_for_ranks(
        store,
        keys,
        Deadline(60),
        "[rank 0/3] roll call",
        arrived="joined",
        hint="start them",
        done="outcome",
        warn_after=0.05,
    )
    assert waits == 4
    assert _still_waiting(warnings) == []


# -- a store address held by another program ----------------------------------------------


class _Impostor:
    """A TCP server of another program on a free port: it accepts, then sends `banner`
    and stays silent, closes at once (`close`), or just stays silent."""

    def __init__(self, banner: bytes = b"", close: bool = False) -> None:
        self._banner, self._close = banner, close
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if self._close:
                conn.close()
                continue
            if self._banner:
                conn.sendall(self._banner)
            self._held.append(conn)

    def close(self) -> None:
        self._listener.close()
        for conn in self._held:
            conn.close()


@pytest.fixture
def impostor():
    made: list[_Impostor] = []

    def make(**kwargs) -> _Impostor:
        made.append(_Impostor(**kwargs))
        return made[-1]

    yield make
    for server in made:
        server.close()


def test_a_store_client_says_another_program_sent_something_else(impostor):
    port = impostor(banner=b"SSH-2.0-OpenSSH_9.6\r\n").port
    with pytest.raises(dist.DistNetworkError) as caught:
        TCPStore("127.0.0.1", port, timeout=5)
    message = str(caught.value)
    assert (
        f"what answers at 127.0.0.1:{port} is not a distcomm TCPStore (it sent "
        "b'SSH-2.0-OpenSSH_9.6\\r\\n'"
    ) in message, message
    assert "is another program using this port? Pick another port (MASTER_PORT" in message


def test_a_store_client_says_another_program_closed_at_once(impostor):
    port = impostor(close=True).port
    with pytest.raises(dist.DistNetworkError) as caught:
        TCPStore("127.0.0.1", port, timeout=5)
    message = str(caught.value)
    assert f"what answers at 127.0.0.1:{port} closed the connection without sending" in message
    assert "is another program using this port?" in message, message


def test_a_silent_program_on_the_store_port_is_named_while_and_after_waiting(impostor, warnings):
    port = impostor().port
    with pytest.raises(dist.DistNetworkError) as caught:
        TCPStore("127.0.0.1", port, timeout=1.5)
    message = str(caught.value)
    assert (
        f"what answers at 127.0.0.1:{port} accepted the connection but sent nothing" in message
    ), message
    assert "it is probably not a distcomm TCPStore" in message, message
    assert "is another program using this port?" in message, message
    lines = [r.getMessage() for r in warnings.records if "has not greeted" in r.getMessage()]
    assert len(lines) == 1 and "may be busy, or another program" in lines[0], lines


def test_a_busy_store_that_greets_late_is_still_used(warnings):
    # the server's loop is held up past the warning: the client warns, waits, then works
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10)
    listener = socket.create_server(("127.0.0.1", 0))
    relay_ready = threading.Event()

    def relay() -> None:  # hands the client to the store only after a pause
        conn, _ = listener.accept()
        relay_ready.wait(5)
        upstream = socket.create_connection(("127.0.0.1", server.port))
        for a, b in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    threading.Thread(target=relay, daemon=True).start()
    timer = threading.Timer(1.0, relay_ready.set)
    timer.start()
    try:
        client = TCPStore("127.0.0.1", listener.getsockname()[1], timeout=10)
        client.set("k", "v")
        assert server.get("k") == b"v"
        client.close()
    finally:
        timer.cancel()
        listener.close()
        server.close()
    assert any("has not greeted" in r.getMessage() for r in warnings.records)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def test_c10d_rendezvous_on_a_port_another_program_holds(impostor):
    from distcomm.launch.rendezvous import (
        RendezvousConnectionError,
        RendezvousParameters,
        get_rendezvous_handler,
    )

    port = impostor(banner=b"HTTP/1.1 400 Bad Request\r\n\r\n").port
    params = RendezvousParameters(
        "c10d", f"127.0.0.1:{port}", "job", 1, 1, config={"read_timeout": "5"}
    )
    with pytest.raises(RendezvousConnectionError) as caught:
        get_rendezvous_handler(params)
    message = str(caught.value)
    assert "this agent found the port taken" in message, message
    assert (
        f"what answers at 127.0.0.1:{port} is not a distcomm TCPStore (it sent "
        "b'HTTP/1.1 400 Bad Request"
    ) in message, message
    assert "--rdzv_endpoint" in message, message


# -- the tutorial's MPI recipe --------------------------------------------------------------

_MPI_RECIPE = """
import json, warnings
import numpy as np
import distcomm as dist

rows = {}
for rank, world_size in ((0, 0), (3, 5), (-1, -1)):  # the tutorial's, any, none given
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.init_process_group("mpi", rank=rank, world_size=world_size)
    x = np.full(2, dist.get_rank() + 1.0)
    dist.all_reduce(x)
    rows[f"{rank},{world_size}"] = {
        "warnings": [
            [w.category.__name__, str(w.message), w.filename]
            for w in caught
            if "MPI backend" in str(w.message)
        ],
        "rank": dist.get_rank(),
        "size": dist.get_world_size(),
        "sum": float(x[0]),
    }
    dist.destroy_process_group()
with open(f"{__file__}.{rows['-1,-1']['rank']}", "w") as out:
    json.dump(rows, out)
"""


@pytest.mark.skipif(LAUNCHER is None, reason=f"needs mpiexec and mpi4py: {SKIP_REASON}")
def test_the_tutorials_mpi_recipe_warns_as_torch_does_and_takes_mpis_values(tmp_path):
    """torch's "Writing Distributed Applications" calls init_process_group('mpi', rank=0,
    world_size=0) under mpirun: torch warns that both are ignored and MPI assigns them."""
    script = tmp_path / "recipe.py"
    script.write_text(_MPI_RECIPE)
    done = run(LAUNCHER.command(2, sys.executable, str(script)), env=job_env(), timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for r in range(2):
        rows = json.loads(Path(f"{script}.{r}").read_text())
        for given, (rank, size) in (("0,0", (0, 0)), ("3,5", (3, 5))):
            row = rows[given]
            assert (row["rank"], row["size"], row["sum"]) == (r, 2, 3.0), rows
            assert row["warnings"] == [
                [
                    "UserWarning",
                    f"For MPI backend, world_size ({size}) and rank ({rank}) are ignored "
                    f"since they are assigned by the MPI runtime. distcomm uses rank {r} and "
                    f"world size 2 from MPI.COMM_WORLD; leave rank and world_size out to "
                    f"silence this warning",
                    str(script),  # the caller's line, as torch's stacklevel points
                ]
            ], rows
        assert rows["-1,-1"] == {"warnings": [], "rank": r, "size": 2, "sum": 3.0}, rows


# -- a script run with plain python ---------------------------------------------------------

#: every variable by which distcomm recognises a launcher or takes a rank, and prefixes
_LAUNCHER_VARIABLES = {
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
}
_LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL", "TORCHELASTIC_", "DISTCOMM_")


def _no_launcher_env(**extra: str) -> dict[str, str]:
    """This environment as a shell gives it, with no launcher's variables, plus `extra`."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _LAUNCHER_VARIABLES and not key.startswith(_LAUNCHER_PREFIXES)
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return {**env, **extra}


@pytest.mark.parametrize(
    ("env", "variable", "to_set"),
    [
        ({}, "RANK", "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"),
        ({"RANK": "0"}, "WORLD_SIZE", "WORLD_SIZE, MASTER_ADDR and MASTER_PORT"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR", "MASTER_ADDR and MASTER_PORT"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
            "MASTER_PORT",
            "MASTER_PORT",
        ),
    ],
)
def test_a_script_run_with_plain_python_is_told_how_to_start(tmp_path, env, variable, to_set):
    script = tmp_path / "train.py"
    script.write_text("import distcomm as dist\ndist.init_process_group('gloo')\n")
    done = subprocess.run(
        [sys.executable, str(script)],
        env=_no_launcher_env(**env),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("ValueError: cannot determine the "), message
    for words in (
        f"env:// rendezvous: environment variable {variable} expected, but not set",  # torch's
        "no launcher started this process: start it with "
        "`distcomm-run --nproc_per_node=N script.py`, `mpiexec -n N python script.py` or "
        "`srun -n N python script.py`",
        f"or set {to_set}; ",
        "a single process also runs with init_process_group(rank=0, world_size=1, "
        "init_method='tcp://127.0.0.1:29500') or init_method='file:///tmp/NAME'",
    ):
        assert words in message, message


@pytest.mark.parametrize(
    "launcher",
    [
        {"TORCHELASTIC_RUN_ID": "job", "RANK": "0", "WORLD_SIZE": "1"},  # distcomm-run
        {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},  # sbatch script
    ],
)
def test_a_process_a_launcher_started_is_not_told_to_use_one(launcher):
    with pytest.raises(ValueError) as caught:
        rendezvous(environ=launcher, timeout=1)
    message = str(caught.value)
    assert message.startswith("cannot determine the store address"), message
    assert "no launcher started" not in message and "distcomm-run" not in message, message


def test_the_one_process_recipe_the_message_gives_works(tmp_path):
    port = free_port("127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
    finally:
        dist.destroy_process_group()
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/s")
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
    finally:
        dist.destroy_process_group()


# -- nccl without a GPU ----------------------------------------------------------------------

#: what `import cupy` raises where the NVIDIA driver is missing (CuPy 13's words)
_CUPY_WITHOUT_DRIVER = """raise ImportError(\"\"\"
================================================================
Failed to import CuPy.

If you installed CuPy via wheels (cupy-cudaXXX or cupy-rocm-X-X), make sure that the
package matches with the version of CUDA or ROCm installed.

Original error:
  ImportError: libcuda.so.1: cannot open shared object file: No such file or directory
================================================================
\"\"\")
"""

_FAKE_RUNTIME = """
DEVICES = {devices}


class CUDARuntimeError(RuntimeError):
    pass


def getDeviceCount():
    if DEVICES == 0:
        raise CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
    return DEVICES
"""

_FAKE_DRIVER = """
class CUDADriverError(RuntimeError):
    def __init__(self, status):
        super().__init__(f"CUDA driver error {{status}}")
        self.status = status


def ctxGetCurrent():
    if {devices} == 0:
        raise CUDADriverError(3)  # CUDA_ERROR_NOT_INITIALIZED: nothing initialised CUDA
    return 1  # a process that initialised CUDA on its GPU
"""

_FAKE_NCCL = {
    "ok": "available = True\n\n\ndef get_version():\n    return 22703\n",
    "no library": "available = False\n",
    "import fails": (
        'raise ImportError("libnccl.so.2: cannot open shared object file: No such file '
        'or directory")\n'
    ),
}


def _fake_cupy(root: Path, devices: int | None, nccl: str = "ok") -> Path:
    """A folder holding a `cupy` package of distribution cupy-cuda12x 13.3.0, for
    PYTHONPATH. `devices`: None, its import fails as CuPy's does without the NVIDIA
    driver; else CUDA reports that many GPUs (0: cudaErrorNoDevice). `nccl`: "ok", "no
    library" (cupy.cuda.nccl.available is False) or "import fails"."""
    site = root / "site"
    (site / "cupy" / "cuda").mkdir(parents=True)
    meta = site / "cupy_cuda12x-13.3.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: cupy-cuda12x\nVersion: 13.3.0\n")
    (meta / "top_level.txt").write_text("cupy\n")
    if devices is None:
        (site / "cupy" / "__init__.py").write_text(_CUPY_WITHOUT_DRIVER)
        return site
    (site / "cupy" / "__init__.py").write_text('__version__ = "13.3.0"\nfrom . import cuda\n')
    (site / "cupy" / "cuda" / "__init__.py").write_text("from . import driver, runtime\n")
    (site / "cupy" / "cuda" / "runtime.py").write_text(_FAKE_RUNTIME.format(devices=devices))
    (site / "cupy" / "cuda" / "driver.py").write_text(_FAKE_DRIVER.format(devices=devices))
    (site / "cupy" / "cuda" / "nccl.py").write_text(_FAKE_NCCL[nccl])
    return site


_NCCL_PROBE = """
import json
import distcomm as dist
from distcomm.backends import registered_backends

found = {
    "available": dist.is_nccl_available(),
    "reason": registered_backends()["nccl"].availability(),
}
try:
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
except Exception as exc:
    found["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(found))
"""


def _probe_nccl(site: Path, **env: str) -> dict[str, object]:
    """What is_nccl_available, the nccl availability reason and init_process_group('nccl')
    say in a fresh interpreter whose `cupy` is the one in `site`."""
    environ = _no_launcher_env(**env)
    environ["PYTHONPATH"] = os.pathsep.join([str(site), environ["PYTHONPATH"]])
    if "CUDA_VISIBLE_DEVICES" not in env:
        environ.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run(
        [sys.executable, "-c", _NCCL_PROBE],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_nccl_where_cupy_cannot_load_the_driver_says_there_is_no_gpu(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides any GPU of the host running the test, as no GPU would
    found = _probe_nccl(_fake_cupy(tmp_path, devices=None), CUDA_VISIBLE_DEVICES="")
    assert found["available"] is False
    error = str(found["error"])
    assert error.startswith("BackendUnavailableError: backend 'nccl' is not available: "), error
    for words in (
        "CuPy 13.3.0 (cupy-cuda12x) is installed but fails to import (ImportError: "
        "libcuda.so.1: cannot open shared object file: No such file or directory): no GPU "
        "is visible to this process (",
        "CUDA_VISIBLE_DEVICES=''",
        "run `python -m distcomm.info` to see what distcomm found",
        "use the gloo backend for numpy (CPU) arrays",
    ):
        assert words in error and words in str(found["reason"]), error
    assert "pip install" not in error, error  # CuPy is installed: installing it is no cure


def test_nccl_where_cupy_finds_no_gpu_says_so_when_the_backend_is_made(tmp_path):
    found = _probe_nccl(_fake_cupy(tmp_path, devices=0), CUDA_VISIBLE_DEVICES="")
    assert found["available"] is True, found  # as torch's: CuPy and NCCL are there
    error = str(found["error"])
    for words in (
        "the nccl backend: CuPy is installed but CUDA reports no usable device "
        "(cudaErrorNoDevice: no CUDA-capable device is detected): no GPU is visible to this "
        "process (CuPy 13.3.0; CUDA_VISIBLE_DEVICES='').",
        "run `python -m distcomm.info` to see what distcomm found",
        "use the gloo backend for numpy (CPU) arrays",
    ):
        assert words in error, error
    assert "pip install" not in error, error


def test_nccl_without_a_gpu_or_nccl_names_the_missing_gpu_first(tmp_path):
    found = _probe_nccl(_fake_cupy(tmp_path, devices=0, nccl="no library"), CUDA_VISIBLE_DEVICES="")
    assert found["available"] is False
    reason = str(found["reason"])
    assert reason.startswith(
        "the nccl backend: CuPy 13.3.0 is installed but no GPU is visible to this process ("
    ), reason
    for words in (
        "and cupy.cuda.nccl found no NCCL library.",
        "use the gloo backend for numpy (CPU) arrays",
        "on a host with a GPU, install NCCL: pip install nvidia-nccl-cu12",
    ):
        assert words in reason, reason
    assert "pip install cupy" not in reason and reason in str(found["error"]), found


def test_nccl_with_a_gpu_but_no_nccl_bindings_says_which_wheel(tmp_path):
    found = _probe_nccl(_fake_cupy(tmp_path, devices=1, nccl="import fails"))
    assert found["available"] is False
    reason = str(found["reason"])
    assert reason == (
        "the nccl backend: CuPy 13.3.0 is installed but its NCCL bindings are not "
        "available: cupy.cuda.nccl fails to import (libnccl.so.2: cannot open shared object "
        "file: No such file or directory); install the NCCL wheel for your CUDA version: "
        "pip install nvidia-nccl-cu12"
    ), reason
    assert reason in str(found["error"]), found
