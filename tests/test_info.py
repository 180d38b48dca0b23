"""python -m distcomm.info: the report a bug report starts with, in a shell and under mpiexec."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import distcomm
from tests.mpijobs import LAUNCHER, SKIP_REASON, job_env, no_mpi_segment_left, run  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


def _info(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in job_env().items() if not k.startswith("DISTCOMM_")}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "distcomm.info", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
        cwd=REPO,
    )


def test_the_text_report_names_versions_backends_and_the_environment():
    done = _info(DISTCOMM_GLOO_TRANSPORT="tcp")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert f"distcomm version: {distcomm.__version__}" in text
    assert f"Python version: {sys.version.split()[0]}" in text
    assert "numpy version: " in text
    assert "  tcp (cpu): available" in text
    assert "/dev/shm: " in text and re.search(r"\d (GiB|MiB) free", text)
    assert "Launcher: a shell (no launcher detected)" in text
    assert "  DISTCOMM_GLOO_TRANSPORT=tcp" in text


def test_json_holds_the_same_facts():
    done = _info("--json", DISTCOMM_GLOO_TRANSPORT="tcp")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["distcomm"]["version"] == distcomm.__version__
    assert info["backends"]["tcp"] == {"devices": ["cpu"], "available": True, "why_not": None}
    assert info["backends"]["gloo"]["available"] is True
    nccl = info["backends"]["nccl"]
    # available where CuPy and its NCCL load, GPU or not (torch's is_nccl_available)
    assert nccl["available"] is (info["gpu"].get("nccl") is not None)
    if not nccl["available"]:
        assert nccl["why_not"].startswith("the nccl backend"), nccl
    assert info["distcomm_variables"] == {"DISTCOMM_GLOO_TRANSPORT": "tcp"}
    assert info["shm"]["total_bytes"] >= info["shm"]["free_bytes"] > 0
    assert info["threads"]["num_threads"] >= 1
    if info["mpi"]["mpi4py"] is not None:
        assert info["mpi"]["library"]  # asked without initialising MPI
        assert info["mpi"]["initialized"] is False


def test_a_bad_flag_is_a_usage_error():
    done = _info("--jsn")
    assert done.returncode == 2
    assert "unrecognized arguments: --jsn" in done.stderr


@pytest.mark.skipif(LAUNCHER is None, reason=f"needs mpiexec: {SKIP_REASON}")
def test_under_mpiexec_every_rank_reports_its_mpi_launcher(tmp_path):
    # each rank writes its own file: two ranks' output could interleave on mpiexec's stdout
    code = (
        "import os, sys, distcomm.info as info; "
        "rank = next(os.environ[v] for v in ('PMI_RANK', 'OMPI_COMM_WORLD_RANK', 'PMIX_RANK') "
        "if v in os.environ); "
        "sys.stdout = open(f'info-{rank}.json', 'w'); info.main(['--json']); sys.stdout.close()"
    )
    done = run(LAUNCHER.command(2, sys.executable, "-c", code), cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    reports = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("info-*.json"))]
    assert len(reports) == 2
    for report in reports:
        assert report["mpi"]["library"]
        (started_by,) = report["launcher"]["started_by"]
        assert "mpiexec/mpirun" in started_by, started_by


def test_small_shm_is_shown_in_mib():
    """A container's 64 MiB /dev/shm must not read as "0.1 GiB"."""
    from distcomm import info

    report = info.collect()
    report["shm"] = {"path": "/dev/shm", "total_bytes": 64 << 20, "free_bytes": 3 << 20}
    assert "/dev/shm: 64 MiB total, 3 MiB free" in info.render(report)
    report["shm"] = {"path": "/dev/shm", "total_bytes": 12 << 30, "free_bytes": 11 << 30}
    assert "/dev/shm: 12.0 GiB total, 11.0 GiB free" in info.render(report)


@pytest.mark.parametrize(
    ("cupy_init", "sentence"),
    [
        (  # CuPy not installed
            "raise ModuleNotFoundError(\"No module named 'cupy'\", name='cupy')\n",
            "install the packages matching your CUDA version: pip install cupy-cuda12x",
        ),
        (  # installed, but its import fails: CuPy's without the NVIDIA driver
            "raise ImportError('libcuda.so.1: cannot open shared object file')\n",
            "fails to import (ImportError: libcuda.so.1: cannot open shared object file)",
        ),
    ],
)
def test_the_cupy_sentence_is_printed_once(tmp_path, cupy_init, sentence):
    """The GPU line says why CuPy cannot be used; the nccl line points there."""
    site = tmp_path / "site"
    (site / "cupy").mkdir(parents=True)
    (site / "cupy" / "__init__.py").write_text(cupy_init)
    done = _info(PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert text.count(sentence) == 1, text
    (gpu,) = [line for line in text.splitlines() if line.startswith("GPU: ")]
    assert sentence in gpu, text
    assert "  nccl (cuda): unavailable: the nccl backend needs CuPy (see GPU above)\n" in text
    report = json.loads(_info("--json", PYTHONPATH=os.pathsep.join([str(site), str(REPO)])).stdout)
    assert sentence in report["backends"]["nccl"]["why_not"]  # the JSON keeps it whole
