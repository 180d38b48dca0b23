"""The programmatic rendezvous API as torch's: RendezvousParameters, the handler registry,
the static handler's endpoint and rank, the `RendezvousBackend` plug-in layer (c10d,
etcd-v2 and a custom backend written in torch's shape), and the endpoint parser.

Real stores and threads on 127.0.0.1; short keep-alive and last-call settings; nothing
asserts how long a step took.
"""

from __future__ import annotations

import os
import sys
import textwrap
import threading
from base64 import b64encode
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from distcomm.launch.rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousHandlerRegistry,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeout,
    get_rendezvous_handler,
    register_rendezvous_backend,
    registered_rendezvous_backends,
    rendezvous_handler_registry,
)
from distcomm.launch.rendezvous.c10d_rendezvous_backend import (
    C10dRendezvousBackend,
)
from distcomm.launch.rendezvous.c10d_rendezvous_backend import (
    create_backend as create_c10d_backend,
)
from distcomm.launch.rendezvous.chair import Keys, peek
from distcomm.launch.rendezvous.dynamic_rendezvous import Token, create_handler
from distcomm.launch.rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend
from distcomm.launch.rendezvous.etcd_rendezvous_backend import (
    create_backend as create_etcd_backend,
)
from distcomm.launch.rendezvous.static_tcp_rendezvous import (
    StaticTCPRendezvous,
    create_rdzv_handler,
)
from distcomm.launch.rendezvous.utils import parse_rendezvous_endpoint
from distcomm.store import FileStore, Store, TCPStore
from tests.processes import free_port

try:
    from tests.etcd_server import etcd_endpoint  # a fixture
except ImportError:  # the etcd fixture's module is not there: the etcd cases skip

    @pytest.fixture
    def etcd_endpoint() -> str:
        pytest.skip("tests/etcd_server.py (the etcd server fixture) is not available")


pytestmark = pytest.mark.timeout(180)

HOST = "127.0.0.1"
#: short settings so rounds take a fraction of a second
FAST = {
    "last_call_timeout": "0.3",
    "keep_alive_interval": "0.2",
    "keep_alive_max_attempt": "5",
    "join_timeout": "30",
    "close_timeout": "10",
}
WAIT = 60.0


@pytest.fixture(autouse=True)
def _no_auth_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISTCOMM_AUTH_KEY", raising=False)


@pytest.fixture
def master() -> Iterator[TCPStore]:
    store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=10)
    yield store
    store.close()


def _params(
    backend: str = "dummy_backend", min_nodes: int = 3, max_nodes: int = 6, **kwargs: Any
) -> RendezvousParameters:
    return RendezvousParameters(
        backend, "dummy_endpoint", "dummy_run_id", min_nodes, max_nodes, **kwargs
    )


# -- 6. RendezvousParameters ------------------------------------------------------------------


def test_parameters_take_torch_keyword_options_into_config() -> None:
    params = _params(dummy_param="x", rank=0, timeout=60)
    assert (params.backend, params.endpoint, params.run_id) == (
        "dummy_backend",
        "dummy_endpoint",
        "dummy_run_id",
    )
    assert (params.min_nodes, params.max_nodes, params.local_addr) == (3, 6, None)
    assert params.config == {"dummy_param": "x", "rank": 0, "timeout": 60}
    assert params.get("dummy_param") == "x"
    assert params.get("missing") is None and params.get("missing", default="x") == "x"
    both = RendezvousParameters("c10d", "", "r", 1, 1, config={"a": "1"}, b="2")
    assert both.config == {"a": "1", "b": "2"}
    params.config["is_host"] = "false"  # mutable, as torch's tests use it
    assert params.get_as_bool("is_host") is False


@pytest.mark.parametrize("backend", [None, ""])
def test_parameters_refuse_an_empty_backend(backend: object) -> None:
    with pytest.raises(ValueError, match="rendezvous backend name must be a non-empty string"):
        _params(backend)  # type: ignore[arg-type]


