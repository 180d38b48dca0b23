"""The etcd v3 JSON client under `EtcdStore`: endpoints, pooled requests, watch streams.

`parse_endpoint` reads an etcd client address. `EtcdClient` speaks to one etcd server:
it POSTs JSON requests to ``/v3/...`` over a small pool of keep-alive connections (each
used by one request at a time; a pooled connection the server dropped while idle is
replaced and the request sent again), follows a watch stream on a connection of its own,
and turns every failure into the store's errors: `DistNetworkError` when etcd cannot be
reached, `DistStoreTimeoutError` when it does not answer within the store timeout (+1 s),
`DistStoreError` when it refuses a request or is not etcd. Only the standard library's
`http.client` is used, over plain HTTP.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from ...deadline import FOREVER, Deadline
from ...errors import DistError, DistNetworkError, DistStoreError, DistStoreTimeoutError
from ...net import format_address, set_keepalive, split_address

__all__ = [
    "DEFAULT_PORT",
    "SAFETY_MARGIN",
    "EtcdClient",
    "b64",
    "kv_value",
    "parse_endpoint",
    "unb64",
]

#: etcd's client port, used when an endpoint gives none.
DEFAULT_PORT = 2379
#: Extra seconds a request may take beyond the store timeout before it counts as unanswered.
SAFETY_MARGIN = 1.0
#: Idle keep-alive connections kept per client; more are closed after use.
_POOL_SIZE = 8
_RESPONSE_MOST = 500  # characters of a non-JSON or error body quoted in messages


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of an etcd endpoint: "host:port", "[v6]:port" or "http://host:port".

    The port defaults to 2379, etcd's client port.

    Raises:
        TypeError: `endpoint` is not a str.
        ValueError: it is malformed, lists several endpoints, or asks for https (TLS is
            not supported).
    """
    if not isinstance(endpoint, str):
        raise TypeError(f"EtcdStore endpoint must be a str, got {type(endpoint).__name__}")
    forms = "give host:port, [ipv6]:port or http://host:port"
    text = endpoint.strip()
    scheme, sep, rest = text.partition("://")
    if sep:
        if scheme.lower() == "https":
            raise ValueError(
                f"EtcdStore endpoint {endpoint!r} uses https, but TLS is not supported: "
                "use an etcd client URL with http:// on a trusted network"
            )
        if scheme.lower() != "http":
            raise ValueError(f"EtcdStore endpoint {endpoint!r} has scheme {scheme!r}; {forms}")
        text = rest[:-1] if rest.endswith("/") else rest
    if "," in text:
        raise ValueError(f"EtcdStore takes one endpoint, got the list {endpoint!r}; {forms}")
    if "/" in text or "@" in text or not text:
        raise ValueError(f"EtcdStore endpoint {endpoint!r} is not an address; {forms}")
    try:
        host, port_text = split_address(text)
    except ValueError:
        raise ValueError(f"EtcdStore endpoint {endpoint!r} is not an address; {forms}") from None
    if ":" in host and not text.startswith("["):
        raise ValueError(
            f"EtcdStore endpoint {endpoint!r}: an IPv6 address needs brackets, as in [::1]:2379"
        )
    if not host:
        raise ValueError(f"EtcdStore endpoint {endpoint!r} names no host; {forms}")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) <= 65535:
        raise ValueError(
            f"EtcdStore endpoint {endpoint!r} has port {port_text!r}; a port is 1..65535"
        )
    return host, int(port_text)


def b64(data: bytes) -> str:
    """`data` as etcd's JSON carries bytes: base64."""
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    """The bytes of a base64 field of etcd's JSON."""
    return base64.b64decode(text, validate=True)


def kv_value(kv: dict[str, Any]) -> bytes:
    return unb64(kv.get("value", ""))


def _request_timeout(timeout: float) -> float | None:
    """The socket timeout of one request under a store timeout: None (none) for store
    timeouts beyond `FOREVER`, which sockets refuse."""
    seconds = timeout + SAFETY_MARGIN
    return None if seconds > FOREVER else seconds


