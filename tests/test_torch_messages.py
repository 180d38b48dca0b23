"""The rendezvous's and the launcher's errors carry torch's message verbatim.

docs/torch-differences.md promises that a bad call of the rendezvous or launcher API
raises torch's exception type (or a subclass) whose message opens with torch's whole
message, case and full stop included, then names what held the value (the parameter a
Python caller passed; the flag only where the value came from distcomm-run's command
line) and says what to do. `CASES` are calls that exist in both torch and distcomm, each
with torch 2.13's message recorded from its real output, so the check runs without torch
(CI does not install it). Where torch is importable, every call also runs against torch:
its live message must be the recorded one (torch 2.13) and lie verbatim in distcomm's.
"""

from __future__ import annotations

import importlib.util
import re
import socket
import types
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import pytest

from tests.launchjobs import run_launcher, script
from tests.processes import free_port

pytestmark = pytest.mark.timeout(120)

HAS_TORCH = importlib.util.find_spec("torch") is not None
requires_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")

C10D_FAILED = "The connection to the C10d store has failed. See inner exception for details."
#: a host name that resolves nowhere, without asking the network (RFC 6761)
NOWHERE = "nohost.invalid"
#: distcomm's documented type for a bad --nnodes range or --max-restarts (torch: assert)
ASSERTION_IS_VALUEERROR = (
    "docs/torch-differences.md > The launcher: an --nnodes range out of order or a negative "
    "--max-restarts raises ValueError (torch: AssertionError)"
)


def torch_api() -> types.SimpleNamespace:
    """torch's modules under the names the cases use."""
    import torch.distributed as dist
    import torch.distributed.run as run
    from torch.distributed.elastic.rendezvous import api, utils
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dynamic
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as static
    from torch.distributed.launcher import api as launcher

    return types.SimpleNamespace(
        api=api,
        utils=utils,
        c10d=c10d,
        dynamic=dynamic,
        static=static,
        run=run,
        launcher=launcher,
        HashStore=dist.HashStore,
    )


def distcomm_api() -> types.SimpleNamespace:
    """distcomm's modules under torch's names."""
    import distcomm.launch.rendezvous  # noqa: F401  (registers the built-in handlers)
    import distcomm.run as run
    from distcomm.launch import api as launcher
    from distcomm.launch.rendezvous import api, utils
    from distcomm.launch.rendezvous import c10d_rendezvous_backend as c10d
    from distcomm.launch.rendezvous import dynamic_rendezvous as dynamic
    from distcomm.launch.rendezvous import static_tcp_rendezvous as static
    from distcomm.store import HashStore

    return types.SimpleNamespace(
        api=api,
        utils=utils,
        c10d=c10d,
        dynamic=dynamic,
        static=static,
        run=run,
        launcher=launcher,
        HashStore=HashStore,
    )


# -- the calls -----------------------------------------------------------------------------


def params(ns, backend="c10d", endpoint="localhost:0", run_id="r", lo=1, hi=1, **options):
    return ns.api.RendezvousParameters(backend, endpoint, run_id, lo, hi, **options)


def c10d_handler(ns, **options):
    """The c10d handler from the registry, hosting its store on a free loopback port."""
    options.setdefault("is_host", "true")
    return ns.api.rendezvous_handler_registry.create_handler(params(ns, **options))


def from_flags(ns, *argv):
    """torch.distributed.run.config_from_args of a command line."""
    return ns.run.config_from_args(ns.run.parse_args([*argv, "train.py"]))


def launch(ns, **fields):
    fields = {"min_nodes": 1, "max_nodes": 1, "nproc_per_node": 1, **fields}
    return ns.launcher.launch_agent(ns.launcher.LaunchConfig(**fields), "true", [])


