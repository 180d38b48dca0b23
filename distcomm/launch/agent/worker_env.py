"""The command, environment and console prefix of each worker of a round, as torchrun
sets them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ... and their TORCHELASTIC_ twins)."""

from __future__ import annotations

import os
import signal
import string
import sys
from collections.abc import Sequence
from typing import NamedTuple

from ...parallel import physical_cores
from ..output import Std
from ..rendezvous import RendezvousInfo
from .config import AgentConfig
from .replace import REPLACEMENT_VARS

__all__ = ["DEFAULT_PREFIX_TEMPLATE", "WorkerSpecs", "script_command", "worker_specs"]

#: torchrun's prefix of teed console lines: role name and *local* rank ("[default0]:")
DEFAULT_PREFIX_TEMPLATE = "[${role_name}${local_rank}]:"


class WorkerSpecs(NamedTuple):
    """What starts a node's workers for one round; every mapping is keyed by local rank."""

    commands: dict[int, list[str]]
    envs: dict[int, dict[str, str]]
    prefixes: dict[int, str]
    #: local rank -> global rank
    ranks: dict[int, int]


def worker_specs(
    c: AgentConfig,
    info: RendezvousInfo,
    restarts: int,
    base: dict[str, str],
    master: tuple[str, int],
    timer_file: str | None,
) -> WorkerSpecs:
    """The workers of this node for round `info`.

    Args:
        c: the agent's configuration.
        info: the round (this node's rank, the number of nodes).
        restarts: the run's restart count so far.
        base: the environment every worker starts from (changed here: the variables all
            workers share are set in it).
        master: the address of the workers' store (MASTER_ADDR, MASTER_PORT).
        timer_file: the expiration timers' pipe, or None when no timer server runs.

    Raises:
        ValueError: --virtual-local-rank with fewer CUDA_VISIBLE_DEVICES than workers.
    """
    host, port = master
    nproc, world = c.nproc_per_node, c.nproc_per_node * info.world_size
    base.setdefault("OMP_NUM_THREADS", str(max(1, physical_cores() // nproc)))
    # torchrun's: its agent exports the signals it handles; NCCL's error handling is on
    base["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(
        signal.Signals(sig).name for sig in c.signals_to_handle
    )
    base.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    for name in REPLACEMENT_VARS:  # a launcher inside a replacement: its workers are not
        base.pop(name, None)
    visible = base.get("CUDA_VISIBLE_DEVICES")
    commands, envs, prefixes = {}, {}, {}
    ranks = {}
    for local_rank in range(nproc):
        rank = info.rank * nproc + local_rank
        ranks[local_rank] = rank
        env = dict(base)  # WorkerProcesses adds the error-file variables
        env.update(
            {
                "LOCAL_RANK": str(local_rank),
                "RANK": str(rank),
                "GROUP_RANK": str(info.rank),
                "ROLE_RANK": str(rank),
                "ROLE_NAME": c.role,
                "LOCAL_WORLD_SIZE": str(nproc),
                "WORLD_SIZE": str(world),
                "GROUP_WORLD_SIZE": str(info.world_size),
                "ROLE_WORLD_SIZE": str(world),
                "MASTER_ADDR": host,
                "MASTER_PORT": str(port),
                "DISTCOMM_USE_AGENT_STORE": "1",
                "TORCHELASTIC_USE_AGENT_STORE": "True",  # torchrun's value
                "DISTCOMM_STORE_PREFIX": f"/worker/round_{info.round}",
                "DISTCOMM_TIMER_FILE": timer_file or "",
            }
        )
        if timer_file:  # torchrun's name of the expiration timers' file
            env["TORCHELASTIC_TIMER_FILE"] = timer_file
        if c.virtual_local_rank:  # as torchrun: LOCAL_RANK 0, its own GPU as device 0
            env["LOCAL_RANK"] = "0"
            env["CUDA_VISIBLE_DEVICES"] = _visible_device(visible, local_rank)
        for name, value in (
            ("RESTART_COUNT", str(restarts)),
            ("MAX_RESTARTS", str(c.max_restarts)),
            ("RUN_ID", c.run_id),
        ):
            env[f"DISTCOMM_{name}"] = env[f"TORCHELASTIC_{name}"] = value
        # torch's macro: ${local_rank} in an argument becomes the worker's local rank
        commands[local_rank] = [
            string.Template(arg).safe_substitute(local_rank=local_rank) if "$" in arg else arg
            for arg in c.command
        ]
        if c.local_rank_argv_index is not None:
            commands[local_rank].insert(c.local_rank_argv_index, f"--local-rank={local_rank}")
        envs[local_rank] = env
        template = c.log_line_prefix_template
        if template is None and c.tee.get(local_rank, Std.NONE) != Std.NONE:
            template = DEFAULT_PREFIX_TEMPLATE
        prefixes[local_rank] = string.Template(template or "").safe_substitute(
            rank=rank, local_rank=local_rank, role_name=c.role
        )
    return WorkerSpecs(commands, envs, prefixes, ranks)


def script_command(
    script: str, script_args: Sequence[str], *, run_path: bool, no_python: bool, module: bool
) -> list[str]:
    """Every worker's command for distcomm-run's script and its arguments: ``python -u
    SCRIPT ...``, ``python -u -m MODULE ...`` (`module`), the program itself
    (`no_python`), or the script run through ``runpy.run_path`` (`run_path`, which wins).

    Raises:
        ValueError: `run_path` with a relative script, or both `no_python` and `module`
            (torch's sentence; the message names the flags).
    """
    rest = list(script_args)
    if run_path:
        if not os.path.isabs(script):
            raise ValueError(f"--run_path needs the script as an absolute path, got {script!r}")
        runner = (
            "import runpy, sys; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')"
        )
        return [sys.executable, "-u", "-c", runner, script, *rest]
    if no_python and module:
        raise ValueError(
            "Don't use both the '--no-python' flag and the '--module' flag at the same time. "
            "--no_python and -m/--module: a module needs the Python interpreter; drop one "
            "of the two flags."
        )
    if no_python:
        return [script, *rest]
    if module:
        return [sys.executable, "-u", "-m", script, *rest]
    return [sys.executable, "-u", script, *rest]


def _visible_device(visible: str | None, local_rank: int) -> str:
    """torchrun's --virtual-local-rank: the `local_rank`-th entry of CUDA_VISIBLE_DEVICES,
    or the local rank itself when it is unset.

    Raises:
        ValueError: CUDA_VISIBLE_DEVICES lists fewer devices than there are workers.
    """
    if visible is None:
        return str(local_rank)
    devices = visible.split(",")
    if local_rank >= len(devices):
        raise ValueError(
            f"--virtual-local-rank: local rank {local_rank} has no device in "
            f"CUDA_VISIBLE_DEVICES={visible!r} ({len(devices)} listed); list one per worker "
            "or lower --nproc-per-node"
        )
    return devices[local_rank].strip()
