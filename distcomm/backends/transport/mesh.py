"""Setting up a group's TCP mesh: one authenticated connection per pair of ranks.

Each rank listens on an ephemeral port of the address its peers can reach, publishes
it in the group's store, connects to every lower rank and accepts every higher one;
the listener is closed once the mesh is complete. Every connection starts with the
handshake of `distcomm.auth`, then a hello naming the rank, the group size and the
set-up round, so that a connection meant for another group or an earlier set-up on the
same store is refused.
"""

from __future__ import annotations

import socket
import struct
import threading

from ... import auth, net
from ...config import load as load_config
from ...deadline import Deadline, StallClock
from ...errors import DistError, DistNetworkError, DistTimeoutError
from ...store.base import Store
from ...store.ranks import log_missing, show_ranks, wait_for_ranks
from ..base import setup_round

__all__ = ["connect_mesh", "local_address"]

_HELLO = struct.Struct("<4siiq")  # magic, rank, size, set-up round
_HELLO_MAGIC = b"DCTP"
_POLL_SLICE = 0.5
_JOIN_SLICE = 3600.0  # a thread join takes no infinite timeout
_HINT = ("did every rank of the group call init_process_group (or new_group) with this "
         "backend? Look at the missing ranks' output for an error")


def connect_mesh(
    store: Store, rank: int, size: int, deadline: Deadline, label: str, key: bytes | None
) -> dict[int, socket.socket]:
    """A connected socket to every other rank of the group, by rank.

    Successive groups on the same store keys (re-initialisation) never mix: every rank
    joins once per set-up, so the join count numbers them (`setup_round`).

    Raises:
        DistTimeoutError: a peer did not publish its address or connect in time.
        DistNetworkError: connecting to a peer failed.
    """
    net.reserve_descriptors(size, label)  # a listener, and a socket per peer
    setup = _MeshSetup(rank, size, label, key)
    return setup.connect(store, setup_round(store, "tcp/joined", size), deadline)


