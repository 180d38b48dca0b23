"""`rendezvous`: what `init_process_group` calls to get the job's store, its rank and size.

It checks the arguments, takes a store= as it is, and hands an init_method URL to the
handler registered for its scheme (`distcomm.bootstrap.urls`; the built-in ones are in
`distcomm.bootstrap.schemes`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from .. import config
from ..deadline import to_seconds
from ..launcher_env import detect, optional_int
from ..store import Store
from . import schemes  # noqa: F401  (registers env://, tcp:// and file://)
from .base import Rendezvous
from .urls import (
    BUILTIN_SCHEMES,
    handler_for,
    refuse_node_parameters_twice,
    with_node_parameters,
)

__all__ = ["rendezvous"]


def rendezvous(
    init_method: str | None = None,
    rank: int | None = -1,
    world_size: int | None = -1,
    *,
    store: Store | None = None,
    timeout: float | timedelta = config.DEFAULT_TIMEOUT,
    environ: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> Rendezvous:
    """Find this process's store, rank and world size, as `init_process_group` does.

    Called as torch's ``rendezvous(url, rank, world_size, **kwargs)``, it is torch's too:
    the `Rendezvous` it returns is also an iterator of one ``(store, rank, world_size)``
    (``next(...)`` gives it, and a second ``next`` raises RuntimeError: an init_method
    cannot rendezvous again), rank and world_size come as arguments or in the URL's query
    but not both, and a scheme without a handler raises an error that is a RuntimeError
    (as torch's) and a ValueError.

    Args:
        init_method: env:// (None means env://), tcp://HOST:PORT, file:///PATH, or a
            scheme registered with `register_rendezvous_handler`.
        rank, world_size: explicit values; -1 (or None) takes them from the URL's query or
            the environment (see `distcomm.launcher_env` for the precedence).
        store: a store already shared by the job; then rank and world_size are required
            and init_method must be None.
        timeout: the store's timeout (seconds or timedelta), connecting included.
        environ: the environment to read (default: os.environ).
        kwargs: passed on to the handler of a scheme registered with
            `register_rendezvous_handler` (the built-in schemes take none).

    Returns:
        A `Rendezvous`; the caller owns its store.

    Raises:
        TypeError: an argument has the wrong type, or a built-in scheme was given a
            keyword it does not take.
        ValueError: a value is missing, malformed or out of range (the message lists where
            it was looked for); rank or world_size given both as an argument and in the
            URL (`NodeParametersGivenTwice`, also an AssertionError as torch's); no handler
            for the URL's scheme (`UnknownSchemeError`, also a RuntimeError as torch's).
        DistNetworkError, DistStoreError, DistTimeoutError: the store could not be
            hosted, opened or reached in time; the message names the rank and the address.
    """
    env = os.environ if environ is None else environ
    rank_arg, size_arg = optional_int("rank", rank, 0), optional_int("world_size", world_size, 1)
    seconds = to_seconds(timeout)
    seconds = config.DEFAULT_TIMEOUT if seconds is None else seconds
    if store is not None:
        if init_method is not None:
            raise ValueError(
                f"cannot specify both init_method ({init_method!r}) and store: pass one of them"
            )
        if not isinstance(store, Store):
            raise TypeError(f"store must be a distcomm Store, got {type(store).__name__}")
        if rank_arg is None or size_arg is None:
            raise ValueError(
                f"a store= needs rank and world_size given explicitly, got "
                f"rank={rank}, world_size={world_size}: pass world_size=N (N >= 1) "
                f"and rank=R (0 <= R < N)"
            )
        return _around(
            store, rank_arg, size_arg, env, "store", ("rank= argument", "world_size= argument")
        )
    url = "env://" if init_method is None else init_method
    refuse_node_parameters_twice(url, rank_arg, size_arg)
    scheme, handler = handler_for(url)
    if kwargs and scheme in BUILTIN_SCHEMES:
        raise TypeError(
            f"rendezvous got {', '.join(f'{k}=' for k in sorted(kwargs))} for {scheme}://, "
            "whose handler takes none of them: the built-in schemes take rank, world_size, "
            "timeout (and environ); other keywords are for a scheme's own handler"
        )
    if scheme not in BUILTIN_SCHEMES:
        url = with_node_parameters(url, rank_arg, size_arg)
    found = handler(url, rank=rank_arg, world_size=size_arg, timeout=seconds, environ=env, **kwargs)
    return _outcome(found, scheme, env)


def _outcome(found: object, scheme: str, env: Mapping[str, str]) -> Rendezvous:
    """What a scheme's handler returned, as a `Rendezvous` (see `distcomm.bootstrap.urls`).

    Raises:
        TypeError: the handler returned something else.
        ValueError: the rank it returned is not below the world size.
    """
    who = f"the {scheme}:// handler"
    if isinstance(found, Rendezvous):  # (itself an iterator, for torch's callers)
        return found
    if hasattr(found, "__next__"):  # torch's form: a generator of (store, rank, world_size)
        try:
            found = next(found)  # type: ignore[call-overload]
        except StopIteration:
            raise TypeError(
                f"{who} yielded nothing: it must yield (store, rank, world_size)"
            ) from None
    if isinstance(found, Rendezvous):
        return found
    if (
        not isinstance(found, tuple)
        or len(found) != 3
        or not isinstance(found[0], Store)
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in found[1:])
    ):
        raise TypeError(
            f"{who} returned {found!r}: it must return a Rendezvous, a (store, rank, "
            f"world_size) tuple of a distcomm Store and two ints, or an iterator of those"
        )
    store, rank, size = found
    return _around(store, rank, size, env, f"{scheme}://", (who, who))


def _around(
    store: Store,
    rank: int,
    size: int,
    env: Mapping[str, str],
    source: str,
    labels: tuple[str, str],
) -> Rendezvous:
    """A rendezvous on a store the job already shares, with this host's values from `env`.

    Args:
        source: how it was found, for `Rendezvous.source`.
        labels: where rank and size came from, for messages ("rank= argument", ...).

    Raises:
        ValueError: rank is not below size, or a launcher variable is malformed.
    """
    info = detect(env, {"rank": (rank, labels[0]), "world_size": (size, labels[1])}, False)
    return Rendezvous(store, rank, size, info.local_rank, info.local_world_size, source=source)