class EtcdClient:
    """Requests to one etcd server over pooled keep-alive connections, and its watches.

    Safe to use from several threads. After a fork the child forgets the parent's
    connections and opens its own.

    Args:
        host: etcd's host.
        port: etcd's client port.
        where: the store it serves, as messages name it ("the EtcdStore at ...").
    """

    def __init__(self, host: str, port: int, where: str) -> None:
        self._host, self._port, self._where = host, port, where
        self._endpoint = format_address(host, port)
        self._lock = threading.Lock()  # guards the pool and the set of open watches
        self._idle: list[http.client.HTTPConnection] = []
        self._watches: set[http.client.HTTPConnection] = set()
        self._pid = os.getpid()
        self.closed = False

    @property
    def endpoint(self) -> str:
        """etcd's address as "host:port" (IPv6 hosts bracketed)."""
        return self._endpoint

    def _check_open(self, what: str) -> None:
        """Raise if closed; forget a parent's connections after a fork. The lock is held."""
        if self.closed:
            raise DistStoreError(f"{self._where} is closed; {what} is not possible")
        if os.getpid() != self._pid:  # forked: the pooled sockets are the parent's
            self._idle.clear()
            self._watches.clear()
            self._pid = os.getpid()

    def _checkout(self, what: str, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        """A connection for one request, and whether it was used before (it may be stale)."""
        with self._lock:
            self._check_open(what)
            if self._idle:
                conn = self._idle.pop()
                conn.timeout = _request_timeout(timeout)
                if conn.sock is not None:
                    conn.sock.settimeout(conn.timeout)
                return conn, True
        return http.client.HTTPConnection(self._host, self._port, _request_timeout(timeout)), False

    def _checkin(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self.closed and len(self._idle) < _POOL_SIZE and os.getpid() == self._pid:
                self._idle.append(conn)
                return
        conn.close()

    def _unreachable(self, what: str, exc: BaseException) -> DistError:
        """The error for a failed connection: DistNetworkError, or DistStoreError once closed."""
        if self.closed:
            return DistStoreError(f"{self._where} was closed during {what}")
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return DistNetworkError(
            f"cannot reach etcd at {self._endpoint} for {what}: {reason} (is etcd running "
            "and serving clients there? check the endpoint, e.g. --rdzv_endpoint)"
        )

    def _refused(self, what: str, status: int, body: bytes) -> DistStoreError:
        try:
            answer = json.loads(body)
            message = answer.get("message") or answer.get("error") or str(answer)
        except (ValueError, AttributeError):
            message = body.decode(errors="replace").strip()[:_RESPONSE_MOST]
        if "too large" in message or "larger than max" in message:
            message += " (etcd takes requests up to about 1.5 MiB: its --max-request-bytes)"
        elif status == 404:
            message += (
                f" (is {self._endpoint} an etcd >= 3.4 client port? older etcd and other "
                "servers do not serve the v3 JSON API at /v3/)"
            )
        return DistStoreError(f"etcd at {self._endpoint} refused {what}: {message} (HTTP {status})")

    def _decode(self, what: str, body: bytes) -> dict[str, Any]:
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            shown = body[:_RESPONSE_MOST].decode(errors="replace")
            raise DistStoreError(
                f"{self._endpoint} answered {what} with {shown!r}, which is not etcd's JSON "
                "(is the endpoint an etcd client port?)"
            )
        return answer

    def post(self, path: str, body: dict[str, Any], what: str, timeout: float) -> dict[str, Any]:
        """POST one JSON request to `/v3/<path>` and return the decoded answer.

        `timeout` is the store's: a request unanswered for it (+1 s) fails.

        A request on a pooled connection that fails before any answer arrives (reset,
        broken pipe, closed without a response) is sent again on a fresh connection: the
        usual cause is a connection the server, or a server since restarted, dropped while
        it was idle, which never saw the request.

        Raises:
            DistNetworkError: etcd cannot be reached.
            DistStoreTimeoutError: no answer within the store timeout (+1 s).
            DistStoreError: etcd refused the request, or this store is closed.
        """
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        while True:
            conn, reused = self._checkout(what, timeout)
            try:
                conn.request("POST", f"/v3/{path}", data, headers)
                response = conn.getresponse()
                answer = response.read()
            except TimeoutError as exc:
                connected = conn.sock is not None
                conn.close()
                if not connected or self.closed:
                    raise self._unreachable(what, exc) from exc
                raise DistStoreTimeoutError(
                    f"etcd at {self._endpoint} did not answer {what} within "
                    f"{timeout + SAFETY_MARGIN:.1f} s (is the server overloaded or stopped?)"
                ) from exc
            except (http.client.HTTPException, OSError) as exc:
                conn.close()
                if reused and isinstance(
                    exc, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)
                ):
                    continue  # the server dropped the idle connection: try a fresh one
                raise self._unreachable(what, exc) from exc
            if response.will_close:
                conn.close()
            else:
                self._checkin(conn)
            if response.status != 200:
                raise self._refused(what, response.status, answer)
            return self._decode(what, answer)

    def follow(
        self,
        low: bytes,
        end: bytes,
        start: int,
        deadline: Deadline,
        what: str,
        on_event: Callable[[dict[str, Any], bool], bool | None],
        timeout: float,
    ) -> bool:
        """Watch the keys in [low, end) from revision `start`, calling
        `on_event(kv, deleted)` for each change, until it returns True (then True) or None,
        the deadline passes or etcd compacted `start` away (then False); `timeout` (the
        store's, +1 s) bounds opening the stream."""
        create: dict[str, Any] = {"key": b64(low), "start_revision": start, "range_end": b64(end)}
        body = json.dumps({"create_request": create}).encode()
        # not a pooled connection: the stream holds it until the watch ends
        conn = http.client.HTTPConnection(self._host, self._port, _request_timeout(timeout))
        with self._lock:
            self._check_open(what)
            self._watches.add(conn)
        sock: socket.socket | None = None  # set once the stream is open
        try:
            conn.request("POST", "/v3/watch", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise self._refused(what, response.status, response.read())
            sock = conn.sock
            if sock is None or self.closed:  # closed before close() could see the socket
                raise self._unreachable(what, ConnectionResetError("connection closed"))
            set_keepalive(sock)  # a vanished server host breaks the stream in ~25 s
            while True:
                left = deadline.remaining()
                if left is not None and left <= 0:
                    return False
                sock.settimeout(left)  # None (no deadline) or > 0
                line = response.readline()
                if not line.endswith(b"\n"):  # every message ends with one; none: cut off
                    raise self._unreachable(
                        what, ConnectionResetError("etcd closed the watch stream")
                    )
                if not line.strip():
                    continue
                result = self._decode(what, line)
                if "error" in result:
                    error = result["error"]
                    message = error.get("message", error) if isinstance(error, dict) else error
                    raise DistStoreError(
                        f"etcd at {self._endpoint} ended the watch for {what}: {message}"
                    )
                result = result.get("result", {})
                if result.get("canceled"):
                    if int(result.get("compact_revision", 0)):
                        return False
                    reason = result.get("cancel_reason") or "no reason given"
                    raise DistStoreError(
                        f"etcd at {self._endpoint} canceled the watch for {what}: {reason}"
                    )
                for event in result.get("events", ()):
                    done = on_event(event.get("kv", {}), event.get("type") == "DELETE")
                    if done is None:
                        return False
                    if done:
                        return True
        except TimeoutError as exc:
            if sock is not None:
                return False  # the stream's read waited out the deadline
            if conn.sock is None or self.closed:
                raise self._unreachable(what, exc) from exc
            raise DistStoreTimeoutError(
                f"etcd at {self._endpoint} did not open the watch for {what} within "
                f"{timeout + SAFETY_MARGIN:.1f} s (is the server overloaded or stopped?)"
            ) from exc
        except (http.client.HTTPException, OSError, binascii.Error) as exc:
            raise self._unreachable(what, exc) from exc
        finally:
            with self._lock:
                self._watches.discard(conn)
            conn.close()

    def close(self) -> None:
        """Close the pooled connections and end the open watches (idempotent).

        Requests and watches in other threads fail with `DistStoreError`.
        """
        with self._lock:
            if self.closed:
                return
            self.closed = True
            idle, self._idle = self._idle, []
            watches = list(self._watches) if os.getpid() == self._pid else []
        for conn in idle:
            conn.close()
        for conn in watches:  # wake the threads reading them
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
