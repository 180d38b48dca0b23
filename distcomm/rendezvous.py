"""Rendezvous: turn an init_method or a launcher's environment into (store, rank, world size).

`rendezvous()` is what `init_process_group` calls. It understands torch's init methods,
``env://`` (the default), ``tcp://HOST:PORT`` (``tcp://[V6ADDR]:PORT`` too) and
``file:///PATH``, each accepting ``?rank=R&world_size=N``, and fills in what the caller
left out from the variables that launchers export. Each value is looked up on its own;
the first source that holds it wins:

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
                   an address of rank 0's host shared over MPI (below), then in a Slurm
                   job the first node of SLURM_STEP_NODELIST for a task srun started
                   (below), else of SLURM_JOB_NODELIST or SLURM_NODELIST
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

For ``env://`` and ``tcp://``, rank 0 hosts the TCPStore at the address; the others
connect. With DISTCOMM_USE_AGENT_STORE=1 (a launcher already serves the store there) and
``env://`` every rank connects, rank 0 included, and keeps its keys under
DISTCOMM_STORE_PREFIX when that is set (the launcher sets one per round, so restarted
workers never see the keys of an earlier round). An explicit ``tcp://`` init_method (or a
store=) wins over the launcher's store: rank 0 hosts it as without a launcher.

Then (when rank 0 hosts the store) every rank sets a key of its own in it and waits for the
others' keys, as torch's TCPStore master waits for its workers. While ranks are missing,
each waiting rank warns after DISTCOMM_STALL_WARN_S seconds (default 30; 0: none), then
after 60, 120, ... more, how many ranks joined and which did not; at the timeout the error
names them.

Bootstrap over MPI: with ``env://``, no agent store, MASTER_ADDR or MASTER_PORT unset, and
an MPI launcher (the first rank variable set is OMPI_COMM_WORLD_RANK, PMIX_RANK or
PMI_RANK, and srun did not start the process), the rendezvous imports mpi4py (which
initialises MPI; nowhere else does it). If MPI.COMM_WORLD holds the world size's
processes, rank 0 hosts the TCPStore at MASTER_ADDR, else at DISTCOMM_SOCKET_IFNAME's
address, else at 127.0.0.1 when every rank runs on its host, else at its host name's
address (or its first non-loopback IPv4 address), on MASTER_PORT or a free port, and
broadcasts "host:port" with ``MPI.COMM_WORLD.bcast``; the others connect. Every process
must reach the rendezvous within the timeout (a non-blocking barrier is polled), and an
error of rank 0's is broadcast, so no rank waits forever. It installs
`mpiutil.install_abort_hook`, so a rank's uncaught exception later aborts the job instead of
leaving that rank in MPI_Finalize while the others wait. If mpi4py is missing, or its MPI
library is not the launcher's (its COMM_WORLD has another size), the Slurm values apply
where complete, else the error says to install mpi4py or set MASTER_ADDR and MASTER_PORT.

The mpi backend takes rank and world size from MPI.COMM_WORLD, and `check_mpi_world_size`
compares that size with the one the launcher announced (the world size above, from the
environment only): N processes that each see an MPI world of one are N separate jobs, not
one, when the launcher's PMI never reached mpi4py's MPI (plain srun with MpiDefault=none)
or the launcher belongs to another MPI library. The error names both sizes and the remedy.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import math
import numbers
import os
import re
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psutil

from . import config, mpiutil
from .deadline import Deadline, to_seconds
from .errors import (
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    DistStoreTimeoutError,
    DistTimeoutError,
)
from .net import format_address, interface_address
from .store import FileStore, PrefixStore, Store, TCPStore

__all__ = [
    "EnvInfo",
    "InitMethod",
    "Rendezvous",
    "check_mpi_world_size",
    "detect_environment",
    "expand_nodelist",
    "parse_init_method",
    "rendezvous",
    "slurm_port",
]

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
# What a task srun started has; (MPI plugin variable, the Slurm variable it must agree with).
_SRUN_VARS = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
_SRUN_PLUGIN_VARS = (
    ("PMIX_RANK", "SLURM_PROCID"),
    ("PMI_RANK", "SLURM_PROCID"),
    ("PMI_SIZE", "SLURM_STEP_NUM_TASKS"),
)
_LAUNCHER_PREFIXES = (
    ("OMPI_", "Open MPI"),
    ("PMIX_", "PMIx"),
    ("PMI_", "MPICH"),
    ("MPI_LOCAL", "MPICH"),
    ("SLURM_", "Slurm"),
)
_SCHEMES = "env:// (the default: MASTER_ADDR, MASTER_PORT), tcp://HOST:PORT or file:///PATH"
_MAX_RANGE = 65536  # hosts in one lo-hi range (Slurm's limit)
_MAX_HOSTS = 1 << 20  # hosts in one node list
_SLURM_PORT_BASE = 12000

log = logging.getLogger(__name__)


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
    """

    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    sources: tuple[tuple[str, str], ...] = ()
    srun: bool = False

    def source_of(self, name: str) -> str | None:
        """Where the value `name` (``"rank"``, ``"master_port"``, ...) came from, or None."""
        return dict(self.sources).get(name)

    @property
    def launcher(self) -> str | None:
        """The launcher whose variable gave the rank ("Open MPI", "Slurm", ...), or None."""
        source = self.source_of("rank")
        return None if source is None else _launcher_of(source)


