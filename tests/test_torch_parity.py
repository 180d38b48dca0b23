"""The same script under torch.distributed and under distcomm, with only the import changed,
must do the same thing. Runs only where torch is installed (it is never a dependency):
`pip install torch==2.13.0`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.harness import LOOPBACK_ENV

torch = pytest.importorskip("torch", reason="the torch comparisons need torch installed")

pytestmark = pytest.mark.timeout(180)

#: run as `python script.py FRAMEWORK RENDEZVOUS RANK WORLD`; prints one JSON line
NON_MEMBER = """
    import json, sys, warnings
    framework, rendezvous = sys.argv[1], sys.argv[2]
    rank, world = int(sys.argv[3]), int(sys.argv[4])
    if framework == "torch":
        import torch
        import torch.distributed as dist
        array = lambda values: torch.tensor(values, dtype=torch.float64)
    else:
        import numpy as np
        import distcomm as dist
        array = lambda values: np.array(values, dtype=np.float64)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)
    group = dist.new_group([0, 1])  # torch's tutorial: four processes, a group of two
    x, objs, out = array([1.0, 2.0]), ["kept"], [None, None]
    seen = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen["all_reduce"] = repr(dist.all_reduce(x, group=group))
        seen["broadcast"] = repr(dist.broadcast(x, src=0, group=group))
        seen["all_gather_object"] = repr(dist.all_gather_object(out, rank, group=group))
        seen["broadcast_object_list"] = repr(dist.broadcast_object_list(objs, src=0,
                                                                        group=group))
        seen["barrier"] = repr(dist.barrier(group=group))
        if rank >= 2:
            seen["recv"] = repr(dist.recv(x, src=0, group=group))
            seen["isend"] = repr(dist.isend(x, dst=0, group=group))
    print(json.dumps({
        "non_member_handle": group == dist.GroupMember.NON_GROUP_MEMBER,
        "rank": dist.get_rank(group), "size": dist.get_world_size(group),
        "returns": seen, "x": [float(v) for v in x], "objs": objs, "out": out,
        "warnings": [str(w.message) for w in caught
                     if "does not belong" in str(w.message)],
    }), flush=True)
    dist.destroy_process_group()
"""


def _run(tmp_path, framework: str, script: str, world: int) -> list[dict]:
    path = tmp_path / f"script_{framework}.py"
    path.write_text(textwrap.dedent(script))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTCOMM_")}
    env.update(LOOPBACK_ENV, GLOO_SOCKET_IFNAME="lo")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    rendezvous = tmp_path / f"rdzv-{framework}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(path), framework, str(rendezvous), str(r), str(world)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=150)
            assert proc.returncode == 0, f"{framework}: {err}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def test_collectives_on_a_group_this_rank_is_not_in_do_nothing_as_in_torch(tmp_path):
    ours = _run(tmp_path, "distcomm", NON_MEMBER, 4)
    theirs = _run(tmp_path, "torch", NON_MEMBER, 4)
    assert ours == theirs
    for rank in (2, 3):  # what that is: no-ops that warn, arrays and lists untouched
        assert ours[rank]["non_member_handle"] and ours[rank]["rank"] == -1
        assert ours[rank]["x"] == [1.0, 2.0] and ours[rank]["objs"] == ["kept"]
        assert ours[rank]["returns"]["recv"] == "-1"
        assert ours[rank]["warnings"][0] == (
            f"Running all_reduce on global rank {rank} which does not belong to the given group."
        )
    assert ours[0]["x"] == [2.0, 4.0] and ours[1]["out"] == [0, 1]
    assert ours[2]["out"] == [None, None]


def test_every_function_takes_torchs_keyword_arguments():
    """A port passes torch's keywords: each public function that torch.distributed also
    has accepts every parameter name torch's takes."""
    import inspect

    import torch.distributed as torch_dist

    import distcomm as dist

    missing = {}
    for name in dist.__all__:
        if name == "reduce_op":  # deprecated in both; reading torch's warns
            continue
        theirs, ours = getattr(torch_dist, name, None), getattr(dist, name)
        if not (inspect.isfunction(theirs) and inspect.isfunction(ours)):
            continue
        names = set(inspect.signature(ours).parameters)
        lacking = [
            p
            for p in inspect.signature(theirs).parameters
            if not p.startswith("_") and p not in names
        ]
        if lacking:
            missing[name] = lacking
    assert missing == {}


def test_readme_shows_the_api_tables_and_nothing_is_missing():
    """The docs' copy of `python -m tests.torch_api_table` is the script's output, and
    no torch name is missing from distcomm except those left out on purpose."""
    readme = (Path(__file__).resolve().parent.parent / "docs" / "torch-differences.md").read_text()
    match = re.search(r"<!-- torch-api-table -->\n(.*?)\n<!-- /torch-api-table -->", readme, re.S)
    assert match, "docs/torch-differences.md lacks the <!-- torch-api-table --> section"
    result = subprocess.run(
        [sys.executable, "-m", "tests.torch_api_table"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert result.returncode == 0, result.stderr
    assert match.group(1).strip() == result.stdout.strip(), (
        "docs/torch-differences.md's API tables are stale: paste the output of "
        "python -m tests.torch_api_table"
    )
    assert "missing:" not in result.stderr, result.stderr
