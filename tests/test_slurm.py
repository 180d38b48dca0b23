"""distcomm under a real Slurm: srun, sbatch and scancel against a one-node cluster.

The cluster (tests/slurm_cluster.py) runs Debian's Slurm on loopback; its node claims 4
CPUs on however many the machine has. Each case starts real jobs and judges what they
print and how they end:

- ``srun --mpi=pmix`` with the gloo and tcp backends: rank, size and store come from
  Slurm, and MPI is never initialised (pip's MPICH speaks no PMIx: MPI_Init would kill the
  task);
- plain ``srun`` with the mpi backend fails, naming ``srun --mpi=pmi2``; with
  ``--mpi=pmi2`` it forms one world;
- the quickstart under plain ``srun -n 4`` is one job of 4 ranks, not 4 jobs;
- two ``srun --mpi=pmi2`` steps of one job rendezvous at the same time on their own ports;
- ``scancel --signal=USR1 --batch`` reaches distcomm-run, which passes it on to its
  workers (a job checkpoints before it is pre-empted);
- one distcomm-run per node started by srun in a batch job (the c10d rendezvous).

Every job carries this module's job name; after each test the cases's jobs are cancelled
and waited for, so the next one starts on an empty node.
"""

from __future__ import annotations

import re
import shlex
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tests.slurm_cluster import (  # noqa: F401 - slurm_cluster is a fixture
    CLIENT_TIMEOUT,
    INSTALL_HINT,
    SlurmCluster,
    slurm_cluster,
    unavailable,
)

#: Every job of this module runs under this name, so cleanup cancels exactly them.
JOB_NAME = f"distcomm-test-{uuid.uuid4().hex[:8]}"
#: Seconds one srun or one batch job may take.
JOB_TIMEOUT = 120.0
PYTHON = sys.executable

# A rank that reports what it became: init_process_group(BACKEND) with no arguments, an
# all_reduce of rank + 1, and whether mpi4py's MPI (MPI_Init) was loaded along the way.
# Results are written with one write() each: ranks share the output file, and print()
# writes a line and its newline apart when the output is unbuffered.
RANK_SCRIPT = """
import os, sys
import numpy as np
import distcomm as dist
from distcomm.rendezvous import detect_environment

backend = sys.argv[1]
dist.init_process_group(backend, timeout=60)
rank, size = dist.get_rank(), dist.get_world_size()
total = np.array([rank + 1.0])
dist.all_reduce(total)
port = detect_environment().master_port
os.write(1, f"RESULT step={os.environ.get('SLURM_STEP_ID')} rank={rank} size={size} "
            f"sum={total[0]:g} backend={dist.get_backend()} port={port} "
            f"mpi={'mpi4py.MPI' in sys.modules}\\n".encode())
dist.destroy_process_group()
"""

# Waits until `count` tasks (of any step) have arrived in the directory argv[2], then runs
# RANK_SCRIPT: the steps of one job then rendezvous at the same time. argv[4] "hidden"
# makes mpi4py unimportable, as where it is not installed.
MEET_SCRIPT = (
    """
import os, sys, time
from pathlib import Path

if sys.argv[4] == "hidden":
    sys.modules["mpi4py"] = None
here, count = Path(sys.argv[2]), int(sys.argv[3])
(here / f"step{os.environ['SLURM_STEP_ID']}-task{os.environ['SLURM_PROCID']}").touch()
deadline = time.monotonic() + 60
while len(list(here.glob("step*-task*"))) < count:
    if time.monotonic() > deadline:
        sys.exit(f"only {len(list(here.glob('step*-task*')))} of {count} tasks arrived")
    time.sleep(0.05)
"""
    + RANK_SCRIPT
)

# A distcomm-run worker that joins the group, says it is ready, waits for SIGUSR1 (the
# pre-emption notice), then agrees with the others that every rank saw it ("checkpoint").
SIGNAL_WORKER = """
import os, signal, sys, time
from pathlib import Path
import numpy as np
import distcomm as dist

seen = []
signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
dist.init_process_group("gloo", timeout=60)
rank = dist.get_rank()
Path(sys.argv[1], f"ready-{rank}").write_text(str(os.getpid()))
deadline = time.monotonic() + 90
while not seen and time.monotonic() < deadline:
    time.sleep(0.05)
count = np.array([float(len(seen))])
dist.all_reduce(count)
os.write(1, f"RESULT rank={rank} got_sigusr1={bool(seen)} "
            f"ranks_that_got_it={count[0]:g}\\n".encode())
dist.destroy_process_group()
sys.exit(0 if seen else 3)
"""


