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
from importlib import metadata
from typing import Any

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
_factories: dict[str, Callable[[], logging.Handler]] = {
    "console": _StderrHandler,
    "null": logging.NullHandler,
    "dynamic_rendezvous": logging.NullHandler,
}
_loggers: dict[str, logging.Logger] = {}


def register_event_handler(name: str, factory: Callable[[], logging.Handler]) -> None:
    """Make --event-log-handler=`name` send events to the handler `factory()` returns.

    Raises:
        ValueError: `name` is empty or already registered.
        TypeError: `factory` is not callable.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"an event handler needs a non-empty name, got {name!r}")
    if not callable(factory):
        raise TypeError(f"event handler {name!r}: the factory must be callable")
    with _lock:
        if name in _factories and _factories[name] is not factory:
            raise ValueError(f"event handler {name!r} is already registered")
        _factories[name] = factory


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def registered_event_handlers() -> list[str]:
    """The names --event-log-handler accepts (built-in, registered, entry points)."""
    with _lock:
        names = set(_factories)
    return sorted(names | set(_entry_points()))


def _factory(name: str) -> Callable[[], logging.Handler]:
    with _lock:
        factory = _factories.get(name)
    if factory is not None:
        return factory
    entry = _entry_points().get(name)
    if entry is None:
        raise ValueError(
            f"--event-log-handler={name!r} is not a known event handler; the known ones are "
            f"{', '.join(registered_event_handlers())} (add one with register_event_handler "
            f"or the {ENTRY_POINT_GROUP!r} entry-point group)"
        )
    try:
        loaded = entry.load()
    except Exception as exc:  # a broken plug-in: say which
        raise ValueError(
            f"--event-log-handler={name!r}: loading entry point {entry.value!r} failed: {exc}"
        ) from exc
    if not callable(loaded):
        raise ValueError(f"--event-log-handler={name!r}: {entry.value!r} is not callable")
    return loaded  # type: ignore[no-any-return]


def get_event_handler(name: str = "null") -> logging.Logger:
    """The logger that events for handler `name` go to (made once per name).

    Raises:
        ValueError: `name` is unknown (the message lists the known ones).
    """
    with _lock:
        logger = _loggers.get(name)
    if logger is not None:
        return logger
    handler = _factory(name)()
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