class Creator:
    """A handler creator whose repr is stable (torch's message shows it)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, params):
        raise AssertionError("never called")

    def __repr__(self) -> str:
        return self.name


def register_twice(ns):
    registry = ns.api.RendezvousHandlerRegistry()
    registry.register("x", Creator("creator-a"))
    registry.register("x", Creator("creator-b"))


def mismatched_handler(ns):
    base = ns.api.RendezvousHandler
    methods = {name: (lambda self, *args: None) for name in base.__abstractmethods__}
    methods["get_backend"] = lambda self: "static"
    handler = type("Handler", (base,), methods)()
    registry = ns.api.RendezvousHandlerRegistry()
    registry.register("other", lambda params: handler)
    registry.create_handler(params(ns, backend="other"))


def from_backend(ns, run_id="r", lo=1, hi=1):
    store = ns.HashStore()
    backend = ns.c10d.C10dRendezvousBackend(store, "r")
    ns.dynamic.DynamicRendezvousHandler.from_backend(run_id, store, backend, lo, hi)


def unreachable(ns):
    endpoint = f"127.0.0.1:{free_port()}"
    ns.c10d.create_backend(params(ns, endpoint=endpoint, is_host="false", read_timeout="1"))


@dataclass(frozen=True)
class Case:
    """One bad call.

    Attributes:
        id: the test id.
        call: makes the call with torch's or distcomm's modules.
        error: the name of torch's exception type (distcomm's is it or a subclass).
        sentence: torch 2.13's message, recorded from its real output.
        where: what distcomm's message names after it: the parameter (a Python call) or
            the flag (a command line).
        documented: why distcomm's type differs from torch's (the section of the docs).
    """

    id: str
    call: Callable[[types.SimpleNamespace], object]
    error: str
    sentence: str
    where: str
    documented: str = ""

    @property
    def command_line(self) -> bool:
        return self.where.startswith("--")


CASES = [
    # torch.distributed.elastic.rendezvous.api.RendezvousParameters
    Case(
        "params-backend-empty",
        lambda ns: params(ns, backend=""),
        "ValueError",
        "The rendezvous backend name must be a non-empty string.",
        "backend=''",
    ),
    Case(
        "params-min-nodes-0",
        lambda ns: params(ns, lo=0, hi=1),
        "ValueError",
        "The minimum number of rendezvous nodes (0) must be greater than zero.",
        "min_nodes=0",
    ),
    Case(
        "params-min-nodes-negative",
        lambda ns: params(ns, lo=-1, hi=1),
        "ValueError",
        "The minimum number of rendezvous nodes (-1) must be greater than zero.",
        "min_nodes=-1",
    ),
    Case(
        "params-max-below-min",
        lambda ns: params(ns, lo=4, hi=2),
        "ValueError",
        "The maximum number of rendezvous nodes (2) must be greater than or equal to the "
        "minimum number of rendezvous nodes (4).",
        "max_nodes=2",
    ),
    Case(
        "get-as-bool-text",
        lambda ns: params(ns, is_host="maybe").get_as_bool("is_host"),
        "ValueError",
        "The rendezvous configuration option 'is_host' does not represent a valid boolean value.",
        "is_host='maybe'",
    ),
    Case(
        "get-as-bool-int",
        lambda ns: params(ns, is_host=2).get_as_bool("is_host"),
        "ValueError",
        "The rendezvous configuration option 'is_host' does not represent a valid boolean value.",
        "is_host=2",
    ),
    Case(
        "get-as-int-text",
        lambda ns: params(ns, n="x").get_as_int("n"),
        "ValueError",
        "The rendezvous configuration option 'n' does not represent a valid integer value.",
        "n='x'",
    ),
    Case(
        "get-as-int-fraction",
        lambda ns: params(ns, n="1.5").get_as_int("n"),
        "ValueError",
        "The rendezvous configuration option 'n' does not represent a valid integer value.",
        "n='1.5'",
    ),
    # its handler registry
    Case(
        "registry-unknown-backend",
        lambda ns: ns.api.rendezvous_handler_registry.create_handler(params(ns, backend="nope")),
        "ValueError",
        "The rendezvous backend 'nope' is not registered. Did you forget to call `register`?",
        "backend='nope'",
    ),
    Case(
        "registry-registered-twice",
        register_twice,
        "ValueError",
        "The rendezvous backend 'x' cannot be registered with 'creator-b' as it is already "
        "registered with 'creator-a'.",
        "backend='x'",
    ),
    Case(
        "registry-empty-name",
        lambda ns: ns.api.RendezvousHandlerRegistry().register("", Creator("c")),
        "ValueError",
        "The rendezvous backend name must be a non-empty string.",
        "backend=''",
    ),
    Case(
        "registry-backend-mismatch",
        mismatched_handler,
        "RuntimeError",
        "The rendezvous backend 'static' does not match the requested backend 'other'.",
        "backend='other'",
    ),
    # utils.parse_rendezvous_endpoint
    Case(
        "endpoint-port-text",
        lambda ns: ns.utils.parse_rendezvous_endpoint("host:abc", 29400),
        "ValueError",
        "The port number of the rendezvous endpoint 'host:abc' must be an integer between 0 "
        "and 65536.",
        "endpoint='host:abc'",
    ),
    Case(
        "endpoint-port-too-big",
        lambda ns: ns.utils.parse_rendezvous_endpoint("host:70000", 29400),
        "ValueError",
        "The port number of the rendezvous endpoint 'host:70000' must be an integer between "
        "0 and 65536.",
        "endpoint='host:70000'",
    ),
    Case(
        "endpoint-port-missing",
        lambda ns: ns.utils.parse_rendezvous_endpoint("host:", 29400),
        "ValueError",
        "The port number of the rendezvous endpoint 'host:' must be an integer between 0 and "
        "65536.",
        "endpoint='host:'",
    ),
    Case(
        "endpoint-host-blank",
        lambda ns: ns.utils.parse_rendezvous_endpoint("ho st:1", 29400),
        "ValueError",
        "The hostname of the rendezvous endpoint 'ho st:1' must be a dot-separated list of "
        "labels, an IPv4 address, or an IPv6 address.",
        "endpoint='ho st:1'",
    ),
    Case(
        "endpoint-host-slash",
        lambda ns: ns.utils.parse_rendezvous_endpoint("a/b:1", 29400),
        "ValueError",
        "The hostname of the rendezvous endpoint 'a/b:1' must be a dot-separated list of "
        "labels, an IPv4 address, or an IPv6 address.",
        "endpoint='a/b:1'",
    ),
    # c10d_rendezvous_backend.create_backend and C10dRendezvousBackend
    Case(
        "c10d-store-type",
        lambda ns: ns.c10d.create_backend(params(ns, store_type="redis")),
        "ValueError",
        "Invalid store type given. Currently only supports file and tcp.",
        "store_type='redis'",
    ),
    Case(
        "c10d-read-timeout-0",
        lambda ns: ns.c10d.create_backend(params(ns, read_timeout="0", is_host="true")),
        "ValueError",
        "The read timeout must be a positive integer.",
        "read_timeout='0'",
    ),
    Case(
        "c10d-read-timeout-negative",
        lambda ns: ns.c10d.create_backend(params(ns, read_timeout="-5", is_host="true")),
        "ValueError",
        "The read timeout must be a positive integer.",
        "read_timeout='-5'",
    ),
    Case(
        "c10d-read-timeout-text",
        lambda ns: ns.c10d.create_backend(params(ns, read_timeout="x", is_host="true")),
        "ValueError",
        "The rendezvous configuration option 'read_timeout' does not represent a valid "
        "integer value.",
        "read_timeout='x'",
    ),
    Case(
        "c10d-is-host-text",
        lambda ns: ns.c10d.create_backend(params(ns, is_host="maybe")),
        "ValueError",
        "The rendezvous configuration option 'is_host' does not represent a valid boolean value.",
        "is_host='maybe'",
    ),
    Case(
        "c10d-run-id-empty",
        lambda ns: ns.c10d.create_backend(params(ns, run_id="", is_host="true")),
        "ValueError",
        "The run id must be a non-empty string.",
        "run_id=''",
    ),
    Case(
        "c10d-backend-run-id-empty",
        lambda ns: ns.c10d.C10dRendezvousBackend(ns.HashStore(), ""),
        "ValueError",
        "The run id must be a non-empty string.",
        "run_id=''",
    ),
    Case(
        "c10d-store-unreachable",
        unreachable,
        "RendezvousConnectionError",
        C10D_FAILED,
        "endpoint='127.0.0.1:",
    ),
    Case(
        "c10d-host-resolves-nowhere",
        lambda ns: ns.c10d.create_backend(
            params(ns, endpoint=f"{NOWHERE}:0", is_host="true", read_timeout="1")
        ),
        "RendezvousConnectionError",
        C10D_FAILED,
        f"endpoint='{NOWHERE}:0'",
    ),
    # the registry's c10d handler with bad --rdzv_conf values (as torch's c10d handler
    # reads them: create_backend, then dynamic_rendezvous.create_handler)
    Case(
        "handler-join-timeout-negative",
        lambda ns: c10d_handler(ns, join_timeout="-1"),
        "ValueError",
        "The join timeout (-1 day, 23:59:59) must be positive.",
        "join_timeout='-1'",
    ),
    Case(
        "handler-join-timeout-0",
        lambda ns: c10d_handler(ns, join_timeout="0"),
        "ValueError",
        "The join timeout (0:00:00) must be positive.",
        "join_timeout='0'",
    ),
    Case(
        "handler-join-timeout-text",
        lambda ns: c10d_handler(ns, join_timeout="abc"),
        "ValueError",
        "The rendezvous configuration option 'join_timeout' does not represent a valid "
        "integer value.",
        "join_timeout='abc'",
    ),
    Case(
        "handler-last-call-timeout-0",
        lambda ns: c10d_handler(ns, last_call_timeout="0"),
        "ValueError",
        "The last_call timeout (0:00:00) must be positive.",
        "last_call_timeout='0'",
    ),
    Case(
        "handler-last-call-timeout-text",
        lambda ns: c10d_handler(ns, last_call_timeout="x"),
        "ValueError",
        "The rendezvous configuration option 'last_call_timeout' does not represent a valid "
        "integer value.",
        "last_call_timeout='x'",
    ),
    Case(
        "handler-close-timeout-negative",
        lambda ns: c10d_handler(ns, close_timeout="-3"),
        "ValueError",
        "The close timeout (-1 day, 23:59:57) must be positive.",
        "close_timeout='-3'",
    ),
    Case(
        "handler-heartbeat-timeout-0",
        lambda ns: c10d_handler(ns, heartbeat_timeout="0"),
        "ValueError",
        "The heartbeat timeout (0:00:00) must be positive.",
        "heartbeat_timeout='0'",
    ),
    Case(
        "handler-read-timeout-0",
        lambda ns: c10d_handler(ns, read_timeout="0"),
        "ValueError",
        "The read timeout must be a positive integer.",
        "read_timeout='0'",
    ),
    Case(
        "handler-read-timeout-text",
        lambda ns: c10d_handler(ns, read_timeout="soon"),
        "ValueError",
        "The rendezvous configuration option 'read_timeout' does not represent a valid "
        "integer value.",
        "read_timeout='soon'",
    ),
    Case(
        "handler-keep-alive-interval-text",
        lambda ns: c10d_handler(ns, keep_alive_interval="x"),
        "ValueError",
        "The rendezvous configuration option 'keep_alive_interval' does not represent a "
        "valid integer value.",
        "keep_alive_interval='x'",
    ),
    Case(
        "handler-keep-alive-max-attempt-text",
        lambda ns: c10d_handler(ns, keep_alive_max_attempt="x"),
        "ValueError",
        "The rendezvous configuration option 'keep_alive_max_attempt' does not represent a "
        "valid integer value.",
        "keep_alive_max_attempt='x'",
    ),
    Case(
        "handler-is-host-text",
        lambda ns: c10d_handler(ns, is_host="maybe"),
        "ValueError",
        "The rendezvous configuration option 'is_host' does not represent a valid boolean value.",
        "is_host='maybe'",
    ),
    Case(
        "handler-run-id-empty",
        lambda ns: c10d_handler(ns, run_id=""),
        "ValueError",
        "The run id must be a non-empty string.",
        "run_id=''",
    ),
    Case(
        "handler-store-type",
        lambda ns: c10d_handler(ns, store_type="redis"),
        "ValueError",
        "Invalid store type given. Currently only supports file and tcp.",
        "store_type='redis'",
    ),
    # dynamic_rendezvous: RendezvousTimeout and DynamicRendezvousHandler.from_backend
    Case(
        "timeout-join-0",
        lambda ns: ns.dynamic.RendezvousTimeout(join=timedelta(0)),
        "ValueError",
        "The join timeout (0:00:00) must be positive.",
        "join=datetime.timedelta(0)",
    ),
    Case(
        "timeout-close-negative",
        lambda ns: ns.dynamic.RendezvousTimeout(close=timedelta(seconds=-1)),
        "ValueError",
        "The close timeout (-1 day, 23:59:59) must be positive.",
        "close=datetime.timedelta(",
    ),
    Case(
        "dynamic-min-nodes-0",
        lambda ns: from_backend(ns, lo=0, hi=1),
        "ValueError",
        "The minimum number of nodes (0) must be greater than zero.",
        "min_nodes=0",
    ),
    Case(
        "dynamic-max-below-min",
        lambda ns: from_backend(ns, lo=3, hi=2),
        "ValueError",
        "The maximum number of nodes (2) must be greater than or equal to the minimum number "
        "of nodes (3).",
        "max_nodes=2",
    ),
    Case(
        "dynamic-run-id-empty",
        lambda ns: from_backend(ns, run_id=""),
        "ValueError",
        "The run id must be a non-empty string.",
        "run_id=''",
    ),
    # static_tcp_rendezvous.create_rdzv_handler (torch's sentences name its flags)
    Case(
        "static-no-rank",
        lambda ns: ns.static.create_rdzv_handler(
            params(ns, backend="static", endpoint="127.0.0.1:29999", lo=2, hi=2)
        ),
        "ValueError",
        "rank is absent in RendezvousParameters.Try add --node-rank to the cmd request",
        "no node_rank, nor option rank",
    ),
    Case(
        "static-no-endpoint",
        lambda ns: ns.static.create_rdzv_handler(
            params(ns, backend="static", endpoint="", lo=2, hi=2, rank=0)
        ),
        "ValueError",
        "endpoint is absent in RendezvousParametersTry add --master-port and --master-addr to "
        "the cmd request",
        "endpoint=''",
    ),
    Case(
        "static-no-port",
        lambda ns: ns.static.create_rdzv_handler(
            params(ns, backend="static", endpoint="127.0.0.1", lo=2, hi=2, rank=0)
        ),
        "ValueError",
        "Port is absent in endpoint: 127.0.0.1. Try launching with --master-port",
        "endpoint='127.0.0.1'",
    ),
    # torch.distributed.run
    Case(
        "run-nnodes-format",
        lambda ns: ns.run.parse_min_max_nnodes("1:2:3"),
        "RuntimeError",
        'nnodes=1:2:3 is not in "MIN:MAX" format',
        "nnodes='1:2:3'",
    ),
    Case(
        "run-nproc-unsupported",
        lambda ns: ns.run.determine_local_world_size("many"),
        "ValueError",
        "Unsupported nproc_per_node value: many",
        "nproc_per_node='many'",
    ),
    Case(
        "run-nproc-gpu-without-cuda",
        lambda ns: ns.run.determine_local_world_size("gpu"),
        "ValueError",
        "Cuda is not available.",
        "nproc_per_node='gpu'",
    ),
    Case(
        "args-nnodes-0",
        lambda ns: from_flags(ns, "--nnodes", "0"),
        "AssertionError",
        "min_nodes must be > 0 and <= max_nodes, got min_nodes=0, max_nodes=0",
        "--nnodes='0'",
        ASSERTION_IS_VALUEERROR,
    ),
    Case(
        "args-nnodes-out-of-order",
        lambda ns: from_flags(ns, "--nnodes", "3:2"),
        "AssertionError",
        "min_nodes must be > 0 and <= max_nodes, got min_nodes=3, max_nodes=2",
        "--nnodes='3:2'",
        ASSERTION_IS_VALUEERROR,
    ),
    Case(
        "args-max-restarts-negative",
        lambda ns: from_flags(ns, "--max-restarts", "-1"),
        "AssertionError",
        "max_restarts must be >= 0",
        "--max_restarts=-1",
        ASSERTION_IS_VALUEERROR,
    ),
    Case(
        "args-local-ranks-filter",
        lambda ns: from_flags(ns, "--local-ranks-filter", "a,b"),
        "ValueError",
        "--local_ranks_filter must be a comma-separated list of integers e.g. "
        "--local_ranks_filter=0,1,2",
        "--local_ranks_filter='a,b'",
    ),
    Case(
        "args-no-python-with-module",
        lambda ns: from_flags(ns, "--no-python", "--module"),
        "ValueError",
        "Don't use both the '--no-python' flag and the '--module' flag at the same time.",
        "--no_python and -m/--module",
    ),
    # torch.distributed.launcher.api
    Case(
        "launch-shutdown-timeout",
        lambda ns: ns.launcher.LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=1, shutdown_timeout=-1
        ),
        "ValueError",
        "shutdown_timeout must be non-negative, got -1",
        "",
    ),
    Case(
        "launch-min-nodes-0",
        lambda ns: launch(ns, min_nodes=0, rdzv_backend="c10d", rdzv_endpoint="localhost:0"),
        "ValueError",
        "The minimum number of rendezvous nodes (0) must be greater than zero.",
        "min_nodes=0",
    ),
    Case(
        "launch-static-no-port",
        lambda ns: launch(ns, rdzv_backend="static", rdzv_endpoint="127.0.0.1"),
        "ValueError",
        "port is missing in endpoint: 127.0.0.1. Try to specify --master-port",
        "rdzv_endpoint='127.0.0.1'",
    ),
    Case(
        "launch-static-no-endpoint",
        lambda ns: launch(ns, rdzv_backend="static", rdzv_endpoint=""),
        "ValueError",
        "Endpoint is missing in endpoint. Try to add --master-addr and --master-port",
        "rdzv_endpoint=''",
    ),
]

#: calls whose message is not torch's sentence, checked for torch's type only: torch's
#: message is Python's own, or names what distcomm does not do
TYPE_ONLY = [
    # torch: int("a") fails, "invalid literal for int() with base 10: 'a'"
    Case("run-nnodes-text", lambda ns: ns.run.parse_min_max_nnodes("a:b"), "ValueError", "", ""),
    # torch looks in 'torchrun.logs_specs'; distcomm in its own group (documented)
    Case(
        "args-logs-specs", lambda ns: from_flags(ns, "--logs-specs", "nope"), "ValueError", "", ""
    ),
]

#: a flag as distcomm's messages write it (--nnodes, --rdzv_conf, --local_ranks_filter)
FLAG = re.compile(r"(?<![\w-])--[a-z]")


def raised(case: Case, ns: types.SimpleNamespace) -> BaseException:
    try:
        case.call(ns)
    except Exception as exc:
        return exc
    raise AssertionError(f"{case.id}: nothing raised")


def type_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


@pytest.fixture(scope="module")
def distcomm_ns():
    return distcomm_api()


@pytest.fixture(scope="module")
def torch_ns():
    return torch_api()


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch):
    from distcomm.launch import flag_values

    monkeypatch.setattr(flag_values, "_gpu_count", lambda: 0)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_distcomm_raises_torchs_type_with_torchs_message_first(case, distcomm_ns):
    exc = raised(case, distcomm_ns)
    if case.documented:
        assert isinstance(exc, ValueError), case.documented
    else:
        assert case.error in type_names(exc), f"{type(exc).__mro__} is not a {case.error}"
    message = str(exc)
    assert message.startswith(case.sentence), f"{case.sentence!r} does not open {message!r}"
    rest = message[len(case.sentence) :]
    assert case.where in rest, f"{case.where!r} is not named in {message!r}"
    if not case.command_line:  # a Python call: the parameter, never a flag
        assert not FLAG.search(rest), f"a flag in {message!r}"


@pytest.mark.parametrize("case", TYPE_ONLY, ids=lambda case: case.id)
def test_distcomm_raises_torchs_type(case, distcomm_ns):
    assert case.error in type_names(raised(case, distcomm_ns))


@requires_torch
@pytest.mark.parametrize("case", CASES + TYPE_ONLY, ids=lambda case: case.id)
def test_against_torch(case, torch_ns, distcomm_ns):
    """torch's live message is the recorded one (torch 2.13) and lies in distcomm's."""
    import torch

    if case.id == "run-nproc-gpu-without-cuda" and torch.cuda.is_available():
        pytest.skip("torch sees a GPU")
    theirs, ours = raised(case, torch_ns), raised(case, distcomm_ns)
    assert type(theirs).__name__ == case.error
    assert type(theirs).__name__ in type_names(ours) or case.documented
    if not case.sentence:
        return
    if torch.__version__.startswith("2.13."):
        assert str(theirs) == case.sentence
    assert str(theirs) in str(ours)


# -- the parameter the caller passed, or the flag -------------------------------------------


def test_python_api_names_the_parameter_not_the_flag():
    from distcomm.launch.rendezvous import RendezvousParameters, get_rendezvous_handler

    with pytest.raises(ValueError) as info:
        RendezvousParameters("c10d", "localhost:0", "r", min_nodes=0, max_nodes=2)
    assert "min_nodes=0" in str(info.value) and "--nnodes" not in str(info.value)
    with pytest.raises(TypeError) as info:
        RendezvousParameters("c10d", "localhost:0", "r", min_nodes="2", max_nodes=2)
    assert "min_nodes='2'" in str(info.value) and "--nnodes" not in str(info.value)
    bad = RendezvousParameters("c10d", "localhost:0", "r", 1, 1, join_timeout="-1")
    with pytest.raises(ValueError) as info:
        get_rendezvous_handler(bad)
    assert "join_timeout='-1'" in str(info.value) and "--rdzv_conf" not in str(info.value)


def test_parameters_from_the_command_line_name_the_flags():
    """What the agent builds from distcomm-run's flags (`from_flags`) names the flags."""
    from distcomm.launch.rendezvous import RendezvousParameters, get_rendezvous_handler

    with pytest.raises(ValueError, match=r"^The minimum number of rendezvous nodes \(0\)") as info:
        RendezvousParameters("c10d", "localhost:0", "r", 0, 2, from_flags=True)
    assert "--nnodes='0:2'" in str(info.value)
    bad = RendezvousParameters(
        "c10d", "localhost:0", "r", 1, 1, config={"join_timeout": "-1"}, from_flags=True
    )
    with pytest.raises(ValueError) as info:
        get_rendezvous_handler(bad)
    assert str(info.value).startswith("The join timeout (-1 day, 23:59:59) must be positive.")
    assert "--rdzv_conf join_timeout='-1'" in str(info.value)
    bad = RendezvousParameters("c10d", "host:x", "r", 1, 1, from_flags=True)
    with pytest.raises(ValueError, match="--rdzv_endpoint='host:x'"):
        get_rendezvous_handler(bad)


