"""Line up the flight-recorder dumps of a run's ranks and say what went wrong.

`python -m distcomm.trace DIR` reads every `rank-<R>.json` in DIR, lines the ranks of
each group up by collective sequence number, and reports in plain words:

- the first collective that not every rank of the group entered, which ranks are
  missing from it and what each of them did last instead;
- when every rank entered every collective, the first one that did not complete
  everywhere (a hang or failure inside it), and on which ranks;
- collectives whose signature (op, dtype, count, root, reduce op) differs between ranks;
- members of a group that left no trace at all.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TraceError", "analyze", "load_traces", "render", "summarize_ranks"]

#: at most this many mismatched collectives are reported per group
MAX_MISMATCHES = 10


class TraceError(ValueError):
    """The directory holds no trace that could be read."""


def load_traces(directory: str) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """Every readable `rank-*.json` of `directory`, by rank, and a note per unreadable one.

    Raises:
        TraceError: the directory does not exist or holds no readable trace.
    """
    if not os.path.isdir(directory):
        raise TraceError(f"{directory} is not a directory; pass the DISTCOMM_TRACE_DIR of the run")
    traces: dict[int, dict[str, Any]] = {}
    problems = []
    paths = sorted(glob.glob(os.path.join(directory, "rank-*.json")))
    for path in paths:
        try:
            with open(path, encoding="utf-8") as fp:
                data = json.load(fp)
            rank = int(data["rank"])
            if not isinstance(data.get("groups"), list):
                raise ValueError("it has no 'groups' list")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problems.append(f"{os.path.basename(path)} could not be read: {exc}")
            continue
        traces[rank] = data
    if not traces:
        found = f" ({len(paths)} unreadable)" if paths else ""
        raise TraceError(
            f"{directory} holds no readable flight-recorder trace (rank-<R>.json){found}; "
            "traces are written when DISTCOMM_TRACE_DIR is set, on a timeout, an abort, "
            "SIGTERM, SIGUSR1 or distcomm.dump_trace()"
        )
    return traces, problems


def summarize_ranks(ranks: list[int]) -> str:
    """Ranks as "0, 2, 4-7"."""
    parts: list[str] = []
    values = sorted(set(ranks))
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ", ".join(parts)


def _signature(entry: dict[str, Any]) -> tuple[Any, ...]:
    count = None if entry["op"].startswith("all_to_all") else entry.get("count")
    return (entry["op"], entry.get("dtype"), count, entry.get("root"), entry.get("reduce_op"))


def describe_entry(entry: dict[str, Any]) -> str:
    """ "#7 all_reduce (float32 x 4, SUM)", "send to rank 3 (int64 x 2)"."""
    details = []
    if entry.get("dtype") is not None:
        details.append(f"{entry['dtype']} x {entry.get('count')}")
    if entry.get("reduce_op") is not None:
        details.append(str(entry["reduce_op"]))
    if entry.get("root") is not None:
        details.append(f"root {entry['root']}")
    if entry.get("profiling_name"):
        details.append(repr(entry["profiling_name"]))
    text = entry["op"]
    if entry.get("seq") is not None:
        text = f"#{entry['seq']} {text}"
    elif entry["op"] == "send":
        text = f"send to rank {entry.get('peer')}"
    elif entry["op"] == "recv":
        peer = entry.get("peer")
        text = "recv from any rank" if peer is None else f"recv from rank {peer}"
    return f"{text} ({', '.join(details)})" if details else text


@dataclass
class _Group:
    name: str
    ranks: list[int]
    entries: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # by global rank


def _groups(traces: dict[int, dict[str, Any]]) -> list[_Group]:
    groups: dict[tuple[str, tuple[int, ...]], _Group] = {}
    for rank, data in sorted(traces.items()):
        for g in data["groups"]:
            key = (str(g["name"]), tuple(g["ranks"]))
            group = groups.setdefault(key, _Group(key[0], list(key[1])))
            group.entries[rank] = list(g.get("entries", []))  # oldest first
    return list(groups.values())


def _analyze_group(group: _Group, traces: dict[int, dict[str, Any]]) -> dict[str, Any]:
    present = [r for r in group.ranks if r in group.entries]
    result: dict[str, Any] = {
        "name": group.name,
        "ranks": group.ranks,
        "no_trace": [r for r in group.ranks if r not in group.entries],
        "first_missing": None,
        "first_incomplete": None,
        "mismatches": [],
    }
    collectives = {
        r: {e["seq"]: e for e in group.entries[r] if e.get("seq") is not None} for r in present
    }
    if not present or not any(collectives.values()):
        return result
    # the ring keeps each rank's last N ops: compare only what every rank still holds
    low = max((min(c) if c else 0) for c in collectives.values())
    high = max((max(c) if c else -1) for c in collectives.values())

    def last_op(rank: int) -> dict[str, Any] | None:
        entries = group.entries[rank]
        return entries[-1] if entries else None

    for seq in range(low, high + 1):
        entered = [r for r in present if seq in collectives[r]]
        if len(entered) == len(present):
            continue
        sample = collectives[entered[0]][seq]
        result["first_missing"] = {
            "seq": seq,
            "op": sample["op"],
            "description": describe_entry(sample),
            "entered": entered,
            "missing": [{"rank": r, "last": last_op(r)} for r in present if r not in entered],
        }
        break
    for seq in range(low, high + 1):
        states = {r: collectives[r][seq]["state"] for r in present if seq in collectives[r]}
        stuck = {r: s for r, s in states.items() if s != "completed"}
        if stuck:
            sample = next(collectives[r][seq] for r in stuck)
            result["first_incomplete"] = {
                "seq": seq,
                "description": describe_entry(sample),
                "states": stuck,
                "errors": {r: collectives[r][seq].get("error") for r in stuck},
            }
            break
    for seq in range(low, high + 1):
        signatures: dict[tuple[Any, ...], list[int]] = {}
        for r in present:
            if seq in collectives[r]:
                signatures.setdefault(_signature(collectives[r][seq]), []).append(r)
        if len(signatures) > 1:
            result["mismatches"].append(
                {
                    "seq": seq,
                    "variants": [
                        {"ranks": ranks, "description": describe_entry(collectives[ranks[0]][seq])}
                        for ranks in signatures.values()
                    ],
                }
            )
            if len(result["mismatches"]) >= MAX_MISMATCHES:
                break
    return result


def analyze(directory: str) -> dict[str, Any]:
    """The findings for the traces in `directory`, as JSON-ready data.

    Raises:
        TraceError: no trace could be read.
    """
    traces, problems = load_traces(directory)
    world_sizes = {int(d.get("world_size", 0)) for d in traces.values()}
    world_size = max(world_sizes) if world_sizes else 0
    return {
        "directory": directory,
        "world_size": world_size,
        "ranks": {
            str(rank): {
                "host": d.get("host"),
                "pid": d.get("pid"),
                "reason": d.get("reason"),
            }
            for rank, d in sorted(traces.items())
        },
        "no_trace": [r for r in range(world_size) if r not in traces],
        "problems": problems,
        "groups": [_analyze_group(g, traces) for g in _groups(traces)],
    }


def _state(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "it recorded no operation in this group"
    return f"its last op was {describe_entry(entry)} ({entry['state']})"


def render(report: dict[str, Any]) -> str:
    """The findings in plain words, one paragraph per group."""
    lines = [
        f"Flight recorder traces in {report['directory']}: "
        f"{len(report['ranks'])} of {report['world_size']} ranks."
    ]
    for rank, info in report["ranks"].items():
        lines.append(
            f"  rank {rank}: host {info['host']}, pid {info['pid']}, written on {info['reason']}"
        )
    if report["no_trace"]:
        lines.append(
            f"  no trace from rank(s) {summarize_ranks(report['no_trace'])}: killed with "
            "SIGKILL, never initialised, or DISTCOMM_TRACE_DIR was not set there"
        )
    lines.extend(f"  {p}" for p in report["problems"])
    for g in report["groups"]:
        label = f"group '{g['name']}' (ranks {summarize_ranks(g['ranks'])})"
        lines.append("")
        found = False
        missing = g["first_missing"]
        if missing is not None:
            found = True
            lines.append(
                f"{label}: collective {missing['description']} was entered by rank(s) "
                f"{summarize_ranks(missing['entered'])}; "
                + "; ".join(
                    f"rank {m['rank']} never entered it: {_state(m['last'])}"
                    for m in missing["missing"]
                )
                + "."
            )
        incomplete = g["first_incomplete"]
        if incomplete is not None:
            found = True
            by_state: dict[str, list[int]] = {}
            for r, s in incomplete["states"].items():
                by_state.setdefault(s, []).append(int(r))
            states = "; ".join(
                f"{s} on rank(s) {summarize_ranks(rs)}" for s, rs in sorted(by_state.items())
            )
            lines.append(
                f"{label}: the first collective that did not complete everywhere is "
                f"{incomplete['description']}: {states}."
            )
            for r, error in incomplete["errors"].items():
                if error:
                    lines.append(f"  rank {r}: {error}")
        for mismatch in g["mismatches"]:
            found = True
            variants = "; ".join(
                f"ranks {summarize_ranks(v['ranks'])} called {v['description']}"
                for v in mismatch["variants"]
            )
            lines.append(f"{label}: collective #{mismatch['seq']} does not match: {variants}.")
        if g["no_trace"]:
            found = True
            lines.append(f"{label}: no trace from member(s) {summarize_ranks(g['no_trace'])}.")
        if not found:
            lines.append(
                f"{label}: every rank entered and completed the same collectives; "
                "nothing looks wrong."
            )
    return "\n".join(lines)
