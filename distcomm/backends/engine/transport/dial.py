"""Connection set-up: dialling a peer process, and accepting a peer's dial.

A connection is made the first time a group sends to a process this one has no
connection to: the sending thread dials it (`Dialling.connection`). A dial is
authenticated (`distcomm.auth`), then says who dials, which set-up of the job it belongs
to and whom it wants; the acceptor, on its I/O thread, answers with a verdict byte
(`_Handshake` is that side's state machine). Two processes that dial each other at once
end with one connection: the dial of the lower rank wins, the other is told so and uses
the winner's.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Sequence

from .... import auth, net
from ....config import load as load_config
from ....deadline import Deadline, StallClock
from ....errors import DistError, DistNetworkError, DistTimeoutError
from ....store.base import Store
from ....store.ranks import log_missing, wait_for_ranks
from . import links
from .conn import _IN, _SEND_SLICE, Conn

__all__ = ["Dialling"]

log = logging.getLogger(links.LOGGER_NAME)

#: a dial's greeting after the handshake: magic, dialer's rank, set-up number, wanted rank
_HELLO = struct.Struct("<4sqqq")
_HELLO_MAGIC = b"DCF1"
#: the acceptor's verdict: refused (another set-up or process), accepted, or "my dial wins"
_REFUSED, _ACCEPTED, _OTHER_WINS = 0, 1, 2
#: how long an accepted connection may take to finish its handshake
_HANDSHAKE_S = 10.0
_JOIN_SLICE = 3600.0
_HINT = (
    "did every rank of the group call init_process_group (or new_group) with this "
    "backend? Look at the missing ranks' output for an error"
)


class _Handshake:
    """An accepted connection until its dial is verified (the engine's state machine)."""

    __slots__ = ("buf", "deadline", "need", "nonce", "sock", "stage")

    def __init__(self, sock: socket.socket, nonce: bytes, keyed: bool) -> None:
        self.sock, self.nonce = sock, nonce
        self.stage = "proof" if keyed else "hello"
        self.need = auth.PROOF_SIZE if keyed else _HELLO.size
        self.buf = bytearray()
        self.deadline = time.monotonic() + _HANDSHAKE_S


class Dialling:
    """Making connections (a mixin of `fabric.Fabric`): dialling a process (any thread)
    and the I/O thread's side of an accepted dial.

    Uses the fabric's lock and tables (`_lock`, `_conns`, `_dialing`, `_addresses`,
    `_handshakes`), its listener, key and identity, and `_post`, `_interest`,
    `_register`, `_unregister`.
    """

    store: Store
    prank: int
    generation: int
    link_timeout: float
    label: str
    closing: bool
    _key: bytes | None
    _lock: threading.Condition
    _conns: dict[int, Conn]
    _dialing: set[int]
    _addresses: dict[int, tuple[str, str]]
    _handshakes: set[_Handshake]
    _listener: socket.socket
    _listener_paused_until: float
    _thread: threading.Thread

    def connection(
        self, prank: int, deadline: Deadline, who: str, label: str, members: Sequence[int]
    ) -> Conn:
        """The connection to process `prank`, dialled now if there is none.

        `who` names the peer in messages ("rank 3"), `label` is the group's message prefix
        and `members` gives each group rank's process rank: the first dial of a group
        fetches the addresses of all its members not known yet, in one request.

        Raises:
            DistTimeoutError: the peer did not publish its address or answer in time.
            DistNetworkError: the connection could not be made.
        """
        conn = self._conns.get(prank)
        if conn is not None and not conn.closed:
            return conn
        with self._lock:
            while True:
                conn = self._conns.get(prank)
                if conn is not None and not conn.closed:
                    return conn
                if self.closing:
                    raise DistNetworkError(f"{label}: the transport is closed")
                if prank not in self._dialing:
                    self._dialing.add(prank)
                    break
                if deadline.expired():
                    raise DistTimeoutError(
                        f"{label}: connecting to {who} took longer than {deadline.seconds:.1f} s"
                    )
                self._lock.wait(deadline.slice(_SEND_SLICE))
        try:
            return self._dial(prank, deadline, who, label, members)
        finally:
            with self._lock:
                self._dialing.discard(prank)
                self._lock.notify_all()

    def _dial(
        self, prank: int, deadline: Deadline, who: str, label: str, members: Sequence[int]
    ) -> Conn:
        if prank not in self._addresses:
            self._look_up(members, deadline, label)
        host, port = self._addresses[prank]
        where = f"{who} at {net.format_address(host, int(port))}"
        try:
            sock = net.connect(host, int(port), deadline, what=where, retry_refused=False)
        except DistNetworkError as exc:
            if isinstance(exc.__cause__, ConnectionRefusedError):
                raise DistNetworkError(
                    f"{who} is gone: nothing listens at its address "
                    f"{net.format_address(host, int(port))} any more (its process ended, or "
                    "it destroyed its process group: exit or crash?)"
                ) from exc
            raise
        try:
            auth.client_handshake(sock, self._key, deadline, where)
            sock.sendall(_HELLO.pack(_HELLO_MAGIC, self.prank, self.generation, prank))
            verdict = net.recv_exact(sock, 1, deadline, where)
        except (OSError, DistError) as exc:
            sock.close()
            # a DistNetworkError is an OSError too (ConnectionError): look at what it wraps
            cause = exc.__cause__ if isinstance(exc, DistError) else exc
            if isinstance(cause, (ConnectionResetError, BrokenPipeError)):
                # it accepted, then its process ended (the kernel still took the dial)
                raise DistNetworkError(self._closed_in_handshake(label, who, where)) from exc
            raise DistNetworkError(f"{label}: connecting to {who}: {exc}") from exc
        if verdict == bytes([_ACCEPTED]):
            sock.settimeout(None)  # the handshake's read timeout must not outlive it
            return self._adopt(prank, sock)
        sock.close()
        if verdict == bytes([_OTHER_WINS]):  # it dialled this process at the same time
            return self._await_conn(prank, deadline, who, label)
        raise DistNetworkError(
            f"{label}: {where} refused the connection: it belongs to another set-up of "
            "the job (was the job re-initialised on the same store a different number of "
            "times by different ranks?)"
            if verdict
            else self._closed_in_handshake(label, who, where)
        )

    @staticmethod
    def _closed_in_handshake(label: str, who: str, where: str) -> str:
        return (
            f"{label}: connecting to {who}: {who} closed the connection (exit or "
            f"crash?) during the handshake ({where})"
        )

    def _look_up(self, members: Sequence[int], deadline: Deadline, label: str) -> None:
        """Learn the addresses of the group's members not known yet: one wait (naming the
        ranks that have not published theirs) and one `multi_get`, however many."""
        keys = {
            rank: self._address_key(p)
            for rank, p in enumerate(members)
            if p != self.prank and p not in self._addresses
        }
        if not keys:
            return
        wait_for_ranks(
            self.store, keys, deadline, label, hint=_HINT, arrived="published their address"
        )
        values = self.store.multi_get(list(keys.values()))
        with self._lock:
            for rank, value in zip(keys, values, strict=True):
                self._addresses[members[rank]] = net.split_address(value.decode())

    def _await_conn(self, prank: int, deadline: Deadline, who: str, label: str) -> Conn:
        stall = StallClock(load_config().stall_warn_s)
        with self._lock:
            while True:
                conn = self._conns.get(prank)
                if conn is not None and not conn.closed:
                    return conn
                if deadline.expired():
                    raise DistTimeoutError(
                        f"{label}: {who} dialled this rank but did not finish connecting "
                        f"within {deadline.seconds:.1f} s"
                    )
                self._lock.wait(deadline.slice(min(stall.until_next(), _JOIN_SLICE)))
                waited = stall.due()
                if waited is not None:
                    log_missing(
                        label,
                        waited,
                        [prank],
                        1,
                        "connected to this rank",
                        _HINT,
                        deadline,
                        stall.next,
                    )

    def _adopt(self, prank: int, sock: socket.socket) -> Conn:
        conn = Conn(prank, sock, self.link_timeout)
        with self._lock:
            if self.closing:  # a dial that finished while the fabric closed
                sock.close()
                raise DistNetworkError(f"{self.label}: the transport is closed")
            self._conns[prank] = conn
            self._lock.notify_all()
        if threading.current_thread() is self._thread:
            self._interest(conn)
        else:
            self._post("conn", conn)
        return conn

    # -- accepting ------------------------------------------------------------------------

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        except OSError as exc:
            short = net.descriptor_shortage(exc, "accept a connection from a peer")
            if short is not None:
                log.error("%s: %s", self.label, short)
                self._unregister(self._listener.fileno())  # try again in a second
                self._listener_paused_until = time.monotonic() + 1.0
            return
        sock.setblocking(True)
        greeting, nonce = auth.hello_message(self._key)
        hs = _Handshake(sock, nonce, self._key is not None)
        try:
            if sock.send(greeting, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL) != len(greeting):
                raise OSError("short write")
        except OSError:
            sock.close()
            return
        self._handshakes.add(hs)
        self._register(sock.fileno(), _IN, hs)

    def _drop_handshake(self, hs: _Handshake, keep: bool = False) -> None:
        self._handshakes.discard(hs)
        self._unregister(hs.sock.fileno())
        if not keep:
            hs.sock.close()

    def _handshake_step(self, hs: _Handshake) -> None:
        try:
            data = hs.sock.recv(hs.need - len(hs.buf), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            self._drop_handshake(hs)
            return
        if not data:
            self._drop_handshake(hs)
            return
        hs.buf += data
        if len(hs.buf) < hs.need:
            return
        if hs.stage == "proof":
            accept = auth.verify_proof(self._key, hs.nonce, bytes(hs.buf))
            if accept is None or not self._send_small(hs.sock, accept):
                self._drop_handshake(hs)
                return
            hs.stage, hs.need, hs.buf = "hello", _HELLO.size, bytearray()
            return
        magic, dialer, generation, wanted = _HELLO.unpack(bytes(hs.buf))
        if magic != _HELLO_MAGIC or wanted != self.prank or generation != self.generation:
            self._send_small(hs.sock, bytes([_REFUSED]))
            self._drop_handshake(hs)
            return
        with self._lock:
            existing = self._conns.get(dialer)
            other_wins = (existing is not None and not existing.closed) or (
                dialer in self._dialing and self.prank < dialer
            )
        if other_wins:
            self._send_small(hs.sock, bytes([_OTHER_WINS]))
            self._drop_handshake(hs)
            return
        self._drop_handshake(hs, keep=True)
        if not self._send_small(hs.sock, bytes([_ACCEPTED])):
            hs.sock.close()
            return
        self._adopt(dialer, hs.sock)

    @staticmethod
    def _send_small(sock: socket.socket, data: bytes) -> bool:
        try:
            return sock.send(data, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL) == len(data)
        except OSError:
            return False
