"""Judge distcomm by PyTorch's own test files: rewrite their imports, run them, report.

A developer tool, not part of the suite: ``pytest`` never collects this file (its name does
not start with ``test_``); ``tests/test_torch_suite.py`` checks its pure functions.

Usage (an interpreter with torch 2.13 and distcomm installed)::

    python tests/torch_suite.py --torch-tests DIR [--only PATTERN]
        [--report FILE] [--results FILE] [--reuse-baseline]

``--torch-tests`` is a copy of the parts of torch's ``test/`` tree named in `SUITES` (same
relative paths; torch's files are never committed here). For each file the runner

1. copies the tree into a scratch directory twice: unchanged (the baseline, run on real
   torch) and rewritten (`rewrite_source`: only imports of torch.distributed modules and
   dotted ``"torch.distributed...."`` strings such as ``mock.patch`` targets change, by
   `MODULE_MAP`; ``torch.testing`` and every other import stay torch's, but for the few
   helpers `NAME_MAP` reroutes to stand-ins here, such as `create_tcp_store`; a name that
   torch's module has and distcomm's counterpart lacks becomes a `MissingName` placeholder,
   so the file imports and only the tests that use the name fail);
2. runs pytest on the file in a subprocess of its own session, one file at a time, with a
   per-test watchdog and a per-file deadline; a hung test is killed with its process tree,
   recorded as ``timeout`` and the file resumed without it;
3. writes a Markdown report: per file, the tests torch passes and how many of those
   distcomm passes; distcomm's failures grouped by the first line of their error, with the
   tests `torch_suite_expect.EXPECT` marks "not applicable" or "documented difference"
   set apart from the real failures.

pytest and expecttest are needed by the child interpreter; if it lacks them, point
``--extra-path`` at a ``pip install --target DIR pytest expecttest`` folder.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import functools
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

#: the torch test files judged, relative to torch's repository root (globs)
SUITES: tuple[str, ...] = (
    "test/distributed/test_store.py",
    "test/distributed/elastic/timer/*.py",
    "test/distributed/elastic/rendezvous/*_test.py",
    "test/distributed/elastic/multiprocessing/errors/*_test.py",
    "test/distributed/launcher/test_run.py",
)

#: helper modules of the suites, copied with them but not run as test files
HELPERS: tuple[str, ...] = ("test/distributed/elastic/rendezvous/rendezvous_backend_test.py",)

#: (torch module, distcomm module or None to keep torch's, why). The rewriter uses the
#: longest entry that is the module itself (imports) or a dotted prefix of the string
#: (``mock.patch`` targets); a module under no entry but ``torch.distributed`` is kept.
MODULE_MAP: tuple[tuple[str, str | None, str], ...] = (
    ("torch.distributed", "distcomm", "docs/api.md public-modules: the package itself"),
    (
        "torch.distributed.distributed_c10d",
        "distcomm",
        "torch's c10d module; distcomm keeps its names at the top level",
    ),
    ("torch.distributed.constants", "distcomm", "default timeouts live at the top level"),
    ("torch.distributed.run", "distcomm.run", "docs/api.md public-modules"),
    ("torch.distributed.rendezvous", "distcomm.rendezvous", "docs/api.md public-modules"),
    ("torch.distributed.launch", "distcomm.launch", "docs/api.md public-modules"),
    (
        "torch.distributed.launcher",
        "distcomm.launch.api",
        "torch re-exports launcher.api's names from the package",
    ),
    ("torch.distributed.launcher.api", "distcomm.launch.api", "docs/api.md public-modules"),
    ("torch.distributed.elastic.timer", "distcomm.launch.timer", "docs/api.md public-modules"),
    (
        "torch.distributed.elastic.timer.api",
        "distcomm.launch.timer.api",
        "docs/api.md public-modules",
    ),
    (
        "torch.distributed.elastic.timer.local_timer",
        "distcomm.launch.timer.local_timer",
        "docs/api.md public-modules",
    ),
    (
        "torch.distributed.elastic.timer.file_based_local_timer",
        "distcomm.launch.timer.file_based_local_timer",
        "docs/api.md public-modules",
    ),
    (
        "torch.distributed.elastic.timer.debug_info_logging",
        "distcomm.launch.timer.debug_info_logging",
        "docs/api.md public-modules",
    ),
    (
        "torch.distributed.elastic.rendezvous",
        "distcomm.launch.rendezvous",
        "docs/api.md public-modules",
    ),
    (
        "torch.distributed.elastic.rendezvous.api",
        "distcomm.launch.rendezvous.api",
        "the interface module, as torch's (RendezvousBackend, the errors, parameters)",
    ),
    (
        "torch.distributed.elastic.rendezvous.registry",
        "distcomm.launch.rendezvous.registry",
        "the handler registry (get_rendezvous_handler)",
    ),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "distcomm.launch.rendezvous.dynamic_rendezvous",
        "torch's module path: DynamicRendezvousHandler, create_handler, RendezvousBackend, Token",
    ),
    (
        "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
        "distcomm.launch.rendezvous.c10d_rendezvous_backend",
        "torch's module path: C10dRendezvousBackend and create_backend",
    ),
    (
        "torch.distributed.elastic.rendezvous.etcd_rendezvous_backend",
        "distcomm.launch.rendezvous.etcd_rendezvous_backend",
        "torch's module path: EtcdRendezvousBackend and create_backend",
    ),
    (
        "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
        "distcomm.launch.rendezvous.static_tcp_rendezvous",
        "torch's module path: StaticTCPRendezvous and create_rdzv_handler",
    ),
    (
        "torch.distributed.elastic.rendezvous.utils",
        "distcomm.launch.rendezvous.utils",
        "torch's module path: parse_rendezvous_endpoint",
    ),
    (
        "torch.distributed.elastic.multiprocessing",
        "distcomm.launch.logs_specs",
        "docs/api.md public-modules (LogsSpecs, DefaultLogsSpecs)",
    ),
    (
        "torch.distributed.elastic.multiprocessing.errors",
        "distcomm.launch.errors",
        "docs/api.md public-modules",
    ),
    (
        "torch.distributed.elastic.multiprocessing.errors.error_handler",
        "distcomm.launch.errors.error_handler",
        "torch's module path: ErrorHandler",
    ),
    (
        "torch.distributed.elastic.multiprocessing.errors.handlers",
        "distcomm.launch.errors.handlers",
        "torch's module path: get_error_handler",
    ),
    ("torch.distributed.elastic.events", "distcomm.launch.events", "docs/api.md public-modules"),
    (
        "torch.distributed.elastic.agent.server",
        "distcomm.launch.agent",
        "the elastic agent (ElasticAgent); torch's package of agent modules",
    ),
    (
        "torch.distributed.elastic.agent.server.api",
        None,
        "keep torch's: test_run.py takes only RunResult/WorkerState from it, to build the value "
        "its mock of LocalElasticAgent.run returns; a torch type there judges the test on its own "
        "instead of failing the whole file's import",
    ),
    (
        "torch.distributed.elastic.agent.server.local_elastic_agent",
        "distcomm.launch.agent",
        "the agent that starts local workers",
    ),
    (
        "torch.distributed.elastic.utils",
        None,
        "test helpers (free ports, sockets) that exercise nothing of distcomm; torch's kept",
    ),
    (
        "torch.distributed.elastic.utils.distributed",
        None,
        "test helper get_free_port; torch's kept",
    ),
    ("torch.multiprocessing", "distcomm.multiprocessing", "docs/api.md public-modules"),
)

#: (module, name, module that provides ours, why): single names outside torch.distributed that
#: the rewriter reroutes, because torch's would build a torch object where the test means
#: the library under test
NAME_MAP: tuple[tuple[str, str, str, str], ...] = (
    (
        "torch.testing._internal.common_distributed",
        "create_tcp_store",
        "_torch_suite_plugin",
        "torch.testing's helper builds torch's TCPStore, so test_store.py's TCPStore tests would "
        "judge torch; `create_tcp_store` here takes its arguments and builds distcomm's",
    ),
)

_MAP: dict[str, str | None] = {torch: ours for torch, ours, _ in MODULE_MAP}
_NAMES: dict[tuple[str, str], str] = {(mod, name): ours for mod, name, ours, _ in NAME_MAP}
#: roots whose modules are rewritten; anything else (torch.testing, torch.nn) is left alone
_ROOTS = ("torch.distributed", "torch.multiprocessing")
#: a quoted dotted name starting at a string's first character, e.g. "torch.distributed.x.y"
_QUOTED = re.compile(r"""(?<=["'])(torch\.(?:distributed|multiprocessing)(?:\.\w+)*)(?=["'])""")
#: the pytest outcome words this runner records
PASSED, FAILED, ERROR, SKIPPED, TIMEOUT, NOT_RUN = (
    "passed",
    "failed",
    "error",
    "skipped",
    "timeout",
    "not run",
)


def _in_roots(module: str) -> bool:
    return any(module == root or module.startswith(root + ".") for root in _ROOTS)


def map_module(module: str) -> str | None:
    """Return distcomm's module for torch's `module`, or None where torch's is kept.

    Only exact entries of `MODULE_MAP` map; a torch.distributed submodule without one
    (torch has it, distcomm has nothing like it) is kept, so its test fails on torch's
    object rather than on a made-up distcomm name.
    """
    if not _in_roots(module):
        return None
    return _MAP.get(module)


def map_dotted(name: str) -> str | None:
    """Map a dotted reference ``module.attr...`` (a ``mock.patch`` target) by its longest
    `MODULE_MAP` prefix; None when that prefix is kept or there is none."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in _MAP:
            ours = _MAP[prefix]
            return None if ours is None else ".".join([ours, *parts[cut:]])
    return None


@functools.cache
def _module_names(module: str) -> frozenset[str] | None:
    try:
        return frozenset(dir(importlib.import_module(module)))
    except Exception:  # the module itself fails: let the test file's import say so
        return None


def distcomm_has(module: str, name: str) -> bool:
    """Whether ``from module import name`` works (True where `module` cannot be imported,
    so that failure stays an import error of the whole file)."""
    names = _module_names(module)
    if names is None or name in names:
        return True
    try:
        return importlib.util.find_spec(f"{module}.{name}") is not None
    except (ImportError, ValueError):
        return False


@dataclass
class Rewrite:
    """The rewritten text of one file and what the rewriter did to it."""

    text: str
    changed: list[str] = field(default_factory=list)  # "torch.x -> distcomm.y" per site
    kept: list[str] = field(default_factory=list)  # torch.distributed modules left as is
    missing: list[str] = field(default_factory=list)  # "distcomm.mod.name" given a placeholder


def _alias(alias: ast.alias) -> str:
    return alias.name if alias.asname is None else f"{alias.name} as {alias.asname}"


def _reroute_names(node: ast.ImportFrom, out: Rewrite) -> str | None:
    """``from torch.testing... import create_tcp_store, x``: the `NAME_MAP` names from ours."""
    moved = [a for a in node.names if (node.module, a.name) in _NAMES]
    if not moved:
        return None
    rest = [_alias(a) for a in node.names if a not in moved]
    stmts = [f"from {node.module} import {', '.join(rest)}"] if rest else []
    for alias in moved:
        ours = _NAMES[(node.module or "", alias.name)]
        out.changed.append(f"{node.module}.{alias.name} -> {ours}.{alias.name}")
        stmts.append(f"from {ours} import {_alias(alias)}")
    return "; ".join(stmts)


def _rewrite_import(
    node: ast.Import | ast.ImportFrom, out: Rewrite, has_name: Callable[[str, str], bool]
) -> str | None:
    """The replacement statement(s) for one import node, or None to leave it.

    A name that torch's module has and distcomm's counterpart lacks (`has_name` says) is
    bound to a `missing_name` placeholder instead, so the file still imports and only the
    tests that use the name fail, each saying which name it was.
    """
    if isinstance(node, ast.Import):
        parts, touched = [], False
        for alias in node.names:
            ours = map_module(alias.name)
            if ours is None or (alias.asname is None and "." in alias.name):
                # an unaliased "import torch.distributed.x" binds "torch": leave it whole
                if _in_roots(alias.name):
                    out.kept.append(alias.name)
                parts.append(f"import {_alias(alias)}")
                continue
            touched = True
            out.changed.append(f"{alias.name} -> {ours}")
            name = alias.asname or alias.name.rsplit(".", 1)[-1]
            parts.append(f"import {ours} as {name}")
        return "; ".join(parts) if touched else None
    if node.level or node.module is None:
        return None
    if not _in_roots(node.module):
        return _reroute_names(node, out)
    base = map_module(node.module)
    stmts: list[str] = []
    plain: list[str] = []
    holders: list[str] = []
    for alias in node.names:
        sub = map_module(f"{node.module}.{alias.name}")
        if sub is not None:  # "from torch.x import submodule": import the counterpart module
            out.changed.append(f"{node.module}.{alias.name} -> {sub}")
            stmts.append(f"import {sub} as {alias.asname or alias.name}")
        elif base is not None and not has_name(base, alias.name):
            out.missing.append(f"{base}.{alias.name}")
            holders.append(
                f"{alias.asname or alias.name} = _torch_suite_missing({base!r}, {alias.name!r})"
            )
        else:
            plain.append(_alias(alias))
    if plain:
        if base is None:
            out.kept.append(node.module)
            stmts.insert(0, f"from {node.module} import {', '.join(plain)}")
        else:
            out.changed.append(f"{node.module} -> {base}")
            stmts.insert(0, f"from {base} import {', '.join(plain)}")
    if holders:
        stmts += ["from _torch_suite_plugin import missing_name as _torch_suite_missing", *holders]
    if base is None and not any(s.startswith("import ") for s in stmts):
        return None
    return "; ".join(stmts)


def rewrite_source(text: str, has_name: Callable[[str, str], bool] = distcomm_has) -> Rewrite:
    """Point `text`'s torch.distributed imports and patch strings at distcomm.

    Import statements are replaced in place (a multi-line one becomes one line followed by
    blank lines, so line numbers in tracebacks still match torch's file); a string literal
    that is exactly a dotted torch.distributed reference is mapped by `map_dotted`; the
    `NAME_MAP` names are imported from their stand-ins; a name distcomm's module lacks becomes
    a placeholder (see `_rewrite_import`). Nothing else changes.
    """
    out = Rewrite(text)
    lines = text.splitlines(keepends=True)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return out
    for node in sorted(
        (n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)),
        key=lambda n: n.lineno,
        reverse=True,
    ):
        new = _rewrite_import(node, out, has_name)
        if new is None:
            continue
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        head = lines[first][: node.col_offset]
        tail = lines[last][node.end_col_offset :]
        lines[first : last + 1] = [head + new + tail] + ["\n"] * (last - first)
    text = "".join(lines)

    def quoted(match: re.Match[str]) -> str:
        ours = map_dotted(match.group(1))
        if ours is None:
            return match.group(1)
        out.changed.append(f"'{match.group(1)}' -> '{ours}'")
        return ours

    out.text = _QUOTED.sub(quoted, text)
    out.changed.reverse()
    return out


# ---------------------------------------------------------------------------------------
# pytest plugin: loaded into the child with -p, it appends one JSON line per event to the
# file named by TORCH_SUITE_EVENTS, so a run killed on a hang loses nothing already done.

_EVENTS_ENV = "TORCH_SUITE_EVENTS"


def _emit(record: dict) -> None:
    path = os.environ.get(_EVENTS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")


def _first_line(report: object) -> str:
    longrepr = getattr(report, "longrepr", None)
    crash = getattr(longrepr, "reprcrash", None)
    text = getattr(crash, "message", None) or str(longrepr or "")
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (file, line, reason)
        text = str(longrepr[2])
    if text.startswith("ImportError while importing"):  # pytest's wrapper: find the cause
        causes = [ln[1:].strip() for ln in str(longrepr).splitlines() if ln.startswith("E ")]
        text = causes[-1] if causes else text
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


def pytest_collection_finish(session: object) -> None:  # pragma: no cover
    _emit(
        {"event": "collected", "nodeids": [item.nodeid for item in getattr(session, "items", [])]}
    )


def pytest_runtest_logstart(nodeid: str, location: object) -> None:  # pragma: no cover
    _emit({"event": "start", "nodeid": nodeid, "time": time.time()})


def pytest_runtest_logreport(report: object) -> None:  # pragma: no cover
    when, outcome = getattr(report, "when", ""), getattr(report, "outcome", "")
    if when == "call" or outcome != "passed":
        word = outcome
        if outcome == "failed" and when != "call":
            word = ERROR
        if hasattr(report, "wasxfail"):
            word = "xfail" if outcome == "skipped" else "xpass"
        _emit(
            {
                "event": "result",
                "nodeid": report.nodeid,
                "when": when,  # type: ignore[attr-defined]
                "outcome": word,
                "message": _first_line(report),
            }
        )
    if when == "teardown":
        _emit({"event": "end", "nodeid": report.nodeid})  # type: ignore[attr-defined]


def pytest_collectreport(report: object) -> None:  # pragma: no cover
    if getattr(report, "outcome", "") == "failed":
        _emit(
            {
                "event": "collect-error",
                "nodeid": report.nodeid,  # type: ignore[attr-defined]
                "message": _first_line(report),
            }
        )


# ---------------------------------------------------------------------------------------
# stand-ins the rewritten files import from this module (copied as _torch_suite_plugin)


class MissingName:
    """Stands for a name torch's module has and distcomm's counterpart lacks.

    The rewriter binds it where the import would fail, so the test file still imports and
    each test is judged on its own: using the name (calling it, reading an attribute)
    raises the ImportError the import would have raised. A class may still derive from it
    (the base becomes `object`), as test files declare fakes of torch's private classes.
    """

    def __init__(self, module: str, name: str) -> None:
        self._where = (module, name)

    def _error(self) -> ImportError:
        module, name = self._where
        return ImportError(
            f"cannot import name {name!r} from {module!r} (torch_suite: "
            "distcomm has no counterpart; the test uses it)"
        )

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise self._error()

    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__"):  # introspection (pytest, mock, typing) sees a plain object
            raise AttributeError(attr)
        raise self._error()

    def __mro_entries__(self, bases: tuple) -> tuple[type, ...]:
        return (object,)

    def __repr__(self) -> str:
        return f"<missing {'.'.join(self._where)}>"


def missing_name(module: str, name: str) -> MissingName:
    """The placeholder for `name` of distcomm's `module` (see `MissingName`)."""
    return MissingName(module, name)


def _address_in_use(exc: BaseException) -> bool:
    import errno

    seen: BaseException | None = exc
    while seen is not None:
        if getattr(seen, "errno", None) == errno.EADDRINUSE or "in use" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def create_tcp_store(
    addr: str = "localhost",
    world_size: int = 1,
    is_master: bool = True,
    timeout: timedelta = timedelta(minutes=5),
    wait_for_workers: bool = True,
    jit_class: bool = False,
    use_libuv: bool = True,
    *,
    port: int | None = None,
    **kwargs: object,
) -> object:
    """A distcomm TCPStore where torch.testing's helper of this name builds torch's.

    Takes torch 2.13's parameters in its order (plus `port`, and keywords passed through
    to `distcomm.store.TCPStore`). Without `port` it picks a free one, as torch's does, and
    picks again (three tries) when another process takes it first, as torch's retry
    decorator does.
    """
    from distcomm.store import TCPStore

    if jit_class:
        raise NotImplementedError(
            "create_tcp_store(jit_class=True) builds torch's "
            "TorchScript TCPStore; distcomm has no TorchScript class"
        )
    for attempt in range(3):
        chosen = _free_port() if port is None else port
        try:
            return TCPStore(
                addr,
                chosen,
                world_size,
                is_master,
                timeout=timeout,
                wait_for_workers=wait_for_workers,
                use_libuv=use_libuv,
                **kwargs,
            )  # type: ignore[arg-type]
        except Exception as exc:
            if port is not None or attempt == 2 or not _address_in_use(exc):
                raise
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------
# running one file


@dataclass
class Outcome:
    """One test's result in one run."""

    outcome: str
    message: str = ""


def _kill_tree(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """SIGTERM the child's session and its process tree, then SIGKILL what is left."""
    try:
        import psutil

        family = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # psutil missing or the process already gone
        family = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for child in family:
            try:
                child.send_signal(sig)
            except Exception:
                pass
        try:
            proc.wait(grace)
            if sig == signal.SIGTERM:
                time.sleep(0.2)
                if not any(c.is_running() for c in family):
                    return
        except subprocess.TimeoutExpired:
            continue
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass


def fold_events(lines: Iterable[str]) -> tuple[dict[str, Outcome], str | None]:
    """Fold the plugin's event lines into per-test outcomes and the test left running."""
    results: dict[str, Outcome] = {}
    running: str | None = None
    for line in lines:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        kind, nodeid = ev.get("event"), ev.get("nodeid", "")
        if kind == "collected":
            for collected in ev.get("nodeids", []):
                results.setdefault(collected, Outcome(NOT_RUN))
        elif kind == "start":
            running = nodeid
        elif kind == "end":
            running = None
        elif kind == "collect-error":
            results[nodeid or "<collection>"] = Outcome(ERROR, "collection: " + ev["message"])
        elif kind == "result":
            old = results.get(nodeid)
            # the first failure wins (a call failure beats its teardown error)
            if old is None or old.outcome in (PASSED, SKIPPED, NOT_RUN):
                results[nodeid] = Outcome(ev["outcome"], ev.get("message", ""))
    return results, running


def run_file(
    python: str,
    root: Path,
    rel: str,
    env: dict[str, str],
    *,
    test_timeout: float,
    file_timeout: float,
    log: Path,
    skip: Iterable[str] = (),
) -> dict[str, Outcome]:
    """Run pytest on `root`/`rel` until every test has an outcome; return them by nodeid.

    A test running past `test_timeout` is killed (with its process tree), recorded as
    ``timeout`` and the file run again without the tests already done. The whole file
    stops after `file_timeout`; tests not reached are missing from the result. The
    `skip` nodeids are deselected from the start (the caller keeps their old outcomes).
    """
    test = root / rel
    events = log.with_suffix(".events")
    results: dict[str, Outcome] = {}
    deadline = time.monotonic() + file_timeout
    done: set[str] = set(skip)
    for _attempt in range(20):
        events.unlink(missing_ok=True)  # each attempt folds only its own events
        cmd = [
            python,
            "-m",
            "pytest",
            str(test),
            "-p",
            "_torch_suite_plugin",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rN",
            "--rootdir",
            str(test.parent),
            "-c",
            os.devnull,
            "-o",
            f"faulthandler_timeout={int(test_timeout - 5)}",
        ]
        cmd += [f"--deselect={nodeid}" for nodeid in sorted(done)]
        child_env = dict(env, **{_EVENTS_ENV: str(events)})
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            proc = subprocess.Popen(
                cmd,
                cwd=test.parent,
                env=child_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            hung: str | None = None
            try:
                while proc.poll() is None:
                    time.sleep(0.5)
                    _, running = fold_events(_read(events))
                    started = _start_time(events, running)
                    now = time.monotonic()
                    if running and started and time.time() - started > test_timeout:
                        hung = running
                    if hung or now > deadline:
                        _kill_tree(proc)
                        break
            finally:
                if proc.poll() is None:
                    _kill_tree(proc)
        got, running = fold_events(_read(events))
        results.update(got)
        if hung or (running and time.monotonic() > deadline):
            stuck = hung or running
            results[stuck] = Outcome(
                TIMEOUT, f"killed after {test_timeout:.0f} s" if hung else "file deadline reached"
            )
        if not hung or time.monotonic() > deadline:
            left = [n for n, o in results.items() if o.outcome == NOT_RUN]
            for nodeid in left:
                results[nodeid] = Outcome(
                    NOT_RUN, f"pytest exited (status {proc.returncode}) before this test ran"
                )
            break
        done = {n for n, o in results.items() if o.outcome != NOT_RUN}
    return results


def _read(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []


def _start_time(path: Path, nodeid: str | None) -> float | None:
    if nodeid is None:
        return None
    for line in reversed(_read(path)):
        if f'"nodeid": {json.dumps(nodeid)}' in line and '"event": "start"' in line:
            return json.loads(line)["time"]
    return None


# ---------------------------------------------------------------------------------------
# the tree copies


def find_files(
    torch_tests: Path, patterns: Sequence[str], only: str | Sequence[str] | None
) -> list[str]:
    """The test files under `torch_tests` matching `patterns` (minus helpers), sorted."""
    found: set[str] = set()
    for pattern in patterns:
        for path in torch_tests.glob(pattern):
            rel = path.relative_to(torch_tests).as_posix()
            if rel not in HELPERS and path.is_file():
                found.add(rel)
    if only:
        wanted = [only] if isinstance(only, str) else list(only)
        found = {rel for rel in found if any(w in rel or fnmatch.fnmatch(rel, w) for w in wanted)}
    return sorted(found)


def copy_tree(src: Path, dst: Path, rewrite: bool) -> dict[str, Rewrite]:
    """Copy `src` to `dst`, rewriting every .py file when `rewrite`; return the rewrites."""
    shutil.copytree(src, dst, symlinks=True)
    done: dict[str, Rewrite] = {}
    if rewrite:
        for path in sorted(dst.rglob("*.py")):
            result = rewrite_source(path.read_text(encoding="utf-8"))
            path.write_text(result.text, encoding="utf-8")
            done[path.relative_to(dst).as_posix()] = result
    shutil.copy(__file__, dst / "_torch_suite_plugin.py")
    return done


def child_env(extra_path: Sequence[str], plugin_dir: Path) -> dict[str, str]:
    """The environment of a suite's pytest: loopback networking, quiet torch, no DISTCOMM_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTCOMM_", "PET_"))}
    env.update(
        HYDRA_IFACE="lo",
        UCX_NET_DEVICES="lo",
        RES_OPTIONS="timeout:1 attempts:1",
        TORCH_CPP_LOG_LEVEL="ERROR",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONPATH=os.pathsep.join(
            [str(plugin_dir), *extra_path, env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep),
    )
    return env


# ---------------------------------------------------------------------------------------
# classification and report


def load_expect() -> dict[str, tuple[str, str]]:
    """`torch_suite_expect.EXPECT` ({nodeid glob: (kind, reason)}), or {} without one."""
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from torch_suite_expect import EXPECT  # type: ignore[import-not-found]
    except ImportError:
        return {}
    finally:
        sys.path.pop(0)
    return dict(EXPECT)


def classify(test: str, expect: dict[str, tuple[str, str]]) -> tuple[str, str] | None:
    """The (kind, reason) `expect` gives `test` ("file.py::Class::name"), if any."""
    for pattern, verdict in expect.items():
        if fnmatch.fnmatchcase(test, pattern):
            return verdict
    return None


#: where distcomm is installed: shown relative, so a report names no path of this machine
_HOME = str(Path(__file__).resolve().parent.parent) + os.sep
_NOISE = (
    (re.compile(re.escape(_HOME)), ""),
    (re.compile(r"0x[0-9a-fA-F]+"), "0x…"),
    (re.compile(r"/tmp/[^\s'\"]+"), "/tmp/…"),
    (re.compile(r"(?<![\w.])\d{4,}(?![\w.])"), "N"),
    (re.compile(r"\bpid \d+"), "pid N"),
)


def cause(message: str) -> str:
    """`message`'s first line with addresses, temp paths and big numbers blanked."""
    line = message.splitlines()[0] if message else "(no message)"
    for pattern, repl in _NOISE:
        line = pattern.sub(repl, line)
    return line[:240]


def build_report(
    files: Sequence[str],
    torch_runs: dict[str, dict[str, Outcome]],
    ours_runs: dict[str, dict[str, Outcome]],
    expect: dict[str, tuple[str, str]],
    rewrites: dict[str, Rewrite],
) -> str:
    """The Markdown report of one run (see the module docstring)."""
    rows, groups, per_test = [], defaultdict(list), []
    classified: list[tuple[str, str, str, str]] = []
    totals = defaultdict(int)
    for rel in files:
        base, ours = torch_runs.get(rel, {}), ours_runs.get(rel, {})
        short = rel.removeprefix("test/distributed/")
        counts = defaultdict(int)
        # a file distcomm cannot even import: its tests take the collection error
        broken = next((o for n, o in ours.items() if "::" not in n and o.outcome == ERROR), None)
        for nodeid in sorted(set(base) | set(ours)):
            if "::" not in nodeid:  # a collection error, reported through its tests
                continue
            b = base.get(nodeid, Outcome(NOT_RUN))
            o = ours.get(nodeid, broken or Outcome(NOT_RUN, "not collected"))
            test = f"{short}::{nodeid.split('::', 1)[-1]}" if "::" in nodeid else short
            per_test.append((test, b.outcome, o.outcome))
            counts["tests"] += 1
            if b.outcome != PASSED:
                counts["torch_not_passed"] += 1
                continue
            counts["torch"] += 1
            if o.outcome == PASSED:
                counts["ours"] += 1
                continue
            verdict = classify(test, expect)
            if verdict:
                kind, reason = verdict
                counts["na" if kind == "not applicable" else "documented"] += 1
                classified.append((kind, reason, test, cause(o.message or o.outcome)))
            else:
                counts["failed"] += 1
                groups[cause(o.message or o.outcome)].append(test)
        for key, value in counts.items():
            totals[key] += value
        rows.append((short, counts))
    out = ["# distcomm against PyTorch 2.13's own tests", ""]
    out.append(
        f"Generated by `tests/torch_suite.py` on {time.strftime('%Y-%m-%d %H:%M')}. "
        "A test counts for distcomm only where torch itself passes it; "
        '"failed" excludes the tests classified in `tests/torch_suite_expect.py`.'
    )
    out += [
        "",
        "## Counts per file",
        "",
        "| file | tests | torch passed | distcomm passed | distcomm failed "
        "| not applicable | documented difference | torch did not pass |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for short, c in [*rows, ("**total**", totals)]:
        out.append(
            f"| {short} | {c['tests']} | {c['torch']} | {c['ours']} | {c['failed']} "
            f"| {c['na']} | {c['documented']} | {c['torch_not_passed']} |"
        )
    out += [
        "",
        "## distcomm failures grouped by cause",
        "",
        "Each group: the first line of the error (addresses, temp paths and long numbers "
        "blanked), how many tests, and which.",
        "",
    ]
    for i, (line, tests) in enumerate(sorted(groups.items(), key=lambda g: (-len(g[1]), g[0])), 1):
        out.append(f"### {i}. `{line}` ({len(tests)})")
        out.append("")
        out += [f"- {t}" for t in tests]
        out.append("")
    if classified:
        out += [
            "## Classified (not counted as failures)",
            "",
            "| test | kind | reason | distcomm's error |",
            "|---|---|---|---|",
        ]
        for kind, reason, test, line in sorted(classified, key=lambda c: c[2]):
            out.append(f"| {test} | {kind} | {reason} | `{line}` |")
        out.append("")
    out += [
        "## Every test",
        "",
        "<details><summary>torch's and distcomm's outcome per test</summary>",
        "",
        "| test | torch | distcomm |",
        "|---|---|---|",
    ]
    out += [f"| {t} | {b} | {o} |" for t, b, o in per_test]
    out += [
        "",
        "</details>",
        "",
        "## Import rewriting",
        "",
        "| torch module | distcomm module | why |",
        "|---|---|---|",
    ]
    out += [f"| `{t}` | {f'`{o}`' if o else 'kept (torch)'} | {why} |" for t, o, why in MODULE_MAP]
    out += [
        f"| `{m}.{n}` | `tests/torch_suite.py`'s `{n}` (as `{o}`) | {why} |"
        for m, n, o, why in NAME_MAP
    ]
    missing = sorted({k for r in rewrites.values() for k in r.missing})
    if missing:
        out += [
            "",
            "Names torch's modules have and distcomm's counterparts lack, bound to a "
            "placeholder so the file imports (a test that uses one fails with "
            "`ImportError: cannot import name ...`): " + ", ".join(f"`{k}`" for k in missing),
        ]
    kept = sorted({k for r in rewrites.values() for k in r.kept})
    if kept:
        out += [
            "",
            "torch.distributed modules left pointing at torch (no counterpart): "
            + ", ".join(f"`{k}`" for k in kept),
        ]
    out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------


def _save(path: Path | None, runs: dict[str, dict[str, dict[str, Outcome]]]) -> None:
    if path is None:
        return
    data = {
        mode: {rel: {n: vars(o) for n, o in res.items()} for rel, res in by_file.items()}
        for mode, by_file in runs.items()
    }
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def _load(path: Path) -> dict[str, dict[str, dict[str, Outcome]]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return {
        mode: {rel: {n: Outcome(**o) for n, o in res.items()} for rel, res in by.items()}
        for mode, by in data.items()
    }


def _reported(every: Sequence[str], runs: dict[str, dict[str, dict[str, Outcome]]]) -> list[str]:
    return [rel for rel in every if any(rel in by_file for by_file in runs.values())]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--torch-tests",
        type=Path,
        required=True,
        help="a copy of torch's test/ tree's files (the repository's paths)",
    )
    parser.add_argument(
        "--only",
        action="append",
        help="run only files whose path contains (or globs) this (repeatable)",
    )
    parser.add_argument("--report", type=Path, default=Path("torch-suite-report.md"))
    parser.add_argument(
        "--results", type=Path, help="JSON of every outcome, written after each file"
    )
    parser.add_argument(
        "--reuse-baseline",
        action="store_true",
        help="keep torch's outcomes from --results instead of rerunning",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild the report from --results without running anything",
    )
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="the interpreter with torch and distcomm (default: this one)",
    )
    parser.add_argument(
        "--extra-path",
        action="append",
        default=[],
        help="a folder added to the children's PYTHONPATH (pytest, expecttest)",
    )
    parser.add_argument(
        "--logs", type=Path, help="keep each run's pytest output here (default: discarded)"
    )
    parser.add_argument("--test-timeout", type=float, default=240.0)
    parser.add_argument("--file-timeout", type=float, default=1500.0)
    parser.add_argument(
        "--keep-previous",
        action="append",
        default=[],
        metavar="GLOB",
        help="tests (nodeid globs) not run again: their outcome in --results "
        "stays (for known hangs, such as test_store.py's RPC tests)",
    )
    parser.add_argument(
        "--skip-torch",
        action="store_true",
        help="run only distcomm (the report then counts nothing)",
    )
    args = parser.parse_args(argv)

    files = find_files(args.torch_tests, SUITES, args.only)
    if not files:
        parser.error(f"no test files under {args.torch_tests} match {SUITES}")
    runs: dict[str, dict[str, dict[str, Outcome]]] = {"torch": {}, "distcomm": {}}
    if args.results and args.results.exists():
        # earlier outcomes stay in the report; the files run now replace theirs
        runs.update(_load(args.results))
    every = find_files(args.torch_tests, SUITES, None)
    scratch = Path(tempfile.mkdtemp(prefix="torch-suite-"))
    rewrites: dict[str, Rewrite] = {}

    def write_report() -> None:
        if args.report:
            text = build_report(
                _reported(every, runs), runs["torch"], runs["distcomm"], load_expect(), rewrites
            )
            args.report.write_text(text, encoding="utf-8")

    try:
        trees = {"torch": scratch / "torch", "distcomm": scratch / "distcomm"}
        copy_tree(args.torch_tests, trees["torch"], rewrite=False)
        rewrites = copy_tree(args.torch_tests, trees["distcomm"], rewrite=True)
        logs = args.logs or scratch / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for rel in [] if args.report_only else files:
            for mode in ("torch", "distcomm"):
                reuse = args.reuse_baseline and rel in runs["torch"]
                if mode == "torch" and (args.skip_torch or reuse):
                    continue
                log = logs / f"{mode}-{rel.replace('/', '_')}.log"
                log.unlink(missing_ok=True)
                began = time.monotonic()
                old = runs[mode].get(rel, {})
                kept = {
                    n: o
                    for n, o in old.items()
                    if any(fnmatch.fnmatchcase(n, g) for g in args.keep_previous)
                }
                res = run_file(
                    args.python,
                    trees[mode],
                    rel,
                    child_env(args.extra_path, trees[mode]),
                    test_timeout=args.test_timeout,
                    file_timeout=args.file_timeout,
                    log=log,
                    skip=kept,
                )
                res.update(kept)
                runs[mode][rel] = res
                tally: dict[str, int] = defaultdict(int)
                for o in res.values():
                    tally[o.outcome] += 1
                print(
                    f"[{mode:8}] {rel}: {dict(tally)} in {time.monotonic() - began:.0f} s"
                    f" (log: {log})",
                    flush=True,
                )
                _save(args.results, runs)
                write_report()
        write_report()
        if args.report:
            print(f"report: {args.report}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
