"""The Store interface: torch.distributed's key-value store method set."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from ..config import DEFAULT_STORE_TIMEOUT
from ..deadline import to_seconds
from ..errors import DistError, DistStoreTimeoutError

__all__ = [
    "CloseOnCollect",
    "Store",
    "check_block",
    "check_key",
    "emulated_append",
    "publish",
    "to_bytes",
]


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


def check_block(block: bool) -> bool:
    """Validate queue_pop's `block` flag.

    Raises:
        TypeError: `block` is not a bool.
    """
    if not isinstance(block, bool):
        raise TypeError(f"queue_pop block must be True or False, got {block!r}")
    return block


class Store:
    """A key-value store shared by the processes of a job (torch.distributed.Store).

    Keys are str, values bytes (str values are UTF-8 encoded). Counters made by
    `add` are stored as decimal text, as torch does. Methods that wait for keys
    raise `DistStoreTimeoutError` naming the missing keys once `timeout` passes.

    A custom store subclasses this and implements what it serves, as in torch: a subclass
    that leaves a method out can still be made, and calling that method raises
    `NotImplementedError` (a `RuntimeError`, so `except RuntimeError` written for torch's
    "Not implemented." catches it too). `append`, `multi_get` and `multi_set` work on any
    store that implements `compare_set`, `get` and `set`; `has_extended_api()` stays False
    until the subclass says otherwise.
    """

    def __init__(self, timeout: float | timedelta | None = DEFAULT_STORE_TIMEOUT) -> None:
        self._timeout = DEFAULT_STORE_TIMEOUT if timeout is None else to_seconds(timeout)

    @property
    def timeout(self) -> timedelta:
        """The default timeout of waiting operations."""
        # a subclass whose __init__ does not call Store.__init__ has the default
        return timedelta(seconds=getattr(self, "_timeout", DEFAULT_STORE_TIMEOUT))

    def set_timeout(self, timeout: float | timedelta) -> None:
        """Set the default timeout of `get` and `wait` (seconds or timedelta)."""
        self._timeout = to_seconds(timeout)

    def _missing(self, method: str, hint: str = "") -> NotImplementedError:
        return NotImplementedError(
            f"{type(self).__name__} does not implement {method}(): Not implemented. "
            f"Define {method}() in the Store subclass{hint}"
        )

    def set(self, key: str, value: str | bytes) -> None:
        """Store `value` under `key`, replacing any previous value.

        Raises:
            NotImplementedError: a subclass that does not define it.
        """
        raise self._missing("set")

    def get(self, key: str) -> bytes:
        """The value of `key`, waiting up to the store timeout for it to be set.

        Raises:
            NotImplementedError: a subclass that does not define it.
        """
        raise self._missing("get")

    def add(self, key: str, amount: int) -> int:
        """Add `amount` to the integer counter `key` (created at 0); returns the new value.

        Raises:
            NotImplementedError: a subclass that does not define it.
        """
        raise self._missing("add")

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Atomically set `key` to `desired_value` if it holds `expected_value`.

        A missing key counts as holding the empty value. Returns the value the key
        holds afterwards when the swap happened, the current value when it did not,
        and `expected_value` when the key is missing and `expected_value` is not empty.

        Raises:
            NotImplementedError: a subclass that does not define it.
        """
        raise self._missing("compare_set")

    def wait(self, keys: Sequence[str], timeout: float | timedelta | None = None) -> None:
        """Block until every key in `keys` is set, up to `timeout` (default: the store's).

        Raises:
            NotImplementedError: a subclass that does not define it.
        """
        raise self._missing("wait")

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in `keys` is set, without waiting.

        Raises:
            NotImplementedError: a subclass that does not define it.
        """
        raise self._missing("check")

    def delete_key(self, key: str) -> bool:
        """Delete `key`; returns whether it existed.

        Raises:
            NotImplementedError: a subclass that does not define it.
        """
        raise self._missing("delete_key")

    def num_keys(self) -> int:
        """The number of keys in the store.

        Raises:
            NotImplementedError: a subclass that does not define it.
        """
        raise self._missing("num_keys")

    def append(self, key: str, value: str | bytes) -> None:
        """Append `value` to the value of `key` (created empty).

        This default is built on `compare_set` (and `check` and `get` where the subclass
        has them), as torch's is: see `emulated_append`.

        Raises:
            NotImplementedError: the subclass defines neither this nor `compare_set`.
        """
        emulated_append(self, key, value)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of `keys`, waiting for each as `get` does (this default calls `get`
        once per key)."""
        return [self.get(key) for key in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Set each key of `keys` to the value at the same position of `values` (this
        default calls `set` once per key)."""
        if len(keys) != len(values):
            raise ValueError(
                f"multi_set needs as many values as keys, got {len(keys)} keys "
                f"and {len(values)} values"
            )
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    # -- the extended API (torch's list_keys, queues, barrier) --------------------------------

    def has_extended_api(self) -> bool:
        """Whether this store implements `list_keys`, the queues and `append`/`multi_get`/
        `multi_set`/`compare_set` natively (torch's has_extended_api). Every distcomm store
        does; a Store subclass says so by overriding this (its `append`, `multi_get` and
        `multi_set` are then called directly, else emulated)."""
        return False

    def list_keys(self) -> list[str]:
        """Every key in the store (queues are not keys and are not listed), as `num_keys`
        counts them.

        Raises:
            NotImplementedError: the store cannot list its keys.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement list_keys()")

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Append `value` to the FIFO queue `key` (created empty).

        Queues live beside the keys: a queue and a key of the same name are separate
        (`get`, `delete_key`, `num_keys` and `list_keys` do not see queues), but `check`
        and `wait` count a key as set while its queue holds an item.

        Raises:
            NotImplementedError: the store has no queues.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement queues")

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Remove and return the oldest item of queue `key`. Each item is popped exactly once,
        by one caller, however many pop at the same time.

        Args:
            key: the queue.
            block: wait up to the store timeout for an item when the queue is empty.

        Raises:
            QueueEmptyError: `block` is False and the queue is empty (or missing).
            DistStoreTimeoutError: `block` is True and no item came within the timeout.
            NotImplementedError: the store has no queues.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement queues")

    def queue_len(self, key: str) -> int:
        """The number of items in queue `key` (0 for a queue never pushed to).

        Raises:
            NotImplementedError: the store has no queues.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement queues")

    def barrier(self, key: str, world_size: int, timeout: float | timedelta | None = None) -> None:
        """Block until `world_size` callers (any processes, threads or store objects on this
        store) have called `barrier` with the same `key`.

        As torch's default Store.barrier: it counts arrivals in the counter
        f"{key}/num_members" and the last arrival sets f"{key}/last_member", which the
        others wait for. The keys stay, so a key serves one barrier: once it has
        completed, a later call with that key returns at once. Use a new key per round.

        Args:
            key: names this barrier.
            world_size: how many callers it waits for (>= 1).
            timeout: seconds or timedelta (default: the store's).

        Raises:
            TypeError: `key` is not a str or `world_size` is not an int.
            ValueError: `key` is empty or `world_size` < 1.
            DistStoreTimeoutError: fewer than `world_size` arrived in time (the message
                says how many did).
        """
        check_key(key)
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"barrier world_size must be an int, got {type(world_size).__name__}")
        if world_size < 1:
            raise ValueError(
                f"barrier world_size must be >= 1 (the number of callers to wait for), "
                f"got {world_size}"
            )
        seconds = None if timeout is None else to_seconds(timeout)
        count_key, last_key = f"{key}/num_members", f"{key}/last_member"
        if self.add(count_key, 1) == world_size:
            self.set(last_key, "1")
        try:
            self.wait([last_key], seconds)
        except DistStoreTimeoutError as exc:
            if seconds is None:
                try:
                    seconds = self.timeout.total_seconds()
                except OverflowError:
                    seconds = float("inf")
            try:
                arrived = str(self.add(count_key, 0))
            except DistError:
                arrived = "an unknown number"
            raise DistStoreTimeoutError(
                f"barrier {key!r} on {self!r}: {arrived} of {world_size} callers arrived "
                f"within {seconds:.1f} s (did a process fail before reaching it, or does "
                "it need a longer timeout?)"
            ) from exc

    def clone(self) -> Store:
        """A store on the same data that another thread may use while this one is blocked in
        a wait (torch's Store.clone): a new connection where the store has one; a store
        that is safe to share between threads returns itself (then do not close it apart).
        """
        return self

    def close(self) -> None:  # an optional hook: stores without resources keep it
        """Release connections and, for a hosting store, stop its server."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class CloseOnCollect:
    """Mixin for a store holding resources (a socket, a file, a server thread): the garbage
    collector closes it.

    A store dropped without `close()` or a `with` block still gives back what it holds when
    it is collected. The store's `close` must be idempotent and safe on an object whose
    constructor failed part way; any error it raises then is swallowed, since nothing could
    handle it. Stores without resources do not use it (a PrefixStore must not close the
    store it wraps when it is dropped).
    """

    def __del__(self) -> None:
        try:
            self.close()  # type: ignore[attr-defined]  # the Store this is mixed into
        except Exception:
            pass


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


def emulated_append(store: Store, key: str, value: str | bytes) -> None:
    """Append `value` to `key` of a store without a native append, with `compare_set`.

    torch's fallback swaps from the empty value first and stops as soon as the key holds
    the text it meant to write, so appending "x" to a key that holds "x" leaves "x". Here
    the first guess is the key's current value where the store can tell (`check`, then
    `get`), so that case appends; a store without `check` starts from the empty value, as
    torch's does. Each later round swaps from the value the last one found.

    Raises:
        NotImplementedError: the store does not implement `compare_set`.
    """
    check_key(key)
    data = to_bytes(value)
    try:
        exists = store.check([key])
    except NotImplementedError:
        exists = False
    current = store.get(key) if exists else b""
    while True:
        desired = current + data
        found = to_bytes(store.compare_set(key, current, desired), "compare_set result")
        if found == desired:
            return
        current = found
