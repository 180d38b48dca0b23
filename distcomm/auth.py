"""The connection handshake: a greeting, then mutual HMAC-SHA256 proof of DISTCOMM_AUTH_KEY.

Every store and backend connection starts with it, before any request is served::

    server -> client   HELLO  = b"DCv1" + flag (1 byte: 0 open, 1 key required) + nonce_s (32)
    client -> server   PROOF  = nonce_c (32) + HMAC(key, b"client" + nonce_s + nonce_c)   [flag 1]
    server -> client   ACCEPT = b"\\x01" + HMAC(key, b"server" + nonce_c + nonce_s)       [flag 1]

A server that rejects a proof closes the connection without a reply. A key set
on one side only is an error on the side that notices it, with a message that
says to set the same key on every process. Since a distcomm server greets first
and at once, a client tells another program on the port (one that sends something
else, closes, or stays silent) from a distcomm peer before it sends anything, and says
so; the one exception is a client without a key that hands `client_handshake` its first
request, which goes out at once to save a round trip (the server answers it right after
its greeting, in the same packet). The message functions are pure so that both
blocking sockets and the store's event loop use them.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import socket
import time

from .deadline import Deadline
from .errors import DistNetworkError
from .net import format_address, recv_exact, recv_within, send_now

__all__ = [
    "ACCEPT_SIZE",
    "HELLO_SIZE",
    "PROOF_SIZE",
    "accept_message",
    "client_handshake",
    "hello_message",
    "proof_message",
    "server_handshake",
    "verify_accept",
    "verify_proof",
]

MAGIC = b"DCv1"
NONCE_SIZE = 32
DIGEST_SIZE = 32
HELLO_SIZE = len(MAGIC) + 1 + NONCE_SIZE
PROOF_SIZE = NONCE_SIZE + DIGEST_SIZE
ACCEPT_SIZE = 1 + DIGEST_SIZE

log = logging.getLogger(__name__)
_READ_SLICE = 3600.0  # the longest one socket read of the greeting is given


def _mac(key: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, label + first + second, hashlib.sha256).digest()


def hello_message(key: bytes | None) -> tuple[bytes, bytes]:
    """The server's greeting and the nonce it must remember."""
    nonce = os.urandom(NONCE_SIZE)
    return MAGIC + (b"\x01" if key else b"\x00") + nonce, nonce


def proof_message(key: bytes | None, hello: bytes, peer: str) -> tuple[bytes, bytes]:
    """The client's answer to `hello`, and the server proof it must then expect.

    Returns (b"", b"") when the server needs no key and none is set here.

    Raises:
        DistNetworkError: `peer` is not a distcomm endpoint, or the two sides disagree
            on whether a key is in use.
    """
    if len(hello) != HELLO_SIZE or not hello.startswith(MAGIC):
        raise DistNetworkError(
            f"{peer} did not greet like a distcomm endpoint (wrong address or port?)"
        )
    required = hello[len(MAGIC)] == 1
    if required and not key:
        raise DistNetworkError(
            f"{peer} requires authentication: set DISTCOMM_AUTH_KEY to the job's key "
            "in this process's environment"
        )
    if not required and key:
        raise DistNetworkError(
            f"{peer} does not authenticate, but DISTCOMM_AUTH_KEY is set in this process: "
            "set the same DISTCOMM_AUTH_KEY in every process of the job, or in none"
        )
    if not required:
        return b"", b""
    nonce_s = hello[len(MAGIC) + 1 :]
    nonce_c = os.urandom(NONCE_SIZE)
    proof = nonce_c + _mac(key, b"client", nonce_s, nonce_c)
    return proof, _mac(key, b"server", nonce_c, nonce_s)


def verify_proof(key: bytes, nonce_s: bytes, proof: bytes) -> bytes | None:
    """Check a client's proof; returns the ACCEPT message, or None to reject."""
    if len(proof) != PROOF_SIZE:
        return None
    nonce_c, digest = proof[:NONCE_SIZE], proof[NONCE_SIZE:]
    if not hmac.compare_digest(digest, _mac(key, b"client", nonce_s, nonce_c)):
        return None
    return accept_message(key, nonce_s, nonce_c)