@pytest.mark.parametrize("min_nodes", [0, -1, -5])
def test_parameters_refuse_min_nodes_below_one(min_nodes: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"minimum number of rendezvous nodes \({min_nodes}\) "
        r"must be greater than zero",
    ) as info:
        _params(min_nodes=min_nodes)
    assert f"min_nodes={min_nodes}" in str(info.value) and "--nnodes" not in str(info.value)


@pytest.mark.parametrize("max_nodes", [2, 1, -2])
def test_parameters_refuse_max_nodes_below_min_nodes(max_nodes: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"maximum number of rendezvous nodes \({max_nodes}\) "
        r"must be greater than or equal to the minimum number of rendezvous "
        r"nodes \(3\)",
    ):
        _params(max_nodes=max_nodes)


def test_parameters_accept_equal_bounds_and_one_node() -> None:
    assert _params(min_nodes=1).min_nodes == 1
    assert _params(max_nodes=3).max_nodes == 3


def test_parameters_refuse_a_count_that_is_not_an_integer() -> None:
    with pytest.raises(TypeError, match="min_nodes='2'"):
        _params(min_nodes="2")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["1", "True", "tRue", "T", "t", "yEs", "Y", 1, True, " on "])
def test_get_as_bool_true(value: object) -> None:
    assert _params(dummy_param=value).get_as_bool("dummy_param") is True


@pytest.mark.parametrize("value", ["0", "False", "faLse", "F", "f", "nO", "N", 0, False, "off"])
def test_get_as_bool_false(value: object) -> None:
    assert _params(dummy_param=value).get_as_bool("dummy_param") is False


@pytest.mark.parametrize("value", ["01", "Flse", "Ture", "g", "4", "_", "truefalse", 2, -1, 1.0])
def test_get_as_bool_refuses(value: object) -> None:
    with pytest.raises(
        ValueError, match="option 'dummy_param' does not represent a valid boolean value"
    ):
        _params(dummy_param=value).get_as_bool("dummy_param")


def test_get_as_bool_and_int_defaults() -> None:
    params = _params()
    assert params.get_as_bool("dummy_param") is None
    assert params.get_as_bool("dummy_param", default=True) is True
    assert params.get_as_int("dummy_param") is None
    assert params.get_as_int("dummy_param", default=5) == 5
    assert _params(dummy_param=None).get_as_int("dummy_param") is None


@pytest.mark.parametrize("value", ["0", "-10", "5", "  4", "4  ", " 4 ", 0, -4, 3])
def test_get_as_int_parses(value: object) -> None:
    assert _params(dummy_param=value).get_as_int("dummy_param") == int(value)  # type: ignore


@pytest.mark.parametrize("value", ["a", "0a", "3b", "abc", "1.5"])
def test_get_as_int_refuses(value: str) -> None:
    with pytest.raises(
        ValueError, match="option 'dummy_param' does not represent a valid integer value"
    ):
        _params(dummy_param=value).get_as_int("dummy_param")


# -- 6. the handler registry ------------------------------------------------------------------


class _Dummy(RendezvousHandler):
    def __init__(self, params: RendezvousParameters, name: str = "dummy_backend") -> None:
        self.params, self._name = params, name

    def get_backend(self) -> str:
        return self._name

    def next_rendezvous(self) -> RendezvousInfo:
        raise NotImplementedError

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return ""

    def shutdown(self) -> bool:
        return True


def _make_dummy(params: RendezvousParameters) -> RendezvousHandler:
    return _Dummy(params)


