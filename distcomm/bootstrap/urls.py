"""init_method URLs: parsing the built-in schemes, and the registry of a handler per scheme.

`parse_init_method` parses the built-in schemes, ``env://`` (the default),
``tcp://HOST:PORT`` (``tcp://[V6ADDR]:PORT`` too) and ``file:///PATH``, each accepting
``?rank=R&world_size=N``. `register_rendezvous_handler` maps a scheme to the function that
turns such a URL into a `Rendezvous`, as torch's function of that name does; the built-in
schemes are registered in `distcomm.bootstrap.schemes`, and `handler_for` finds the
handler of a URL or refuses it, listing the registered schemes.

A handler is called as ``handler(url, rank=R, world_size=N, timeout=S, environ=ENV)``:
`rank` and `world_size` are the caller's explicit values (None where not given; torch puts
them in the URL's query instead, which would lose where each came from), `timeout` the
seconds it may take, `environ` the environment to read. It returns a `Rendezvous`, a
``(store, rank, world_size)`` tuple, or an iterator whose first item is one of them (the
generator form torch's handlers use).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import SplitResult, urlsplit, urlunsplit

from .base import InitMethod, parse_int

__all__ = ["RendezvousHandler", "parse_init_method", "register_rendezvous_handler"]

#: A scheme's handler: ``handler(url, *, rank, world_size, timeout, environ)``.
RendezvousHandler = Callable[..., Any]

#: How a message names each built-in scheme.
_BUILTIN = {
    "env": "env:// (the default: MASTER_ADDR, MASTER_PORT)",
    "tcp": "tcp://HOST:PORT",
    "file": "file:///PATH",
}
_SCHEME_SYNTAX = re.compile(r"[a-z][a-z0-9+.-]*")

_lock = threading.Lock()
_handlers: dict[str, RendezvousHandler] = {}


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
            raise ValueError(f"a rendezvous handler for {scheme.lower()}:// is already registered")
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


def _unsupported(url: object, scheme: str, schemes: str) -> ValueError:
    return ValueError(f"init_method {url!r} has an unsupported scheme {scheme!r}: use {schemes}")


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
            raise ValueError(
                f"init_method {url!r} needs a host and a port: tcp://HOST:PORT or tcp://[IPV6]:PORT"
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
        raise ValueError(f"init_method {url!r} has no path: use file:///shared/path")
    return InitMethod("file", bare, path=parts.path, **query)
