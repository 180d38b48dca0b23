"""benchmarks/plots.py: which lines a plot of benchmark rows draws, and that it draws them."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import plots

ROWS = [  # as csv.DictReader gives them: text, the peer's columns empty when not compared
    {
        "op": "all_reduce",
        "nprocs": "2",
        "backend": "gloo",
        "size": "8",
        "time_us": "20.5",
        "busbw": "0.001",
        "peer_time_us": "300",
        "peer_busbw": "0.0001",
    },
    {
        "op": "all_reduce",
        "nprocs": "2",
        "backend": "gloo",
        "size": "64",
        "time_us": "21",
        "busbw": "0.006",
        "peer_time_us": "310",
        "peer_busbw": "0.0004",
    },
    {
        "op": "all_reduce",
        "nprocs": "2",
        "backend": "mpi",
        "size": "8",
        "time_us": "5.6",
        "busbw": "0.003",
        "peer_time_us": "1.8",
        "peer_busbw": "0.009",
    },
    {
        "op": "barrier",
        "nprocs": "2",
        "backend": "mpi",
        "size": "0",
        "time_us": "4.0",
        "busbw": "0",
        "peer_time_us": "",
        "peer_busbw": "",
    },
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


# -- benchmarks/store.py and benchmarks/launcher.py: repeated runs, failures -----------------

import launcher  # noqa: E402  (benchmarks/, put on the path above)
import store  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    """A PNG file matplotlib reads back with a picture in it."""
    image = pytest.importorskip("matplotlib.image")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width = image.imread(str(path)).shape[:2]
    assert height > 100 and width > 100


def store_report(ops=("set", "add"), clients=(4, 8)):
    """A report as benchmarks/store.py builds one, small: 2 ops x 3 runs, 2 barrier sizes."""
    machine = {"distcomm": "0.1.0", "torch": "2.13.0+cpu"}
    single = {
        impl: {
            op: {
                "ops_per_s": [1000.0 * k + i for i in range(3)],
                "server_cpu_us_per_call": [10.0 * k, 11.0 * k, 12.0 * k],
                "client_cpu_us_per_call": [20.0 * k, 21.0 * k, 22.5 * k],
            }
            for op in ops
        }
        for k, impl in enumerate(("ours", "torch"), 1)
    }
    barrier = {
        str(n): {
            impl: {
                "seconds": [0.001 * n * k, 0.0012 * n * k],
                "server_cpu_us_per_client": [5.0, 6.0],
                "client_cpu_us_per_client": [7.0, 8.0],
                "connect_s": 0.01 * n,
            }
            for k, impl in enumerate(("ours", "torch"), 1)
        }
        for n in clients
    }
    return {"machine": machine, "single": single, "barrier": barrier}


def test_store_rows_round_trip_through_the_csv(tmp_path):
    rows = store.csv_rows(store_report(), ["ours", "torch"])
    assert {r["label"] for r in rows} == {"distcomm 0.1.0 TCPStore", "torch 2.13.0+cpu TCPStore"}
    # 2 stores x (2 ops x 3 measurements x 3 runs + 2 sizes x (3 x 2 rounds + 1 connect))
    assert len(rows) == 2 * (2 * 3 * 3 + 2 * (3 * 2 + 1))
    path = tmp_path / "store.csv"
    plots.write_csv(rows, str(path), plots.STORE_FIELDS)
    back = plots.read_csv([str(path)])
    assert [list(r) for r in back] == [list(plots.STORE_FIELDS)] * len(rows)
    assert [{k: str(v) for k, v in r.items()} for r in rows] == back
    connect = [r for r in back if r["measurement"] == "connect_ms" and r["impl"] == "torch"]
    assert [(r["clients"], float(r["value"])) for r in connect] == [("4", 40.0), ("8", 80.0)]


def test_store_plot_from_its_csv(tmp_path):
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (the bench extra)")
    csv_path, png = tmp_path / "store.csv", tmp_path / "store.png"
    plots.write_csv(
        store.csv_rows(store_report(), ["ours", "torch"]), str(csv_path), plots.STORE_FIELDS
    )
    assert plots.main(["store", str(csv_path), "--png", str(png), "--title", "test"]) == 0
    assert_png(png)


def test_store_plot_of_one_store_and_a_failed_cell(tmp_path):
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (the bench extra)")
    rows = store.csv_rows(store_report(clients=()), ["ours", "torch"])
    for row in rows:  # torch's add failed in every run: no values
        if row["impl"] == "torch" and row["op"] == "add":
            row["value"] = None
    plots.store(rows, str(tmp_path / "failed.png"))
    assert_png(tmp_path / "failed.png")
    plots.store([r for r in rows if r["impl"] == "ours"], str(tmp_path / "ours.png"))
    assert_png(tmp_path / "ours.png")


TORCH_ERROR = (
    "RuntimeError: Gloo connectFullMesh failed with timed out connecting: "
    "SO_ERROR: Connection refused"
)


def launcher_times(repeat=5):
    """Runs as benchmarks/launcher.py records them: torchrun's recovery failed every time."""
    return {
        ("launch", "distcomm"): [(0.5 + 0.01 * i, "") for i in range(repeat)],
        ("launch", "torch"): [(3.5 + 0.1 * i, "") for i in range(repeat)],
        ("fail", "distcomm"): [(0.3, ""), (None, "timed out after 180 s")]
        + [(0.31, "")] * (repeat - 2),
        ("fail", "torch"): [(None, TORCH_ERROR)] * repeat,
    }