# -- helpers ---------------------------------------------------------------------------------


def _write(directory: Path, name: str, text: str, executable: bool = False) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text).lstrip())
    if executable:
        path.chmod(0o755)
    return path


def _results(output: str) -> list[dict[str, str]]:
    """The RESULT lines of `output`, as dicts, sorted by (step, rank)."""
    rows = [
        dict(re.findall(r"(\w+)=(\S+)", line))
        for line in output.splitlines()
        if line.startswith("RESULT ")
    ]
    return sorted(rows, key=lambda row: (row.get("step", ""), int(row["rank"])))


def _srun(
    cluster: SlurmCluster, *args: str, timeout: float = JOB_TIMEOUT, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `srun ARGS` (a job of its own) and return how it ended, stdout and stderr."""
    command = ["srun", f"--job-name={JOB_NAME}", "--time=5", *args]
    try:
        return subprocess.run(
            command, env=cluster.env(), cwd=cwd, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        _cancel_all(cluster)
        pytest.fail(
            f"{shlex.join(command)} ran past {timeout:.0f} s; it printed:\n"
            f"{exc.stdout!r}\n{exc.stderr!r}"
        )


def _sbatch(cluster: SlurmCluster, script: Path, *options: str, minutes: int = 5) -> str:
    """Submit `script` with a time limit of `minutes`; its job id."""
    out = cluster.client(
        "sbatch",
        "--parsable",
        f"--job-name={JOB_NAME}",
        f"--time={minutes}",
        f"--chdir={script.parent}",
        *options,
        str(script),
    )
    return out.strip().split(";")[0]


def _job_field(cluster: SlurmCluster, job: str, field: str) -> str:
    text = cluster.client("scontrol", "show", "job", job)
    match = re.search(rf"\b{field}=(\S+)", text)
    return match.group(1) if match else ""


def _wait_job(
    cluster: SlurmCluster, job: str, output: Path, timeout: float = JOB_TIMEOUT
) -> tuple[str, str, str]:
    """Wait for batch job `job` to end: (its state, its exit code "N:S", its output)."""
    deadline = time.monotonic() + timeout
    while True:
        state = _job_field(cluster, job, "JobState")
        if state in (
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "PREEMPTED",
            "OUT_OF_MEMORY",
            "BOOT_FAIL",
            "DEADLINE",
        ):
            text = output.read_text() if output.exists() else ""
            return state, _job_field(cluster, job, "ExitCode"), text
        if time.monotonic() > deadline:
            text = output.read_text() if output.exists() else ""
            _cancel_all(cluster)
            pytest.fail(f"job {job} still {state} after {timeout:.0f} s; its output:\n{text}")
        time.sleep(0.2)


def _wait_for_files(
    paths: list[Path], job: str, cluster: SlurmCluster, timeout: float = 60.0
) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        if time.monotonic() > deadline:
            state = _job_field(cluster, job, "JobState")
            _cancel_all(cluster)
            pytest.fail(
                f"job {job} ({state}) made only "
                f"{[p.name for p in paths if p.exists()]} of "
                f"{[p.name for p in paths]} within {timeout:.0f} s"
            )
        time.sleep(0.1)


def _cancel_all(cluster: SlurmCluster, timeout: float = 60.0) -> None:
    """Cancel this module's jobs and wait until none is left (nor completing)."""
    cluster.client("scancel", f"--name={JOB_NAME}", "--full")
    deadline = time.monotonic() + timeout
    while cluster.client("squeue", "-h", f"--name={JOB_NAME}", "-o", "%i %T").strip():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"jobs named {JOB_NAME} were still queued {timeout:.0f} s "
                f"after scancel{cluster.logs()}"
            )
        time.sleep(0.2)


def _distcomm_run() -> list[str]:
    script = Path(PYTHON).with_name("distcomm-run")
    return [str(script)] if script.exists() else [PYTHON, "-m", "distcomm.run"]


