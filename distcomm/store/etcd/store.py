"""EtcdStore: a key-value store kept in an etcd server, spoken to over its v3 JSON API.

etcd (>= 3.4) serves its gRPC API as JSON over HTTP at ``/v3/...`` (the gRPC gateway):
keys and values travel base64-encoded, 64-bit integers as decimal strings, and fields
holding their default value (false, 0, empty) are left out. Only the standard library's
`http.client` is used, over plain HTTP: TLS and authentication are not supported, so
run the store's etcd on a trusted network. DISTCOMM_AUTH_KEY does not apply here (etcd
cannot take part in its handshake); the store never unpickles what it reads.

Every key is stored as `prefix` + key. Requests go through `client.EtcdClient`, over
a small pool of keep-alive connections, each used by one request at a time. The key
layout, requests, snapshot reads and watches are `requests.StoreRequests`, a mixin of
`EtcdStore`; this module holds the constructor and the Store methods, which map onto
etcd as follows::

    set, multi_set        put; one txn of puts (in chunks of 128, etcd's --max-txn-ops)
    add, append           a compare-and-swap loop of txns: put if the key's mod_revision
                          (or create_revision 0: missing) is still the one read
    compare_set           txn: put if the value (or create_revision 0) matches
    check                 txn of one range per key (keys only)
    get, multi_get, wait  that txn; then, for missing keys, a watch from the txn's revision
                          + 1 on a dedicated streaming connection, so a key set at any
                          moment after the read is seen and nothing polls
    delete_key            deleterange
    num_keys, list_keys   count-only / keys-only range over the prefix's keys
    queue_push            put of prefix + 0xff + key + 0xff + a random id (0xff never
                          occurs in UTF-8, so no key collides with a queue item)
    queue_pop             the queue's oldest item (a range sorted by create_revision,
                          limit 1), then a txn that deletes it if it still exists: only one
                          popper's txn succeeds; the others look again. An empty queue is
                          watched from the range's revision + 1 for the next push.
    queue_len             count-only range over the queue's items

`wait` and `check` count a key as set while its queue holds an item (`get` does not).
A get, wait or queue_pop still waiting after DISTCOMM_STALL_WARN_S logs the keys it still
misses, then again after twice as long each time, as TCPStore's and FileStore's do.

A stopped or unreachable server makes requests fail at once with `DistNetworkError`;
a watch notices a vanished server host through TCP keep-alive.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from datetime import timedelta

from ... import config
from ...config import DEFAULT_STORE_TIMEOUT
from ...deadline import Deadline, StallClock, to_seconds
from ...errors import DistStoreTimeoutError
from ...net import format_address
from ..base import CloseOnCollect, Store, check_block, check_key, to_bytes
from ..hash import (
    add_value,
    check_amount,
    check_keys,
    check_values,
    compare_set_value,
    log_still_waiting,
    queue_empty_error,
    queue_timeout_error,
)
from .client import EtcdClient, b64, kv_value, parse_endpoint, unb64
from .requests import (
    MAX_TXN_OPS,
    QUEUES,
    StoreRequests,
    compare_missing,
    compare_unchanged,
    put_request,
    range_kv,
    range_request,
)

__all__ = ["EtcdStore", "parse_endpoint"]

log = logging.getLogger(__name__)


class EtcdStore(StoreRequests, CloseOnCollect, Store):
    """A store kept in an etcd server under a key prefix (torch's EtcdStore, on etcd's JSON API).

    Many stores (one per job or rendezvous round) can share one etcd by using distinct
    prefixes. etcd limits a request to about 1.5 MiB (its --max-request-bytes), so
    larger values are refused with `DistStoreError`.

    Args:
        endpoint: etcd's client address: "host:port", "[ipv6]:port" or
            "http://host:port" (port 2379 when left out).
        prefix: prepended to every key (non-empty); `num_keys` counts the keys under it
            (queue items, also kept under it, aside).
        timeout: default timeout of `get`/`wait` (seconds or timedelta; default 300 s);
            a single request that gets no answer within it (+1 s) fails too.

    Raises:
        ValueError: the endpoint is malformed or uses https, or the prefix is empty.
        DistNetworkError: etcd cannot be reached at the endpoint (the message names it).
        DistStoreError: the server there does not speak etcd's v3 JSON API.
    """

    def __init__(
        self,
        endpoint: str,
        prefix: str = "/distcomm/",
        timeout: float | timedelta = DEFAULT_STORE_TIMEOUT,
    ) -> None:
        self._client: EtcdClient | None = None
        super().__init__(timeout)
        self._stall_warn = config.load().stall_warn_s  # a wait still waiting says so then
        self._host, self._port = parse_endpoint(endpoint)
        if not isinstance(prefix, str):
            raise TypeError(f"EtcdStore prefix must be a str, got {type(prefix).__name__}")
        if not prefix:
            raise ValueError(
                "EtcdStore prefix must be non-empty: it keeps this store's keys apart from "
                "the rest of etcd (num_keys counts everything under it)"
            )
        self._prefix = prefix
        self._raw_prefix = prefix.encode()
        self._endpoint = format_address(self._host, self._port)
        self._client = EtcdClient(self._host, self._port, self._where)
        try:
            self._count("connect")  # fail now if etcd is not there or is not etcd
        except BaseException:
            self.close()
            raise

    # -- properties -----------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """etcd's address as "host:port" (IPv6 hosts bracketed)."""
        return self._endpoint

    @property
    def prefix(self) -> str:
        """The prefix of every key this store writes."""
        return self._prefix

    @property
    def _where(self) -> str:
        return f"the EtcdStore at {self._endpoint} (prefix {self._prefix!r})"

    # -- read-modify-write ----------------------------------------------------------------

    def _update(self, key: str, change: Callable[[bytes | None], bytes], what: str) -> bytes:
        """Store `change(current value or None)` under `key` atomically; returns what was stored.

        A compare-and-swap loop: each txn puts the new value only if the key is unchanged
        since it was read (its mod_revision, or create_revision 0 while missing) and
        otherwise reads it again in the same txn. Each failed round means another writer
        succeeded, so the loop always makes progress; it gives up at the store timeout.

        Raises:
            DistStoreTimeoutError: other writers kept changing the key until the timeout.
        """
        full = self._full(key)
        deadline = Deadline(self._timeout)
        compare = compare_missing(full)  # the first guess: the key does not exist yet
        new = change(None)
        while True:
            answer = self._txn([compare], [put_request(full, new)], [range_request(full)], what)
            if answer.get("succeeded"):
                return new
            if deadline.expired():
                raise DistStoreTimeoutError(
                    f"{what} on {self._where} lost every compare-and-swap round for "
                    f"{self._timeout:.1f} s: other processes keep changing the key"
                )
            kv = range_kv(answer)
            if kv is None:
                compare, new = compare_missing(full), change(None)
            else:
                compare, new = compare_unchanged(full, kv), change(kv_value(kv))

    # -- the Store methods ----------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        """Store `value` under `key`, replacing any previous value."""
        body = {"key": b64(self._full(key)), "value": b64(to_bytes(value))}
        self._post("kv/put", body, f"set({key!r})")

    def get(self, key: str) -> bytes:
        """The value of `key`, waiting up to the store timeout for it to be set.

        Raises:
            DistStoreTimeoutError: the key was not set in time (the message names it).
        """
        check_key(key)
        return self._wait_for([key], self._timeout, True, f"get({key!r})")[key]

    def add(self, key: str, amount: int) -> int:
        """Add `amount` to the counter `key` (created at 0); returns the new value.

        Raises:
            DistStoreError: the key holds something other than an integer.
        """
        check_key(key)
        check_amount(amount)
        stored = self._update(key, lambda current: add_value(key, current, amount), f"add({key!r})")
        return int(stored)

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Atomically set `key` to `desired_value` if it holds `expected_value` (see Store).

        One txn decides, except when `expected_value` is empty and the key exists with an
        empty value, which takes a second txn (etcd cannot compare a missing key's value).
        """
        full = self._full(key)
        expected = to_bytes(expected_value, "expected_value")
        desired = to_bytes(desired_value, "desired_value")
        what = f"compare_set({key!r})"
        deadline = Deadline(self._timeout)
        if expected:
            compare = {
                "key": b64(full),
                "target": "VALUE",
                "result": "EQUAL",
                "value": b64(expected),
            }
        else:
            compare = compare_missing(full)
        while True:
            answer = self._txn([compare], [put_request(full, desired)], [range_request(full)], what)
            if answer.get("succeeded"):
                return desired
            kv = range_kv(answer)
            current = None if kv is None else kv_value(kv)
            new, result = compare_set_value(current, expected, desired)
            if new is None:
                return result
            # the swap should happen after all: expected is empty and the key is missing
            # (deleted since) or holds the empty value; try again unless it changed since
            if deadline.expired():
                raise DistStoreTimeoutError(
                    f"{what} on {self._where} lost every compare-and-swap round for "
                    f"{self._timeout:.1f} s: other processes keep changing the key"
                )
            compare = compare_missing(full) if kv is None else compare_unchanged(full, kv)

    def wait(self, keys: Sequence[str], timeout: float | timedelta | None = None) -> None:
        """Block until every key in `keys` is set, up to `timeout` (default: the store's).

        Raises:
            DistStoreTimeoutError: names the keys still missing.
        """
        names = check_keys(keys)
        seconds = self._timeout if timeout is None else to_seconds(timeout)
        if names:
            self._wait_for(names, seconds, False, f"wait({names!r})")

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in `keys` is set, without waiting."""
        names = list(dict.fromkeys(check_keys(keys)))
        if not names:
            return True
        found, _ = self._snapshot(names, False, "check")
        return len(found) == len(names)

    def delete_key(self, key: str) -> bool:
        """Delete `key`; returns whether it existed."""
        answer = self._post("kv/deleterange", {"key": b64(self._full(key))}, f"delete_key({key!r})")
        return int(answer.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        """The number of keys under this store's prefix."""
        return self._count("num_keys")

    def append(self, key: str, value: str | bytes) -> None:
        """Append `value` to the value of `key` (created empty)."""
        check_key(key)
        data = to_bytes(value)
        self._update(key, lambda current: (current or b"") + data, f"append({key!r})")

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of `keys`, waiting up to the store timeout for all of them.

        Raises:
            DistStoreTimeoutError: names the keys still missing.
        """
        names = check_keys(keys)
        if not names:
            return []
        what = f"get({names[0]!r})" if len(names) == 1 else f"multi_get({names!r})"
        found = self._wait_for(names, self._timeout, True, what)
        return [found[name] for name in names]

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Set each key of `keys` to the value at the same position of `values`.

        Atomic (one txn) for up to 128 distinct keys, etcd's default --max-txn-ops; longer
        lists are written in several txns. A key given twice gets its last value.
        """
        names = check_keys(keys)
        latest = dict(zip(names, check_values(names, values), strict=True))
        puts = [put_request(self._full(name), data) for name, data in latest.items()]
        for start in range(0, len(puts), MAX_TXN_OPS):
            self._txn([], puts[start : start + MAX_TXN_OPS], [], "multi_set")

    # -- the extended API -----------------------------------------------------------------

    def has_extended_api(self) -> bool:
        """True: every extended operation maps onto etcd requests."""
        return True

    def list_keys(self) -> list[str]:
        """Every key under this store's prefix, without it, in etcd's (byte) order; queue
        items are not keys."""
        body = {
            "key": b64(self._raw_prefix),
            "range_end": b64(self._raw_prefix + QUEUES),
            "keys_only": True,
        }
        kvs = self._post("kv/range", body, "list_keys").get("kvs", ())
        size = len(self._raw_prefix)
        return [unb64(kv["key"])[size:].decode(errors="replace") for kv in kvs]

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Append `value` to the queue `key` (see Store.queue_push)."""
        item = self._queue(key)[0] + secrets.token_hex(8).encode()
        self._post(
            "kv/put", {"key": b64(item), "value": b64(to_bytes(value))}, f"queue_push({key!r})"
        )

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest item of queue `key`, removed (see Store.queue_pop).

        Each item is deleted by one txn that succeeds only while the item exists, so of
        several processes popping at once exactly one gets it. An empty queue is watched
        for the next push (nothing polls).

        Raises:
            QueueEmptyError: `block` is False and the queue is empty.
            DistStoreTimeoutError: no item came within the store timeout.
        """
        low, high = self._queue(key)
        check_block(block)
        what = f"queue_pop({key!r})"
        deadline = Deadline(self._timeout)
        stall = StallClock(self._stall_warn)
        oldest = {
            "key": b64(low),
            "range_end": b64(high),
            "limit": 1,
            "sort_order": "ASCEND",
            "sort_target": "CREATE",
        }
        while True:
            answer = self._post("kv/range", oldest, what)
            kvs = answer.get("kvs")
            if kvs:
                kv = kvs[0]
                compare = {
                    "key": kv["key"],
                    "target": "CREATE",
                    "result": "EQUAL",
                    "create_revision": int(kv["create_revision"]),
                }
                delete = {"request_delete_range": {"key": kv["key"]}}
                if self._txn([compare], [delete], [], what).get("succeeded"):
                    return kv_value(kv)
                continue  # another popper took it: the next one
            if not block:
                raise queue_empty_error(key, self._where)
            if deadline.expired():
                raise queue_timeout_error(key, self._timeout, self._where)
            waited = stall.due()
            if waited is not None:
                log_still_waiting(
                    log, f"{what} on {self._where}", waited, [key], self._timeout, stall.next
                )
            revision = int(answer["header"]["revision"])
            until = Deadline(deadline.slice(stall.until_next()))  # the next warning's time
            self._client.follow(
                low,
                high,
                revision + 1,
                until,
                what,
                lambda kv, deleted: None if not deleted else False,
                self._timeout,
            )

    def queue_len(self, key: str) -> int:
        """The number of items in queue `key` (0 when it has none)."""
        low, high = self._queue(key)
        body = {"key": b64(low), "range_end": b64(high), "count_only": True}
        return int(self._post("kv/range", body, f"queue_len({key!r})").get("count", 0))

    # -- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        """Close this store's connections (idempotent); etcd and its data stay.

        Waits blocked in other threads fail with `DistStoreError`.
        """
        client = getattr(self, "_client", None)
        if client is not None:
            client.close()

    def __repr__(self) -> str:
        return f"EtcdStore({self._endpoint!r}, prefix={self._prefix!r})"
