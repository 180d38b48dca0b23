"""The declaration of environment variables in `distcomm.config`: every variable the
package names or reads is declared, every declared one is read (or set for the worker's
script), the docs' table is generated from it, and its parsers refuse bad values with a
message naming the variable."""

from __future__ import annotations

import ast
import importlib.util
import math
import re
from pathlib import Path

import pytest

from distcomm import config
from distcomm.launch.run import get_args_parser

ROOT = Path(__file__).resolve().parent.parent
LITERAL = re.compile(r"DISTCOMM_[A-Z0-9_]+")


def _flag_variables() -> set[str]:
    """DISTCOMM_<FLAG> of every distcomm-run flag."""
    parser = get_args_parser()
    return {config.FLAG_PREFIX + action.dest.upper() for action in parser._actions}


def test_every_variable_named_in_the_package_is_declared():
    declared = {var.name for var in config.VARIABLES} | _flag_variables()
    missing = {}
    for path in sorted((ROOT / "distcomm").rglob("*.py")):
        for name in LITERAL.findall(path.read_text()):
            if name.endswith("_"):  # the start of a name built in an f-string
                if any(d.startswith(name) for d in declared):
                    continue
            elif name in declared:
                continue
            missing.setdefault(name, str(path.relative_to(ROOT)))
    assert not missing, f"declare these in distcomm.config.VARIABLES: {missing}"


def test_declared_names_are_unique_and_defaults_parse():
    names = [var.name for var in config.VARIABLES]
    assert len(names) == len(set(names))
    for var in config.VARIABLES:
        if not var.name.endswith("<FLAG>"):
            config.get(var.name, {})  # the default is a value the parser takes


def test_the_docs_table_is_the_generated_one():
    # docs/environment.md holds only the markers; the site's build (docs/hooks.py) fills
    # them with python -m distcomm.config's table, so there is no copy to go stale
    page = (ROOT / "docs" / "environment.md").read_text()
    assert "<!-- env-table -->\n<!-- /env-table -->" in page, (
        "docs/environment.md: leave the env-table markers empty; the docs build fills them"
    )
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    filled = hooks.fill_env_table(page)
    match = re.search(r"<!-- env-table -->\n(.*?)\n<!-- /env-table -->", filled, re.DOTALL)
    assert match and match[1] == config.env_table(), filled


def test_load_reads_through_the_declaration():
    cfg = config.load(
        {
            "DISTCOMM_AUTH_KEY": "k",
            "DISTCOMM_TIMEOUT": "12.5",
            "DISTCOMM_STALL_WARN_S": " ",  # blank: the default
            "DISTCOMM_USE_AGENT_STORE": "yes",
            "DISTCOMM_STORE_MAX_KEY_BYTES": "1K",
            "DISTCOMM_MPI_ABORT_ON_EXCEPTION": "off",
            "TORCH_DISTRIBUTED_DEBUG": "detail",
        }
    )
    assert cfg.auth_key == b"k" and cfg.timeout == 12.5 and cfg.stall_warn_s == 30.0
    assert cfg.use_agent_store and cfg.store_max_key_bytes == 1024
    assert not cfg.mpi_abort_on_exception and cfg.debug == "DETAIL"
    assert config.load({"DISTCOMM_DEBUG": "info", "TORCH_DISTRIBUTED_DEBUG": "detail"}).debug == (
        "INFO"
    )
    assert config.load({}) == config.Config()


def test_torch_socket_ifname_is_read_when_ours_is_unset():
    assert config.load({"GLOO_SOCKET_IFNAME": "lo"}).socket_ifname == "lo"
    assert config.load({"GLOO_SOCKET_IFNAME": " lo , eth0"}).socket_ifname == "lo"
    both = {"GLOO_SOCKET_IFNAME": "lo", "DISTCOMM_SOCKET_IFNAME": "eth0"}
    assert config.load(both).socket_ifname == "eth0"
    assert config.load({"GLOO_SOCKET_IFNAME": " "}).socket_ifname is None


def test_get_refuses_an_undeclared_name():
    with pytest.raises(KeyError):
        config.get("DISTCOMM_NOT_DECLARED", {})


@pytest.mark.parametrize("text", ["1", "true", "YES", " on "])
def test_parse_bool_true(text):
    assert config.parse_bool("X", text) is True


@pytest.mark.parametrize("text", ["0", "false", "No", "off", ""])
def test_parse_bool_false(text):
    assert config.parse_bool("X", text) is False


def test_parse_bool_errors():
    with pytest.raises(ValueError, match=r"^X='maybe' is not a boolean: use 1/0, true/false"):
        config.parse_bool("X", "maybe")
    with pytest.raises(ValueError, match="--rdzv_conf k='' is not a boolean"):
        config.parse_bool("--rdzv_conf k", "", empty=None)
    assert config.parse_bool("X", "", empty=True) is True


