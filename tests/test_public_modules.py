"""The public modules: the README's list, their `__all__`, and examples that use only them."""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import distcomm

ROOT = Path(__file__).resolve().parent.parent
#: the README and the docs pages (the table is on docs/api.md), but architecture.md, the one
#: page that names internal modules on purpose (test_readme checks the reference/ pages)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README = "\n".join(p.read_text() for p in PAGES if p.name != "architecture.md")


def _listed() -> list[str]:
    match = re.search(r"<!-- public-modules -->\n(.*?)\n<!-- /public-modules -->", README, re.S)
    assert match, "docs/api.md lacks the <!-- public-modules --> section"
    return re.findall(r"^\| `([a-z0-9_.]+)` \|", match.group(1), re.M)


PUBLIC = _listed()


def _all_modules() -> list[str]:
    names = ["distcomm"]
    for info in pkgutil.walk_packages(distcomm.__path__, "distcomm."):
        names.append(info.name)
    return names


def test_the_list_is_not_empty_and_every_entry_is_a_module():
    assert "distcomm" in PUBLIC and len(PUBLIC) >= 10, PUBLIC
    modules = set(_all_modules())
    assert not set(PUBLIC) - modules, sorted(set(PUBLIC) - modules)


@pytest.mark.parametrize("name", PUBLIC)
def test_a_public_module_declares_what_it_exports(name):
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert isinstance(exported, (list, tuple)), f"{name} has no __all__"
    for attr in exported:
        assert hasattr(module, attr), f"{name}.__all__ names {attr!r}, which it lacks"


def _public_or_under_public(dotted: str) -> bool:
    """`dotted` (a module or module.attribute the README names) is reached through a
    public module: the longest importable prefix is in the list."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in PUBLIC:
            return True
        try:
            importlib.import_module(prefix)
        except ImportError:
            continue
        return False  # an importable module that is not public
    return False


def test_the_readme_reaches_distcomm_only_through_public_modules():
    text = README.replace(
        re.search(r"<!-- public-modules -->.*?<!-- /public-modules -->", README, re.S).group(0), ""
    )
    named = set(re.findall(r"\b(distcomm(?:\.[a-z_][a-z0-9_]*)+)", text))
    named = {n for n in named if not n.startswith('distcomm.backends" ')}
    internal = sorted(n for n in named if not _public_or_under_public(n))
    assert not internal, (
        f"the README names internal modules {internal}: use a public module "
        "(README 'Public modules'), or add the module to that list with an __all__"
    )


def _loaded_after(code: str, watched: list[str]) -> list[str]:
    """Which of `watched` a fresh interpreter has imported after running `code`."""
    probe = f"import sys\n{code}\nprint(' '.join(m for m in {watched!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout.split()


def test_the_launcher_and_a_store_client_do_not_import_the_collectives():
    """`import distcomm` is lazy: distcomm-run's agent and a store client start without
    numpy, the collectives, the entry-point scan or the etcd HTTP client."""
    heavy = ["numpy", "distcomm.group", "importlib.metadata", "http.client"]
    assert _loaded_after("import distcomm.run", heavy) == []
    assert _loaded_after("import distcomm; distcomm.TCPStore", heavy) == []


def test_a_worker_pays_only_for_what_it_uses():
    code = "import distcomm; distcomm.init_process_group; distcomm.all_reduce; distcomm.barrier"
    watched = ["numpy", "importlib.metadata", "http.client", "psutil"]
    assert _loaded_after(code, watched) == ["numpy"]
    assert _loaded_after("import distcomm; distcomm.EtcdStore", ["http.client"]) == ["http.client"]
