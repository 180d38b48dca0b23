"""Tests of distcomm.rendezvous: node lists, environment detection, URLs, and real rendezvous."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import pytest

from distcomm import mpiutil
from distcomm.bootstrap import urls
from distcomm.errors import DistBackendError, DistError
from distcomm.examples import quickstart
from distcomm.rendezvous import (
    EnvInfo,
    Rendezvous,
    check_mpi_world_size,
    detect_environment,
    expand_nodelist,
    parse_init_method,
    register_rendezvous_handler,
    rendezvous,
    slurm_port,
)
from distcomm.store import FileStore, HashStore, TCPStore
from tests.harness import run_ranks
from tests.processes import free_port

TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


# -- expand_nodelist ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "hosts"),
    [
        ("", []),
        ("single", ["single"]),
        ("host1,host2", ["host1", "host2"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu-a[1-2],gpu-b3", ["gpu-a1", "gpu-a2", "gpu-b3"]),
        ("n[001-003]-ib", ["n001-ib", "n002-ib", "n003-ib"]),
        ("node[8-10]", ["node8", "node9", "node10"]),
        ("node[08-10]", ["node08", "node09", "node10"]),
        ("node[7]", ["node7"]),
        ("a[1,3],b[2-3],c", ["a1", "a3", "b2", "b3", "c"]),
        ("x[1-2] y[5]\tz", ["x1", "x2", "y5", "z"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
        ("[1-2]", ["1", "2"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        # Slurm's order with three groups: the middle group outermost, the last innermost.
        (
            "a[1-2]b[3-4]c[5-6]",
            ["a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6", "a1b4c5", "a1b4c6", "a2b4c5", "a2b4c6"],
        ),
        ("r[1-2]n[1]-ib,login", ["r1n1-ib", "r2n1-ib", "login"]),
        (",,host1,,", ["host1"]),
    ],
)
def test_expand_nodelist(spec: str, hosts: list[str]) -> None:
    assert expand_nodelist(spec) == hosts


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("node[1-", "unbalanced or nested"),
        ("node1-]", "unbalanced or nested"),
        ("node]1[", "unbalanced or nested"),
        ("node[1-2]]", "unbalanced or nested"),
        ("node[[1-2]]", "unbalanced or nested"),
        ("node[3-1]", "backwards"),
        ("node[a-b]", "not a number"),
        ("node[]", "not a number"),
        ("node[1,,2]", "not a number"),
        ("node[-1]", "not a number"),
        ("node[1 - 2]", "not a number"),
        ("node[1-2-3]", "not a number"),
        ("n[0-70000]", "more than"),
        ("a[0-9999]b[0-9999]", "more than"),
    ],
)
def test_expand_nodelist_rejects_malformed(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match="malformed Slurm node list") as info:
        expand_nodelist(spec)
    assert words in str(info.value)
    assert repr(spec) in str(info.value)


def test_expand_nodelist_rejects_non_str() -> None:
    with pytest.raises(TypeError, match="str"):
        expand_nodelist(["node1"])  # type: ignore[arg-type]


# -- detect_environment -----------------------------------------------------------------------

TORCH = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
OMPI = {
    "OMPI_COMM_WORLD_RANK": "5",
    "OMPI_COMM_WORLD_SIZE": "16",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}
PMIX = {"PMIX_RANK": "6", "PMIX_NAMESPACE": "prterun-host-1234@1"}
MPICH = {"PMI_RANK": "7", "PMI_SIZE": "12", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "6"}
#: task 9 of step 3, which srun started on 10 tasks, 5 per node (with no MPI plugin)
SLURM = {
    "SLURM_PROCID": "9",
    "SLURM_NTASKS": "10",
    "SLURM_LOCALID": "4",
    "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "5(x2)",
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "3",
    "SLURM_STEP_NUM_TASKS": "10",
    "SLURM_STEP_TASKS_PER_NODE": "5(x2)",
    "SLURM_JOB_NODELIST": "node[07-08]",
    "SLURM_STEP_NODELIST": "node08",
}
#: what srun's MPI plugins add to SLURM's task (--mpi=pmi2, --mpi=pmix)
SRUN_PLUGINS = {
    "none": {},
    "pmi2": {"PMI_RANK": "9", "PMI_SIZE": "10", "PMI_FD": "11", "PMI_JOBID": "123456.3"},
    "pmix": {"PMIX_RANK": "9", "PMIX_NAMESPACE": "slurm.pmix.123456.3"},
}
#: the batch script of a job of 10 tasks: the job's variables, no step
BATCH = {
    key: value
    for key, value in SLURM.items()
    if not key.startswith("SLURM_STEP_") and key not in ("SLURM_LOCALID", "SLURM_NODEID")
} | {"SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_LOCALID": "0"}


def test_detect_nothing() -> None:
    info = detect_environment({})
    assert info == EnvInfo()
    assert info.launcher is None


def test_detect_torch_style() -> None:
    env = {**TORCH, "MASTER_ADDR": "10.1.1.20", "MASTER_PORT": "23456"}
    info = detect_environment(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 8, 1, 2)
    assert (info.master_addr, info.master_port) == ("10.1.1.20", 23456)
    assert info.launcher == "torch style"
    assert info.source_of("master_port") == "MASTER_PORT"


def test_detect_open_mpi() -> None:
    info = detect_environment(OMPI)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 16, 1, 4)
    assert info.launcher == "Open MPI"
    assert info.source_of("local_world_size") == "OMPI_COMM_WORLD_LOCAL_SIZE"


def test_detect_mpich() -> None:
    info = detect_environment(MPICH)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (7, 12, 3, 6)
    assert info.launcher == "MPICH"


def test_detect_pmix_alone_has_no_size() -> None:
    info = detect_environment(PMIX)
    assert (info.rank, info.world_size) == (6, None)
    assert info.launcher == "PMIx"


def test_detect_pmix_takes_size_from_slurm() -> None:
    env = {**PMIX, "SLURM_PROCID": "6", "SLURM_NTASKS": "8"}
    info = detect_environment(env)
    assert (info.rank, info.world_size) == (6, 8)
    assert info.source_of("rank") == "PMIX_RANK"
    assert info.source_of("world_size") == "SLURM_NTASKS"


@pytest.mark.parametrize("plugin", sorted(SRUN_PLUGINS))
def test_detect_srun_task_takes_everything_from_slurm(plugin: str) -> None:
    info = detect_environment({**SLURM, **SRUN_PLUGINS[plugin]})
    assert info.srun
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (9, 10, 4, 5)
    assert info.launcher == "Slurm"
    assert info.source_of("rank") == "SLURM_PROCID"  # not PMI_RANK or PMIX_RANK
    assert info.source_of("world_size") == "SLURM_STEP_NUM_TASKS"
    # srun started the ranks: the step's node list and step id count, whatever the plugin
    assert info.master_addr == "node08"
    assert info.source_of("master_addr") == "SLURM_STEP_NODELIST"
    assert info.master_port == slurm_port(123456, 3) == 12000 + 10 * (123456 % 2000) + 3
    assert info.source_of("master_port") == "SLURM_JOB_ID and SLURM_STEP_ID"


@pytest.mark.parametrize("plugin", sorted(SRUN_PLUGINS))
def test_concurrent_srun_steps_get_their_own_ports(plugin: str) -> None:
    ports = {
        detect_environment(
            {**SLURM, **SRUN_PLUGINS[plugin], "SLURM_STEP_ID": str(step)}
        ).master_port
        for step in range(10)
    }
    assert len(ports) == 10


@pytest.mark.parametrize(
    ("extra", "rank", "rank_source"),
    [
        ({}, 0, "SLURM_PROCID"),  # the batch script itself
        ({"PMI_RANK": "3", "PMI_SIZE": "4"}, 3, "PMI_RANK"),  # mpiexec in the batch script
        (OMPI, 5, "OMPI_COMM_WORLD_RANK"),  # mpirun in the batch script
    ],
)
def test_detect_batch_script_and_mpi_launchers_in_it_use_job_values(
    extra: dict[str, str], rank: int, rank_source: str
) -> None:
    info = detect_environment({**BATCH, **extra})
    assert not info.srun
    assert (info.rank, info.source_of("rank")) == (rank, rank_source)
    assert (info.master_addr, info.source_of("master_addr")) == ("node07", "SLURM_JOB_NODELIST")
    assert (info.master_port, info.source_of("master_port")) == (slurm_port(123456), "SLURM_JOB_ID")


@pytest.mark.parametrize(
    "extra",
    [
        {"PMI_RANK": "2", "PMI_SIZE": "10"},  # an mpiexec whose ranks are not srun's tasks
        {"PMI_RANK": "9", "PMI_SIZE": "40"},  # mpiexec -n 40 inside a step of 10 tasks
        {"PMIX_RANK": "0", "PMIX_NAMESPACE": "prterun-vm-1@1"},
        {"OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "10"},  # mpirun inside a step
    ],
)
def test_detect_mpi_launcher_inside_a_step_is_not_srun(extra: dict[str, str]) -> None:
    info = detect_environment({**SLURM, **extra})
    assert not info.srun
    assert info.launcher in ("MPICH", "PMIx", "Open MPI")
    assert info.master_port == slurm_port(123456)  # no step term: not every rank sees a step


def test_detect_slurm_batch_step_uses_job_values_under_mpirun() -> None:
    # mpirun inside a batch job: Open MPI gives the ranks, Slurm only the job's node list
    env = {**SLURM, **OMPI}
    info = detect_environment(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 16, 1, 4)
    assert info.master_addr == "node07"
    assert info.source_of("master_addr") == "SLURM_JOB_NODELIST"
    assert info.master_port == slurm_port(123456)


def test_detect_slurm_step_tasks_and_nodelist_fallbacks() -> None:
    env = {
        "SLURM_PROCID": "2",
        "SLURM_STEP_NUM_TASKS": "3",
        "SLURM_NTASKS": "64",
        "SLURM_NODEID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "2,1",
        "SLURM_TASKS_PER_NODE": "32(x2)",
        "SLURM_NODELIST": "c[1-2]",
        "SLURM_JOB_ID": "7",
    }
    info = detect_environment(env)
    assert (info.world_size, info.local_world_size) == (3, 1)
    assert info.master_addr == "c1"
    assert info.master_port == slurm_port(7) == 12070


@pytest.mark.parametrize(
    ("env", "local_size"),
    [
        ({"SLURM_TASKS_PER_NODE": "4(x3)"}, 4),  # uniform: no node id needed
        ({"SLURM_TASKS_PER_NODE": "4,2"}, None),  # not uniform, no node id
        ({"SLURM_TASKS_PER_NODE": "4,2", "SLURM_NODEID": "1"}, 2),
        ({"SLURM_TASKS_PER_NODE": "4,2", "SLURM_NTASKS_PER_NODE": "4"}, 4),
        ({"SLURM_NTASKS_PER_NODE": "6"}, 6),
        ({"SLURM_NTASKS_PER_NODE": "6", "MPI_LOCALNRANKS": "3"}, 3),
    ],
)
def test_detect_slurm_local_size(env: dict[str, str], local_size: int | None) -> None:
    assert detect_environment(env).local_world_size == local_size


def test_slurm_port_range() -> None:
    for job_id in (0, 1, 1999, 2000, 123456789, 2**32 - 1):
        for step_id in (None, 0, 9, 4294967294):
            assert 12000 <= slurm_port(job_id, step_id) <= 31999
    assert slurm_port(5, 2) != slurm_port(5, 3) != slurm_port(6, 3)


PRECEDENCE = [
    (TORCH, "RANK"),
    (OMPI, "OMPI_COMM_WORLD_RANK"),
    (PMIX, "PMIX_RANK"),
    (MPICH, "PMI_RANK"),
    (SLURM, "SLURM_PROCID"),
]


@pytest.mark.parametrize("first", range(len(PRECEDENCE)))
def test_detect_rank_precedence(first: int) -> None:
    env: dict[str, str] = {}
    for variables, _ in PRECEDENCE[first:]:
        env.update(variables)
    variables, winner = PRECEDENCE[first]
    info = detect_environment(env)
    assert info.source_of("rank") == winner
    assert info.rank == int(variables[winner])


def test_detect_explicit_values_win_and_skip_the_environment() -> None:
    env = {
        "RANK": "not a number",
        "WORLD_SIZE": "x",
        "MASTER_ADDR": "env-host",
        "MASTER_PORT": "99999",
        "LOCAL_RANK": "0",
    }
    info = detect_environment(env, rank=1, world_size=2, master_addr="h", master_port=80)
    assert (info.rank, info.world_size, info.master_addr, info.master_port) == (1, 2, "h", 80)
    assert info.source_of("rank") == "rank= argument"
    assert info.launcher is None


def test_detect_master_vars_beat_slurm() -> None:
    env = {**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "29500"}
    info = detect_environment(env)
    assert (info.master_addr, info.master_port) == ("head", 29500)


def test_detect_without_master_ignores_master_vars() -> None:
    info = detect_environment({"MASTER_PORT": "nope", "RANK": "0"}, with_master=False)
    assert (info.rank, info.master_port) == (0, None)


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"RANK": "one"}, ["RANK='one'", "not an integer"]),
        ({"OMPI_COMM_WORLD_SIZE": "4.0"}, ["OMPI_COMM_WORLD_SIZE", "not an integer"]),
        ({"MASTER_PORT": "http"}, ["MASTER_PORT='http'", "not an integer"]),
        ({"RANK": "4", "WORLD_SIZE": "4"}, ["rank 4", "RANK", "world_size 4", "WORLD_SIZE"]),
        (
            {"OMPI_COMM_WORLD_RANK": "2", "SLURM_NTASKS": "2"},
            ["OMPI_COMM_WORLD_RANK (Open MPI)", "SLURM_NTASKS (Slurm)"],
        ),
        ({"RANK": "-1"}, ["rank -1", "RANK", ">= 0"]),
        ({"WORLD_SIZE": "0"}, ["world_size 0", ">= 1"]),
        ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, ["local_rank 2", "LOCAL_WORLD_SIZE"]),
        ({"MASTER_PORT": "70000"}, ["70000", "MASTER_PORT", "1 to 65535"]),
        ({"MASTER_PORT": "0"}, ["port 0", "1 to 65535"]),
        ({"SLURM_JOB_NODELIST": "node[1-"}, ["SLURM_JOB_NODELIST", "malformed"]),
        ({"SLURM_JOB_ID": "12a"}, ["SLURM_JOB_ID='12a'"]),
        ({"SLURM_TASKS_PER_NODE": "2(x)"}, ["SLURM_TASKS_PER_NODE", "2(x3),1"]),
        ({"SLURM_TASKS_PER_NODE": "2,2", "SLURM_NODEID": "2"}, ["SLURM_NODEID=2", "2 nodes"]),
    ],
)
def test_detect_rejects_bad_values(env: dict[str, str], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        detect_environment(env)
    for word in words:
        assert word in str(info.value)


# -- parse_init_method ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("env://", ("env", None, None, None, None, None)),
        ("env://?rank=1&world_size=2", ("env", None, None, None, 1, 2)),
        ("tcp://10.1.1.20:23456", ("tcp", "10.1.1.20", 23456, None, None, None)),
        ("TCP://Node1:80/", ("tcp", "node1", 80, None, None, None)),
        (
            "tcp://[ff15:1e18:5d4c:4cf0:d02d:b659:53ba:b0a7]:23456?world_size=4",
            ("tcp", "ff15:1e18:5d4c:4cf0:d02d:b659:53ba:b0a7", 23456, None, None, 4),
        ),
        ("tcp://[::1]:1?rank=0&world_size=1&use_libuv=0", ("tcp", "::1", 1, None, 0, 1)),
        ("file:///mnt/nfs/sharedfile", ("file", None, None, "/mnt/nfs/sharedfile", None, None)),
        ("file://localhost/tmp/f?rank=3&world_size=4", ("file", None, None, "/tmp/f", 3, 4)),
        ("file:relative/f", ("file", None, None, "relative/f", None, None)),
    ],
)
def test_parse_init_method(url: str, expected: tuple[object, ...]) -> None:
    method = parse_init_method(url)
    got = (method.scheme, method.host, method.port, method.path, method.rank, method.world_size)
    assert got == expected
    assert "?" not in method.url


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("mpi://host", ["unsupported scheme 'mpi'", "env://", "tcp://HOST:PORT", "file:///"]),
        ("localhost:29500", ["unsupported scheme"]),
        ("tcp://host", ["needs a host and a port"]),
        ("tcp://:29500", ["needs a host and a port"]),
        ("tcp://host:0", ["port 0", "1 to 65535"]),
        ("tcp://host:70000", ["not a valid URL"]),
        ("tcp://host:http", ["not a valid URL"]),
        ("tcp://[::1:29500", ["not a valid URL"]),
        ("tcp://host:1/path", ["no path"]),
        ("env://host:29500", ["env:// takes no address", "MASTER_ADDR"]),
        ("file://relative/f", ["names the host 'relative'", "file:///"]),
        ("file://", ["no path"]),
        ("file:///tmp/a#b", ["'#' part", "remove it"]),
        ("tcp://h:1?rank=x", ["?rank='x'", "not an integer"]),
        ("tcp://h:1?ranks=1", ["'ranks=1'", "rank=R and world_size=N"]),
        ("tcp://h:1?rank", ["'rank'", "not understood"]),
        ("tcp://h:1?rank=1&rank=2", ["rank twice"]),
    ],
)
def test_parse_init_method_rejects(url: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        parse_init_method(url)
    for word in words:
        assert word in str(info.value)


def test_parse_init_method_rejects_non_str() -> None:
    with pytest.raises(TypeError, match="str URL"):
        parse_init_method(b"env://")  # type: ignore[arg-type]


# -- rendezvous: argument checks and messages (no network) ---------------------------------


def test_missing_rank_lists_every_source() -> None:
    with pytest.raises(ValueError) as info:
        rendezvous(environ={})
    assert str(info.value).startswith(
        "cannot determine the rank (rank parameter missing): pass rank= to "
        "init_process_group, or set RANK (torch style), OMPI_COMM_WORLD_RANK (Open MPI), "
        "PMIX_RANK (PMIx), PMI_RANK (MPICH) or "
        "SLURM_PROCID (Slurm)"
    )


def test_missing_world_size_lists_every_source() -> None:
    with pytest.raises(ValueError) as info:
        rendezvous("tcp://127.0.0.1:1", rank=0, environ={"PMIX_RANK": "0"})
    message = str(info.value)
    assert message.startswith(
        "cannot determine the world size (size parameter missing): pass world_size="
    )
    for word in (
        "WORLD_SIZE",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "SLURM_NTASKS",
        "PMIx",
        "?world_size=",
    ):
        assert word in message


def test_missing_master_addr_and_port() -> None:
    with pytest.raises(ValueError, match="cannot determine the store address") as info:
        rendezvous(rank=0, world_size=1, environ={"MASTER_PORT": "1"})
    assert "MASTER_ADDR" in str(info.value)
    assert "SLURM_JOB_NODELIST" in str(info.value)
    with pytest.raises(ValueError, match="cannot determine the store port") as info:
        rendezvous(rank=0, world_size=1, environ={"MASTER_ADDR": "127.0.0.1"})
    assert "MASTER_PORT" in str(info.value)
    assert "SLURM_JOB_ID" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"rank": True, "world_size": 2}, TypeError, ["rank must be an int", "bool"]),
        ({"rank": 0, "world_size": 2.0}, TypeError, ["world_size must be an int", "float"]),
        ({"rank": -2, "world_size": 2}, ValueError, ["rank=-2", ">= 0", "-1"]),
        ({"rank": 0, "world_size": 0}, ValueError, ["world_size=0", ">= 1"]),
        ({"rank": 2, "world_size": 2}, ValueError, ["rank 2", "rank= argument", "world_size 2"]),
        ({"init_method": "udp://h:1"}, ValueError, ["unsupported scheme", "tcp://HOST:PORT"]),
        (
            {"init_method": "tcp://h:1?rank=1", "rank": 0},
            ValueError,
            ["has node-specific arguments", "(?rank)", "rank=0 came as arguments"],
        ),
        (  # even when they agree, as torch refuses it
            {"init_method": "tcp://h:1?world_size=2", "rank": 0, "world_size": 2},
            AssertionError,
            ["has node-specific arguments", "(?world_size)", "rank=0, world_size=2"],
        ),
        ({"timeout": "10"}, TypeError, ["timeout"]),
    ],
)
def test_rendezvous_rejects_bad_arguments(
    kwargs: dict[str, object], error: type, words: list[str]
) -> None:
    with pytest.raises(error) as info:
        rendezvous(environ={}, **kwargs)  # type: ignore[arg-type]
    for word in words:
        assert word in str(info.value)


def test_store_argument_rules() -> None:
    store = HashStore()
    with pytest.raises(ValueError, match=r"cannot specify both init_method .* and store"):
        rendezvous("env://", rank=0, world_size=1, store=store, environ={})
    for rank, size in ((-1, 2), (0, -1)):
        with pytest.raises(ValueError, match="needs rank and world_size given explicitly"):
            rendezvous(rank=rank, world_size=size, store=store, environ={"RANK": "0"})
    with pytest.raises(TypeError, match="distcomm Store"):
        rendezvous(rank=0, world_size=1, store={}, environ={})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank 3"):
        rendezvous(rank=3, world_size=2, store=store, environ={})


def test_store_argument_passes_through() -> None:
    store = HashStore()
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "junk", "RANK": "junk"}
    result = rendezvous(rank=1, world_size=2, store=store, environ=env)
    assert result == Rendezvous(store, 1, 2, 1, 2, None, None, "store")


def test_file_single_process(tmp_path: object) -> None:
    url = f"file://{tmp_path}/store?world_size=1&rank=0"
    result = rendezvous(url, environ={"MASTER_PORT": "ignored"}, timeout=5)
    try:
        assert isinstance(result.store, FileStore)
        assert (result.rank, result.world_size, result.source) == (0, 1, f"file://{tmp_path}/store")
        assert (result.master_addr, result.master_port) == (None, None)
        result.store.set("k", "v")
        assert result.store.get("k") == b"v"
    finally:
        result.store.close()


def test_env_single_process() -> None:
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    result = rendezvous(environ=env, timeout=timedelta(seconds=10))
    try:
        assert isinstance(result.store, TCPStore)
        assert (result.rank, result.world_size, result.source) == (0, 1, "env://")
        assert (result.master_addr, result.master_port) == ("127.0.0.1", port)
        assert result.store.add("n", 2) == 2
    finally:
        result.store.close()


def test_connect_failure_names_rank_and_address_sources() -> None:
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    with pytest.raises(DistError) as info:
        rendezvous(rank=1, world_size=2, environ=env, timeout=0.5)
    message = str(info.value)
    for word in (
        "[rank 1/2]",
        "connecting to the store at 127.0.0.1:",
        str(port),
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        assert word in message


# -- the scheme registry ----------------------------------------------------------------------


@pytest.fixture
def own_registry(monkeypatch) -> None:
    """Schemes registered by a test are forgotten after it."""
    monkeypatch.setattr(urls, "_handlers", dict(urls._handlers))


def test_registered_scheme_handler_gets_url_and_explicit_values(own_registry) -> None:
    store, calls = HashStore(), []

    def handler(url: str, **kwargs: object) -> Rendezvous:
        calls.append((url, kwargs))
        return Rendezvous(store, 1, 3, source="mine")

    register_rendezvous_handler("Mine", handler)
    env = {"RANK": "2"}
    result = rendezvous("mine://x/y?a=b", world_size=3, timeout=7, environ=env)
    assert result == Rendezvous(store, 1, 3, source="mine")
    url, kwargs = calls[0]
    assert url == "mine://x/y?a=b&world_size=3"  # as torch hands them, and as keywords
    assert kwargs == {"rank": None, "world_size": 3, "timeout": 7.0, "environ": env}


def test_registered_scheme_handler_may_yield_as_torchs_do(own_registry) -> None:
    store = HashStore()

    def handler(url: str, **kwargs: object):
        yield store, 1, 2

    register_rendezvous_handler("gen", handler)
    result = rendezvous("gen://", environ={"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    assert result == Rendezvous(store, 1, 2, 0, 1, None, None, "gen://")
    register_rendezvous_handler("tuple", lambda url, **kwargs: (store, 0, 1))
    assert rendezvous("tuple://", environ={}).world_size == 1
    register_rendezvous_handler("junk", lambda url, **kwargs: (store, "0", 1))
    with pytest.raises(TypeError, match="junk:// handler"):
        rendezvous("junk://", environ={})


def test_register_rendezvous_handler_rules(own_registry) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_rendezvous_handler("TCP", lambda url, **kwargs: None)
    with pytest.raises(ValueError, match="URL scheme"):
        register_rendezvous_handler("no scheme", lambda url, **kwargs: None)
    with pytest.raises(TypeError, match="callable"):
        register_rendezvous_handler("x", "not a function")  # type: ignore[arg-type]
    register_rendezvous_handler("etcd", lambda url, **kwargs: None)
    with pytest.raises(ValueError) as info:
        rendezvous("udp://h:1", environ={})
    assert str(info.value).endswith(
        "use env:// (the default: MASTER_ADDR, MASTER_PORT), tcp://HOST:PORT, "
        "file:///PATH or etcd://"
    )


# -- rendezvous across processes ------------------------------------------------------------


def exchange(init_method: str | None, explicit: bool, drop: tuple[str, ...]) -> dict[str, object]:
    """One rank: rendezvous, publish a key, read everyone's, close (rank 0 last)."""
    environ = dict(os.environ)
    rank = int(environ.get("TRUE_RANK", environ["RANK"]))
    size = int(environ.get("TRUE_SIZE", environ["WORLD_SIZE"]))
    for var in drop:
        environ.pop(var, None)
    if init_method is not None:
        init_method = init_method.format(rank=rank, size=size)
    kwargs = {"rank": rank, "world_size": size} if explicit else {}
    result = rendezvous(init_method, timeout=30, environ=environ, **kwargs)
    store = result.store
    try:
        store.set(f"hello/{result.rank}", f"from {result.rank}")
        keys = [f"hello/{r}" for r in range(result.world_size)]
        store.wait(keys, timedelta(seconds=30))
        values = [store.get(key).decode() for key in keys]
        store.set(f"done/{result.rank}", "1")
        if result.rank == 0:  # rank 0 may host the server: let everyone finish first
            store.wait([f"done/{r}" for r in range(result.world_size)], timedelta(seconds=30))
    finally:
        store.close()
    return {
        "rank": result.rank,
        "world_size": result.world_size,
        "local": (result.local_rank, result.local_world_size),
        "source": result.source,
        "master": (result.master_addr, result.master_port),
        "values": values,
        "mpi_initialised": "mpi4py.MPI" in sys.modules,
    }


