"""Waiting for keys that ranks set, naming the late ranks (not the keys), and roll calls.

Set-up steps (the rendezvous's join, a backend's set-up) wait for one key per rank in the
job's store. `wait_for_ranks` is that wait: while ranks are missing it warns after
DISTCOMM_STALL_WARN_S seconds, then after twice as long each time, naming the ranks that
arrived and those still missing; at the deadline it raises `DistTimeoutError` naming them
and what to do. It asks the store in slices no longer than the first warning, so the
store's own still-waiting warning (which can only name keys) never speaks first. Which
ranks are missing is asked only when a warning or the error is due, by halving the key
list: a few requests when a few ranks are late, never one per rank and poll.

`roll_call` is the set-up step that checks that the ranks were started alike (the same
world size, the same backends): each records what it was started with, compares with
rank 0's, and a disagreement anywhere makes every rank fail at once, naming both sides,
instead of leaving some to wait for peers that will never come.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import config
from ..deadline import FOREVER, Deadline, StallClock
from ..errors import DistError, DistStoreTimeoutError, DistTimeoutError
from .base import Store

__all__ = [
    "log_missing",
    "missing_ranks",
    "roll_call",
    "show_ranks",
    "size_differs",
    "wait_for_ranks",
]

log = logging.getLogger("distcomm.rendezvous")  # the name users and tests filter on

#: the most ranks a message names one by one
SHOWN = 32


def show_ranks(ranks: Sequence[int]) -> str:
    """Ranks for a message: "1, 2, 5"; runs of three or more as "0-7"; after `SHOWN`
    items, "..."."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    parts: list[str] = []
    for first, last in runs:
        if last - first >= 2:
            parts.append(f"{first}-{last}")
        else:
            parts.extend(map(str, range(first, last + 1)))
    return ", ".join(parts[:SHOWN]) + (" ..." if len(parts) > SHOWN else "")


def missing_ranks(store: Store, keys: Mapping[int, str]) -> list[int]:
    """The ranks of `keys` (rank -> key) whose key is not set, in order.

    One `check` covers a whole half of the list, so m missing ranks out of n cost about
    m log(n / m) requests.
    """
    ranks = sorted(keys)
    missing: list[int] = []
    pending = [ranks] if ranks else []
    while pending:
        part = pending.pop()
        if store.check([keys[r] for r in part]):
            continue
        if len(part) == 1:
            missing.append(part[0])
            continue
        half = len(part) // 2
        pending += [part[half:], part[:half]]  # the lower half is looked at first
    return sorted(missing)


def wait_for_ranks(
    store: Store,
    keys: Mapping[int, str],
    deadline: Deadline,
    where: str,
    *,
    arrived: str,
    hint: str,
    done: str | None = None,
    warn_after: float | None = None,
) -> None:
    """Block until every rank of `keys` (rank -> the key it sets) has set its key.

    Args:
        where: who waits in which step, for messages ("[rank 1/4] gloo backend ...").
        arrived: what a rank whose key is set did, for messages ("joined the store").
        hint: what to do about the missing ranks, for messages.
        done: wait for this one key instead (one that is set once the wait is over, by
            the last rank to arrive or by a rank that found an error); `keys` then only
            name the missing ranks in warnings and in the error.
        warn_after: seconds before the first warning; None: DISTCOMM_STALL_WARN_S; 0: none.

    Raises:
        DistTimeoutError: the deadline passed first; the message names the missing ranks.
        DistStoreError, DistNetworkError: the store failed.
    """
    warn = config.load().stall_warn_s if warn_after is None else warn_after
    wanted = [done] if done is not None else [keys[r] for r in sorted(keys)]
    stall = StallClock(warn)
    most = warn if warn > 0 else FOREVER  # a store wait longer than that warns on its own
    while True:
        step = deadline.slice(min(stall.until_next(), most))
        try:
            store.wait(wanted, step)
            return
        except DistStoreTimeoutError:
            pass
        expired = deadline.expired()
        waited = stall.due()
        if not expired and waited is None:
            continue
        missing = missing_ranks(store, keys)
        if done is not None and store.check([done]):
            return
        if done is None and not missing:
            return
        total, late = len(keys), len(missing)
        if expired:
            if not missing:  # a rank arrived, then stopped before the step was over
                raise DistTimeoutError(
                    f"{where}: every rank {arrived}, but the step did not complete within "
                    f"{deadline.seconds:.1f} s (did a rank stop meanwhile?): {hint}"
                )
            raise DistTimeoutError(
                f"{where}: only {total - late} of {total} ranks {arrived} within "
                f"{deadline.seconds:.1f} s; rank(s) {show_ranks(missing)} never did: {hint}"
            )
        if missing:  # else the last rank is finishing the step: no rank to name
            log_missing(where, waited, missing, total, arrived, hint, deadline, stall.next)


def log_missing(
    where: str,
    waited: float,
    missing: Sequence[int],
    total: int,
    arrived: str,
    hint: str,
    deadline: Deadline,
    next_at: float,
) -> None:
    """The warning of a wait for ranks that is still waiting, naming the missing ones."""
    seconds = deadline.seconds if deadline.seconds is not None else float("inf")
    log.warning(
        "%s: still waiting after %.0f s: %d of %d ranks %s; missing rank(s) %s. %s "
        "(waiting up to the timeout, %.0f s; next report at %.0f s; "
        "DISTCOMM_STALL_WARN_S=0 turns this warning off)",
        where,
        waited,
        total - len(missing),
        total,
        arrived,
        show_ranks(missing) or "none",
        hint,
        seconds,
        next_at,
    )


