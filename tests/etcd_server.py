"""Run a real single-member etcd on loopback for tests: `EtcdServer`, `etcd_endpoint`.

The server listens on free ports of 127.0.0.1 only, keeps its data in a fresh temporary
directory, and is stopped (SIGTERM, then SIGKILL) and its directory removed afterwards.
It also dies with the process that started it (PR_SET_PDEATHSIG), so an interrupted
test run leaves no etcd behind. Test modules use it as::

    from tests.etcd_server import EtcdServer, etcd_endpoint  # noqa: F401

`etcd_endpoint` skips when the etcd binary is missing, unless DISTCOMM_TEST_REQUIRE_ETCD=1,
which turns the skip into a failure.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import tempfile
import time

import pytest

from tests import processes

__all__ = ["EtcdServer", "etcd_binary", "etcd_endpoint", "find_etcd"]

HOST = "127.0.0.1"
INSTALL_HINT = "etcd not installed: apt-get install etcd-server"
#: Seconds to wait for a started etcd to report itself healthy.
START_TIMEOUT = 30.0
#: Seconds between SIGTERM and SIGKILL when stopping.
STOP_GRACE = 10.0


def find_etcd() -> str | None:
    """The path of the etcd binary on PATH, or None."""
    return shutil.which("etcd")


class EtcdServer:
    """A single-member etcd on 127.0.0.1, started by the constructor.

    Args:
        binary: the etcd executable (default: `etcd` on PATH).
        start_timeout: seconds to wait until it is healthy.

    Attributes:
        endpoint: the client address, "127.0.0.1:PORT".
        data_dir: its temporary data directory (removed by `stop`).

    Raises:
        FileNotFoundError: no etcd binary.
        RuntimeError: it did not become healthy in time (the message holds its log).
    """

    def __init__(self, binary: str | None = None, start_timeout: float = START_TIMEOUT) -> None:
        self.binary = binary or find_etcd()
        if self.binary is None:
            raise FileNotFoundError(INSTALL_HINT)
        self.process: subprocess.Popen[bytes] | None = None
        self.data_dir = tempfile.mkdtemp(prefix="distcomm-etcd-")
        self.endpoint = ""
        try:
            for attempt in range(3):  # a port taken between picking and binding: pick again
                if self._start(start_timeout) or attempt == 2:
                    break
        except BaseException:
            self.stop()
            raise

    @property
    def log_path(self) -> str:
        return os.path.join(self.data_dir, "etcd.log")

    def log_tail(self, size: int = 4000) -> str:
        """The end of the server's log."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, os.fstat(log.fileno()).st_size - size))
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def _start(self, start_timeout: float) -> bool:
        """Start etcd on fresh ports; True once healthy, False if it exited (port clash)."""
        client, peer = processes.free_ports(2, HOST)
        client_url, peer_url = f"http://{HOST}:{client}", f"http://{HOST}:{peer}"
        member_dir = os.path.join(self.data_dir, f"member-{client}")
        args = [
            self.binary,
            "--name",
            "default",
            "--data-dir",
            member_dir,
            "--listen-client-urls",
            client_url,
            "--advertise-client-urls",
            client_url,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
            "--initial-cluster",
            f"default={peer_url}",
            "--initial-cluster-state",
            "new",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=processes.die_with_parent,
            )
        self.endpoint = f"{HOST}:{client}"
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.process = None
                return False
            if self.healthy():
                return True
            time.sleep(0.05)
        raise RuntimeError(
            f"etcd at {self.endpoint} was not healthy within {start_timeout:.0f} s; "
            f"its log ends:\n{self.log_tail()}"
        )

    def healthy(self) -> bool:
        """Whether etcd answers GET /health with a leader elected."""
        host, port = self.endpoint.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=2.0)
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            return response.status == 200 and json.loads(response.read()).get("health") == "true"
        except (OSError, http.client.HTTPException, ValueError):
            return False
        finally:
            conn.close()

    def kill(self) -> None:
        """SIGKILL the server (a crash) and reap it; `stop` still removes its data."""
        process = self.process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(STOP_GRACE)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after a grace period), remove its data."""
        process, self.process = self.process, None
        if process is not None:
            processes.stop(process, STOP_GRACE)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.process is not None and self.process.poll() is None else "down"
        return f"EtcdServer({self.endpoint!r}, {state})"


def etcd_binary() -> str:
    """The etcd binary; skips the calling test when there is none, or fails it when
    DISTCOMM_TEST_REQUIRE_ETCD=1 (a machine that must run the etcd tests)."""
    binary = find_etcd()
    if binary is None:
        if os.environ.get("DISTCOMM_TEST_REQUIRE_ETCD") == "1":
            pytest.fail(f"{INSTALL_HINT} (DISTCOMM_TEST_REQUIRE_ETCD=1 requires it)")
        pytest.skip(INSTALL_HINT)
    return binary


@pytest.fixture(scope="module")
def etcd_endpoint():
    """The "127.0.0.1:PORT" of an etcd running for the test module.

    Skips when etcd is not installed; fails instead when DISTCOMM_TEST_REQUIRE_ETCD=1.
    """
    with EtcdServer(etcd_binary()) as server:
        yield server.endpoint
