"""Simulated hosts for multi-node tests: network namespaces joined by a bridge.

A `Cluster` of N hosts is N + 1 network namespaces: a "switch" holding a bridge, and one
namespace per host, each with its loopback up and one interface, `eth0`, whose veth peer
is a port of the bridge. Addresses come from a /24 of 10.213.0.0/16 that no route of
this machine uses: host i is `.i+1`, the switch's bridge `.254` (where infrastructure such
as an etcd server runs). They exist only inside those namespaces: nothing created here
can reach this machine's own interfaces or beyond, and no route leads out of them.

Every command a host runs gets a UTS namespace of its own with the host's name (which no
/etc/hosts entry or DNS server resolves, as on a cluster whose nodes only know each
other's addresses). Namespace names carry the test process's pid and a counter, so
clusters of parallel tests never meet, after a prefix (DISTCOMM_TEST_NETNS_PREFIX,
default "dc"): "dc4242x0-h1" is host 1 of process 4242's first cluster. `Cluster.close`
(also on leaving the `with` block) kills every process inside the cluster's namespaces,
whoever started it, waits for them, and deletes the namespaces, which removes the veth
pairs and the addresses.

`unavailable()` says why clusters cannot be made here (not root, no `ip netns`);
`require()` turns that into a skip, or a failure when DISTCOMM_TEST_REQUIRE_NETNS=1.

Link faults: `Host.link_down`/`link_up` take the host's switch port down and up (a
pulled cable: packets are dropped, the host's interface loses its carrier).
`Host.impair(delay_ms, loss_percent)` slows its outgoing packets with `tc netem` where
the kernel has netem; elsewhere with an NFQUEUE rule (iptables) and `delayer`, a small
netfilter-queue client of this module that holds each packet for the delay and drops
the given share (`python -m tests.netns delay QUEUE DELAY_MS LOSS_PERCENT STATS_FILE`);
`Host.impairment_stats` says how many packets it delayed and dropped.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import ipaddress
import itertools
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

__all__ = [
    "Cluster",
    "Host",
    "ImpairmentUnavailable",
    "delayer",
    "require",
    "unavailable",
]

#: the private range the clusters' subnets come from
SUPERNET = ipaddress.ip_network("10.213.0.0/16")
#: seconds a command of the harness itself (ip, tc, iptables) may take
COMMAND_TIMEOUT = 30.0
#: seconds processes get after SIGKILL to be gone before close() reports them
KILL_TIMEOUT = 10.0
REQUIRE_VARIABLE = "DISTCOMM_TEST_REQUIRE_NETNS"
#: set to 1 to run the multi-host tests at all (they are not part of a plain `pytest`)
OPT_IN_VARIABLE = "DISTCOMM_TEST_CLUSTERS"
#: names the clusters' namespaces begin with (default "dc"), then the pid and a counter
PREFIX_VARIABLE = "DISTCOMM_TEST_NETNS_PREFIX"

_counter = itertools.count()


class ImpairmentUnavailable(RuntimeError):
    """Neither netem nor the NFQUEUE fallback can slow a link on this machine."""


def _run(
    args: Sequence[str], timeout: float = COMMAND_TIMEOUT, check: bool = True
) -> subprocess.CompletedProcess:
    """Run a harness command; a failure raises RuntimeError with its output."""
    result = subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(args)} failed ({result.returncode}): "
            f"{(result.stderr or result.stdout).strip()}"
        )
    return result


def unavailable() -> str | None:
    """Why network-namespace clusters cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 util-linux)"
    probe = f"dcprobe{os.getpid()}"
    try:
        made = _run(["ip", "netns", "add", probe], check=False)
        if made.returncode != 0:
            return f"ip netns add fails: {made.stderr.strip()}"
        veth = _run(
            ["ip", "-n", probe, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb"],
            check=False,
        )
        if veth.returncode != 0:
            return f"no veth pairs: {veth.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def require() -> None:
    """Skip the calling test (or module) unless DISTCOMM_TEST_CLUSTERS=1 or
    DISTCOMM_TEST_REQUIRE_NETNS=1 asks for it, or when clusters cannot be made; fail instead
    when DISTCOMM_TEST_REQUIRE_NETNS=1 (a machine that must run these tests)."""
    import pytest

    required = os.environ.get(REQUIRE_VARIABLE) == "1"
    if not required and os.environ.get(OPT_IN_VARIABLE) != "1":
        pytest.skip(
            "the multi-host tests make network namespaces and run for minutes: run them "
            f"with .ci/hosts, or with {OPT_IN_VARIABLE}=1",
            allow_module_level=True,
        )
    reason = unavailable()
    if reason is None:
        return
    if required:
        pytest.fail(
            f"{reason} ({REQUIRE_VARIABLE}=1 requires network-namespace hosts)", pytrace=False
        )
    pytest.skip(reason, allow_module_level=True)


def _used_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of this machine's routes and addresses (the root namespace)."""
    used = []
    for line in _run(["ip", "-4", "route", "show", "table", "all"]).stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        if word in ("broadcast", "local", "unicast", "multicast"):
            word = line.split()[1]
        with contextlib.suppress(ValueError):
            used.append(ipaddress.ip_network(word, strict=False))
    for line in _run(["ip", "-4", "-o", "addr", "show"]).stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            with contextlib.suppress(ValueError, IndexError):
                used.append(ipaddress.ip_network(parts[parts.index("inet") + 1], strict=False))
    return used


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of SUPERNET that overlaps no route or address of this machine."""
    used = [n for n in _used_networks() if n.prefixlen > 0]  # the default route is not a use
    subnets = list(SUPERNET.subnets(new_prefix=24))
    start = (os.getpid() * 7 + next(_counter)) % len(subnets)
    for subnet in subnets[start:] + subnets[:start]:
        if not any(subnet.overlaps(n) for n in used):
            return subnet
    raise RuntimeError(f"every /24 of {SUPERNET} overlaps a route of this machine")


class Host:
    """One simulated host: a network namespace with one interface on the cluster's switch.

    Attributes:
        index: its position in the cluster (0-based).
        hostname: the name its processes see (gethostname); it resolves nowhere.
        netns: the network namespace's name (`ip netns`).
        address: its IPv4 address on the switch.
    """

    def __init__(self, cluster: Cluster, index: int, address: str) -> None:
        self.cluster, self.index, self.address = cluster, index, address
        self.hostname = f"node{index}-{cluster.tag}"
        self.netns = f"{cluster.tag}-h{index}"
        self.port = f"p{index}"  # its port on the switch
        self._delayer: subprocess.Popen | None = None
        self._stats = os.path.join(cluster.workdir, f"delayer-{index}.json")

    def command(self, args: Sequence[str]) -> list[str]:
        """`args` wrapped to run in this host's network namespace under its host name."""
        return [
            "ip",
            "netns",
            "exec",
            self.netns,
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.hostname,
            *args,
        ]

    def popen(self, args: Sequence[str], **popen: Any) -> subprocess.Popen:
        """Start `args` on this host (in a session of its own; `popen`: Popen's keyword
        arguments); the cluster kills it at the latest when it closes. The process keeps
        the pid Popen reports (each wrapper execs the next), so a signal sent to it reaches
        the program itself."""
        popen.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(self.command(args), start_new_session=True, **popen)
        self.cluster.processes.append(proc)
        return proc

    def run(
        self, args: Sequence[str], timeout: float = COMMAND_TIMEOUT, check: bool = True
    ) -> subprocess.CompletedProcess:
        """Run `args` on this host to the end (killed after `timeout`); its output."""
        return _run(self.command(args), timeout=timeout, check=check)

    def ip(self, *args: str) -> subprocess.CompletedProcess:
        return _run(["ip", "-n", self.netns, *args])

    def link_down(self) -> None:
        """Take this host's switch port down: its packets are lost until `link_up`."""
        _run(["ip", "-n", self.cluster.switch, "link", "set", self.port, "down"])

    def link_up(self) -> None:
        _run(["ip", "-n", self.cluster.switch, "link", "set", self.port, "up"])

    def impair(self, delay_ms: float, loss_percent: float) -> str:
        """Delay every packet this host sends by `delay_ms` and drop `loss_percent` of them.

        Returns how: "netem", or "nfqueue" (an iptables NFQUEUE rule and `delayer`).

        Raises:
            ImpairmentUnavailable: neither works here; the message says why.
        """
        netem = _run(
            [
                "ip",
                "netns",
                "exec",
                self.netns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                "eth0",
                "root",
                "netem",
                "delay",
                f"{delay_ms}ms",
                "loss",
                f"{loss_percent}%",
            ],
            check=False,
        )
        if netem.returncode == 0:
            return "netem"
        why_netem = (netem.stderr or netem.stdout).strip()
        if shutil.which("iptables") is None:
            raise ImpairmentUnavailable(
                f"tc netem: {why_netem}; and iptables (for the NFQUEUE fallback) is not installed"
            )
        queue = 1 + self.index
        rule = [
            "-t",
            "mangle",
            "-A",
            "POSTROUTING",
            "-o",
            "eth0",
            "-j",
            "NFQUEUE",
            "--queue-num",
            str(queue),
        ]
        added = _run(["ip", "netns", "exec", self.netns, "iptables", *rule], check=False)
        if added.returncode != 0:
            raise ImpairmentUnavailable(
                f"tc netem: {why_netem}; iptables NFQUEUE: {added.stderr.strip()}"
            )
        self._delayer = self.popen(
            [
                sys.executable,
                "-m",
                "tests.netns",
                "delay",
                str(queue),
                str(delay_ms),
                str(loss_percent),
                self._stats,
            ],
            cwd=str(Path(__file__).resolve().parent.parent),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        pipe = self._delayer.stdout
        assert pipe is not None
        ready = pipe.readline() if select.select([pipe], [], [], COMMAND_TIMEOUT)[0] else ""
        if not ready.startswith("ready"):
            self._delayer.kill()
            rest, _ = self._delayer.communicate(timeout=KILL_TIMEOUT)
            raise ImpairmentUnavailable(
                f"tc netem: {why_netem}; the NFQUEUE delayer did not start: "
                f"{(ready + rest).strip() or 'no answer'}"
            )
        return "nfqueue"

    def impairment_stats(self) -> dict[str, int]:
        """{"packets": N, "dropped": M}: what `impair` has handled so far (netem's counters,
        or the delayer's, which lag up to a second)."""
        if self._delayer is not None:
            try:
                with open(self._stats) as f:
                    return json.load(f)
            except (OSError, ValueError):
                return {"packets": 0, "dropped": 0}
        shown = _run(
            ["ip", "netns", "exec", self.netns, "tc", "-s", "qdisc", "show", "dev", "eth0"]
        ).stdout
        match = re.search(r"Sent \d+ bytes (\d+) pkt \(dropped (\d+)", shown)
        if match is None:
            return {"packets": 0, "dropped": 0}
        return {"packets": int(match[1]) + int(match[2]), "dropped": int(match[2])}

    def __repr__(self) -> str:
        return f"Host({self.hostname!r}, {self.address})"


class Cluster:
    """N simulated hosts on one switch; a context manager that removes everything it made.

    Args:
        hosts: how many hosts.

    Attributes:
        hosts: the `Host`s.
        switch: the switch's namespace; `switch_address` is its bridge's address.
        processes: everything started with `Host.popen`/`Cluster.popen_switch`.
        workdir: a temporary directory for the harness's own files (removed by `close`).
    """

    def __init__(self, hosts: int) -> None:
        prefix = os.environ.get(PREFIX_VARIABLE, "dc")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,15}", prefix):
            raise ValueError(
                f"{PREFIX_VARIABLE}={prefix!r}: use 1 to 16 lowercase letters and digits, "
                "starting with a letter (it begins namespace and host names)"
            )
        self.tag = f"{prefix}{os.getpid()}x{next(_counter)}"
        self.subnet = _free_subnet()
        addresses = list(self.subnet.hosts())
        self.switch = f"{self.tag}-sw"
        self.switch_address = str(addresses[253])
        self.workdir = tempfile.mkdtemp(prefix=f"{self.tag}-")  # the harness's own files
        self.hosts = [Host(self, i, str(addresses[i])) for i in range(hosts)]
        self.processes: list[subprocess.Popen] = []
        self._made: list[str] = []
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        prefix = self.subnet.prefixlen
        _run(["ip", "netns", "add", self.switch])
        self._made.append(self.switch)
        sw = ["ip", "-n", self.switch]
        _run([*sw, "link", "set", "lo", "up"])
        _run([*sw, "link", "add", "br0", "type", "bridge"])
        _run([*sw, "addr", "add", f"{self.switch_address}/{prefix}", "dev", "br0"])
        _run([*sw, "link", "set", "br0", "up"])
        for host in self.hosts:
            _run(["ip", "netns", "add", host.netns])
            self._made.append(host.netns)
            _run(
                [
                    "ip",
                    "link",
                    "add",
                    "eth0",
                    "netns",
                    host.netns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    host.port,
                    "netns",
                    self.switch,
                ]
            )
            _run([*sw, "link", "set", host.port, "master", "br0"])
            _run([*sw, "link", "set", host.port, "up"])
            host.ip("link", "set", "lo", "up")
            host.ip("addr", "add", f"{host.address}/{prefix}", "dev", "eth0")
            host.ip("link", "set", "eth0", "up")
        self._wait_reachable()

    def _wait_reachable(self, timeout: float = 20.0) -> None:
        """Wait until every host reaches the switch from its own address (interfaces up,
        the bridge forwarding), by connecting to a closed port there."""
        end = time.monotonic() + timeout
        for host in self.hosts:
            while True:
                done = host.run(
                    [sys.executable, "-c", _REACH_PROBE, self.switch_address, host.address],
                    check=False,
                )
                if done.returncode == 0:
                    break
                if time.monotonic() > end:
                    raise RuntimeError(
                        f"{host} cannot reach the switch at "
                        f"{self.switch_address}: {done.stderr.strip()}"
                    )
                time.sleep(0.2)

    def popen_switch(self, args: Sequence[str], **popen: Any) -> subprocess.Popen:
        """Start `args` in the switch's namespace (reachable at `switch_address`)."""
        popen.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.switch, *args], start_new_session=True, **popen
        )
        self.processes.append(proc)
        return proc

    def pids(self) -> list[int]:
        """The processes running in the cluster's namespaces, whoever started them."""
        found: set[int] = set()
        for name in self._made:
            result = _run(["ip", "netns", "pids", name], check=False)
            found.update(int(p) for p in result.stdout.split() if p.isdigit())
        return sorted(found)

    def kill_all(self) -> list[int]:
        """SIGKILL every process of the cluster and wait for them; those still there."""
        for proc in self.processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        victims = []
        for pid in self.pids():
            with contextlib.suppress(psutil.Error):
                victim = psutil.Process(pid)
                victim.kill()
                victims.append(victim)
        _, alive = psutil.wait_procs(victims, timeout=KILL_TIMEOUT)
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(KILL_TIMEOUT)
        return [p.pid for p in alive]

    def close(self) -> None:
        """Kill every process in the namespaces, then delete them; idempotent.

        Raises:
            RuntimeError: something could not be removed (named in the message).
        """
        problems = []
        if self._made:
            left = self.kill_all()
            if left:
                problems.append(f"processes {left} survived SIGKILL")
        for name in reversed(self._made):
            deleted = _run(["ip", "netns", "del", name], check=False)
            if deleted.returncode != 0:
                problems.append(f"ip netns del {name}: {deleted.stderr.strip()}")
        self._made.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)
        if problems:
            raise RuntimeError(f"cluster {self.tag}: " + "; ".join(problems))

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Cluster({self.tag!r}, {self.subnet}, hosts={self.hosts})"