def test_positive_seconds():
    assert config.positive_seconds("X", "2.5") == 2.5
    assert config.positive_seconds("X", 3) == 3.0
    assert config.positive_seconds("X", 0, zero=True) == 0.0
    assert config.positive_seconds("X", "inf") == math.inf
    for bad in ("0", "-1", "soon", "nan", 0, -2.0):
        with pytest.raises(ValueError, match=r"^X=.* must be a positive number of seconds$"):
            config.positive_seconds("X", bad)
    with pytest.raises(ValueError, match=r"must be a number of seconds >= 0: hint"):
        config.positive_seconds("X", "-1", zero=True, hint=": hint")
    with pytest.raises(ValueError, match="positive number of seconds"):
        config.positive_seconds("X", math.inf, finite=True)
    for bad in (True, None, [1]):
        with pytest.raises(TypeError, match="X must be a number of seconds, got"):
            config.positive_seconds("X", bad)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("DISTCOMM_TIMEOUT", "soon", "DISTCOMM_TIMEOUT='soon' must be a positive number"),
        ("DISTCOMM_TIMEOUT", "-1", "DISTCOMM_TIMEOUT='-1' must be a positive number"),
        ("DISTCOMM_STALL_WARN_S", "-3", "or 0 to turn the stall warnings off"),
        ("DISTCOMM_STALL_WARN_S", "inf", "DISTCOMM_STALL_WARN_S='inf' must be a number"),
        ("DISTCOMM_STORE_MAX_KEY_BYTES", "4T", "is not a size from 1 byte to 4G - 2M"),
        ("DISTCOMM_STORE_MAX_VALUE_BYTES", "0", "is not a size from 1 byte"),
        ("DISTCOMM_TRACE_BUFFER", "-1", "is not a count: write a whole number >= 0"),
        ("DISTCOMM_DEBUG", "loud", "DISTCOMM_DEBUG='LOUD' is not one of OFF, INFO, DETAIL"),
        ("DISTCOMM_GLOO_TRANSPORT", "udp", "DISTCOMM_GLOO_TRANSPORT='udp' is not valid"),
        ("DISTCOMM_NCCL_BLOCKING_WAIT", "maybe", "'maybe' is not a boolean"),
    ],
)
def test_declared_parsers_name_the_variable(name, text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config.get(name, {name: text})


def test_parse_size():
    assert config.parse_size("256K") == 256 << 10
    assert config.parse_size(" 8m ") == 8 << 20
    assert config.parse_size("12") == 12
    assert config.parse_size("1.5M") is None


# -- every variable read is declared, and every declared one is read ------------------------

#: Names of a mapping that holds the environment (`env.get("RANK")`, `environ["X"]`).
_ENVIRON_NAMES = {"env", "environ", "environment"}
_ENV_NAME = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*")
#: Reads whose variable is named at run time and belongs to a declared family, with why.
_DYNAMIC_FAMILIES = {
    ("distcomm/launch/env_flags.py", "name"): "DISTCOMM_<FLAG> and torchrun's PET_<FLAG>",
    ("distcomm/config.py", "name"): "config.get itself: its callers name the variable",
}


def _is_environ(node: ast.AST) -> bool:
    """`os.environ`, `self.environ`, or a mapping named env/environ/environment."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ"
    return isinstance(node, ast.Name) and node.id in _ENVIRON_NAMES


def _str_tuple(node: ast.AST | None) -> list[str] | None:
    """The strings of a str constant or a tuple/list of them; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List)) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
    ):
        return [e.value for e in node.elts]  # type: ignore[attr-defined]
    return None