def check_world(results: list[dict[str, object]], size: int, source: str) -> None:
    expected_values = [f"from {r}" for r in range(size)]
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        assert result["world_size"] == size
        assert result["source"] == source
        assert result["values"] == expected_values


@pytest.mark.parametrize("size", [1, 2, 4])
def test_env_world(size: int) -> None:
    port = free_port()
    init_method = "env://" if size != 2 else None
    results = run_ranks(
        exchange, size, init_method, False, (), timeout=60, env={"MASTER_PORT": str(port)}
    )
    check_world(results, size, "env://")
    for rank, result in enumerate(results):
        assert result["local"] == (rank, size)
        assert result["master"] == ("127.0.0.1", port)


def test_env_explicit_arguments_override_environment() -> None:
    port = free_port()
    # each rank's RANK and WORLD_SIZE lie; the rank= and world_size= arguments win
    results = run_ranks(
        exchange,
        2,
        "env://",
        True,
        (),
        timeout=60,
        env={"MASTER_PORT": str(port), "TRUE_SIZE": "2"},
        rank_env=lambda r: {"RANK": str(1 - r), "WORLD_SIZE": "5", "TRUE_RANK": str(r)},
    )
    check_world(results, 2, "env://")


def test_tcp_explicit_rank_and_world_size() -> None:
    port = free_port()
    results = run_ranks(
        exchange, 3, f"tcp://127.0.0.1:{port}", True, (*TORCH_VARS, "MASTER_ADDR"), timeout=60
    )
    check_world(results, 3, f"tcp://127.0.0.1:{port}")
    assert all(result["local"] == (None, None) for result in results)


