"""init_method URLs: parsing the built-in schemes, and the registry of a handler per scheme.

`parse_init_method` parses the built-in schemes, ``env://`` (the default),
``tcp://HOST:PORT`` (``tcp://[V6ADDR]:PORT`` too) and ``file:///PATH``, each accepting
``?rank=R&world_size=N``. `register_rendezvous_handler` maps a scheme to the function that
turns such a URL into a `Rendezvous`, as torch's function of that name does; the built-in
schemes are registered in `distcomm.bootstrap.schemes`, and `handler_for` finds the
handler of a URL or refuses it, listing the registered schemes.

A handler is called as ``handler(url, rank=R, world_size=N, timeout=S, environ=ENV,
**kwargs)``: `rank` and `world_size` are the caller's explicit values (None where not
given), which the URL's query also carries, as torch hands them to its handlers (a caller
gives them in one place or the other, never both); `timeout` is the seconds it may take,
`environ` the environment to read, and `kwargs` what else the caller gave `rendezvous`.
It returns a `Rendezvous`, a ``(store, rank, world_size)`` tuple, or an iterator whose
first item is one of them (the generator form torch's handlers use).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import SplitResult, urlsplit, urlunsplit

from ..launcher_env import parse_int
from .base import InitMethod

__all__ = [
    "BUILTIN_SCHEMES",
    "NodeParametersGivenTwice",
    "RendezvousHandler",
    "UnknownSchemeError",
    "parse_init_method",
    "refuse_node_parameters_twice",
    "register_rendezvous_handler",
    "with_node_parameters",
]

#: A scheme's handler: ``handler(url, *, rank, world_size, timeout, environ)``.
RendezvousHandler = Callable[..., Any]

#: How a message names each built-in scheme.
_BUILTIN = {
    "env": "env:// (the default: MASTER_ADDR, MASTER_PORT)",
    "tcp": "tcp://HOST:PORT",
    "file": "file:///PATH",
}
#: The schemes distcomm registers itself (`distcomm.bootstrap.schemes`).
BUILTIN_SCHEMES = frozenset(_BUILTIN)
_SCHEME_SYNTAX = re.compile(r"[a-z][a-z0-9+.-]*")

_lock = threading.Lock()
_handlers: dict[str, RendezvousHandler] = {}


class UnknownSchemeError(ValueError, RuntimeError):
    """No rendezvous handler is registered for an init_method's scheme, or one is already
    registered for a scheme given to `register_rendezvous_handler`: a ValueError, as
    distcomm raises for a bad argument, and a RuntimeError, as torch raises for these."""


class NodeParametersGivenTwice(ValueError, AssertionError):
    """rank or world_size given as arguments to a rendezvous whose URL carries them too:
    a ValueError, and an AssertionError, as torch's check is an assertion."""


