"""Multi-node jobs across simulated hosts: one distcomm-run agent per network namespace.

Each test builds a `tests.netns.Cluster` (hosts with their own names and addresses,
joined by a bridge, reachable only from each other) and runs real agents on its hosts,
two workers each, with the rendezvous backends users pick: c10d (the store hosted by the
first agent), etcd (a server on the switch), a shared file, and static. No host name
resolves, so everything works from addresses. The jobs check their own results and the
tests assert the agents' exit statuses, what the workers reported and what they logged:

- the quickstart on every rendezvous backend, with gloo on shared memory within each host
  and TCP between hosts (from DISTCOMM_DEBUG=INFO's setup line);
- ranks finishing and leaving the group at different times (the last collective of a job);
- a worker failing on one host after the others finished: every agent reports it;
- an agent killed with SIGKILL mid-training (its workers die with it): the survivors
  re-form with --nnodes=2:3 and finish;
- a host's link down for 10 s: the job completes, and the stall is logged as it starts
  and when it ends; a link down for good: the ranks cut off fail within the link
  timeout, naming the peer and its address;
- a slow, lossy link (200 ms, 5 % loss: netem, or an NFQUEUE delayer where the kernel
  has no netem): the job completes;
- a worker frozen with SIGSTOP: every timeout names it, and the job ends although the
  shutdown grace is long;
- benchmarks/collectives.py run as the ranks of distcomm-run across hosts.

Tests that measure something (detection and restart times, the stall) print it; run with
`-s` to see. The module runs only with DISTCOMM_TEST_CLUSTERS=1 (`.ci/hosts` sets the
variable below); it skips without root or `ip netns`; DISTCOMM_TEST_REQUIRE_NETNS=1
turns that into a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import netns

netns.require()

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parent.parent
#: seconds an agent of a test job may run before the test gives up on it
JOB_TIMEOUT = 150.0
NPROC = 2


def job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The agents' environment: nothing inherited from a surrounding job, one auth key for
    the whole job (its ports are reachable from every host), INFO logging."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DISTCOMM_", "TORCHELASTIC_", "PET_", "HYDRA_", "UCX_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
        TMPDIR=str(tmp_path),
        DISTCOMM_AUTH_KEY=f"multihost-{os.getpid()}-{time.monotonic_ns()}",
        DISTCOMM_DEBUG="INFO",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def rendezvous_args(
    kind: str, cluster: netns.Cluster, host: netns.Host, tmp_path: Path, run_id: str = "job"
) -> list[str]:
    """The agent flags of rendezvous backend `kind` for `host`."""
    first = cluster.hosts[0].address
    if kind == "c10d":
        return ["--rdzv-backend=c10d", f"--rdzv-endpoint={first}:29400", f"--rdzv-id={run_id}"]
    if kind == "etcd":
        return [
            "--rdzv-backend=etcd",
            f"--rdzv-endpoint={cluster.switch_address}:2379",
            f"--rdzv-id={run_id}",
        ]
    if kind == "file":
        return [
            "--rdzv-backend=file",
            f"--rdzv-endpoint={tmp_path / 'rdzv'}",
            f"--rdzv-id={run_id}",
        ]
    if kind == "static":
        return [
            "--rdzv-backend=static",
            f"--master-addr={first}",
            "--master-port=29500",
            f"--node-rank={host.index}",
        ]
    raise ValueError(kind)


class Job:
    """distcomm-run agents on some hosts of a cluster, their output in files."""

    def __init__(self, cluster: netns.Cluster, tmp_path: Path) -> None:
        self.cluster, self.tmp_path = cluster, tmp_path
        self.agents: dict[int, subprocess.Popen] = {}
        self.started = 0.0

    def start(
        self,
        agent_args: list[str],
        program: list[str],
        *,
        kind: str = "c10d",
        hosts: list[netns.Host] | None = None,
        env: dict[str, str] | None = None,
        run_id: str = "job",
    ) -> None:
        """Start one agent per host: distcomm-run AGENT_ARGS <rendezvous flags> PROGRAM."""
        env = env or job_env(self.tmp_path)
        self.started = time.time()
        for host in hosts or self.cluster.hosts:
            log = (self.tmp_path / f"agent{host.index}.log").open("w")
            with log:
                self.agents[host.index] = host.popen(
                    [
                        sys.executable,
                        "-m",
                        "distcomm.run",
                        f"--nproc-per-node={NPROC}",
                        *agent_args,
                        *rendezvous_args(kind, self.cluster, host, self.tmp_path, run_id),
                        *program,
                    ],
                    env=env,
                    cwd=self.tmp_path,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )

    def output(self, index: int) -> str:
        return (self.tmp_path / f"agent{index}.log").read_text(errors="replace")

    def outputs(self) -> str:
        return "\n".join(
            f"===== agent on host {i} =====\n{self.output(i)}" for i in sorted(self.agents)
        )

    def wait(self, timeout: float = JOB_TIMEOUT, only: list[int] | None = None) -> dict[int, int]:
        """Wait for the agents (those of `only`); their exit statuses. An agent still
        running after `timeout` fails the test with every agent's output."""
        end = time.monotonic() + timeout
        codes = {}
        for index, proc in sorted(self.agents.items()):
            if only is not None and index not in only:
                continue
            try:
                codes[index] = proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.cluster.kill_all()
                pytest.fail(
                    f"agent on host {index} still runs after {timeout:.0f} s\n{self.outputs()}",
                    pytrace=False,
                )
        return codes

    def expect_success(self, timeout: float = JOB_TIMEOUT, only: list[int] | None = None) -> None:
        codes = self.wait(timeout, only)
        assert all(code == 0 for code in codes.values()), f"exit statuses {codes}\n{self.outputs()}"