def test_registry_registers_creates_and_checks_names() -> None:
    registry = RendezvousHandlerRegistry()
    registry.register("dummy_backend", _make_dummy)
    registry.register("dummy_backend", _make_dummy)  # the same creator again: fine
    other = lambda p: _Dummy(p)  # noqa: E731
    with pytest.raises(ValueError, match="'dummy_backend' cannot be registered with"):
        registry.register("dummy_backend", other)
    params = _params(min_nodes=1, max_nodes=1)
    handler = registry.create_handler(params)
    assert isinstance(handler, _Dummy) and handler.params is params
    registry.register("dummy_backend_2", _make_dummy)
    params.backend = "dummy_backend_2"
    with pytest.raises(
        RuntimeError, match="'dummy_backend' does not match the requested backend 'dummy_backend_2'"
    ):
        registry.create_handler(params)
    params.backend = "nobody"
    with pytest.raises(ValueError, match="'nobody' is not registered") as info:
        registry.create_handler(params)
    assert "dummy_backend_2" in str(info.value)
    with pytest.raises(ValueError, match="non-empty string"):
        registry.register("", _make_dummy)


def test_the_global_registry_is_the_one_behind_distcomms_functions() -> None:
    def creator(params: RendezvousParameters) -> RendezvousHandler:
        return _Dummy(params, "port-global")

    rendezvous_handler_registry.register("port-global", creator)
    assert "port-global" in registered_rendezvous_backends()
    assert get_rendezvous_handler(_params("port-global")).get_backend() == "port-global"
    register_rendezvous_backend("port-global", creator)  # same creator: fine
    assert {"static", "c10d", "etcd", "etcd-v2", "file"} <= set(rendezvous_handler_registry.names())


