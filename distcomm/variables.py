"""The declaration of every environment variable distcomm reads or sets: `VARIABLES`.

Each `EnvVar` names a variable with its type, default, meaning, who sets it and who reads
it, and the parser (`distcomm.parsers`) that turns its text into a value. `distcomm.config`
reads variables through it (`config.get`, `config.load`) and prints it as the docs'
table (`python -m distcomm.config`); a test scans the package for every variable read and
holds the reads and this declaration equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .parsers import (
    as_bytes,
    as_count,
    as_debug_level,
    as_flag,
    as_gloo_transport,
    as_nccl_bindings,
    as_non_negative,
    as_stall_seconds,
    as_text,
    as_timeout,
)

__all__ = ["DEFAULT_STORE_TIMEOUT", "DEFAULT_TIMEOUT", "FLAG_PREFIX", "VARIABLES", "EnvVar"]

#: Default timeout of a process group's blocking operations, in seconds (torch: 30 minutes).
DEFAULT_TIMEOUT = 1800.0
#: Default timeout of store operations, in seconds (torch's TCPStore: 300 s).
DEFAULT_STORE_TIMEOUT = 300.0
#: `distcomm-run` reads each flag's default from this prefix and the flag's name in capitals.
FLAG_PREFIX = "DISTCOMM_"


@dataclass(frozen=True)
class EnvVar:
    """One environment variable distcomm reads or sets.

    Attributes:
        name: the variable, e.g. `DISTCOMM_TIMEOUT`; `DISTCOMM_<FLAG>` stands for the
            family of `distcomm-run` flag defaults.
        type: what it holds, for the table: bool, seconds, size, count, text, ...
        default: the text used when it is unset or blank ("" : none).
        meaning: what it does, as the docs' table says it.
        set_by: who sets it: the user, `distcomm-run`, a launcher, or both.
        parse: turns (name, text) into the value `get` returns.
        read_by: who reads it: "distcomm" (a test holds that some module does), or, for a
            variable distcomm only sets, who it is set for ("the worker's script").
    """

    name: str
    type: str
    default: str
    meaning: str
    set_by: str = "user"
    parse: Callable[[str, str], Any] = as_text
    read_by: str = "distcomm"


_RUN = "distcomm-run"
_BOTH = "user or distcomm-run"
_WORKER = "the worker's script"
#: What the launcher variables below are for (`distcomm.launcher_env` reads them).
_PLACE = (
    "where the torch-style variables are unset: this process's rank, the world size, its "
    "rank and the rank count on its host (`distcomm.rendezvous.detect_environment` shows "
    "what was found where)"
)

#: Every variable distcomm reads or sets, in the order of the docs' table.
VARIABLES: tuple[EnvVar, ...] = (
    *(
        EnvVar(name, "text", "", "torch's rendezvous variables (`env://`)", _BOTH)
        for name in (
            "MASTER_ADDR",
            "MASTER_PORT",
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
        )
    ),
    EnvVar(
        "GROUP_RANK",
        "text",
        "",
        "torchrun's: this node's rank among the nodes of the round, set in every worker",
        _RUN,
    ),
    *(
        EnvVar(name, "text", "", _PLACE, "Open MPI's mpirun")
        for name in (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        )
    ),
    EnvVar("PMIX_RANK", "text", "", _PLACE + "; PMIx exports no size", "a PMIx launcher"),
    *(
        EnvVar(name, "text", "", _PLACE, "MPICH's or Intel MPI's mpiexec (Hydra)")
        for name in ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    ),
    EnvVar(
        "PMI_FD",
        "text",
        "",
        "set (like `OMPI_COMM_WORLD_SIZE`, `PMIX_RANK`, `PMI_RANK`, `PMI_SIZE`) when an MPI "
        "launcher started the process: without any, an Open MPI singleton's shared-memory "
        "segment is removed at exit",
        "an MPI launcher",
    ),
    *(
        EnvVar(name, "text", "", _PLACE, "Slurm")
        for name in (
            "SLURM_PROCID",
            "SLURM_STEP_NUM_TASKS",
            "SLURM_NTASKS",
            "SLURM_LOCALID",
            "SLURM_NODEID",
            "SLURM_STEP_TASKS_PER_NODE",
            "SLURM_TASKS_PER_NODE",
            "SLURM_NTASKS_PER_NODE",
        )
    ),
    *(
        EnvVar(
            name,
            "text",
            "",
            "in a Slurm job without `MASTER_ADDR`/`MASTER_PORT`: the store is served on the "
            "first node of the step (a task srun started) or of the job, on a port derived "
            "from the job and step ids",
            "Slurm",
        )
        for name in (
            "SLURM_STEP_NODELIST",
            "SLURM_JOB_NODELIST",
            "SLURM_NODELIST",
            "SLURM_JOB_ID",
            "SLURM_STEP_ID",
        )
    ),
    EnvVar(
        "DISTCOMM_AUTH_KEY",
        "text",
        "",
        "a shared secret: every store and backend connection must prove it holds the key "
        "(HMAC-SHA256 challenge) before anything is served. `distcomm-run` makes one for a "
        "single-node job when it is not set",
        _BOTH,
    ),
    EnvVar(
        "DISTCOMM_SOCKET_IFNAME",
        "text",
        "",
        "the network interface backend connections bind, e.g. `eth0` or `lo` (default: "
        "the interface that reaches the store)",
    ),
    EnvVar(
        "GLOO_SOCKET_IFNAME",
        "text",
        "",
        "torch's name for `DISTCOMM_SOCKET_IFNAME`, read when ours is unset (of a "
        "comma-separated list, the first interface)",
    ),
    EnvVar(
        "DISTCOMM_TIMEOUT",
        "seconds",
        f"{DEFAULT_TIMEOUT:g}",
        "default group timeout in seconds",
        parse=as_timeout,
    ),
    EnvVar(
        "DISTCOMM_USE_AGENT_STORE",
        "bool",
        "0",
        "`1`: the store at `MASTER_ADDR:MASTER_PORT` is already served by a launcher, so "
        "rank 0 connects to it instead of hosting it. It applies to `env://` and to a "
        '`tcp://` URL on `MASTER_PORT`; an `init_method="tcp://..."` on another port, or '
        "`store=`, is the script's own store",
        _BOTH,
        as_flag,
    ),
    EnvVar(
        "TORCHELASTIC_USE_AGENT_STORE",
        "bool",
        "0",
        "torchrun's: `True` in distcomm-run's workers. A master `TCPStore` on "
        "`MASTER_PORT` that cannot bind it then becomes a client of the agent's store, "
        "as torch's does",
        _RUN,
        as_flag,
    ),
    EnvVar(
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        "bool",
        "0",
        "torch's: `1` keeps a c10d rendezvous's own TCPStore from the workers; the agent "
        "hosts another store for them",
        _BOTH,
        as_flag,
    ),
    EnvVar(
        "DISTCOMM_STORE_PREFIX",
        "text",
        "",
        "with `DISTCOMM_USE_AGENT_STORE`, the key prefix of this round of workers",
        _RUN,
    ),
    EnvVar(
        "DISTCOMM_STORE_MAX_KEY_BYTES",
        "size",
        "8K",
        "read by the process hosting a `TCPStore`: the longest key it accepts. Sizes take "
        "a K, M or G suffix",
        parse=as_bytes,
    ),
    EnvVar(
        "DISTCOMM_STORE_MAX_VALUE_BYTES",
        "size",
        "8M",
        "read by the process hosting a `TCPStore`: the largest value it accepts (a request "
        "may carry 1 MiB more). Sizes take a K, M or G suffix",
        parse=as_bytes,
    ),
    EnvVar(
        FLAG_PREFIX + "<FLAG>",
        "flag",
        "",
        "any `distcomm-run` flag, e.g. `DISTCOMM_NPROC_PER_NODE=4` (the command line wins); "
        "torchrun's `PET_<FLAG>` too, below ours",
    ),
    *(
        EnvVar(
            name,
            "text",
            "",
            "set by `distcomm-run` in every worker, also as `TORCHELASTIC_*`",
            _RUN,
            read_by=_WORKER,
        )
        for name in ("DISTCOMM_RESTART_COUNT", "DISTCOMM_MAX_RESTARTS")
    ),
    EnvVar(
        "DISTCOMM_REPLACEMENT",
        "count",
        "",
        "set by `distcomm-run --on-failure=replace` only in a worker started in place of a "
        "failed one: which replacement of its slot it is (1 for the first); the worker must "
        "join the running group",
        _RUN,
        read_by=_WORKER,
    ),
    EnvVar(
        "DISTCOMM_REPLACED_PID",
        "text",
        "",
        "set with `DISTCOMM_REPLACEMENT`: the process id of the failed worker replaced",
        _RUN,
        read_by=_WORKER,
    ),
    EnvVar(
        "DISTCOMM_RUN_ID",
        "text",
        "",
        "set by `distcomm-run` in every worker, also as `TORCHELASTIC_*`",
        _RUN,
    ),
    EnvVar(
        "TORCHELASTIC_RUN_ID",
        "text",
        "",
        "torchrun's name for `DISTCOMM_RUN_ID`: set, `is_torchelastic_launched()` is true",
        _RUN,
    ),
    EnvVar(
        "DISTCOMM_ERROR_FILE",
        "path",
        "",
        "where `@record` writes the worker's exception (else torchelastic's "
        "`TORCHELASTIC_ERROR_FILE`)",
        _RUN,
    ),
    EnvVar(
        "TORCHELASTIC_ERROR_FILE",
        "path",
        "",
        "torchelastic's name for `DISTCOMM_ERROR_FILE`, read when ours is unset",
        _RUN,
    ),
    EnvVar(
        "DISTCOMM_TIMER_FILE",
        "path",
        "",
        "the expiration-timer pipe `timer.expires` uses",
        _RUN,
    ),
    EnvVar(
        "TORCHELASTIC_ENABLE_FILE_TIMER",
        "text",
        "",
        "torchrun's: `1` makes `distcomm-run` serve a file-based expiration timer for its "
        "workers, on `TORCHELASTIC_TIMER_FILE` when set",
    ),
    EnvVar(
        "TORCHELASTIC_TIMER_FILE",
        "path",
        "",
        "torchrun's: the named pipe of the file-based timer `TORCHELASTIC_ENABLE_FILE_TIMER` "
        "asks for (default: a new one); set in every worker then",
        _BOTH,
    ),
    EnvVar(
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
        "text",
        "",
        "torchrun's: the default of `--log_line_prefix_template`",
    ),
    EnvVar(
        "DISTCOMM_SHM_MANAGER",
        "text",
        "",
        "the address of the `file_system` strategy's manager daemon; set by the first "
        "process that starts one, so its children share it",
        "distcomm",
    ),
    EnvVar(
        "DISTCOMM_LAUNCH_VERBOSE",
        "text",
        "",
        "set (e.g. `1`): `distcomm-run` logs each round (node rank, nodes, restart count) "
        "to stderr",
    ),
    EnvVar(
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
        "seconds",
        "30",
        "torchrun's default of `--shutdown_timeout`: seconds workers get after SIGTERM "
        "before SIGKILL",
        parse=as_non_negative,
    ),
    EnvVar(
        "DISTCOMM_GLOO_TRANSPORT",
        "auto, tcp",
        "auto",
        "`auto`: gloo uses shared memory when every rank of a group is on one host, TCP "
        "otherwise; `tcp`: TCP for everything. If one rank says `tcp`, the whole group "
        "uses TCP",
        parse=as_gloo_transport,
    ),
    EnvVar(
        "DISTCOMM_TUNING",
        "field=size,...",
        "",
        "overrides the algorithm thresholds of a backend, e.g. "
        '`all_reduce_ring_min=1M,shm_chunk=512K` (see "Algorithms and tuning")',
    ),
    EnvVar(
        "DISTCOMM_HOST_ID",
        "text",
        "",
        "overrides the identity gloo uses to decide which ranks share a host (default: "
        "host name, kernel boot id and PID namespace)",
    ),
    *(
        EnvVar(
            name,
            "count",
            "",
            "the default intra-op thread count (`MKL_NUM_THREADS` first), as in torch",
        )
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
    ),
    EnvVar(
        "OPENBLAS_NUM_THREADS",
        "count",
        "",
        "OpenBLAS's thread count, reported by `python -m distcomm.info`",
    ),
    EnvVar(
        "CUDA_VISIBLE_DEVICES",
        "text",
        "",
        "CUDA's: which GPUs a process sees; named in the error for a device that does not exist",
    ),
    EnvVar(
        "PYTHONPATH",
        "text",
        "",
        "kept, behind distcomm's own location, for the shared-memory manager daemon "
        "(`distcomm.multiprocessing.shm_manager`)",
    ),
    EnvVar(
        "DISTCOMM_MPI_ABORT_ON_EXCEPTION",
        "bool",
        "1",
        "`1`: under the mpi backend an uncaught exception aborts the whole MPI job "
        "(traceback first), and Ctrl-C ends every rank with one line and status 130; "
        "`0`: off",
        parse=as_flag,
    ),
    EnvVar(
        "DISTCOMM_NCCL_BLOCKING_WAIT",
        "bool",
        "0",
        "`1`: `Work.wait()` of an `nccl` operation blocks the host until it finished, "
        "bounded by the group timeout (`0`: it only orders the caller's CUDA stream after "
        "it)",
        parse=as_flag,
    ),
    EnvVar(
        "DISTCOMM_NCCL_BINDINGS",
        "cupy, nccl4py",
        "cupy",
        "the NCCL bindings of the `nccl` backend: `cupy` (CuPy's, blocking communicators) or "
        "`nccl4py` (NVIDIA's nccl4py, non-blocking communicators that can be aborted while "
        "they initialise or while a call is in progress; `pip install nccl4py`)",
        parse=as_nccl_bindings,
    ),
    EnvVar(
        "DISTCOMM_DEBUG",
        "OFF, INFO, DETAIL",
        "",
        "`OFF` (default), `INFO` (log group setup, teardown and aborts to stderr, prefixed "
        "with the rank) or `DETAIL` (also every collective with its sequence number and "
        "signature). Aborts are logged as warnings at any level.",
        parse=as_debug_level,
    ),
    EnvVar(
        "TORCH_DISTRIBUTED_DEBUG",
        "OFF, INFO, DETAIL",
        "",
        "torch's name for `DISTCOMM_DEBUG`, read when ours is unset",
        parse=as_debug_level,
    ),
    EnvVar(
        "DISTCOMM_STALL_WARN_S",
        "seconds",
        "30",
        "seconds before a wait that is still waiting says so (`0`: never), then again "
        "after 60 s, 120 s, ...: a collective, send or receive (naming the ranks that have "
        'not entered it and what they do, see "When a job hangs"), `init_process_group` '
        "waiting for ranks that have not joined the store or reached a backend's set-up "
        "(naming them, on every waiting rank), and a TCPStore, FileStore or EtcdStore "
        "`get`/`wait`/`queue_pop` (naming the keys still missing); a TCPStore client "
        "whose server has not greeted it warns after 5 s, or this when shorter",
        parse=as_stall_seconds,
    ),
    EnvVar(
        "DISTCOMM_TRACE_BUFFER",
        "count",
        "2000",
        "how many of its last operations each group's flight recorder keeps (`0`: off). "
        'See "When a job hangs"',
        parse=as_count,
    ),
    EnvVar(
        "DISTCOMM_TRACE_DIR",
        "path",
        "",
        "where each rank writes its flight recorder (`rank-<R>.json`) on a collective "
        "timeout or failure, SIGTERM, SIGUSR1, `dump_trace()` and at an exit with "
        "unfinished operations; unset: no files. `distcomm-run` sets it for its workers "
        "when it is not set",
        _BOTH,
    ),
)
