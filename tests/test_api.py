"""The public surface: exports, argument errors, the backend registry, multi-device specs.

These run in the test process itself (a 1-rank group on a HashStore needs no sockets).
"""

from __future__ import annotations

import copy
import logging
import re
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

import distcomm as dist
from distcomm import backends, config
from distcomm.backends import registry as backend_registry
from distcomm.backends.tcp import TcpBackend

README = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def readme_api() -> set[str]:
    text = README.read_text()
    match = re.search(r"<!-- api-list -->(.*?)<!-- /api-list -->", text, re.S)
    assert match, "docs/api.md lacks the <!-- api-list --> section"
    return set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)", match.group(1)))


def test_exports_match_the_readme_api_list():
    assert set(dist.__all__) == readme_api()
    for name in dist.__all__:
        assert hasattr(dist, name), name
    assert len(dist.__all__) == len(set(dist.__all__))


def test_error_hierarchy():
    assert issubclass(dist.DistError, RuntimeError)
    assert issubclass(dist.DistTimeoutError, TimeoutError)
    assert issubclass(dist.DistNetworkError, ConnectionError)
    assert issubclass(dist.DistStoreTimeoutError, dist.DistStoreError)
    assert issubclass(dist.DistStoreTimeoutError, dist.DistTimeoutError)
    assert issubclass(dist.BackendUnavailableError, ImportError)
    for cls in (
        dist.DistBackendError,
        dist.DistNetworkError,
        dist.DistStoreError,
        dist.DistTimeoutError,
    ):
        assert issubclass(cls, dist.DistError)


# -- before initialisation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda: dist.get_rank(),
        lambda: dist.get_world_size(),
        lambda: dist.get_backend(),
        lambda: dist.all_reduce(np.zeros(3)),
        lambda: dist.barrier(),
        lambda: dist.new_group([0]),
        lambda: dist.destroy_process_group(),
        lambda: dist.send(np.zeros(2), dst=1),
    ],
)
def test_use_before_init_raises(call):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        call()


def test_init_arguments_are_checked():
    with pytest.raises(ValueError, match=r"unknown backend 'nosuch'; registered backends: .*tcp"):
        dist.init_process_group("nosuch", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match="does not serve cuda"):
        dist.init_process_group("cpu:tcp,cuda:tcp", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match="device:backend"):
        dist.init_process_group("gpu:tcp", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match="timeout"):
        dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1, timeout=-1)
    with pytest.raises(ValueError, match="rank"):
        dist.init_process_group("tcp", store=dist.HashStore(), world_size=1)
    assert not dist.is_initialized()


def test_availability_queries():
    assert dist.is_available()
    assert dist.is_backend_available("tcp")
    assert not dist.is_backend_available("nosuch")
    assert isinstance(dist.is_gloo_available(), bool)
    assert isinstance(dist.is_mpi_available(), bool)
    assert isinstance(dist.is_nccl_available(), bool)


# -- with a 1-rank group -------------------------------------------------------------------------


def test_solo_group_basics(solo):
    assert dist.is_initialized()
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, "tcp")
    assert dist.group.WORLD is dist.GroupMember.WORLD
    assert dist.group.WORLD.rank() == 0 and dist.group.WORLD.size() == 1
    x = np.arange(5.0)
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    assert x.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="already called"):
        dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1)