def write_script(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


def wait_for_file(paths: Path | list[Path], predicate, timeout: float, job: Job) -> str:
    """Poll `paths` (one file, or several: the first to do wins) until a file's text
    satisfies `predicate`; that text (fail with the job's output if none comes)."""
    paths = [paths] if isinstance(paths, Path) else paths
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for path in paths:
            try:
                text = path.read_text()
                if predicate(text):
                    return text
            except (FileNotFoundError, ValueError):
                pass
        if all(p.poll() is not None for p in job.agents.values()):
            break
        time.sleep(0.1)
    names = " or ".join(path.name for path in paths)
    pytest.fail(f"{names} did not reach the expected state\n{job.outputs()}", pytrace=False)


#: a training loop that records its progress: TRAIN STEPS PAUSE OUTDIR TIMEOUT
TRAIN = """
import json, os, signal, socket, sys, time
import numpy as np
import distcomm as dist

steps, pause, out, timeout = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], float(sys.argv[4])
restart = int(os.environ["DISTCOMM_RESTART_COUNT"])
begun = time.time()
dist.init_process_group("gloo", timeout=timeout)
rank, world = dist.get_rank(), dist.get_world_size()
mark = f"{restart}-{rank}"

def record(name, **fields):
    path = os.path.join(out, f"{name}-{mark}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(dict(fields, rank=rank, world=world, restart=restart,
                       host=socket.gethostname(), time=time.time()), f)
    os.replace(path + ".tmp", path)

def stopped(signum, frame, previous=signal.getsignal(signal.SIGTERM)):
    # the agent stops a node's workers once one of them has failed, as torchrun's does:
    # say so, then end as SIGTERM would have (the flight recorder's handler, if any)
    record("stopped")
    if callable(previous):
        previous(signum, frame)
    else:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

signal.signal(signal.SIGTERM, stopped)
record("start", begun=begun)
try:
    x = np.zeros(1000)
    for step in range(steps):
        x[:] = rank + 1
        dist.all_reduce(x)
        if not (x == world * (world + 1) / 2).all():
            sys.exit(f"rank {rank}: step {step}: wrong sum {x[0]}")
        if rank == 0:
            record("progress", step=step)
        time.sleep(pause)
    dist.barrier()
except dist.DistError as exc:
    record("error", kind=type(exc).__name__, message=str(exc))
    print(f"rank {rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    sys.exit(1)
record("done")
dist.destroy_process_group()
"""


def records(directory: Path, name: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob(f"{name}-*.json"))]


