"""benchmarks/scale.py: a two-rank run gives sane counts, and the store wrapper counts calls."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import scale  # noqa: E402  (benchmarks/, put on the path above)

import distcomm  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_counting_store_counts_each_call_and_shares_counts_with_clones():
    inner = distcomm.HashStore()
    store = scale.CountingStore(inner)
    store.set("a", "1")
    assert store.get("a") == b"1"
    assert store.add("n", 2) == 2
    store.wait(["a"])
    assert store.requests() == 4
    assert store.clone().requests() == 4  # a store that clones to itself shares the counts
    assert dict(store.counts) == {"set": 1, "get": 1, "add": 1, "wait": 1}


def test_two_ranks_of_tcp_and_gloo_give_sane_counts(tmp_path):
    out = tmp_path / "scale.csv"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    res = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "scale.py"),
            "--sizes",
            "2",
            "--backends",
            "tcp,gloo",
            "--iters",
            "3",
            "--timeout",
            "120",
            "--csv",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(row["backend"], row["nprocs"]) for row in rows] == [("tcp", "2"), ("gloo", "2")]
    for row in rows:
        assert row["status"] == "ok", row
        assert row["error"] == "", row
        assert row["ranks_reported"] == "2"
        assert row["all_reduce_correct"] == "True"
        for key in ("threads_py", "threads_os"):
            assert int(float(row[f"{key}_median"])) >= 1
            assert float(row[f"{key}_max"]) >= float(row[f"{key}_median"])
        assert float(row["sockets_median"]) >= 0
        assert float(row["rss_mib_median"]) > 0
        assert float(row["store_requests_init_median"]) >= 1  # the ranks exchanged addresses
        assert float(row["store_requests_new_group_median"]) >= 0
    assert "| tcp | 2 | ok |" in res.stdout
