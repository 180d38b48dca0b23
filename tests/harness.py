"""Run a function on N spawned ranks with a hard deadline and one report of every rank.

`run_ranks(fn, n)` starts a fresh world for one call; `RankPool(n, backend)` keeps a
world alive across many calls (the conformance suite). Either way each rank runs
`fn(*args)` and the parent returns the list of results in rank order, or raises
`RankFailure` whose message holds one block per rank headed `### rank r/N`: its
traceback, its exit status, or (when it hung) a faulthandler dump of its threads.
On the first failure every other rank gets a short grace period, then all are killed.

Functions must be importable module-level callables (they are pickled by reference).
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from distcomm.launch.errors import exit_description

__all__ = ["LOOPBACK_ENV", "Outcome", "RankFailure", "RankPool", "run_ranks", "wait_until"]

#: Environment every rank gets: all traffic stays on loopback.
LOOPBACK_ENV = {
    "MASTER_ADDR": "127.0.0.1",
    "DISTCOMM_SOCKET_IFNAME": "lo",
    "HYDRA_IFACE": "lo",
    "UCX_NET_DEVICES": "lo",
    "OMP_NUM_THREADS": "1",
}

GRACE_AFTER_FAILURE = 5.0

#: seconds `wait_until` waits by default: far beyond what a condition takes on a loaded
#: machine, so that only a condition that never comes fails
EVENTUALLY_S = 30.0


def wait_until(
    condition: Callable[[], Any],
    what: str,
    timeout: float = EVENTUALLY_S,
    interval: float = 0.01,
    detail: Callable[[], Any] | None = None,
) -> Any:
    """Poll `condition()` until it is truthy, for at most `timeout` seconds.

    For something that happens asynchronously (a thread ending, a file removed, a message
    another process sent being processed): wait for it, then assert on it, instead of
    asserting at once or after a fixed `time.sleep`.

    Args:
        condition: called until it returns a truthy value.
        what: what is waited for, for the failure message ("the watchdog to fail the op").
        timeout: the most seconds to wait.
        interval: seconds between two calls.
        detail: what to show in the failure message instead of the last value (the state
            that `condition` judged, say).

    Returns:
        The truthy value `condition()` returned.

    Raises:
        AssertionError: `condition()` was still falsy after `timeout` seconds; the message
            names `what` and the last value.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            seen = f"now: {detail()!r}" if detail is not None else f"last value: {value!r}"
            raise AssertionError(f"timed out after {timeout} s waiting for {what} ({seen})")
        time.sleep(interval)


class RankFailure(AssertionError):
    """One or more ranks failed, died or hung; the message reports every rank."""