# -- the harness itself ------------------------------------------------------------------------

NAME_PROBE = """
import socket, sys
try:
    socket.getaddrinfo(socket.gethostname(), None)
    resolved = "resolves"
except socket.gaierror:
    resolved = "unresolved"
print(socket.gethostname(), resolved)
"""


def test_hosts_have_their_own_names_and_only_the_switch_routes():
    with netns.Cluster(2) as cluster:
        for host in cluster.hosts:
            name, resolved = host.run([sys.executable, "-c", NAME_PROBE]).stdout.split()
            assert (name, resolved) == (host.hostname, "unresolved")
            # one route: the switch's subnet; nothing leads anywhere else
            routes = host.run(["ip", "-4", "route", "show", "table", "all"]).stdout
            assert [
                r.split()[0]
                for r in routes.splitlines()
                if not r.startswith(("local ", "broadcast "))
            ] == [str(cluster.subnet)], routes
        assert len(cluster.pids()) == 0
        namespaces = [cluster.switch, *(h.netns for h in cluster.hosts)]
    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=30
    ).stdout
    assert not any(name in listed for name in namespaces), listed


# -- the quickstart on every rendezvous backend; gloo's transports -----------------------------

SETUP_LINE = re.compile(
    r"\[rank (\d+)/(\d+)\] setup on 'gloo' \(group 'default'\): "
    r"collectives over (\S+) \(hosts: (.*)\)"
)


