"""The request half of an EtcdStore: key layout, request builders, reading and waiting.

`StoreRequests` is the mixin `store.EtcdStore` inherits for everything below its Store
methods: where a key or a queue's items live under the prefix (`_full`, `_queue`,
`_queue_name`), one request or txn through the `client.EtcdClient` (`_post`, `_txn`,
`_count`), a consistent snapshot of many keys (`_snapshot`), and waiting for keys to be
set (`_wait_for`): a snapshot, then a watch from its revision + 1 (`_watch`, fed one
event at a time to `_seen`), read again when a stall warning is due, the revision was
compacted away or a watched queue lost an item. `EtcdStore` adds the constructor,
the Store methods and the extended API.

The module-level builders make the pieces of etcd's v3 JSON requests that both halves
use: a prefix's range end, compares (key missing, key unchanged since read), put and
range operations of a txn, and the key-value a failed txn's range read back.
"""

from __future__ import annotations

import logging
from typing import Any

from ...deadline import Deadline, StallClock
from ..base import check_key
from ..hash import log_still_waiting, timeout_error
from .client import EtcdClient, b64, kv_value, unb64

__all__ = [
    "MAX_TXN_OPS",
    "QUEUES",
    "StoreRequests",
    "compare_missing",
    "compare_unchanged",
    "prefix_end",
    "put_request",
    "range_kv",
    "range_request",
]

log = logging.getLogger(__name__)

