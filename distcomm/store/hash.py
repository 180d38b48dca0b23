"""HashStore: an in-process key-value store, and the value rules every store shares."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ..deadline import Deadline, to_seconds
from ..errors import DistStoreError, DistStoreTimeoutError, QueueEmptyError
from .base import Store, check_block, check_key, to_bytes

__all__ = [
    "HashStore",
    "KeysOrQueues",
    "Values",
    "add_value",
    "check_amount",
    "check_keys",
    "check_values",
    "compare_set_value",
    "queue_empty_error",
    "queue_timeout_error",
    "timeout_error",
]


#: Longest single sleep of a waiting HashStore call (it sleeps again until its deadline).
_MAX_NAP = 3600.0


class Values:
    """A key -> bytes table whose `append` costs the appended bytes, not the whole value.

    Appended values grow in a bytearray (amortised O(len(chunk)) per append); reading such
    a value turns it into bytes once, and the bytes are kept until the next append. The
    three local stores and the TCPStore server keep their data in one, so 10,000 appends
    of 1 KiB cost about 10 MiB of copying, not 50 GiB.
    """

    __slots__ = ("_data", "_growing")

    def __init__(self) -> None:
        self._data: dict = {}
        self._growing: dict = {}  # key -> bytearray holding the key's whole current value

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, key):
        if self._growing:
            grown = self._growing.pop(key, None)
            if grown is not None:
                self._data[key] = value = bytes(grown)
                return value
        return self._data[key]

    def get(self, key, default: bytes | None = None) -> bytes | None:
        """The value of `key`, or `default` when it is missing."""
        if self._growing and key in self._growing:
            return self[key]
        return self._data.get(key, default)

    def __setitem__(self, key, value: bytes) -> None:
        if self._growing:
            self._growing.pop(key, None)
        self._data[key] = value

    def delete(self, key) -> bool:
        """Remove `key`; whether it was there."""
        if key not in self._data:
            return False
        del self._data[key]
        if self._growing:
            self._growing.pop(key, None)
        return True

    def append(self, key, chunk: bytes) -> None:
        """Append `chunk` to the value of `key` (created empty)."""
        grown = self._growing.get(key)
        if grown is None:
            current = self._data.get(key)
            if current is None:
                self._data[key] = current = b""
            grown = self._growing[key] = bytearray(current)
        grown += chunk

    def size(self, key) -> int:
        """The length of the value of `key` (0 when missing), without materialising it."""
        grown = self._growing.get(key) if self._growing else None
        if grown is not None:
            return len(grown)
        value = self._data.get(key)
        return 0 if value is None else len(value)

    def keys(self):
        """The keys, in insertion order."""
        return self._data.keys()


def add_value(key: str | bytes, current: bytes | None, amount: int) -> bytes:
    """The decimal counter value `add(key, amount)` stores when `key` holds `current`.

    Raises:
        DistStoreError: `current` is not a decimal integer.
    """
    if current is None:
        return str(amount).encode()
    try:
        number = int(current)
    except ValueError:
        shown = current[:40]
        if isinstance(key, bytes):
            key = key.decode(errors="replace")
        raise DistStoreError(
            f"store key {key!r} holds {shown!r}, which is not an integer: add() only works on "
            "keys created by add() or set to decimal text"
        ) from None
    return str(number + amount).encode()


def compare_set_value(
    current: bytes | None, expected: bytes, desired: bytes
) -> tuple[bytes | None, bytes]:
    """torch's compare_set rule: (the value to store, or None to store nothing; the result).

    A missing key with an empty `expected` is set to `desired`; a key holding `expected`
    is set to `desired`; otherwise nothing changes and the result is the current value,
    or `expected` itself when the key is missing.
    """
    if (current is None and not expected) or current == expected:
        return desired, desired
    if current is None:
        return None, expected
    return None, current


def _torch_phrase(seconds: float, keys: Sequence[str], key_prefix: str | None) -> str:
    """torch's words for a store wait that timed out ("wait timeout after 100ms"), with its
    list of keys ("keys: /a, /b") where `key_prefix` says how torch's store shows them."""
    phrase = f"wait timeout after {round(seconds * 1000)}ms"
    if key_prefix is not None:
        phrase += ", keys: " + ", ".join(key_prefix + key for key in keys)
        return phrase + " -"
    return phrase + ":"


