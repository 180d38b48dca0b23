"""`ErrorHandler`: how `record` writes a worker's exception to the error file the agent reads.

`record` (in `errors/api.py`) calls the handler it was given, or `get_error_handler()`'s:
`initialize()` before the entrypoint runs, `record_exception(e)` when it raises, and
`dump_error_file(child_error_file, exitcode)` when it raises `ChildFailedError` (a
launcher inside a launcher), so that the outer agent reports the first real failure.
Subclass it to send errors elsewhere as well (torch's
``torch.distributed.elastic.multiprocessing.errors.ErrorHandler`` has the same methods).

Torch's module path, ``distcomm.launch.errors.error_handler``, names this module's
contents; the module itself stays here, outside the `errors` package, so that the
exception hook every worker installs (`excepthook.py`) imports nothing more than it
needs (the package's report code brings psutil).
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import json
import logging
import os
import time
import traceback
from typing import Any

from ..config import get as env_var
from ..errors import peer_failure

__all__ = ["ERROR_FILE_ENV", "TORCH_ERROR_FILE_ENV", "ErrorHandler", "get_error_handler"]

log = logging.getLogger(__name__)

#: where `@record` writes a worker's exception; the launcher sets it for every worker
ERROR_FILE_ENV = "DISTCOMM_ERROR_FILE"
#: torchelastic's name for the same file, read when ours is unset (and set by the launcher)
TORCH_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def exception_record(exc: BaseException) -> dict[str, Any]:
    """The error file's content for `exc`: message, traceback and time (see `errors/failure.py`),
    and ``peer_ranks`` when it follows from a peer's failure (`distcomm.errors.peer_failure`)."""
    now_ns = time.time_ns()
    info: dict[str, Any] = {
        "py_callstack": "".join(traceback.format_exception(exc)),
        "timestamp": str(now_ns // 1_000_000_000),
        "timestamp_ns": str(now_ns),
    }
    peers = peer_failure(exc)
    if peers is not None:
        info["peer_ranks"] = list(peers)
    return {"message": {"message": f"{type(exc).__name__}: {exc}", "extraInfo": info}}


class ErrorHandler:
    """Writes a worker's exception, as JSON, to the error file the launcher gave it.

    The file is named by ``DISTCOMM_ERROR_FILE``, else ``TORCHELASTIC_ERROR_FILE``; with
    neither set nothing is written. Writing never raises: a file that cannot be written
    is logged, so the exception being recorded is what the caller sees. Subclasses
    usually override `initialize` and `record_exception`.
    """

    def _get_error_file_path(self) -> str | None:
        """The error file to write, or None to write nothing."""
        return env_var(ERROR_FILE_ENV) or env_var(TORCH_ERROR_FILE_ENV)

    def initialize(self) -> None:
        """Prepare to capture errors; called before the recorded function runs.

        Enables `faulthandler` (all threads), so a crash in native code leaves a Python
        stack on stderr.
        """
        if faulthandler.is_enabled():
            return
        try:
            faulthandler.enable(all_threads=True)
        except (RuntimeError, ValueError, OSError) as exc:  # e.g. no usable stderr
            log.warning("could not enable faulthandler (%s: %s)", type(exc).__name__, exc)

    def _write_error_file(self, file_path: str, error_msg: str) -> None:
        """Write `error_msg` to `file_path` atomically (a reader never sees half a file).

        An existing file is replaced with a warning; a failure to write is logged.
        """
        if os.path.exists(file_path):
            log.warning("error file %s already exists; overwriting it with this error", file_path)
        tmp = f"{file_path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as fp:
                fp.write(error_msg)
            os.replace(tmp, file_path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            log.warning(
                "could not write the error file %s (%s); the exception follows unrecorded",
                file_path,
                exc,
            )

    def record_exception(self, e: BaseException) -> None:
        """Write `e`'s message, traceback and time to the error file (if one is set)."""
        path = self._get_error_file_path()
        if path:
            self._write_error_file(path, json.dumps(exception_record(e)))

    def override_error_code_in_rootcause_data(
        self,
        rootcause_error_file: str,
        rootcause_error: dict[str, Any],
        error_code: int = 0,
    ) -> None:
        """Set ``message.errorCode`` of a child's error record (read from
        `rootcause_error_file`) to `error_code`, the child's exit status, which the child
        could not record itself when a signal ended it. A record whose ``message`` is a
        string (torch's C++ layout) or missing is left as it is, with a warning.
        """
        message = rootcause_error.get("message")
        if isinstance(message, dict):
            message["errorCode"] = error_code
        else:
            log.warning(
                "error record from %s has no message object; its error code stays unset "
                "(wanted %s)",
                rootcause_error_file,
                error_code,
            )

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        """Copy a child's error file (the root cause) into this process's error file.

        Args:
            rootcause_error_file: the failed child's error file.
            error_code: the child's exit status, set as ``message.errorCode`` unless 0.

        Raises:
            OSError: `rootcause_error_file` cannot be read.
            ValueError: it is not JSON.
        """
        with open(rootcause_error_file, encoding="utf-8") as fp:
            rootcause_error = json.load(fp)
        self._dump_error_data(rootcause_error_file, rootcause_error, error_code)

    def _dump_error_data(self, source: str, rootcause_error: Any, error_code: int) -> None:
        """`dump_error_file` for a record already read (its file may be gone, or on
        another node): `source` names where it came from, for messages."""
        data = copy.deepcopy(rootcause_error)
        if error_code and isinstance(data, dict):
            self.override_error_code_in_rootcause_data(source, data, error_code)
        path = self._get_error_file_path()
        if path:
            self._write_error_file(path, json.dumps(data))
        else:
            log.debug("no error file is set for this process to copy %s into", source)


def get_error_handler() -> ErrorHandler:
    """A new default `ErrorHandler` (what `record` uses when given none)."""
    return ErrorHandler()
