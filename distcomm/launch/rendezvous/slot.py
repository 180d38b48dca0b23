"""Where a dynamic rendezvous keeps its state blob: a key of its store, or a plug-in backend.

The chair (`chair.py`) is the only node that writes the state, and it writes by
compare-and-swap of the bytes it last wrote; a `StateSlot` is that one operation and a
read, over either

- `StoreSlot`: the key ``/rdzv/<run_id>/state`` of the rendezvous's own store (distcomm's
  c10d, etcd and file backends): `swap` is one `compare_set`;
- `BackendSlot`: a torch-style `RendezvousBackend` (`get_state` / `set_state` by fencing
  token). It remembers the token of the state it last read or wrote, so the chair's write
  is one `set_state`; only when the stored bytes are not the ones it expects does it read
  them first (`get_state`), as after a change of chair.

Either way the blob costs O(1) operations per chair pass and nothing for the other nodes,
whose requests, heartbeats and answers go through the store.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod

from ...store import Store
from .api import RendezvousBackend, RendezvousStateError, Token

__all__ = ["BackendSlot", "StateSlot", "StoreSlot", "peek"]

#: what `peek` compares with: no stored value is ever this
_ABSENT = b"\x00distcomm:absent"


def peek(store: Store, key: str) -> bytes | None:
    """The value of `key`, or None when it is not set, without waiting and without writing
    (a compare_set whose expected value no key holds changes nothing and returns the value,
    or the expected value itself for a missing key)."""
    value = store.compare_set(key, _ABSENT, _ABSENT)
    return None if value == _ABSENT else value


class StateSlot(ABC):
    """One state blob with compare-and-swap (empty bytes: no state stored)."""

    @abstractmethod
    def read(self) -> bytes:
        """The stored bytes (b"" when none)."""

    @abstractmethod
    def swap(self, expected: bytes, new: bytes) -> bytes:
        """Store `new` if the stored bytes are `expected` (b"": none stored); returns the
        stored bytes afterwards (`new` when this call wrote them), as `Store.compare_set`."""

    @abstractmethod
    def describe(self) -> str:
        """Where the blob lives, for messages."""


class StoreSlot(StateSlot):
    """The blob under `key` of `store`."""

    def __init__(self, store: Store, key: str) -> None:
        self._store, self._key = store, key

    def read(self) -> bytes:
        return peek(self._store, self._key) or b""

    def swap(self, expected: bytes, new: bytes) -> bytes:
        return self._store.compare_set(self._key, expected, new)

    def describe(self) -> str:
        return f"the store key {self._key!r}"


class BackendSlot(StateSlot):
    """The blob a `RendezvousBackend` keeps (thread-safe: the node's heartbeat thread and
    its caller share it)."""

    def __init__(self, backend: RendezvousBackend) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._seen: tuple[bytes, Token] | None = None  # the state and token last seen

    def _checked(self, result: object, method: str, size: int) -> tuple | None:
        if result is None:
            return None
        if not isinstance(result, tuple) or len(result) != size or not isinstance(result[0], bytes):
            raise RendezvousStateError(
                f"rendezvous backend {self._backend.name!r}: {method} returned {result!r}, "
                f"not None or a tuple of {size} starting with the state's bytes"
            )
        return result

    def _get(self) -> tuple[bytes, Token] | None:
        got = self._checked(self._backend.get_state(), "get_state", 2)
        self._seen = None if got is None else (got[0], got[1])
        return self._seen

    def read(self) -> bytes:
        with self._lock:
            got = self._get()
        return b"" if got is None else got[0]

    def swap(self, expected: bytes, new: bytes) -> bytes:
        with self._lock:
            seen = self._seen
            if seen is None or seen[0] != expected:
                seen = self._get()
                current = b"" if seen is None else seen[0]
                if current != expected:
                    return current
            token = None if seen is None else seen[1]
            result = self._checked(self._backend.set_state(new, token), "set_state", 3)
            if result is None:  # lost, and the backend did not say to what: read it
                seen = self._get()
                return b"" if seen is None else seen[0]
            self._seen = (result[0], result[1])
            return result[0]  # type: ignore[no-any-return]

    def describe(self) -> str:
        return f"the state of rendezvous backend {self._backend.name!r}"
