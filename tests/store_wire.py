"""Raw TCPStore connections for tests that speak the wire protocol themselves."""

from __future__ import annotations

import socket

from distcomm import auth
from distcomm.store.tcp.protocol import HEADER, decode_args, encode_frame

__all__ = ["frame", "raw_connection", "read_response", "recv_exact"]


def frame(code: int, args: list[bytes]) -> bytes:
    """A request as one buffer."""
    return b"".join(encode_frame(code, args))


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """`size` bytes, or fewer if the server closes the connection first."""
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def read_response(sock: socket.socket) -> tuple[int, list[bytes]]:
    """(status, arguments) of the next answer.

    Raises:
        AssertionError: the server closed the connection instead.
    """
    header = recv_exact(sock, HEADER.size)
    assert len(header) == HEADER.size, "the server closed the connection"
    size, status = HEADER.unpack(header)
    return status, decode_args(recv_exact(sock, size))


def raw_connection(host: str, port: int, timeout: float = 10.0) -> socket.socket:
    """A connection past a keyless server's greeting."""
    sock = socket.create_connection((host, port), timeout=timeout)
    assert len(recv_exact(sock, auth.HELLO_SIZE)) == auth.HELLO_SIZE
    return sock