def test_a_backend_declared_as_an_entry_point_is_found_by_name(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "port_rdzv_plugin.py"
    package.write_text(
        textwrap.dedent("""
        from distcomm.launch.rendezvous import RendezvousHandler

        class Handler(RendezvousHandler):
            def __init__(self, params):
                self.params = params
            def get_backend(self): return "port-plugin"
            def next_rendezvous(self): raise NotImplementedError
            def is_closed(self): return False
            def set_closed(self): pass
            def num_nodes_waiting(self): return 0
            def get_run_id(self): return self.params.run_id
            def shutdown(self): return True

        def get_handler():
            return Handler
    """)
    )
    info = tmp_path / "port_rdzv_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: port-rdzv-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[distcomm.rendezvous_handlers]\nport-plugin = port_rdzv_plugin:get_handler\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "port-plugin" in registered_rendezvous_backends()
    handler = get_rendezvous_handler(_params("port-plugin"))
    assert handler.get_backend() == "port-plugin" and handler.get_run_id() == "dummy_run_id"


# -- 6. the static handler: endpoint and rank as torch's --------------------------------------


def test_static_handler_reads_rank_and_endpoint() -> None:
    port = free_port()
    params = [
        RendezvousParameters("static", f"{HOST}:{port}", "static-ep", 2, 2, rank=rank, timeout=30)
        for rank in (0, 1)
    ]
    handlers = [create_rdzv_handler(p) for p in params]
    assert all(h.get_backend() == "static" for h in handlers)
    try:
        with ThreadPoolExecutor(2) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
        assert sorted(i.rank for i in infos) == [0, 1]
        assert {i.world_size for i in infos} == {2}
        assert all(i.bootstrap_address == (HOST, port) for i in infos)
    finally:
        for handler in reversed(handlers):
            handler.shutdown()


def test_static_handler_single_node_rounds_at_a_given_port() -> None:
    port = free_port()
    handler = create_rdzv_handler(
        RendezvousParameters("static", f"localhost:{port}", "test_id", 1, 1, rank=0)
    )
    try:
        for _ in range(2):
            info = handler.next_rendezvous()
            assert (info.rank, info.world_size) == (0, 1)
            assert info.bootstrap_address == ("localhost", port)
    finally:
        handler.shutdown()


def test_static_handler_refuses_an_endpoint_without_port() -> None:
    with pytest.raises(ValueError, match="Port is absent in endpoint"):
        create_rdzv_handler(RendezvousParameters("static", "localhost", "test_id", 1, 1, rank=0))


def test_static_tcp_rendezvous_has_torchs_constructor() -> None:
    handler = StaticTCPRendezvous(HOST, free_port(), 0, 1, "ctor", 30)
    try:
        assert handler.next_rendezvous().world_size == 1
        assert handler.get_run_id() == "ctor"
    finally:
        handler.shutdown()


# -- 6. the RendezvousBackend contract, for each backend --------------------------------------


def _check_backend_contract(backend: RendezvousBackend, corrupt: Callable[[], None]) -> None:
    assert backend.get_state() is None
    state, token1, written = backend.set_state(b"x")  # type: ignore[misc]
    assert (state, written) == (b"x", True) and token1 is not None
    assert backend.get_state() == (b"x", token1)
    # no token: writes only where nothing is stored
    assert backend.set_state(b"y") == (b"x", token1, False)
    # an invalid token writes nothing
    assert backend.set_state(b"y", token="invalid") == (b"x", token1, False)
    state, token2, written = backend.set_state(b"y", token1)  # type: ignore[misc]
    assert (state, written) == (b"y", True) and token2 != token1
    # an old token: the current state comes back
    assert backend.set_state(b"z", token1) == (b"y", token2, False)
    corrupt()
    with pytest.raises(RendezvousStateError):
        backend.get_state()


def test_c10d_backend_over_a_tcp_store(master: TCPStore) -> None:
    backend = C10dRendezvousBackend(master, "contract")
    assert backend.name == "c10d"
    _check_backend_contract(backend, lambda: master.set("torch.rendezvous.contract", "non_base64"))


def test_c10d_backend_over_a_file_store(tmp_path: Any) -> None:
    store = FileStore(str(tmp_path / "store"), world_size=-1)
    try:
        _check_backend_contract(
            C10dRendezvousBackend(store, "contract"),
            lambda: store.set("torch.rendezvous.contract", "non_base64"),
        )
    finally:
        store.close()


def test_c10d_backend_refuses_an_empty_run_id(master: TCPStore) -> None:
    with pytest.raises(ValueError, match="run id must be a non-empty string"):
        C10dRendezvousBackend(master, "")


def test_etcd_backend_over_an_etcd_store(etcd_endpoint: str) -> None:
    from distcomm.store.etcd import EtcdStore

    store = EtcdStore(etcd_endpoint, prefix="/port-contract/", timeout=10)
    try:
        backend = EtcdRendezvousBackend(store, "contract", "/dummy_prefix")
        assert backend.name == "etcd-v2"
        _check_backend_contract(backend, lambda: store.set("/dummy_prefix/contract", "non_base64"))
    finally:
        store.close()


# -- 6. create_backend per module -------------------------------------------------------------


def _c10d_params(endpoint: str, **conf: Any) -> RendezvousParameters:
    return RendezvousParameters("c10d", endpoint, "dummy_run_id", 1, 1, **conf)


def test_c10d_create_backend_over_tcp_and_file(tmp_path: Any) -> None:
    port = free_port()
    backend, store = create_c10d_backend(
        _c10d_params(f"localhost:{port}", is_host="true", store_type="tCp", read_timeout="10")
    )
    try:
        assert backend.name == "c10d" and isinstance(store, TCPStore)
        assert store.port == port
        backend.set_state(b"dummy_state")
        assert store.get("torch.rendezvous.dummy_run_id") == b64encode(b"dummy_state")
    finally:
        store.close()
    for endpoint in (str(tmp_path / "rdzv"), ""):
        backend, store = create_c10d_backend(_c10d_params(endpoint, store_type="fIlE"))
        try:
            assert isinstance(store, FileStore)
            backend.set_state(b"dummy_state")
            assert store.get("torch.rendezvous.dummy_run_id") == b64encode(b"dummy_state")
        finally:
            store.close()
            if not endpoint:
                os.remove(store.path)


def test_c10d_create_backend_refusals() -> None:
    with pytest.raises(ValueError, match="Invalid store type given"):
        create_c10d_backend(_c10d_params("localhost:1", store_type="dummy_store_type"))
    for read_timeout in ("0", "-10"):
        with pytest.raises(ValueError, match="The read timeout must be a positive integer"):
            create_c10d_backend(_c10d_params("localhost:1", read_timeout=read_timeout))
    with pytest.raises(
        RendezvousConnectionError, match="The connection to the C10d store has failed"
    ):
        create_c10d_backend(
            _c10d_params(f"{HOST}:{free_port()}", is_host="false", read_timeout="1")
        )


def test_etcd_create_backend(etcd_endpoint: str) -> None:
    from distcomm.store.etcd import EtcdStore

    backend, store = create_etcd_backend(
        RendezvousParameters(
            "etcd-v2", etcd_endpoint, "port-etcd-v2", 1, 1, protocol="hTTp", read_timeout="10"
        )
    )
    reader = EtcdStore(etcd_endpoint, prefix="/", timeout=10)
    try:
        assert backend.name == "etcd-v2" and isinstance(store, EtcdStore)
        backend.set_state(b"dummy_state")
        stored = peek(reader, "torch/elastic/rendezvous/port-etcd-v2")
        assert stored == b64encode(b"dummy_state")
    finally:
        reader.close()
        store.close()
    with pytest.raises(ValueError, match="The protocol must be HTTP or HTTPS"):
        create_etcd_backend(
            RendezvousParameters("etcd-v2", etcd_endpoint, "x", 1, 1, protocol="dummy")
        )


# -- 6. a custom backend in torch's shape: rounds through distcomm's dynamic handler ----------


class DictBackend(RendezvousBackend):
    """A backend as a torch user writes one: a dict, an integer token per write."""

    def __init__(self, name: str = "dictrdzv") -> None:
        self._name = name
        self._lock = threading.Lock()
        self.data: dict[str, tuple[bytes, int]] = {}
        self.writers: set[str] = set()  # threads that wrote a state

    @property
    def name(self) -> str:
        return self._name

    def get_state(self) -> tuple[bytes, Token] | None:
        with self._lock:
            return self.data.get("state")

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        with self._lock:
            current = self.data.get("state")
            if (current is None and token is None) or (current is not None and token == current[1]):
                new_token = 1 if current is None else current[1] + 1
                self.data["state"] = (state, new_token)
                self.writers.add(threading.current_thread().name)
                return state, new_token, True
            return None if current is None else (*current, False)


def _join_all(handlers: list[DynamicRendezvousHandler]) -> list[RendezvousInfo]:
    with ThreadPoolExecutor(len(handlers)) as pool:
        futures = [pool.submit(h.next_rendezvous) for h in handlers]
        return [f.result(timeout=WAIT) for f in futures]


def test_from_backend_forms_rounds_with_the_state_in_the_backend(master: TCPStore) -> None:
    backend = DictBackend()
    stores = [master.clone() for _ in range(3)]
    handlers = [
        DynamicRendezvousHandler.from_backend(
            "custom-run",
            store,
            backend,
            3,
            3,
            local_addr=f"node{i}",
            timeout=RendezvousTimeout(last_call=_seconds(0.3), close=_seconds(10)),
            keep_alive_interval=0.2,
            keep_alive_max_attempt=5,
        )
        for i, store in enumerate(stores)
    ]
    try:
        assert {h.get_backend() for h in handlers} == {"dictrdzv"}
        first = _join_all(handlers)
        assert sorted(i.rank for i in first) == [0, 1, 2]
        assert {(i.world_size, i.round) for i in first} == {(3, first[0].round)}
        # the state is the backend's: none in the store; one node (the chair) wrote it
        assert peek(master, Keys("custom-run").state) is None
        assert backend.get_state() is not None
        assert len(backend.writers) == 1 and backend.writers.pop().startswith("rdzv-heartbeat")
        second = _join_all(handlers)  # a restart: every node joins again
        assert {i.round for i in second} == {first[0].round + 1}
        assert sorted(i.rank for i in second) == [0, 1, 2]
        handlers[0].set_closed()
        assert all(h.is_closed() for h in handlers)
        with pytest.raises(RendezvousClosedError):
            handlers[1].next_rendezvous()
    finally:
        for handler in handlers:
            handler.shutdown()
        for store in stores:
            store.close()


def _seconds(value: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=value)


def test_a_registered_custom_backend_forms_rounds_through_the_registry(master: TCPStore) -> None:
    backend = DictBackend("port-dict")
    opened: list[Store] = []

    def creator(params: RendezvousParameters) -> RendezvousHandler:
        # what a torch user writes, the store being theirs to choose
        store = TCPStore(HOST, master.port, is_master=False, timeout=10)
        opened.append(store)
        return create_handler(store, backend, params)

    rendezvous_handler_registry.register("port-dict", creator)
    handlers = [
        get_rendezvous_handler(
            RendezvousParameters(
                "port-dict", "", "dict-run", 2, 3, f"n{i}", **FAST, custom_option="kept"
            )
        )
        for i in range(3)
    ]
    try:
        infos = _join_all(handlers)  # type: ignore[arg-type]
        assert sorted(i.rank for i in infos) == [0, 1, 2]
        assert {i.world_size for i in infos} == {3}
        state = backend.get_state()
        assert state is not None and b"participants" in state[0]
    finally:
        for handler in handlers:
            handler.shutdown()
        for store in opened:
            store.close()


def test_create_handler_reads_torchs_timeout_options(master: TCPStore) -> None:
    params = RendezvousParameters(
        "dictrdzv",
        "",
        "opts",
        1,
        1,
        join_timeout="7",
        last_call_timeout=2,
        close_timeout="3",
        heartbeat_timeout="4",
        keep_alive_interval="1",
        keep_alive_max_attempt=2,
        backend_own_key="x",
    )
    handler = create_handler(master, DictBackend(), params)
    assert handler.get_backend() == "dictrdzv"
    assert handler._join_timeout == 7 and handler._close_timeout == 3
    assert handler._limits.last_call_timeout == 2 and handler._limits.dead_after == 2
    with pytest.raises(ValueError, match="keep_alive_max_attempt"):
        create_handler(
            master,
            DictBackend(),
            RendezvousParameters("dictrdzv", "", "opts", 1, 1, keep_alive_max_attempt="x"),
        )
    with pytest.raises(TypeError, match="RendezvousBackend"):
        create_handler(master, object(), params)  # type: ignore[arg-type]


def test_the_c10d_backend_forms_rounds_through_create_handler(master: TCPStore) -> None:
    stores = [master.clone() for _ in range(2)]
    handlers = [
        create_handler(
            store,
            C10dRendezvousBackend(store, "c10d-api"),
            RendezvousParameters("c10d", "", "c10d-api", 2, 2, **FAST),
        )
        for store in stores
    ]
    try:
        infos = _join_all(handlers)
        assert sorted(i.rank for i in infos) == [0, 1]
        assert master.check(["torch.rendezvous.c10d-api"])
    finally:
        for handler in handlers:
            handler.shutdown()
        for store in stores:
            store.close()


def test_a_custom_backend_runs_a_job_through_the_launch_api(
    master: TCPStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from distcomm.launch.api import LaunchConfig, elastic_launch
    from tests.launchjobs import launcher_env

    for name in list(os.environ):
        if name not in launcher_env():
            monkeypatch.delenv(name)
    for name, value in launcher_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    backend = DictBackend("port-launch")
    rendezvous_handler_registry.register(
        "port-launch", lambda params: create_handler(master, backend, params)
    )
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        rdzv_backend="port-launch",
        rdzv_endpoint="",
        run_id="launch-run",
        rdzv_configs=dict(FAST),
        max_restarts=0,
        monitor_interval=0.05,
    )
    result = elastic_launch(config, sys.executable)("-c", "import os; print(os.environ['RANK'])")
    assert set(result) == {0, 1}
    assert backend.get_state() is not None


# -- 12. the endpoint parser ------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint", ["dummy.com:0", "dummy-1.com:65535", "123.123.123.123:123", "[2001:db8::1]:123"]
)
def test_parse_endpoint_host_and_port(endpoint: str) -> None:
    host, port = endpoint.rsplit(":", 1)
    assert parse_rendezvous_endpoint(endpoint, 123) == (host.strip("[]"), int(port))


