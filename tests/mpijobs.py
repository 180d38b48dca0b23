"""What the tests that start real mpiexec jobs share: finding mpiexec, a clean loopback
environment for the job, and the check that no MPI shared-memory file is left behind."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

__all__ = ["MPIEXEC", "REPO", "job_env", "mpi_segments", "no_mpi_segment_left"]

REPO = Path(__file__).resolve().parent.parent

#: launcher and rank variables of any job the tests run inside: the jobs start clean
_DROPPED_PREFIXES = ("PMI_", "PMIX_", "OMPI_COMM_WORLD_", "MPI_LOCAL", "SLURM_")
_DROPPED = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "DISTCOMM_USE_AGENT_STORE",
    "DISTCOMM_MPI_ABORT_ON_EXCEPTION",
    "PYTEST_CURRENT_TEST",
)


def _find_mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


#: the mpiexec beside this interpreter (the pip MPICH's) or on PATH; None if there is none
MPIEXEC = _find_mpiexec()


def job_env(**extra: str) -> dict[str, str]:
    """This environment without launcher variables, on loopback, with the repo importable."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _DROPPED and not key.startswith(_DROPPED_PREFIXES)
    }
    env.update(
        HYDRA_IFACE="lo",
        UCX_NET_DEVICES="lo",
        HYDRA_LAUNCHER="fork",
        DISTCOMM_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONFAULTHANDLER="1",
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def mpi_segments() -> set[str]:
    """MPICH's shared-memory files in /dev/shm."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("mpich_shm_*")} if shm.is_dir() else set()


@pytest.fixture(autouse=True)
def no_mpi_segment_left():
    """Every job, aborted ones included, leaves no MPI shared-memory file behind."""
    before = mpi_segments()
    yield
    assert mpi_segments() <= before, sorted(mpi_segments() - before)