def _either(names: list[str]) -> str:
    """'a, b or c'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


_SCHEMES = _either(list(_BUILTIN.values()))


def register_rendezvous_handler(scheme: str, handler: RendezvousHandler) -> None:
    """Make ``init_method="SCHEME://..."`` rendezvous through `handler` (torch's function).

    Args:
        scheme: the URL scheme, without ``://`` (case-insensitive, as in URLs).
        handler: called as described in the module docstring.

    Raises:
        ValueError: `scheme` is not a URL scheme, or a handler is already registered for it.
        TypeError: `handler` is not callable.
    """
    if not isinstance(scheme, str) or not _SCHEME_SYNTAX.fullmatch(scheme.lower()):
        raise ValueError(
            f"a rendezvous scheme is a URL scheme such as 'myscheme' (a letter, then "
            f"letters, digits, '+', '-' or '.'), got {scheme!r}"
        )
    if not callable(handler):
        raise TypeError(f"the rendezvous handler for {scheme}:// must be callable, got {handler!r}")
    with _lock:
        if scheme.lower() in _handlers:
            raise UnknownSchemeError(
                f"a rendezvous handler for {scheme.lower()}:// is already registered: a "
                "scheme has one handler; register yours under a scheme of its own"
            )
        _handlers[scheme.lower()] = handler


def _registered() -> str:
    """The registered schemes, for messages (the built-in ones as `parse_init_method` says)."""
    with _lock:
        schemes = list(_handlers)
    return _either([_BUILTIN.get(scheme, f"{scheme}://") for scheme in schemes])


def _split(url: object, schemes: str, *, with_port: bool = True) -> SplitResult:
    """urlsplit `url`, with the errors `parse_init_method` raises for a non-str or malformed
    URL; `schemes` is what the messages offer instead."""
    if not isinstance(url, str):
        raise TypeError(
            f"init_method must be a str URL such as {schemes}, got {type(url).__name__}"
        )
    try:
        parts = urlsplit(url)
        if with_port:
            parts.port  # noqa: B018  (raises for a port that is no number in 0..65535)
    except ValueError as exc:
        raise ValueError(f"init_method {url!r} is not a valid URL ({exc}): use {schemes}") from None
    return parts


def handler_for(url: object) -> tuple[str, RendezvousHandler]:
    """`url`'s scheme (lower case) and the handler registered for it.

    Raises:
        TypeError: `url` is not a str.
        ValueError: `url` is malformed, or no handler is registered for its scheme; the
            message lists the registered ones.
    """
    schemes = _registered()
    parts = _split(url, schemes, with_port=False)
    scheme = parts.scheme.lower()
    with _lock:
        handler = _handlers.get(scheme)
    if handler is None:
        _split(url, schemes)  # a malformed port is reported as such
        raise _unsupported(url, parts.scheme, schemes)
    return scheme, handler


def _unsupported(url: object, scheme: str, schemes: str) -> UnknownSchemeError:
    return UnknownSchemeError(
        f"No rendezvous handler for {scheme.lower()}://: init_method {url!r} has an "
        f"unsupported scheme {scheme!r}: use {schemes}"
    )


def with_node_parameters(url: str, rank: int | None, world_size: int | None) -> str:
    """`url` with the rank and world size given as arguments added to its query, as torch
    hands them to a scheme's handler (which also gets them as keywords)."""
    items = [
        f"{name}={value}"
        for name, value in (("rank", rank), ("world_size", world_size))
        if value is not None
    ]
    if not items:
        return url
    parts = urlsplit(url)
    query = "&".join(filter(None, [parts.query, *items]))
    return urlunsplit(parts._replace(query=query))


def refuse_node_parameters_twice(url: object, rank: int | None, world_size: int | None) -> None:
    """Refuse rank or world_size given as arguments when the URL's query carries either,
    as torch refuses them (even when they agree): each has one place to come from.

    Raises:
        NodeParametersGivenTwice: both give node parameters; the message names them.
    """
    if (rank is None and world_size is None) or not isinstance(url, str):
        return
    try:
        query = urlsplit(url).query
    except ValueError:
        return  # a malformed URL is refused by its handler, with its own message
    in_url = [item.partition("=")[0] for item in filter(None, query.split("&"))]
    in_url = [key for key in in_url if key in ("rank", "world_size")]
    if in_url:
        given = [
            f"{name}={value}"
            for name, value in (("rank", rank), ("world_size", world_size))
            if value is not None
        ]
        raise NodeParametersGivenTwice(
            f"init_method {url!r} has node-specific arguments in its query "
            f"({', '.join('?' + key for key in in_url)}), and {', '.join(given)} came as "
            "arguments too: give rank and world_size in the URL or as arguments, not both"
        )


def _parse_query(url: str, query: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for item in filter(None, query.split("&")):
        key, sep, value = item.partition("=")
        if key == "use_libuv":
            continue  # torch's TCPStore implementation switch: nothing to choose here
        if not sep or key not in ("rank", "world_size"):
            raise ValueError(
                f"init_method {url!r}: query item {item!r} is not understood; "
                f"only rank=R and world_size=N may follow the '?'"
            )
        if key in found:
            raise ValueError(f"init_method {url!r} gives {key} twice: give it once")
        found[key] = parse_int(f"?{key}", value)
    return found


def parse_init_method(url: str) -> InitMethod:
    """Parse an init_method URL: env://, tcp://HOST:PORT, file:///PATH, each with an optional
    ``?rank=R&world_size=N``.

    Raises:
        TypeError: `url` is not a str.
        ValueError: the scheme is unknown or the URL lacks what its scheme needs.
    """
    parts = _split(url, _SCHEMES)
    port = parts.port
    scheme = parts.scheme.lower()
    if scheme not in _BUILTIN:
        raise _unsupported(url, parts.scheme, _SCHEMES)
    if parts.fragment:
        raise ValueError(
            f"init_method {url!r} has a '#' part, which no init_method takes: "
            f"remove it (for file://, pick a path without '#')"
        )
    query = _parse_query(url, parts.query)
    bare = urlunsplit(parts._replace(query=""))
    if scheme == "env":
        if parts.netloc or parts.path.strip("/"):
            raise ValueError(
                f"init_method {url!r}: env:// takes no address, it reads "
                f"MASTER_ADDR and MASTER_PORT; write tcp://HOST:PORT to give one"
            )
        return InitMethod("env", bare, **query)
    if scheme == "tcp":
        if not parts.hostname or port is None:
            missing = "port number missing" if parts.hostname else "host name missing"
            raise ValueError(
                f"init_method {url!r} needs a host and a port ({missing}): tcp://HOST:PORT "
                "or tcp://[IPV6]:PORT"
            )
        if not 1 <= port <= 65535:
            raise ValueError(
                f"init_method {url!r}: port {port} is out of range: use a TCP port from 1 to 65535"
            )
        if parts.path.strip("/"):
            raise ValueError(f"init_method {url!r}: a tcp:// URL takes no path")
        return InitMethod("tcp", bare, host=parts.hostname, port=port, **query)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(
            f"init_method {url!r} names the host {parts.netloc!r}: a file:// "
            f"URL holds a path, absolute after three slashes: file:///shared/path"
        )
    if not parts.path:
        raise ValueError(f"init_method {url!r} has no path (path missing): use file:///shared/path")
    return InitMethod("file", bare, path=parts.path, **query)