@pytest.mark.parametrize("endpoint", ["dummy.com", "123.123.123.123", "[2001:db8::1]", "::1"])
def test_parse_endpoint_default_port(endpoint: str) -> None:
    assert parse_rendezvous_endpoint(endpoint, 123) == (endpoint.strip("[]"), 123)


@pytest.mark.parametrize("endpoint", ["", "  ", None])
def test_parse_endpoint_empty_is_localhost(endpoint: str | None) -> None:
    assert parse_rendezvous_endpoint(endpoint, 123) == ("localhost", 123)


@pytest.mark.parametrize(
    "endpoint",
    [
        "dummy.com:",
        "host:",
        "[::1]:",
        "dummy.com:abc",
        "dummy.com:-123",
        "dummy.com:-",
        "dummy.com:65536",
        "dummy.com:70000",
    ],
)
def test_parse_endpoint_refuses_a_bad_port(endpoint: str) -> None:
    with pytest.raises(
        ValueError,
        match=r"port number of the rendezvous endpoint .* must be an "
        r"integer between 0 and 65536",
    ) as info:
        parse_rendezvous_endpoint(endpoint, 123)
    assert f"endpoint={endpoint!r}" in str(info.value) and "--rdzv" not in str(info.value)


@pytest.mark.parametrize("endpoint", ["~", "dummy.com :123", "~:123", ":123", "a:b:c"])
def test_parse_endpoint_refuses_a_bad_host(endpoint: str) -> None:
    with pytest.raises(ValueError, match="hostname of the rendezvous endpoint"):
        parse_rendezvous_endpoint(endpoint, 123)