@pytest.fixture
def cluster(slurm_cluster):  # noqa: F811 - the fixture imported above
    """The module's cluster, with this test's jobs cancelled and gone afterwards."""
    yield slurm_cluster
    _cancel_all(slurm_cluster)


def test_cluster_runs_the_mpi_plugins_the_cases_need(cluster) -> None:
    listed = cluster.client("srun", "--mpi=list", timeout=CLIENT_TIMEOUT)
    assert cluster.version.startswith("slurm")
    for plugin in ("pmi2", "pmix"):
        assert re.search(rf"^\s*{plugin}\s*$", listed, re.M), listed


# -- item 1: srun --mpi=pmix with the socket backends -----------------------------------------


@pytest.mark.parametrize("backend", ["gloo", "tcp"])
def test_srun_pmix_socket_backends_take_everything_from_slurm(cluster, tmp_path, backend) -> None:
    if not cluster.pmix_loaded:
        unavailable(f"slurmd could not load its mpi/pmix plugin (no libpmix.so): {INSTALL_HINT}")
    script = _write(tmp_path, "rank.py", RANK_SCRIPT)
    done = _srun(cluster, "-n", "4", "--mpi=pmix", PYTHON, str(script), backend)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _results(done.stdout)
    assert [int(row["rank"]) for row in rows] == [0, 1, 2, 3], done.stdout + done.stderr
    for row in rows:
        assert (row["size"], row["sum"], row["backend"]) == ("4", "10", backend), row
        assert row["mpi"] == "False", f"MPI was initialised under srun --mpi=pmix: {row}"


# -- item 2: the mpi backend under srun --------------------------------------------------------


def test_plain_srun_with_the_mpi_backend_fails_with_the_remedy(cluster, tmp_path) -> None:
    script = _write(tmp_path, "rank.py", RANK_SCRIPT)
    done = _srun(cluster, "-n", "4", PYTHON, str(script), "mpi")
    said = done.stdout + done.stderr
    assert done.returncode != 0, said
    assert not _results(done.stdout), f"a task ran as a world of its own:\n{said}"
    for words in (
        "MPI.COMM_WORLD has 1 process(es)",
        "a world of 4",
        "SLURM_STEP_NUM_TASKS=4",
        "srun --mpi=pmi2",
        "MpiDefault=pmi2",
    ):
        assert words in said, said


def test_srun_pmi2_with_the_mpi_backend_forms_one_world(cluster, tmp_path) -> None:
    script = _write(tmp_path, "rank.py", RANK_SCRIPT)
    done = _srun(cluster, "-n", "4", "--mpi=pmi2", PYTHON, str(script), "mpi")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _results(done.stdout)
    assert [int(row["rank"]) for row in rows] == [0, 1, 2, 3], done.stdout + done.stderr
    for row in rows:
        assert (row["size"], row["sum"], row["backend"]) == ("4", "10", "mpi"), row


# -- item 3: the quickstart under plain srun ---------------------------------------------------