class _Module:
    """One source file: its constants, loop variables, config readers and variable tables."""

    def __init__(self, path: Path, constants: dict[str, list[str]]) -> None:
        self.rel = str(path.relative_to(ROOT))
        self.tree = ast.parse(path.read_text())
        self.constants = constants
        self.bound: dict[str, list[ast.AST]] = {}  # name -> assigned values and loop iterables
        self.readers = {"getenv"}  # names that call config.get (or os.getenv)
        self.config_names: set[str] = set()  # names bound to the distcomm.config module
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.bound.setdefault(target.id, []).append(node.value)
            elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(
                node.target, ast.Name
            ):
                self.bound.setdefault(node.target.id, []).append(ast.Starred(node.iter))
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""  # None in `from .. import config`
                for alias in node.names:
                    local = alias.asname or alias.name
                    if alias.name == "config" and source in ("", "distcomm"):
                        self.config_names.add(local)
                    elif alias.name == "get" and source.split(".")[-1] == "config":
                        self.readers.add(local)
        if self.rel == "distcomm/config.py":
            self.readers |= {"get", "read"}  # `get` and `load`'s `read` are its readers
        self.tables = [  # *_VARS / *_VARIABLES tables: names, or (name, ...) tuples
            (e.elts[0] if isinstance(e, ast.Tuple) and e.elts else e).value
            for node in self.tree.body
            if isinstance(node, ast.Assign)
            and any(
                isinstance(t, ast.Name) and t.id.endswith(("_VARS", "_VARIABLES"))
                for t in node.targets
            )
            and isinstance(node.value, (ast.Tuple, ast.List))
            for e in node.value.elts
            if isinstance(e.elts[0] if isinstance(e, ast.Tuple) and e.elts else e, ast.Constant)
        ]

    def resolve(self, key: ast.AST, depth: int = 0) -> list[str] | None:
        """The variable names `key` may hold, or None where they are known at run time only."""
        if (found := _str_tuple(key)) is not None:
            return found
        if depth > 3 or not isinstance(key, (ast.Name, ast.Starred)):
            return None
        if isinstance(key, ast.Starred):  # a loop variable: the items of its iterable
            return self.resolve(key.value, depth + 1)
        values = self.bound.get(key.id)
        if values is None:
            return self.constants.get(key.id)
        names: list[str] = []
        for value in values:
            if (found := self.resolve(value, depth + 1)) is None:
                return None
            names += found
        return names

    def reads(self) -> tuple[dict[str, int], list[str]]:
        """(variable -> a line that reads it, reads whose variable could not be named)."""
        found: dict[str, int] = {}
        unresolved: list[str] = []
        for node in ast.walk(self.tree):
            key: ast.AST | None = None
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                if (
                    isinstance(func, ast.Attribute)
                    and (
                        (func.attr == "get" and _is_environ(func.value))
                        or (
                            func.attr == "get"
                            and isinstance(func.value, ast.Name)
                            and func.value.id in self.config_names
                        )
                        or func.attr == "getenv"
                    )
                ) or (isinstance(func, ast.Name) and func.id in self.readers):
                    key = node.args[0]
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                key = node.slice if _is_environ(node.value) else None
            elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
                key = node.left if _is_environ(node.comparators[0]) else None
            if key is None:
                continue
            names = self.resolve(key)
            if names is None and self.tables:
                names = self.tables  # a loop over the module's tables of variables
            if names is None:
                if (self.rel, ast.unparse(key)) not in _DYNAMIC_FAMILIES:
                    unresolved.append(f"{self.rel}:{node.lineno}: {ast.unparse(node)}")
                continue
            for name in names:
                if _ENV_NAME.fullmatch(name):
                    found.setdefault(name, node.lineno)
        return found, unresolved


def _package_reads() -> tuple[dict[str, str], list[str]]:
    """Every variable some distcomm module reads (-> where), and the reads not resolved."""
    paths = sorted((ROOT / "distcomm").rglob("*.py"))
    constants: dict[str, list[str]] = {}  # module-level str constants of the whole package
    for path in paths:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and (values := _str_tuple(node.value)) is not None:
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        constants.setdefault(target.id, []).extend(values)
    reads: dict[str, str] = {}
    unresolved: list[str] = []
    for path in paths:
        module = _Module(path, constants)
        found, missed = module.reads()
        for name, line in found.items():
            reads.setdefault(name, f"{module.rel}:{line}")
        unresolved += missed
    return reads, unresolved


def test_every_variable_read_is_declared_and_every_declared_one_read():
    """Scan every source file (ast) for reads of the environment: os.environ.get("X"),
    os.getenv("X"), os.environ["X"], "X" in os.environ, env.get("X") on a mapping named
    env/environ, config.get("X") (and its aliases), a key named by a constant or a loop
    over a literal tuple, and a loop over a module's *_VARS tables."""
    reads, unresolved = _package_reads()
    assert not unresolved, (
        "these reads name their variable at run time only: name it with a literal, a "
        f"constant or a module-level *_VARS table, so that it can be checked: {unresolved}"
    )
    declared = {var.name: var for var in config.VARIABLES}
    undeclared = {name: where for name, where in reads.items() if name not in declared}
    assert not undeclared, f"declare these in distcomm.variables.VARIABLES: {undeclared}"
    unread = sorted(
        name
        for name, var in declared.items()
        if name not in reads and var.read_by == "distcomm" and not name.endswith("<FLAG>")
    )
    assert not unread, (
        f"nothing in distcomm reads {unread}: remove them, or declare them with read_by= "
        "naming who reads them (the user's script, for a variable distcomm sets for it)"
    )