def local_address(store: Store) -> str:
    """The local address peers can reach: DISTCOMM_SOCKET_IFNAME's (or GLOO_SOCKET_IFNAME's),
    else the store route's.

    Falls back to this host name's address, then 127.0.0.1, for stores without a socket.
    """
    ifname = load_config().socket_ifname
    if ifname:
        return net.interface_address(ifname)
    inner = store
    while inner is not None:
        address = getattr(inner, "local_address", None)
        if address:
            return address
        inner = getattr(inner, "underlying_store", None)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class _MeshSetup:
    """One rank's side of the mesh set-up (the accepting thread and the connecting one)."""

    def __init__(self, rank: int, size: int, label: str, key: bytes | None) -> None:
        self.rank, self.size, self._label, self._key = rank, size, label, key

    def connect(
        self, store: Store, generation: int, deadline: Deadline
    ) -> dict[int, socket.socket]:
        host = local_address(store)
        listener = net.listen(
            host,
            0,
            backlog=max(16, self.size),
            authenticated=self._key is not None,
            what="the tcp transport",
        )
        port = listener.getsockname()[1]
        store.set(f"tcp/{generation}/{self.rank}", f"{net.format_address(host, port)}")
        accepted: dict[int, socket.socket] = {}
        peers: dict[int, socket.socket] = {}
        accept_error: list[BaseException] = []
        acceptor = threading.Thread(
            target=self._accept_loop,
            args=(listener, generation, deadline, accepted, accept_error),
            name=f"distcomm-accept-{self.rank}",
            daemon=True,
        )
        acceptor.start()
        try:
            lower = {peer: f"tcp/{generation}/{peer}" for peer in range(self.rank)}
            wait_for_ranks(store, lower, deadline, self._label, hint=_HINT,
                           arrived="published their address")
            for peer in range(self.rank):
                sock = self._connect_to(store, peer, generation, deadline)
                peers[peer] = sock
            self._await_acceptor(acceptor, deadline, accepted)
            if acceptor.is_alive() or accept_error:
                missing = sorted(set(range(self.rank + 1, self.size)) - set(accepted))
                reason = f": {accept_error[0]}" if accept_error else ""
                raise DistTimeoutError(
                    f"{self._label}: rank(s) {show_ranks(missing)} did not connect "
                    f"within {deadline.seconds:.1f} s{reason} (did every rank call "
                    "init_process_group/new_group, and can they reach this host?)"
                )
            peers.update(accepted)
        except BaseException:
            listener.close()
            acceptor.join(1.0)
            for sock in list(peers.values()) + list(accepted.values()):
                sock.close()
            raise
        finally:
            listener.close()
        return peers

    def _await_acceptor(
        self, acceptor: threading.Thread, deadline: Deadline, accepted: dict[int, socket.socket]
    ) -> None:
        """Wait for the accepting thread to finish or give up, saying after
        DISTCOMM_STALL_WARN_S (then twice as long each time) which ranks have not connected."""
        higher = self.size - self.rank - 1
        stall = StallClock(load_config().stall_warn_s)
        while acceptor.is_alive() and not deadline.expired():
            acceptor.join(deadline.slice(min(stall.until_next(), _JOIN_SLICE)))
            waited = stall.due()
            if waited is not None and acceptor.is_alive():
                missing = sorted(set(range(self.rank + 1, self.size)) - set(accepted))
                log_missing(self._label, waited, missing, higher, "connected to this rank",
                            _HINT, deadline, stall.next)

    def _connect_to(
        self, store: Store, peer: int, generation: int, deadline: Deadline
    ) -> socket.socket:
        address = store.get(f"tcp/{generation}/{peer}").decode()
        host, port = net.split_address(address)
        sock = net.connect(host, int(port), deadline, what=f"rank {peer} at {address}")
        try:
            auth.client_handshake(sock, self._key, deadline, f"rank {peer} at {address}")
            sock.sendall(_HELLO.pack(_HELLO_MAGIC, self.rank, self.size, generation))
        except (OSError, DistError) as exc:
            sock.close()
            raise DistNetworkError(f"{self._label}: connecting to rank {peer}: {exc}") from exc
        sock.settimeout(None)  # the handshake's read timeout must not outlive it
        return sock

    def _accept_loop(
        self,
        listener: socket.socket,
        generation: int,
        deadline: Deadline,
        accepted: dict[int, socket.socket],
        errors: list[BaseException],
    ) -> None:
        expected = set(range(self.rank + 1, self.size))
        try:
            while expected - set(accepted):
                left = deadline.remaining()
                if left is not None and left <= 0:
                    return
                listener.settimeout(deadline.slice(_POLL_SLICE))
                try:
                    sock, _ = listener.accept()
                except TimeoutError:
                    continue
                except OSError as exc:
                    short = net.descriptor_shortage(exc, "accept a connection from a peer")
                    if short is not None:
                        raise DistNetworkError(f"{self._label}: {short}") from exc
                    return  # the listener was closed: setup gave up
                peer = self._admit(sock, generation, deadline, expected, accepted)
                if peer is None:
                    sock.close()
                else:
                    accepted[peer] = sock
        except BaseException as exc:  # reported by the joining thread
            errors.append(exc)

    def _admit(
        self,
        sock: socket.socket,
        generation: int,
        deadline: Deadline,
        expected: set[int],
        accepted: dict[int, socket.socket],
    ) -> int | None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        net.set_keepalive(sock)
        step = Deadline(min(10.0, deadline.remaining() or 10.0))
        if not auth.server_handshake(sock, self._key, step, "a connecting rank"):
            return None
        try:
            data = net.recv_exact(sock, _HELLO.size, step, "a connecting rank")
        except DistNetworkError:
            return None
        if len(data) != _HELLO.size:
            return None
        magic, peer, size, gen = _HELLO.unpack(data)
        if magic != _HELLO_MAGIC or size != self.size or gen != generation:
            return None
        if peer not in expected or peer in accepted:
            return None
        sock.settimeout(None)
        return peer

