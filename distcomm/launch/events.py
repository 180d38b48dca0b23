"""The agent's events (--event-log-handler): torchelastic's event records and handler names.

Each event is torch's ``Event`` serialized as one JSON line: ``{"name":
"torchelastic.worker.status.START", "source": "WORKER", "timestamp": <ms>, "metadata":
{...}}``, logged at INFO to the logger ``distcomm-events-<handler>``, which has the named
handler only and does not propagate. The agent records:

- ``RENDEZVOUS`` (source AGENT, with ``duration_ms``): a rendezvous round completed;
- ``START`` (WORKER): once per worker when the group starts;
- ``FAILED`` / ``TERMINATED`` / ``SUCCEEDED`` (WORKER): each worker when the group ends
  (TERMINATED: stopped by the agent because another worker failed);
- ``RESTART`` (AGENT): the group is restarted after a failure (distcomm's addition);
- ``SUCCEEDED`` / ``FAILED`` (AGENT): the run's outcome on this node.

Handlers: ``console`` (the agent's stderr), ``null`` and ``dynamic_rendezvous`` (both drop
events: torch's names), any registered with `register_event_handler`, and any that an
installed package declares in the ``distcomm.event_handlers`` entry-point group (a
callable returning a ``logging.Handler``).
"""

from __future__ import annotations

import enum
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from .plugins import NamedPlugins

__all__ = [
    "Event",
    "EventSource",
    "get_event_handler",
    "record",
    "register_event_handler",
    "registered_event_handlers",
]

ENTRY_POINT_GROUP = "distcomm.event_handlers"

log = logging.getLogger(__name__)


class EventSource(str, enum.Enum):
    """Who an event is about (torch's names)."""

    AGENT = "AGENT"
    WORKER = "WORKER"


@dataclass
class Event:
    """One event: ``torchelastic.worker.status.<STATE>``, its source, time (ms) and data."""

    name: str
    source: EventSource
    timestamp: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    def serialize(self) -> str:
        """The event as one JSON object (torch's layout)."""
        data = asdict(self)
        data["source"] = self.source.value
        return json.dumps(data)

    def __str__(self) -> str:
        return self.serialize()


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is at the time of each event."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.setStream(sys.stderr)
        super().emit(record)


_lock = threading.Lock()
_plugins: NamedPlugins[Callable[[], logging.Handler]] = NamedPlugins(
    "--event-log-handler",
    "event handler",
    ENTRY_POINT_GROUP,
    "register_event_handler",
    {
        "console": _StderrHandler,
        "null": logging.NullHandler,
        "dynamic_rendezvous": logging.NullHandler,
    },
    callable,
    "callable (a factory of a logging.Handler)",
)
_loggers: dict[str, logging.Logger] = {}


def register_event_handler(name: str, factory: Callable[[], logging.Handler]) -> None:
    """Make --event-log-handler=`name` send events to the handler `factory()` returns.

    Raises:
        ValueError: `name` is empty or already registered.
        TypeError: `factory` is not callable.
    """
    _plugins.register(name, factory)


def registered_event_handlers() -> list[str]:
    """The names --event-log-handler accepts (built-in, registered, entry points)."""
    return _plugins.names()


def get_event_handler(name: str = "null") -> logging.Logger:
    """The logger that events for handler `name` go to (made once per name).

    Raises:
        ValueError: `name` is unknown (the message lists the known ones).
    """
    with _lock:
        logger = _loggers.get(name)
    if logger is not None:
        return logger
    handler = _plugins.get(name)()
    if not isinstance(handler, logging.Handler):
        raise ValueError(
            f"--event-log-handler={name!r} made a {type(handler).__name__}, not a logging.Handler"
        )
    with _lock:
        logger = _loggers.get(name)
        if logger is None:
            logger = logging.getLogger(f"distcomm-events-{name}")
            logger.setLevel(logging.INFO)
            logger.propagate = False
            logger.addHandler(handler)
            _loggers[name] = logger
    return logger


def record(event: Event, destination: str = "null") -> None:
    """Send `event` to the handler named `destination` (its timestamp set if 0)."""
    if not event.timestamp:
        event.timestamp = int(time.time() * 1000)
    try:
        get_event_handler(destination).info(event.serialize())
    except (OSError, ValueError) as exc:  # an event must never stop the run
        log.warning("distcomm-run: event %s not recorded: %s", event.name, exc)