def start_etcd(cluster: netns.Cluster, tmp_path: Path) -> None:
    """An etcd server in the switch's namespace, at switch_address:2379 (stopped with the
    cluster); waits until it answers."""
    binary = shutil.which("etcd")
    if binary is None:
        if os.environ.get("DISTCOMM_TEST_REQUIRE_ETCD") == "1":
            pytest.fail(
                "etcd not installed: apt-get install etcd-server "
                "(DISTCOMM_TEST_REQUIRE_ETCD=1 requires it)",
                pytrace=False,
            )
        pytest.skip("etcd not installed: apt-get install etcd-server")
    a = cluster.switch_address
    log = (tmp_path / "etcd.log").open("w")
    with log:
        cluster.popen_switch(
            [
                binary,
                "--name",
                "default",
                "--data-dir",
                str(tmp_path / "etcd-data"),
                "--listen-client-urls",
                f"http://{a}:2379",
                "--advertise-client-urls",
                f"http://{a}:2379",
                "--listen-peer-urls",
                f"http://{a}:2380",
                "--initial-advertise-peer-urls",
                f"http://{a}:2380",
                "--initial-cluster",
                f"default=http://{a}:2380",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    probe = (
        "import http.client, sys; c = http.client.HTTPConnection(sys.argv[1], 2379, "
        "timeout=2); c.request('GET', '/health'); "
        "sys.exit(0 if b'true' in c.getresponse().read() else 1)"
    )
    end = time.monotonic() + 30
    while cluster.hosts[0].run([sys.executable, "-c", probe, a], check=False).returncode:
        if time.monotonic() > end:
            pytest.fail(
                f"etcd did not start:\n{(tmp_path / 'etcd.log').read_text()}", pytrace=False
            )
        time.sleep(0.3)


@pytest.mark.parametrize("kind,hosts", [("c10d", 3), ("etcd", 2), ("file", 2), ("static", 2)])
def test_quickstart_across_hosts(kind, hosts, tmp_path):
    with netns.Cluster(hosts) as cluster:
        if kind == "etcd":
            start_etcd(cluster, tmp_path)
        job = Job(cluster, tmp_path)
        job.start(
            [f"--nnodes={hosts}"],
            ["-m", "distcomm.examples.quickstart", "--backend", "gloo"],
            kind=kind,
        )
        job.expect_success()
        text = job.outputs()
    assert "\nOK\n" in job.output(0), text
    world = hosts * NPROC
    layout = str([[h * NPROC + i for i in range(NPROC)] for h in range(hosts)])
    setups = {int(m[1]): m for m in SETUP_LINE.finditer(text)}
    assert sorted(setups) == list(range(world)), text
    for match in setups.values():
        # shared memory within each host, TCP between them, hosts told apart by name
        assert (int(match[2]), match[3], match[4]) == (world, "shm+tcp", layout), match[0]
    # each agent ran its own host's ranks: the ranks' setup lines are in its output
    for h in range(hosts):
        mine = {int(m[1]) for m in SETUP_LINE.finditer(job.output(h))}
        assert mine == {h * NPROC + i for i in range(NPROC)}, job.output(h)


# -- ranks leaving at different times ----------------------------------------------------------

LEAVE = """
import os, sys, time
import numpy as np
import distcomm as dist

dist.init_process_group("gloo", timeout=60)
rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
x = np.ones(1000)
for _ in range(5):
    dist.all_reduce(x)
y = np.full(1000, 5.0) if rank == 0 else np.zeros(1000)
if local == 0 and rank != 0:
    time.sleep(1.5)  # the other hosts' first ranks come late to the last collective...
try:
    dist.broadcast(y, src=0)  # ... which rank 0 and its host-mate finish and leave at once
except dist.DistError as exc:
    sys.exit(f"rank {rank}: {type(exc).__name__}: {exc}")
dist.destroy_process_group()
if not (y == 5.0).all():
    sys.exit(f"rank {rank}: wrong broadcast result {y[0]}")
print(f"rank {rank} done", flush=True)
"""


def test_ranks_leave_at_different_times(tmp_path):
    script = write_script(tmp_path / "leave.py", LEAVE)
    with netns.Cluster(3) as cluster:
        job = Job(cluster, tmp_path)
        job.start(["--nnodes=3"], [str(script)])
        job.expect_success()
        text = job.outputs()
    for rank in range(3 * NPROC):
        assert f"rank {rank} done" in text, text


# -- a failure on one host fails the job on every host -----------------------------------------

FAIL_LATE = """
import sys, time
import numpy as np
import distcomm as dist

failing = int(sys.argv[1])
dist.init_process_group("gloo", timeout=60)
rank = dist.get_rank()
x = np.ones(1000)
for _ in range(5):
    dist.all_reduce(x)
dist.barrier()
dist.destroy_process_group()
if rank == failing:  # after the others have finished and left: they reach the exit barrier
    time.sleep(2)
    print(f"rank {rank} fails after the job", flush=True)
    sys.exit(3)
"""


def test_a_late_failure_on_one_host_fails_every_agent(tmp_path):
    script = write_script(tmp_path / "fail_late.py", FAIL_LATE)
    failing = 3 * NPROC - 1  # the last worker of the last host
    with netns.Cluster(3) as cluster:
        job = Job(cluster, tmp_path)
        job.start(["--nnodes=3"], [str(script), str(failing)])
        codes = job.wait()
        text = job.outputs()
    assert f"rank {failing} fails after the job" in text, text
    # every node reports the failure: none of them calls the run a success
    assert all(code != 0 for code in codes.values()), (codes, text)
    for index in codes:
        assert re.search(rf"rank\s*:\s*{failing}\b", job.output(index)), job.output(index)


# -- a node dies: the survivors re-form --------------------------------------------------------


def test_agent_killed_survivors_reform_and_finish(tmp_path):
    script = write_script(tmp_path / "train.py", TRAIN)
    out = tmp_path / "records"
    out.mkdir()
    with netns.Cluster(3) as cluster:
        job = Job(cluster, tmp_path)
        job.start(["--nnodes=2:3", "--max-restarts=3"], [str(script), "60", "0.1", str(out), "60"])
        wait_for_file(out / "progress-0-0.json", lambda t: json.loads(t)["step"] >= 5, 90, job)
        killed_at = time.time()
        os.kill(job.agents[2].pid, signal.SIGKILL)  # its workers die with it (PDEATHSIG)
        job.expect_success(only=[0, 1])
        text = job.outputs()
    done = records(out, "done")
    finals = [r for r in done if r["restart"] >= 1]
    assert sorted(r["rank"] for r in finals) == list(range(2 * NPROC)), (done, text)
    assert {r["world"] for r in finals} == {2 * NPROC}, (done, text)
    assert not [r for r in done if r["restart"] == 0], (done, text)  # round 0 never finished
    errors = [r for r in records(out, "error") if r["restart"] == 0]
    assert errors, text
    for error in errors:  # the survivors were told a peer on the dead host closed its link
        assert error["kind"] == "DistNetworkError", errors
        assert re.search(r"rank [45]\b", error["message"]), errors
    restarted = min(r["begun"] for r in records(out, "start") if r["restart"] >= 1)
    print(
        f"\nnode death: first survivor error {min(e['time'] for e in errors) - killed_at:.2f} s"
        f" after the kill; new workers started {restarted - killed_at:.2f} s after it; "
        f"job done {max(r['time'] for r in finals) - killed_at:.2f} s after it"
    )


# -- a link goes down and comes back -----------------------------------------------------------

STALLED = re.compile(
    r"\[rank (\d+)\] tcp transport: the link to rank (\d+) \((\S+)\) has stalled: (.*)"
)
RECOVERED = re.compile(
    r"\[rank (\d+)\] tcp transport: the link to rank (\d+) \((\S+)\) recovered after a "
    r"stall of ([\d.]+) s"
)


def test_link_down_for_10_s_is_logged_and_survived(tmp_path):
    script = write_script(tmp_path / "train.py", TRAIN)
    out = tmp_path / "records"
    out.mkdir()
    with netns.Cluster(2) as cluster:
        job = Job(cluster, tmp_path)
        job.start(["--nnodes=2"], [str(script), "200", "0.05", str(out), "120"])
        wait_for_file(out / "progress-0-0.json", lambda t: json.loads(t)["step"] >= 10, 90, job)
        down_at = time.time()
        cluster.hosts[1].link_down()
        time.sleep(10)
        cluster.hosts[1].link_up()
        up_at = time.time()
        job.expect_success()
        text = job.outputs()
    done = records(out, "done")
    assert sorted(r["rank"] for r in done) == list(range(2 * NPROC)), text
    assert {r["restart"] for r in done} == {0}, text  # survived without a restart
    stalls = STALLED.findall(text)
    recoveries = RECOVERED.findall(text)
    # ranks on both sides of the link saw it stall and recover, naming the far side
    far = {str(r) for r in range(NPROC, 2 * NPROC)}
    assert any(rank in {"0", "1"} and peer in far for rank, peer, _, _ in stalls), text
    assert any(rank in {"0", "1"} and peer in far for rank, peer, _, _ in recoveries), text
    longest = max(float(r[3]) for r in recoveries)
    print(
        f"\nlink down {up_at - down_at:.1f} s: {len(stalls)} stall warning(s), the longest "
        f"stall {longest:.1f} s; e.g.\n  {stalls[0]}\n  {recoveries[0]}"
    )


DEAD_LINK = re.compile(r"the link to rank (\d+) \((10\.213\.\d+\.\d+):\d+\) failed: (.*)")
HOST_MATE_ENDED = re.compile(r"rank (\d+)'s process ended")


def test_dead_link_is_found_within_the_link_timeout(tmp_path):
    script = write_script(tmp_path / "train.py", TRAIN)
    out = tmp_path / "records"
    out.mkdir()
    cut_off = list(range(NPROC, 2 * NPROC))  # the ranks on host 1
    with netns.Cluster(2) as cluster:
        job = Job(cluster, tmp_path)
        # group timeout 60 s: the link timeout (30 s at most) finds the dead link first
        job.start(["--nnodes=2"], [str(script), "100000", "0.05", str(out), "60"])
        wait_for_file(out / "progress-0-0.json", lambda t: json.loads(t)["step"] >= 10, 90, job)
        down_at = time.time()
        cluster.hosts[1].link_down()  # for good
        # host 1's ranks only have their links to the ranks on host 0 to go by (host 0's
        # agent drops host 1 from the rendezvous once its heartbeats stop, and stops its
        # own workers; host 1's agent, cut off from the store, is not judged here)
        for rank in cut_off:
            wait_for_file(
                [out / f"error-0-{rank}.json", out / f"stopped-0-{rank}.json"], bool, 90, job
            )
        errors = [r for r in records(out, "error") if r["rank"] in cut_off]
        stops = [r for r in records(out, "stopped") if r["rank"] in cut_off]
        text = job.outputs()
    # each of host 1's ranks finds the dead link, unless a host-mate found it first and
    # exited: then it may see that rank's process end first, and says so, or its agent,
    # seeing the host-mate fail, may stop it before it reports (SIGTERM, as torchrun's)
    found_link = [e["rank"] for e in errors if DEAD_LINK.search(e["message"])]
    assert found_link, (errors, text)
    first_found = min(e["time"] for e in errors if e["rank"] in found_link)
    reported = {e["rank"] for e in errors}
    for stop in stops:
        if stop["rank"] not in reported:
            assert stop["time"] >= first_found, (errors, stops, text)
    for error in errors:
        assert error["kind"] == "DistNetworkError", (errors, text)
        found = DEAD_LINK.search(error["message"])
        if found is None:
            ended = HOST_MATE_ENDED.search(error["message"])
            assert ended and int(ended[1]) in found_link, (errors, text)
            continue
        assert int(found[1]) < NPROC and found[2] == cluster.hosts[0].address, errors
        assert f"(link down, or the host of rank {found[1]} down or unreachable?)" in found[3]
    failed = min(e["time"] for e in errors) - down_at
    print(
        f"\nlink down for good: host 1's ranks failed {failed:.1f} s later: {errors[0]['message']}"
    )


# -- a slow, lossy link ------------------------------------------------------------------------


def test_slow_lossy_link_job_completes(tmp_path):
    with netns.Cluster(2) as cluster:
        try:
            how = cluster.hosts[1].impair(delay_ms=200, loss_percent=5)
        except netns.ImpairmentUnavailable as exc:
            pytest.skip(f"no delay or loss can be made here: {exc}")
        job = Job(cluster, tmp_path)
        job.start(
            ["--nnodes=2"],
            [
                "-m",
                "distcomm.examples.quickstart",
                "--backend",
                "gloo",
                "--steps",
                "25",
                "--lr",
                "0.25",
            ],
        )
        job.expect_success(timeout=200)
        text = job.outputs()
        time.sleep(1.5)  # the delayer's counters lag up to a second
        stats = cluster.hosts[1].impairment_stats()
    assert "\nOK\n" in job.output(0), text
    # the link really was slow and lossy: its packets went through the delay, some dropped
    assert stats["packets"] > 100 and stats["dropped"] > 0, stats
    print(
        f"\n200 ms delay and 5 % loss on host 1's link ({how}): the quickstart took "
        f"{time.time() - job.started:.1f} s; {stats['packets']} packets delayed, "
        f"{stats['dropped']} dropped"
    )


# -- a frozen worker ---------------------------------------------------------------------------

FREEZE = """
import os, signal, sys, time
import numpy as np
import distcomm as dist

frozen, timeout = int(sys.argv[1]), float(sys.argv[2])
dist.init_process_group("gloo", timeout=timeout)
rank = dist.get_rank()
x = np.ones(1000)
try:
    for step in range(1000):
        if step == 20 and rank == frozen:
            print(f"rank {rank} stops itself at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(x)
        time.sleep(0.01)
except dist.DistError as exc:
    print(f"rank {rank} raised {type(exc).__name__}: {exc}", flush=True)
    time.sleep(2)  # the agent stops this host's other workers when one exits: let them say it
    sys.exit(1)
"""


def test_frozen_worker_is_named_and_the_job_ends(tmp_path):
    script = write_script(tmp_path / "freeze.py", FREEZE)
    frozen = NPROC + 1  # the second worker of the second host
    with netns.Cluster(3) as cluster:
        job = Job(cluster, tmp_path)
        # a stopped worker must not hold the stop up for the shutdown grace
        job.start(["--nnodes=3", "--shutdown-timeout=600"], [str(script), str(frozen), "8"])
        codes = job.wait()
        text = job.outputs()
    assert all(code != 0 for code in codes.values()), (codes, text)
    assert f"rank {frozen} stops itself" in text, text
    raised = dict(re.findall(r"rank (\d+) raised (\w+Error: .*)", text))
    assert sorted(map(int, raised)) == sorted(set(range(3 * NPROC)) - {frozen}), text
    for rank, message in raised.items():
        # whoever timed out first, and those it told: the stopped rank, in group numbers
        assert f"rank(s) {frozen} did not answer" in message, (rank, message)
        others = re.findall(r"rank\(s\) ([\d, ]+) (?:did not answer|have not called)", message)
        assert others == [str(frozen)] * len(others), (rank, message)
    print(f"\nfrozen rank {frozen}: e.g. {next(iter(raised.values()))}")


# -- the benchmark under an external launcher --------------------------------------------------


@pytest.mark.parametrize("backend", ["gloo", "tcp"])
def test_benchmark_runs_as_the_launchers_ranks(backend, tmp_path):
    with netns.Cluster(2) as cluster:
        job = Job(cluster, tmp_path)
        job.start(
            ["--nnodes=2"],
            [
                str(REPO / "benchmarks" / "collectives.py"),
                "--backend",
                backend,
                "--op",
                "all_reduce,all_gather",
                "-b",
                "1K",
                "-e",
                "1M",
                "-f",
                "1024",
                "-n",
                "3",
                "-w",
                "1",
            ],
            env=job_env(tmp_path, DISTCOMM_DEBUG="OFF"),
        )
        job.expect_success()
        text = job.output(0)
    hosts = "; ".join(
        f"{h.hostname}: {h.index * NPROC},{h.index * NPROC + 1}" for h in cluster.hosts
    )
    assert f"# {2 * NPROC} ranks started by distcomm-run, by host: {hosts}" in text, text
    assert f"# op all_gather, nprocs {2 * NPROC}, dtype float32, backend {backend}" in text, text
    assert "# 4 rows, 0 with wrong results: all checks passed" in text, text
    print(f"\n{text}")


def test_hosts_benchmark_runs_and_reports_every_kind():
    # benchmarks/hosts.py makes its own two namespaces (and removes them)
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "hosts.py"),
            "--sizes",
            "64K",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--repeat",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    row = [line for line in done.stdout.splitlines() if line.startswith("| 64 KiB |")]
    assert len(row) == 1, done.stdout
    figures = [float(cell) for cell in row[0].strip("|").split("|")[1:]]
    assert len(figures) == 5 and all(f > 0 for f in figures), done.stdout
