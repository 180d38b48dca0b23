"""The mpi backend under a real mpiexec (MPICH, Open MPI 4 or 5: DISTCOMM_TEST_MPIEXEC, see
tests/mpijobs.py): the conformance suite at 2, 3 and 4 processes and
tests/test_scalars_and_warnings.py at 2 and 3, initialisation from MPI.COMM_WORLD, what
happens when a rank does not arrive, and a process that initialises MPI without a
launcher. Every job runs with a hard timeout, on loopback only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.mpijobs import (  # noqa: F401 - the fixture applies to every test here
    LAUNCHER,
    SKIP_REASON,
    Finished,
    job_env,
    no_mpi_segment_left,
    run,
)
from tests.processes import free_port

pytestmark = pytest.mark.timeout(400)

if LAUNCHER is None:
    pytest.skip(
        f"the mpi backend tests need mpi4py and mpiexec: {SKIP_REASON}", allow_module_level=True
    )


def mpiexec(
    n: int, *argv: str, timeout: float = 300, env: dict[str, str] | None = None
) -> Finished:
    """Run `argv` on `n` ranks of the launcher under test, on loopback, with no torch-style
    rendezvous variables."""
    return run(LAUNCHER.command(n, *argv), env=job_env(**(env or {})), timeout=timeout)


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _suite_under_mpiexec(n: int, path: str) -> None:
    """Run the test module `path` on n ranks under mpiexec (tests.mpi_world's World)."""
    done = mpiexec(
        n, sys.executable, "-m", "tests.mpi_world", path, "-q", "-x", "-p", "no:cacheprovider"
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    assert " passed" in done.stdout and "failed" not in done.stdout, done.stdout[-3000:]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_conformance_suite_under_mpiexec(n):
    _suite_under_mpiexec(n, "tests/test_collectives.py")


@pytest.mark.parametrize("n", [2, 3])
def test_scalars_and_quiet_reductions_under_mpiexec(n):
    # 0-d arrays in every op, the numpy-scalar TypeError, and reductions that overflow
    # without a warning (a warning raised in mpi4py's float16 reduction aborts the job)
    _suite_under_mpiexec(n, "tests/test_scalars_and_warnings.py")


def test_init_takes_rank_and_size_from_mpi(tmp_path):
    script = _script(
        tmp_path,
        """
        import numpy as np
        from mpi4py import MPI
        import distcomm as dist
        dist.init_process_group("mpi")
        x = np.ones(3)
        dist.all_reduce(x)
        row = (dist.get_rank(), dist.get_world_size(), MPI.COMM_WORLD.rank,
               MPI.COMM_WORLD.size, dist.get_backend(), float(x[0]))
        with open(f"{__file__}.{MPI.COMM_WORLD.rank}", "w") as out:
            out.write(repr(row))
        dist.destroy_process_group()
    """,
    )
    done = mpiexec(3, sys.executable, script, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [eval(Path(f"{script}.{r}").read_text()) for r in range(3)]
    assert rows == [(r, 3, r, 3, "mpi", 3.0) for r in range(3)], done.stdout


def test_world_size_disagreeing_with_mpi_is_ignored_with_torchs_warning(tmp_path):
    """As torch's mpi backend: a rank or world size given under mpiexec is ignored, with a
    warning, and MPI's are used."""
    script = _script(
        tmp_path,
        """
        import warnings
        from mpi4py import MPI
        import distcomm as dist
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            dist.init_process_group("mpi", world_size=5)
        row = (dist.get_rank(), dist.get_world_size(), [str(w.message) for w in seen])
        dist.destroy_process_group()
        with open(f"{__file__}.{MPI.COMM_WORLD.rank}", "w") as out:
            out.write(repr(row))
    """,
    )
    done = mpiexec(2, sys.executable, script, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [eval(Path(f"{script}.{r}").read_text()) for r in range(2)]
    assert [row[:2] for row in rows] == [(0, 2), (1, 2)], rows
    for _, _, messages in rows:
        assert any(
            "For MPI backend, world_size (5)" in m and "world size 2 from MPI.COMM_WORLD" in m
            for m in messages
        ), messages


def test_a_rank_that_never_arrives_aborts_the_job(tmp_path):
    script = _script(
        tmp_path,
        """
        import time
        import numpy as np
        import distcomm as dist
        dist.init_process_group("mpi", timeout=2)
        if dist.get_rank() == 1:
            time.sleep(60)
        dist.all_reduce(np.ones(4))
    """,
    )
    done = mpiexec(
        2, sys.executable, script, timeout=60, env={"DISTCOMM_MPI_ABORT_ON_EXCEPTION": "0"}
    )
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "all_reduce on 'mpi'" in output and "did not complete within 2.0 s" in output, output


def test_async_wait_timeout_then_completion(tmp_path):
    script = _script(
        tmp_path,
        """
        import time
        import numpy as np
        import distcomm as dist
        dist.init_process_group("mpi")
        x = np.ones(4)
        if dist.get_rank() == 1:
            time.sleep(2)
            dist.all_reduce(x)
        else:
            work = dist.all_reduce(x, async_op=True)
            try:
                work.wait(timeout=0.3)
            except dist.DistTimeoutError as exc:
                print("TIMEOUT", exc, flush=True)
            try:
                dist.barrier()
            except dist.DistBackendError as exc:
                print("UNUSABLE", exc, flush=True)
            work.get_future().wait(30)
            print("LATE", x[0], flush=True)
    """,
    )
    done = mpiexec(
        2, sys.executable, script, timeout=120, env={"DISTCOMM_MPI_ABORT_ON_EXCEPTION": "0"}
    )
    assert done.returncode == 0, done.stderr
    assert "TIMEOUT" in done.stdout and "cannot be cancelled" in done.stdout, done.stdout
    assert "UNUSABLE" in done.stdout and "LATE 2.0" in done.stdout, done.stdout


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_quickstart_runs_under_mpiexec_without_arguments(backend):
    done = mpiexec(
        4, sys.executable, "-m", "distcomm.examples.quickstart", "--backend", backend, timeout=180
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"4 rank(s), backend {backend}" in done.stdout and "OK" in done.stdout, done.stdout


SINGLETON_SCRIPT = """
    import json, os
    import numpy as np
    import distcomm as dist

    dist.init_process_group("mpi")
    x = np.full(4, 3.0)
    dist.all_reduce(x)
    with open("/proc/self/maps") as maps:
        mapped = sorted({line.split(None, 5)[5].strip() for line in maps
                         if line.count(" ") >= 5 and " /dev/shm/" in line})
    print(json.dumps({"size": dist.get_world_size(), "sum": x.tolist(), "mapped": mapped}))
    dist.destroy_process_group()
"""


def test_a_process_without_launcher_leaves_no_shared_memory(tmp_path):
    """`python script.py` calling init_process_group("mpi") (an MPI singleton): Open MPI 5
    maps a 16 MiB /dev/shm/sm_segment.* file that it never removes; distcomm removes it at
    exit. The files the process mapped must be gone once it has ended."""
    script = _script(tmp_path, SINGLETON_SCRIPT)
    env = job_env(TMPDIR=str(tmp_path))  # Open MPI's session folder, which it leaves too
    if LAUNCHER.kind == "openmpi4":  # its singleton starts orted from the install prefix
        env.setdefault("OPAL_PREFIX", str(Path(os.path.realpath(LAUNCHER.path)).parent.parent))
    done = run([sys.executable, script], env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["size"], report["sum"]) == (1, [3.0] * 4), done.stdout
    if LAUNCHER.kind == "openmpi5":  # the case this guards: the segment existed
        assert any("/sm_segment." in path for path in report["mapped"]), report
    left = [path for path in report["mapped"] if os.path.exists(path)]
    assert not left, f"the singleton left {left} behind"


def test_shrink_and_split_groups(tmp_path):
    """split_group, and shrink_group of the default group by ranks that go on while the
    excluded one (alive: MPI ends a job whose process dies) waits outside."""
    script = _script(
        tmp_path,
        """
        import numpy as np
        from mpi4py import MPI
        import distcomm as dist
        from distcomm.regroup import SHRINK_DEFAULT
        dist.init_process_group("mpi")
        r = dist.get_rank()
        halves = dist.split_group(split_ranks=[[0, 1], [2]])
        x = np.full(2, r + 1.0)
        dist.all_reduce(x, group=halves)
        assert x.tolist() == ([3.0, 3.0] if r < 2 else [3.0, 3.0]), x
        if r != 1:
            world = dist.shrink_group([1], shrink_flags=SHRINK_DEFAULT)
            assert (dist.get_rank(), dist.get_world_size()) == ({0: 0, 2: 1}[r], 2)
            y = np.full(2, float(r))
            dist.all_reduce(y, group=world)
            assert y.tolist() == [2.0, 2.0], y
            pair = dist.new_group([0, 1])  # in the renumbered world: old ranks 0 and 2
            z = np.ones(1)
            dist.all_reduce(z, group=pair)
            assert z.tolist() == [2.0], z
            print("shrunk", r, flush=True)
        MPI.COMM_WORLD.Barrier()
        dist.destroy_process_group()
    """,
    )
    done = mpiexec(3, sys.executable, script, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("shrunk") == 2, done.stdout


def test_reconfigure_without_a_shared_store_is_refused_saying_what_to_do(tmp_path):
    """A bare init_process_group("mpi") has a store private to each process, where no
    newcomer can meet the members: re-forming says so, and the group still works."""
    script = _script(
        tmp_path,
        """
        import numpy as np
        import distcomm as dist
        dist.init_process_group("mpi")
        pg = dist.group.WORLD
        try:
            pg.reconfigure("again", [pg.get_init_handle()])
        except dist.DistBackendError as exc:
            assert "a store its processes share" in str(exc) and "env://" in str(exc), exc
            print("refused", flush=True)
        x = np.ones(2)
        dist.all_reduce(x)
        assert x.tolist() == [2.0, 2.0], x
        dist.destroy_process_group()
    """,
    )
    done = mpiexec(2, sys.executable, script, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("refused") == 2, done.stdout


_GROWN = """
    import sys
    import numpy as np
    import distcomm as dist
    x = np.array([1.0])
    dist.all_reduce(x)
    pair = dist.new_group([0, 2])  # made from the re-formed world
    y = np.array([float(dist.get_rank())])
    if dist.get_rank() in (0, 2):
        dist.all_reduce(y, group=pair)
    # one write per line: the ranks' output interleaves otherwise
    sys.stdout.write(f"RESULT {dist.get_rank()} {dist.get_world_size()} {x[0]} {y[0]}\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
"""


def _singleton(script, env: dict[str, str]) -> subprocess.Popen:
    """Start `script` as an MPI singleton (no mpiexec): the newcomer of a growing world."""
    return subprocess.Popen(
        [sys.executable, str(script)],
        env={**env, "RANK": "1", "WORLD_SIZE": "2"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.skipif(
    LAUNCHER is not None and LAUNCHER.kind != "mpich",
    reason="Open MPI connects separate jobs only through its PRRTE runtime (ompi-server)",
)
def test_an_mpi_world_grows_by_a_process_mpiexec_did_not_start(tmp_path):
    """Two ranks under mpiexec take in an MPI singleton (MPI_Comm_accept/connect through
    the job's store): three ranks, one all_reduce over them, a subgroup of the new world."""
    port = str(free_port())
    members = _script(
        tmp_path,
        textwrap.dedent(
            """
        import time
        import distcomm as dist
        from distcomm import membership
        dist.init_process_group("mpi", init_method="env://")
        pg = dist.group.WORLD
        handles = [None] * dist.get_world_size()
        dist.all_gather_object(handles, pg.get_init_handle())
        end = time.monotonic() + 60
        while membership.pending(0) < 1:
            assert time.monotonic() < end, "no newcomer registered"
            time.sleep(0.05)
        membership.reform(pg, handles, 0, settle=10.0)
    """
        )
        + textwrap.dedent(_GROWN),
    )
    newcomer_script = tmp_path / "newcomer.py"
    newcomer_script.write_text(
        textwrap.dedent(
            """
            import distcomm as dist
            dist.init_process_group("mpi", join=True)
        """
        )
        + textwrap.dedent(_GROWN)
    )
    newcomer = _singleton(newcomer_script, job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
    try:
        done = mpiexec(
            2,
            sys.executable,
            members,
            timeout=120,
            env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
        )
        assert done.returncode == 0, done.stdout + done.stderr
        out, err = newcomer.communicate(timeout=60)
    finally:
        if newcomer.poll() is None:
            newcomer.kill()
            newcomer.wait(10)
    assert done.returncode == 0, done.stdout + done.stderr
    assert newcomer.returncode == 0, out + err
    rows = sorted(
        line.split()[1:] for line in (done.stdout + out).splitlines() if line.startswith("RESULT")
    )
    assert rows == [["0", "3", "3.0", "2.0"], ["1", "3", "3.0", "1.0"], ["2", "3", "3.0", "2.0"]], (
        rows
    )


#: a recovery Manager loop whose weights sum every step's (step + 1): identical everywhere.
#: From half-way on it votes every step down (discards it) until the newcomer is in (it
#: creates BACK once there), so the members keep voting, and so taking it in.
_MANAGER_LOOP = """
    import json
    import os
    import time

    import numpy as np

    import distcomm as dist
    from distcomm.recovery import Manager

    BACK = os.environ["BACK"]

    def loop(steps, joined):
        model = {"w": np.zeros(4)}

        def load(state):
            model["w"] = state["w"]

        mgr = Manager(lambda: {"w": model["w"]}, load, settle=1.0)
        sizes, held = [], None
        while mgr.step < steps:
            mgr.start_step()
            if joined and not os.path.exists(BACK):
                open(BACK, "w").close()
            g = np.full(4, float(mgr.step + 1))
            dist.all_reduce(g)
            holding = mgr.step >= steps // 2 and not os.path.exists(BACK)
            held = (held or time.monotonic()) if holding else None
            if held is not None and time.monotonic() - held > 300:
                raise SystemExit("the newcomer was not taken in within 300 s")
            if mgr.should_commit(not holding):
                model["w"] = model["w"] + g / dist.get_world_size()
                sizes.append(dist.get_world_size())
        row = {"rank": dist.get_rank(), "size": dist.get_world_size(), "steps": mgr.step,
               "w": model["w"].tolist(), "sizes": sorted(set(sizes)), "joined": joined}
        result = os.path.join(os.environ["RESULTS"], f"{os.getpid()}.json")
        with open(result + ".part", "w") as part:  # a file each: ranks' output interleaves
            json.dump(row, part)
        os.replace(result + ".part", result)
        mgr.close()
        dist.destroy_process_group()
"""


@pytest.mark.skipif(
    LAUNCHER is not None and LAUNCHER.kind != "mpich",
    reason="Open MPI connects separate jobs only through its PRRTE runtime (ompi-server)",
)
def test_a_process_that_joined_an_mpi_world_runs_the_recovery_manager_loop(tmp_path):
    """Two ranks under mpiexec run a Manager loop; an MPI singleton joins with
    init_process_group("mpi", join=True) and runs the same loop: it is taken in, caught
    up, and all three end at the same step with the same weights, the newcomer last. The
    re-forming renumbers the mpi process ranks, so the joiner is known as one by a state
    of its own, not by its process rank."""
    port = str(free_port())
    back = tmp_path / "newcomer-in"
    members = tmp_path / "members.py"
    members.write_text(
        textwrap.dedent(_MANAGER_LOOP)
        + textwrap.dedent(
            """
            dist.init_process_group("mpi", init_method="env://")
            loop(40, joined=False)
            """
        )
    )
    newcomer_script = tmp_path / "newcomer.py"
    newcomer_script.write_text(
        textwrap.dedent(_MANAGER_LOOP)
        + textwrap.dedent(
            """
            dist.init_process_group("mpi", join=True)
            loop(40, joined=True)
            """
        )
    )
    results = tmp_path / "results"
    results.mkdir()
    where = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "BACK": str(back)}
    where["RESULTS"] = str(results)
    newcomer = _singleton(newcomer_script, job_env(**where))
    try:
        done = mpiexec(
            2,
            sys.executable,
            str(members),
            timeout=300,
            env=where,
        )
        try:
            out, err = newcomer.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            newcomer.kill()
            out, err = newcomer.communicate(timeout=30)
            pytest.fail(
                f"the newcomer still ran 120 s after the members ended (exit "
                f"{done.returncode}); members:\n{done.stdout[-3000:]}{done.stderr[-6000:]}\n"
                f"newcomer:\n{err[-3000:]}"
            )
    finally:
        if newcomer.poll() is None:
            newcomer.kill()
            newcomer.wait(10)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert newcomer.returncode == 0, out[-3000:] + err[-6000:]
    rows = [json.loads(path.read_text()) for path in sorted(results.glob("*.json"))]
    assert sorted(r["rank"] for r in rows) == [0, 1, 2], rows
    assert all(r["size"] == 3 and r["steps"] == 40 for r in rows), rows
    assert all(r["w"] == [820.0] * 4 for r in rows), rows  # the sum of step + 1, bit for bit
    assert [r["rank"] for r in rows if r["joined"]] == [2], rows  # the newcomer comes last
    assert all({2, 3} <= set(r["sizes"]) for r in rows if not r["joined"]), rows