def test_a_c10d_handler_refuses_an_endpoint_with_an_empty_port() -> None:
    with pytest.raises(ValueError, match="endpoint='localhost:'"):
        get_rendezvous_handler(RendezvousParameters("c10d", "localhost:", "empty-port", 1, 1))


# -- the launcher: a plug-in backend by name, and an endpoint with an empty port --------------

_PLUGIN = """
import threading

from distcomm.launch.rendezvous import RendezvousBackend
from distcomm.launch.rendezvous.dynamic_rendezvous import create_handler
from distcomm.store import TCPStore


class DictBackend(RendezvousBackend):
    def __init__(self):
        self._lock, self._state = threading.Lock(), None

    @property
    def name(self):
        return "cli-dict"

    def get_state(self):
        return self._state

    def set_state(self, state, token=None):
        with self._lock:
            current = self._state
            if (current is None and token is None) or (current and token == current[1]):
                self._state = (state, 1 if current is None else current[1] + 1)
                print("cli-dict: state written", flush=True)
                return (*self._state, True)
            return None if current is None else (*current, False)


def get_handler():
    def creator(params):
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        return create_handler(store, DictBackend(), params)
    return creator
"""


def _install_plugin(where: Any) -> None:
    (where / "cli_dict_rdzv.py").write_text(_PLUGIN)
    info = where / "cli_dict_rdzv-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cli-dict-rdzv\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[distcomm.rendezvous_handlers]\ncli-dict = cli_dict_rdzv:get_handler\n"
    )


