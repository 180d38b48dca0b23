"""`log_debug_info_for_expired_timers`: the file timer server's log line for expired timers."""

from __future__ import annotations

import logging

__all__ = ["log_debug_info_for_expired_timers"]

log = logging.getLogger(__name__)


def log_debug_info_for_expired_timers(run_id: str, expired_timers: dict[int, list[str]]) -> None:
    """Log (at INFO) the expired timers of run `run_id`, if there are any.

    `FileTimerServer` calls it for each worker's newly expired timers, before reaping.

    Args:
        run_id: the run the timers belong to.
        expired_timers: worker pid -> its expired timers, each as `FileTimerRequest.to_json()`.
    """
    if expired_timers:
        log.info("timers expired in run %r: %s", run_id, expired_timers)
