"""The init-method bootstrap: an init_method URL or a launcher's environment becomes the job's
store, this process's rank and the world size.

`rendezvous()` is what `init_process_group` calls (`api`). It hands the URL to the handler
registered for its scheme (`urls`: the registry and URL parsing; `schemes`: the built-in
``env://``, ``tcp://`` and ``file://``), which reads what the caller left out from the
variables launchers export (`distcomm.launcher_env`, which also holds Slurm's rules), shares
the store address over MPI under an MPI launcher (`mpi`), and opens the store and waits for
every rank (`stores`). Not to be confused with `distcomm.launch.rendezvous`, where the agents of
distcomm-run meet. `distcomm.rendezvous` re-exports these names.
"""

from ..launcher_env import EnvInfo, detect_environment, expand_nodelist, slurm_port
from .api import rendezvous
from .base import InitMethod, Rendezvous
from .mpi import check_mpi_world_size
from .urls import RendezvousHandler, parse_init_method, register_rendezvous_handler

__all__ = [
    "EnvInfo",
    "InitMethod",
    "Rendezvous",
    "RendezvousHandler",
    "check_mpi_world_size",
    "detect_environment",
    "expand_nodelist",
    "parse_init_method",
    "register_rendezvous_handler",
    "rendezvous",
    "slurm_port",
]
