"""The I/O thread's reading: frames parsed from a connection's bytes, payloads landed
where their group wants them.

The I/O thread reads frames as bytes arrive (non-blocking reads into one staging buffer,
no thread per peer), asks the group's channel (`Channel.incoming`) where the payload goes
and receives it straight into that buffer: a posted receive, a buffer kept for a message
nobody has asked for yet, or nowhere (dropped). A channel that wants a moment for a
receive to be posted pauses the connection. Messages for a group this process has not
made yet are kept until it does; messages for a group it has destroyed are dropped; the
fabric's own messages (a peer's goodbye) are answered here.
"""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any

from ..protocol import BYE, Header
from .conn import _FRAME, DISCARD, FRAME_SIZE, Conn, _Sink

if TYPE_CHECKING:  # the contract a group implements, beside the fabric that calls it
    from .fabric import Channel

__all__ = ["Reading"]

#: reads the engine makes from one connection before it serves the others
_READS_PER_TURN = 16
#: the engine reads into one buffer of this size (a frame's header and small payloads in
#: one system call) and parses it at once; a payload with more than this left lands in
#: place
_STAGING = 64 * 1024
_new_header = tuple.__new__


class Reading:
    """Reading frames and delivering them to channels (a mixin of `fabric.Fabric`, run on
    its I/O thread only).

    Uses the fabric's channel tables (`_channels`, `_early`, `_closed_channels`), its
    paused connections, its staging buffer, and `_interest`, `_lost`, `control`.
    """

    closing: bool
    _channels: dict[int, Any]
    _early: dict[int, list[tuple[int, Header, bytearray]]]
    _closed_channels: set[int]
    _paused: set[Conn]
    _ended: set[int]
    _broken: set[int]
    _conns: dict[int, Conn]
    _staging: memoryview

    def _read(self, conn: Conn) -> None:
        """Read what `conn` has: into its staging buffer, parsed frame by frame, or, for
        the rest of a large payload, straight into the payload's buffer."""
        sock = conn.sock
        try:
            for _ in range(_READS_PER_TURN):
                if conn.paused is not None or conn.closed:
                    return
                sink = conn.sink
                if (
                    sink is not None
                    and sink.view is not None
                    and len(sink.view) - sink.got >= _STAGING
                ):
                    got = sock.recv_into(sink.view[sink.got :], 0, socket.MSG_DONTWAIT)
                    if not got:
                        raise EOFError
                    sink.got += got
                    if sink.got == len(sink.view):
                        conn.sink = None
                        if sink.done is not None:
                            sink.done()
                    continue
                got = sock.recv_into(self._staging, 0, socket.MSG_DONTWAIT)
                if not got:
                    raise EOFError
                self._consume(conn, self._staging, got)
                if got < _STAGING:
                    return  # drained: the next bytes come with the next event
        except BlockingIOError:
            return
        except (OSError, EOFError) as exc:
            self._lost(conn, exc)

    def _consume(self, conn: Conn, data: memoryview, end: int, pos: int = 0) -> None:
        """Parse `data[pos:end]`: frame headers, and payload bytes for their sinks."""
        while pos < end:
            sink = conn.sink
            if sink is None:
                if conn.got == 0 and end - pos >= FRAME_SIZE:
                    head = data[pos : pos + FRAME_SIZE]
                    pos += FRAME_SIZE
                else:
                    take = min(FRAME_SIZE - conn.got, end - pos)
                    conn.head[conn.got : conn.got + take] = data[pos : pos + take]
                    conn.got += take
                    pos += take
                    if conn.got < FRAME_SIZE:
                        return
                    conn.got = 0
                    head = conn.head_view
                where, nbytes = self._frame(conn, head)
                if conn.paused is not None:  # keep the rest for when it resumes
                    conn.leftover = bytes(data[pos:end])
                    return
                if where is None:
                    continue
                if where is DISCARD:
                    take = min(nbytes, end - pos)
                    pos += take
                    if take < nbytes:
                        conn.sink = _Sink(None, None, nbytes - take)
                    continue
                view, done = where
                if nbytes <= end - pos:  # all of it is here: it lands now
                    if nbytes:
                        view[:] = data[pos : pos + nbytes]
                        pos += nbytes
                    done()
                    continue
                conn.sink = sink = _Sink(view, done)
            take = min(end - pos, (sink.skip if sink.view is None else len(sink.view) - sink.got))
            if sink.view is None:
                sink.skip -= take
                done_now = not sink.skip
            else:
                sink.view[sink.got : sink.got + take] = data[pos : pos + take]
                sink.got += take
                done_now = sink.got == len(sink.view)
            pos += take
            if done_now:
                conn.sink = None
                if sink.done is not None:
                    sink.done()

    def _frame(self, conn: Conn, head: memoryview) -> tuple[Any, int]:
        """A frame's header has arrived on `conn`: where its payload goes (see
        `Channel.incoming`; a paused connection keeps it for later) and its length."""
        fields = _FRAME.unpack(head)
        cid = fields[0]
        header = _new_header(Header, fields[1:])
        nbytes = header.nbytes
        if cid == 0:
            return self._fabric_message(conn, header), nbytes
        channel = self._channels.get(cid)
        if channel is None:
            if cid in self._closed_channels or self.closing:
                return DISCARD, nbytes
            return self._keep_early(conn, cid, header), nbytes
        rank = channel.rank_of(conn.prank)
        if rank is None:
            return DISCARD, nbytes
        where = channel.incoming(rank, header, True)
        if where.__class__ is float:
            conn.paused = (channel, rank, header, time.monotonic() + where)
            self._paused.add(conn)
            self._interest(conn)
            return None, 0
        return where, nbytes

    def _expect(self, conn: Conn, where: Any, nbytes: int) -> None:
        if where is None or (not nbytes and where is DISCARD):
            return
        if where is DISCARD:
            conn.sink = _Sink(None, None, nbytes)
            return
        view, done = where
        if len(view):
            conn.sink = _Sink(view, done)
        else:
            done()

    def _retry(self, conn: Conn) -> None:
        """Ask again where a paused connection's payload goes (a receive was posted, or
        the wait is over)."""
        if conn.paused is None:
            self._paused.discard(conn)
            return
        channel, rank, header, until = conn.paused
        patient = time.monotonic() < until and channel.cid in self._channels
        where = (
            channel.incoming(rank, header, patient) if channel.cid in self._channels else DISCARD
        )
        if isinstance(where, float):
            return
        conn.paused = None
        self._paused.discard(conn)
        self._expect(conn, where, header.nbytes)
        leftover, conn.leftover = conn.leftover, b""
        if leftover:
            self._consume(conn, memoryview(leftover), len(leftover))
        self._interest(conn)

    def _keep_early(self, conn: Conn, cid: int, header: Header) -> Any:
        """Keep a message for a group this process has not made yet (it is on its way)."""
        payload = bytearray(header.nbytes)
        early = self._early.setdefault(cid, [])

        def done() -> None:
            channel = self._channels.get(cid)
            if channel is None:
                if cid not in self._closed_channels:
                    early.append((conn.prank, header, payload))
            else:  # it was made while the payload arrived: the earlier ones are delivered
                self._replay(channel, conn.prank, header, payload)

        return memoryview(payload), done

    def _replay(self, channel: Channel, prank: int, header: Header, payload: bytearray) -> None:
        rank = channel.rank_of(prank)
        if rank is None:
            return
        where = channel.incoming(rank, header, False)
        if where is None or where is DISCARD:
            return
        view, done = where
        view[:] = payload
        done()

    def _open_channel(self, channel: Channel) -> None:
        self._channels[channel.cid] = channel
        for prank, header, payload in self._early.pop(channel.cid, []):
            self._replay(channel, prank, header, payload)
        for prank in self._ended:
            rank = channel.rank_of(prank)
            if rank is not None:
                channel.peer_ended(rank)
        # a member whose connection failed before the channel opened (the group was made
        # here just after that process ended) fails the channel's waits for it only if it
        # is really gone: a member dropped and back (the same process) takes the dial
        suspects = []
        for prank in self._broken - self._ended:
            rank = channel.rank_of(prank)
            conn = self._conns.get(prank)
            if rank is not None and (conn is None or conn.closed):
                suspects.append(rank)
        if suspects:
            channel.check_peers(sorted(suspects))

    def _close_channel(self, cid: int) -> None:
        self._channels.pop(cid, None)
        self._early.pop(cid, None)
        self._closed_channels.add(cid)
        for conn in [c for c in self._paused if c.paused and c.paused[0].cid == cid]:
            self._retry(conn)

    def _channels_with(self, prank: int) -> list[tuple[Channel, int]]:
        found = []
        for channel in list(self._channels.values()):
            rank = channel.rank_of(prank)
            if rank is not None:
                found.append((channel, rank))
        return found

    def _fabric_message(self, conn: Conn, header: Header) -> Any:
        if header.kind != BYE:
            return DISCARD
        if self.closing or conn.gone:
            conn.answered.set()  # the answer to this process's goodbye (or theirs, crossed)
            conn.gone = True
            return None
        # the peer process is leaving: everything it sent is read; it waits for this answer
        conn.gone = True
        for channel, rank in self._channels_with(conn.prank):
            channel.peer_left(rank)
        self.control(conn, 0, Header(BYE))
        return None
