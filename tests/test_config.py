"""The declaration of environment variables in `distcomm.config`: every variable the
package names is declared, the README's table is generated from it, and its parsers
refuse bad values with a message naming the variable."""

from __future__ import annotations

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


def test_readme_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- env-table -->\n(.*?)\n<!-- /env-table -->", readme, re.DOTALL)
    assert match, "README.md lacks the <!-- env-table --> section"
    assert match[1] == config.env_table(), (
        "the README's variable table is stale: paste the output of python -m distcomm.config"
    )


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