#: Operations per txn: etcd's default --max-txn-ops; longer key lists go in several txns.
MAX_TXN_OPS = 128
QUEUES = b"\xff"  # after the prefix: the queues' items (never in a UTF-8 key)


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key above every key that starts with `prefix` (etcd's range end)."""
    for index in range(len(prefix) - 1, -1, -1):
        if prefix[index] < 0xFF:
            return prefix[:index] + bytes([prefix[index] + 1])
    return b"\0"  # a prefix of only 0xff bytes: every key from it on


def range_kv(response: dict[str, Any]) -> dict[str, Any] | None:
    """The key-value of a txn whose only (failure) operation was a range of one key."""
    kvs = response.get("responses", [{}])[0].get("response_range", {}).get("kvs")
    return kvs[0] if kvs else None


def compare_missing(key: bytes) -> dict[str, Any]:
    return {"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": 0}


def compare_unchanged(key: bytes, kv: dict[str, Any]) -> dict[str, Any]:
    return {
        "key": b64(key),
        "target": "MOD",
        "result": "EQUAL",
        "mod_revision": int(kv["mod_revision"]),
    }


def put_request(key: bytes, value: bytes) -> dict[str, Any]:
    return {"request_put": {"key": b64(key), "value": b64(value)}}


def range_request(key: bytes) -> dict[str, Any]:
    return {"request_range": {"key": b64(key)}}


class StoreRequests:
    """An EtcdStore's key layout, requests, snapshots and watches.

    A mixin of `store.EtcdStore`, which sets, before its first request, what this reads:
    `_client` (the `EtcdClient`), `_timeout`, `_raw_prefix` (the prefix, encoded),
    `_stall_warn` and the `_where` property (the store as messages name it).
    """

    _client: EtcdClient | None
    _timeout: float
    _raw_prefix: bytes
    _stall_warn: float
    _where: str

    # -- keys -----------------------------------------------------------------------------

    def _full(self, key: str) -> bytes:
        return self._raw_prefix + check_key(key).encode()

    def _queue(self, key: str) -> tuple[bytes, bytes]:
        """The key range (start, end) of queue `key`'s items."""
        start = self._raw_prefix + QUEUES + check_key(key).encode() + QUEUES
        return start, prefix_end(start)

    def _queue_name(self, full: bytes) -> str | None:
        """The queue a stored key holds an item of, or None when it is not a queue item."""
        head = len(self._raw_prefix) + 1
        if full[head - 1 : head] != QUEUES or not full.startswith(self._raw_prefix):
            return None
        end = full.find(QUEUES, head)
        return None if end < 0 else full[head:end].decode(errors="replace")

    # -- HTTP -----------------------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        """POST one request to etcd's `/v3/<path>` (see `EtcdClient.post`)."""
        return self._client.post(path, body, what, self._timeout)

    def _txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]],
        what: str,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"compare": compare, "success": success}
        if failure:
            body["failure"] = failure
        return self._post("kv/txn", body, what)

    def _count(self, what: str) -> int:
        """The number of keys (queue items aside)."""
        body = {
            "key": b64(self._raw_prefix),
            "range_end": b64(self._raw_prefix + QUEUES),
            "count_only": True,
        }
        return int(self._post("kv/range", body, what).get("count", 0))

    # -- reading and waiting --------------------------------------------------------------

    def _snapshot(self, names: list[str], values: bool, what: str) -> tuple[dict[str, bytes], int]:
        """The keys of `names` that exist (with their values if asked) and etcd's revision.

        Without `values` (wait, check) a key whose queue holds an item counts as existing.
        Every chunk of the key list reads at the revision the first one read at, so the
        result is one consistent snapshot.
        """
        found: dict[str, bytes] = {}
        revision = 0
        step = MAX_TXN_OPS if values else MAX_TXN_OPS // 2  # a key and its queue each
        for start in range(0, len(names), step):
            chunk = names[start : start + step]
            ops = []
            for name in chunk:
                read: dict[str, Any] = {"key": b64(self._full(name))}
                if not values:
                    read["keys_only"] = True
                if revision:
                    read["revision"] = revision
                ops.append({"request_range": read})
                if not values:
                    low, high = self._queue(name)
                    count: dict[str, Any] = {
                        "key": b64(low),
                        "range_end": b64(high),
                        "count_only": True,
                    }
                    if revision:
                        count["revision"] = revision
                    ops.append({"request_range": count})
            answer = self._txn([], ops, [], what)
            if not revision:
                revision = int(answer["header"]["revision"])
            results = answer.get("responses", [])
            per = 1 if values else 2
            for index, name in enumerate(chunk):
                kvs = results[per * index].get("response_range", {}).get("kvs")
                if kvs:
                    found[name] = kv_value(kvs[0]) if values else b""
                elif not values and int(
                    results[2 * index + 1].get("response_range", {}).get("count", 0)
                ):
                    found[name] = b""
        return found, revision

    def _wait_for(
        self, names: list[str], timeout: float, values: bool, what: str
    ) -> dict[str, bytes]:
        """The keys of `names` once all exist at one revision; raise once `timeout` passes."""
        unique = list(dict.fromkeys(names))
        deadline = Deadline(timeout)
        stall = StallClock(self._stall_warn)
        while True:
            found, revision = self._snapshot(unique, values, what)
            missing = [name for name in unique if name not in found]
            if not missing:
                return found
            if deadline.expired():
                raise timeout_error(missing, timeout, self._where)
            waited = stall.due()
            if waited is not None:
                log_still_waiting(
                    log, f"{what} on {self._where}", waited, missing, timeout, stall.next
                )
            until = Deadline(deadline.slice(stall.until_next()))  # the next warning's time
            if self._watch(unique, found, revision + 1, until, what, queues=not values):
                return found
            # the deadline or a warning is due (the snapshot above names what is still
            # missing), or the revision was compacted away under the watch: read again

    def _watch(
        self,
        names: list[str],
        state: dict[str, bytes],
        start: int,
        deadline: Deadline,
        what: str,
        queues: bool = False,
    ) -> bool:
        """Follow changes to `names` from revision `start`, updating `state`, until all exist.

        One watcher covers the key range from the smallest to the largest key; events for
        other keys in between are skipped. With `queues`, a push to the queue of a name
        counts as setting it, and a pop from one ends the watch (the caller looks again:
        the queue may be empty now). The watch has its own connection, which the server
        keeps streaming on (one JSON message per line); it is closed afterwards.

        Returns:
            True once every key exists; False when the deadline passed, etcd compacted
            revision `start` away or a watched queue lost an item (the caller reads a
            fresh snapshot).
        """
        wanted = {self._full(name): name for name in names}
        low, end = min(wanted), max(wanted) + b"\0"
        if queues:
            ranges = [self._queue(name) for name in names]
            low, end = min(low, *(r[0] for r in ranges)), max(end, *(r[1] for r in ranges))
        return self._client.follow(
            low,
            end,
            start,
            deadline,
            what,
            lambda kv, deleted: self._seen(kv, deleted, wanted, names, state, queues),
            self._timeout,
        )

    def _seen(
        self,
        kv: dict[str, Any],
        deleted: bool,
        wanted: dict[bytes, str],
        names: list[str],
        state: dict[str, bytes],
        queues: bool,
    ) -> bool | None:
        """One event of `_watch`: True once every name is set, None to stop and look again."""
        full = unb64(kv.get("key", ""))
        name = wanted.get(full)
        if name is None:
            queue = self._queue_name(full) if queues else None
            if queue is None or queue not in names:
                return False
            if deleted:
                return None
            state[queue] = b""
        elif deleted:
            state.pop(name, None)
        else:
            state[name] = kv_value(kv)
        return all(name in state for name in names)
