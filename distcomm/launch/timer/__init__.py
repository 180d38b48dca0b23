"""Expiration timers: reap a worker that overstays a `with expires(after=...)` block."""

from .api import (
    TIMER_FILE_ENV,
    RequestQueue,
    TimerClient,
    TimerRequest,
    TimerServer,
    TimerServerUnavailableError,
    configure,
    expires,
)
from .debug_info_logging import log_debug_info_for_expired_timers
from .file_based_local_timer import FileTimerClient, FileTimerRequest, FileTimerServer
from .local_timer import LocalTimerClient, LocalTimerServer, MultiprocessingRequestQueue

__all__ = [
    "TIMER_FILE_ENV",
    "FileTimerClient",
    "FileTimerRequest",
    "FileTimerServer",
    "LocalTimerClient",
    "LocalTimerServer",
    "MultiprocessingRequestQueue",
    "RequestQueue",
    "TimerClient",
    "TimerRequest",
    "TimerServer",
    "TimerServerUnavailableError",
    "configure",
    "expires",
    "log_debug_info_for_expired_timers",
]
