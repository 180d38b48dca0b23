"""The Store interface: torch.distributed's key-value store method set."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from datetime import timedelta

from ..config import DEFAULT_STORE_TIMEOUT
from ..deadline import to_seconds

__all__ = ["Store", "check_key", "publish", "to_bytes"]


def to_bytes(value: str | bytes | bytearray | memoryview, name: str = "value") -> bytes:
    """A store value as bytes: str is UTF-8 encoded, bytes-like is copied.

    Raises:
        TypeError: `value` is neither str nor bytes-like.
    """
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store {name} must be str or bytes, got {type(value).__name__}")


def check_key(key: str) -> str:
    """Validate a store key (a non-empty str).

    Raises:
        TypeError: `key` is not a str.
        ValueError: `key` is empty.
    """
    if not isinstance(key, str):
        raise TypeError(f"store key must be a str, got {type(key).__name__}")
    if not key:
        raise ValueError("store key must be a non-empty string")
    return key


class Store(ABC):
    """A key-value store shared by the processes of a job (torch.distributed.Store).

    Keys are str, values bytes (str values are UTF-8 encoded). Counters made by
    `add` are stored as decimal text, as torch does. Methods that wait for keys
    raise `DistStoreTimeoutError` naming the missing keys once `timeout` passes.
    """

    def __init__(self, timeout: float | timedelta | None = DEFAULT_STORE_TIMEOUT) -> None:
        self._timeout = DEFAULT_STORE_TIMEOUT if timeout is None else to_seconds(timeout)

    @property
    def timeout(self) -> timedelta:
        """The default timeout of waiting operations."""
        return timedelta(seconds=self._timeout)

    def set_timeout(self, timeout: float | timedelta) -> None:
        """Set the default timeout of `get` and `wait` (seconds or timedelta)."""
        self._timeout = to_seconds(timeout)

    @abstractmethod
    def set(self, key: str, value: str | bytes) -> None:
        """Store `value` under `key`, replacing any previous value."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The value of `key`, waiting up to the store timeout for it to be set."""

    @abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Add `amount` to the integer counter `key` (created at 0); returns the new value."""

    @abstractmethod
    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Atomically set `key` to `desired_value` if it holds `expected_value`.

        A missing key counts as holding the empty value. Returns the value the key
        holds afterwards when the swap happened, the current value when it did not,
        and `expected_value` when the key is missing and `expected_value` is not empty.
        """

    @abstractmethod
    def wait(self, keys: Sequence[str], timeout: float | timedelta | None = None) -> None:
        """Block until every key in `keys` is set, up to `timeout` (default: the store's)."""

    @abstractmethod
    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in `keys` is set, without waiting."""

    @abstractmethod
    def delete_key(self, key: str) -> bool:
        """Delete `key`; returns whether it existed."""

    @abstractmethod
    def num_keys(self) -> int:
        """The number of keys in the store."""

    @abstractmethod
    def append(self, key: str, value: str | bytes) -> None:
        """Append `value` to the value of `key` (created empty)."""

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of `keys`, waiting for each as `get` does."""
        return [self.get(key) for key in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Set each key of `keys` to the value at the same position of `values`."""
        if len(keys) != len(values):
            raise ValueError(
                f"multi_set needs as many values as keys, got {len(keys)} keys "
                f"and {len(values)} values"
            )
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def clone(self) -> Store:
        """A store on the same data that another thread may use while this one is blocked in
        a wait (torch's Store.clone): a new connection where the store has one; a store
        that is safe to share between threads returns itself (then do not close it apart).
        """
        return self

    def close(self) -> None:  # noqa: B027 - optional hook, stores without resources keep it
        """Release connections and, for a hosting store, stop its server."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def publish(store: Store, key: str, value: str | bytes) -> None:
    """Set `key` and return once every client of `store` can read it.

    TCPStore's `set` returns once the request is sent, as torch's does: a `get` or
    `wait` anywhere sees the value when it lands, but a client that looks without waiting
    (`check`, `add`, `compare_set`, a `get` of a key that held an older value) right after
    `set` returned may be served first. An answered request on the same connection is
    served after the set, so once it returns the value is there for everyone.
    """
    store.set(key, value)
    store.check([key])
