"""What the launcher told this process: its rank, the world size, its place on its node and
where the job's store is, read from the variables each launcher exports.

This is the one module that reads a launcher's variables; the bootstrap, the thread
defaults (`distcomm.parallel`), device selection (`distcomm.gpu.runtime`), the torch-style
queries (`distcomm.launched`) and the MPI helpers ask it. It imports nothing of distcomm,
so any room may.

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
                   an address of rank 0's host shared over MPI (`distcomm.bootstrap.mpi`),
                   then in a Slurm job the first node of SLURM_STEP_NODELIST for a task
                   srun started, else of SLURM_JOB_NODELIST or SLURM_NODELIST
    store port     the tcp:// port, MASTER_PORT, then (env:// only) under an MPI launcher a
                   free port of rank 0's shared over MPI, then in a Slurm job `slurm_port`:
                   12000 + 10 * (SLURM_JOB_ID % 2000) + SLURM_STEP_ID % 10, the step term
                   only for a task srun started

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
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "LOCAL_SIZE_VARIABLES",
    "RANK_VARIABLES",
    "SIZE_VARIABLES",
    "EnvInfo",
    "describe",
    "detect",
    "detect_environment",
    "elastic_launched",
    "expand_nodelist",
    "launcher_of",
    "local_world_size",
    "mpi_launched",
    "mpi_launcher",
    "node_local_rank",
    "optional_int",
    "parse_int",
    "slurm_port",
    "srun_mpi_plugin",
    "srun_task",
]

# Per value, (variable, launcher) in precedence order.
RANK_VARIABLES = (
    ("RANK", "torch style"),
    ("OMPI_COMM_WORLD_RANK", "Open MPI"),
    ("PMIX_RANK", "PMIx"),
    ("PMI_RANK", "MPICH"),
    ("SLURM_PROCID", "Slurm"),
)
SIZE_VARIABLES = (
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
#: The variables, in precedence order, that name the ranks on this host (Slurm's tasks per
#: node come after the last).
LOCAL_SIZE_VARIABLES = tuple(var for var, _ in _LOCAL_SIZE_VARS)
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
_MPI_LAUNCHERS = ("Open MPI", "PMIx", "MPICH")
#: what any MPI launcher (mpirun, mpiexec, srun's MPI plugins) gives an MPI process
_MPI_LAUNCHED_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "PMI_FD")
_TORCH_STYLE = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_LAUNCHER_PREFIXES = (
    ("OMPI_", "Open MPI"),
    ("PMIX_", "PMIx"),
    ("PMI_", "MPICH"),
    ("MPI_LOCAL", "MPICH"),
    ("SLURM_", "Slurm"),
)
# What a task srun started has; (MPI plugin variable, the Slurm variable it must agree with).
_SRUN_VARS = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
_SRUN_PLUGIN_VARS = (
    ("PMIX_RANK", "SLURM_PROCID"),
    ("PMI_RANK", "SLURM_PROCID"),
    ("PMI_SIZE", "SLURM_STEP_NUM_TASKS"),
)
_TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
#: Where the store's host is found in a Slurm job; the step's only for a task srun started.
_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_MAX_RANGE = 65536  # hosts in one lo-hi range (Slurm's limit)
_MAX_HOSTS = 1 << 20  # hosts in one node list
_SLURM_PORT_BASE = 12000


@dataclass(frozen=True)
class EnvInfo:
    """What the arguments and the environment say about this process's place in the job.

    Attributes:
        rank, world_size, local_rank, local_world_size: None where nothing said.
        master_addr, master_port: where the store is served; None where unknown.
        sources: (value name, where it came from) pairs: a variable name such as
            ``OMPI_COMM_WORLD_RANK``, or ``rank= argument``, ``tcp:// URL``, ...
        srun: srun started this process as one task of its step (see the module
            docstring): its values come from Slurm's step variables, not from MPI's.
        mpi_launcher: (rank variable, launcher) when an MPI launcher started this process
            and srun did not (the first rank variable set is an MPI one), else None.
    """

    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    sources: tuple[tuple[str, str], ...] = ()
    srun: bool = False
    mpi_launcher: tuple[str, str] | None = None

    def source_of(self, name: str) -> str | None:
        """Where the value `name` (``"rank"``, ``"master_port"``, ...) came from, or None."""
        return dict(self.sources).get(name)

    @property
    def launcher(self) -> str | None:
        """The launcher whose variable gave the rank ("Open MPI", "Slurm", ...), or None."""
        source = self.source_of("rank")
        return None if source is None else launcher_of(source)


# -- sources and numbers, for messages --------------------------------------------------------


def launcher_of(source: str) -> str | None:
    """The launcher that exports the variable `source` ("Open MPI", "torch style", ...), or
    None for a source that is no launcher's variable ("rank= argument", ...)."""
    for prefix, launcher in _LAUNCHER_PREFIXES:
        if source.startswith(prefix):
            return launcher
    return "torch style" if source in _TORCH_STYLE else None


def describe(source: str) -> str:
    """`source` for messages: ``OMPI_COMM_WORLD_RANK (Open MPI)``, ``rank= argument``."""
    launcher = launcher_of(source)
    return source if launcher is None else f"{source} ({launcher})"


def parse_int(name: str, raw: str) -> int:
    """The integer a variable `name` holds as `raw` (spaces around it allowed).

    Raises:
        ValueError: `raw` is not a whole number; the message names the variable.
    """
    text = raw.strip()
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        raise ValueError(f"{name}={raw!r} is not an integer: set {name} to a whole number")
    return int(text)


