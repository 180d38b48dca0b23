"""The conformance suite under mpiexec: every MPI process is one rank and runs pytest.

`python -m tests.mpi_world [pytest args]`, started by mpiexec, runs pytest in every
process with DISTCOMM_TEST_UNDER_MPIEXEC=1, which makes conftest's `world` fixture an
`MpiWorld`: one default group on the `mpi` backend for the whole session, and `run`
calls the test body in this process, then gathers every rank's outcome so that all
ranks pass or fail each test together (and stay in step). Only rank 0 prints.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import distcomm as dist
from tests.harness import RankFailure

__all__ = ["RANK_VARS", "MpiWorld", "main"]

#: where the launchers put the rank: MPICH/Hydra, Open MPI 4 and 5, PMIx
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


class MpiWorld:
    """conftest's World for the processes of an mpiexec job (backend `mpi`)."""

    backend = "mpi"

    def __init__(self) -> None:
        from mpi4py import MPI

        self._comm = MPI.COMM_WORLD.Dup()  # outcomes never mix with the tests' traffic
        self.size = self._comm.size
        self.env: dict[str, str] = {}

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0, **kwargs: Any
    ) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; the results in rank order."""
        if not dist.is_initialized():
            dist.init_process_group("mpi", timeout=max(timeout, 60.0))
        try:
            outcome = (True, fn(*args, **kwargs))
        except BaseException:  # reported on every rank, below
            outcome = (False, traceback.format_exc())
        outcomes = self._comm.allgather(outcome)
        failed = [r for r, (ok, _) in enumerate(outcomes) if not ok]
        if failed:
            raise RankFailure(
                "\n".join(f"### rank {r}/{self.size}\n{outcomes[r][1]}" for r in failed)
            )
        return [value for _, value in outcomes]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def __repr__(self) -> str:
        return f"MpiWorld({self.size})"


def main(argv: list[str]) -> int:
    import pytest

    os.environ["DISTCOMM_TEST_UNDER_MPIEXEC"] = "1"
    rank = int(next((os.environ[name] for name in RANK_VARS if os.environ.get(name)), 0))
    if rank:
        sink = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
        sys.stdout = sys.stderr = sink
    return int(pytest.main(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