@pytest.mark.parametrize(
    "call,error,words",
    [
        (lambda: dist.all_reduce(np.zeros((4, 4))[:, ::2]), ValueError, "C-contiguous"),
        (lambda: _all_reduce_read_only(), ValueError, "read-only"),
        (lambda: dist.all_reduce(np.array([object()])), TypeError, "dtype object"),
        (lambda: dist.all_reduce(np.zeros(3, dtype=">f8")), ValueError, "byte order"),
        (lambda: dist.all_reduce([1.0, 2.0]), TypeError, "numpy.ndarray"),
        (lambda: dist.all_reduce(np.zeros(3), op="sum"), TypeError, "ReduceOp"),
        (lambda: dist.all_reduce(np.zeros(3), op=dist.ReduceOp.BAND), TypeError, "integer or bool"),
        (
            lambda: dist.all_reduce(np.zeros(3, np.complex64), op=dist.ReduceOp.MAX),
            TypeError,
            "complex",
        ),
        (
            lambda: dist.all_reduce(np.zeros(3, np.int32), op=dist.ReduceOp.AVG),
            TypeError,
            "floating",
        ),
        (lambda: dist.broadcast(np.zeros(3)), ValueError, "src is required"),
        (lambda: dist.broadcast(np.zeros(3), src=5), ValueError, "not a member"),
        (lambda: dist.broadcast(np.zeros(3), src=0, group_src=0), ValueError, "not both"),
        (lambda: dist.broadcast(np.zeros(3), group_src=3), ValueError, "out of range"),
        (lambda: dist.reduce(np.zeros(3), dst="0"), TypeError, "must be an int"),
        (lambda: dist.send(np.zeros(3), dst=0), ValueError, "this process itself"),
        (lambda: dist.isend(np.zeros(3), dst=0, tag=-1), ValueError, "tag"),
        (
            lambda: dist.all_gather([np.zeros(3), np.zeros(3)], np.zeros(3)),
            ValueError,
            "one array per rank",
        ),
        (lambda: dist.all_gather([np.zeros(4)], np.zeros(3)), ValueError, "elements"),
        (
            lambda: dist.all_gather([np.zeros(3, np.float32)], np.zeros(3)),
            TypeError,
            "mixes dtypes",
        ),
        (lambda: dist.all_gather(np.zeros(3), np.zeros(3)), TypeError, "list of arrays"),
        (
            lambda: dist.all_gather_single(np.zeros(5), np.zeros(3)),
            ValueError,
            "group size x input",
        ),
        (
            lambda: dist.reduce_scatter_single(np.zeros(2), np.zeros(3)),
            ValueError,
            "group size x output",
        ),
        (lambda: dist.gather(np.zeros(3)), ValueError, "gather_list is required"),
        (
            lambda: dist.scatter(np.zeros(3), [np.zeros(3), np.zeros(3)]),
            ValueError,
            "one array per rank",
        ),
        (
            lambda: dist.all_to_all_single(np.zeros(3), np.zeros(3), [1, 1], [3]),
            ValueError,
            "one per rank",
        ),
        (lambda: dist.all_to_all_single(np.zeros(3), np.zeros(3), [2], [3]), ValueError, "sum to"),
        (
            lambda: dist.all_to_all_single(np.zeros(()), np.zeros(())),
            ValueError,
            "splits along dim 0",
        ),
        (lambda: dist.all_reduce(np.float64(1.0)), TypeError, "numpy.asarray(value)"),
        (lambda: dist.new_group([0, 0]), ValueError, "twice"),
        (lambda: dist.new_group([1]), ValueError, "out of range"),
        (lambda: dist.new_group(["0"]), TypeError, "ints"),
        (lambda: dist.get_global_rank(None, 4), ValueError, "not in group"),
        (lambda: dist.get_group_rank(None, 4), ValueError, "not a member"),
        (lambda: dist.all_reduce(np.zeros(3), group="world"), TypeError, "ProcessGroup"),
        (lambda: dist.P2POp(dist.send, np.zeros(3), 0), ValueError, "isend or distcomm.irecv"),
        (lambda: dist.batch_isend_irecv([]), ValueError, "empty"),
        (lambda: dist.all_gather_object([None, None], 1), ValueError, "one slot per rank"),
        (lambda: dist.monitored_barrier(timeout="soon"), TypeError, "timedelta"),
    ],
)
def test_bad_arguments_say_what_to_do(solo, call, error, words):
    with pytest.raises(error, match=re.escape(words)):
        call()


def _all_reduce_read_only() -> None:
    array = np.zeros(3)
    array.setflags(write=False)
    dist.all_reduce(array)


def test_read_only_input_is_fine_where_nothing_is_written(solo):
    frozen = np.arange(3.0)
    frozen.setflags(write=False)
    out = np.empty(3)
    dist.all_gather_single(out, frozen)
    assert out.tolist() == [0.0, 1.0, 2.0]


