"""The init-method bootstrap under its historical name: re-exports `distcomm.bootstrap`.

`from distcomm.rendezvous import rendezvous, detect_environment, ...` keeps working, and
`register_rendezvous_handler` stands where torch keeps it
(``torch.distributed.rendezvous``). The code lives in `distcomm.bootstrap`.
"""

from .bootstrap import (
    EnvInfo,
    InitMethod,
    Rendezvous,
    RendezvousHandler,
    check_mpi_world_size,
    detect_environment,
    expand_nodelist,
    parse_init_method,
    register_rendezvous_handler,
    rendezvous,
    slurm_port,
)

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
