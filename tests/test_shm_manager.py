"""Tests of the shared-memory manager (shm/manager, client, protocol): real daemons, clients
and /dev/shm files."""

from __future__ import annotations

import os
import queue
import re
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from distcomm.multiprocessing import shm_manager
from distcomm.multiprocessing.shm import client as shm_client
from distcomm.multiprocessing.shm import protocol as shm_protocol
from distcomm.multiprocessing.shm.client import (
    ManagerClient,
    ShmManagerConnectionError,
    ShmManagerError,
    ShmManagerTimeoutError,
    start_manager,
)
from distcomm.multiprocessing.shm.protocol import ADDRESS_ENV, validate_name
from distcomm.multiprocessing.shm_manager import SegmentTable

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the shm manager needs Linux"
)

WAIT = 30.0  # generous bound for anything that should happen within a second or two
LINGER = 0.3  # short linger of the managers the tests start
SHM_DIR = "/dev/shm"
MODULE = "distcomm.multiprocessing.shm_manager"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# imported by every child script; the test passes names and commands on stdin
PRELUDE = """\
import os, sys
from distcomm.multiprocessing.shm.client import ManagerClient, ShmManagerError

def create(name, size=4096):
    fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    os.close(fd)

def say(*words):
    print(*words, flush=True)

def hear():
    return sys.stdin.readline().strip()
"""


# -- helpers --------------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_until(predicate, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def _manager_pids(starters: set[int]) -> set[int]:
    """Running managers started by one of `starters` (the pid is part of the address), so
    that managers of other test runs on the machine are left alone."""
    pids = set()
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if MODULE not in cmdline[:-1] or _gone(proc.pid):
            continue
        address = cmdline[cmdline.index(MODULE) + 1]
        match = re.fullmatch(r"distcomm-shm-(\d+)-[0-9a-f]+", address)
        if match and int(match[1]) in starters:
            pids.add(proc.pid)
    return pids


class Child:
    """A Python subprocess running PRELUDE + a script; its stdout lines arrive on a queue."""

    def __init__(self, code: str, env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
            env=env,
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.pid = self.popen.pid
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._pump_stderr, daemon=True).start()

    def _pump(self) -> None:
        for line in self.popen.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _pump_stderr(self) -> None:
        for line in self.popen.stderr:
            self._stderr.append(line)

    def expect(self, timeout: float = WAIT) -> list[str]:
        """The next line the child prints, split into words."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"child {self.pid} printed nothing in {timeout} s") from None
        if line is None:
            code = self.popen.wait(WAIT)
            raise AssertionError(f"child {self.pid} exited ({code}) early: {''.join(self._stderr)}")
        return line.split()

    def tell(self, *words: str) -> None:
        self.popen.stdin.write(" ".join(words) + "\n")
        self.popen.stdin.flush()

    def wait(self) -> int:
        try:
            code = self.popen.wait(WAIT)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            raise AssertionError(f"child {self.pid} still running after {WAIT} s") from None
        if code != 0:
            time.sleep(0.1)  # let the stderr pump finish
            raise AssertionError(f"child {self.pid} exited {code}: {''.join(self._stderr)}")
        return code

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(WAIT)


class Children:
    def __init__(self) -> None:
        self.started: list[Child] = []

    def python(
        self, code: str, address: str | None = None, env: dict[str, str] | None = None
    ) -> Child:
        """A child whose DISTCOMM_SHM_MANAGER is `address` (unset when None), with `env` added."""
        env = {k: v for k, v in os.environ.items() if k != ADDRESS_ENV} | (env or {})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
        if address is not None:
            env[ADDRESS_ENV] = address
        child = Child(code, env)
        self.started.append(child)
        return child

    def cleanup(self) -> None:
        for child in self.started:
            child.kill()


@pytest.fixture
def tag() -> str:
    """The prefix of every segment name a test creates."""
    return f"distcomm_test_{secrets.token_hex(4)}_"


@pytest.fixture(autouse=True)
def no_leaks(tag, monkeypatch):
    """No DISTCOMM_SHM_MANAGER or client leaks in; after the test, its children are killed,
    no manager it (or a child) started still runs and no /dev/shm file with its tag is left
    (both are removed and reported). Yields the test's `Children`."""
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    monkeypatch.setattr(ManagerClient, "_instance", None)
    kids = Children()
    yield kids
    kids.cleanup()
    problems = []
    client = ManagerClient._instance
    if client is not None:
        client.close()
    managers = _manager_pids({os.getpid()} | {child.pid for child in kids.started})
    if not _wait_until(lambda: all(_gone(pid) for pid in managers)):
        alive = [pid for pid in managers if not _gone(pid)]
        problems.append(f"manager(s) {alive} still running {WAIT} s after the test")
        for pid in alive:
            os.kill(pid, signal.SIGTERM)
        _wait_until(lambda: all(_gone(pid) for pid in alive))
    left = sorted(name for name in os.listdir(SHM_DIR) if name.startswith(tag))
    for name in left:
        os.unlink(os.path.join(SHM_DIR, name))
    if left:
        problems.append(f"left in {SHM_DIR}: {left}")
    assert not problems, "; ".join(problems)