@dataclass(frozen=True)
class InitMethod:
    """A parsed init_method URL; `url` is the URL without its query, for messages."""

    scheme: str
    url: str
    host: str | None = None
    port: int | None = None
    path: str | None = None
    rank: int | None = None
    world_size: int | None = None


@dataclass(frozen=True)
class Rendezvous:
    """The outcome of a rendezvous: a store shared by the job and this process's place.

    Attributes:
        store: the job's store; the caller owns it and closes it.
        rank, world_size: this process's rank and the number of processes.
        local_rank, local_world_size: the same on this host, None when unknown.
        master_addr, master_port: the TCPStore's address (None for file:// and store=).
        source: how it was found, for messages: "env://", "tcp://h:p", "file:///p",
            "store", the launcher that gave the rank ("Open MPI", "Slurm", ...), or that
            launcher and "(store address bootstrapped over MPI)".
    """

    store: Store
    rank: int
    world_size: int
    local_rank: int | None = None
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    source: str = "env://"


class _RoundStore(PrefixStore):
    """The workers' namespace in a launcher's store; closing it closes the connection."""

    def close(self) -> None:
        self.underlying_store.close()


def _launcher_of(source: str) -> str | None:
    for prefix, launcher in _LAUNCHER_PREFIXES:
        if source.startswith(prefix):
            return launcher
    if source in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        return "torch style"
    return None


def _describe(source: str) -> str:
    launcher = _launcher_of(source)
    return source if launcher is None else f"{source} ({launcher})"


def _parse_int(name: str, raw: str) -> int:
    text = raw.strip()
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        raise ValueError(f"{name}={raw!r} is not an integer: set {name} to a whole number")
    return int(text)


def _optional_int(name: str, value: object, lowest: int) -> int | None:
    """An explicit rank/world_size argument: None or -1 mean 'not given'."""
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


# -- Slurm node lists -------------------------------------------------------------------------


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
    node_raw = env.get("SLURM_NODEID", "").strip()
    node = _parse_int("SLURM_NODEID", node_raw) if node_raw else None
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
    return (_parse_int("SLURM_NTASKS_PER_NODE", raw), "SLURM_NTASKS_PER_NODE") if raw else None


# -- environment detection --------------------------------------------------------------------


def _srun_task(env: Mapping[str, str]) -> bool:
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
        if raw and _parse_int(plugin_var, raw) != _parse_int(slurm_var, env[slurm_var]):
            return False  # an MPI launcher inside the job (mpiexec in the batch script, ...)
    return True


