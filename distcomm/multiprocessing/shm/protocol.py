"""What the shm manager daemon and its client share: the line protocol, its limits and checks.

The daemon (`manager`) and its client (`client`) both import this module and
never each other, so the daemon loads none of the client's machinery.

Protocol (version 1): ASCII lines over an abstract-namespace unix stream socket
(``"\\0" + address``). The client opens with ``HELLO <version> <pid>``, answered by
``OK <version> <manager pid>``. Then ``REG <name>``, ``SEND <name>`` and ``STAT [<name>]``
are answered, in order, by ``OK [...]`` or ``ERR <message>``; ``CLAIM <name>`` and
``REL <name>`` get no answer (the manager logs what it cannot do). A line that is not
ASCII, longer than `MAX_LINE` bytes or has an unknown operation closes the connection.
Only processes of the manager's own user are served (``SO_PEERCRED``): the abstract
namespace has no file permissions. What each operation means for a segment's reference
count is described in `manager`.
"""

from __future__ import annotations

import re

__all__ = [
    "ADDRESS_ENV",
    "DEFAULT_LINGER",
    "DEFAULT_STARTUP_TIMEOUT",
    "MAX_LINE",
    "MAX_NAME_LENGTH",
    "NAME_PREFIX",
    "PROTOCOL_VERSION",
    "validate_name",
]

#: Environment variable naming this process tree's manager (its abstract socket address).
ADDRESS_ENV = "DISTCOMM_SHM_MANAGER"
#: Every segment name the manager accepts starts with this.
NAME_PREFIX = "distcomm_"
#: Longest segment name, in characters.
MAX_NAME_LENGTH = 200
#: Seconds the manager waits, once its last client has gone, before it cleans up and exits.
DEFAULT_LINGER = 2.0
#: Seconds the manager waits for its first client before it gives up and exits.
DEFAULT_STARTUP_TIMEOUT = 30.0
#: Version of the line protocol spoken between clients and the manager.
PROTOCOL_VERSION = 1
#: Longest request or reply line, in bytes (without the newline).
MAX_LINE = 512

_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
_MAX_ADDRESS_BYTES = 107  # sun_path is 108 bytes, one of them the leading NUL


def validate_name(name: str) -> str:
    """Check a segment name: ``distcomm_`` then ``[A-Za-z0-9._-]``, at most 200 characters.

    Returns:
        The name, unchanged.

    Raises:
        TypeError: `name` is not a str.
        ValueError: the name breaks a rule; the message says which.
    """
    if not isinstance(name, str):
        raise TypeError(f"segment name must be a str, got {type(name).__name__}")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"segment name of {len(name)} characters is too long: at most {MAX_NAME_LENGTH}"
        )
    if not name.startswith(NAME_PREFIX) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"segment name {name!r} is invalid: it must start with {NAME_PREFIX!r} and "
            f"hold only ASCII letters, digits, '.', '_' and '-'"
        )
    return name


def _validate_address(address: str) -> str:
    if not isinstance(address, str):
        raise TypeError(f"manager address must be a str, got {type(address).__name__}")
    raw = address.encode("utf-8", "surrogateescape")
    if not address or "\0" in address or len(raw) > _MAX_ADDRESS_BYTES:
        raise ValueError(
            f"manager address {address!r} is invalid: it must be 1 to {_MAX_ADDRESS_BYTES} "
            f"bytes without NUL (check {ADDRESS_ENV})"
        )
    return address