@pytest.fixture
def children(no_leaks):
    """Starts child processes (`Children.python`); killed before the leak check."""
    return no_leaks


@pytest.fixture
def segments(tag):
    """Creates /dev/shm files named with the test's tag: `segments.new()`."""

    class Segments:
        count = 0

        def new(self, size: int = 4096) -> str:
            Segments.count += 1
            name = f"{tag}{Segments.count}"
            fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
            os.close(fd)
            return name

    return Segments()


@pytest.fixture
def manager():
    """A manager with a short linger; connect within 30 s (the startup timeout)."""
    return start_manager(linger=LINGER)


@pytest.fixture
def client(manager):
    """This test process's client of `manager`, closed at teardown."""
    with ManagerClient(manager.address) as conn:
        yield conn


# -- the reference table, without processes ---------------------------------------------------


def test_table_register_release():
    table = SegmentTable()
    table.register(1, "distcomm_a")
    table.register(1, "distcomm_a")
    table.register(2, "distcomm_a")
    assert table.counts("distcomm_a") == (3, 0)
    assert table.release(1, "distcomm_a") == []
    assert table.release(2, "distcomm_a") == []
    assert table.release(1, "distcomm_a") == ["distcomm_a"]
    assert table.names() == []
    with pytest.raises(LookupError):
        table.release(1, "distcomm_a")


def test_table_in_flight_outlives_its_sender():
    table = SegmentTable()
    table.register(1, "distcomm_a")
    table.register(1, "distcomm_b")
    table.send("distcomm_a")
    assert table.drop_owner(1) == ["distcomm_b"]
    assert table.counts("distcomm_a") == (0, 1)
    assert table.claim(2, "distcomm_a") is True
    assert table.counts("distcomm_a") == (1, 0)
    assert table.drop_owner(2) == ["distcomm_a"]
    assert len(table) == 0


def test_table_unknown_and_extra_claims():
    table = SegmentTable()
    with pytest.raises(LookupError):
        table.send("distcomm_a")
    with pytest.raises(LookupError):
        table.claim(1, "distcomm_a")
    table.register(1, "distcomm_a")
    assert table.claim(2, "distcomm_a") is False  # nothing in flight: still counted
    assert table.release(1, "distcomm_a") == []
    with pytest.raises(LookupError):
        table.release(1, "distcomm_a")  # 1 holds nothing now (as a forked child would)
    assert table.release(2, "distcomm_a") == ["distcomm_a"]
    table.register(3, "distcomm_b")
    table.send("distcomm_b")
    assert table.clear() == ["distcomm_b"]


# -- names and protocol -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["distcomm_", "distcomm_a.B-9_z", "distcomm_" + "x" * 191])
def test_valid_names(name):
    assert validate_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "segment",
        "/distcomm_a",
        "distcomm_a/../b",
        "distcomm_a b",
        "distcomm_a\n",
        "distcomm_\u00e4",
        "distcomm_" + "x" * 192,
    ],
)
def test_bad_names_rejected(name, client):
    with pytest.raises(ValueError):
        validate_name(name)
    for method in (client.register, client.send, client.claim, client.release):
        with pytest.raises(ValueError):
            method(name)
    assert client._stats() == {"clients": 1, "segments": 0}