NAMES = {"distcomm": "distcomm-run (distcomm 0.1.0)", "torch": "torchrun (torch 2.13.0+cpu)"}


def test_launcher_rows_round_trip_through_the_csv(tmp_path):
    rows = launcher.csv_rows(launcher_times(), 4, NAMES)
    assert len(rows) == 4 * 5
    path = tmp_path / "launcher.csv"
    plots.write_csv(rows, str(path), plots.LAUNCHER_FIELDS)
    back = plots.read_csv([str(path)])
    assert [{k: "" if v is None else str(v) for k, v in r.items()} for r in rows] == back
    failed = [r for r in back if r["measurement"] == "recovery" and r["impl"] == "torch"]
    assert [(r["seconds"], r["error"]) for r in failed] == [("", TORCH_ERROR)] * 5
    runs = plots._runs(back, lambda r: (r["measurement"], r["label"]), "seconds")
    values, errors = runs[("recovery", NAMES["distcomm"])]
    assert values == [0.3, None, 0.31, 0.31, 0.31]
    assert errors == ["timed out after 180 s"]
    assert plots.failure_note(values) == "failed in 1 of 5 runs"


def test_launcher_plot_from_its_csv(tmp_path):
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (the bench extra)")
    csv_path, png = tmp_path / "launcher.csv", tmp_path / "launcher.png"
    plots.write_csv(
        launcher.csv_rows(launcher_times(), 4, NAMES), str(csv_path), plots.LAUNCHER_FIELDS
    )
    assert plots.main(["launcher", str(csv_path), "--png", str(png)]) == 0
    assert_png(png)


def test_a_failed_peer_is_named_on_the_plot_not_drawn():
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (the bench extra)")
    plt = plots._pyplot()
    fig, ax = plt.subplots()
    try:
        cells = {
            ("4 workers", "ours"): ([0.3, 0.31, None], ["timed out after 180 s"]),
            ("4 workers", "torchrun"): ([None] * 5, [TORCH_ERROR] * 5),
        }
        plots._cells(
            ax,
            ["4 workers"],
            ["ours", "torchrun"],
            lambda g, lab: cells.get((g, lab)),
            fmt=lambda v: f"{v:.2f} s",
        )
        texts = [" ".join(t.get_text().split()) for t in ax.texts]  # unwrapped
        assert any(
            "torchrun: failed in 5 of 5 runs" in t and "Connection refused" in t for t in texts
        ), texts
        assert "failed in 1 of 3 runs" in texts and "0.30 s" in texts
        from matplotlib.collections import PathCollection  # what scatter draws

        drawn = [
            float(y)
            for collection in ax.collections
            if isinstance(collection, PathCollection)
            for _, y in collection.get_offsets()
        ]
        assert sorted(drawn) == [0.3, 0.31]  # ours' two runs; nothing for torchrun, no zero
    finally:
        plt.close(fig)


