"""`distcomm-run` (also `python -m distcomm.run`): torchrun's command line, flag for flag.

Parses the flags into an `AgentConfig` and runs the elastic agent (`agent/`). `main` is
the command: it reports a failure on stderr and returns the exit status (bad flags: usage
and status 2). The Python API of ``torch.distributed.run`` is `distcomm.run`, built on
this module: its ``main(args)`` and `run(args)` raise on failure as torch's do. Every flag
is also read from a ``DISTCOMM_<FLAG>`` environment variable (``DISTCOMM_NPROC_PER_NODE=4``)
or torchrun's ``PET_<FLAG>``; a flag on the command line wins over the variables (ours over
torchrun's), which win over the built-in default. Flags accept dashes and underscores alike.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import uuid
from collections.abc import Callable, Sequence

from .._version import __version__
from ..config import positive_seconds
from ..net import format_address
from .agent import DEFAULT_SIGNALS_TO_HANDLE, AgentConfig, launch
from .agent.replace import DEFAULT_MAX_REPLACEMENTS, ON_FAILURE_MODES, check_on_failure
from .agent.worker_env import script_command
from .api import LaunchConfig, run_agent
from .env_flags import EnvDefault, EnvFlag, flag_names
from .events import get_event_handler
from .flag_values import (
    RDZV_BACKENDS,
    START_METHODS,
    check_max_restarts,
    comma_separated_list,
    determine_local_world_size,
    parse_filters,
    parse_min_max_nnodes,
    parse_rdzv_conf,
    parse_signals,
    signal_names,
)
from .logs_specs import get_logs_specs_class
from .numa import AFFINITY_MODES, NumaOptions
from .rendezvous.settings import effective_backend
from .workers import parse_local_ranks_filter, parse_std

__all__ = [
    "config_from_args",
    "determine_local_world_size",
    "get_args_parser",
    "get_rdzv_endpoint",
    "get_use_env",
    "launch_config_from_args",
    "main",
    "parse_args",
    "parse_min_max_nnodes",
    "parse_signals",
    "run",
    "run_script_path",
]

DEFAULT_MASTER_PORT = 29500

_EPILOG = """\
Every flag can also be set with an environment variable named DISTCOMM_ and the flag's
name in capitals with underscores (DISTCOMM_NPROC_PER_NODE=4, DISTCOMM_STANDALONE=1), or
with torchrun's name for it, PET_ and the same (PET_NPROC_PER_NODE=4). Precedence: the
command line, then DISTCOMM_<FLAG>, then PET_<FLAG>, then the default.

Workers get RANK, LOCAL_RANK, GROUP_RANK, ROLE_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE,
GROUP_WORLD_SIZE, ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR, MASTER_PORT,
DISTCOMM_RESTART_COUNT, DISTCOMM_MAX_RESTARTS and DISTCOMM_RUN_ID (also as
TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS and TORCHELASTIC_RUN_ID),
TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_ERROR_FILE (and DISTCOMM_ERROR_FILE),
TORCHELASTIC_TIMER_FILE (and DISTCOMM_TIMER_FILE; the agent always serves expiration
timers, so TORCHELASTIC_ENABLE_FILE_TIMER is not needed), TORCHELASTIC_SIGNALS_TO_HANDLE,
TORCH_NCCL_ASYNC_ERROR_HANDLING (1 unless set), OMP_NUM_THREADS (cores / workers per node,
unless set), and what distcomm.init_process_group() needs with no arguments.

