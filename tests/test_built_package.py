"""distcomm as a user installs it: the wheel and the sdist built from this checkout.

The editable install the tests normally run against hides what a built package lacks (a
folder without ``__init__.py`` once left ``distcomm.backends.transport`` out of every
wheel). These tests build both artefacts from a copy of the checkout with setuptools'
PEP 517 hooks (no network, no build isolation), check what each carries, install the
wheel into a folder of its own and run distcomm from there, never from the source tree.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: what a build needs from the checkout (MANIFEST.in names what else the sdist carries)
_BUILD_INPUTS = (
    "distcomm",
    "tests",
    "docs",
    "benchmarks",
    ".ci",
    "setup.py",
    "setup.cfg",
    "pyproject.toml",
    "MANIFEST.in",
    "README.md",
    "LICENSE",
    "CHANGELOG.md",
)

_BUILD = """
import sys
from setuptools import build_meta
out = sys.argv[1]
print(build_meta.build_sdist(out))
print(build_meta.build_wheel(out))
"""


def _run(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{' '.join(args)} exited {done.returncode}\n--- stdout\n{done.stdout[-4000:]}"
        f"\n--- stderr\n{done.stderr[-4000:]}"
    )
    return done


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel built from a copy of the checkout (the tree stays clean)."""
    pytest.importorskip("setuptools")
    pytest.importorskip(
        "wheel", reason="building a wheel needs the `wheel` package (part of the `test` extra)"
    )
    work = tmp_path_factory.mktemp("build")
    src = work / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.py[cod]", "*.egg-info", "*.whl")
    for name in _BUILD_INPUTS:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    out = work / "dist"
    out.mkdir()
    _run([sys.executable, "-c", _BUILD, str(out)], cwd=src)
    sdist = next(out.glob("distcomm-*.tar.gz"))
    wheel = next(out.glob("distcomm-*.whl"))
    return {"sdist": sdist, "wheel": wheel, "work": work}


def _package_dirs() -> list[str]:
    """Every folder of modules in the checkout's package, as a dotted name."""
    package = ROOT / "distcomm"
    found = []
    for d in [package, *sorted(package.rglob("*"))]:
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")):
            found.append(".".join(d.relative_to(ROOT).parts))
    return found


def _checkout_modules() -> set[str]:
    return {
        str(p.relative_to(ROOT))
        for p in (ROOT / "distcomm").rglob("*.py")
        if "__pycache__" not in p.parts
    }


def test_the_wheel_carries_every_module_and_package_of_the_checkout(built):
    with zipfile.ZipFile(built["wheel"]) as wheel:
        names = set(wheel.namelist())
    missing = sorted(_checkout_modules() - names)
    assert not missing, f"modules of the checkout missing from the wheel: {missing}"
    packages = [p for p in _package_dirs() if p.replace(".", "/") + "/__init__.py" not in names]
    assert not packages, f"folders not shipped as packages: {packages}"
    assert "distcomm/py.typed" in names
    extra = sorted(n for n in names if not n.startswith(("distcomm/", "distcomm-")))
    assert not extra, f"the wheel installs files outside the package: {extra}"


def test_the_sdist_carries_the_tests_docs_changelog_and_the_readmes_pictures(built):
    with tarfile.open(built["sdist"]) as sdist:
        top, names = None, set()
        for member in sdist.getmembers():
            top, _, rest = member.name.partition("/")
            names.add(rest)
    expected = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*.py")}
    expected |= {str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")}
    expected |= {"CHANGELOG.md", "LICENSE", "README.md", "MANIFEST.in"}
    expected |= _checkout_modules()
    readme = (ROOT / "README.md").read_text()
    pictures = set(re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", readme))
    assert pictures, "the README shows no picture: update this test"
    linked = set(re.findall(r"\]\(((?:docs|benchmarks)/[^)#\s]+)\)", readme))
    expected |= pictures | linked
    missing = sorted(expected - names)
    assert not missing, f"files missing from the sdist {top}: {missing}"
    assert not [n for n in names if "__pycache__" in n or n.endswith((".pyc", ".whl"))]


def _installed_env(target: Path) -> dict[str, str]:
    """An environment whose `python` finds distcomm only in `target` (before the editable
    install's finder, which site-packages appends after the path entries)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTCOMM_", "PYTHON"))}
    env["PYTHONPATH"] = str(target)
    env["PYTHONNOUSERSITE"] = "1"
    return env


@pytest.fixture(scope="module")
def installed(built) -> Path:
    target = built["work"] / "site"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--target",
            str(target),
            str(built["wheel"]),
        ],
        cwd=built["work"],
    )
    return target


_IMPORT_ALL = """
import importlib, pkgutil, sys
import distcomm
where = distcomm.__path__[0]
assert where.startswith(sys.argv[1]), f"distcomm came from {where}"
names = [info.name for info in pkgutil.walk_packages(distcomm.__path__, "distcomm.")
         if not info.name.endswith("__main__")]
for name in names:
    module = importlib.import_module(name)
    assert module.__file__.startswith(sys.argv[1]), (name, module.__file__)
print(len(names), "modules")
print("gloo", distcomm.is_gloo_available(), "mpi", distcomm.is_mpi_available(),
      "nccl", distcomm.is_nccl_available())
"""


def test_every_module_imports_from_the_installed_wheel(installed, tmp_path):
    done = _run(
        [sys.executable, "-c", _IMPORT_ALL, str(installed)],
        cwd=tmp_path,
        env=_installed_env(installed),
    )
    count = int(done.stdout.split()[0])
    assert count >= len(_checkout_modules()) - len(_package_dirs()) - 5, done.stdout
    assert "gloo True" in done.stdout, done.stdout


def test_the_readmes_first_job_runs_from_the_installed_wheel(installed, tmp_path):
    env = _installed_env(installed)
    info = _run([sys.executable, "-m", "distcomm.info"], cwd=tmp_path, env=env)
    assert f"({installed / 'distcomm'})" in info.stdout.splitlines()[0], info.stdout
    for backend in ("gloo", "tcp"):
        done = _run(
            [
                sys.executable,
                "-m",
                "distcomm.run",
                "--standalone",
                "--nproc_per_node=2",
                "-m",
                "distcomm.examples.quickstart",
                "--backend",
                backend,
            ],
            cwd=tmp_path,
            env=env,
        )
        assert re.search(r"^OK\b", done.stdout, re.M), done.stdout


def test_the_console_script_points_at_the_launcher(built):
    with zipfile.ZipFile(built["wheel"]) as wheel:
        entry = next(n for n in wheel.namelist() if n.endswith("entry_points.txt"))
        text = wheel.read(entry).decode()
    assert re.search(r"^distcomm-run\s*=\s*distcomm\.launch\.run:main$", text, re.M), text
