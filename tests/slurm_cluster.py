"""Run a real single-node Slurm cluster on loopback for tests: `SlurmCluster`, `slurm_cluster`.

The cluster is Debian's Slurm (packages munge, slurmctld, slurmd, slurm-client), started
from a fresh temporary directory that holds everything it writes: a munge key and a
munged with its own socket, pid, log and seed files; a slurm.conf with the controller on
this host at 127.0.0.1 and one node named ``localhost`` at 127.0.0.1 (the name the jobs'
node lists carry, so ranks meet on loopback), on free ports; slurmctld's state and
slurmd's spool. Nothing of the host's own Slurm or munge configuration is read or
changed. There are no cgroups and no systemd: processes are tracked through /proc
(``proctrack/linuxproc``), tasks are not bound (``task/none``), and
``SlurmdParameters=config_overrides`` lets the node claim `CPUS` CPUs whatever the machine
has, so 4 tasks run on 2 cores.

Daemons run in the foreground (``-D``, ``-F``) as children of the test process and die
with it (PR_SET_PDEATHSIG); slurmd runs under a small reaper that adopts the slurmstepd
processes and job tasks it leaves. `stop` cancels every job, stops the daemons by their
pid (SIGTERM, then SIGKILL) and removes the directory. Clients find the cluster through
`env()`, which sets SLURM_CONF. Test modules use it as::

    from tests.slurm_cluster import slurm_cluster  # noqa: F401

The fixture skips unless DISTCOMM_TEST_CLUSTERS=1 (or the variable below) asks for the
Slurm tests, which a plain `pytest` leaves to ``.ci/slurm``. It skips when a Slurm or
munge binary is missing, unless DISTCOMM_TEST_REQUIRE_SLURM=1, which turns the skip into a
failure. This module never installs anything: ``.ci/slurm`` does (apt-get install munge
slurmctld slurmd slurm-client libpmix-dev; Slurm's mpi/pmix plugin loads libpmix.so,
which only the -dev package has).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping

import pytest

from tests import processes

__all__ = ["BINARIES", "SlurmCluster", "missing_binaries", "slurm_cluster", "unavailable"]

HOST = "127.0.0.1"
#: The node's name: the step's node list names it, so ranks reach each other on loopback.
NODE = "localhost"
#: The programs the cluster needs, each from one of the Debian packages of INSTALL_HINT.
BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "sinfo", "squeue")
INSTALL_HINT = (
    "Slurm is not installed: apt-get install munge slurmctld slurmd slurm-client libpmix-dev "
    "(.ci/slurm does)"
)
#: What slurmd logs at start when its mpi/pmix plugin cannot load libpmix.so.
PMIX_LOAD_ERROR = "Couldn't load specified plugin name for mpi/pmix"
#: CPUs the node claims (SlurmdParameters=config_overrides: more than the machine has).
CPUS = 4
#: Seconds to wait for the node to be idle after starting the daemons.
START_TIMEOUT = 60.0
#: Seconds between SIGTERM and SIGKILL when stopping a daemon.
STOP_GRACE = 10.0
#: Seconds any one client command (sinfo, scontrol) may take.
CLIENT_TIMEOUT = 30.0


# Runs a daemon (argv[1:]) as a child subreaper: slurmd's slurmstepd processes, which it
# double-forks, and the job tasks they leave become this process's children instead of
# init's, so they are reaped (no zombies where init does not reap), and when the daemon
# exits (it gets this process's SIGTERM) whatever it left is killed.
_REAPER = """
import ctypes, os, signal, sys, time
import psutil

libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
daemon = os.posix_spawn(sys.argv[1], sys.argv[1:], os.environ)
alive = True


def forward(signum, frame):
    if alive:
        os.kill(daemon, signum)


signal.signal(signal.SIGTERM, forward)
status = 1
while alive:
    pid, code = os.wait()
    if pid == daemon:
        alive, status = False, os.waitstatus_to_exitcode(code)
for child in psutil.Process().children(recursive=True):
    try:
        child.kill()
    except psutil.Error:
        pass
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    try:
        if os.waitpid(-1, os.WNOHANG) == (0, 0):
            time.sleep(0.05)
    except ChildProcessError:
        break
sys.exit(status if status >= 0 else 128 - status)
"""


def missing_binaries() -> list[str]:
    """The programs of BINARIES that are not on PATH (or in /usr/sbin)."""
    return [name for name in BINARIES if _which(name) is None]


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _host_name() -> str:
    """This host's short name: slurmctld runs only where SlurmctldHost names it."""
    return socket.gethostname().split(".")[0]


