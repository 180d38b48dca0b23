"""tests/torch_suite.py's pure parts: the import rewriting, the event folding, the causes."""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest

from tests import torch_suite as ts


def rewrite(source: str) -> str:
    return ts.rewrite_source(textwrap.dedent(source)).text


def test_aliased_package_import_points_at_distcomm():
    assert rewrite("import torch.distributed as dist\n") == "import distcomm as dist\n"


def test_submodule_import_keeps_its_local_name():
    out = rewrite(
        "import torch.distributed.elastic.timer as timer\n"
        "import torch.multiprocessing as torch_mp\n"
    )
    assert out == (
        "import distcomm.launch.timer as timer\nimport distcomm.multiprocessing as torch_mp\n"
    )


def test_multiline_from_import_keeps_line_numbers():
    source = textwrap.dedent("""\
        from torch.distributed.elastic.rendezvous import (
            RendezvousError,
            RendezvousParameters,
        )
        x = 1
    """)
    out = ts.rewrite_source(source).text
    assert out.splitlines()[0] == (
        "from distcomm.launch.rendezvous import RendezvousError, RendezvousParameters"
    )
    assert out.splitlines()[1:3] == ["", ""]
    assert out.splitlines()[4] == "x = 1"
    assert len(out.splitlines()) == len(source.splitlines())


def test_from_package_import_submodule_imports_the_counterpart_module():
    out = rewrite("""\
        from torch.distributed.elastic.multiprocessing.errors import (
            error_handler as handler_mod,
        )
    """)
    assert out.splitlines()[0] == "import distcomm.launch.errors.error_handler as handler_mod"


def test_name_distcomm_lacks_becomes_a_placeholder_on_the_same_line():
    source = textwrap.dedent("""\
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            _NodeDesc,
            create_handler,
        )
    """)
    result = ts.rewrite_source(source, has_name=lambda mod, name: not name.startswith("_"))
    first = result.text.splitlines()[0]
    assert first.startswith(
        "from distcomm.launch.rendezvous.dynamic_rendezvous import "
        "create_handler; from _torch_suite_plugin import missing_name"
    )
    assert first.endswith(
        "_NodeDesc = _torch_suite_missing("
        "'distcomm.launch.rendezvous.dynamic_rendezvous', '_NodeDesc')"
    )
    assert len(result.text.splitlines()) == len(source.splitlines())
    assert result.missing == ["distcomm.launch.rendezvous.dynamic_rendezvous._NodeDesc"]


def test_missing_name_fails_only_where_used():
    holder = ts.missing_name("distcomm.x", "_Action")
    with pytest.raises(ImportError, match=r"cannot import name '_Action' from 'distcomm\.x'"):
        holder.FINISH  # noqa: B018
    with pytest.raises(ImportError, match="_Action"):
        holder()
    assert not hasattr(holder, "__test__")  # pytest's collection looks, and must not fail

    class Fake(holder):  # type: ignore[misc,valid-type]  # a test's fake of a private base
        pass

    assert Fake.__mro__ == (Fake, object)


def test_distcomm_has_checks_names_and_submodules():
    assert ts.distcomm_has("distcomm.launch.rendezvous.dynamic_rendezvous", "create_handler")
    assert not ts.distcomm_has("distcomm.launch.rendezvous.dynamic_rendezvous", "_NoSuch")
    assert ts.distcomm_has("distcomm.launch.errors", "error_handler")
    assert ts.distcomm_has("distcomm.no_such_module", "x")  # the import error stays visible


def test_create_tcp_store_is_rerouted_to_the_stand_in():
    out = rewrite("""\
        from torch.testing._internal.common_distributed import (
            create_tcp_store,
            skip_if_win32,
        )
    """)
    assert out.splitlines()[0] == (
        "from torch.testing._internal.common_distributed import skip_if_win32; "
        "from _torch_suite_plugin import create_tcp_store"
    )


def test_create_tcp_store_stand_in_builds_a_distcomm_store():
    from distcomm.store import TCPStore

    store = ts.create_tcp_store(
        "localhost", 1, wait_for_workers=False, timeout=ts.timedelta(seconds=30)
    )
    try:
        assert isinstance(store, TCPStore)
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store
    with pytest.raises(NotImplementedError, match="TorchScript"):
        ts.create_tcp_store(jit_class=True)


def test_module_without_counterpart_is_kept_and_reported():
    result = ts.rewrite_source("from torch.distributed.elastic.utils import get_socket_with_port\n")
    assert result.text == "from torch.distributed.elastic.utils import get_socket_with_port\n"
    assert result.kept == ["torch.distributed.elastic.utils"]
    assert result.changed == []


def test_unaliased_submodule_import_is_left_whole():
    # "import torch.distributed.run" binds the name torch; rewriting it would break its users
    result = ts.rewrite_source("import torch.distributed.run\n")
    assert result.text == "import torch.distributed.run\n"
    assert result.kept == ["torch.distributed.run"]


def test_torch_testing_and_plain_torch_are_untouched():
    source = (
        "import torch\n"
        "from torch.testing._internal.common_utils import TestCase, run_tests\n"
        "import torch.nn.functional as F\n"
    )
    assert rewrite(source) == source