torchrun's variables read by the agent: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (the default
of --log-line-prefix-template), TORCH_ELASTIC_SHUTDOWN_TIMEOUT (the default of
--shutdown-timeout), TORCHELASTIC_TIMER_FILE (the path of the timers' pipe, with
TORCHELASTIC_ENABLE_FILE_TIMER=1 as in torchrun; the pipe is served either way).
"""


def get_args_parser() -> argparse.ArgumentParser:
    """The argument parser of distcomm-run."""
    parser = argparse.ArgumentParser(
        prog="distcomm-run",
        description="distcomm's elastic launcher (torchrun's flags and semantics): starts "
        "--nproc_per_node workers on this node, joins them with the other nodes "
        "of the run, restarts the group on failures and membership changes.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"distcomm-run (distcomm {__version__})"
    )

    def add(flag: str, help: str, **kwargs: object) -> None:
        parser.add_argument(*flag_names(flag), action=EnvDefault, help=help, **kwargs)  # type: ignore[arg-type]

    def flag(flag: str, help: str, *short: str) -> None:
        parser.add_argument(*short, *flag_names(flag), action=EnvFlag, help=help)

    add(
        "nnodes",
        "number of nodes, or the range MIN:MAX for an elastic job (default 1:1)",
        default="1:1",
    )
    add(
        "nproc_per_node",
        "workers per node: an integer, 'cpu' (one per CPU core), 'gpu' "
        "(one per GPU) or 'auto' (GPUs if any, else CPU cores) (default 1)",
        default="1",
    )
    add(
        "node_rank",
        "this node's rank for --rdzv_backend=static (0..nnodes-1)",
        type=int,
        default=None,
    )
    add(
        "master_addr",
        "static rendezvous: the address of node 0 (default 127.0.0.1)",
        default="127.0.0.1",
    )
    add(
        "master_port",
        "static rendezvous: node 0's store port (default: a free port on "
        f"a single node, else {DEFAULT_MASTER_PORT})",
        type=int,
        default=None,
    )
    add(
        "rdzv_backend",
        f"rendezvous backend: {', '.join(RDZV_BACKENDS)}, or one a plug-in registers "
        "(default static)",
        default="static",
    )
    add(
        "rdzv_endpoint",
        "rendezvous endpoint: host[:port] for c10d (port 29400 when "
        "omitted) and etcd (port 2379), a shared file's path for file",
        default="",
    )
    add("rdzv_id", "run id shared by every node of the job (default 'none')", default="none")
    add(
        "rdzv_conf",
        "rendezvous settings key=value,...: join_timeout, last_call_timeout, "
        "close_timeout, read_timeout, is_host, keep_alive_interval, "
        "keep_alive_max_attempt, timeout (static/etcd join timeout), rank (static node "
        "rank), store_type (tcp or file, for c10d), etcd_prefix, protocol (http); "
        "torch's heartbeat_timeout and use_libuv are accepted and have no effect",
        default="",
    )
    flag(
        "standalone",
        "single-node job: a c10d rendezvous on a free local port with a "
        "random run id (--rdzv_backend/--rdzv_endpoint/--rdzv_id are ignored)",
    )
    add(
        "max_restarts",
        "restarts of the worker group on failures before the run fails "
        "(counted over the whole run, not per node; default 0)",
        type=int,
        default=0,
    )
    add(
        "on_failure",
        "what a failed worker costs: 'restart' (the default) stops every worker and "
        "restarts the group, as torchrun does; 'replace' starts a new worker with the same "
        "ranks in its place (DISTCOMM_REPLACEMENT=<k> and DISTCOMM_REPLACED_PID set) while "
        "the others run on, no rendezvous redone: it must join the running group",
        default="restart",
        choices=ON_FAILURE_MODES,
    )
    add(
        "max_replacements",
        "--on_failure=replace: replacements this node starts over the whole run; a "
        f"failure past them restarts the workers as --max_restarts allows (default "
        f"{DEFAULT_MAX_REPLACEMENTS})",
        type=int,
        default=DEFAULT_MAX_REPLACEMENTS,
    )
    add(
        "monitor_interval",
        "seconds between checks of the workers (default 0.1)",
        type=float,
        default=0.1,
    )
    add(
        "start_method",
        f"{', '.join(START_METHODS)}: accepted for torchrun compatibility and has no "
        "effect. torchrun applies it only to function entrypoints (its elastic_launch); a "
        "script always runs in a new process, here as there. distcomm's elastic_launch "
        "also runs a function in a fresh interpreter (spawn's way) whatever the method: "
        "forking the agent, whose store, timer and output threads are running, could "
        "leave a worker with a lock held by a thread that does not exist in it",
        default="spawn",
        choices=START_METHODS,
    )
    add(
        "event_log_handler",
        "where the agent's events go (rendezvous done, workers started, failed, "
        "restarted, the outcome), as torchrun's JSON lines: console (stderr), null (dropped; "
        "the default) or a handler registered in the distcomm.event_handlers entry-point "
        "group",
        default="null",
    )
    add("role", "the workers' role name (ROLE_NAME; default 'default')", default="default")
    flag("module", "run the script as a module, like 'python -m'", "-m")
    flag("no_python", "run the script as a program, without prepending 'python'")
    flag(
        "run_path",
        "run the script (an absolute path) with runpy.run_path in a Python "
        "interpreter; takes precedence over --no_python",
    )
    add(
        "log_dir",
        "directory for the workers' log and error files (a run_id_xxxxx "
        "subdirectory per run, attempt_N per restart)",
        default=None,
    )
    parser.add_argument(
        "-r",
        *flag_names("redirects"),
        action=EnvDefault,
        default="0",
        help="send workers' streams to log files only: 0 none, 1 stdout, 2 "
        "stderr, 3 both, for all local ranks ('3') or per local rank "
        "('0:1,1:2')",
    )
    parser.add_argument(
        "-t",
        *flag_names("tee"),
        action=EnvDefault,
        default="0",
        help="like --redirects, but also to the console, each line prefixed with "
        "torchrun's '[<role><local rank>]:' ('[default0]:')",
    )
    add(
        "local_ranks_filter",
        "show only these local ranks' output on the console "
        "('0' or '0,2'; log files keep everything)",
        default="",
    )
    add(
        "duplicate_stdout_filters",
        "also write the teed stdout lines (see --tee) that contain any of these "
        "comma-separated strings (',,' for a comma) to <log_dir>/.../attempt_N/"
        "filtered_stdout.log, prefixed, as torchrun does; nothing is filtered when empty",
        default=[],
        type=comma_separated_list,
    )
    add(
        "duplicate_stderr_filters",
        "the same for stderr, into filtered_stderr.log",
        default=[],
        type=comma_separated_list,
    )
    add(
        "log_line_prefix_template",
        "prefix each console line of a worker with this template (${rank}, "
        "${local_rank}, ${role_name}); default: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE "
        "(torchrun's variable), else '[${role_name}${local_rank}]:' for teed streams and "
        "none otherwise. distcomm's flag: torchrun reads the variable only, and applies it "
        "to teed streams only",
        default=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
    )
    add(
        "logs_specs",
        "the LogsSpecs (where each attempt's log files go) registered under this name: "
        "'default' (torchrun's layout, the default), or one an installed package declares "
        "in the distcomm.logs_specs entry-point group",
        default=None,
    )
    add(
        "numa_binding",
        f"{', '.join(AFFINITY_MODES)}: bind each worker's CPUs (sched_setaffinity) to "
        "its NUMA node, that node's socket, an exclusive share of the node's cores, or one "
        "core complex (cores sharing the last-level cache). Workers are spread over the "
        "NUMA nodes in blocks by local rank (torchrun follows each worker's GPU). On a "
        "machine whose topology is flat for the mode, a one-line message says so and "
        "affinity is left alone",
        default=None,
        choices=AFFINITY_MODES,
    )
    add(
        "local_addr",
        "the address other nodes reach this node at, for the workers' store "
        "that node 0 hosts with --rdzv_backend=etcd or file (default: 127.0.0.1 for "
        "single-node jobs; else an IP: the source address of the route to the etcd "
        "endpoint, or for file the address of the default route's interface)",
        default=None,
    )
    add(
        "shutdown_timeout",
        "seconds workers get after SIGTERM before SIGKILL when the group is stopped "
        "(default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, torchrun's variable, else 30)",
        type=float,
        default=os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"),
    )
    add(
        "signals_to_handle",
        "comma-separated signals that stop the run, as in torchrun: "
        "the agent sends the signal to every worker's process group, SIGKILL after "
        "--shutdown_timeout, and exits 128+signal (default "
        f"{signal_names(DEFAULT_SIGNALS_TO_HANDLE)}). SIGUSR1 and SIGUSR2, unless listed "
        "here, are passed on to every worker process and the run goes on, so that a Slurm "
        "job (sbatch --signal=USR1@120) can checkpoint before it is pre-empted; list them "
        "to make them stop the run instead",
        default=signal_names(DEFAULT_SIGNALS_TO_HANDLE),
    )
    flag(
        "virtual_local_rank",
        "every worker sees LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES set to its own GPU "
        "(the local-rank-th entry of the agent's CUDA_VISIBLE_DEVICES, or the local rank "
        "when unset), so each uses device 0, as torchrun does",
    )
    parser.add_argument(
        "training_script",
        help="the program (or module with -m) each worker runs, followed by its arguments",
    )
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse distcomm-run's command line (default: sys.argv[1:]).

    Raises:
        SystemExit: argparse's status 2 for an unknown flag or a value of the wrong type
            (after printing the usage), as torch's ``parse_args``.
        ValueError: a DISTCOMM_<FLAG> or PET_<FLAG> variable holds a bad value.
    """
    return get_args_parser().parse_args(args)