_OK = b"ok"
#: the most seconds rank 0 of a failed roll call waits for its ranks to have read why
LINGER = 5.0


def _record(value: bytes) -> dict[str, Any]:
    """A roll-call record as a dict ({} for one this version cannot read)."""
    try:
        record = json.loads(value)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _who(record: dict[str, Any]) -> str:
    return f"pid {record.get('pid', '?')} on {record.get('host', '?')}"


def _variable(source: str) -> str:
    """The environment variable a value came from ("WORLD_SIZE (torch style)" ->
    "WORLD_SIZE"), or "" when it came from an argument, a URL or nowhere known."""
    word = source.split(" ", 1)[0]
    return word if word.isupper() and word.replace("_", "").isalnum() else ""


def size_differs(rank: int, size: int, size_from: str, host: dict[str, Any]) -> str | None:
    """Why this rank's world size differs from rank 0's (`host`, its roll-call record),
    or None when it does not."""
    theirs = host.get("size", size)
    if theirs == size:
        return None
    their_from = str(host.get("from", ""))
    mine_var = _variable(size_from)
    if mine_var and mine_var == _variable(their_from):
        remedy = f"set the same {mine_var} on every rank"
    else:
        remedy = "give every rank the same world size"

    def origin(source: str) -> str:
        return f" (from {source})" if source else ""

    return (
        f"rank {rank} was started with world size {size}{origin(size_from)}, but rank 0 "
        f"with world size {theirs}{origin(their_from)}: {remedy}, the number of processes "
        f"in the job"
    )


def roll_call(
    store: Store,
    base: str,
    rank: int,
    size: int,
    deadline: Deadline,
    where: str,
    *,
    arrived: str,
    hint: str,
    size_from: str = "",
    record: dict[str, Any] | None = None,
    differs: Callable[[dict[str, Any]], str | None] | None = None,
    warn_after: float | None = None,
    linger: float = LINGER,
) -> None:
    """Every rank records what it was started with; all go on once all agree with rank 0.

    Each rank writes its world size (and `record`, its pid, host and a random id) under
    ``base/<rank>``; every rank but 0 waits for rank 0's and compares: the world size,
    then whatever `differs` compares. A rank that disagrees, or a second process with a
    rank already recorded, records why under ``base/outcome`` and raises; every rank
    still waiting reads it there at once and raises the same. The ranks that agree count
    themselves in ``base/count``; the last one writes "ok" under ``base/outcome``, the one
    key every rank waits for. O(1) store requests per rank, however many ranks.

    Args:
        size_from: where `size` came from, for messages ("WORLD_SIZE (torch style)").
        record: more of what this rank was started with (JSON-serialisable).
        differs: given rank 0's record, why this rank's disagrees (a sentence naming
            both sides and what to do), or None.
        arrived, hint, warn_after: as `wait_for_ranks`, for the waits.
        linger: the most seconds rank 0 waits, after a failure, for its ranks to have
            read why (it often hosts the store: closing it would cut them off).

    Raises:
        ValueError: a rank disagrees with rank 0, or two processes have the same rank;
            the message names both sides.
        DistTimeoutError: some ranks did not come in time; the message names them.
        DistStoreError, DistNetworkError: the store failed.
    """
    keys = {r: f"{base}/{r}" for r in range(size)}
    outcome_key, seen_key = f"{base}/outcome", f"{base}/seen"
    mine = {
        **(record or {}),
        "size": size,
        "from": size_from,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "id": secrets.token_hex(8),
    }
    text = json.dumps(mine)

    def wait(done: str) -> None:
        wait_for_ranks(
            store,
            keys,
            deadline,
            where,
            arrived=arrived,
            hint=hint,
            done=done,
            warn_after=warn_after,
        )

    def fail(message: str, counted: bool) -> None:
        if counted:  # one of the ranks rank 0 lingers for
            store.add(seen_key, 1)
        store.compare_set(outcome_key, "", message)  # the first error found is everyone's
        raise ValueError(f"{where}: {message}")

    held = store.compare_set(keys[rank], "", text)
    if held != text.encode():
        fail(
            f"rank {rank} was started twice ({_who(_record(held))} came first, then "
            f"{_who(mine)}), so another rank is missing: give every process its own rank, "
            f"from 0 to the world size - 1",
            False,
        )
    if rank != 0:
        wait(keys[0])
        theirs = _record(store.get(keys[0]))
        why = size_differs(rank, size, size_from, theirs)
        if why is None and differs is not None and theirs:
            why = differs(theirs)
        if why:
            fail(why, rank < theirs.get("size", size))
    outcome = None
    if store.add(f"{base}/count", 1) == size:
        outcome = store.compare_set(outcome_key, "", _OK)
    if outcome is None:
        wait(outcome_key)
        outcome = store.get(outcome_key)
    if outcome == _OK:
        return
    store.add(seen_key, 1)
    if rank == 0 and linger > 0:
        until = Deadline(deadline.slice(linger))
        delay = 0.01
        try:
            while store.add(seen_key, 0) < size and not until.expired():
                delay = until.nap(delay, 0.2)
        except DistError:
            pass
    raise ValueError(f"{where}: {outcome.decode(errors='replace')}")