#: from a host, connect to a closed port of the switch: a refusal proves the path works
#: (argv: the switch's address, the host's own address to connect from)
_REACH_PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=2, source_address=(sys.argv[2], 0))
except ConnectionRefusedError:
    sys.exit(0)
except OSError as exc:
    sys.exit(f"{exc}")
sys.exit("port 9 of the switch accepted a connection")
"""


# -- the NFQUEUE delayer ---------------------------------------------------------------------

_NETLINK_NETFILTER = 12
_NFNL_SUBSYS_QUEUE = 3
_NFQNL_MSG_PACKET, _NFQNL_MSG_VERDICT, _NFQNL_MSG_CONFIG = 0, 1, 2
_NFQA_CFG_CMD, _NFQA_CFG_PARAMS = 1, 2
_NFQA_PACKET_HDR = 1
_NFQA_VERDICT_HDR = 2
_NFQNL_CFG_CMD_BIND = 1
_NFQNL_COPY_META = 1
_NF_DROP, _NF_ACCEPT = 0, 1
_NLM_F_REQUEST, _NLM_F_ACK = 1, 4
_NLMSG_ERROR = 2
_NLMSG = struct.Struct("=IHHII")
_NFGEN = struct.Struct("=BBH")  # family, version, queue number (big-endian, packed by hand)


def _attr(kind: int, payload: bytes) -> bytes:
    head = struct.pack("=HH", 4 + len(payload), kind)
    return head + payload + b"\0" * (-len(payload) % 4)


def _message(kind: int, queue: int, attrs: bytes, seq: int, flags: int = 0) -> bytes:
    body = _NFGEN.pack(socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return (
        _NLMSG.pack(
            _NLMSG.size + len(body),
            (_NFNL_SUBSYS_QUEUE << 8) | kind,
            _NLM_F_REQUEST | flags,
            seq,
            0,
        )
        + body
    )


def _packet_ids(data: bytes) -> Iterator[int]:
    """The packet ids of the NFQNL_MSG_PACKET messages in one netlink read."""
    at = 0
    while at + _NLMSG.size <= len(data):
        length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(data, at)
        if length < _NLMSG.size:
            return
        if kind == _NLMSG_ERROR:
            code = struct.unpack_from("=i", data, at + _NLMSG.size)[0]
            if code:
                raise OSError(-code, f"netfilter queue: {os.strerror(-code)}")
        elif kind == (_NFNL_SUBSYS_QUEUE << 8) | _NFQNL_MSG_PACKET:
            pos, end = at + _NLMSG.size + _NFGEN.size, at + length
            while pos + 4 <= end:
                size, attr = struct.unpack_from("=HH", data, pos)
                if size < 4:
                    break
                if attr & 0x7FFF == _NFQA_PACKET_HDR:
                    yield struct.unpack_from("!I", data, pos + 4)[0]
                pos += (size + 3) & ~3
        at += (length + 3) & ~3


def delayer(queue: int, delay_ms: float, loss_percent: float, stats: str) -> None:
    """Serve netfilter queue `queue`: accept each packet `delay_ms` after it arrived, in
    order, or drop it with probability `loss_percent`/100. Prints "ready" once bound, keeps
    {"packets": N, "dropped": M} in the file `stats` (rewritten once a second) and runs
    until killed."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER)
    sock.bind((0, 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    seq = itertools.count(1)
    bind = _attr(_NFQA_CFG_CMD, struct.pack("!BxH", _NFQNL_CFG_CMD_BIND, socket.AF_INET))
    params = _attr(_NFQA_CFG_PARAMS, struct.pack("!IB", 0, _NFQNL_COPY_META))
    for attrs in (bind, params):
        sock.send(_message(_NFQNL_MSG_CONFIG, queue, attrs, next(seq), _NLM_F_ACK))
        list(_packet_ids(sock.recv(65536)))  # the acknowledgement: raises on an error
    print("ready", flush=True)
    held: collections.deque[tuple[float, int]] = collections.deque()
    delay, loss = delay_ms / 1000.0, loss_percent / 100.0
    counts = {"packets": 0, "dropped": 0}
    written = 0.0
    while True:
        now = time.monotonic()
        if now - written >= 1.0:
            with open(stats + ".tmp", "w") as f:
                json.dump(counts, f)
            os.replace(stats + ".tmp", stats)
            written = now
        wait = min(1.0, max(0.0, held[0][0] - now)) if held else 1.0
        sock.settimeout(wait)
        try:
            data = sock.recv(1 << 20)
        except (TimeoutError, BlockingIOError):  # a timeout of 0 (a packet due already)
            data = b""  # makes the socket non-blocking: nothing to read is no error
        except OSError as exc:  # ENOBUFS: messages lost; their packets wait for the kernel
            if exc.errno != errno.ENOBUFS:
                raise
            data = b""
        now = time.monotonic()
        for packet in _packet_ids(data):
            held.append((now + delay, packet))
            counts["packets"] += 1
        while held and held[0][0] <= time.monotonic():
            _, packet = held.popleft()
            verdict = _NF_DROP if random.random() < loss else _NF_ACCEPT
            counts["dropped"] += verdict == _NF_DROP
            sock.send(
                _message(
                    _NFQNL_MSG_VERDICT,
                    queue,
                    _attr(_NFQA_VERDICT_HDR, struct.pack("!II", verdict, packet)),
                    next(seq),
                )
            )


def main(argv: list[str]) -> int:
    if len(argv) == 5 and argv[0] == "delay":
        delayer(int(argv[1]), float(argv[2]), float(argv[3]), argv[4])
        return 0
    print(
        "usage: python -m tests.netns delay QUEUE DELAY_MS LOSS_PERCENT STATS_FILE", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main(sys.argv[1:]))
