"""A `RendezvousBackend` over one key of a distcomm Store: the state base64-encoded, its
fencing token the stored text itself, `set_state` one `compare_set`.

torch's c10d and etcd-v2 backends (`c10d_rendezvous_backend`, `etcd_rendezvous_backend`)
are this over a TCPStore/FileStore and an EtcdStore. The token is the encoded state, so a
swap succeeds only against the exact bytes read; states never repeat (the dynamic
rendezvous counts every request it applies in its state), so a token cannot come back.
"""

from __future__ import annotations

import binascii
from base64 import b64decode, b64encode
from collections.abc import Callable
from typing import Any

from ...errors import DistError
from ...store import Store
from .api import RendezvousBackend, RendezvousConnectionError, RendezvousStateError, Token
from .slot import peek

__all__ = ["StoreStateBackend"]


class StoreStateBackend(RendezvousBackend):
    """The state blob under `key` of `store`.

    Args:
        store: a distcomm Store shared by every node of the run.
        key: the key that holds the state.
        name: the backend's name (`name`).
        what: what the store is, for messages ("the C10d store", "etcd").

    Raises:
        TypeError: `store` is not a distcomm Store.
    """

    def __init__(self, store: Store, key: str, name: str, what: str) -> None:
        if not isinstance(store, Store):
            raise TypeError(
                f"the {name} rendezvous backend needs a distcomm Store, got {type(store).__name__}"
            )
        self._store, self._key, self._name, self._what = store, key, name, what

    @property
    def name(self) -> str:
        """See `RendezvousBackend.name`."""
        return self._name

    @property
    def key(self) -> str:
        """The store key that holds the state."""
        return self._key

    def _call(self, method: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except (DistError, OSError) as exc:
            raise RendezvousConnectionError(
                f"The connection to {self._what} has failed ({method} of key {self._key!r}: "
                f"{exc}); check that the store is up and reachable"
            ) from exc

    def _decode(self, stored: bytes | None) -> tuple[bytes, Token] | None:
        if not stored:
            return None
        try:
            return b64decode(stored, validate=True), stored
        except (binascii.Error, ValueError) as exc:
            raise RendezvousStateError(
                f"The state object is corrupt: key {self._key!r} of {self._what} holds "
                f"{stored[:40]!r}, which is not a base64-encoded rendezvous state ({exc}); "
                "another program wrote it: use another run id"
            ) from exc

    def get_state(self) -> tuple[bytes, Token] | None:
        """See `RendezvousBackend.get_state` (one read of the key)."""
        return self._decode(self._call("a read", lambda: peek(self._store, self._key)))

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """See `RendezvousBackend.set_state` (one compare_set; a token that is not one of
        this backend's costs a read instead, and writes nothing)."""
        encoded = b64encode(state)
        if token is not None and token != b"" and not isinstance(token, bytes):
            current = self.get_state()
            return None if current is None else (*current, False)
        stored = self._call(
            "compare_set", lambda: self._store.compare_set(self._key, token or b"", encoded)
        )
        decoded = self._decode(stored)
        if decoded is None:
            return None
        return decoded[0], decoded[1], stored == encoded