def _detect(
    env: Mapping[str, str], given: Mapping[str, tuple[object, str]], with_master: bool
) -> EnvInfo:
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    srun = _srun_task(env)
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
            values[name], sources[name] = _parse_int(found, env[found]), found
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
                f"{name} {values[name]} from {_describe(sources[name])} is "
                f"invalid: it must be >= {lowest}"
            )
    for low, high in (("rank", "world_size"), ("local_rank", "local_world_size")):
        if low in values and high in values and values[low] >= values[high]:  # type: ignore[operator]
            raise ValueError(
                f"{low} {values[low]} (from {_describe(sources[low])}) is out of range for "
                f"{high} {values[high]} (from {_describe(sources[high])}): it must run from "
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
        values["master_port"] = _parse_int("MASTER_PORT", env["MASTER_PORT"])
        sources["master_port"] = "MASTER_PORT"
    elif env.get("SLURM_JOB_ID", "").strip():
        job = _parse_int("SLURM_JOB_ID", env["SLURM_JOB_ID"])
        step = _parse_int("SLURM_STEP_ID", env["SLURM_STEP_ID"]) if srun else None
        values["master_port"] = slurm_port(job, step)
        sources["master_port"] = "SLURM_JOB_ID and SLURM_STEP_ID" if srun else "SLURM_JOB_ID"
    port = values.get("master_port")
    if port is not None and not 1 <= port <= 65535:  # type: ignore[operator]
        raise ValueError(
            f"store port {port} from {_describe(sources['master_port'])} is out "
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
        if (checked := _optional_int(name, value, lowest)) is not None:
            given[name] = (checked, f"{name}= argument")
    if master_addr is not None:
        given["master_addr"] = (master_addr, "master_addr= argument")
    if master_port is not None:
        given["master_port"] = (master_port, "master_port= argument")
    return _detect(os.environ if environ is None else environ, given, with_master)


def _require(info: EnvInfo, name: str, hint: str = "") -> object:
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
            f"cannot determine the {name.replace('_', ' ')}: pass {name}= to "
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


def check_mpi_world_size(
    mpi_size: int, library: str = "", environ: Mapping[str, str] | None = None
) -> None:
    """Raise when MPI.COMM_WORLD's size is not the world size the launcher announced.

    The announced size is the world size of the module's table, from the environment
    alone (WORLD_SIZE, OMPI_COMM_WORLD_SIZE, PMI_SIZE, SLURM_STEP_NUM_TASKS, SLURM_NTASKS);
    nothing announced, nothing to check. A disagreement means the launcher started
    processes that MPI does not connect: `srun` without an MPI plugin mpi4py's MPI speaks,
    the batch script of a job of several tasks, another MPI library's mpiexec, or a
    torch-style launcher.

    Args:
        mpi_size: MPI.COMM_WORLD's size.
        library: MPI.Get_library_version(), for the message (its first line is shown).
        environ: the environment to read (default: os.environ).

    Raises:
        DistBackendError: the sizes disagree; the message names both, where the announced
            one came from, and what to do.
        ValueError: a launcher variable holds no integer.
    """
    env = os.environ if environ is None else environ
    info = _detect(env, {}, False)
    size, source = info.world_size, str(info.source_of("world_size"))
    if size is None or size == mpi_size:
        return
    name = " ".join((library.strip().splitlines() or ["its MPI library"])[0].split())
    launcher = _launcher_of(source)
    head = (
        f"init_process_group('mpi'): MPI.COMM_WORLD has {mpi_size} process(es), but the "
        f"launcher announced a world of {size} ({source}={size}, {launcher})"
    )
    apart = "; each process is an MPI world of its own" if mpi_size == 1 else ""
    plugin = "pmix" if env.get("PMIX_RANK") else "pmi2" if env.get("PMI_RANK") else None
    if launcher == "Slurm" and info.srun and plugin is None:
        why = (
            f"srun started {size} tasks with no MPI plugin (--mpi=none, the default unless "
            f"slurm.conf sets MpiDefault), so mpi4py's MPI ({name}) found no PMI to join "
            f"them{apart}. Start "
            f"the tasks with 'srun --mpi=pmi2' (MPICH, Intel MPI and MVAPICH speak PMI-2; "
            f"'srun --mpi=list' shows this Slurm's plugins), or have the administrator set "
            f"MpiDefault=pmi2 in slurm.conf"
        )
    elif launcher == "Slurm" and info.srun:
        why = (
            f"srun started {size} tasks with its {plugin} plugin, which mpi4py's MPI "
            f"({name}) did not use{apart}: start them with a plugin that library speaks "
            f"('srun --mpi=pmi2' for MPICH, Intel MPI and MVAPICH, 'srun --mpi=pmix' for "
            f"Open MPI; 'srun --mpi=list' shows this Slurm's plugins)"
        )
    elif launcher == "Slurm":
        why = (
            f"this process is not one of the tasks of a job step (the batch script runs "
            f"once, whatever the job's task count): start the {size} tasks with "
            f"'srun --mpi=pmi2 python ...' from the batch script, or set WORLD_SIZE=1 "
            f"to run this one process on its own"
        )
    elif launcher == "torch style":
        why = (
            "WORLD_SIZE comes from a torch-style launcher (distcomm-run, torchrun), which "
            "starts processes that MPI does not connect: under it use the gloo or tcp "
            "backend, or start the job with mpiexec (or srun --mpi=pmi2) for the mpi backend"
        )
    else:
        why = (
            f"the {launcher} launcher that started this job is not the MPI library that "
            f"mpi4py loaded ({name}){apart}: start the job with the mpiexec of mpi4py's MPI "
            f"library, or rebuild mpi4py against the launcher's MPI (pip install "
            f"--no-binary mpi4py mpi4py, with its mpicc on PATH)"
        )
    raise DistBackendError(f"{head}: {why}")


# -- init_method URLs ---------------------------------------------------------------------


def _parse_query(url: str, query: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for item in filter(None, query.split("&")):
        key, sep, value = item.partition("=")
        if key == "use_libuv":
            continue  # torch's TCPStore implementation switch: nothing to choose here
        if not sep or key not in ("rank", "world_size"):
            raise ValueError(
                f"init_method {url!r}: query item {item!r} is not understood; "
                f"only rank=R and world_size=N may follow the '?'"
            )
        if key in found:
            raise ValueError(f"init_method {url!r} gives {key} twice: give it once")
        found[key] = _parse_int(f"?{key}", value)
    return found


def parse_init_method(url: str) -> InitMethod:
    """Parse an init_method URL: env://, tcp://HOST:PORT, file:///PATH, each with an optional
    ``?rank=R&world_size=N``.

    Raises:
        TypeError: `url` is not a str.
        ValueError: the scheme is unknown or the URL lacks what its scheme needs.
    """
    if not isinstance(url, str):
        raise TypeError(
            f"init_method must be a str URL such as {_SCHEMES}, got {type(url).__name__}"
        )
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(
            f"init_method {url!r} is not a valid URL ({exc}): use {_SCHEMES}"
        ) from None
    scheme = parts.scheme.lower()
    if scheme not in ("env", "tcp", "file"):
        raise ValueError(
            f"init_method {url!r} has an unsupported scheme {parts.scheme!r}: use {_SCHEMES}"
        )
    if parts.fragment:
        raise ValueError(
            f"init_method {url!r} has a '#' part, which no init_method takes: "
            f"remove it (for file://, pick a path without '#')"
        )
    query = _parse_query(url, parts.query)
    bare = urlunsplit(parts._replace(query=""))
    if scheme == "env":
        if parts.netloc or parts.path.strip("/"):
            raise ValueError(
                f"init_method {url!r}: env:// takes no address, it reads "
                f"MASTER_ADDR and MASTER_PORT; write tcp://HOST:PORT to give one"
            )
        return InitMethod("env", bare, **query)
    if scheme == "tcp":
        if not parts.hostname or port is None:
            raise ValueError(
                f"init_method {url!r} needs a host and a port: tcp://HOST:PORT or tcp://[IPV6]:PORT"
            )
        if not 1 <= port <= 65535:
            raise ValueError(
                f"init_method {url!r}: port {port} is out of range: use a TCP port from 1 to 65535"
            )
        if parts.path.strip("/"):
            raise ValueError(f"init_method {url!r}: a tcp:// URL takes no path")
        return InitMethod("tcp", bare, host=parts.hostname, port=port, **query)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(
            f"init_method {url!r} names the host {parts.netloc!r}: a file:// "
            f"URL holds a path, absolute after three slashes: file:///shared/path"
        )
    if not parts.path:
        raise ValueError(f"init_method {url!r} has no path: use file:///shared/path")
    return InitMethod("file", bare, path=parts.path, **query)


# -- rendezvous -----------------------------------------------------------------------------


def _open_store(make: Callable[[], Store], context: str, os_error: type[DistError]) -> Store:
    """Create a store; its errors gain `context` (who, where, from which variables)."""
    try:
        return make()
    except DistError as exc:
        try:
            wrapped = type(exc)(f"{context}: {exc}")
        except Exception:  # an error type with a constructor of its own: keep it as it is
            raise exc from None
        raise wrapped from exc
    except OSError as exc:
        raise os_error(f"{context}: {exc}") from exc


_JOINED = "distcomm/rendezvous/joined/"
_STALL_BACKOFF = 2.0


def _join(
    store: Store, rank: int, size: int, seconds: float, warn_after: float, where: str
) -> None:
    """Set this rank's key in `store` and wait for every rank's, for at most `seconds`.

    While some are missing, warn after `warn_after` seconds (0: never), then after twice
    as long as the previous wait each time, naming the ranks that joined and those missing.

    Raises:
        DistTimeoutError: some ranks did not join in time; the message names them.
        DistStoreError: the store failed.
    """
    keys = [f"{_JOINED}{r}" for r in range(size)]
    store.set(keys[rank], str(os.getpid()))
    deadline = Deadline(seconds)
    started = time.monotonic()
    interval = warn_after
    warn_at = warn_after if warn_after > 0 else math.inf
    while True:
        left = deadline.remaining()
        left = math.inf if left is None else max(left, 0.0)
        step = min(left, max(warn_at - (time.monotonic() - started), 0.001))
        if warn_after > 0:  # a store wait longer than that would warn on its own
            step = min(step, warn_after)
        try:
            store.wait(keys, step)
            return
        except DistStoreTimeoutError:
            pass
        waited = time.monotonic() - started
        missing = [r for r in range(size) if not store.check([keys[r]])]
        if not missing:
            return
        joined = size - len(missing)
        shown = ", ".join(map(str, missing[:32])) + (" ..." if len(missing) > 32 else "")
        if deadline.expired():
            raise DistTimeoutError(
                f"{where}: only {joined} of {size} ranks joined the store within "
                f"{seconds:.1f} s; rank(s) {shown} never did: start every rank with the same "
                f"store address and world size, or look at the missing ranks' output for an "
                f"error"
            )
        if waited >= warn_at:
            interval *= _STALL_BACKOFF
            warn_at = waited + interval
            log.warning(
                "%s: still waiting after %.0f s: %d of %d ranks joined the store; missing "
                "rank(s) %s. Start them, or check their output for an error (waiting up to "
                "the timeout, %.0f s; DISTCOMM_STALL_WARN_S=0 turns this warning off)",
                where,
                waited,
                joined,
                size,
                shown,
                seconds,
            )


def _mpi_launcher(env: Mapping[str, str]) -> tuple[str, str] | None:
    """(variable, launcher) when the first rank variable set in `env` is an MPI one and srun
    did not start this process (srun's MPI plugins export PMI variables too)."""
    if _srun_task(env):
        return None
    for var, launcher in _RANK_VARS:
        if env.get(var, "").strip():
            return (var, launcher) if var in _MPI_RANK_VARS else None
    return None


def _host_address(one_host: bool, ifname: str | None) -> str:
    """The address rank 0 serves the store at when it picks one (see the module docstring).

    Raises:
        ValueError: DISTCOMM_SOCKET_IFNAME names no usable interface, or no address of this
            host is usable from other hosts.
    """
    if ifname:
        return interface_address(ifname)
    if one_host:
        return "127.0.0.1"
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = ""
    if address and not ipaddress.ip_address(address).is_loopback:
        return address
    stats = psutil.net_if_stats()
    for name, addresses in psutil.net_if_addrs().items():
        if name in stats and stats[name].isup:
            for addr in addresses:
                if (
                    addr.family == socket.AF_INET
                    and not ipaddress.ip_address(addr.address).is_loopback
                ):
                    return addr.address
    raise ValueError(
        "this host's name resolves to a loopback address and no interface has "
        "another IPv4 address: set DISTCOMM_SOCKET_IFNAME to the interface the "
        "other hosts reach (e.g. eth0), or MASTER_ADDR"
    )


def _bootstrap_over_mpi(
    mpi: Any,
    info: EnvInfo,
    rank: int,
    size: int,
    seconds: float,
    launcher: str,
    where: str,
    ifname: str | None,
) -> Rendezvous:
    """Rank 0 hosts the TCPStore and broadcasts its address over MPI.COMM_WORLD.

    Raises:
        ValueError: the ranks do not map one to one onto MPI.COMM_WORLD's processes.
        DistTimeoutError: not every process reached the rendezvous in time.
        DistNetworkError, DistStoreError: the store could not be hosted or reached.
    """
    comm = mpi.COMM_WORLD
    where = f"{where} (store address bootstrapped over MPI)"
    mpiutil.wait_all(comm, Deadline(seconds), where)
    shared = comm.Split_type(mpi.COMM_TYPE_SHARED)
    try:
        one_host = shared.Get_size() == size
    finally:
        shared.Free()
    ranks = comm.allgather(rank)
    if sorted(ranks) != list(range(size)):
        raise ValueError(
            f"{where}: the processes of MPI.COMM_WORLD have ranks {ranks} (in MPI "
            f"rank order), not each of 0..{size - 1} once: pass rank= so that "
            f"every process gets its own, or leave it out under mpiexec"
        )
    root = ranks.index(0)
    fixed_addr = info.source_of("master_addr") == "MASTER_ADDR"
    fixed_port = info.source_of("master_port") == "MASTER_PORT"
    origin = (
        f"address from {'MASTER_ADDR' if fixed_addr else 'rank 0'}, port from "
        f"{'MASTER_PORT' if fixed_port else 'rank 0'}, shared over MPI"
    )
    if rank == 0:
        try:
            host = str(info.master_addr) if fixed_addr else _host_address(one_host, ifname)
            port = int(info.master_port) if fixed_port else 0  # type: ignore[arg-type]
            context = f"{where}: hosting the store at {format_address(host, port)} ({origin})"
            store = _open_store(
                lambda: TCPStore(
                    host,
                    port,
                    world_size=size,
                    is_master=True,
                    timeout=seconds,
                    wait_for_workers=False,
                ),
                context,
                DistNetworkError,
            )
        except BaseException as exc:
            comm.bcast(("error", f"{type(exc).__name__}: {exc}"), root=root)
            raise
        port = store.port
        comm.bcast(("ok", host, port), root=root)

        def wait_for_workers() -> Store:  # TCPStore(wait_for_workers=True)'s wait, run
            store._wait_for_workers(size, Deadline(seconds))  # once the address is out
            return store

        try:
            _open_store(
                wait_for_workers,
                f"{where}: hosting the store at {format_address(host, port)} ({origin})",
                DistNetworkError,
            )
        except BaseException:
            store.close()
            raise
    else:
        reply = comm.bcast(None, root=root)
        if reply[0] != "ok":
            raise DistNetworkError(f"{where}: rank 0 could not host the store: {reply[1]}")
        host, port = reply[1], reply[2]
        store = _open_store(
            lambda: TCPStore(host, port, world_size=size, is_master=False, timeout=seconds),
            f"{where}: connecting to the store at {format_address(host, port)} ({origin})",
            DistNetworkError,
        )
    return Rendezvous(
        store,
        rank,
        size,
        info.local_rank,
        info.local_world_size,
        host,
        port,
        f"{launcher} (store address bootstrapped over MPI)",
    )


def rendezvous(
    init_method: str | None = None,
    *,
    rank: int | None = -1,
    world_size: int | None = -1,
    store: Store | None = None,
    timeout: float | timedelta = config.DEFAULT_TIMEOUT,
    environ: Mapping[str, str] | None = None,
) -> Rendezvous:
    """Find this process's store, rank and world size, as `init_process_group` does.

    Args:
        init_method: env:// (None means env://), tcp://HOST:PORT or file:///PATH.
        rank, world_size: explicit values; -1 (or None) takes them from the URL's query or
            the environment (see the module docstring for the precedence).
        store: a store already shared by the job; then rank and world_size are required
            and init_method must be None.
        timeout: the store's timeout (seconds or timedelta), connecting included.
        environ: the environment to read (default: os.environ).

    Returns:
        A `Rendezvous`; the caller owns its store.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: a value is missing, malformed or out of range; the message lists
            where it was looked for.
        DistNetworkError, DistStoreError, DistTimeoutError: the store could not be
            hosted, opened or reached in time; the message names the rank and the address.
    """
    env = os.environ if environ is None else environ
    rank_arg, size_arg = _optional_int("rank", rank, 0), _optional_int("world_size", world_size, 1)
    seconds = to_seconds(timeout)
    seconds = config.DEFAULT_TIMEOUT if seconds is None else seconds
    if store is not None:
        if init_method is not None:
            raise ValueError(
                f"cannot specify both init_method ({init_method!r}) and store: pass one of them"
            )
        if not isinstance(store, Store):
            raise TypeError(f"store must be a distcomm Store, got {type(store).__name__}")
        if rank_arg is None or size_arg is None:
            raise ValueError(
                f"a store= needs rank and world_size given explicitly, got "
                f"rank={rank}, world_size={world_size}: pass world_size=N (N >= 1) "
                f"and rank=R (0 <= R < N)"
            )
        info = _detect(
            env,
            {
                "rank": (rank_arg, "rank= argument"),
                "world_size": (size_arg, "world_size= argument"),
            },
            False,
        )
        return Rendezvous(
            store, rank_arg, size_arg, info.local_rank, info.local_world_size, source="store"
        )
    method = parse_init_method("env://" if init_method is None else init_method)
    given: dict[str, tuple[object, str]] = {}
    for name, arg in (("rank", rank_arg), ("world_size", size_arg)):
        in_url = getattr(method, name)
        if arg is not None and in_url is not None and arg != in_url:
            raise ValueError(
                f"{name} is given twice with different values: {name}={arg} and "
                f"?{name}={in_url} in init_method {method.url!r}: give it once"
            )
        if arg is not None:
            given[name] = (arg, f"{name}= argument")
        elif in_url is not None:
            given[name] = (in_url, f"?{name}= in the URL")
    if method.scheme == "tcp":
        given["master_addr"] = (method.host, "tcp:// URL")
        given["master_port"] = (method.port, "tcp:// URL")
    info = _detect(env, given, with_master=method.scheme != "file")
    the_rank, size = int(_require(info, "rank")), int(_require(info, "world_size"))  # type: ignore[call-overload]
    where = f"[rank {the_rank}/{size}] {method.scheme}:// rendezvous"
    if method.scheme == "file":
        path = str(method.path)
        opened = _open_store(
            lambda: FileStore(path, size, timeout=seconds),
            f"{where}: opening the FileStore {path!r}",
            DistStoreError,
        )
        return Rendezvous(
            opened, the_rank, size, info.local_rank, info.local_world_size, source=method.url
        )
    cfg = config.load(dict(env))
    # an explicit tcp:// address is the script's own store, not the launcher's
    agent = cfg.use_agent_store and method.scheme == "env"
    hint = ""
    mpi_launch = _mpi_launcher(env)
    if (
        method.scheme == "env"
        and not agent
        and mpi_launch is not None
        and (
            info.source_of("master_addr") != "MASTER_ADDR"
            or info.source_of("master_port") != "MASTER_PORT"
        )
    ):
        var, launcher = mpi_launch
        if not mpiutil.is_mpi4py_available():
            why, remedy = "mpi4py is not installed", f"install it ({mpiutil.INSTALL_HINT})"
        else:
            try:
                mpi = mpiutil.load_mpi()
            except ImportError as exc:
                why, remedy = str(exc), "repair mpi4py"
            else:
                if mpi.COMM_WORLD.Get_size() == size:
                    # MPI is initialised now: a rank that raises would sit in MPI_Finalize
                    # and the others wait for the group timeout unless the error aborts
                    mpiutil.install_abort_hook()
                    return _bootstrap_over_mpi(
                        mpi, info, the_rank, size, seconds, launcher, where, cfg.socket_ifname
                    )
                library = (mpi.Get_library_version().strip().splitlines() or ["?"])[0]
                why = (
                    f"MPI.COMM_WORLD has {mpi.COMM_WORLD.Get_size()} process(es), not the "
                    f"world size {size} (from {_describe(str(info.source_of('world_size')))})"
                    f": mpi4py's MPI library ({library.strip()}) did not start this job"
                )
                remedy = "start the job with that library's mpiexec"
                if info.master_addr is not None and info.master_port is not None:
                    log.warning(
                        "%s: not bootstrapping the store over MPI: %s; using %s and %s",
                        where,
                        why,
                        info.source_of("master_addr"),
                        info.source_of("master_port"),
                    )
        hint = (
            f"; under {launcher} ({var}) rank 0 shares the store address over MPI "
            f"instead, but {why}: {remedy} or set MASTER_ADDR and MASTER_PORT"
        )
    host = str(_require(info, "master_addr", hint))
    port = int(_require(info, "master_port", hint))  # type: ignore[call-overload]
    hosting = the_rank == 0 and not agent
    context = (
        f"{where}: {'hosting' if hosting else 'connecting to'} the store at "
        f"{format_address(host, port)} (address from "
        f"{_describe(str(info.source_of('master_addr')))}, port from "
        f"{_describe(str(info.source_of('master_port')))})"
    )
    opened = _open_store(
        lambda: TCPStore(
            host,
            port,
            world_size=size,
            is_master=hosting,
            timeout=seconds,
            wait_for_workers=False,  # _join waits, naming the ranks still missing
        ),
        context,
        DistNetworkError,
    )
    if agent and cfg.store_prefix:
        opened = _RoundStore(cfg.store_prefix, opened)
    if not agent:
        try:
            # every rank waits for all to join: any rank still waiting says which are missing
            store_at = f"{where} (the store at {format_address(host, port)})"
            _join(opened, the_rank, size, seconds, cfg.stall_warn_s, store_at)
        except BaseException:
            opened.close()
            raise
    launcher = info.launcher
    if method.scheme == "tcp":
        source = f"tcp://{format_address(host, port)}"
    else:
        source = launcher if launcher not in (None, "torch style") else "env://"
    return Rendezvous(
        opened, the_rank, size, info.local_rank, info.local_world_size, host, port, source
    )
