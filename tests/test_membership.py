"""The world's epochs at scale, simulated: many members (threads, each with a store
connection of its own) arrive at one epoch's roll in a real TCPStore, as the processes of
a job would after a loss. Every one of them must read the same member list, decided once:
the old members that arrived in their old order, then the registered newcomers. Members
on another host that never arrive are left out after `settle`; a newcomer whose process
ended on this host is never proposed, and the final list of an epoch that names newcomers
keeps those that acknowledged it. Results only, no durations."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from datetime import timedelta

import pytest

from distcomm import membership
from distcomm.store import TCPStore

OTHER_HOST = "not-" + socket.gethostname()  # processes there cannot be looked at


def _handle(prank: int) -> str:
    return f"dc1:{prank}:0:{OTHER_HOST}:{100000 + prank}:feed"


def _arrive_all(
    store: TCPStore, epoch: int, members: list[str], arriving: list[str], settle: float
):
    decisions: dict[str, membership.Decision] = {}
    errors: list[BaseException] = []

    def arrive(handle: str) -> None:
        client = store.clone()
        try:
            roll = membership._Roll(client, epoch, settle, time.monotonic() + 120, 120.0)
            decisions[handle] = roll.decide(handle, members, 0, True)
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=arrive, args=(h,)) for h in arriving]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert not errors, errors[:3]
    return decisions


@pytest.fixture
def store():
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield master
    master.close()


@pytest.mark.parametrize("size", [16, 256])
def test_every_member_reads_one_list_decided_once(store, size):
    members = [_handle(p) for p in range(size)]
    decisions = _arrive_all(store, 1, members, list(reversed(members)), settle=30.0)
    assert len(decisions) == size
    lists = {tuple(d.handles) for d in decisions.values()}
    assert lists == {tuple(members)}  # everyone arrived: all kept, in the old order


def test_members_that_never_arrive_are_left_out_after_settle(store):
    members = [_handle(p) for p in range(64)]
    lost = {members[5], members[40]}
    arriving = [h for h in members if h not in lost]
    decisions = _arrive_all(store, 1, members, arriving, settle=1.0)
    lists = {tuple(d.handles) for d in decisions.values()}
    assert lists == {tuple(arriving)}


def test_newcomers_registered_before_the_decision_come_last(store):
    members = [_handle(p) for p in range(8)]
    prefix = membership._p()
    for k in range(2):  # two newcomers registered, as membership.join does
        store.add(prefix + "newcomers", 1)
        store.set(prefix + f"nc/{k}", _handle(1000 + k))
    decisions = _arrive_all(store, 1, members, members, settle=30.0)
    (only,) = {tuple(d.handles) for d in decisions.values()}
    assert list(only) == [*members, _handle(1000), _handle(1001)]
    assert {d.admitted for d in decisions.values()} == {2}
    assert store.get(prefix + "nc/0/epoch") == b"1" and store.get(prefix + "nc/1/epoch") == b"1"


def _dead_pid() -> int:
    """The pid of a process of this host that has ended (and been reaped)."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    return ended.pid


def _register(store: TCPStore, handle: str) -> int:
    """Register `handle` as a newcomer, as membership.join does; its number."""
    k = store.add(membership._p() + "newcomers", 1) - 1
    store.set(membership._p() + f"nc/{k}", handle)
    return k


def test_a_newcomer_whose_process_ended_here_is_never_proposed(store):
    members = [_handle(p) for p in range(4)]
    gone = f"dc1:{1000}:0:{socket.gethostname()}:{_dead_pid()}:gone"
    _register(store, gone)
    _register(store, _handle(1001))
    decisions = _arrive_all(store, 1, members, members, settle=30.0)
    (only,) = {tuple(d.handles) for d in decisions.values()}
    assert list(only) == [*members, _handle(1001)]
    # both were looked at: a later epoch does not look at the one that ended again
    assert {(d.admitted, tuple(d.newcomers)) for d in decisions.values()} == {(2, (1,))}


def test_the_final_list_keeps_the_newcomers_that_acknowledged_it(store):
    """Two newcomers named (on another host, where their processes cannot be looked at):
    the one that acknowledges the list is in the final list every member reads, the one
    that never does is left out, and both are told the epoch (to look whether they are
    in, or register again)."""
    members = [_handle(p) for p in range(6)]
    answering, silent = _register(store, _handle(1000)), _register(store, _handle(1001))
    prefix = membership._p()

    def acknowledge() -> None:
        client = store.clone()
        try:
            client.wait([prefix + f"nc/{answering}/epoch"], timedelta(seconds=120))
            epoch = int(client.get(prefix + f"nc/{answering}/epoch"))
            client.set(prefix + f"e/{epoch}/ack/{answering}", "1")
        finally:
            client.close()

    newcomer = threading.Thread(target=acknowledge)
    newcomer.start()
    finals: dict[str, membership.Decision] = {}
    errors: list[BaseException] = []

    def arrive(handle: str) -> None:
        client = store.clone()
        try:
            roll = membership._Roll(client, 1, 0.2, time.monotonic() + 120, 120.0)
            finals[handle] = roll.final(roll.decide(handle, members, 0, True))
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=arrive, args=(h,)) for h in members]
    for thread in threads:
        thread.start()
    for thread in [*threads, newcomer]:
        thread.join(180)
    assert not errors, errors[:3]
    (only,) = {(tuple(d.handles), tuple(d.newcomers), d.admitted) for d in finals.values()}
    assert only == ((*members, _handle(1000)), (answering,), 2)
    assert store.get(prefix + f"nc/{silent}/epoch") == b"1"  # told: it registers again
