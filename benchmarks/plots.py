"""Plots of the benchmarks' rows, ours beside each peer (matplotlib, the `bench` extra).

`collectives(rows, path)` draws what `benchmarks/collectives.py` measured: for each op, the
time per call and the bus bandwidth against the message size, one line for distcomm and
one for the peer of each run (torch gloo, raw mpi4py, raw CuPy NCCL). The rows may come
from several runs (the CSV files of a gloo run beside torch and an mpi run beside mpi4py,
say): each (backend, ranks) pair is one line, and so is each peer.

`store(rows, path)` draws `benchmarks/store.py` (distcomm's TCPStore beside torch's) and
`launcher(rows, path)` draws `benchmarks/launcher.py` (distcomm-run beside torchrun). Both
benchmarks repeat each measurement, so each cell shows every run as a dot, the median as a
wide bar and the fastest to the slowest run as a thin line; a run that failed is counted
on the plot ("failed in 5 of 5 runs", with the error), never drawn as zero.

    python benchmarks/collectives.py --op all_reduce --compare torch --png gloo.png
    python benchmarks/plots.py collectives gloo.csv mpi.csv --png collectives.png
    python benchmarks/store.py --csv store.csv --png store.png
    python benchmarks/plots.py store store.csv --png store.png
    python benchmarks/launcher.py --csv launcher.csv --png launcher.png
    python benchmarks/plots.py launcher launcher.csv --png launcher.png
    python benchmarks/scale.py --csv scale.csv --png scale.png
    python benchmarks/plots.py scale scale.csv --png scale.png

`rendezvous(rows, path)` draws `benchmarks/rendezvous.py`: round time, store requests per
node, heartbeat load, the state's size and the recovery time against the number of nodes,
one line per backend.

    python benchmarks/rendezvous.py --csv rdzv.csv --png rdzv.png
    python benchmarks/plots.py rendezvous rdzv.csv --png rdzv.png

`scale(rows, path)` draws `benchmarks/scale.py`: each measure against the number of ranks
(log scale), one line per backend through the medians over the ranks, the maxima dotted; a
configuration that failed keeps the points its ranks measured before the failure and is
listed under the picture.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import textwrap
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

#: the peer a run of each distcomm backend is compared with (--compare)
PEERS = {"gloo": "torch gloo", "tcp": "torch gloo", "mpi": "raw mpi4py", "nccl": "raw CuPy NCCL"}

#: The columns of benchmarks/store.py --csv: one row per run of one measurement of one store.
#: `value` is empty where the run failed.
STORE_FIELDS = ("impl", "label", "measurement", "op", "clients", "run", "value")
#: The columns of benchmarks/launcher.py --csv: one row per launch; `seconds` is empty and
#: `error` says why where the launch failed.
LAUNCHER_FIELDS = ("measurement", "impl", "label", "nproc", "run", "seconds", "error")

#: The columns of benchmarks/rendezvous.py --csv: one row per backend and node count; a
#: measure is empty where it was not measured or its step failed (`status`, `error` say why).
RENDEZVOUS_FIELDS = (
    "backend",
    "nodes",
    "processes",
    "status",
    "error",
    "round_s",
    "requests_per_node",
    "heartbeat_requests_per_node_per_interval",
    "watch_requests_per_node_per_interval",
    "state_keys",
    "state_bytes",
    "recovery_s",
    "recovery_limit_s",
    "keep_alive_interval",
    "keep_alive_max_attempt",
)

#: What the dots and bars of the store and launcher plots mean, under each picture.
SPREAD_NOTE = (
    "each dot: one run; wide bar: the median; thin line: the fastest to the slowest "
    "run. A cell whose runs failed says so; it is never drawn as zero."
)


def require_matplotlib(parser: argparse.ArgumentParser) -> None:
    """Stop with a usage error naming the fix when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error(
            f"--png needs matplotlib, which is not importable in this Python "
            f"({sys.executable}); install it (pip install matplotlib, or the "
            "'bench' extra: pip install -e \".[bench]\") or run without --png"
        )