def test_quickstart_under_plain_srun_is_one_job(cluster, tmp_path) -> None:
    done = _srun(
        cluster,
        "-n",
        "4",
        PYTHON,
        "-m",
        "distcomm.examples.quickstart",
        "--timeout",
        "60",
        cwd=tmp_path,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    lines = done.stdout.splitlines()
    assert lines.count("OK") == 1, said
    headers = [line for line in lines if "rank(s), backend" in line]
    assert len(headers) == 1 and headers[0].startswith("4 rank(s), backend gloo"), said


# -- item 4: concurrent srun --mpi=pmi2 steps of one job ---------------------------------------


@pytest.mark.parametrize("mpi4py", ["hidden", "installed"])
def test_concurrent_pmi2_steps_of_one_job_meet_on_their_own_ports(
    cluster, tmp_path, mpi4py
) -> None:
    meet = _write(tmp_path, "meet.py", MEET_SCRIPT)
    sync = tmp_path / "sync"
    sync.mkdir()
    step = f"srun --mpi=pmi2 -n 2 --exact {shlex.quote(PYTHON)} {meet} gloo {sync} 4 {mpi4py}"
    batch = _write(
        tmp_path,
        "steps.sh",
        f"""
        #!/bin/bash
        {step} > step-a.out 2>&1 &
        {step} > step-b.out 2>&1 &
        wait %1; a=$?
        wait %2; b=$?
        echo "steps ended with $a and $b"
        exit $((a + b))
    """,
    )
    job = _sbatch(cluster, batch, "-n", "4", "--output=job.out")
    state, code, _ = _wait_job(cluster, job, tmp_path / "job.out")
    said = "".join(
        f"\n--- {name}\n{(tmp_path / name).read_text()}"
        for name in ("job.out", "step-a.out", "step-b.out")
        if (tmp_path / name).exists()
    )
    assert (state, code) == ("COMPLETED", "0:0"), said
    rows = _results((tmp_path / "step-a.out").read_text() + (tmp_path / "step-b.out").read_text())
    steps = sorted({row["step"] for row in rows})
    assert len(steps) == 2 and len(rows) == 4, said
    for row in rows:
        assert (row["size"], row["sum"], row["mpi"]) == ("2", "3", "False"), said
    ports = {row["step"]: row["port"] for row in rows}
    assert ports[steps[0]] != ports[steps[1]], said


# -- item 5: pre-emption notice through distcomm-run -------------------------------------------


@pytest.mark.parametrize("notice", ["scancel --batch", "sbatch --signal"])
def test_sigusr1_to_distcomm_run_reaches_the_workers(cluster, tmp_path, notice) -> None:
    worker = _write(tmp_path, "worker.py", SIGNAL_WORKER)
    run = shlex.join([*_distcomm_run(), "--standalone", "--nproc_per_node=2"])
    # exec: the batch step's shell becomes the agent, which the batch step's signal reaches
    batch = _write(
        tmp_path,
        "signal.sh",
        f"""
        #!/bin/bash
        exec {run} {worker} {tmp_path}
    """,
    )
    options = ["-n", "1", "-c", "2", "--output=job.out"]
    if notice == "sbatch --signal":
        # a 2-minute job asks for SIGUSR1 to its batch step 65 s before its end. Slurm
        # checks time limits every 30 s and sends the notice at the first check where the
        # time left is below 65 + 30 s: 25 to 55 s after the start, long after the agent
        # and its workers are ready, and over a minute before the limit
        job = _sbatch(cluster, batch, *options, "--signal=B:USR1@65", minutes=2)
    else:
        job = _sbatch(cluster, batch, *options)
        _wait_for_files([tmp_path / "ready-0", tmp_path / "ready-1"], job, cluster)
        cluster.client("scancel", "--signal=USR1", "--batch", job)
    state, code, output = _wait_job(cluster, job, tmp_path / "job.out")
    assert (state, code) == ("COMPLETED", "0:0"), (
        f"job {job} ended {state}, ExitCode {code} (status:signal); its output:\n{output}"
    )
    rows = _results(output)
    assert [row["rank"] for row in rows] == ["0", "1"], output
    for row in rows:
        assert (row["got_sigusr1"], row["ranks_that_got_it"]) == ("True", "2"), output


# -- one distcomm-run per node, started by srun in a batch job -------------------------------


def test_one_distcomm_run_per_node_under_sbatch(cluster, tmp_path) -> None:
    script = _write(tmp_path, "rank.py", RANK_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = shlex.join([*_distcomm_run(), "--nnodes=1", "--nproc_per_node=2", "--rdzv_backend=c10d"])
    batch = _write(
        tmp_path,
        "nodes.sh",
        f"""
        #!/bin/bash
        head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
        srun --ntasks-per-node=1 {run} --rdzv_endpoint="$head:{port}" \\
            --rdzv_id="$SLURM_JOB_ID" {script} gloo
    """,
    )
    job = _sbatch(cluster, batch, "-N", "1", "--ntasks-per-node=1", "-c", "2", "--output=job.out")
    state, code, output = _wait_job(cluster, job, tmp_path / "job.out")
    assert (state, code) == ("COMPLETED", "0:0"), output
    rows = _results(output)
    assert [row["rank"] for row in rows] == ["0", "1"], output
    for row in rows:
        assert (row["size"], row["sum"], row["backend"]) == ("2", "3", "gloo"), output