def _cli(tmp_path: Any, *flags: str, pythonpath: str = "") -> Any:
    from tests.launchjobs import launcher_env, run_launcher

    worker = tmp_path / "worker.py"
    worker.write_text("import os\nprint('worker rank', os.environ['RANK'], flush=True)\n")
    env = launcher_env()
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, env["PYTHONPATH"]])
    return run_launcher(
        [
            "--nnodes=1",
            "--nproc-per-node=2",
            "--max-restarts=0",
            "--monitor-interval=0.05",
            *flags,
            str(worker),
        ],
        tmp_path,
        env,
        timeout=90,
    )


def test_distcomm_run_refuses_an_endpoint_with_an_empty_port(tmp_path: Any) -> None:
    done = _cli(tmp_path, "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:", "--rdzv-id=e")
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "localhost:" in output and "port" in output, output
    assert "worker rank" not in output


def test_distcomm_run_loads_a_plugin_backend_by_name(tmp_path: Any) -> None:
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    _install_plugin(plugin)
    done = _cli(
        tmp_path,
        "--rdzv-backend=cli-dict",
        "--rdzv-id=cli",
        "--rdzv-conf=last_call_timeout=0.3,keep_alive_interval=0.2",
        pythonpath=str(plugin),
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "cli-dict: state written" in output
    assert "worker rank 0" in output and "worker rank 1" in output


def test_a_handler_shows_its_settings_as_torchs_does() -> None:
    from datetime import timedelta

    from distcomm.launch.rendezvous.api import RendezvousTimeout
    from distcomm.launch.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from distcomm.launch.rendezvous.dynamic import DynamicRendezvousHandler
    from distcomm.store import HashStore

    store = HashStore()
    timeout = RendezvousTimeout(join=timedelta(seconds=9))
    handler = DynamicRendezvousHandler.from_backend(
        "settings",
        store,
        C10dRendezvousBackend(store, "settings"),
        2,
        4,
        timeout=timeout,
        keep_alive_interval=2,
        keep_alive_max_attempt=4,
    )
    settings = handler.settings
    assert (settings.run_id, settings.min_nodes, settings.max_nodes) == ("settings", 2, 4)
    assert settings.timeout is timeout  # the very object given, as torch's tests check
    assert settings.keep_alive_interval == timedelta(seconds=2)
    assert settings.keep_alive_max_attempt == 4
    plain = DynamicRendezvousHandler.from_backend(
        "plain", store, C10dRendezvousBackend(store, "plain"), 1, 1
    )
    assert plain.settings.timeout.join == timedelta(seconds=600)
    assert plain.settings.timeout.last_call == timedelta(seconds=30)


class SilentBackend(DictBackend):
    """As torch's own test backend: a lost write returns None, not the state it lost to."""

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        result = super().set_state(state, token)
        return result if result is not None and result[2] else None


def test_a_backend_that_answers_a_lost_write_with_none_still_forms_rounds(master: TCPStore) -> None:
    backend = SilentBackend("silent")
    stores = [master.clone() for _ in range(2)]
    handlers = [
        DynamicRendezvousHandler.from_backend(
            "silent-run",
            store,
            backend,
            2,
            2,
            local_addr=f"node{i}",
            timeout=RendezvousTimeout(last_call=_seconds(0.3), close=_seconds(10)),
            keep_alive_interval=0.2,
            keep_alive_max_attempt=5,
        )
        for i, store in enumerate(stores)
    ]
    try:
        infos = _join_all(handlers)
        assert sorted(i.rank for i in infos) == [0, 1]
        assert {i.world_size for i in infos} == {2}
    finally:
        for handler in handlers:
            handler.shutdown()
        for store in stores:
            store.close()


def test_use_agent_store_follows_torchs_variable(master: TCPStore, monkeypatch) -> None:
    def make() -> DynamicRendezvousHandler:
        return DynamicRendezvousHandler.from_backend(
            "share", master, DictBackend(), 1, 1, local_addr="node"
        )

    assert make().use_agent_store
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    assert not make().use_agent_store