@dataclass
class Outcome:
    """What one rank did: returned `value`, raised (`error` holds the traceback) or died."""

    rank: int
    ok: bool = False
    value: Any = None
    error: str = ""
    exitcode: int | None = None
    stacks: str = ""
    exc_type: str = ""

    def describe(self) -> str:
        if self.ok:
            return "returned normally"
        parts = []
        if self.error:
            parts.append(self.error.rstrip())
        elif self.exitcode is not None:
            parts.append(f"exited without reporting: {exit_description(self.exitcode)}")
        else:
            parts.append("did not finish (still running when the run was stopped)")
        if self.stacks:
            parts.append("stack dump of its threads:\n" + self.stacks.rstrip())
        return "\n".join(parts)


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _child_main(
    rank: int,
    size: int,
    env: dict[str, str],
    backend: str | None,
    init_timeout: float,
    conn: multiprocessing.connection.Connection,
    stack_path: str,
) -> None:
    _die_with_parent()
    os.environ.update(env)
    stack_file = open(stack_path, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    initialized = False
    try:
        if backend is not None:
            import distcomm as dist

            dist.init_process_group(backend, timeout=init_timeout)
            initialized = True
        conn.send(("ready", None))
        while True:
            try:
                task = conn.recv()
            except EOFError:
                break
            if task is None:
                break
            fn, args, kwargs = task
            try:
                value = fn(*args, **kwargs)
                payload = pickle.dumps(value)
                conn.send(("ok", payload))
            except BaseException as exc:  # report everything, SystemExit included
                conn.send(("error", (type(exc).__name__, traceback.format_exc())))
    except BaseException as exc:
        try:
            conn.send(("error", (type(exc).__name__, traceback.format_exc())))
        except OSError:
            pass
    finally:
        if initialized:
            import distcomm as dist

            try:
                if dist.is_initialized():  # a test may have destroyed it itself
                    dist.destroy_process_group()
            except Exception:
                traceback.print_exc()
        conn.close()


@dataclass
class _Rank:
    rank: int
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    stack_path: str
    outcome: Outcome = field(init=False)

    def __post_init__(self) -> None:
        self.outcome = Outcome(self.rank)


class RankPool:
    """N spawned ranks that stay alive (and initialized) across `run` calls.

    Args:
        nprocs: number of ranks.
        backend: when not None, each rank calls `init_process_group(backend)` through
            env:// with a store hosted by this process.
        env: extra environment for every rank; `rank_env(rank)` adds per-rank variables.
        init_timeout: the process group's timeout.
        start_timeout: how long starting and initialising may take.
    """

    #: pools not closed yet: a fixture's world outlives the test that started it, so
    #: conftest's check for store servers left running passes over theirs
    open_pools: ClassVar[weakref.WeakSet[RankPool]] = weakref.WeakSet()

    def __init__(
        self,
        nprocs: int,
        backend: str | None = None,
        *,
        env: dict[str, str] | None = None,
        rank_env: Callable[[int], dict[str, str]] | None = None,
        init_timeout: float = 60.0,
        start_timeout: float = 60.0,
    ) -> None:
        self.nprocs = nprocs
        self.backend = backend
        self.broken = False
        self._store = None
        self._tmpdir = tempfile.TemporaryDirectory(prefix="distcomm-test-")
        base = dict(LOOPBACK_ENV)
        if backend is not None:
            from distcomm.store import TCPStore

            self._store = TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=start_timeout
            )
            base.update(MASTER_PORT=str(self._store.port), DISTCOMM_USE_AGENT_STORE="1")
            RankPool.open_pools.add(self)
        base.update(env or {})
        ctx = multiprocessing.get_context("spawn")
        self._ranks: list[_Rank] = []
        try:
            for rank in range(nprocs):
                rank_vars = dict(
                    base,
                    RANK=str(rank),
                    WORLD_SIZE=str(nprocs),
                    LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(nprocs),
                )
                if rank_env is not None:
                    rank_vars.update(rank_env(rank))
                parent_conn, child_conn = ctx.Pipe()
                stack_path = os.path.join(self._tmpdir.name, f"stacks-{rank}.txt")
                process = ctx.Process(
                    target=_child_main,
                    name=f"rank-{rank}",
                    daemon=True,
                    args=(rank, nprocs, rank_vars, backend, init_timeout, child_conn, stack_path),
                )
                process.start()
                child_conn.close()
                self._ranks.append(_Rank(rank, process, parent_conn, stack_path))
            self._collect(start_timeout, expect="ready", may_die=frozenset(), check=True)
        except BaseException:
            self.close()
            raise

    # -- running -------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = 60.0,
        may_die: frozenset[int] | set[int] = frozenset(),
        check: bool = True,
        **kwargs: Any,
    ) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; the results in rank order.

        Args:
            timeout: hard deadline for the whole call, in seconds.
            may_die: ranks whose death is expected (their result is None).
            check: when False, return the list of `Outcome` instead of raising.

        Raises:
            RankFailure: a rank raised, died or hung (when `check`).
        """
        if self.broken:
            raise RuntimeError("this RankPool failed earlier; make a new one")
        for r in self._ranks:
            r.outcome = Outcome(r.rank)
            try:
                r.conn.send((fn, args, kwargs))
            except OSError:
                pass  # its death is reported by _collect
        outcomes = self._collect(timeout, expect="ok", may_die=frozenset(may_die), check=check)
        return outcomes if not check else [o.value for o in outcomes]

    def _collect(
        self, timeout: float, expect: str, may_die: frozenset[int], check: bool
    ) -> list[Outcome]:
        deadline = time.monotonic() + timeout
        pending = {r.rank: r for r in self._ranks}
        failed_at: float | None = None
        timed_out = False
        while pending:
            now = time.monotonic()
            limit = deadline
            if failed_at is not None:
                limit = min(deadline, failed_at + GRACE_AFTER_FAILURE)
            if now >= limit:
                timed_out = failed_at is None
                break
            waitables: list[Any] = []
            for r in pending.values():
                waitables += [r.conn, r.process.sentinel]
            ready = multiprocessing.connection.wait(waitables, timeout=limit - now)
            for r in list(pending.values()):
                closed = False
                if r.conn in ready:
                    try:
                        kind, payload = r.conn.recv()
                    except (EOFError, OSError):
                        closed = True
                    else:
                        if kind in ("ready", "ok"):
                            r.outcome.ok = True
                            r.outcome.value = pickle.loads(payload) if kind == "ok" else None
                        else:
                            r.outcome.exc_type, r.outcome.error = payload
                            failed_at = failed_at or time.monotonic()
                        del pending[r.rank]
                        continue
                if closed or not r.process.is_alive():
                    r.process.join(1.0)
                    if not closed and r.conn.poll():
                        continue  # it reported just before exiting: read it next round
                    r.outcome.exitcode = r.process.exitcode
                    del pending[r.rank]
                    if r.rank not in may_die:
                        failed_at = failed_at or time.monotonic()
                    else:
                        r.outcome.ok = True
        failure = bool(pending) or any(
            not r.outcome.ok for r in self._ranks if r.rank not in may_die
        )
        if not failure:
            return [r.outcome for r in self._ranks]
        self.broken = True
        self._dump_stacks(pending.values())
        self.close()
        outcomes = [r.outcome for r in self._ranks]
        if not check and not timed_out:
            return outcomes
        heading = f"timed out after {timeout:.1f} s" if timed_out else "a rank failed"
        raise RankFailure(_report(heading, outcomes, self.nprocs))

    def _dump_stacks(self, ranks: Any) -> None:
        alive = [r for r in ranks if r.process.is_alive()]
        for r in alive:
            try:
                os.kill(r.process.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        if alive:
            time.sleep(0.5)
        for r in alive:
            try:
                with open(r.stack_path) as f:
                    r.outcome.stacks = f.read()
            except OSError:
                pass

    # -- teardown ------------------------------------------------------------------------

    def close(self, timeout: float = 20.0) -> None:
        """Stop every rank (politely, then SIGKILL) and the store; idempotent."""
        for r in self._ranks:
            if r.process.is_alive() and not self.broken:
                try:
                    r.conn.send(None)
                except OSError:
                    pass
        end = time.monotonic() + (timeout if not self.broken else 0)
        for r in self._ranks:
            r.process.join(max(0.0, end - time.monotonic()))
            if r.process.is_alive():
                r.process.kill()
                r.process.join(5)
            r.conn.close()
        if self._store is not None:
            self._store.close()
            self._store = None
        RankPool.open_pools.discard(self)
        self._tmpdir.cleanup()

    @property
    def store_port(self) -> int | None:
        """The port of the store this process hosts for the ranks (None: none, or closed)."""
        return None if self._store is None else self._store.port

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _report(heading: str, outcomes: list[Outcome], nprocs: int) -> str:
    lines = [f"{heading}; report of every rank:"]
    for o in outcomes:
        lines.append(f"### rank {o.rank}/{nprocs}")
        lines.append(o.describe())
    return "\n".join(lines)


def run_ranks(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    rank_env: Callable[[int], dict[str, str]] | None = None,
    may_die: frozenset[int] | set[int] = frozenset(),
    check: bool = True,
    init_timeout: float = 30.0,
    **kwargs: Any,
) -> list[Any]:
    """Start a fresh world of `nprocs` ranks, run `fn(*args, **kwargs)` on each, tear down.

    See `RankPool` and `RankPool.run` for the arguments. Returns the results in rank
    order (or the `Outcome`s when `check` is False).
    """
    pool = RankPool(
        nprocs,
        backend,
        env=env,
        rank_env=rank_env,
        init_timeout=init_timeout,
        start_timeout=timeout,
    )
    try:
        return pool.run(fn, *args, timeout=timeout, may_die=may_die, check=check, **kwargs)
    finally:
        pool.close()


if __name__ == "__main__":  # pragma: no cover - a manual smoke run
    print(run_ranks(os.getpid, int(sys.argv[1]) if len(sys.argv) > 1 else 2))
