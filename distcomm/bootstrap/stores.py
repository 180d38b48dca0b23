"""Opening the job's store at an address, and waiting until every rank has joined it.

For ``env://`` and ``tcp://``, rank 0 hosts the TCPStore at the address; the others
connect. With DISTCOMM_USE_AGENT_STORE=1 (a launcher already serves the store there) and
``env://`` every rank connects, rank 0 included, and keeps its keys under
DISTCOMM_STORE_PREFIX when that is set (the launcher sets one per round, so restarted
workers never see the keys of an earlier round). An explicit ``tcp://`` init_method (or a
store=) wins over the launcher's store: rank 0 hosts it as without a launcher.

Then (when rank 0 hosts the store) every rank sets a key of its own in it and waits for the
others' keys, as torch's TCPStore master waits for its workers. While ranks are missing,
each waiting rank warns after DISTCOMM_STALL_WARN_S seconds (default 30; 0: none), then
after 60, 120, ... more, how many ranks joined and which did not; at the timeout the error
names them.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

from ..deadline import Deadline
from ..errors import DistError, DistNetworkError, DistStoreTimeoutError, DistTimeoutError
from ..net import format_address
from ..store import PrefixStore, Store, TCPStore

__all__: list[str] = []

log = logging.getLogger("distcomm.rendezvous")  # the name users and tests filter on


class _RoundStore(PrefixStore):
    """The workers' namespace in a launcher's store; closing it closes the connection."""

    def close(self) -> None:
        self.underlying_store.close()


def open_store(make: Callable[[], Store], context: str, os_error: type[DistError]) -> Store:
    """Create a store; its errors gain `context` (who, where, from which variables)."""
    try:
        return make()
    except DistError as exc:
        try:
            wrapped = type(exc)(f"{context}: {exc}")
        except Exception:  # an error type with a constructor of its own: keep it as it is
            raise exc from None
        raise wrapped from exc
    except OSError as exc:
        raise os_error(f"{context}: {exc}") from exc


_JOINED = "distcomm/rendezvous/joined/"
_STALL_BACKOFF = 2.0


def join(store: Store, rank: int, size: int, seconds: float, warn_after: float, where: str) -> None:
    """Set this rank's key in `store` and wait for every rank's, for at most `seconds`.

    While some are missing, warn after `warn_after` seconds (0: never), then after twice
    as long as the previous wait each time, naming the ranks that joined and those missing.

    Raises:
        DistTimeoutError: some ranks did not join in time; the message names them.
        DistStoreError: the store failed.
    """
    keys = [f"{_JOINED}{r}" for r in range(size)]
    store.set(keys[rank], str(os.getpid()))
    deadline = Deadline(seconds)
    started = time.monotonic()
    interval = warn_after
    warn_at = warn_after if warn_after > 0 else math.inf
    while True:
        left = deadline.remaining()
        left = math.inf if left is None else max(left, 0.0)
        step = min(left, max(warn_at - (time.monotonic() - started), 0.001))
        if warn_after > 0:  # a store wait longer than that would warn on its own
            step = min(step, warn_after)
        try:
            store.wait(keys, step)
            return
        except DistStoreTimeoutError:
            pass
        waited = time.monotonic() - started
        missing = [r for r in range(size) if not store.check([keys[r]])]
        if not missing:
            return
        joined = size - len(missing)
        shown = ", ".join(map(str, missing[:32])) + (" ..." if len(missing) > 32 else "")
        if deadline.expired():
            raise DistTimeoutError(
                f"{where}: only {joined} of {size} ranks joined the store within "
                f"{seconds:.1f} s; rank(s) {shown} never did: start every rank with the same "
                f"store address and world size, or look at the missing ranks' output for an "
                f"error"
            )
        if waited >= warn_at:
            interval *= _STALL_BACKOFF
            warn_at = waited + interval
            log.warning(
                "%s: still waiting after %.0f s: %d of %d ranks joined the store; missing "
                "rank(s) %s. Start them, or check their output for an error (waiting up to "
                "the timeout, %.0f s; DISTCOMM_STALL_WARN_S=0 turns this warning off)",
                where,
                waited,
                joined,
                size,
                shown,
                seconds,
            )


def tcp_store(
    host: str, port: int, size: int, seconds: float, *, hosting: bool, context: str
) -> TCPStore:
    """Host or connect to the TCPStore at `host`:`port`, without waiting for the workers.

    Raises:
        DistNetworkError, DistStoreError: as `open_store`, with `context`.
    """
    return open_store(  # type: ignore[return-value]
        lambda: TCPStore(
            host,
            port,
            world_size=size,
            is_master=hosting,
            timeout=seconds,
            wait_for_workers=False,
        ),
        context,
        DistNetworkError,
    )


def open_tcp_store(
    host: str,
    port: int,
    rank: int,
    size: int,
    seconds: float,
    where: str,
    origin: str,
    *,
    agent: bool,
    prefix: str,
    warn_after: float,
) -> Store:
    """Host (rank 0) or connect to the TCPStore at `host`:`port`, then wait for every rank.

    With `agent` (a launcher serves the store) every rank connects, keeps its keys under
    `prefix` when that is set, and does not wait for the others.

    Args:
        where: who rendezvouses how, for messages ("[rank 1/4] env:// rendezvous").
        origin: where the address came from, for messages.
        warn_after: seconds before the first warning about missing ranks (0: none).

    Raises:
        DistNetworkError, DistStoreError: the store could not be hosted or reached.
        DistTimeoutError: some ranks did not join in time; the message names them.
    """
    hosting = rank == 0 and not agent
    context = (
        f"{where}: {'hosting' if hosting else 'connecting to'} the store at "
        f"{format_address(host, port)} ({origin})"
    )
    # join waits for the workers, naming the ranks still missing
    opened = tcp_store(host, port, size, seconds, hosting=hosting, context=context)
    if agent and prefix:
        opened = _RoundStore(prefix, opened)
    if not agent:
        try:
            # every rank waits for all to join: any rank still waiting says which are missing
            store_at = f"{where} (the store at {format_address(host, port)})"
            join(opened, rank, size, seconds, warn_after, store_at)
        except BaseException:
            opened.close()
            raise
    return opened