def test_the_command_line_names_the_flag(tmp_path):
    job = script(tmp_path / "job.py", "print('ran')")
    res = run_launcher(["--nnodes", "0", "--nproc_per_node", "1", str(job)], tmp_path)
    assert res.returncode == 2
    assert (
        "min_nodes must be > 0 and <= max_nodes, got min_nodes=0, max_nodes=0. --nnodes='0':"
        in res.stderr
    ), res.stderr
    res = run_launcher(
        [
            "--rdzv_backend=c10d",
            "--rdzv_endpoint=localhost:0",
            "--rdzv_conf=join_timeout=-1",
            "--nproc_per_node=1",
            str(job),
        ],
        tmp_path,
    )
    assert res.returncode != 0 and "ran" not in res.stdout
    assert (
        "The join timeout (-1 day, 23:59:59) must be positive. --rdzv_conf join_timeout='-1':"
        in res.stderr
    ), res.stderr


@pytest.mark.parametrize(
    ("option", "value"),
    [("keep_alive_interval", "0"), ("keep_alive_max_attempt", "0"), ("timeout", "-1")],
)
def test_checks_torch_lacks_name_the_option(option, value):
    """Values torch's c10d handler takes and distcomm refuses: the option is named."""
    from distcomm.launch.rendezvous import RendezvousParameters, get_rendezvous_handler

    bad = RendezvousParameters("c10d", "localhost:0", "r", 1, 1, **{option: value})
    with pytest.raises(ValueError) as info:
        get_rendezvous_handler(bad)
    assert f"{option}={value!r}" in str(info.value)
    assert not FLAG.search(str(info.value))


# -- hosting the c10d store for a name that resolves nowhere --------------------------------


def test_hosting_for_a_host_that_resolves_nowhere_raises_as_torch():
    """torch's host connects to its own store by the endpoint's name and fails; distcomm's
    listens on every interface only once the name resolves, else raises the same error."""
    from distcomm.launch.rendezvous import RendezvousConnectionError, get_rendezvous_handler
    from distcomm.launch.rendezvous.api import RendezvousParameters
    from distcomm.launch.rendezvous.c10d_rendezvous_backend import create_backend

    for make in (create_backend, get_rendezvous_handler):
        nowhere = RendezvousParameters(
            "c10d", f"{NOWHERE}:0", "r", 1, 1, is_host="true", read_timeout="1"
        )
        with pytest.raises(RendezvousConnectionError) as info:
            make(nowhere)
        message = str(info.value)
        assert message.startswith(C10D_FAILED)
        assert f"endpoint='{NOWHERE}:0'" in message and "does not resolve" in message
        assert isinstance(info.value.__cause__, socket.gaierror)