def _default_master_port(max_nodes: int) -> int:
    """The static rendezvous's port without --master_port: a free one (0) for a single
    node, torch's 29500 for several (which must agree on it)."""
    return 0 if max_nodes == 1 else DEFAULT_MASTER_PORT


def get_use_env(args: argparse.Namespace) -> bool:
    """Whether the workers read LOCAL_RANK from the environment only (torch's
    ``get_use_env``): True, unless the legacy launcher's ``--use-env`` flag is there and
    off, when each worker is also passed ``--local-rank=N``."""
    return bool(getattr(args, "use_env", True))


def get_rdzv_endpoint(args: argparse.Namespace) -> str:
    """The rendezvous endpoint the flags name (torch's ``get_rdzv_endpoint``):
    --rdzv_endpoint, or for --rdzv_backend=static without one, "MASTER_ADDR:MASTER_PORT".
    Without --master_port that port is 0 (a free port, chosen at launch) for one node and
    29500 for several, as distcomm-run chooses it."""
    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        port = args.master_port
        if port is None:
            port = _default_master_port(parse_min_max_nnodes(args.nnodes, from_flags=True)[1])
        return format_address(args.master_addr, int(port))
    return str(args.rdzv_endpoint)


def run_script_path(training_script: str, *training_script_args: str) -> None:
    """Run a Python script in this interpreter as ``__main__``, with `training_script_args`
    as its arguments (sys.argv is replaced): what a worker does under --run_path."""
    sys.argv = [training_script, *training_script_args]
    runpy.run_path(training_script, run_name="__main__")


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """The launch configuration the parsed flags describe.

    Raises:
        ValueError: a flag's value is invalid or contradicts another; the message names it.
    """
    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes, from_flags=True)
    nproc = determine_local_world_size(args.nproc_per_node, from_flags=True)
    backend, endpoint, run_id = args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id
    if args.standalone:
        if max_nodes != 1:
            raise ValueError(
                f"--standalone runs one node, but --nnodes={args.nnodes}: drop "
                f"--standalone and use --rdzv_backend=c10d for several nodes"
            )
        backend, endpoint, run_id = "c10d", "localhost:0", str(uuid.uuid4())
    rdzv_conf = parse_rdzv_conf(args.rdzv_conf)
    backend = effective_backend(backend, rdzv_conf)
    if backend not in RDZV_BACKENDS:
        from .rendezvous import registered_rendezvous_backends  # plug-ins, entry points

        known = registered_rendezvous_backends()
        if backend not in known:
            raise ValueError(
                f"--rdzv_backend={backend!r} is not one of {', '.join(known)} (a plug-in "
                "registers its own with rendezvous_handler_registry, or declares it in the "
                "'distcomm.rendezvous_handlers' or 'torchrun.handlers' entry-point group)"
            )
    if args.start_method not in START_METHODS:  # a DISTCOMM_START_METHOD default skips choices
        raise ValueError(
            f"--start_method={args.start_method!r} is not one of {', '.join(START_METHODS)}"
        )
    max_restarts = check_max_restarts(args.max_restarts)
    on_failure, max_replacements = check_on_failure(args.on_failure, args.max_replacements)
    monitor = positive_seconds("--monitor_interval", float(args.monitor_interval))
    shutdown = positive_seconds(
        "--shutdown_timeout (or TORCH_ELASTIC_SHUTDOWN_TIMEOUT)", args.shutdown_timeout, zero=True
    )
    node_rank = -1 if args.node_rank is None else int(args.node_rank)
    master_port = args.master_port
    if backend == "static":
        if min_nodes != max_nodes:
            raise ValueError(
                f"--rdzv_backend=static needs a fixed --nnodes, got "
                f"{args.nnodes}: use c10d, etcd or file for an elastic range"
            )
        if max_nodes == 1:
            node_rank = 0 if node_rank == -1 else node_rank
        if not 0 <= node_rank < max_nodes:
            raise ValueError(
                f"--node_rank must be in 0..{max_nodes - 1} for --nnodes="
                f"{args.nnodes} with --rdzv_backend=static, got "
                f"{args.node_rank}"
            )
        if master_port is None:
            master_port = _default_master_port(max_nodes)
    if master_port is not None and not 0 <= int(master_port) <= 65535:
        raise ValueError(f"--master_port must be in 0..65535, got {master_port}")
    if backend in ("c10d", "etcd", "file") and not endpoint:
        if backend == "file":
            raise ValueError(
                "--rdzv_backend=file needs --rdzv_endpoint=PATH (a file on a "
                "filesystem every node shares)"
            )
        if max_nodes > 1 or backend == "etcd":
            raise ValueError(
                f"--rdzv_backend={backend} needs --rdzv_endpoint=HOST[:PORT] "
                f"naming the {'etcd server' if backend == 'etcd' else 'node'} "
                f"every agent reaches"
            )
        endpoint = "localhost:0"
    redirects = parse_std(str(args.redirects), nproc, "--redirects")
    tee = parse_std(str(args.tee), nproc, "--tee")
    console = parse_local_ranks_filter(str(args.local_ranks_filter or ""), nproc)
    signals = parse_signals(args.signals_to_handle)
    get_event_handler(str(getattr(args, "event_log_handler", "null")))  # a bad name, named
    numa = getattr(args, "numa_binding", None)
    if numa is not None and numa not in AFFINITY_MODES:  # from a variable: choices skipped
        raise ValueError(f"--numa_binding={numa!r} is not one of {', '.join(AFFINITY_MODES)}")
    logs_specs = get_logs_specs_class(getattr(args, "logs_specs", None))(
        log_dir=args.log_dir, redirects=redirects, tee=tee, local_ranks_filter=console
    )
    return AgentConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        command=script_command(
            args.training_script,
            args.training_script_args,
            run_path=args.run_path,
            no_python=args.no_python,
            module=args.module,
        ),
        name=os.path.basename(args.training_script),
        run_id=run_id,
        role=args.role,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_conf,
        max_restarts=max_restarts,
        on_failure=on_failure,
        max_replacements=max_replacements,
        monitor_interval=monitor,
        log_dir=args.log_dir,
        redirects=redirects,
        tee=tee,
        console_ranks=console,
        log_line_prefix_template=args.log_line_prefix_template,
        local_addr=args.local_addr,
        node_rank=node_rank,
        master_addr=args.master_addr,
        master_port=0 if master_port is None else int(master_port),
        shutdown_timeout=shutdown,
        signals_to_handle=signals,
        logs_specs=logs_specs,
        event_log_handler=str(getattr(args, "event_log_handler", "null")),
        numa_binding=None if numa is None else NumaOptions(numa),
        duplicate_stdout_filters=parse_filters(getattr(args, "duplicate_stdout_filters", [])),
        duplicate_stderr_filters=parse_filters(getattr(args, "duplicate_stderr_filters", [])),
        virtual_local_rank=bool(getattr(args, "virtual_local_rank", False)),
        from_flags=True,
    )


