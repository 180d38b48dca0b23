"""Find import cycles in the distcomm package, reading its source with `ast` only.

Run it as a script (``python tests/import_cycles.py``): it prints each cycle (strongly
connected component of the import graph) with its modules, then how many there are, and
exits with status 1 when there is at least one. `tests/test_structure.py` asserts the
count is 0. It imports nothing of distcomm, so a cycle that would fail at import time
is still reported rather than crashing the check.

The graph (DESIGN.md: "imports only go down ... not even lazily inside a function"):

- A node is a module of the package, named by its dotted path (``distcomm.group``;
  a package is its ``__init__``, ``distcomm.trace``).
- Every ``import`` and ``from ... import`` statement counts, at module level and
  inside functions, methods and classes, except those in the body of an
  ``if TYPE_CHECKING:`` (or ``if typing.TYPE_CHECKING:``) block, which never run.
- Relative imports are resolved against the importing module's package
  (``from ..store import Store`` in ``distcomm.bootstrap.api`` is
  ``distcomm.store``); absolute ones that name ``distcomm`` count the same way;
  imports of other packages are ignored.
- ``import a.b.c`` and ``from a.b import c`` (where ``c`` is not a module) are an edge
  to the module named (``a.b.c``, ``a.b``), not to the packages above it.
- ``from pkg import name`` is an edge to ``pkg`` (its ``__init__``, where ``name`` is
  defined) and, when ``name`` is a submodule of ``pkg`` (``from . import config``,
  ``from .trace import stall``), to that submodule instead: like ``import pkg.sub``,
  it runs ``pkg/__init__`` only as the parent of the module named, and parents are not
  counted (else every package whose ``__init__`` re-exports a submodule that does
  ``from . import sibling`` would be a cycle of no consequence). Each name of one
  statement counts on its own: ``from . import config, load`` is an edge to both.
- Dynamic imports (``importlib.import_module``) are not seen.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "distcomm"


def package_root() -> Path:
    """The package's directory: ``distcomm/`` beside this script's ``tests/``."""
    return Path(__file__).resolve().parent.parent / PACKAGE


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package under `root`: dotted name -> file."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    """Whether an `if` test is ``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run: every one, except under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # the else branch does run
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def edges_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the package that module `name` (file `path`) imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    targets.add(alias.name)
            continue
        if node.level:
            base_parts = package.split(".")
            if node.level > 1:
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts)
            origin = f"{base}.{node.module}" if node.module else base
        else:
            origin = node.module or ""
        if origin not in modules:
            continue
        for alias in node.names:
            sub = f"{origin}.{alias.name}"
            targets.add(sub if sub in modules else origin)
    targets.discard(name)
    return targets


def import_graph(root: Path | None = None) -> dict[str, set[str]]:
    """The package's import graph: module -> the modules it imports (see the docstring)."""
    modules = module_names(root or package_root())
    return {name: edges_of(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` (iterative Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def cycles(graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    """The import cycles: components of more than one module (a module importing itself
    is not counted: `edges_of` drops such edges)."""
    graph = import_graph() if graph is None else graph
    return sorted(c for c in strongly_connected(graph) if len(c) > 1)


def main() -> int:
    """Print each cycle and the count; 1 when there is any, else 0."""
    found = cycles()
    for i, component in enumerate(found, 1):
        print(f"cycle {i} ({len(component)} modules): {', '.join(component)}")
    print(f"{len(found)} import cycle(s) in {PACKAGE}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
