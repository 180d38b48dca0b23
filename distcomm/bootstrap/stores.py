"""Opening the job's store at an address, and waiting until every rank has joined it.

For ``env://`` and ``tcp://``, rank 0 hosts the TCPStore at the address; the others
connect. With DISTCOMM_USE_AGENT_STORE=1 (a launcher already serves the store there) and
``env://``, or a ``tcp://`` URL on MASTER_PORT, every rank connects, rank 0 included, and
keeps its keys under DISTCOMM_STORE_PREFIX when that is set (the launcher sets one per
round, so restarted workers never see the keys of an earlier round). A ``tcp://``
init_method on another port (or a store=) wins over the launcher's store: rank 0 hosts it
as without a launcher.

Then (when rank 0 hosts the store) every rank joins it (`join`) and waits for the others,
as torch's TCPStore master waits for its workers. Each rank records the world size it was
started with; one that differs from rank 0's, or a second process with the same rank,
makes every rank fail at once with a `ValueError` naming both sides, instead of waiting
for ranks that will never come. While ranks are missing, each waiting rank warns after
DISTCOMM_STALL_WARN_S seconds (default 30; 0: none), then after 60, 120, ... more, how
many ranks joined and which did not; at the timeout the error names them.
"""

from __future__ import annotations

from collections.abc import Callable

from ..deadline import Deadline
from ..errors import DistError, DistNetworkError
from ..net import format_address
from ..store import PrefixStore, Store, TCPStore
from ..store.ranks import roll_call

__all__: list[str] = []


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


_JOINED = "distcomm/rendezvous/joined"  # the roll call's keys: /<rank>, /count, /outcome


def join(
    store: Store,
    rank: int,
    size: int,
    seconds: float,
    warn_after: float,
    where: str,
    size_from: str = "world_size",
) -> None:
    """Join the store as `rank` of `size` and wait until every rank has, for at most `seconds`.

    A roll call (`distcomm.store.ranks.roll_call`) of the world size: a rank started with
    another one than rank 0's, or a second process with a rank already taken, makes every
    rank fail at once. While some are missing, warn after `warn_after` seconds (0: never),
    then after twice as long as the previous wait each time, naming the ranks that joined
    and those missing.

    Args:
        size_from: where `size` came from, for messages ("WORLD_SIZE (torch style)").

    Raises:
        ValueError: this rank's world size differs from rank 0's, its rank is taken, or
            another rank found one of these; the message names both sides.
        DistTimeoutError: some ranks did not join in time; the message names them.
        DistStoreError: the store failed.
    """
    roll_call(
        store,
        _JOINED,
        rank,
        size,
        Deadline(seconds),
        where,
        arrived="joined the store",
        hint="start them with the same store address and world size, or look at their "
        "output for an error",
        size_from=size_from,
        warn_after=warn_after,
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
    size_from: str = "world_size",
) -> Store:
    """Host (rank 0) or connect to the TCPStore at `host`:`port`, then wait for every rank.

    With `agent` (a launcher serves the store) every rank connects, keeps its keys under
    `prefix` when that is set, and does not wait for the others.

    Args:
        where: who rendezvouses how, for messages ("[rank 1/4] env:// rendezvous").
        origin: where the address came from, for messages.
        warn_after: seconds before the first warning about missing ranks (0: none).
        size_from: where `size` came from, for messages ("WORLD_SIZE (torch style)").

    Raises:
        ValueError: the ranks disagree on the world size, or two have the same rank.
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
            join(opened, rank, size, seconds, warn_after, store_at, size_from)
        except BaseException:
            opened.close()
            raise
    return opened
