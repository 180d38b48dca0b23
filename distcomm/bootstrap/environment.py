"""Launcher detection: what the arguments and each launcher's variables say about this process.

Torch-style launchers (distcomm-run, torchrun), the MPI launchers (Open MPI, PMIx,
MPICH/Hydra and Intel MPI) and Slurm each export the rank and world size under their own
names; a process started on its own exports none. Each value is looked up on its own; the
first source that holds it wins:

    rank           rank= argument, ?rank= in the URL, RANK (torch style),
                   OMPI_COMM_WORLD_RANK (Open MPI), PMIX_RANK (PMIx),
                   PMI_RANK (MPICH/Hydra, Intel MPI), SLURM_PROCID (Slurm)
    world size     world_size= argument, ?world_size=, WORLD_SIZE, OMPI_COMM_WORLD_SIZE,
                   PMI_SIZE, SLURM_STEP_NUM_TASKS, SLURM_NTASKS. PMIx exports no size
                   variable (its clients ask the PMIx server), so under PMIx the size
                   comes from the launcher's other variables (Open MPI's, Slurm's).
    local rank     LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID
    local size     LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS, then
                   the entry of SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE
                   (``2(x3),1``) at SLURM_NODEID, then SLURM_NTASKS_PER_NODE
    store address  the tcp:// host, MASTER_ADDR, then (env:// only) under an MPI launcher
                   an address of rank 0's host shared over MPI (`mpi`), then in a Slurm
                   job the first node of SLURM_STEP_NODELIST for a task srun started
                   (`slurm`), else of SLURM_JOB_NODELIST or SLURM_NODELIST
    store port     the tcp:// port, MASTER_PORT, then (env:// only) under an MPI launcher a
                   free port of rank 0's shared over MPI, then in a Slurm job `slurm_port`:
                   12000 + 10 * (SLURM_JOB_ID % 2000) + SLURM_STEP_ID % 10, the step term
                   only for a task srun started

The Slurm rules (tasks srun started, node lists, the derived port) are in
`distcomm.bootstrap.slurm`, the store address shared over MPI in `distcomm.bootstrap.mpi`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .base import EnvInfo, describe, optional_int, parse_int
from .slurm import expand_nodelist, slurm_local_size, slurm_port, srun_task

__all__ = ["detect_environment"]

# Per value, (variable, launcher) in precedence order.
_RANK_VARS = (
    ("RANK", "torch style"),
    ("OMPI_COMM_WORLD_RANK", "Open MPI"),
    ("PMIX_RANK", "PMIx"),
    ("PMI_RANK", "MPICH"),
    ("SLURM_PROCID", "Slurm"),
)
_SIZE_VARS = (
    ("WORLD_SIZE", "torch style"),
    ("OMPI_COMM_WORLD_SIZE", "Open MPI"),
    ("PMI_SIZE", "MPICH"),
    ("SLURM_STEP_NUM_TASKS", "Slurm"),
    ("SLURM_NTASKS", "Slurm"),
)
_LOCAL_RANK_VARS = (
    ("LOCAL_RANK", "torch style"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI"),
    ("MPI_LOCALRANKID", "MPICH"),
    ("SLURM_LOCALID", "Slurm"),
)
_LOCAL_SIZE_VARS = (
    ("LOCAL_WORLD_SIZE", "torch style"),
    ("OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI"),
    ("MPI_LOCALNRANKS", "MPICH"),
)
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
_MPI_LAUNCHERS = ("Open MPI", "PMIx", "MPICH")


def detect(
    env: Mapping[str, str], given: Mapping[str, tuple[object, str]], with_master: bool
) -> EnvInfo:
    """What `given` (name: (value, source)) and `env` say, per the module's table; the
    store's address and port too `with_master`.

    Raises:
        ValueError: a variable holds no integer, or values are out of range.
    """
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    srun = srun_task(env)
    skipped = _MPI_LAUNCHERS if srun else ()  # srun's plugin variables say what Slurm's say
    for name, table in (
        ("rank", _RANK_VARS),
        ("world_size", _SIZE_VARS),
        ("local_rank", _LOCAL_RANK_VARS),
        ("local_world_size", _LOCAL_SIZE_VARS),
    ):
        if name in given:
            values[name], sources[name] = given[name]
        elif found := next(
            (var for var, who in table if who not in skipped and env.get(var, "").strip()), None
        ):
            values[name], sources[name] = parse_int(found, env[found]), found
    if "local_world_size" not in values and (slurm := slurm_local_size(env)) is not None:
        values["local_world_size"], sources["local_world_size"] = slurm
    for name, lowest in (
        ("rank", 0),
        ("world_size", 1),
        ("local_rank", 0),
        ("local_world_size", 1),
    ):
        if name in values and values[name] < lowest:  # type: ignore[operator]
            raise ValueError(
                f"{name} {values[name]} from {describe(sources[name])} is "
                f"invalid: it must be >= {lowest}"
            )
    for low, high in (("rank", "world_size"), ("local_rank", "local_world_size")):
        if low in values and high in values and values[low] >= values[high]:  # type: ignore[operator]
            raise ValueError(
                f"{low} {values[low]} (from {describe(sources[low])}) is out of range for "
                f"{high} {values[high]} (from {describe(sources[high])}): it must run from "
                f"0 to {high} - 1; check that every process was started with the same size"
            )
    if with_master:
        _detect_master(env, given, values, sources, srun)
    return EnvInfo(**values, sources=tuple(sources.items()), srun=srun)  # type: ignore[arg-type]


def _detect_master(
    env: Mapping[str, str],
    given: Mapping[str, tuple[object, str]],
    values: dict[str, object],
    sources: dict[str, str],
    srun: bool,
) -> None:
    if "master_addr" in given:
        values["master_addr"], sources["master_addr"] = given["master_addr"]
    elif env.get("MASTER_ADDR", "").strip():
        values["master_addr"], sources["master_addr"] = env["MASTER_ADDR"].strip(), "MASTER_ADDR"
    else:
        lists = ("SLURM_STEP_NODELIST",) * srun + ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
        for var in lists:
            raw = env.get(var, "").strip()
            if raw:
                try:
                    hosts = expand_nodelist(raw)
                except ValueError as exc:
                    raise ValueError(f"{var}: {exc}") from None
                if hosts:
                    values["master_addr"], sources["master_addr"] = hosts[0], var
                    break
    if "master_port" in given:
        values["master_port"], sources["master_port"] = given["master_port"]
    elif env.get("MASTER_PORT", "").strip():
        values["master_port"] = parse_int("MASTER_PORT", env["MASTER_PORT"])
        sources["master_port"] = "MASTER_PORT"
    elif env.get("SLURM_JOB_ID", "").strip():
        job = parse_int("SLURM_JOB_ID", env["SLURM_JOB_ID"])
        step = parse_int("SLURM_STEP_ID", env["SLURM_STEP_ID"]) if srun else None
        values["master_port"] = slurm_port(job, step)
        sources["master_port"] = "SLURM_JOB_ID and SLURM_STEP_ID" if srun else "SLURM_JOB_ID"
    port = values.get("master_port")
    if port is not None and not 1 <= port <= 65535:  # type: ignore[operator]
        raise ValueError(
            f"store port {port} from {describe(sources['master_port'])} is out "
            f"of range: use a TCP port from 1 to 65535"
        )


def detect_environment(
    environ: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    with_master: bool = True,
) -> EnvInfo:
    """What `environ` (default os.environ) says about this process, per the module's table.

    Values passed explicitly win over the environment, which is then not read for them.
    Values found nowhere are None; `rendezvous` turns those it needs into errors.

    Args:
        with_master: also look for the store's address and port.

    Raises:
        ValueError: a variable holds no integer, or values are out of range (rank not
            below the world size, a port outside 1..65535), naming the variables.
    """
    given: dict[str, tuple[object, str]] = {}
    for name, value, lowest in (("rank", rank, 0), ("world_size", world_size, 1)):
        if (checked := optional_int(name, value, lowest)) is not None:
            given[name] = (checked, f"{name}= argument")
    if master_addr is not None:
        given["master_addr"] = (master_addr, "master_addr= argument")
    if master_port is not None:
        given["master_port"] = (master_port, "master_port= argument")
    return detect(os.environ if environ is None else environ, given, with_master)


def require(info: EnvInfo, name: str, hint: str = "") -> object:
    value = getattr(info, name)
    if value is not None:
        return value
    if name in ("rank", "world_size"):
        names = [
            f"{var} ({launcher})"
            for var, launcher in (_RANK_VARS if name == "rank" else _SIZE_VARS)
        ]
        note = " (PMIx exports no size variable)" if name == "world_size" else ""
        message = (
            f"cannot determine the {name.replace('_', ' ')} ({name[-4:]} parameter missing): "
            f"pass {name}= to "
            f"init_process_group, or set {', '.join(names[:-1])} or {names[-1]}{note}; "
            f"a tcp:// or file:// URL may also carry ?{name}="
        )
    elif name == "master_addr":
        message = (
            "cannot determine the store address: set MASTER_ADDR to the host name or "
            "IP address of rank 0's host (looked for MASTER_ADDR, then for "
            "SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST), or use "
            "init_method='tcp://HOST:PORT'"
        )
    else:
        message = (
            "cannot determine the store port: set MASTER_PORT to a free TCP port on rank "
            "0's host (looked for MASTER_PORT, then for SLURM_JOB_ID to derive one), or "
            "use init_method='tcp://HOST:PORT'"
        )
    raise ValueError(message + hint)


def mpi_launcher(env: Mapping[str, str]) -> tuple[str, str] | None:
    """(variable, launcher) when the first rank variable set in `env` is an MPI one and srun
    did not start this process (srun's MPI plugins export PMI variables too)."""
    if srun_task(env):
        return None
    for var, launcher in _RANK_VARS:
        if env.get(var, "").strip():
            return (var, launcher) if var in _MPI_RANK_VARS else None
    return None