def test_name_of_wrong_type_rejected(client):
    with pytest.raises(TypeError):
        client.register(b"distcomm_a")


def _raw(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(WAIT)
    sock.connect("\0" + address)
    return sock


def _ask(sock: socket.socket, line: str) -> str:
    sock.sendall(line.encode() + b"\n")
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            return reply.decode() + "<closed>"
        reply += chunk
    return reply.decode().strip()


def test_manager_rejects_bad_requests(manager):
    with _raw(manager.address) as sock:
        assert _ask(sock, "HELLO 1 123") == f"OK 1 {manager.pid}"
        assert _ask(sock, "REG ../etc/passwd").startswith("ERR segment name '../etc/passwd'")
        assert _ask(sock, "REG distcomm_" + "x" * 300).startswith("ERR segment name of 309")
        assert "not tracked" in _ask(sock, "SEND distcomm_never_registered")
        sock.sendall(b"CLAIM bad\nREL distcomm_unknown\nCLAIM distcomm_unknown\n")
        assert _ask(sock, "STAT") == "OK clients=1 segments=0"  # still served
        assert _ask(sock, "BOGUS distcomm_a") == "<closed>"
    with _raw(manager.address) as sock:
        assert _ask(sock, "REG distcomm_a") == "<closed>"  # no greeting
    with _raw(manager.address) as sock:
        reply = _ask(sock, "HELLO 99 123")
        assert reply.startswith("ERR protocol version 99")
        assert sock.recv(10) == b""


def test_client_reports_an_incompatible_or_silent_peer():
    address = f"distcomm-test-{secrets.token_hex(6)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind("\0" + address)
        listener.listen(4)
        with pytest.raises(ShmManagerTimeoutError, match=address):
            ManagerClient(address, timeout=0.3)  # connected, never answered
        peer, _ = listener.accept()
        peer.close()

        def answer_garbage():
            conn, _ = listener.accept()
            with conn:
                conn.recv(100)
                conn.sendall(b"HTTP/1.1 400 Bad Request\n")

        thread = threading.Thread(target=answer_garbage)
        thread.start()
        with pytest.raises(ShmManagerError, match="not a distcomm shared-memory manager"):
            ManagerClient(address, timeout=WAIT)
        thread.join(WAIT)
    with pytest.raises(ShmManagerConnectionError, match="no shared-memory manager listens"):
        ManagerClient(address, timeout=WAIT)


# -- one process ------------------------------------------------------------------------------


def test_register_release_unlinks(client, segments):
    name = segments.new()
    client.register(name)
    client.register(name)
    assert client._stats(name) == {"owned": 2, "in_flight": 0}
    client.release(name)
    assert client._stats(name) == {"owned": 1, "in_flight": 0}
    assert _exists(name)
    client.release(name)
    assert _wait_until(lambda: not _exists(name))
    assert client._stats() == {"clients": 1, "segments": 0}


def test_registered_before_created_is_fine(client, tag):
    name = f"{tag}never_created"
    client.register(name)  # register first, then create: a crash in between leaks nothing
    client.release(name)
    assert client._stats() == {"clients": 1, "segments": 0}


def test_close_drops_own_references_keeps_in_flight(manager, segments):
    owned, sent = segments.new(), segments.new()
    with ManagerClient(manager.address) as observer:
        sender = ManagerClient(manager.address)
        sender.register(owned)
        sender.register(sent)
        sender.send(sent)
        sender.close()
        sender.close()  # idempotent
        assert sender.closed
        with pytest.raises(ShmManagerConnectionError, match="closed"):
            sender.register(owned)
        assert _wait_until(lambda: not _exists(owned))
        assert observer._stats(sent) == {"owned": 0, "in_flight": 1}
        observer.claim(sent)
        observer.release(sent)
        assert _wait_until(lambda: not _exists(sent))


def test_threads_share_one_client(client, segments):
    names = [segments.new() for _ in range(32)]
    errors = []

    def work(chunk):
        try:
            for name in chunk:
                client.register(name)
                client.send(name)
                client.claim(name)
                client.release(name)
                client.release(name)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(names[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert not errors
    assert _wait_until(lambda: not any(_exists(name) for name in names))


def test_release_reentered_during_a_request_is_sent_after_it(client, segments, monkeypatch):
    first, second = segments.new(), segments.new()
    client.register(first)
    channel = client._channel
    real_send = channel.send
    reentered = []

    def send_and_finalize(data, deadline):
        if not reentered:  # as if a finalizer ran in the middle of register(second)
            reentered.append(True)
            client.release(first)
            with pytest.raises(ShmManagerError, match="re-entered"):
                client.register(first)
        real_send(data, deadline)

    monkeypatch.setattr(channel, "send", send_and_finalize)
    client.register(second)
    assert client._stats(second) == {"owned": 1, "in_flight": 0}
    assert _wait_until(lambda: not _exists(first))
    client.release(second)
    assert _wait_until(lambda: not _exists(second))


def test_startup_timeout_without_clients():
    started = start_manager(linger=LINGER, startup_timeout=0.3)
    assert _wait_until(lambda: _gone(started.pid))


@pytest.mark.timeout(60)
def test_sigterm_unlinks_everything_and_clients_fail_clearly(children, segments, tag, monkeypatch):
    started = start_manager(linger=60.0)  # only the signal can end it in time
    monkeypatch.setenv(ADDRESS_ENV, started.address)
    client = ManagerClient.instance()
    assert client.manager_pid == started.pid
    owned, sent, held = segments.new(), segments.new(), segments.new()
    client.register(owned)
    client.register(sent)
    client.send(sent)
    client.release(sent)  # now only in flight
    child = children.python(
        """
        client = ManagerClient.instance()
        client.register(hear())
        say("registered")
        hear()
        """,
        started.address,
    )
    child.tell(held)
    assert child.expect() == ["registered"]
    os.kill(started.pid, signal.SIGTERM)
    assert _wait_until(lambda: _gone(started.pid))
    assert not any(_exists(name) for name in (owned, sent, held))
    with pytest.raises(ShmManagerConnectionError, match="died or was killed") as info:
        client.register(f"{tag}after_death")
    assert started.address in str(info.value)
    # no second manager mid-run: instance() keeps returning the broken client
    assert ManagerClient.instance() is client
    with pytest.raises(ShmManagerConnectionError, match="no second manager"):
        client.release(owned)
    # after close(), the next instance() starts afresh and publishes the new address
    client.close()
    fresh = ManagerClient.instance()
    assert fresh.manager_pid != started.pid
    assert os.environ[ADDRESS_ENV] == fresh.address != started.address
    fresh.close()


# -- several processes --------------------------------------------------------------------------


SENDER = """
client = ManagerClient.instance()
name = hear()
create(name)
client.register(name)
client.send(name)
say("sent", client.manager_pid)
if hear() == "release":
    client.release(name)
    say("released")
    hear()
"""

RECEIVER = """
client = ManagerClient.instance()
name = hear()
client.claim(name)
stats = client._stats(name)  # same connection: the claim is counted before this answer
say("claimed", stats["owned"], stats["in_flight"])
hear()
client.release(name)
say("released")
hear()
"""


@pytest.mark.timeout(60)
def test_send_claim_release_across_processes(manager, children, client, tag):
    name = f"{tag}pair"
    sender = children.python(SENDER, manager.address)
    receiver = children.python(RECEIVER, manager.address)
    sender.tell(name)
    assert sender.expect() == ["sent", str(manager.pid)]
    receiver.tell(name)
    assert receiver.expect() == ["claimed", "2", "0"]
    sender.tell("release")
    assert sender.expect() == ["released"]
    # a release is not acknowledged: the manager may serve this client's request first
    receiver_only = {"owned": 1, "in_flight": 0}
    assert _wait_until(lambda: client._stats(name) == receiver_only), client._stats(name)
    assert _exists(name)
    receiver.tell("release")
    assert receiver.expect() == ["released"]
    assert _wait_until(lambda: not _exists(name))
    sender.tell("exit")
    receiver.tell("exit")
    sender.wait()
    receiver.wait()


@pytest.mark.timeout(60)
def test_in_flight_survives_the_senders_exit(manager, children, client, tag):
    name = f"{tag}in_flight"
    sender = children.python(SENDER, manager.address)
    sender.tell(name)
    assert sender.expect()[0] == "sent"
    sender.tell("exit")  # exits holding its reference: the manager drops it
    sender.wait()
    assert _wait_until(lambda: client._stats()["clients"] == 1)
    assert client._stats(name) == {"owned": 0, "in_flight": 1}
    assert _exists(name)
    receiver = children.python(RECEIVER, manager.address)
    receiver.tell(name)
    assert receiver.expect() == ["claimed", "1", "0"]
    assert _exists(name)
    receiver.tell("release")
    assert receiver.expect() == ["released"]
    assert _wait_until(lambda: not _exists(name))
    receiver.tell("exit")
    receiver.wait()


HOLDER = """
os.setpgid(0, int(os.environ["TEST_PGID"]))  # 0: lead a new group (Popen's process_group is 3.11+)
client = ManagerClient.instance()
say("manager", client.address, client.manager_pid)
for word in hear().split():
    kind, name = word.split("=")
    create(name)
    client.register(name)
    if kind == "sent":
        client.send(name)
        client.release(name)
say("holding")
hear()
"""


@pytest.mark.timeout(60)
def test_kill9_of_every_client_unlinks_everything(children, tag):
    # the first client starts the manager itself; both clients form one process group
    first = children.python(HOLDER, env={"TEST_PGID": "0"})
    _, address, pid = first.expect()
    manager_pid = int(pid)
    second = children.python(HOLDER, address, env={"TEST_PGID": str(first.pid)})
    assert second.expect() == ["manager", address, pid]
    names = {first: [f"{tag}a1", f"{tag}a2"], second: [f"{tag}b1", f"{tag}b2"]}
    for child, (owned, sent) in names.items():
        child.tell(f"owned={owned} sent={sent}")
        assert child.expect() == ["holding"]
    assert all(_exists(name) for pair in names.values() for name in pair)
    assert psutil.Process(manager_pid).ppid() != first.pid  # detached: nobody's child here
    os.killpg(first.pid, signal.SIGKILL)  # the whole job's process group
    for child in names:
        assert child.popen.wait(WAIT) == -signal.SIGKILL
    assert _wait_until(lambda: _gone(manager_pid))
    assert not any(_exists(name) for pair in names.values() for name in pair)


@pytest.mark.timeout(60)
def test_a_client_connecting_later_while_others_live(manager, children, tag):
    early = children.python(SENDER, manager.address)
    name = f"{tag}shared"
    early.tell(name)
    assert early.expect()[0] == "sent"
    time.sleep(3 * LINGER)  # longer than the linger: the live client keeps the manager
    assert not _gone(manager.pid)
    late = children.python(
        """
        client = ManagerClient.instance()
        name = hear()
        client.claim(name)
        own = name + "_late"
        create(own)
        client.register(own)
        stats = client._stats()
        say(client.manager_pid, stats["clients"], stats["segments"])
        hear()
        """,
        manager.address,
    )
    late.tell(name)
    assert late.expect() == [str(manager.pid), "2", "2"]
    late.tell("exit")
    late.wait()
    assert _wait_until(lambda: not _exists(name + "_late"))
    assert _exists(name)  # the early client still holds it
    early.tell("exit")
    early.wait()
    assert _wait_until(lambda: _gone(manager.pid))
    assert not _exists(name)


@pytest.mark.timeout(60)
def test_children_find_the_manager_through_the_environment(children):
    parent = children.python(
        """
        import subprocess
        client = ManagerClient.instance()
        say(client.address, client.manager_pid, os.environ["DISTCOMM_SHM_MANAGER"])
        code = ("from distcomm.multiprocessing.shm.client import ManagerClient as C; "
                "c = C.instance(); print(c.address, c.manager_pid)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, check=True)
        say(out.stdout.strip())
        """
    )
    address, pid, env_address = parent.expect()
    assert env_address == address
    assert parent.expect() == [address, pid]
    parent.wait()
    assert _wait_until(lambda: _gone(int(pid)))


@pytest.mark.timeout(60)
def test_unreachable_address_in_the_environment_starts_a_new_manager(children):
    dead = f"distcomm-shm-0-{secrets.token_hex(8)}"
    child = children.python(
        """
        client = ManagerClient.instance()
        say(client.address, os.environ["DISTCOMM_SHM_MANAGER"], client.manager_pid)
        """,
        dead,
    )
    address, env_address, pid = child.expect()
    assert address == env_address != dead
    child.wait()
    assert _wait_until(lambda: _gone(int(pid)))


@pytest.mark.timeout(60)
def test_forked_child_gets_its_own_connection(manager, children, client, tag):
    name = f"{tag}forked"
    parent = children.python(
        """
        from distcomm.multiprocessing.shm.client import ShmManagerConnectionError
        inherited = ManagerClient.instance()
        name = hear()
        create(name)
        inherited.register(name)
        to_child_r, to_child_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            os.close(to_child_w)  # so the read below ends if the parent dies
            try:
                assert inherited._sock.fileno() == -1  # closed in the child at fork
                assert ManagerClient.current() is None
                own = ManagerClient.instance()
                assert own is not inherited and own is ManagerClient.current()
                assert own.manager_pid == inherited.manager_pid
                try:
                    inherited.register(name)
                except ShmManagerConnectionError as exc:
                    assert "ManagerClient.instance()" in str(exc)
                else:
                    raise AssertionError("the parent's client worked in the child")
                own.register(name)
                say("child", own._stats()["clients"], own._stats(name)["owned"])
                os.read(to_child_r, 1)
                code = 0
            finally:
                os._exit(code)
        say("forked")
        hear()
        inherited.release(name)
        say("parent", inherited._stats(name)["owned"])
        os.write(to_child_w, b"x")
        say("exit", os.waitpid(pid, 0)[1])
        hear()
        """,
        manager.address,
    )
    parent.tell(name)
    # the parent's and the child's lines race: take both, in either order
    lines = sorted([parent.expect(), parent.expect()])
    # test client, parent, child: three connections, two references
    assert lines == [["child", "3", "2"], ["forked"]]
    parent.tell("go")
    assert parent.expect() == ["parent", "1"]  # the child's own reference keeps it
    assert parent.expect() == ["exit", "0"]
    assert _wait_until(lambda: not _exists(name))
    parent.tell("exit")
    parent.wait()


def test_command_line_errors(manager):
    with ManagerClient(manager.address):  # so that the manager exits after the test
        taken = subprocess.run(
            [sys.executable, "-m", MODULE, manager.address],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=WAIT,
        )
    assert taken.returncode == 1
    assert "cannot listen" in taken.stderr
    bad = subprocess.run(
        [sys.executable, "-m", MODULE, "x", "--linger", "-1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert bad.returncode == 2
    assert "--linger must be >= 0" in bad.stderr
    with pytest.raises(ValueError, match="linger"):
        start_manager(linger=-1)


def test_a_manager_that_cannot_start_is_reported(monkeypatch):
    monkeypatch.setattr(shm_client, "_MANAGER_MODULE", "distcomm.multiprocessing.no_such_module")
    with pytest.raises(ShmManagerError, match=r"exited before listening.*no_such_module"):
        start_manager()


def test_invalid_address_in_the_environment(monkeypatch):
    monkeypatch.setenv(ADDRESS_ENV, "x" * 200)
    with pytest.raises(ValueError, match=ADDRESS_ENV):
        ManagerClient.instance()


@pytest.mark.parametrize("module", [shm_client, shm_manager, shm_protocol])
def test_module_exports(module):
    assert set(module.__all__) <= set(dir(module))
