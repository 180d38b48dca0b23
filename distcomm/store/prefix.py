"""PrefixStore: a namespace inside another store (every key becomes "prefix/key")."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from .base import Store, check_key, to_bytes
from .hash import check_keys, check_values

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """A view of `store` in which every key is stored as f"{prefix}/{key}" (torch's PrefixStore).

    The timeout is the underlying store's (reading and setting it both go there) and
    `num_keys` counts every key of the underlying store, as torch does, while `list_keys`
    lists only the keys under f"{prefix}/", with that stripped (torch's strips the length
    of the prefix from every key that merely starts with it). Queues are namespaced like
    keys. `close()` leaves the underlying store open: it usually serves other users too.

    Values reach the underlying store as bytes (str values are UTF-8 encoded here), as
    torch hands them to a Python store. `append`, `multi_get` and `multi_set` go to the
    underlying store's, which `Store` builds on `compare_set`, `get` and `set` for a store
    that has none of its own.

    Args:
        prefix: the namespace.
        store: the store that holds the data.

    Raises:
        TypeError: `prefix` is not a str or `store` is not a Store.
        ValueError: `store` is None.
    """

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"PrefixStore prefix must be a str, got {type(prefix).__name__}")
        if store is None:
            raise ValueError(
                "PrefixStore store argument cannot be None: pass the store to wrap (a "
                "TCPStore, FileStore, HashStore, ...)"
            )
        if not isinstance(store, Store):
            raise TypeError(
                f"PrefixStore needs a distcomm Store to wrap, got {type(store).__name__}"
            )
        self.prefix = prefix
        self.underlying_store = store

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{check_key(key)}"

    def _keys(self, keys: Sequence[str]) -> list[str]:
        return [f"{self.prefix}/{key}" for key in check_keys(keys)]

    @property
    def _underlying_non_prefix_store(self) -> Store:
        """The first store below this one that is not a PrefixStore (torch's name)."""
        store = self.underlying_store
        while isinstance(store, PrefixStore):
            store = store.underlying_store
        return store

    @property
    def timeout(self) -> timedelta:
        """The default timeout of waiting operations: the underlying store's."""
        return self.underlying_store.timeout

    def set_timeout(self, timeout: float | timedelta) -> None:
        """Set the underlying store's default timeout (seconds or timedelta)."""
        self.underlying_store.set_timeout(timeout)

    def set(self, key: str, value: str | bytes) -> None:
        """Store `value` under `key`, replacing any previous value."""
        self.underlying_store.set(self._key(key), to_bytes(value))

    def get(self, key: str) -> bytes:
        """The value of `key`, waiting up to the store timeout for it to be set."""
        return self.underlying_store.get(self._key(key))

    def add(self, key: str, amount: int) -> int:
        """Add `amount` to the counter `key` (created at 0); returns the new value."""
        return self.underlying_store.add(self._key(key), amount)

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Atomically set `key` to `desired_value` if it holds `expected_value` (see Store)."""
        return self.underlying_store.compare_set(
            self._key(key),
            to_bytes(expected_value, "expected_value"),
            to_bytes(desired_value, "desired_value"),
        )

    def wait(self, keys: Sequence[str], timeout: float | timedelta | None = None) -> None:
        """Block until every key in `keys` is set, up to `timeout` (default: the store's)."""
        self.underlying_store.wait(self._keys(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in `keys` is set, without waiting."""
        return self.underlying_store.check(self._keys(keys))

    def delete_key(self, key: str) -> bool:
        """Delete `key`; returns whether it existed."""
        return self.underlying_store.delete_key(self._key(key))

    def num_keys(self) -> int:
        """The number of keys in the underlying store (all prefixes), as torch counts."""
        return self.underlying_store.num_keys()

    def append(self, key: str, value: str | bytes) -> None:
        """Append `value` to the value of `key` (created empty), by the underlying store's
        `append` (a store without its own builds it on `compare_set`: `Store.append`)."""
        self.underlying_store.append(self._key(key), to_bytes(value))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of `keys`, waiting for each as `get` does (a store without its own
        `multi_get` calls `get` once per key)."""
        return self.underlying_store.multi_get(self._keys(keys))

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Set each key of `keys` to the value at the same position of `values` (a store
        without its own `multi_set` calls `set` once per key)."""
        names = self._keys(keys)
        self.underlying_store.multi_set(names, check_values(names, values))

    def has_extended_api(self) -> bool:
        """Whether the underlying store has the extended API."""
        return self.underlying_store.has_extended_api()

    def list_keys(self) -> list[str]:
        """The keys under this prefix, without it (keys of other namespaces are left out)."""
        head = f"{self.prefix}/"
        size = len(head)
        return [
            key[size:]
            for key in self.underlying_store.list_keys()
            if key.startswith(head) and len(key) > size
        ]

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Append `value` to the queue `key` (see Store.queue_push)."""
        self.underlying_store.queue_push(self._key(key), to_bytes(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest item of queue `key`, removed (see Store.queue_pop)."""
        return self.underlying_store.queue_pop(self._key(key), block)

    def queue_len(self, key: str) -> int:
        """The number of items in queue `key` (0 when it has none)."""
        return self.underlying_store.queue_len(self._key(key))

    def clone(self) -> Store:
        """The same namespace on a clone of the underlying store (itself when the underlying
        store shares itself); closing the clone closes the underlying one's clone."""
        inner = self.underlying_store.clone()
        if inner is self.underlying_store:
            return self
        return _ClonedPrefixStore(self.prefix, inner)

    def close(self) -> None:
        """Nothing to release: the underlying store stays open for its other users."""

    def __repr__(self) -> str:
        return f"PrefixStore({self.prefix!r}, {self.underlying_store!r})"


class _ClonedPrefixStore(PrefixStore):
    """A PrefixStore made by `clone`: it owns its underlying store's clone."""

    def close(self) -> None:
        self.underlying_store.close()