def test_work_api(solo):
    x = np.ones(4)
    work = dist.all_reduce(x, async_op=True)
    assert work.wait(timedelta(seconds=5)) is True
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert work.result() == [x]
    assert work.get_future().done()
    assert "all_reduce" in repr(work)


def test_subgroup_of_one_and_destroy(solo):
    group = dist.new_group([0], timeout=5, group_desc="solo")
    assert group.rank() == 0 and group.size() == 1 and group.group_name == "solo"
    y = np.full(2, 3.0)
    dist.broadcast(y, src=0, group=group)
    dist.destroy_process_group(group)
    with pytest.raises(RuntimeError, match="destroyed"):
        dist.all_reduce(y, group=group)
    dist.all_reduce(y)  # the world is untouched


def test_multi_device_spec(monkeypatch):
    dist.init_process_group("cpu:tcp", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.get_backend() == "tcp"
        x = np.ones(3)
        dist.all_reduce(x)
    finally:
        dist.destroy_process_group()


# -- the registry ----------------------------------------------------------------------------------


class EchoBackend(TcpBackend):
    """A third-party backend: the tcp backend under another name, counting its all_reduces."""

    name = "echo"
    calls = 0

    def all_reduce(self, array, op, *, async_op=False):
        EchoBackend.calls += 1
        return super().all_reduce(array, op, async_op=async_op)


@pytest.fixture
def fresh_registry(monkeypatch):
    registry = backend_registry._Registry()
    registry.records = dict(backend_registry._registry.records)
    monkeypatch.setattr(backend_registry, "_registry", registry)
    for name in ("backend_list", "default_device_backend_map", "backend_capability"):
        monkeypatch.setattr(dist.Backend, name, copy.copy(getattr(dist.Backend, name)))
    return registry


def test_register_backend_and_use_it(fresh_registry):
    dist.Backend.register_backend("echo", EchoBackend, devices=["cpu"])
    assert dist.Backend.ECHO == "echo" and "echo" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["echo"] == ["cpu"]
    delattr(dist.Backend, "ECHO")
    with pytest.raises(ValueError, match="already registered"):
        backends.register_backend("echo", EchoBackend)
    with pytest.raises(ValueError, match="identifier"):
        backends.register_backend("bad name", EchoBackend)
    with pytest.raises(TypeError, match="callable"):
        backends.register_backend("notcallable", 42)
    with pytest.raises(ValueError, match="unknown device"):
        backends.register_backend("gpuonly", EchoBackend, devices="tpu")
    dist.init_process_group("echo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(np.ones(2))
        assert EchoBackend.calls == 1 and dist.get_backend() == "echo"
    finally:
        dist.destroy_process_group()


def test_backend_is_torchs_string_type():
    assert dist.Backend("GLOO") == "gloo" == dist.Backend.GLOO and dist.Backend("mine") == "mine"
    assert isinstance(dist.Backend("tcp"), str) and dist.Backend.NCCL == "nccl"
    assert {"gloo", "nccl", "mpi", "tcp"} <= set(dist.Backend.backend_list)
    assert dist.Backend.default_device_backend_map == {"cpu": "gloo", "cuda": "nccl"}
    with pytest.raises(ValueError, match="string"):
        dist.Backend(3)
    config = dist.BackendConfig("cpu:tcp,cuda:nccl")
    assert str(config) == "cpu:tcp,cuda:nccl"
    assert config.get_device_backend_map() == {"cpu": "tcp", "cuda": "nccl"}
    assert str(dist.BackendConfig("gloo")) == "cpu:gloo,cuda:gloo"
    assert dist.Backend is not backends.Backend  # the plug-in base keeps its own name


def test_backend_matches_torch():
    torch_dist = pytest.importorskip("torch.distributed")
    for name in ("gloo", "GLOO", "Nccl", "mpi", "custom"):
        assert dist.Backend(name) == torch_dist.Backend(name), name
    for attr in ("GLOO", "NCCL", "MPI", "UCC", "XCCL", "UNDEFINED"):
        assert getattr(dist.Backend, attr) == getattr(torch_dist.Backend, attr), attr
    assert str(dist.BackendConfig("cpu:gloo,cuda:nccl")) == str(
        torch_dist.distributed_c10d.BackendConfig("cpu:gloo,cuda:nccl")
    )


def test_factories_are_called_as_torch_calls_them(fresh_registry):
    seen = []

    def plain(store, rank, size, timeout):
        seen.append(("plain", rank, size, timeout))
        return EchoBackend(store, rank, size, timeout)

    def extended(options, pg_options):
        seen.append(("extended", options, pg_options))
        return EchoBackend.from_options(options)

    backends.register_backend("plain", plain, devices="cpu")
    backends.register_backend("extended", extended, extended_api=True, devices="cpu")
    for name in ("plain", "extended"):
        dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1, timeout=7)
        dist.destroy_process_group()
    assert seen[0] == ("plain", 0, 1, 7.0)
    kind, options, pg_options = seen[1]
    assert kind == "extended" and pg_options is None
    assert isinstance(options, backends.BackendOptions)
    assert (options.group_rank, options.group_size, options.timeout) == (0, 1, 7.0)
    assert options.group_id == "default" and options.global_ranks_in_group == (0,)
    assert isinstance(options.store, dist.Store)


def test_factory_must_return_a_backend(fresh_registry):
    backends.register_backend("liar", lambda store, rank, size, timeout: object())
    with pytest.raises(TypeError, match=r"not a distcomm\.backends\.Backend"):
        dist.init_process_group("liar", store=dist.HashStore(), rank=0, world_size=1)


def _write_plugin(root: Path, name: str, target: str) -> None:
    info = root / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[distcomm.backends]\n{name} = {target}\n")


def test_entry_point_plugins(tmp_path, monkeypatch, fresh_registry, caplog):
    package = tmp_path / "plugin_pkg.py"
    package.write_text(
        "from tests.test_api import EchoBackend\n"
        "class Shout(EchoBackend):\n    name = 'shout'\n"
        "def broken():\n    raise RuntimeError('plug-in exploded')\n"
    )
    _write_plugin(tmp_path, "shout", "plugin_pkg:Shout")
    _write_plugin(tmp_path, "broken", "plugin_pkg:broken")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="distcomm.backends"):
        names = backends.registered_backends()
    assert "shout" in names and names["shout"].devices == ("cpu",)
    assert "plug-in exploded" in caplog.text and "broken" in caplog.text
    sys.modules.pop("plugin_pkg", None)