def accept_message(key: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    """The server's proof that it also holds the key."""
    return b"\x01" + _mac(key, b"server", nonce_c, nonce_s)


def verify_accept(expected: bytes, accept: bytes, peer: str) -> None:
    """Check the server's ACCEPT against the proof `proof_message` said to expect.

    Raises:
        DistNetworkError: the server refused this process's key or could not prove its own.
    """
    if len(accept) < ACCEPT_SIZE:
        raise DistNetworkError(
            f"{peer} refused this process's DISTCOMM_AUTH_KEY: the key differs between "
            "processes of the job; set the same key everywhere"
        )
    if accept[0] != 1 or not hmac.compare_digest(accept[1:], expected):
        raise DistNetworkError(
            f"{peer} could not prove it holds DISTCOMM_AUTH_KEY: refusing to talk to it"
        )


def client_handshake(
    sock: socket.socket,
    key: bytes | None,
    deadline: Deadline,
    peer: str,
    *,
    expected: str = "a distcomm endpoint",
    hint: str = "wrong address or port?",
    warn_after: float = 0.0,
    first: bytes = b"",
    address: str = "",
) -> bytes:
    """Run the client side of the handshake on a connected blocking socket.

    A distcomm server greets as soon as it accepts, so the greeting tells a distcomm peer
    from another program: bytes that cannot begin a greeting fail at once, showing what
    came; a peer that closes first fails too. A peer that stays silent is waited for up
    to `deadline` (a server busy with thousands of connections may greet late), with a
    warning after `warn_after` seconds (0: none) that it may not be distcomm at all.

    Args:
        peer: who is expected there, for messages ("the TCPStore at 10.0.0.1:29500").
        expected: what a distcomm peer there is, for messages ("a distcomm TCPStore").
        hint: what to do when something else answers there.
        warn_after: seconds of silence before the warning.
        first: the caller's first request, sent as early as the handshake allows, which
            saves a round trip: before the greeting is read where this process has no
            key (a server that wants one is refused on its greeting all the same, and the
            request is never served), else with the proof, after the greeting.
        address: host:port dialled, named in messages where the socket can no longer
            say whom it was connected to (reset); default `peer`.

    Returns:
        What the peer sent past the handshake (the start of the answer to `first`); b""
        for nothing.

    Raises:
        DistNetworkError: the handshake failed; the message says why and what to do.
    """
    ahead = 1 << 16 if first else 0  # an answer to `first` may come with the greeting
    if first and not key:
        _send(sock, first, peer)
    hello = _read_greeting(sock, deadline, peer, expected, hint, warn_after, ahead, address or peer)
    hello, rest = hello[:HELLO_SIZE], hello[HELLO_SIZE:]
    proof, expected_accept = proof_message(key, hello, peer)
    if not proof:
        return rest
    _send(sock, proof + first, peer)
    accept = _read_accept(sock, deadline, peer, ahead)
    verify_accept(expected_accept, accept[:ACCEPT_SIZE], peer)
    return accept[ACCEPT_SIZE:]


def _send(sock: socket.socket, data: bytes, peer: str) -> None:
    try:
        sent = send_now(sock, data)  # a handshake message always fits: no wait
        if sent < len(data):
            sock.sendall(data[sent:])
    except OSError as exc:
        raise DistNetworkError(f"handshake with {peer} failed: {exc}") from exc


def _read_accept(sock: socket.socket, deadline: Deadline, peer: str, ahead: int) -> bytes:
    """The server's ACCEPT and, up to `ahead` bytes, what came after it; less only when the
    server closed first (it refused the proof)."""
    data = b""
    while len(data) < ACCEPT_SIZE:
        step = deadline.slice(_READ_SLICE)
        if step <= 0:
            raise DistNetworkError(f"timed out reading from {peer}")
        try:
            chunk = recv_within(sock, max(ahead, ACCEPT_SIZE - len(data)), step)
        except OSError as exc:
            raise DistNetworkError(f"reading from {peer} failed: {exc}") from exc
        if chunk == b"":
            break
        if chunk:
            data += chunk
    return data


def _could_begin_greeting(data: bytes) -> bool:
    """Whether `data` is the start of a distcomm greeting (magic, then a 0 or 1 flag)."""
    if not MAGIC.startswith(data[: len(MAGIC)]):
        return False
    return len(data) <= len(MAGIC) or data[len(MAGIC)] in (0, 1)


def _preview(data: bytes) -> str:
    shown = data[:48]
    return repr(shown) + (f" and {len(data) - len(shown)} more bytes" if len(data) > 48 else "")


def _address(sock: socket.socket, dialled: str) -> str:
    """Where `sock` is connected, for messages (asked only for one: it costs a system call
    that lets go of the GIL); `dialled` once the connection is reset."""
    try:
        return format_address(*sock.getpeername()[:2])
    except OSError:
        return dialled


def _read_greeting(
    sock: socket.socket,
    deadline: Deadline,
    peer: str,
    expected: str,
    hint: str,
    warn_after: float,
    ahead: int = 0,
    dialled: str = "",
) -> bytes:
    """The server's HELLO, read as it comes (see `client_handshake`), and, up to `ahead`
    bytes, what came after it."""
    dialled = dialled or peer
    started = time.monotonic()
    warn_at = started + warn_after if warn_after > 0 else math.inf
    data = b""
    while len(data) < HELLO_SIZE:
        step = deadline.slice(min(max(warn_at - time.monotonic(), 0.001), _READ_SLICE))
        chunk = None
        if step > 0:
            try:
                chunk = recv_within(sock, max(ahead, HELLO_SIZE - len(data)), step)
            except OSError as exc:
                raise DistNetworkError(f"reading from {peer} failed: {exc}") from exc
        if chunk == b"":
            said = f"after sending {_preview(data)}" if data else "without sending anything"
            raise DistNetworkError(
                f"what answers at {_address(sock, dialled)} closed the connection {said}, "
                f"where {expected} greets first: it is not {expected}, or it refused this "
                f"process; {hint}"
            )
        if chunk:
            data += chunk
            if not _could_begin_greeting(data):
                other = " (or one of another version)" if data.startswith(MAGIC[:2]) else ""
                raise DistNetworkError(
                    f"what answers at {_address(sock, dialled)} is not {expected}{other} (it "
                    f"sent {_preview(data)}, where {expected} greets with {MAGIC!r}); {hint}"
                )
            continue
        waited = time.monotonic() - started
        if deadline.expired():
            raise DistNetworkError(
                f"what answers at {_address(sock, dialled)} accepted the connection but sent "
                f"nothing in {waited:.1f} s, where {expected} greets at once: it is probably "
                f"not {expected} (or one too busy to answer); {hint}"
            )
        if time.monotonic() >= warn_at:
            log.warning(
                "what answers at %s accepted the connection %.1f s ago but has not greeted "
                "as %s does at once: it may be busy, or another program that is not "
                "distcomm (%s); waiting up to %s",
                _address(sock, dialled),
                waited,
                expected,
                hint,
                "no limit" if deadline.seconds is None else f"{deadline.seconds:.0f} s",
            )
            warn_at = math.inf
    return data


def server_handshake(sock: socket.socket, key: bytes | None, deadline: Deadline, peer: str) -> bool:
    """Run the server side on an accepted blocking socket; False means reject and close."""
    hello, nonce_s = hello_message(key)
    try:
        sock.settimeout(deadline.remaining())
        sock.sendall(hello)
    except OSError:
        return False
    if not key:
        return True
    try:
        proof = recv_exact(sock, PROOF_SIZE, deadline, peer)
    except DistNetworkError:
        return False
    accept = verify_proof(key, nonce_s, proof)
    if accept is None:
        return False
    try:
        sock.sendall(accept)
    except OSError:
        return False
    return True