def test_tcp_query_parameters() -> None:
    port = free_port()
    url = f"tcp://127.0.0.1:{port}?rank={{rank}}&world_size={{size}}"
    results = run_ranks(exchange, 2, url, False, (*TORCH_VARS, "MASTER_ADDR"), timeout=60)
    check_world(results, 2, f"tcp://127.0.0.1:{port}")


def test_file_world(tmp_path: object) -> None:
    url = f"file://{tmp_path}/shared?world_size={{size}}"
    results = run_ranks(exchange, 3, url, False, ("WORLD_SIZE",), timeout=60)
    check_world(results, 3, f"file://{tmp_path}/shared")
    assert all(result["master"] == (None, None) for result in results)


def _open_mpi_env(rank: int) -> dict[str, str]:
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": "3",
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % 2),
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "PMIX_RANK": str(rank),
    }


def test_open_mpi_environment() -> None:
    port = free_port()
    results = run_ranks(
        exchange,
        3,
        None,
        False,
        TORCH_VARS,
        timeout=60,
        env={"MASTER_PORT": str(port)},
        rank_env=_open_mpi_env,
    )
    check_world(results, 3, "Open MPI")
    assert [result["local"] for result in results] == [(0, 2), (1, 2), (0, 2)]


def _slurm_env(rank: int, plugin: str = "none") -> dict[str, str]:
    """Task `rank` of a 2-task step srun started with --mpi=`plugin`."""
    env = {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_STEP_NODELIST": "127.0.0.1",
    }
    if plugin == "pmi2":
        env.update(PMI_RANK=str(rank), PMI_SIZE="2", PMI_JOBID="4242.0")
    elif plugin == "pmix":
        env.update(PMIX_RANK=str(rank), PMIX_NAMESPACE="slurm.pmix.4242.0")
    return env