def test_failure_reason_is_the_workers_exception():
    stderr = (
        "[E1125 ProcessGroupGloo.cpp:67] Gloo connectFullMesh failed\n"
        "RuntimeError: Gloo connectFullMesh failed with [/__w/pytorch/third_party/gloo/"
        "gloo/transport/tcp/pair.cc:152] timed out connecting: SO_ERROR: Connection "
        "refused, remote=[127.0.0.1]:31112$2\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "  exitcode  : 1 (pid: 30784)\n"
    )
    assert launcher.failure_reason(stderr, 1) == TORCH_ERROR
    assert launcher.failure_reason("no traceback here\n", 3) == "exit status 3"


def test_png_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit):
        plots.main(["launcher", str(tmp_path / "none.csv"), "--png", str(tmp_path / "x.png")])
    assert 'pip install -e ".[bench]"' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launcher.main(["--png", str(tmp_path / "x.png")])
    assert 'pip install -e ".[bench]"' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        store.parse_args(["--png", str(tmp_path / "x.png"), "--impl", "ours"])
    assert 'pip install -e ".[bench]"' in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


# -- benchmarks/scale.py: each measure against the number of ranks ---------------------------


def test_the_scale_plot_is_written_with_a_failed_configuration(tmp_path):
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (the bench extra)")
    rows = [
        {
            "backend": "tcp",
            "label": "distcomm tcp",
            "nprocs": str(n),
            "status": "ok",
            **{
                f"{key}_{stat}": str(n + (stat == "max"))
                for key, _ in plots.SCALE_PANELS
                for stat in ("median", "max")
            },
        }
        for n in (2, 4, 8)
    ]
    rows.append(
        {
            "backend": "gloo",
            "label": "distcomm gloo",
            "nprocs": "8",
            "status": "failed",
            "init_s_median": "",
            "init_s_max": "",
        }
    )
    path = tmp_path / "scale.png"
    plots.scale(rows, str(path), "test")
    assert_png(path)


# -- benchmarks/rendezvous.py: each measure against the number of nodes ----------------------


def test_the_rendezvous_plot_is_written_with_an_incomplete_round(tmp_path):
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (the bench extra)")
    rows = [
        {
            "backend": backend,
            "nodes": str(n),
            "processes": "1",
            "status": "ok",
            "error": "",
            "round_s": str(n / 100),
            "requests_per_node": str(n),
            "heartbeat_requests_per_node_per_interval": "2.5",
            "watch_requests_per_node_per_interval": "1",
            "state_keys": "1",
            "state_bytes": str(70 * n),
            "recovery_s": "16.5",
            "recovery_limit_s": "20",
            "keep_alive_interval": "5",
            "keep_alive_max_attempt": "3",
        }
        for backend in ("c10d", "file")
        for n in (16, 64)
    ]
    rows.append(
        {
            **rows[1],
            "nodes": "256",
            "status": "incomplete",
            "round_s": "",
            "recovery_s": "",
            "error": "only 200 of 256 nodes had their RendezvousInfo",
        }
    )
    csv_path, png = tmp_path / "rendezvous.csv", tmp_path / "rendezvous.png"
    plots.write_csv(rows, str(csv_path), plots.RENDEZVOUS_FIELDS)
    assert plots.main(["rendezvous", str(csv_path), "--png", str(png)]) == 0
    assert_png(png)
