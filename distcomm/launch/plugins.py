"""Plug-ins a distcomm-run flag names: built-in and registered ones, then an entry-point group.

`--logs-specs` and `--event-log-handler` both pick an object by name this way, as
torchrun's do: a name registered in the process wins, else an installed package's entry
point of that name is loaded; an unknown name is refused with the list of known ones.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from importlib import metadata

__all__ = ["NamedPlugins"]

T = TypeVar("T")


class NamedPlugins(Generic[T]):
    """Objects chosen by name for one flag.

    Args:
        flag: the flag, for messages ("--logs-specs").
        kind: what an object is, for messages ("LogsSpecs", "event handler").
        group: the entry-point group third-party packages declare them in.
        register_name: the function that registers one, for messages.
        builtins: the built-in objects by name.
        accepts: whether an object (registered or loaded) is of the right kind.
        expected: what `accepts` wants, for messages ("a subclass of LogsSpecs").
    """

    def __init__(
        self,
        flag: str,
        kind: str,
        group: str,
        register_name: str,
        builtins: dict[str, T],
        accepts: Callable[[object], bool],
        expected: str,
    ) -> None:
        self.flag, self.kind, self.group = flag, kind, group
        self._register_name, self._accepts, self._expected = register_name, accepts, expected
        self._lock = threading.Lock()
        self._items: dict[str, T] = dict(builtins)

    def register(self, name: str, value: T) -> None:
        """Make `flag`=`name` choose `value`.

        Raises:
            ValueError: `name` is empty or already registered with another object.
            TypeError: `value` is not of the kind this flag takes.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty name, got {name!r}")
        if not self._accepts(value):
            raise TypeError(f"{self.flag}={name!r}: {value!r} is not {self._expected}")
        with self._lock:
            if self._items.get(name, value) is not value:
                raise ValueError(f"{self.flag} name {name!r} is already registered")
            self._items[name] = value

    def _entry_points(self) -> dict[str, metadata.EntryPoint]:
        from importlib import metadata  # ~40 ms of imports: only when a name is looked up

        return {ep.name: ep for ep in metadata.entry_points(group=self.group)}

    def names(self) -> list[str]:
        """Every name the flag accepts (built-in, registered, entry points)."""
        with self._lock:
            names = set(self._items)
        return sorted(names | set(self._entry_points()))

    def get(self, name: str) -> T:
        """The object `name` chooses.

        Raises:
            ValueError: the name is unknown (the message lists the known ones), or its
                entry point fails to load or loads the wrong kind of object.
        """
        with self._lock:
            value = self._items.get(name)
        if value is not None:
            return value
        entry = self._entry_points().get(name)
        if entry is None:
            raise ValueError(
                f"{self.flag}={name!r} is not a known {self.kind} (could not find entrypoint "
                f"{name!r} in the {self.group!r} group); the known ones are "
                f"{', '.join(self.names())} (add one with {self._register_name} or the "
                f"{self.group!r} entry-point group)"
            )
        try:
            loaded = entry.load()
        except Exception as exc:  # a broken plug-in: say which
            raise ValueError(
                f"{self.flag}={name!r}: loading entry point {entry.value!r} failed: {exc}"
            ) from exc
        if not self._accepts(loaded):
            raise ValueError(
                f"{self.flag}={name!r}: entry point {entry.value!r} is not {self._expected}"
            )
        return loaded  # type: ignore[no-any-return]
