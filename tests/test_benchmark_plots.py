"""benchmarks/plots.py: which lines a plot of benchmark rows draws, and that it draws them."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import plots

ROWS = [  # as csv.DictReader gives them: text, the peer's columns empty when not compared
    {"op": "all_reduce", "nprocs": "2", "backend": "gloo", "size": "8", "time_us": "20.5",
     "busbw": "0.001", "peer_time_us": "300", "peer_busbw": "0.0001"},
    {"op": "all_reduce", "nprocs": "2", "backend": "gloo", "size": "64", "time_us": "21",
     "busbw": "0.006", "peer_time_us": "310", "peer_busbw": "0.0004"},
    {"op": "all_reduce", "nprocs": "2", "backend": "mpi", "size": "8", "time_us": "5.6",
     "busbw": "0.003", "peer_time_us": "1.8", "peer_busbw": "0.009"},
    {"op": "barrier", "nprocs": "2", "backend": "mpi", "size": "0", "time_us": "4.0",
     "busbw": "0", "peer_time_us": "", "peer_busbw": ""},
]


def test_each_backend_and_each_peer_is_a_line():
    series = plots._series(ROWS)
    assert set(series) == {
        ("distcomm gloo, 2 ranks", "all_reduce"),
        ("torch gloo, 2 ranks", "all_reduce"),
        ("distcomm mpi, 2 ranks", "all_reduce"),
        ("raw mpi4py, 2 ranks", "all_reduce"),
        ("distcomm mpi, 2 ranks", "barrier"),  # no peer figure: no peer line
    }
    gloo = series[("distcomm gloo, 2 ranks", "all_reduce")]
    assert gloo == {"size": [8, 64], "time": [20.5, 21.0], "busbw": [0.001, 0.006]}
    assert series[("torch gloo, 2 ranks", "all_reduce")]["time"] == [300.0, 310.0]


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (the bench extra)")
    path = tmp_path / "collectives.png"
    plots.collectives(ROWS, str(path), "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
