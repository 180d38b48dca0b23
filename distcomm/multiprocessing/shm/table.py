"""The shm manager's reference table: who holds how many references to which segment.

`SegmentTable` does no I/O: the daemon (`manager.ShmManager`) applies each client's
register/send/claim/release to it and unlinks the names whose count reached zero, and tests
drive it directly. The counting rules are described in `manager`.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

__all__ = ["SegmentTable"]


@dataclass
class _Segment:
    owned: int = 0  # references held by connected processes, summed
    in_flight: int = 0  # references pickled into messages nobody has claimed yet


class SegmentTable:
    """Reference counts of the segments one manager tracks; no I/O, so tests drive it directly.

    Owners are connection ids. Every mutator returns the names whose count reached zero:
    they are forgotten, and the caller unlinks them.
    """

    def __init__(self) -> None:
        self._segments: dict[str, _Segment] = {}
        self._owners: dict[int, collections.Counter[str]] = {}

    def register(self, owner: int, name: str) -> None:
        """`owner` holds one more reference to `name` (a new or an already tracked segment)."""
        self._segments.setdefault(name, _Segment()).owned += 1
        self._owners.setdefault(owner, collections.Counter())[name] += 1

    def send(self, name: str) -> None:
        """One more in-flight reference to `name`.

        Raises:
            LookupError: `name` is not tracked (never registered, or already unlinked).
        """
        self._known(name).in_flight += 1

    def claim(self, owner: int, name: str) -> bool:
        """`owner` takes one in-flight reference to `name` as its own.

        Returns:
            True; False when no reference was in flight, in which case `owner` still gets
            one (it uses the segment, so the segment must live while it does).

        Raises:
            LookupError: `name` is not tracked.
        """
        segment = self._known(name)
        took = segment.in_flight > 0
        if took:
            segment.in_flight -= 1
        segment.owned += 1
        self._owners.setdefault(owner, collections.Counter())[name] += 1
        return took

    def release(self, owner: int, name: str) -> list[str]:
        """`owner` drops one of its references to `name`.

        Raises:
            LookupError: `owner` holds no reference to `name` (e.g. a forked child
                releasing what its parent registered).
        """
        held = self._owners.get(owner)
        if not held or held[name] <= 0:
            raise LookupError(f"connection holds no reference to {name}")
        held[name] -= 1
        if not held[name]:
            del held[name]
        self._segments[name].owned -= 1
        return self._collect([name])

    def drop_owner(self, owner: int) -> list[str]:
        """Drop every reference `owner` holds (its connection closed); in-flight ones stay."""
        held = self._owners.pop(owner, None)
        if not held:
            return []
        for name, count in held.items():
            self._segments[name].owned -= count
        return self._collect(held)

    def counts(self, name: str) -> tuple[int, int]:
        """(owned, in-flight) references to `name`; (0, 0) when it is not tracked."""
        segment = self._segments.get(name)
        return (0, 0) if segment is None else (segment.owned, segment.in_flight)

    def names(self) -> list[str]:
        """Every tracked segment, sorted."""
        return sorted(self._segments)

    def clear(self) -> list[str]:
        """Forget everything; the names that were tracked, sorted (to unlink them all)."""
        names = self.names()
        self._segments.clear()
        self._owners.clear()
        return names

    def __len__(self) -> int:
        return len(self._segments)

    def _known(self, name: str) -> _Segment:
        segment = self._segments.get(name)
        if segment is None:
            raise LookupError(f"segment {name} is not tracked (never registered, or unlinked)")
        return segment

    def _collect(self, names) -> list[str]:
        dead = [
            name
            for name in names
            if self._segments[name].owned + self._segments[name].in_flight <= 0
        ]
        for name in dead:
            del self._segments[name]
        return dead