def timeout_error(
    missing: Sequence[str], seconds: float, where: str, key_prefix: str | None = None
) -> DistStoreTimeoutError:
    """The error for keys that did not appear: names them, the time waited and the store.

    It opens with torch's words ("wait timeout after 500ms"), so that code matching torch's
    message finds them; with `key_prefix`, torch's list of keys too (TCPStore: "/").
    """
    if len(missing) == 1:
        what = f"key {missing[0]!r} was not set"
    else:
        what = f"keys {list(missing)!r} were not set"
    return DistStoreTimeoutError(
        f"{_torch_phrase(seconds, missing, key_prefix)} {what} within {seconds:.1f} s in "
        f"{where} (did the process that sets it fail, or does it need a longer timeout?)"
    )


def queue_timeout_error(
    key: str, seconds: float, where: str, key_prefix: str | None = None
) -> DistStoreTimeoutError:
    """The error of a blocking queue_pop that got no item: names the queue and the time,
    after torch's words as `timeout_error` does."""
    return DistStoreTimeoutError(
        f"{_torch_phrase(seconds, [key], key_prefix)} queue {key!r} stayed empty for "
        f"{seconds:.1f} s in {where}: queue_pop gave up (did the process that pushes to it "
        "fail, or does it need a longer timeout?)"
    )


def queue_empty_error(key: str, where: str) -> QueueEmptyError:
    """The error of queue_pop(block=False) on an empty queue."""
    return QueueEmptyError(
        f"queue {key!r} in {where} is empty: queue_pop(block=False) does not wait "
        "(pass block=True to wait for an item, or look at queue_len first)"
    )


def log_still_waiting(
    logger: Any, what: str, waited: float, missing: Sequence[str], seconds: float, next_at: float
) -> None:
    """The warning of a store wait still waiting after DISTCOMM_STALL_WARN_S (`what`: the
    request and the store), naming the keys still missing."""
    shown = ", ".join(repr(key) for key in missing[:8]) + (
        f" and {len(missing) - 8} more" if len(missing) > 8 else ""
    )
    logger.warning(
        "%s has waited %.1f s for %s, not set yet: the process that sets it may be late, "
        "stuck or gone (waiting up to %.1f s; next report at %.1f s; "
        "DISTCOMM_STALL_WARN_S=0 turns these warnings off)",
        what,
        waited,
        shown,
        seconds,
        next_at,
    )


def check_keys(keys: Sequence[str]) -> list[str]:
    """Validate a sequence of keys (a lone str is refused: it is almost always a mistake).

    Raises:
        TypeError: `keys` is a str, or holds a non-str.
        ValueError: a key is empty.
    """
    if isinstance(keys, (str, bytes)):
        raise TypeError(
            f"keys must be a list of str, got the single {type(keys).__name__} {keys!r}"
        )
    return [check_key(key) for key in keys]


def check_amount(amount: int) -> int:
    """Validate an add() amount.

    Raises:
        TypeError: `amount` is not an int.
    """
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise TypeError(f"add() amount must be an int, got {type(amount).__name__}")
    return amount


def check_values(keys: list[str], values: Sequence[str | bytes]) -> list[bytes]:
    """The values of a multi_set as bytes, one per key.

    Raises:
        ValueError: the lengths differ.
        TypeError: a value is neither str nor bytes.
    """
    if isinstance(values, (str, bytes)) or len(keys) != len(values):
        count = "a single value" if isinstance(values, (str, bytes)) else f"{len(values)} values"
        raise ValueError(
            f"multi_set needs a list with one value per key, got {len(keys)} keys and {count}"
        )
    return [to_bytes(value) for value in values]


