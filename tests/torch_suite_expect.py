"""Which of torch's own tests `tests/torch_suite.py` does not hold against distcomm, and why.

`EXPECT` maps a test ("path under test/distributed::Class::test", fnmatch globs allowed) to
(kind, reason): kind "not applicable" for a test of torch's internals (its C++ protocol,
private names, RPC, torch.cuda), "documented difference" for behaviour the docs say
distcomm changes on purpose (the reason names the section of docs/torch-differences.md).
The report lists these apart from the real failures; a test listed here that passes is
simply counted as passed. Keep the list short and every reason checkable.
"""

from __future__ import annotations

NA = "not applicable"
DOC = "documented difference"

_PRIVATE_STATE = (
    "torch's private dynamic-rendezvous state machine (_NodeDesc, _RendezvousState, "
    "_RendezvousStateHolder, _Action and the _Rendezvous*Op steps); distcomm's differs "
    "(chair.py, state.py) and has none of these names"
)

_STATIC_DEFAULTS = (
    "docs/torch-differences.md > Semantics > Rendezvous plug-ins: the static handler lets a single "
    "node leave out its rank (it is 0); torch raises ValueError for the missing rank"
)
_TIMER_REAP = (
    "docs/torch-differences.md > The launcher > Timers: the timer server reaps the worker's whole "
    "process tree (SIGTERM, a grace period, SIGKILL)"
)

_C10D = "elastic/rendezvous/c10d_rendezvous_backend_test.py::CreateBackendTest"
_RDZV_WORDING = (
    "docs/torch-differences.md > Semantics: rendezvous parameter errors open with torch's whole "
    "message, then name the parameter or flag and what to do, so torch's anchored ^...$ "
    "pattern does not match"
)

_NUM_KEYS = (
    "docs/torch-differences.md > Semantics: FileStore.num_keys and TCPStore.num_keys count "
    "the keys set; torch 2.13's count one internal key more"
)

#: torch's tests of a rendezvous error message, by file and class
_WORDING_TESTS: dict[str, tuple[str, ...]] = {
    "elastic/rendezvous/c10d_rendezvous_backend_test.py::CreateBackendTest": (
        "test_create_backend_raises_error_if_tempfile_creation_fails",
        "test_create_backend_raises_error_if_store_type_is_invalid",
        "test_create_backend_raises_error_if_store_is_unreachable",
        "test_create_backend_raises_error_if_file_path_is_invalid",
        "test_create_backend_raises_error_if_read_timeout_is_invalid",
    ),
    "elastic/rendezvous/utils_test.py::UtilsTest": (
        "test_parse_rendezvous_endpoint_raises_error_if_hostname_is_invalid",
        "test_parse_rendezvous_endpoint_raises_error_if_port_is_invalid",
        "test_parse_rendezvous_endpoint_raises_error_if_port_is_too_big",
    ),
    "elastic/rendezvous/dynamic_rendezvous_test.py::RendezvousTimeoutTest": (
        "test_init_raises_error_if_timeout_is_not_positive",
    ),
    "elastic/rendezvous/dynamic_rendezvous_test.py::DynamicRendezvousHandlerFromBackendTest": (
        "test_init_raises_error_if_max_nodes_is_less_than_min",
        "test_init_raises_error_if_min_nodes_is_not_positive",
    ),
    "elastic/rendezvous/api_test.py::RendezvousParametersTest": (
        "test_init_raises_error_if_max_nodes_is_less_than_min_nodes",
        "test_init_raises_error_if_min_nodes_is_less_than_1",
        "test_init_raises_error_if_backend_is_none_or_empty",
        "test_get_as_bool_raises_error_if_value_is_invalid",
        "test_get_as_int_raises_error_if_value_is_invalid",
    ),
    "elastic/rendezvous/api_test.py::RendezvousHandlerRegistryTest": (
        "test_create_handler_raises_error_if_backend_names_do_not_match",
        "test_create_handler_raises_error_if_backend_is_not_registered",
        "test_register_raises_error_if_called_twice_with_different_creators",
    ),
}

