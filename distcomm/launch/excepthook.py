"""A `sys.excepthook` that writes a worker's uncaught exception to its error file (no `@record`).

distcomm-run (and torchrun) give every worker an error file (``DISTCOMM_ERROR_FILE``,
``TORCHELASTIC_ERROR_FILE``). `install`, which `init_process_group` calls, puts
`RecordingHook` in front of the hook installed before it: an exception that ends the
program is written to that file in `@record`'s layout (message, traceback, time and, for
an error that follows from a peer's failure, ``peer_ranks``), then passed to the previous
hook, which prints it as before. So the failure report quotes the exception of a script
that was never decorated, and can tell the rank that failed first from those that failed
because of it.

- `@record` wins: it writes the file before the exception reaches the hook, and a file
  already written is left as it is.
- Only the process that installed the hook writes: a forked child that inherited it (and
  the error file's variable) passes its exceptions on unrecorded.
- `KeyboardInterrupt` and other non-`Exception`s pass through unrecorded, as with
  `@record`; a hook that fails to write passes the exception on all the same.
- With no error file set (not under a launcher) nothing is installed.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .error_handler import ErrorHandler

__all__ = ["RecordingHook", "install", "uninstall"]

_ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]

_lock = threading.Lock()
_installed: RecordingHook | None = None


class RecordingHook:
    """`sys.excepthook`: record the exception (see the module's docstring), then call
    `previous`.

    Args:
        previous: the hook to pass every exception on to.
        handler: what writes the error file.
    """

    def __init__(self, previous: _ExceptHook, handler: ErrorHandler) -> None:
        self.previous = previous
        self.handler = handler
        self.active = True
        self.pid = os.getpid()

    def __call__(
        self, exc_type: type[BaseException], exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self.active and os.getpid() == self.pid and issubclass(exc_type, Exception):
                self._record(exc_type() if exc is None else exc, tb)
        except Exception:
            pass  # never in the way of the exception being reported
        finally:
            self.previous(exc_type, exc, tb)  # type: ignore[arg-type]

    def _record(self, exc: BaseException, tb: TracebackType | None) -> None:
        path = self.handler._get_error_file_path()
        if not path or os.path.exists(path):
            return  # not launched, or @record (or a nested launcher) wrote it already
        if exc.__traceback__ is None and tb is not None:
            exc = exc.with_traceback(tb)
        self.handler.record_exception(exc)


def install(handler: ErrorHandler | None = None) -> bool:
    """Put a `RecordingHook` in front of `sys.excepthook` when this process has an error
    file; once (calling it again while it is installed changes nothing).

    Args:
        handler: what writes the error file; default: a new `ErrorHandler`.

    Returns:
        Whether the hook is installed.
    """
    global _installed
    handler = ErrorHandler() if handler is None else handler
    with _lock:
        if _installed is not None:
            return True
        if not handler._get_error_file_path():
            return False
        _installed = RecordingHook(sys.excepthook, handler)
        sys.excepthook = _installed
    return True


def uninstall() -> bool:
    """Undo `install`: restore the previous hook (or, when another hook was installed on
    top since, switch ours off so that it only passes exceptions on).

    Returns:
        Whether a hook was installed.
    """
    global _installed
    with _lock:
        hook, _installed = _installed, None
        if hook is None:
            return False
        hook.active = False
        if sys.excepthook is hook:
            sys.excepthook = hook.previous
    return True