def _pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (imported only when drawing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _number(value: Any) -> float | None:
    if value in ("", None):
        return None
    return float(value)


def _series(rows: Iterable[dict[str, Any]]) -> dict[tuple[str, str], dict[str, list]]:
    """{(label, op): {"size": [...], "time": [...], "busbw": [...]}}, ours and the peers."""
    out: dict[tuple[str, str], dict[str, list]] = {}
    for row in rows:
        backend, n, op = row["backend"], int(row["nprocs"]), row["op"]
        size = int(row["size"])
        for label, time_key, bw_key in (
            (f"distcomm {backend}, {n} ranks", "time_us", "busbw"),
            (f"{PEERS.get(backend, 'peer')}, {n} ranks", "peer_time_us", "peer_busbw"),
        ):
            time_us = _number(row.get(time_key))
            if time_us is None:
                continue
            line = out.setdefault((label, op), {"size": [], "time": [], "busbw": []})
            line["size"].append(size)
            line["time"].append(time_us)
            line["busbw"].append(_number(row.get(bw_key)) or 0.0)
    return out


def collectives(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Write a PNG to `path`: per op, time and bus bandwidth against size, every line."""
    plt = _pyplot()
    series = _series(rows)
    ops = list(dict.fromkeys(op for _, op in series))
    sized = [op for op in ops if op != "barrier"]
    labels = list(dict.fromkeys(label for label, _ in series))
    colours = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    height = len(sized) + (1 if "barrier" in ops else 0)
    fig, axes = plt.subplots(max(height, 1), 2, figsize=(12, 3.6 * max(height, 1)), squeeze=False)
    for i, op in enumerate(sized):
        ax_time, ax_bw = axes[i]
        for label in labels:
            line = series.get((label, op))
            if line is None:
                continue
            style = dict(
                marker="o",
                markersize=3,
                color=colours[label],
                label=label,
                linestyle="--" if label.startswith(tuple(PEERS.values())) else "-",
            )
            ax_time.plot(line["size"], line["time"], **style)
            ax_bw.plot(line["size"], line["busbw"], **style)
        ax_time.set(
            xscale="log",
            yscale="log",
            xlabel="message size (bytes)",
            ylabel="time per call (us)",
            title=f"{op}: latency",
        )
        ax_bw.set(
            xscale="log",
            xlabel="message size (bytes)",
            ylabel="bus bandwidth (GB/s)",
            title=f"{op}: bus bandwidth",
        )
        for ax in (ax_time, ax_bw):
            ax.grid(True, which="both", alpha=0.3)
        ax_time.legend(fontsize="small")
    if "barrier" in ops:
        ax, spare = axes[len(sized)]
        names = [label for label in labels if (label, "barrier") in series]
        times = [series[(label, "barrier")]["time"][0] for label in names]
        ax.barh(names, times, color=[colours[label] for label in names])
        ax.set(xscale="log", xlabel="time per call (us)", title="barrier")
        ax.grid(True, which="both", axis="x", alpha=0.3)
        spare.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"# wrote the plot to {path}", flush=True)


# -- repeated measurements: store and launcher ---------------------------------------------------

#: one cell of a repeated measurement: each run's value (None: that run failed) and the
#: failed runs' errors
Cell = tuple[list[float | None], list[str]]


def failure_note(values: Sequence[float | None]) -> str:
    """'failed in 2 of 5 runs' ('' when none failed): the words the plots and tables use."""
    failed = sum(1 for v in values if v is None)
    return f"failed in {failed} of {len(values)} runs" if failed else ""


def _reason(errors: list[str], width: int) -> str:
    """The failed runs' errors, the most common first ("2x ..." where they differ), each
    wrapped to `width` and cut to four lines."""
    counts = Counter(e for e in errors if e).most_common()
    parts = []
    for error, count in counts[:2]:
        lines = textwrap.wrap(error if len(counts) == 1 else f"{count}x {error}", width)
        parts.append("\n".join(lines[:4]) + (" ..." if len(lines) > 4 else ""))
    if len(counts) > 2:
        parts.append(f"and {len(counts) - 2} other errors")
    return "\n".join(parts)


def _cells(
    ax: Any,
    groups: Sequence[Any],
    labels: Sequence[str],
    cell: Callable[[Any, str], Cell | None],
    *,
    fmt: Callable[[float], str] | None = None,
    connect: bool = False,
    wrap: int = 28,
) -> None:
    """Draw each label's runs in each group side by side on `ax` (categorical x).

    Every run a dot, the median a wide bar, min to max a thin line, the median's value
    beside it when `fmt` is given, the medians joined across the groups when `connect`
    (ours solid, the peers dashed). A cell with failed runs says "failed in k of n runs"
    above its dots; one whose runs all failed is a hatched band the height of the axis, no
    value, with that note and the errors in its middle.
    """
    from matplotlib.transforms import blended_transform_factory

    band = blended_transform_factory(ax.transData, ax.transAxes)
    width = 0.8 / max(len(labels), 1)
    for j, label in enumerate(labels):
        colour, marker = f"C{j % 10}", "os^Dv"[j % 5]
        line_x: list[float] = []
        line_y: list[float] = []
        for i, group in enumerate(groups):
            got = cell(group, label)
            if got is None:  # not measured (no such row): nothing to draw
                continue
            values, errors = got
            x = i + (j - (len(labels) - 1) / 2) * width
            good = [v for v in values if v is not None]
            note = failure_note(values)
            if good:
                step = 0.5 * width / max(len(good), 1)
                xs = [x + (k - (len(good) - 1) / 2) * step for k in range(len(good))]
                ax.scatter(
                    xs, good, s=16, color=colour, marker=marker, alpha=0.5, linewidths=0, zorder=3
                )
                ax.vlines(x, min(good), max(good), color=colour, linewidth=1, zorder=2)
                median = statistics.median(good)
                ax.hlines(
                    median, x - 0.3 * width, x + 0.3 * width, color=colour, linewidth=2.5, zorder=4
                )
                line_x.append(x)
                line_y.append(median)
                if fmt is not None:
                    ax.annotate(
                        fmt(median),
                        (x + 0.32 * width, median),
                        fontsize=7,
                        color=colour,
                        va="center",
                        ha="left",
                    )
                if note:
                    ax.annotate(
                        note,
                        (x, max(good)),
                        xytext=(0, 5),
                        textcoords="offset points",
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        color="C3",
                    )
            elif values:
                ax.fill_between(
                    [x - 0.4 * width, x + 0.4 * width],
                    0,
                    1,
                    transform=band,
                    facecolor="none",
                    edgecolor=colour,
                    hatch="//",
                    alpha=0.35,
                    linewidth=0,
                    zorder=1,
                )
                reason = _reason(errors, wrap)
                text = "\n".join(textwrap.wrap(f"{label}: {note}", wrap))
                ax.text(
                    x,
                    0.5,
                    text + (f"\n{reason}" if reason else ""),
                    transform=band,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="C3",
                    zorder=5,
                    bbox=dict(boxstyle="round", facecolor="white", edgecolor="C3", alpha=0.95),
                )
        if connect and len(line_x) > 1:
            ax.plot(
                line_x,
                line_y,
                color=colour,
                linewidth=1,
                alpha=0.7,
                linestyle="-" if j == 0 else "--",
                zorder=1,
            )
    ax.set_xticks(range(len(groups)), [str(g) for g in groups])
    if groups:
        ax.set_xlim(-0.5, len(groups) - 0.5)
    ax.margins(y=0.12)  # room above the slowest run for its note
    ax.grid(True, which="both", axis="y", alpha=0.3)


def _plain(value: float, _pos: Any = None) -> str:
    """A tick's number without powers of ten: 0.5, 20, 3k, 1.5M."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def _log_y(ax: Any) -> None:
    """A log y axis labelled in plain numbers, with 2 and 5 labelled too when it spans
    less than about a decade and a half."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(_plain))
    low, high = ax.get_ylim()
    if high / low < 30:
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        ax.yaxis.set_minor_formatter(FuncFormatter(_plain))
    else:
        ax.yaxis.set_minor_formatter(NullFormatter())


def _legend(ax: Any, labels: Sequence[str]) -> None:
    from matplotlib.lines import Line2D

    handles = [
        Line2D(
            [],
            [],
            color=f"C{j % 10}",
            marker="os^Dv"[j % 5],
            linewidth=2.5,
            linestyle="-" if j == 0 else "--",
            label=label,
        )
        for j, label in enumerate(labels)
    ]
    ax.legend(handles=handles, fontsize="small")


def _finish(fig: Any, plt: Any, path: str, title: str, note: str) -> None:
    fig.suptitle(title)
    fig.text(0.01, 0.005, note, fontsize=8, color="0.3", va="bottom", ha="left")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"# wrote the plot to {path}", flush=True)


def _labels(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The implementations in the order they first appear: ours first, then the peers."""
    return list(dict.fromkeys(row["label"] for row in rows))


def _runs(
    rows: Iterable[dict[str, Any]], key: Callable[[dict[str, Any]], Any], value: str
) -> dict[Any, Cell]:
    """{key(row): (each run's value or None, the failed runs' errors)} in the rows' order."""
    out: dict[Any, Cell] = {}
    for row in rows:
        values, errors = out.setdefault(key(row), ([], []))
        number = _number(row[value])
        values.append(number)
        if number is None:
            errors.append(row.get("error") or "")
    return out


#: The store plot's panels: measurement, title, y label, x axis ("op" or "clients"), log y.
STORE_PANELS = (
    (
        "calls_per_s",
        "one client: calls per second (higher is better)",
        "calls per second (log scale)",
        "op",
        True,
    ),
    (
        "barrier_ms",
        "barrier of N clients (lower is better)",
        "start to the last client's return (ms, log scale)",
        "clients",
        True,
    ),
    (
        "server_cpu_us_per_call",
        "server CPU per call, one client (lower is better)",
        "server process CPU per call (µs)",
        "op",
        False,
    ),
    (
        "client_cpu_us_per_call",
        "client CPU per call, one client (lower is better)",
        "client process CPU per call (µs)",
        "op",
        False,
    ),
    (
        "connect_ms",
        "connecting N clients (lower is better)",
        "time to connect all, before the barrier (ms, log)",
        "clients",
        True,
    ),
)


def store(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Write a PNG to `path`: benchmarks/store.py's rows, each store's runs side by side.

    Panels: calls per second of one client per op, the barrier's time against its clients,
    the server's and the client's CPU time per call per op, and the time to connect the
    barrier's clients; a measurement missing from the rows leaves its panel empty.
    """
    plt = _pyplot()
    labels = _labels(rows)
    runs = _runs(
        rows, lambda r: (r["measurement"], r["op"], int(r["clients"]), r["label"]), "value"
    )
    fig = plt.figure(figsize=(15, 9))
    grid = fig.add_gridspec(2, 3)
    axes = [
        fig.add_subplot(grid[0, :2]),
        fig.add_subplot(grid[0, 2]),
        fig.add_subplot(grid[1, 0]),
        fig.add_subplot(grid[1, 1]),
        fig.add_subplot(grid[1, 2]),
    ]
    for ax, (measurement, name, ylabel, by, log) in zip(axes, STORE_PANELS, strict=True):
        keys = [k for k in runs if k[0] == measurement]
        if by == "op":
            groups = list(dict.fromkeys(op for _, op, _, _ in keys))
            find: dict[Any, Any] = {(op, label): (m, op, n, label) for m, op, n, label in keys}
            xlabel = "call"
            ax.tick_params(axis="x", labelsize=8)
        else:
            groups = sorted(dict.fromkeys(n for _, _, n, _ in keys))
            find = {(n, label): (m, op, n, label) for m, op, n, label in keys}
            xlabel = "clients (threads spread over the barrier processes)"
        _cells(
            ax,
            groups,
            labels,
            lambda g, lab, find=find: runs.get(find.get((g, lab))),
            connect=by == "clients",
            wrap=22,
        )
        if log and keys:
            _log_y(ax)
        ax.set(title=name, xlabel=xlabel, ylabel=ylabel)
        if not keys:
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", color="0.5")
    _legend(axes[0], labels)
    heading = "TCPStore on 127.0.0.1: " + " against ".join(labels)
    _finish(
        fig,
        plt,
        path,
        heading + (f"\n{title}" if title else ""),
        SPREAD_NOTE + " Barrier: one dot per round. torch's get is two requests on the "
        "wire (WAIT, GET), distcomm's one.",
    )


#: The launcher plot's panels: measurement, title.
LAUNCHER_PANELS = (
    ("launch", "launch: workers init, one barrier, exit (wall time)"),
    ("recovery", "recovery: a worker's failure to the restarted group's first barrier"),
)


def launcher(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Write a PNG to `path`: benchmarks/launcher.py's rows, launch and recovery time,
    each launcher's runs side by side per worker count (lower is better)."""
    plt = _pyplot()
    labels = _labels(rows)
    runs = _runs(rows, lambda r: (r["measurement"], int(r["nproc"]), r["label"]), "seconds")
    nprocs = sorted(dict.fromkeys(n for _, n, _ in runs))
    groups = [f"{n} workers" for n in nprocs]
    fig, axes = plt.subplots(1, len(LAUNCHER_PANELS), figsize=(12, 5.2), squeeze=False)
    for ax, (measurement, name) in zip(axes[0], LAUNCHER_PANELS, strict=True):
        _cells(
            ax,
            groups,
            labels,
            lambda g, lab, m=measurement: runs.get((m, int(g.split()[0]), lab)),
            fmt=lambda v: f"{v:.2f} s",
            wrap=30,
        )
        done = [
            v
            for (m, _, _), (values, _) in runs.items()
            if m == measurement
            for v in values
            if v is not None
        ]
        ax.set_ylim(0, 1.15 * max(done) if done else 1)
        ax.set(title=name, ylabel="seconds (lower is better)", xlabel="workers per launch")
    _legend(axes[0][0], labels)
    heading = " against ".join(labels) + ": launch and recovery"
    _finish(fig, plt, path, heading + (f"\n{title}" if title else ""), SPREAD_NOTE)


#: The measures of benchmarks/scale.py, one panel each: (column prefix, panel title).
SCALE_PANELS = (
    ("init_s", "init_process_group (s)"),
    ("first_all_reduce_ms", "first 8-byte all_reduce (ms)"),
    ("all_reduce_us", "8-byte all_reduce (us)"),
    ("barrier_us", "barrier (us)"),
    ("threads_os", "threads per rank (kernel)"),
    ("sockets", "sockets per rank"),
    ("rss_mib", "RSS per rank (MiB)"),
    ("store_requests_init", "store requests per rank, init"),
    ("store_requests_new_group", "store requests per rank, new_group"),
)


def scale(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Each measure of benchmarks/scale.py against N: one line per backend (medians over
    the ranks; the maxima dotted in the same colour), x and y log-scaled."""
    plt = _pyplot()
    labels = _labels(rows)
    columns = 3
    lines = -(-len(SCALE_PANELS) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(5.2 * columns, 3.6 * lines), squeeze=False)
    failed = sorted(
        {
            f"{row['label']}, {row['nprocs']} ranks: {row['status']}"
            for row in rows
            if row.get("status") not in ("ok", None)
        }
    )
    for ax, (key, heading) in zip(axes.flat, SCALE_PANELS, strict=False):
        for j, label in enumerate(labels):
            points = sorted(
                (
                    int(row["nprocs"]),
                    _number(row.get(f"{key}_median")),
                    _number(row.get(f"{key}_max")),
                )
                for row in rows
                if row["label"] == label
            )
            points = [p for p in points if p[1] is not None]
            if not points:
                continue
            xs = [p[0] for p in points]
            ax.plot(
                xs, [p[1] for p in points], color=f"C{j % 10}", marker="os^Dv"[j % 5], label=label
            )
            ax.plot(xs, [p[2] for p in points], color=f"C{j % 10}", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog" if key.startswith("store") else "log")
        ax.xaxis.set_major_formatter(_plain)
        ax.set_title(heading, fontsize="medium")
        ax.set_xlabel("ranks")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(SCALE_PANELS) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize="small")
    note = "solid: median over the ranks; dotted: the slowest / largest rank."
    if failed:
        note += " Failed (drawn up to the step that failed): " + "; ".join(failed)
    _finish(
        fig,
        plt,
        path,
        "Cost per rank against the number of ranks" + (f"\n{title}" if title else ""),
        note,
    )


#: The measures of benchmarks/rendezvous.py, one panel each: (column, panel title).
RENDEZVOUS_PANELS = (
    ("round_s", "round: start to the last node's RendezvousInfo (s)"),
    ("requests_per_node", "store requests per node per round"),
    (
        "heartbeat_requests_per_node_per_interval",
        "requests per node per keep-alive interval, heartbeats",
    ),
    ("state_bytes", "state: bytes of the run's keys"),
    ("recovery_s", "recovery: a node killed to the survivors' next round (s)"),
)


def rendezvous(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Each measure of benchmarks/rendezvous.py against N, one line per backend, both axes
    log-scaled (the recovery's time on a linear scale, beside each backend's target,
    dashed). A configuration whose round failed or did not complete is listed under the
    picture and drawn only with what it measured before that."""
    plt = _pyplot()
    backends = list(dict.fromkeys(row["backend"] for row in rows))
    columns = 3
    lines = -(-len(RENDEZVOUS_PANELS) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(5.2 * columns, 3.8 * lines), squeeze=False)
    failed = sorted(
        {
            f"{row['backend']}, {row['nodes']} nodes: {row['status']}"
            for row in rows
            if row.get("status") not in ("ok", None, "")
        }
    )
    for ax, (key, heading) in zip(axes.flat, RENDEZVOUS_PANELS, strict=False):
        for j, backend in enumerate(backends):
            points = sorted(
                (int(row["nodes"]), _number(row.get(key)), _number(row.get("recovery_limit_s")))
                for row in rows
                if row["backend"] == backend
            )
            drawn = [p for p in points if p[1] is not None]
            colour = f"C{j % 10}"
            if drawn:
                ax.plot(
                    [p[0] for p in drawn],
                    [p[1] for p in drawn],
                    color=colour,
                    marker="os^Dv"[j % 5],
                    label=backend,
                )
            limits = [p for p in points if p[2] is not None]
            if key == "recovery_s" and limits:
                ax.plot(
                    [p[0] for p in limits],
                    [p[2] for p in limits],
                    color=colour,
                    linestyle="--",
                    linewidth=1,
                )
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(_plain)
        if key == "recovery_s":
            tops = [max(line.get_ydata(), default=0) for line in ax.lines]
            ax.set_ylim(0, 1.15 * max(tops, default=1) or 1)
        elif ax.lines:
            _log_y(ax)
        ax.set_title(heading, fontsize="medium")
        ax.set_xlabel("nodes")
        ax.grid(True, which="both", alpha=0.3)
        if not ax.lines:
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", color="0.5")
    for ax in list(axes.flat)[len(RENDEZVOUS_PANELS) :]:
        ax.set_visible(False)
    if backends:
        axes.flat[0].legend(fontsize="small")
    note = "recovery: dashed, keep_alive_interval x keep_alive_max_attempt + 5 s."
    if failed:
        note += " Not complete (drawn up to the step that failed): " + "; ".join(failed)
    _finish(
        fig,
        plt,
        path,
        "Rendezvous of N simulated nodes against N" + (f"\n{title}" if title else ""),
        "\n".join(textwrap.wrap(note, 180)),
    )


def write_csv(rows: list[dict[str, Any]], path: str, fields: Sequence[str]) -> None:
    """Write `rows` to `path` with a header of `fields` (None as an empty cell)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields))
        writer.writeheader()
        writer.writerows(rows)
    print(f"# wrote {len(rows)} rows to {path}", flush=True)


def read_csv(paths: Iterable[str]) -> list[dict[str, Any]]:
    """The rows of every CSV file, in order."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        with open(path, newline="") as f:
            rows.extend(csv.DictReader(f))
    return rows


#: What draws the rows of each benchmark's CSV files.
KINDS: dict[str, Callable[[list[dict[str, Any]], str, str], None]] = {
    "collectives": collectives,
    "store": store,
    "launcher": launcher,
    "scale": scale,
    "rendezvous": rendezvous,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot benchmark CSV files, ours beside the peers.")
    parser.add_argument(
        "kind",
        choices=tuple(KINDS),
        help="which benchmark wrote the files (benchmarks/KIND.py --csv)",
    )
    parser.add_argument("csv", nargs="+", help="CSV files written with --csv")
    parser.add_argument("--png", required=True, metavar="PATH", help="the picture to write")
    parser.add_argument(
        "--title",
        default="",
        help="a title above the plots (store and launcher: a second line under theirs)",
    )
    args = parser.parse_args(argv)
    require_matplotlib(parser)
    try:
        rows = read_csv(args.csv)
        if not rows:
            parser.error(f"no rows in {', '.join(args.csv)}")
        KINDS[args.kind](rows, args.png, args.title)
    except (OSError, KeyError, ValueError) as exc:
        parser.error(
            f"cannot plot {', '.join(args.csv)}: {exc!r} (files written by "
            f"benchmarks/{args.kind}.py --csv?)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