def test_deprecated_names_warn_and_work(solo):
    out = np.empty(3)
    with pytest.warns(FutureWarning, match="all_gather_single"):
        dist.all_gather_into_tensor(out, np.arange(3.0))
    assert out.tolist() == [0.0, 1.0, 2.0]
    with pytest.warns(FutureWarning, match="reduce_scatter_single"):
        dist.reduce_scatter_tensor(out, np.full(3, 2.0))
    assert out.tolist() == [2.0, 2.0, 2.0]


def test_debug_detail_logs_collectives(monkeypatch, caplog):
    from distcomm import config

    monkeypatch.setenv("DISTCOMM_DEBUG", "DETAIL")
    logger = logging.getLogger("distcomm")
    try:
        with caplog.at_level(logging.DEBUG, logger="distcomm"):
            dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1)
            dist.all_reduce(np.ones(3, dtype=np.float32), op=dist.ReduceOp.MAX)
            dist.destroy_process_group()
        assert "initialised: rank 0 of 1, backend tcp" in caplog.text
        assert "all_reduce(MAX) of 3 float32" in caplog.text
        assert "destroying every group" in caplog.text
    finally:
        if config._handler is not None:
            logger.removeHandler(config._handler)
            config._handler = None
        logger.setLevel(logging.NOTSET)


def test_debug_level_is_validated(monkeypatch):
    monkeypatch.setenv("DISTCOMM_DEBUG", "LOUD")
    with pytest.raises(ValueError, match="DISTCOMM_DEBUG"):
        dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1)


# -- torch's small helpers, debug level and top-level thread controls ----------------------