@pytest.mark.parametrize("plugin", ["none", "pmi2", "pmix"])
def test_slurm_environment(plugin: str) -> None:
    port = free_port()
    # MASTER_ADDR is dropped: the store's address comes from SLURM_STEP_NODELIST. MPI's
    # variables (srun --mpi=pmi2/pmix) do not make the ranks share it over MPI.
    results = run_ranks(
        exchange,
        2,
        "env://",
        False,
        (*TORCH_VARS, "MASTER_ADDR"),
        timeout=60,
        env={"MASTER_PORT": str(port)},
        rank_env=lambda rank: _slurm_env(rank, plugin),
    )
    check_world(results, 2, "Slurm")
    for rank, result in enumerate(results):
        assert result["local"] == (rank, 2)
        assert result["master"] == ("127.0.0.1", port)
        assert not result["mpi_initialised"]


def test_srun_task_never_loads_mpi(monkeypatch) -> None:
    def refuse():
        raise AssertionError("the rendezvous loaded mpi4py in a task srun started")

    monkeypatch.setattr(mpiutil, "is_mpi4py_available", lambda: True)
    monkeypatch.setattr(mpiutil, "load_mpi", refuse)
    env = {**_slurm_env(0, "pmix"), "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"}
    env.update(SLURM_TASKS_PER_NODE="1", SLURM_STEP_TASKS_PER_NODE="1")
    result = rendezvous(environ={**env, "MASTER_PORT": str(free_port())}, timeout=10)
    try:
        assert (result.rank, result.world_size, result.source) == (0, 1, "Slurm")
    finally:
        result.store.close()


