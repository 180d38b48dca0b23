"""`dist.rendezvous` and `dist.register_rendezvous_handler` called as torch's are.

torch's `torch.distributed.rendezvous(url, rank=-1, world_size=-1, **kwargs)` returns an
iterator whose `next` gives `(store, rank, world_size)`; its module and its function share
the name. These tests call distcomm's the way torch's own tests and scripts call torch's.
"""

from __future__ import annotations

import importlib
from datetime import timedelta

import pytest

import distcomm as dist
from distcomm.bootstrap import urls
from distcomm.store import FileStore, HashStore, TCPStore
from tests.processes import free_port


@pytest.fixture()
def own_registry(monkeypatch):
    """Schemes registered by a test are forgotten after it."""
    monkeypatch.setattr(urls, "_handlers", dict(urls._handlers))


def test_rendezvous_is_both_the_module_and_torchs_function():
    module = importlib.import_module("distcomm.rendezvous")
    assert dist.rendezvous is module and callable(dist.rendezvous)
    assert dist.register_rendezvous_handler is module.register_rendezvous_handler
    assert "rendezvous" in dist.__all__ and "register_rendezvous_handler" in dist.__all__


def test_an_unknown_scheme_is_a_runtime_error_as_in_torch_and_a_value_error():
    with pytest.raises(RuntimeError, match=r"^No rendezvous handler for invalid://") as info:
        dist.rendezvous("invalid://")
    assert isinstance(info.value, ValueError)
    assert "tcp://HOST:PORT" in str(info.value)  # and what to use instead


@pytest.mark.parametrize("args", [(12, 16), (12, -1), (-1, 16)])
def test_node_parameters_in_the_url_and_as_arguments_are_refused(args):
    with pytest.raises(AssertionError, match="has node-specific arguments") as info:
        dist.rendezvous("file:///never/used?rank=12&world_size=16", *args)
    assert isinstance(info.value, ValueError)
    assert "came as arguments too" in str(info.value)


def test_file_rendezvous_gives_its_triple_to_next_once(tmp_path):
    url = f"file://{tmp_path}/store"
    first = dist.rendezvous(url, 0, 2)  # rank and world size positionally, as torch's
    second = dist.rendezvous(f"{url}?world_size=2&rank=1")
    store0, rank0, size0 = next(first)
    store1, rank1, size1 = next(second)
    try:
        assert (rank0, size0, rank1, size1) == (0, 2, 1, 2)
        assert isinstance(store0, FileStore)
        store0.set("key0", "value0")
        assert store1.get("key0") == b"value0"
        with pytest.raises(RuntimeError, match="cannot rendezvous again"):
            next(first)
        assert (first.rank, first.world_size) == (0, 2)  # still the Rendezvous it was
    finally:
        store1.close()
        store0.close()


@pytest.mark.parametrize(
    ("url", "phrase"),
    [
        ("file://?rank=0&world_size=1", "path missing"),
        ("file:///tmp/never?world_size=1", "rank parameter missing"),
        ("file:///tmp/never?rank=0", "size parameter missing"),
        ("tcp://127.0.0.1?rank=0&world_size=1", "port number missing"),
        ("tcp://127.0.0.1:23456?world_size=1", "rank parameter missing"),
        ("tcp://127.0.0.1:23456?rank=0", "size parameter missing"),
    ],
)
def test_a_url_missing_a_part_says_so_in_torchs_words_too(url, phrase):
    with pytest.raises(ValueError, match=phrase):
        next(dist.rendezvous(url, environ={}))


def test_env_and_tcp_rendezvous_as_torchs_tests_call_them(monkeypatch):
    port = free_port("127.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    store, rank, size = next(dist.rendezvous("env://"))
    try:
        assert (rank, size) == (0, 1) and isinstance(store, TCPStore)
        store.set("key0", "value0")
        assert store.get("key0") == b"value0"
    finally:
        store.close()
    url = f"tcp://127.0.0.1:{free_port('127.0.0.1')}?world_size=1&rank=0&use_libuv=1"
    store, rank, size = next(dist.rendezvous(url, timeout=timedelta(seconds=10)))
    try:
        assert (rank, size) == (0, 1)
        assert store.timeout == timedelta(seconds=10)
    finally:
        store.close()


def test_a_builtin_scheme_refuses_a_keyword_it_does_not_take(tmp_path):
    with pytest.raises(TypeError, match="rendezvous got use_libuv= for file://"):
        dist.rendezvous(f"file://{tmp_path}/s", 0, 1, use_libuv=True)


def test_a_handler_written_for_torch_registers_at_the_top_and_gets_its_values(own_registry):
    store = HashStore()
    seen = []

    def handler(url, **kwargs):  # torch's shape: the node values in the URL, a generator
        seen.append((url, kwargs.get("flavour")))
        query = dict(item.split("=") for item in url.partition("?")[2].split("&"))
        yield store, int(query["rank"]), int(query["world_size"])
        raise RuntimeError("no second rendezvous")

    dist.register_rendezvous_handler("torchstyle", handler)
    assert next(dist.rendezvous("torchstyle://here", 1, 2, flavour="x")) == (store, 1, 2)
    assert seen == [("torchstyle://here?rank=1&world_size=2", "x")]
    with pytest.raises(RuntimeError, match="already registered") as info:
        dist.register_rendezvous_handler("torchstyle", handler)
    assert isinstance(info.value, ValueError)


def test_a_tcp_url_on_master_port_under_distcomm_run_is_the_agents_store(tmp_path):
    """torch connects a tcp:// init_method to the agent's store under torchrun; here a
    tcp:// URL on MASTER_PORT is too, with the round's key prefix: a restarted group
    rendezvouses afresh on the same store (its first attempt failed after joining)."""
    from tests.launchjobs import run_launcher, script

    worker = script(
        tmp_path / "worker.py",
        """
        import os, sys
        import numpy as np
        import distcomm as dist
        url = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        dist.init_process_group("tcp", init_method=url)
        x = np.array([dist.get_rank() + 1.0])
        dist.all_reduce(x)
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        if attempt == "0" and dist.get_rank() == 1:
            sys.exit(7)  # fail the first attempt after its rendezvous
        with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}-{attempt}"), "w") as f:
            f.write(f"{x[0]:g} {dist.get_world_size()}")
        dist.destroy_process_group()
    """,
    )
    done = run_launcher(
        [
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            str(worker),
            str(tmp_path),
        ],
        tmp_path,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    results = {path.name: path.read_text() for path in tmp_path.glob("rank*-1")}
    assert results == {"rank0-1": "3 2", "rank1-1": "3 2"}, (results, done.stderr)