def test_query_helpers(solo, monkeypatch):
    assert dist.get_backend_config() == "cpu:tcp"
    assert dist.get_pg_count() == 1
    dist.new_group([0])
    assert dist.get_pg_count() == 2
    assert dist.default_pg_timeout == timedelta(minutes=30)
    assert dist.get_default_backend_for_device("cpu") == "gloo"
    assert dist.get_default_backend_for_device("cuda:1") == "nccl"
    with pytest.raises(ValueError, match="'xpu' is not a device"):
        dist.get_default_backend_for_device("xpu")
    assert dist.is_ucc_available() is False
    assert [op.name for op in dist.ReduceOp if not dist.supports_complex(op)] == [
        "PRODUCT",
        "MIN",
        "MAX",
        "BAND",
        "BOR",
        "BXOR",
    ]
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(RuntimeError, match="fallback_rank"):
        dist.get_node_local_rank()
    assert dist.get_node_local_rank(fallback_rank=3) == 3
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert dist.get_node_local_rank(fallback_rank=3) == 1
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert dist.is_torchelastic_launched() is False
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert dist.is_torchelastic_launched() is True


def test_get_pg_count_is_zero_before_init():
    assert dist.get_pg_count() == 0


def test_debug_level_from_either_variable_and_set(monkeypatch):
    for name in ("DISTCOMM_DEBUG", "TORCH_DISTRIBUTED_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    try:
        assert dist.get_debug_level() is dist.DebugLevel.OFF
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "detail")
        assert dist.get_debug_level() is dist.DebugLevel.DETAIL
        monkeypatch.setenv("DISTCOMM_DEBUG", "INFO")  # ours wins
        assert dist.get_debug_level() is dist.DebugLevel.INFO
        dist.set_debug_level(dist.DebugLevel.OFF)  # over both
        assert dist.get_debug_level() is dist.DebugLevel.OFF
        with pytest.raises(ValueError, match="not a DebugLevel"):
            dist.set_debug_level(7)
        dist.set_debug_level_from_env()
        assert dist.get_debug_level() is dist.DebugLevel.INFO
        monkeypatch.setenv("DISTCOMM_DEBUG", "LOUD")
        with pytest.raises(ValueError, match="DISTCOMM_DEBUG='LOUD'"):
            dist.set_debug_level_from_env()
    finally:
        monkeypatch.delenv("DISTCOMM_DEBUG", raising=False)
        monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
        config.set_debug(None)
    assert [(m.name, m.value) for m in dist.DebugLevel] == [("OFF", 0), ("INFO", 1), ("DETAIL", 2)]


def test_small_torch_names():
    assert dist.is_xccl_available() is False and dist.GroupName("g") == "g"
    with pytest.warns(FutureWarning, match="reduce_op is deprecated"):
        assert dist.reduce_op.MAX is dist.ReduceOp.MAX
    with pytest.raises(AttributeError, match="ReduceOp"):
        dist.reduce_op.NOPE  # noqa: B018


def test_thread_controls_at_the_top_level():
    from distcomm import parallel

    for name in (
        "set_num_threads",
        "get_num_threads",
        "set_num_interop_threads",
        "get_num_interop_threads",
        "parallel_info",
        "fork",
        "wait",
    ):
        assert getattr(dist, name) is getattr(parallel, name)
    assert dist.wait(dist.fork(lambda a, b: a + b, 2, b=3)) == 5


def test_helpers_match_torch():
    torch_dist = pytest.importorskip("torch.distributed", reason="needs torch installed")
    for op in dist.ReduceOp:
        assert dist.supports_complex(op) == torch_dist.supports_complex(
            getattr(torch_dist.ReduceOp, op.name)
        ), op
    assert dist.default_pg_timeout == torch_dist.default_pg_timeout
    for device in ("cpu", "cuda"):
        assert dist.get_default_backend_for_device(
            device
        ) == torch_dist.get_default_backend_for_device(device)
    assert [(m.name, int(m.value)) for m in dist.DebugLevel] == [
        (m.name, int(m.value))
        for m in (
            torch_dist.DebugLevel.OFF,
            torch_dist.DebugLevel.INFO,
            torch_dist.DebugLevel.DETAIL,
        )
    ]