# -- the mpi backend's world against the launcher's -------------------------------------------


@pytest.mark.parametrize(
    ("env", "words"),
    [
        (  # plain srun -n 4: no MPI plugin, every task a world of one
            {**_slurm_env(1), "SLURM_STEP_NUM_TASKS": "4"},
            ["MPI.COMM_WORLD has 1 process(es)", "a world of 4", "SLURM_STEP_NUM_TASKS=4",
             "no MPI plugin", "srun --mpi=pmi2", "MpiDefault=pmi2", "srun --mpi=list",
             "Fake MPI 1.0", "each process is an MPI world of its own"],
        ),
        (  # srun --mpi=pmix -n 4, an MPI library that does not use PMIx
            {**_slurm_env(1, "pmix"), "SLURM_STEP_NUM_TASKS": "4"},
            ["a world of 4", "its pmix plugin", "did not use", "srun --mpi=pmi2",
             "srun --mpi=pmix"],
        ),
        (  # python run straight from the batch script of a 10-task job
            BATCH,
            ["a world of 10", "SLURM_NTASKS=10", "batch script", "srun --mpi=pmi2",
             "WORLD_SIZE=1"],
        ),
        (  # Open MPI's mpirun, MPICH's mpi4py
            {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"},
            ["a world of 4", "OMPI_COMM_WORLD_SIZE=4", "Open MPI", "Fake MPI 1.0",
             "mpiexec of mpi4py's MPI library", "rebuild mpi4py"],
        ),
        (  # distcomm-run's workers
            {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"},
            ["a world of 4", "WORLD_SIZE=4", "distcomm-run", "gloo"],
        ),
    ],
)  # fmt: skip
def test_mpi_world_size_disagreement_says_what_to_do(env: dict[str, str], words: list[str]) -> None:
    with pytest.raises(DistBackendError) as info:
        check_mpi_world_size(1, "Fake MPI 1.0\nmore", environ=env)
    message = str(info.value)
    assert message.startswith("init_process_group('mpi'): ")
    for word in words:
        assert word in message


@pytest.mark.parametrize(
    "env",
    [
        {},  # no launcher: a singleton MPI world
        {**_slurm_env(1, "pmi2"), "SLURM_STEP_NUM_TASKS": "4", "PMI_SIZE": "4"},
        {"PMI_RANK": "0", "PMI_SIZE": "4"},
        {"RANK": "0", "WORLD_SIZE": "4"},
        {**BATCH, "WORLD_SIZE": "1"},  # one process on its own in a 10-task job's script
    ],
)
def test_mpi_world_size_agreement_passes(env: dict[str, str]) -> None:
    size = 1 if not env or env.get("WORLD_SIZE") == "1" else 4
    check_mpi_world_size(size, "Fake MPI 1.0", environ=env)


# -- the quickstart: which processes are ranks of a launched job --------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        (BATCH, None),  # the batch script is no rank: the quickstart starts its own
        (SLURM, "rank 9 (SLURM_PROCID, Slurm)"),
        ({**SLURM, **SRUN_PLUGINS["pmix"]}, "rank 9 (SLURM_PROCID, Slurm)"),
        ({"PMI_RANK": "2", "PMI_SIZE": "4"}, "rank 2 (PMI_RANK, MPICH)"),
        (OMPI, "rank 5 (OMPI_COMM_WORLD_RANK, Open MPI)"),
    ],
)
def test_quickstart_knows_launched_ranks(monkeypatch, env: dict[str, str], expected) -> None:
    for var in list(os.environ):
        if var.startswith(("SLURM_", "PMI", "OMPI_", "MPI_LOCAL")) or var in TORCH_VARS:
            monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert quickstart.launcher_rank() == expected


def test_agent_store_every_rank_connects() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=30)
    try:
        env = {"MASTER_PORT": str(store.port), "DISTCOMM_USE_AGENT_STORE": "1"}
        results = run_ranks(exchange, 2, "env://", False, (), timeout=60, env=env)
        check_world(results, 2, "env://")
        # the ranks wrote into the store this process hosts
        assert store.get("hello/0") == b"from 0"
        assert store.get("hello/1") == b"from 1"
    finally:
        store.close()