EXPECT: dict[str, tuple[str, str]] = {
    **{
        f"{where}::{test}": (DOC, _RDZV_WORDING)
        for where, tests in _WORDING_TESTS.items()
        for test in tests
    },
    # test_store.py
    "test_store.py::*::test_init_pg_and_rpc_with_same_*": (
        NA,
        "torch.distributed.rpc (TensorPipe) has no distcomm counterpart",
    ),
    "test_store.py::PythonStoreTest::test_set_get": (
        NA,
        "dist._test_python_store drives torch's C++ Store trampoline",
    ),
    "test_store.py::TestClientProtocol::test_client_connect": (
        NA,
        "asserts the bytes of torch's C++ TCPStore wire protocol",
    ),
    "test_store.py::*TCPStoreTest::test_repr": (
        NA,
        "asserts the repr of torch's C++ TCPClient/SocketImpl",
    ),
    "test_store.py::PrefixTCPStoreTest::test_underlying_non_prefix_store": (
        NA,
        "private attribute _underlying_non_prefix_store",
    ),
    "test_store.py::InitPgWithNonUvStore::*": (
        NA,
        "private c10d._get_process_group_store and torch's libuv switch",
    ),
    "test_store.py::TestMultiThreadedWait::*": (
        NA,
        "MultiThreadedTestCase runs torch's threaded fake process group; "
        "dist.get_rank() then asks distcomm, which has no such group",
    ),
    # elastic/multiprocessing/errors
    "elastic/multiprocessing/errors/api_test.py::ApiTest::test_process_failure_no_error_file": (
        DOC,
        "docs/torch-differences.md > The launcher > Error files: a worker that recorded nothing "
        "is described by its exit, where torch links to its docs",
    ),
    "elastic/multiprocessing/errors/api_test.py::ApiTest::test_process_failure_signal": (
        DOC,
        "docs/torch-differences.md > The launcher > Error files: the worker's exit is described "
        "as 'process N ended with signal SIGSEGV (-11)', not torch's 'Signal 11 ... received'",
    ),
    "elastic/multiprocessing/errors/error_handler_test.py::ErrorHandlerTest::test_initialize*": (
        DOC,
        "docs/torch-differences.md > The launcher > Error files: ErrorHandler.initialize() "
        "leaves faulthandler as it is when it is on already (pytest turns it on)",
    ),
    # elastic/rendezvous/dynamic_rendezvous_test.py: torch's private state machine
    **{
        f"elastic/rendezvous/dynamic_rendezvous_test.py::{cls}::*": (NA, why)
        for cls, why in (
            ("NodeDescTest", _PRIVATE_STATE),
            ("NodeDescGeneratorTest", _PRIVATE_STATE),
            ("RendezvousStateTest", _PRIVATE_STATE + "; sizes torch's pickled state"),
            (
                "BackendRendezvousStateHolderTest",
                _PRIVATE_STATE + "; reads torch's pickled "
                "state and patches dynamic_rendezvous.datetime/time",
            ),
            ("DistributedRendezvousOpExecutorTest", _PRIVATE_STATE),
            ("TestRendezvousExitOp", _PRIVATE_STATE),
            ("TestRendezvousJoinOp", _PRIVATE_STATE),
            ("TestRendezvousCloseOp", _PRIVATE_STATE),
            ("TestRendezvousKeepAliveOp", _PRIVATE_STATE),
            (
                "DynamicRendezvousHandlerTest",
                _PRIVATE_STATE + "; builds the handler through its "
                "private constructor (node, settings, backend name, store, state holder)",
            ),
        )
    },
    "elastic/rendezvous/dynamic_rendezvous_test.py::IntegrationTest::test_redundancy_*": (
        NA,
        "unpickles the backend's state blob (docs/torch-differences.md > Semantics > "
        "Rendezvous plug-ins: distcomm's state is JSON) and calls private _stop_heartbeats",
    ),
    # elastic/timer
    "elastic/rendezvous/static_rendezvous_test.py::StaticTCPRendezvousTest::test_empty_endpoint": (
        DOC,
        _STATIC_DEFAULTS,
    ),
    "elastic/rendezvous/static_rendezvous_test.py::StaticTCPRendezvousTest::test_ipv6_addr*": (
        DOC,
        _STATIC_DEFAULTS,
    ),
    "elastic/rendezvous/utils_test.py::PeriodicTimerTest::*": (
        NA,
        "torch's private _PeriodicTimer (rendezvous/utils.py); distcomm's keep-alive is "
        "the chair's keeper thread",
    ),
    "elastic/rendezvous/utils_test.py::UtilsTest::test_matches_machine_hostname_*": (
        NA,
        "torch's private _matches_machine_hostname",
    ),
    "elastic/rendezvous/utils_test.py::UtilsTest::test_parse_rendezvous_[cr]*": (
        NA,
        "torch's private _parse_rendezvous_config (distcomm parses --rdzv-conf in "
        "launch/flag_values.py)",
    ),
    "elastic/rendezvous/utils_test.py::UtilsTest::test_try_parse_port_*": (
        NA,
        "torch's private _try_parse_port",
    ),
    "elastic/timer/file_based_local_timer_test.py::FileTimerTest::test_exit_before_release_reap": (
        DOC,
        _TIMER_REAP + "; the test mocks torch's FileTimerServer._reap_worker",
    ),
    "elastic/timer/local_timer_test.py::LocalTimerServerTest::test_expired_timers": (
        DOC,
        _TIMER_REAP + "; the test mocks os.kill, which torch calls on the pid",
    ),
    "elastic/timer/local_timer_test.py::LocalTimerServerTest::test_valid_timers": (
        NA,
        "drives the private _run_watchdog and counts the private _timers dict, with "
        "made-up negative pids",
    ),
    "test_store.py::*StoreTest::test_set_get_check": (DOC, _NUM_KEYS),
    "test_store.py::*TCPStoreTest::test_numkeys_delkeys": (DOC, _NUM_KEYS),
    "test_store.py::Rendezvous*Test::test_common_errors": (
        DOC,
        "docs/torch-differences.md > Semantics: a tcp:// or file:// init_method without "
        "?rank= or ?world_size= takes them from the environment, where torch raises",
    ),
    # launcher/test_run.py
    "launcher/test_run.py::ElasticLaunchTest::test_launch_elastic_agent_raise_exception": (
        NA,
        "mocks torch's LocalElasticAgent.run to return torch's RunResult; distcomm's agent "
        "is distcomm.launch.agent.ElasticAgent, with no LocalElasticAgent to patch",
    ),
    "launcher/test_run.py::ElasticLaunchTest::test_launch_shutdown": (
        NA,
        "patches torch's launcher.api.LocalElasticAgent, a name distcomm.launch.api has not",
    ),
    "launcher/test_run.py::ElasticLaunchTest::test_is_torchelastic_launched_with_logs_spec_*": (
        NA,
        "patches torch.distributed.run's module global `metadata` (importlib.metadata) to "
        "fake a logs-specs entry point; distcomm.run loads --logs-specs elsewhere",
    ),
    "launcher/test_run.py::ElasticLaunchTest::test_nproc_gpu_launch_configurations": (
        NA,
        "patches torch.cuda/torch.accelerator; distcomm counts GPUs through CuPy",
    ),
    "launcher/test_run.py::ElasticLaunchTest::test_nproc_xpu_launch_configurations": (
        NA,
        "patches torch.xpu; distcomm has no XPU support",
    ),
    f"{_C10D}::test_create_backend_returns_backend_if_endpoint_port_is_not_specified": (
        NA,
        "patches the module constant DEFAULT_PORT of torch's c10d backend module; "
        "distcomm's create_backend reads the launcher's own default (29400 either way)",
    ),
    f"{_C10D}::test_create_backend_raises_error_if_endpoint_is_invalid": (
        DOC,
        "docs/torch-differences.md > Done better on purpose: a store for a non-loopback "
        "endpoint host listens on every interface, so is_host=True succeeds where torch's "
        "fails to bind the made-up name",
    ),
    "elastic/rendezvous/dynamic_rendezvous_test.py::CreateHandlerTest::"
    "test_create_handler_records_and_raises_exceptions": (
        NA,
        "patches torch's events.record_rdzv_event, which distcomm's events module has not "
        "(its handlers report through the agent's event handler)",
    ),
    "launcher/test_run.py::ElasticLaunchTest::test_launch_elastic_worker_raise_exception": (
        NA,
        "mocks torch's events.record and expects torch's agent to call it; distcomm's "
        "agent records through its own event handler",
    ),
    **{
        f"elastic/rendezvous/dynamic_rendezvous_test.py::IntegrationTest::{test}": (
            NA,
            "its teardown calls the torch handler's private _stop_heartbeats (the test's "
            "own assertions pass)",
        )
        for test in (
            "test_all_nodes_join_rendezvous",
            "test_use_agent_store_is_disabled",
            "test_use_agent_store_is_true_by_default",
        )
    },
    "elastic/rendezvous/dynamic_rendezvous_test.py::IntegrationTest::"
    "test_share_tcp_store_is_disabled": (
        NA,
        "patches dist.PrefixStore with a Mock and passes a Mock(spec=TCPStore) as the "
        "store; distcomm's handler needs a store with queues",
    ),
    "elastic/rendezvous/dynamic_rendezvous_test.py::CreateHandlerTest::"
    "test_create_handler_rdzv_local_addr": (
        NA,
        "its backend stores nothing (get_state and set_state always None), which torch's "
        "private state holder tolerates by keeping its own copy and distcomm's chair does not "
        "(it reads back what it wrote); and it reads torch's RendezvousInfo."
        "bootstrap_store_info",
    ),
}
