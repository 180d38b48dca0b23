"""--logs-specs: where the workers' log and error files go, as torch's ``LogsSpecs``.

A `LogsSpecs` holds torchrun's --log-dir, --redirects, --tee and --local-ranks-filter and
names the directory of each start of the worker group (`attempt_dir`); inside it each
local rank has ``<local_rank>/stdout.log``, ``stderr.log`` and ``error.json``, and the
node has ``filtered_stdout.log`` / ``filtered_stderr.log`` (--duplicate-*-filters).
`DefaultLogsSpecs` (``--logs-specs=default``, or no flag) lays them out as torchrun does:
``<log_dir>/<run_id>_<random>/attempt_<n>/``; without a log dir, in the agent's temporary
directory. Others come from `register_logs_specs` or the ``distcomm.logs_specs``
entry-point group (a subclass of `LogsSpecs`).
"""

from __future__ import annotations

import os
import tempfile
import threading
from abc import ABC, abstractmethod

from .plugins import NamedPlugins
from .workers import Std

__all__ = [
    "DefaultLogsSpecs",
    "LogsSpecs",
    "get_logs_specs_class",
    "register_logs_specs",
    "registered_logs_specs",
]

ENTRY_POINT_GROUP = "distcomm.logs_specs"
DEFAULT_NAME = "default"


def _to_map(value: Std | int | dict[int, Std], nproc: int) -> dict[int, Std]:
    if isinstance(value, dict):
        return {lr: Std(value.get(lr, Std.NONE)) for lr in range(nproc)}
    return dict.fromkeys(range(nproc), Std(value))


class LogsSpecs(ABC):
    """The logging part of a launch (torch's constructor arguments).

    Args:
        log_dir: the base directory of the log files (None: the agent's temp directory).
        redirects: streams sent to files only: one Std for all local ranks, or a map.
        tee: streams sent to files and the console: one Std, or a map.
        local_ranks_filter: the local ranks shown on the console (None: all).
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        self._root_log_dir = log_dir
        self._redirects = redirects
        self._tee = tee
        self._local_ranks_filter = None if local_ranks_filter is None else set(local_ranks_filter)

    @property
    @abstractmethod
    def root_log_dir(self) -> str:
        """The base directory given (or "" for none)."""

    @abstractmethod
    def attempt_dir(self, run_id: str, attempt: int) -> str | None:
        """The directory for the `attempt`-th start (0, 1, ...) of this node's workers, or
        None for the agent's temporary directory."""

    def redirects(self, nproc: int) -> dict[int, Std]:
        """--redirects per local rank."""
        return _to_map(self._redirects, nproc)

    def tee(self, nproc: int) -> dict[int, Std]:
        """--tee per local rank."""
        return _to_map(self._tee, nproc)

    @property
    def local_ranks_filter(self) -> set[int] | None:
        """--local-ranks-filter (None: every local rank is shown)."""
        return None if self._local_ranks_filter is None else set(self._local_ranks_filter)


class DefaultLogsSpecs(LogsSpecs):
    """torchrun's layout: ``<log_dir>/<run_id>_<random>/attempt_<n>/<local_rank>/``.

    Raises:
        NotADirectoryError: `log_dir` is a file.
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        if log_dir and os.path.isfile(log_dir):
            raise NotADirectoryError(f"--log-dir={log_dir!r} is a file; give a directory")
        super().__init__(log_dir, redirects, tee, local_ranks_filter)
        self._run_dir: str | None = None
        self._lock = threading.Lock()

    @property
    def root_log_dir(self) -> str:
        return self._root_log_dir or ""

    def attempt_dir(self, run_id: str, attempt: int) -> str | None:
        if not self._root_log_dir:
            return None
        with self._lock:
            if self._run_dir is None:
                os.makedirs(self._root_log_dir, exist_ok=True)
                self._run_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=self._root_log_dir)
        return os.path.join(self._run_dir, f"attempt_{attempt}")

    def __repr__(self) -> str:
        return (
            f"DefaultLogsSpecs(root_log_dir={self._root_log_dir!r}, "
            f"redirects={self._redirects!r}, tee={self._tee!r}, "
            f"local_ranks_filter={self._local_ranks_filter!r})"
        )


_plugins: NamedPlugins[type[LogsSpecs]] = NamedPlugins(
    "--logs-specs",
    "LogsSpecs",
    ENTRY_POINT_GROUP,
    "register_logs_specs",
    {DEFAULT_NAME: DefaultLogsSpecs},
    lambda cls: isinstance(cls, type) and issubclass(cls, LogsSpecs),
    "a subclass of distcomm.launch.logs_specs.LogsSpecs",
)


def register_logs_specs(name: str, cls: type[LogsSpecs]) -> None:
    """Make --logs-specs=`name` use `cls`.

    Raises:
        ValueError: `name` is empty or already registered with another class.
        TypeError: `cls` is not a subclass of `LogsSpecs`.
    """
    _plugins.register(name, cls)


def registered_logs_specs() -> list[str]:
    """The names --logs-specs accepts."""
    return _plugins.names()


def get_logs_specs_class(name: str | None) -> type[LogsSpecs]:
    """The LogsSpecs class --logs-specs=`name` names (None: `DefaultLogsSpecs`).

    Raises:
        ValueError: the name is unknown (the message lists the known ones), or its entry
            point does not load a `LogsSpecs` subclass.
    """
    return DefaultLogsSpecs if name is None else _plugins.get(name)