def test_patch_targets_are_mapped_by_longest_prefix():
    out = rewrite("""\
        @mock.patch("torch.distributed.elastic.timer.FileTimerServer._reap_worker")
        @mock.patch("torch.distributed.elastic.rendezvous.registry.get_rendezvous_handler")
        @mock.patch('torch.distributed.launcher.api.LocalElasticAgent')
        def f(): pass
    """)
    assert '"distcomm.launch.timer.FileTimerServer._reap_worker"' in out
    assert '"distcomm.launch.rendezvous.registry.get_rendezvous_handler"' in out
    assert "'distcomm.launch.api.LocalElasticAgent'" in out


def test_patch_target_under_a_kept_module_is_left_alone():
    source = 'mock.patch("torch.distributed.elastic.utils.distributed.get_free_port")\n'
    assert rewrite(source) == source


def test_prose_and_other_strings_are_untouched():
    source = textwrap.dedent('''\
        """validates torch.distributed.is_torchelastic_launched() in prose"""
        x = "see torch.distributed.run for details"
        y = "torch.accelerator.is_available"
    ''')
    assert rewrite(source) == source


def test_map_dotted():
    assert ts.map_dotted("torch.distributed.run.metadata") == "distcomm.run.metadata"
    assert ts.map_dotted("torch.distributed.elastic.events.record") == (
        "distcomm.launch.events.record"
    )
    assert ts.map_dotted("torch.distributed.elastic.utils.x") is None
    assert ts.map_dotted("numpy.zeros") is None


def test_map_module_needs_an_exact_entry():
    assert ts.map_module("torch.distributed") == "distcomm"
    assert ts.map_module("torch.distributed.rpc") is None
    assert ts.map_module("torch.testing") is None


def test_every_distcomm_target_exists():
    for _torch, ours, _why in ts.MODULE_MAP:
        if ours is not None:
            assert importlib.util.find_spec(ours) is not None, ours


def test_table_entries_are_unique():
    names = [torch for torch, _, _ in ts.MODULE_MAP]
    assert len(names) == len(set(names))


def _events(*records: dict) -> list[str]:
    return [json.dumps(r) for r in records]


def test_fold_events_keeps_first_failure_and_finds_the_running_test():
    results, running = ts.fold_events(
        [
            *_events(
                {"event": "collected", "nodeids": ["a.py::T::x", "a.py::T::y", "a.py::T::z"]},
                {"event": "start", "nodeid": "a.py::T::x"},
                {
                    "event": "result",
                    "nodeid": "a.py::T::x",
                    "when": "call",
                    "outcome": "failed",
                    "message": "AssertionError: 1 != 2",
                },
                {
                    "event": "result",
                    "nodeid": "a.py::T::x",
                    "when": "teardown",
                    "outcome": "error",
                    "message": "OSError: late",
                },
                {"event": "end", "nodeid": "a.py::T::x"},
                {"event": "start", "nodeid": "a.py::T::y"},
            ),
            "not json",
        ]
    )
    assert results["a.py::T::x"] == ts.Outcome("failed", "AssertionError: 1 != 2")
    assert results["a.py::T::z"].outcome == ts.NOT_RUN
    assert running == "a.py::T::y"


def test_fold_events_collection_error():
    results, running = ts.fold_events(
        _events({"event": "collect-error", "nodeid": "a.py", "message": "ImportError: nope"})
    )
    assert results == {"a.py": ts.Outcome("error", "collection: ImportError: nope")}
    assert running is None


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("ValueError: bad port 29500 at 0x7f00dead", "ValueError: bad port N at 0x…"),
        ("FileNotFoundError: /tmp/tmpab12/x.json\nmore", "FileNotFoundError: /tmp/…"),
        ("", "(no message)"),
    ],
)
def test_cause_blanks_noise(message, expected):
    assert ts.cause(message) == expected


def test_report_groups_failures_and_sets_classified_apart():
    files = ["test/distributed/x_test.py"]
    base = {files[0]: {f"x_test.py::T::{n}": ts.Outcome("passed") for n in "abcd"}}
    ours = {
        files[0]: {
            "x_test.py::T::a": ts.Outcome("passed"),
            "x_test.py::T::b": ts.Outcome("failed", "AttributeError: no foo"),
            "x_test.py::T::c": ts.Outcome("failed", "AttributeError: no foo"),
            "x_test.py::T::d": ts.Outcome("failed", "RuntimeError: rpc"),
        }
    }
    expect = {"x_test.py::T::d": ("not applicable", "RPC")}
    report = ts.build_report(files, base, ours, expect, {})
    assert "| x_test.py | 4 | 4 | 1 | 2 | 1 | 0 | 0 |" in report
    assert "### 1. `AttributeError: no foo` (2)" in report
    assert "RuntimeError: rpc" in report.split("## Classified")[1]


def test_report_gives_a_collection_error_to_every_test_of_the_file():
    files = ["test/distributed/x_test.py"]
    base = {files[0]: {"x_test.py::T::a": ts.Outcome("passed")}}
    ours = {files[0]: {"x_test.py": ts.Outcome("error", "collection: ImportError: no C")}}
    report = ts.build_report(files, base, ours, {}, {})
    assert "### 1. `collection: ImportError: no C` (1)" in report