class HashStore(Store):
    """A store held in this process's memory, shared by its threads (torch's HashStore).

    Waiting methods block on a condition variable and honour the store timeout. Queues
    are kept beside the keys, one deque per queue.
    """

    def __init__(self) -> None:
        super().__init__()
        self._data = Values()
        self._queues: dict[str, deque[bytes]] = {}  # only non-empty queues
        self._cond = threading.Condition()

    def _wait_for(self, keys: list[str], timeout: float, queues: bool = False) -> None:
        """Wait (holding the condition) until every key is set; raise once `timeout` passes.

        With `queues` (wait, not get) a key also counts as set while its queue holds an
        item. Keys found set are not looked at again until the last one is (then all are,
        once, as one may have been deleted meanwhile): a wait for K keys costs O(K) lookups
        however many wake-ups it takes.
        """
        deadline = Deadline(timeout)
        data, index = (KeysOrQueues(self._data, self._queues) if queues else self._data), 0
        while True:
            while index < len(keys) and keys[index] in data:
                index += 1
            if index == len(keys):
                index = next((i for i, key in enumerate(keys) if key not in data), index)
                if index == len(keys):
                    return
            left = deadline.remaining()
            if left is not None and left <= 0:
                missing = [key for key in keys if key not in data]
                raise timeout_error(missing, timeout, "the HashStore")
            self._cond.wait(_MAX_NAP if left is None else min(left, _MAX_NAP))

    def set(self, key: str, value: str | bytes) -> None:
        """Store `value` under `key`, replacing any previous value."""
        check_key(key)
        data = to_bytes(value)
        with self._cond:
            self._data[key] = data
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        """The value of `key`, waiting up to the store timeout for it to be set.

        Raises:
            DistStoreTimeoutError: the key was not set in time.
        """
        check_key(key)
        with self._cond:
            self._wait_for([key], self._timeout)
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        """Add `amount` to the counter `key` (created at 0); returns the new value.

        Raises:
            DistStoreError: the key holds something other than an integer.
        """
        check_key(key)
        amount = check_amount(amount)
        with self._cond:
            value = add_value(key, self._data.get(key), amount)
            self._data[key] = value
            self._cond.notify_all()
            return int(value)

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Atomically set `key` to `desired_value` if it holds `expected_value` (see Store)."""
        check_key(key)
        expected = to_bytes(expected_value, "expected_value")
        desired = to_bytes(desired_value, "desired_value")
        with self._cond:
            new, result = compare_set_value(self._data.get(key), expected, desired)
            if new is not None:
                self._data[key] = new
                self._cond.notify_all()
            return result

    def wait(self, keys: Sequence[str], timeout: float | timedelta | None = None) -> None:
        """Block until every key in `keys` is set, up to `timeout` (default: the store's).

        Raises:
            DistStoreTimeoutError: names the keys still missing.
        """
        names = check_keys(keys)
        seconds = self._timeout if timeout is None else to_seconds(timeout)
        with self._cond:
            self._wait_for(names, seconds, queues=True)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in `keys` is set (or its queue holds an item), without waiting."""
        names = check_keys(keys)
        with self._cond:
            return all(key in self._data or key in self._queues for key in names)

    def delete_key(self, key: str) -> bool:
        """Delete `key`; returns whether it existed."""
        check_key(key)
        with self._cond:
            return self._data.delete(key)

    def num_keys(self) -> int:
        """The number of keys in the store."""
        with self._cond:
            return len(self._data)

    def append(self, key: str, value: str | bytes) -> None:
        """Append `value` to the value of `key` (created empty)."""
        check_key(key)
        data = to_bytes(value)
        with self._cond:
            self._data.append(key, data)
            self._cond.notify_all()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of `keys`, waiting up to the store timeout for all of them.

        Raises:
            DistStoreTimeoutError: names the keys still missing.
        """
        names = check_keys(keys)
        with self._cond:
            self._wait_for(names, self._timeout)
            return [self._data[key] for key in names]

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Set each key of `keys` to the value at the same position of `values`, atomically."""
        names = check_keys(keys)
        datas = check_values(names, values)
        with self._cond:
            for name, data in zip(names, datas, strict=True):
                self._data[name] = data
            self._cond.notify_all()

    # -- the extended API -----------------------------------------------------------------

    def has_extended_api(self) -> bool:
        """True: every extended operation is native here."""
        return True

    def list_keys(self) -> list[str]:
        """Every key, in the order they were first set (queues are not keys)."""
        with self._cond:
            return list(self._data.keys())

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Append `value` to the queue `key` (see Store.queue_push)."""
        check_key(key)
        data = to_bytes(value)
        with self._cond:
            self._queues.setdefault(key, deque()).append(data)
            self._cond.notify_all()

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest item of queue `key`, removed (see Store.queue_pop).

        Raises:
            QueueEmptyError: `block` is False and the queue is empty.
            DistStoreTimeoutError: no item came within the store timeout.
        """
        check_key(key)
        check_block(block)
        with self._cond:
            if key not in self._queues:
                if not block:
                    raise queue_empty_error(key, "the HashStore")
                deadline = Deadline(self._timeout)
                while key not in self._queues:
                    left = deadline.remaining()
                    if left is not None and left <= 0:
                        raise queue_timeout_error(key, self._timeout, "the HashStore")
                    self._cond.wait(_MAX_NAP if left is None else min(left, _MAX_NAP))
            items = self._queues[key]
            value = items.popleft()
            if not items:
                del self._queues[key]
            return value

    def queue_len(self, key: str) -> int:
        """The number of items in queue `key` (0 when it has none)."""
        check_key(key)
        with self._cond:
            items = self._queues.get(key)
            return 0 if items is None else len(items)

    def __repr__(self) -> str:
        return "HashStore()"


class KeysOrQueues:
    """`key in` a key table or a table of non-empty queues: what wait and check count as set."""

    __slots__ = ("_data", "_queues")

    def __init__(self, data: Values, queues: dict) -> None:
        self._data, self._queues = data, queues

    def __contains__(self, key: object) -> bool:
        return key in self._data or key in self._queues
