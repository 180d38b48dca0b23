"""Worker failures: `@record` writes a worker's exception down; `ChildFailedError` reports.

`record` has an `ErrorHandler` (`launch/error_handler.py`) write the exception of a worker's
entrypoint to the worker's error file;
`ProcessFailure` is one failed worker as the agent saw it (reading that file), and
`ChildFailedError` the agent's report with one block per failed rank and the root cause
(the first failure not caused by a peer's; `ProcessFailure.peer_ranks`). A worker that
recorded nothing is reported from the tail of its stderr (`tracebacks.py`). `ProcessFailure`,
`exit_description` and the report's placeholder texts live in `failure.py` and are
re-exported here, torch's module for them.

The error file's layout, and how the agent reads it, are `failure.py`'s.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from ...errors import DistError
from ..error_handler import ERROR_FILE_ENV, TORCH_ERROR_FILE_ENV, ErrorHandler, get_error_handler
from .failure import NO_RECORDED_TRACEBACK as NO_RECORDED_TRACEBACK
from .failure import NO_TRACEBACK as NO_TRACEBACK
from .failure import NOT_AVAILABLE, NOT_KEPT, ProcessFailure, exit_description

__all__ = [
    "ERROR_FILE_ENV",
    "TORCH_ERROR_FILE_ENV",
    "ChildFailedError",
    "ErrorHandler",
    "ProcessFailure",
    "exit_description",
    "get_error_handler",
    "record",
]

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])


_HANDLER_METHODS = ("initialize", "record_exception", "dump_error_file")


def record(fn: _F, error_handler: ErrorHandler | None = None) -> _F:
    """Decorate a worker's entrypoint so that an exception it raises reaches the agent's report.

    The wrapper calls ``error_handler.initialize()`` (the default handler enables
    `faulthandler`) and runs `fn`. On an exception it calls
    ``error_handler.record_exception(e)``, which writes the exception's message,
    traceback and time to the file named by ``DISTCOMM_ERROR_FILE`` (or
    ``TORCHELASTIC_ERROR_FILE``), set by the launcher for each worker, then re-raises it
    unchanged. A `ChildFailedError` (a nested launcher's agent failing) is recorded as its
    root cause instead: ``error_handler.dump_error_file(failure.error_file, exitcode)``,
    so an outer launcher reports the real first failure; when that worker recorded
    nothing, nothing is written (as in torch) and the error is re-raised.
    ``SystemExit(0)`` (``sys.exit(0)`` in `fn`) makes the wrapper return None, as torch's
    does; any other `SystemExit` and `KeyboardInterrupt` pass through unrecorded. A
    handler that fails is logged, never raised in place of the exception.

    Args:
        fn: the function to wrap (usually ``main``).
        error_handler: what records the exception; default: `get_error_handler()`'s,
            made once, here. Anything with `ErrorHandler`'s `initialize`,
            `record_exception` and `dump_error_file` methods will do.

    Returns:
        The wrapped function, with `fn`'s name and docstring; it returns what `fn`
        returns, or None when `fn` exits with ``SystemExit(0)``.

    Raises:
        TypeError: `fn` is not callable, or `error_handler` lacks a handler's methods.
    """
    if not callable(fn):
        raise TypeError(
            f"record() decorates a function (@record, or record(main, error_handler=...)), "
            f"got {type(fn).__name__}"
        )
    handler = get_error_handler() if error_handler is None else error_handler
    missing = [name for name in _HANDLER_METHODS if not callable(getattr(handler, name, None))]
    if missing:
        raise TypeError(
            f"record(error_handler=...) needs an ErrorHandler (subclass "
            f"distcomm.launch.errors.ErrorHandler); {type(handler).__name__} has no "
            f"{', '.join(missing)}"
        )

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        handler.initialize()
        try:
            return fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code == 0:  # a successful exit, e.g. of a script run through run_path
                return None
            raise
        except Exception as exc:
            try:
                _record_with(handler, exc)
            except Exception as handler_exc:
                log.warning(
                    "error handler %s failed (%s: %s); the exception follows unrecorded",
                    type(handler).__name__,
                    type(handler_exc).__name__,
                    handler_exc,
                )
            raise

    return wrapper  # type: ignore[return-value]


def _record_with(handler: ErrorHandler, exc: Exception) -> None:
    if isinstance(exc, ChildFailedError):
        rank, failure = exc.get_first_failure()
        code = failure.exitcode or 0
        if failure.error_file != NOT_AVAILABLE and os.path.isfile(failure.error_file):
            handler.dump_error_file(failure.error_file, code)
            return
        if failure.error_data is not None and isinstance(handler, ErrorHandler):
            # read before its file went away, or shared by another node's agent
            source = f"rank {rank} on {failure.host or 'this node'}"
            handler._dump_error_data(source, failure.error_data, code)
            return
        if failure.error_data is None:
            # the worker recorded nothing: the parent's error file stays unwritten, as
            # torch's; the report (the re-raised error) still describes the failure
            log.info(
                "rank %s failed with no error file to pass on (%s); decorate its entrypoint "
                "with @record to have its traceback recorded",
                rank,
                exit_description(failure.exitcode),
            )
            return
    tb = exc.__traceback__
    exc.__traceback__ = tb.tb_next if tb is not None and tb.tb_next is not None else tb
    try:  # the record shows the traceback from `fn` down, not through the wrapper
        handler.record_exception(exc)
    finally:
        exc.__traceback__ = tb


class ChildFailedError(DistError):
    """One or more workers failed; the message has one block per failed rank.

    Raised by the agent when its workers fail and no restart is left. The root cause is
    the first failure (smallest timestamp; ties go to the smallest rank) among those not
    caused by a peer's failure (`ProcessFailure.peer_ranks`), or among all when every one
    was.

    Attributes:
        name: what failed (the entrypoint's name).
        failures: rank -> its ProcessFailure.
    """

    def __init__(self, name: str, failures: dict[int, ProcessFailure]) -> None:
        if not failures:
            raise ValueError(f"ChildFailedError({name!r}) needs at least one failure")
        self.name = name
        self.failures = dict(failures)
        super().__init__(self.format_msg())

    def __reduce__(self) -> tuple[Any, ...]:  # picklable, e.g. across multiprocessing
        return type(self), (self.name, self.failures)

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        """The root cause: (rank, failure) with the smallest timestamp, then smallest rank,
        of the failures no peer caused (of all, when a peer caused every one)."""
        own = [r for r, failure in self.failures.items() if failure.peer_ranks is None]
        rank = min(own or self.failures, key=lambda r: (self.failures[r]._time, r))
        return rank, self.failures[rank]

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        """The failure report: a header, every other failed rank, then the root cause.

        Args:
            boarder_delim: the character of the report's top and bottom rules (torch's
                parameter name, spelling included).
            section_delim: the character of the rules between its sections.
        """
        root_rank, root = self.get_first_failure()
        others = [
            _format_failure(rank, self.failures[rank])
            for rank in sorted(self.failures)
            if rank != root_rank
        ]
        rule, sep = boarder_delim * _REPORT_WIDTH, section_delim * _REPORT_WIDTH
        return "\n".join(
            [
                rule,
                f"{self.name} FAILED",
                sep,
                "Failures:",
                *(others or ["  <NO_OTHER_FAILURES>"]),
                sep,
                "Root Cause (first observed failure):",
                _format_failure(root_rank, root),
                rule,
            ]
        )


_REPORT_WIDTH = 72
_LABEL_WIDTH = 10


def _format_failure(rank: int, failure: ProcessFailure) -> str:
    """One rank's block of the failure report: fixed-width labels, continuation lines indented."""
    code = failure.exitcode
    if code is None or code >= 0:
        status = exit_description(code).removeprefix("exit code ")
    else:
        status = f"{code} ({failure.signal_name()})"
    rows = [
        ("time", failure.timestamp_isoformat()),
        ("host", failure.host or "<unknown>"),
        ("rank", f"{rank} (local_rank: {failure.local_rank})"),
    ]
    if failure.role != "default":
        rows.append(("role", failure.role))
    rows += [("pid", str(failure.pid)), ("exitcode", status)]
    if failure.reason:
        rows.append(("reason", failure.reason))
    peers = failure.peer_ranks
    if peers is not None:
        named = f" (rank{'s' * (len(peers) > 1)} {', '.join(map(str, peers))})" if peers else ""
        rows.append(("caused by", f"a peer's failure{named}"))
    kept = failure.files_kept
    error_file = failure.error_file
    if error_file != NOT_AVAILABLE and not kept:
        error_file = NOT_KEPT
    rows += [("message", failure.message), ("error_file", error_file)]
    rows += sorted((name, path if kept else NOT_KEPT) for name, path in failure.log_files.items())
    lines = [f"[{rank}]:"]
    for name, value in rows:
        first, *rest = value.splitlines() or [""]
        lines.append(f"  {name:<{_LABEL_WIDTH}}: {first}")
        lines.extend(f"    {line}" for line in rest)
    lines.append(f"  {'traceback':<{_LABEL_WIDTH}}:")
    lines.extend(f"    {line}" for line in failure.traceback_text().splitlines())
    return "\n".join(lines)
