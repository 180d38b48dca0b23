"""Deadlines on the monotonic clock, created once per blocking call and passed down.

Every layer below the call (a collective's steps, a socket write, a store wait) reads the
one deadline it is given instead of starting a clock of its own, so a timeout means the
same thing however deep the wait is. Keep it that way: take a `Deadline` argument, do
not derive a new timeout from the group's.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta

__all__ = ["FOREVER", "Deadline", "StallClock", "to_seconds"]

#: Seconds (about three years) beyond which a timeout is taken as none: sockets, locks and
#: event loops refuse timeouts beyond a few hundred years or even 25 days, and no job waits
#: this long on purpose.
FOREVER = 1e8


def to_seconds(timeout: float | timedelta | None, *, name: str = "timeout") -> float | None:
    """Normalise a timeout given as seconds or a `timedelta`; None stays None (no limit).

    Raises:
        TypeError: the value is neither a number nor a timedelta.
        ValueError: the value is negative or NaN.
    """
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"{name} must be a number of seconds or a datetime.timedelta, "
            f"got {type(timeout).__name__}"
        )
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{name} must be >= 0 seconds, got {seconds}")
    return seconds


class Deadline:
    """A point in time by which a blocking operation must finish.

    Args:
        seconds: time allowed from now; None, or more than `FOREVER`, means no limit (the
            value is kept in `seconds` for messages).
    """

    __slots__ = ("_end", "seconds")

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self._end = math.inf if seconds is None or seconds > FOREVER else time.monotonic() + seconds

    @classmethod
    def of(cls, timeout: float | timedelta | None) -> Deadline:
        """A deadline `timeout` (seconds or timedelta, None for none) from now."""
        return cls(to_seconds(timeout))

    def remaining(self) -> float | None:
        """Seconds left (0.0 once expired), or None when there is no limit."""
        if self._end == math.inf:
            return None
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return time.monotonic() >= self._end

    def slice(self, most: float) -> float:
        """Seconds to block next: what is left, but at most `most` (for polling loops)."""
        left = self.remaining()
        return most if left is None else min(most, left)

    def nap(self, delay: float, most: float, cap: float | None = None) -> float:
        """Sleep `delay` seconds (never past the deadline, nor past `cap` seconds when
        given: an event the poller knows is due sooner) between two polls; returns the
        next delay: twice `delay`, at most `most` (exponential backoff)."""
        time.sleep(self.slice(delay if cap is None else min(delay, cap)))
        return min(delay * 2, most)

    def __repr__(self) -> str:
        left = self.remaining()
        return "Deadline(none)" if left is None else f"Deadline({left:.3f}s left)"


class StallClock:
    """When a wait that is still waiting should say so: after `warn` seconds (0: never),
    then after twice as long each time (DISTCOMM_STALL_WARN_S's 30, 60, 120 s ...),
    counted from `started` (a time.monotonic(); default now)."""

    __slots__ = ("_at", "_started")

    def __init__(self, warn: float, started: float | None = None) -> None:
        self._started = time.monotonic() if started is None else started
        self._at = warn if warn > 0 else math.inf

    def due(self) -> float | None:
        """The seconds waited when a warning is due now (the next one is then twice as far
        out), else None."""
        waited = time.monotonic() - self._started
        if waited < self._at:
            return None
        while self._at <= waited:
            self._at *= 2
        return waited

    def until_next(self) -> float:
        """Seconds until the next warning is due (inf when it never is)."""
        return max(0.0, self._at - (time.monotonic() - self._started))

    @property
    def next(self) -> float:
        """The wait, in seconds, at which the next warning is due."""
        return self._at
