"""What the launcher told this process, as torch.distributed asks it (the answers are
`distcomm.launcher_env`'s)."""

from __future__ import annotations

from .launcher_env import elastic_launched, node_local_rank

__all__ = ["get_node_local_rank", "is_torchelastic_launched"]


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank on its node: LOCAL_RANK (set by distcomm-run and torchrun), else
    `fallback_rank`.

    Raises:
        RuntimeError: LOCAL_RANK is not set and no `fallback_rank` was given.
        ValueError: LOCAL_RANK is not an integer.
    """
    local = node_local_rank()
    if local is not None:
        return local
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "LOCAL_RANK is not in the environment: start the job with distcomm-run (or torchrun), "
        "or pass fallback_rank= to get_node_local_rank for a process started on its own"
    )


def is_torchelastic_launched() -> bool:
    """Whether distcomm-run (or torchrun) started this process: TORCHELASTIC_RUN_ID is set,
    which both export to their workers."""
    return elastic_launched()