def launch_config_from_args(
    args: argparse.Namespace,
) -> tuple[LaunchConfig, Callable[..., None] | str, list[str]]:
    """torch's ``config_from_args``: the flags as ``(LaunchConfig, entrypoint, args)`` for
    ``elastic_launch(config, entrypoint)(*args)`` (``distcomm.run.config_from_args``).

    The entrypoint is the Python interpreter (its arguments ``-u [-m] SCRIPT ...``), the
    program itself with --no-python, or `run_script_path` with --run-path;
    ``--local-rank=${local_rank}`` comes first among the script's arguments when
    `get_use_env` is False. A static rendezvous gets "MASTER_ADDR:MASTER_PORT" as its
    endpoint and the node rank as ``rdzv_configs["rank"]``; --standalone gives c10d on a
    free local port with a random run id. Checked as distcomm-run checks the flags.

    Raises:
        ValueError: a flag's value is invalid or contradicts another; the message names it.
            --on_failure=replace is refused: LaunchConfig cannot carry it.
    """
    agent = config_from_args(args)
    if agent.on_failure != "restart":  # LaunchConfig has torch's fields, and only those
        raise ValueError(
            f"--on_failure={agent.on_failure} has no LaunchConfig field (torch's fields only): "
            "run these flags with distcomm.run.run(args) or distcomm-run"
        )
    endpoint, conf = agent.rdzv_endpoint, dict(agent.rdzv_configs)
    if agent.rdzv_backend == "static":
        endpoint = format_address(agent.master_addr, agent.master_port)
        conf["rank"] = agent.node_rank
    config = LaunchConfig(
        min_nodes=agent.min_nodes,
        max_nodes=agent.max_nodes,
        nproc_per_node=agent.nproc_per_node,
        logs_specs=agent.logs_specs,
        run_id=agent.run_id,
        role=agent.role,
        rdzv_endpoint=endpoint,
        rdzv_backend=agent.rdzv_backend,
        rdzv_configs=conf,
        max_restarts=agent.max_restarts,
        monitor_interval=agent.monitor_interval,
        start_method=args.start_method,
        log_line_prefix_template=agent.log_line_prefix_template,
        local_addr=agent.local_addr,
        event_log_handler=agent.event_log_handler,
        numa_options=agent.numa_binding,
        signals_to_handle=signal_names(agent.signals_to_handle),
        duplicate_stdout_filters=list(agent.duplicate_stdout_filters),
        duplicate_stderr_filters=list(agent.duplicate_stderr_filters),
        virtual_local_rank=agent.virtual_local_rank,
        shutdown_timeout=agent.shutdown_timeout,
    )
    entrypoint: Callable[..., None] | str
    if args.run_path:
        entrypoint, entry_args = run_script_path, [args.training_script]
    elif args.no_python:
        entrypoint, entry_args = args.training_script, []
    else:
        entrypoint = sys.executable
        entry_args = ["-u", *(["-m"] if args.module else []), args.training_script]
    if not get_use_env(args):
        entry_args.append("--local-rank=${local_rank}")
    return config, entrypoint, [*entry_args, *args.training_script_args]


def run(args: argparse.Namespace) -> None:
    """Run the job the parsed flags describe on this node (torch's ``run(args)``).

    Returns once every worker succeeded.

    Raises:
        ChildFailedError: the run failed (its report names every failed rank).
        SignalException: the agent was stopped by one of --signals-to-handle.
        ValueError: a flag's value is invalid; DistError: the rendezvous failed.
    """
    run_agent(config_from_args(args))


def main(argv: Sequence[str] | None = None) -> int:
    """The `distcomm-run` command with `argv` (default sys.argv[1:]); returns the exit status.

    A failed run has printed its report (one block per failed rank) and returns a nonzero
    status; bad flags print the usage and the error and return 2. For the Python API that
    raises instead, as torch's ``torch.distributed.run.main``, use ``distcomm.run.main``.
    """
    try:
        parser = get_args_parser()
    except ValueError as exc:  # a DISTCOMM_<FLAG> or PET_<FLAG> variable holds a bad value
        print(f"distcomm-run: error: {exc}", file=sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return launch(config)


if __name__ == "__main__":
    sys.exit(main())
