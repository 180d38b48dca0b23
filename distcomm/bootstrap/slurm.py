"""Slurm: node lists, the store port derived from a job, and tasks that srun started.

Tasks srun started. A process is one task of a step that srun started when SLURM_JOB_ID,
SLURM_STEP_ID, SLURM_PROCID and SLURM_STEP_NUM_TASKS are set, OMPI_COMM_WORLD_RANK is not,
and the variables of srun's MPI plugin, where set (``--mpi=pmi2``: PMI_RANK and PMI_SIZE,
``--mpi=pmix``: PMIX_RANK), agree with SLURM_PROCID and SLURM_STEP_NUM_TASKS. Such a task
takes its place from Slurm whatever plugin srun ran: rank SLURM_PROCID, world size
SLURM_STEP_NUM_TASKS, local rank SLURM_LOCALID (the torch-style variables still come
first), the store at the step's first node on the step's port, so that concurrent steps
of one job do not meet; and the store address is never bootstrapped over MPI, so MPI is
not initialised: importing mpi4py runs MPI_Init, which kills the process in C when srun's
PMI is one that mpi4py's MPI does not speak (pip's MPICH under ``--mpi=pmix``). Other
processes of a job use only the job-level variables: the batch script sees no step, and
ranks that mpirun or mpiexec starts inside a job see the batch step's variables on the
first node and a daemon step's elsewhere, while the job-level ones agree everywhere. The
derived port lies in 12000-31999, below Linux's ephemeral range (32768-60999), so no
outgoing connection holds it; jobs whose ids are equal modulo 2000 and share a first node
collide, and so do steps whose ids are equal modulo 10: set MASTER_PORT.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping

from .base import parse_int

__all__ = ["expand_nodelist", "slurm_port"]

# What a task srun started has; (MPI plugin variable, the Slurm variable it must agree with).
_SRUN_VARS = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
_SRUN_PLUGIN_VARS = (
    ("PMIX_RANK", "SLURM_PROCID"),
    ("PMI_RANK", "SLURM_PROCID"),
    ("PMI_SIZE", "SLURM_STEP_NUM_TASKS"),
)
_MAX_RANGE = 65536  # hosts in one lo-hi range (Slurm's limit)
_MAX_HOSTS = 1 << 20  # hosts in one node list
_SLURM_PORT_BASE = 12000


def _bad_nodelist(spec: str, problem: str) -> ValueError:
    return ValueError(
        f"malformed Slurm node list {spec!r}: {problem}; expected names such as "
        f"node[01-04,07], gpu-a[1-2],gpu-b3 or host1,host2"
    )


def _range_values(spec: str, body: str) -> list[str]:
    values: list[str] = []
    for item in body.split(","):
        match = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", item)
        if match is None:
            raise _bad_nodelist(spec, f"[{body}] holds {item!r}, not a number or a range lo-hi")
        lo_text, hi_text = match.groups()
        lo, hi = int(lo_text), int(hi_text if hi_text is not None else lo_text)
        if hi < lo:
            raise _bad_nodelist(spec, f"range {item!r} runs backwards")
        if hi - lo + 1 > _MAX_RANGE:
            raise _bad_nodelist(spec, f"range {item!r} holds more than {_MAX_RANGE} hosts")
        values.extend(f"{n:0{len(lo_text)}d}" for n in range(lo, hi + 1))
    return values


def _expand_token(spec: str, token: str) -> list[str]:
    pieces = re.split(r"\[([^\[\]]*)\]", token)
    literals, groups = pieces[0::2], [_range_values(spec, body) for body in pieces[1::2]]
    if math.prod(len(g) for g in groups) > _MAX_HOSTS:
        raise _bad_nodelist(spec, f"{token!r} names more than {_MAX_HOSTS} hosts")
    # Slurm's hostlist expands the last group innermost and the groups before it from right
    # to left, outermost first: a[1-2]b[3-4]c[5-6] gives a1b3c5 a1b3c6 a2b3c5 a2b3c6 a1b4c5...
    order = [*range(len(groups) - 2, -1, -1), len(groups) - 1] if groups else []
    hosts = []
    for combo in itertools.product(*(groups[i] for i in order)):
        chosen = dict(zip(order, combo, strict=True))
        hosts.append("".join(lit + chosen.get(i, "") for i, lit in enumerate(literals)))
    return hosts


def expand_nodelist(spec: str) -> list[str]:
    """Expand a Slurm node list (``node[01-04,07]``) into host names, as scontrol would.

    Names are separated by commas or whitespace outside brackets; a bracket holds numbers
    and lo-hi ranges, zero padded to the width of lo; a name may hold several bracket
    groups (``rack[1-2]-node[01-02]``), expanded in Slurm's order, and a suffix after the
    last one (``n[001-003]-ib``).

    Raises:
        TypeError: `spec` is not a str.
        ValueError: `spec` is malformed (unbalanced or nested brackets, a bad range).
    """
    if not isinstance(spec, str):
        raise TypeError(f"a Slurm node list must be a str, got {type(spec).__name__}")
    if not re.fullmatch(r"[^\[\]]*(?:\[[^\[\]]*\][^\[\]]*)*", spec):
        raise _bad_nodelist(spec, "its brackets are unbalanced or nested")
    hosts: list[str] = []
    for token in filter(None, re.split(r"[,\s]+(?![^\[]*\])", spec)):
        hosts.extend(_expand_token(spec, token))
        if len(hosts) > _MAX_HOSTS:
            raise _bad_nodelist(spec, f"it names more than {_MAX_HOSTS} hosts")
    return hosts


def slurm_port(job_id: int, step_id: int | None = None) -> int:
    """The store port derived from a Slurm job: 12000 + 10*(job_id % 2000) + step_id % 10."""
    return _SLURM_PORT_BASE + 10 * (job_id % 2000) + (0 if step_id is None else step_id % 10)


def slurm_local_size(env: Mapping[str, str]) -> tuple[int, str] | None:
    """(tasks on this node, the variable it came from), from the step's or the job's tasks
    per node at SLURM_NODEID, else SLURM_NTASKS_PER_NODE; None where Slurm says nothing.

    Raises:
        ValueError: a variable is malformed, or SLURM_NODEID has no entry in it.
    """
    node_raw = env.get("SLURM_NODEID", "").strip()
    node = parse_int("SLURM_NODEID", node_raw) if node_raw else None
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if not (raw := env.get(var, "").strip()):
            continue
        counts: list[int] = []
        for item in raw.split(","):  # "2(x3),1" is 2, 2, 2, 1
            match = re.fullmatch(r"\s*([0-9]+)(?:\(x([0-9]+)\))?\s*", item)
            if match is None:
                raise ValueError(f"{var}={raw!r} is malformed: expected counts such as 2(x3),1")
            counts.extend([int(match.group(1))] * int(match.group(2) or 1))
        if node is None:
            if len(set(counts)) == 1:
                return counts[0], var
            continue
        if not 0 <= node < len(counts):
            raise ValueError(
                f"SLURM_NODEID={node} has no entry in {var}={raw!r} (it lists "
                f"{len(counts)} nodes): are both from the same job step?"
            )
        return counts[node], var
    raw = env.get("SLURM_NTASKS_PER_NODE", "").strip()
    return (parse_int("SLURM_NTASKS_PER_NODE", raw), "SLURM_NTASKS_PER_NODE") if raw else None


def srun_task(env: Mapping[str, str]) -> bool:
    """Whether srun started this process as one task of its step (see the module docstring).

    Raises:
        ValueError: one of the variables compared holds no integer.
    """
    if not all(env.get(var, "").strip() for var in _SRUN_VARS):
        return False  # the batch script, or not in a Slurm job
    if env.get("OMPI_COMM_WORLD_RANK", "").strip():
        return False  # Open MPI's mpirun started it
    for plugin_var, slurm_var in _SRUN_PLUGIN_VARS:
        raw = env.get(plugin_var, "").strip()
        if raw and parse_int(plugin_var, raw) != parse_int(slurm_var, env[slurm_var]):
            return False  # an MPI launcher inside the job (mpiexec in the batch script, ...)
    return True