class SlurmCluster:
    """munged, slurmctld and slurmd for one node on 127.0.0.1, started by the constructor.

    Args:
        cpus: CPUs the node claims.
        start_timeout: seconds to wait for the node to be idle.

    Attributes:
        directory: the temporary directory holding configuration, state and logs.
        node: the node's name, NODE.
        partition: the only partition, the default.
        version: Slurm's version, as ``sinfo --version`` prints it ("slurm 22.05.8").

    Raises:
        FileNotFoundError: a binary is missing (the message says what to install).
        RuntimeError: a daemon exited or the node was not idle in time (the message holds
            the daemons' logs).
    """

    partition = "debug"

    def __init__(self, cpus: int = CPUS, start_timeout: float = START_TIMEOUT) -> None:
        missing = missing_binaries()
        if missing:
            raise FileNotFoundError(f"{INSTALL_HINT}; missing: {', '.join(missing)}")
        self.cpus = cpus
        self.node = NODE
        self.directory = tempfile.mkdtemp(prefix="distcomm-slurm-")
        os.chmod(self.directory, 0o755)  # munged refuses group/world-writable directories
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.version = ""
        try:
            self._start(start_timeout)
        except BaseException:
            self.stop()
            raise

    # -- paths and environment ---------------------------------------------------------------

    def path(self, *parts: str) -> str:
        """A path inside the cluster's directory."""
        return os.path.join(self.directory, *parts)

    @property
    def conf(self) -> str:
        """The slurm.conf path (SLURM_CONF of `env()`)."""
        return self.path("slurm.conf")

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """An environment for Slurm clients (srun, sbatch, ...): this process's, without any
        Slurm, launcher or rendezvous variables, with SLURM_CONF set and traffic on loopback.
        """
        dropped = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "PMI_", "PMIX_", "OMPI_")
        launch = (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "DISTCOMM_USE_AGENT_STORE",
            "DISTCOMM_STORE_PREFIX",
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(dropped) and k not in launch}
        env.update(SLURM_CONF=self.conf, HYDRA_IFACE="lo", UCX_NET_DEVICES="lo")
        env.update(extra or {})
        return env

    def log_tail(self, name: str, size: int = 3000) -> str:
        """The end of a daemon's log ("munged", "slurmctld" or "slurmd")."""
        try:
            with open(self.path(f"{name}.log"), "rb") as log:
                log.seek(max(0, os.fstat(log.fileno()).st_size - size))
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    @property
    def pmix_loaded(self) -> bool:
        """Whether slurmd loaded its mpi/pmix plugin (it needs libpmix.so: libpmix-dev)."""
        try:
            with open(self.path("slurmd.log"), errors="replace") as log:
                return PMIX_LOAD_ERROR not in log.read()
        except OSError:
            return False

    def logs(self) -> str:
        """Every daemon's log tail, headed by its name, for failure messages."""
        return "".join(
            f"\n--- {name}.log ---\n{self.log_tail(name)}"
            for name in ("munged", "slurmctld", "slurmd")
        )

    # -- starting ----------------------------------------------------------------------------

    def _write_files(self) -> None:
        for sub in ("state", "spool", "tmp", "munge"):
            os.makedirs(self.path(sub), mode=0o755, exist_ok=True)
        key = self.path("munge", "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
            out.write(secrets.token_bytes(1024))
        ctld_port, slurmd_port = processes.free_ports(2, HOST)
        with open(self.path("plugstack.conf"), "w") as out:
            out.write("# no SPANK plug-ins\n")
        lines = {
            "ClusterName": "distcomm",
            "SlurmctldHost": f"{_host_name()}({HOST})",
            "SlurmctldPort": str(ctld_port),
            "SlurmdPort": str(slurmd_port),
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={self.path('munge', 'munge.socket')}",
            "StateSaveLocation": self.path("state"),
            "SlurmdSpoolDir": self.path("spool"),
            "TmpFS": self.path("tmp"),
            "SlurmctldPidFile": self.path("slurmctld.pid"),
            "SlurmdPidFile": self.path("slurmd.pid"),
            "SlurmctldLogFile": self.path("slurmctld.log"),
            "SlurmdLogFile": self.path("slurmd.log"),
            "PlugStackConfig": self.path("plugstack.conf"),
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "AccountingStorageType": "accounting_storage/none",
            "JobCompType": "jobcomp/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_CPU",
            "SchedulerType": "sched/builtin",
            "SlurmdParameters": "config_overrides",
            "MpiDefault": "none",
            "ReturnToService": "2",
            "InactiveLimit": "0",
            "KillWait": "5",
            "MinJobAge": "30",
            "SlurmctldTimeout": "30",
            "SlurmdTimeout": "60",
            "MailProg": "/bin/true",
            "SlurmctldDebug": "info",
            "SlurmdDebug": "info",
        }
        text = "".join(f"{key}={value}\n" for key, value in lines.items())
        text += (
            f"NodeName={self.node} NodeAddr={HOST} NodeHostname={self.node} CPUs={self.cpus} "
            f"State=UNKNOWN\n"
            f"PartitionName={self.partition} Nodes={self.node} Default=YES "
            f"MaxTime=INFINITE State=UP OverSubscribe=NO\n"
        )
        with open(self.conf, "w") as out:
            out.write(text)

    def _spawn(self, name: str, args: list[str], reap: bool = False) -> None:
        """Start a daemon; with `reap`, under the _REAPER (slurmd: its job processes)."""
        if reap:
            args = [sys.executable, "-c", _REAPER, *args]
        with open(self.path(f"{name}.out"), "ab") as out:
            self.processes[name] = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=self.directory,
                preexec_fn=processes.die_with_parent,
            )

    def _check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                with contextlib.suppress(OSError), open(self.path(f"{name}.out"), "rb") as out:
                    said = out.read()[-2000:].decode(errors="replace")
                raise RuntimeError(
                    f"{name} exited with status {process.returncode} while the Slurm cluster "
                    f"in {self.directory} was starting; it said:\n{said}{self.logs()}"
                )

    def _start(self, start_timeout: float) -> None:
        self._write_files()
        munge = self.path("munge")
        self._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                f"--socket={munge}/munge.socket",
                f"--key-file={munge}/munge.key",
                f"--pid-file={munge}/munged.pid",
                f"--seed-file={munge}/munged.seed",
                f"--log-file={self.path('munged.log')}",
            ],
        )
        deadline = time.monotonic() + start_timeout
        while not os.path.exists(f"{munge}/munge.socket"):
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"munged made no socket within {start_timeout:.0f} s{self.logs()}"
                )
            time.sleep(0.05)
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-c", "-f", self.conf])
        self._spawn("slurmd", [_which("slurmd"), "-D", "-f", self.conf, "-N", self.node], reap=True)
        self.version = self.client("sinfo", "--version", timeout=CLIENT_TIMEOUT).strip()
        while True:
            self._check_alive()
            state = self._node_state()
            if state in ("idle",):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Slurm node {self.node} was not idle within {start_timeout:.0f} s "
                    f"(state {state!r}){self.logs()}"
                )
            time.sleep(0.2)

    def _node_state(self) -> str:
        try:
            out = subprocess.run(
                [_which("sinfo"), "-h", "-N", "-o", "%T", "-n", self.node],
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=CLIENT_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            return "not answering"
        return out.stdout.strip() if out.returncode == 0 else f"sinfo: {out.stderr.strip()}"

    def client(self, *args: str, timeout: float = CLIENT_TIMEOUT) -> str:
        """Run a Slurm client command (`args[0]` is its name) and return its output.

        Raises:
            RuntimeError: it failed (its output is in the message).
            subprocess.TimeoutExpired: it took longer than `timeout` seconds.
        """
        out = subprocess.run(
            [_which(args[0]) or args[0], *args[1:]],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if out.returncode != 0:
            raise RuntimeError(
                f"{' '.join(args)} exited with status {out.returncode}:\n{out.stdout}{out.stderr}"
            )
        return out.stdout

    # -- stopping ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel every job and wait (a while) for them to end, stop the daemons by pid
        (SIGTERM, then SIGKILL after a grace period; slurmd first, whose reaper then kills
        what its jobs left), remove the directory."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                self.client("scancel", "--full", "--quiet", "--user=root")
                deadline = time.monotonic() + STOP_GRACE
                while self.client("squeue", "-h", "-o", "%i").strip():
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            process = self.processes.pop(name, None)
            if process is not None:
                processes.stop(process, STOP_GRACE)
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        up = [name for name, p in self.processes.items() if p.poll() is None]
        return f"SlurmCluster({self.node!r}, {self.directory!r}, running: {up})"


def unavailable(message: str) -> None:
    """Skip the calling test because `message` (what is missing), or fail it when
    DISTCOMM_TEST_REQUIRE_SLURM=1 (a machine that must run the Slurm tests)."""
    if os.environ.get("DISTCOMM_TEST_REQUIRE_SLURM") == "1":
        pytest.fail(f"{message} (DISTCOMM_TEST_REQUIRE_SLURM=1 requires it)")
    pytest.skip(message)


def require_slurm() -> None:
    """Skip unless DISTCOMM_TEST_CLUSTERS=1 or DISTCOMM_TEST_REQUIRE_SLURM=1 asks for the
    Slurm tests (they start daemons and run for a minute or more, so a plain `pytest` leaves
    them to ``.ci/slurm``); `unavailable` when a Slurm or munge binary is missing."""
    if (
        os.environ.get("DISTCOMM_TEST_REQUIRE_SLURM") != "1"
        and os.environ.get("DISTCOMM_TEST_CLUSTERS") != "1"
    ):
        pytest.skip(
            "the Slurm tests start a Slurm cluster and run for a minute or more: run them "
            "with .ci/slurm, or with DISTCOMM_TEST_CLUSTERS=1"
        )
    missing = missing_binaries()
    if missing:
        unavailable(f"{INSTALL_HINT}; missing: {', '.join(missing)}")


@pytest.fixture(scope="module")
def slurm_cluster():
    """A `SlurmCluster` running for the test module.

    Skips when Slurm is not installed; fails instead when DISTCOMM_TEST_REQUIRE_SLURM=1.
    """
    require_slurm()
    with SlurmCluster() as cluster:
        yield cluster