def optional_int(name: str, value: object, lowest: int) -> int | None:
    """An explicit rank/world_size argument: None or -1 mean 'not given'.

    Raises:
        TypeError: `value` is not an int.
        ValueError: it is below `lowest` (and not -1).
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value == -1:
        return None
    if value < lowest:
        raise ValueError(
            f"{name}={value} is invalid: pass a value >= {lowest}, or -1 (the "
            f"default) to take it from the environment"
        )
    return int(value)


# -- Slurm's formats ---------------------------------------------------------------------------


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


def _slurm_local_size(env: Mapping[str, str]) -> tuple[int, str] | None:
    """(tasks on this node, the variable it came from), from the step's or the job's tasks
    per node at SLURM_NODEID, else SLURM_NTASKS_PER_NODE; None where Slurm says nothing.

    Raises:
        ValueError: a variable is malformed, or SLURM_NODEID has no entry in it.
    """
    node_raw = env.get("SLURM_NODEID", "").strip()
    node = parse_int("SLURM_NODEID", node_raw) if node_raw else None
    for var in _TASKS_PER_NODE_VARS:
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


def srun_mpi_plugin(env: Mapping[str, str]) -> str | None:
    """The MPI plugin whose variables srun exported ("pmix", "pmi2"), or None."""
    return "pmix" if env.get("PMIX_RANK") else "pmi2" if env.get("PMI_RANK") else None


# -- what the launcher said ------------------------------------------------------------------


def _environ(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _first(
    env: Mapping[str, str], table: tuple[tuple[str, str], ...], srun: bool
) -> tuple[int, str] | None:
    """(value, variable) of the first variable of `table` set in `env`; under srun, its MPI
    plugin's variables are skipped (they say what Slurm's say).

    Raises:
        ValueError: that variable holds no integer.
    """
    for var, launcher in table:
        if (srun and launcher in _MPI_LAUNCHERS) or not env.get(var, "").strip():
            continue
        return parse_int(var, env[var]), var
    return None


def mpi_launcher(env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(variable, launcher) when the first rank variable set in `env` (default: os.environ)
    is an MPI one and srun did not start this process (srun's MPI plugins export PMI
    variables too); else None.

    Raises:
        ValueError: a variable srun's check compares holds no integer.
    """
    env = _environ(env)
    return _mpi_launcher(env, srun_task(env))


def _mpi_launcher(env: Mapping[str, str], srun: bool) -> tuple[str, str] | None:
    if srun:
        return None
    for var, launcher in RANK_VARIABLES:
        if env.get(var, "").strip():
            return (var, launcher) if var in _MPI_RANK_VARS else None
    return None


def mpi_launched(env: Mapping[str, str] | None = None) -> bool:
    """Whether any MPI launcher (mpirun, mpiexec, srun's MPI plugins) started this process:
    one of OMPI_COMM_WORLD_SIZE, PMIX_RANK, PMI_RANK, PMI_SIZE, PMI_FD is set. An MPI
    process without them is a singleton."""
    env = _environ(env)
    return any(var in env for var in _MPI_LAUNCHED_VARS)


def elastic_launched(env: Mapping[str, str] | None = None) -> bool:
    """Whether distcomm-run (or torchrun) started this process: TORCHELASTIC_RUN_ID is set,
    which both export to their workers."""
    return "TORCHELASTIC_RUN_ID" in _environ(env)


def node_local_rank(env: Mapping[str, str] | None = None) -> int | None:
    """LOCAL_RANK (set by distcomm-run and torchrun, one worker per device), or None where
    it is unset or blank.

    Raises:
        ValueError: LOCAL_RANK is not an integer.
    """
    text = _environ(env).get("LOCAL_RANK", "")
    return parse_int("LOCAL_RANK", text) if text.strip() else None


def local_world_size(env: Mapping[str, str] | None = None) -> int | None:
    """How many ranks the launcher started on this host, per the module's table; None
    where no launcher says.

    Raises:
        ValueError: a variable is malformed.
    """
    env = _environ(env)
    found = _first(env, _LOCAL_SIZE_VARS, srun_task(env)) or _slurm_local_size(env)
    return None if found is None else found[0]


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
    for name, table in (
        ("rank", RANK_VARIABLES),
        ("world_size", SIZE_VARIABLES),
        ("local_rank", _LOCAL_RANK_VARS),
        ("local_world_size", _LOCAL_SIZE_VARS),
    ):
        if name in given:
            values[name], sources[name] = given[name]
        elif found := _first(env, table, srun):
            values[name], sources[name] = found
    if "local_world_size" not in values and (slurm := _slurm_local_size(env)) is not None:
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
    return EnvInfo(
        **values,  # type: ignore[arg-type]
        sources=tuple(sources.items()),
        srun=srun,
        mpi_launcher=_mpi_launcher(env, srun),
    )


def _detect_master(
    env: Mapping[str, str],
    given: Mapping[str, tuple[object, str]],
    values: dict[str, object],
    sources: dict[str, str],
    srun: bool,
) -> None:
    """Add the store's address and port (and where they came from) to `values`/`sources`."""
    if "master_addr" in given:
        values["master_addr"], sources["master_addr"] = given["master_addr"]
    elif env.get("MASTER_ADDR", "").strip():
        values["master_addr"], sources["master_addr"] = env["MASTER_ADDR"].strip(), "MASTER_ADDR"
    else:
        for var in _NODELIST_VARS if srun else _NODELIST_VARS[1:]:
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
    return detect(_environ(environ), given, with_master)