def test_work_synchronize_and_result_code(solo):
    x = np.ones(3)
    work = dist.all_reduce(x, async_op=True)
    work.synchronize()
    assert work.is_completed() and work.get_future_result().wait(10) == 0
    failed = dist.Work("an op")
    failed.fail(dist.DistBackendError("peer gone"))
    assert failed.get_future_result().wait(10) == 2
    timed_out = dist.Work("an op")
    codes = timed_out.get_future_result()
    timed_out.fail(dist.DistTimeoutError("late"))
    assert codes.wait(10) == 1


def test_barrier_timeout_alone_and_non_sorted_group(solo):
    assert dist.barrier(timeout=timedelta(seconds=5)) is None
    assert dist.barrier(timeout=5, async_op=True).wait() is True
    group = dist.new_group([0], sort_ranks=False, device_id=None)
    assert dist.get_rank(group) == 0


def test_device_id_without_cupy_says_what_to_install(monkeypatch):
    from distcomm.gpu import runtime

    if runtime.is_available():
        pytest.skip("CuPy and a GPU are here")
    with pytest.raises(dist.BackendUnavailableError, match="pip install"):
        dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1, device_id=0)
    assert not dist.is_initialized()


BREAK_SCRIPT = """
import sys, time
import distcomm as dist

rank = int(sys.argv[2])
dist.init_process_group("tcp", init_method=f"file://{sys.argv[1]}", rank=rank, world_size=2,
                        timeout=60)
secret = 41 + rank
dist.breakpoint(rank=0, timeout_s=120)  # rank 1 waits here until rank 0 continues
dist.breakpoint(rank=1, skip=1)         # skipped: its first call
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_breakpoint_stops_one_rank_while_the_other_waits(tmp_path):
    """Rank 0 stops in pdb and reads commands from its stdin; rank 1 waits in the barrier
    until rank 0 continues; skip=1 passes the first call."""
    import os
    import subprocess

    script = tmp_path / "break.py"
    script.write_text(BREAK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTCOMM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "rdzv"), str(r)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        out0, err0 = procs[0].communicate("up\np secret\nc\n", timeout=90)
        out1, err1 = procs[1].communicate("", timeout=90)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert procs[0].returncode == 0 and procs[1].returncode == 0, (err0, err1)
    assert "!!! ATTENTION !!!" in out0 and "dist.breakpoint(rank=0)" in out0, out0
    assert "(Pdb) 41\n" in out0, out0  # 'up', then `p secret` in the caller's frame
    assert "rank 0 done" in out0 and "rank 1 done" in out1
    assert "ATTENTION" not in out1  # rank 1 never stopped: its breakpoint was skipped
    assert "skipped, call 1 of the 1 to skip" in err1, err1


def test_a_backend_whose_module_is_missing_is_unavailable_and_says_why(monkeypatch):
    # a wheel that lacked distcomm.backends.transport once made is_gloo_available() raise
    # ModuleNotFoundError instead of answering
    monkeypatch.setitem(sys.modules, "distcomm.backends.gloo", None)
    assert dist.is_gloo_available() is False
    why = backends.get_backend_record("gloo").availability()
    assert "distcomm.backends.gloo:GlooBackend cannot be imported" in why, why
    assert "reinstall" in why, why
    with pytest.raises(dist.BackendUnavailableError, match="cannot be imported"):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()


class BrittleBackend(TcpBackend):
    """A third-party backend whose shutdown raises after releasing what it holds."""

    name = "brittle"

    def shutdown(self):
        super().shutdown()
        raise RuntimeError("brittle backend: shutdown failed")


def test_destroy_finishes_when_a_backends_shutdown_raises(fresh_registry):
    import socket

    from tests.processes import free_port

    backends.register_backend("brittle", BrittleBackend, extended_api=False, devices="cpu")
    port = free_port()
    dist.init_process_group("brittle", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    sub = dist.new_group([0], backend="tcp")
    dist.all_reduce(np.ones(2), group=sub)
    with pytest.raises(RuntimeError, match="brittle backend: shutdown failed"):
        dist.destroy_process_group()
    # the store it owned is closed and the module state is reset all the same
    assert not dist.is_initialized()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), 5):
        pass
    dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1)
    dist.destroy_process_group()
