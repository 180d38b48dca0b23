"""shrink_group: the ranks that survive a failure make a group of their own and go on."""

from __future__ import annotations

import os

import numpy as np
import pytest

import distcomm as dist
from distcomm.regroup import SHRINK_ABORT
from tests.harness import run_ranks


def _sync(name: str, count: int) -> None:
    """A barrier of `count` ranks on the test's own store (the groups may be broken)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=60)
    store.barrier(name, count)
    store.close()


def _survivors_shrink(victim: int) -> tuple[int, int, list[int]]:
    r = dist.get_rank()
    sub = dist.new_group(sorted({1, 3, victim}))
    if r == victim:
        os._exit(3)
    # every survivor is out of new_group's barrier before one aborts the old world
    _sync(f"made-sub-{victim}", 3)
    with pytest.raises(RuntimeError, match="only the remaining ranks call shrink_group"):
        dist.shrink_group([r])
    world = dist.shrink_group([victim], shrink_flags=SHRINK_ABORT)
    assert world is dist.group.WORLD
    me, size = dist.get_rank(), dist.get_world_size()
    assert size == 3 and me == (r if r < victim else r - 1), (r, me, size)
    x = np.full(3, r, dtype=np.int64)
    dist.all_reduce(x)
    assert x.tolist() == [sum(k for k in range(4) if k != victim)] * 3, x
    if sub != dist.GroupMember.NON_GROUP_MEMBER:  # every other group went with the old world
        with pytest.raises(Exception, match="destroyed"):
            dist.all_reduce(np.ones(1), group=sub)
    # a group of the renumbered world, then a shrink of it by its two remaining members
    trio = dist.new_group([0, 1, 2])
    _sync(f"made-trio-{victim}", 3)
    if me != 1:
        duo = dist.shrink_group([1], group=trio, shrink_flags=SHRINK_ABORT)
        assert dist.get_process_group_ranks(duo) == [0, 2] and duo.rank() == me // 2
        y = np.full(2, me + 1.0)
        dist.all_reduce(y, group=duo)
        assert y.tolist() == [4.0, 4.0], y
    dist.barrier()
    return me, size, dist.get_process_group_ranks(dist.group.WORLD)


@pytest.mark.parametrize("backend", ["tcp", "gloo"])
@pytest.mark.parametrize("victim", [0, 2])
def test_survivors_of_a_dead_rank_shrink_the_world_and_go_on(backend, victim):
    outcomes = run_ranks(
        _survivors_shrink,
        4,
        victim,
        backend=backend,
        timeout=90,
        init_timeout=60,
        may_die={victim},
        check=False,
    )
    survivors = [o for rank, o in enumerate(outcomes) if rank != victim]
    assert all(o.ok for o in survivors), "\n".join(o.describe()[-1500:] for o in survivors)
    assert sorted(o.value[0] for o in survivors) == [0, 1, 2]
    assert {(o.value[1], tuple(o.value[2])) for o in survivors} == {(3, (0, 1, 2))}


def _bad_shrinks() -> None:
    for args, error, words in [
        (((1,),), TypeError, "must be a list"),
        (([],), ValueError, "is empty"),
        (([5],), ValueError, "out of range"),
        (([1, 1],), ValueError, "twice"),
        (([0, 1],), ValueError, "names all 2 ranks"),
        (([1], None, 7), ValueError, "SHRINK_DEFAULT"),
    ]:
        with pytest.raises(error, match=words):
            dist.shrink_group(*args)
    pair = dist.new_group([0, 1])
    dist.destroy_process_group(pair)
    with pytest.raises(dist.GroupDestroyedError, match="was destroyed"):
        dist.shrink_group([1], group=pair)


def test_bad_shrink_arguments_are_refused_before_anything_changes():
    run_ranks(_bad_shrinks, 2, backend="tcp")
