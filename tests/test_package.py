"""The package as a user meets it: its version, the launcher's --version, its licence."""

from __future__ import annotations

import configparser
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import distcomm

ROOT = Path(__file__).resolve().parent.parent


def test_version_is_the_installed_distributions():
    assert re.fullmatch(r"\d+\.\d+\.\d+(?:(?:a|b|rc)\d+)?(?:\.dev\d+)?", distcomm.__version__)
    assert importlib.metadata.version("distcomm") == distcomm.__version__


def test_the_launcher_says_its_version():
    for module in ("distcomm.run", "distcomm.launch.run"):
        done = subprocess.run(
            [sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"distcomm-run (distcomm {distcomm.__version__})"


def test_the_licence_file_is_the_one_the_metadata_names():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert config["metadata"]["license"] == "BSD-3-Clause"
    text = (ROOT / "LICENSE").read_text()
    assert "Redistribution and use in source and binary forms" in text
    assert "Neither the name of the copyright holder nor the names of its" in text


def test_the_changelog_has_an_entry_for_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(distcomm.__version__)}\b", text, re.MULTILINE)


def test_every_folder_of_modules_is_a_package():
    # setup.cfg's `packages = find:` ships only folders with an __init__.py: one without
    # it (distcomm/backends/transport once) is missing from every wheel and sdist
    package = ROOT / "distcomm"
    missing = sorted(
        str(d.relative_to(ROOT))
        for d in [package, *package.rglob("*")]
        if d.is_dir()
        and d.name != "__pycache__"
        and any(d.glob("*.py"))
        and not (d / "__init__.py").exists()
    )
    assert not missing, f"folders of modules without __init__.py: {missing}"
