"""Intra-op and inter-op thread settings, fork/wait and parallel_info, as torch has them.

The settings are per process, like torch's: the intra-op count (`set_num_threads`) sizes
the pool that splits large reductions (`parallel_for`) and the BLAS/OpenMP pools numpy
loaded; the inter-op count sizes the pool that runs `fork`. Both pools are created on
first use, hold daemon threads and are recreated in a child after `os.fork()`.
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from .launcher_env import LOCAL_SIZE_VARIABLES, local_world_size
from .work import Future

__all__ = [
    "fork",
    "get_num_interop_threads",
    "get_num_threads",
    "parallel_for",
    "parallel_info",
    "set_num_interop_threads",
    "set_num_threads",
    "threads",
    "wait",
]

#: Environment variables giving the default intra-op count, the later one winning (torch).
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

_lock = threading.Lock()
_num_threads: int | None = None  # intra-op count; None until first use
_interop_threads: int | None = None  # the inter-op size, once fixed
_interop_fixed = ""  # why it is fixed: set, or the pool started
_interop_pool: _Pool | None = None
_intraop_pool: _Pool | None = None
_local = threading.local()  # .busy: this thread runs a parallel_for piece


class _Pool:
    """Daemon threads serving one queue of callables (None stops one); changed under _lock."""

    def __init__(self, name: str, size: int, worker_busy: bool) -> None:
        self.name, self.worker_busy = name, worker_busy
        self.tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.size = self.spawned = 0
        self.resize(size)

    def resize(self, size: int) -> None:
        """Start or stop threads until `size` of them serve the queue."""
        for _ in range(size, self.size):
            self.tasks.put(None)  # after the tasks already queued
        for _ in range(self.size, size):
            self.spawned += 1
            threading.Thread(
                target=self._serve, name=f"{self.name}-{self.spawned}", daemon=True
            ).start()
        self.size = size

    def _serve(self) -> None:
        _local.busy = self.worker_busy
        while (task := self.tasks.get()) is not None:
            task()


def _env_count(name: str) -> int | None:
    """A positive integer environment variable; None (with a warning if invalid) otherwise."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text.split(",")[0])  # OpenMP's nested form "4,2": the outer level
    except ValueError:
        value = 0
    if value < 1:
        warnings.warn(
            f"ignoring invalid {name}={text!r}: expected an integer >= 1",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    return value


def physical_cores() -> int:
    """This machine's physical CPU cores (logical ones where that is unknown)."""
    import psutil  # ~20 ms of imports: not at `import distcomm`

    return psutil.cpu_count(logical=False) or psutil.cpu_count(logical=True) or 1


def _local_ranks() -> int:
    """How many ranks the launcher started on this host (`distcomm.launcher_env`'s local
    size); 1 where no launcher says, or (with a warning) where what it says is malformed."""
    try:
        return local_world_size() or 1
    except ValueError as exc:
        warnings.warn(
            f"ignoring the launcher's ranks per host: {exc}", RuntimeWarning, stacklevel=4
        )
        return 1


def _parse_cpu_list(text: str) -> set[int]:
    """CPU numbers from the kernel's list format ("0-3,8,10-11")."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def _allowed_cpus() -> set[int] | None:
    """The CPUs this process's cpuset cgroup allows (cgroup v2 or v1), or the online CPUs;
    None where neither can be read."""
    try:
        with open("/proc/self/cgroup") as table:
            entries = [line.rstrip("\n").split(":", 2) for line in table]
    except OSError:
        entries = []
    for entry in entries:
        if len(entry) != 3:
            continue
        if entry[1] == "":
            root, name = "/sys/fs/cgroup", "cpuset.cpus.effective"
        elif "cpuset" in entry[1].split(","):
            root, name = "/sys/fs/cgroup/cpuset", "cpuset.effective_cpus"
        else:
            continue
        folder = os.path.normpath(root + "/" + entry[2])
        while folder.startswith(root):  # the nearest cgroup that has the file
            try:
                with open(os.path.join(folder, name)) as limit:
                    cpus = _parse_cpu_list(limit.read())
                if cpus:
                    return cpus
            except (OSError, ValueError):
                pass
            folder = os.path.dirname(folder)
    try:
        with open("/sys/devices/system/cpu/online") as online:
            return _parse_cpu_list(online.read()) or None
    except (OSError, ValueError):
        return None


def _default_num_threads() -> int:
    counts = [c for c in map(_env_count, _THREAD_VARS) if c is not None]
    if counts:
        return counts[-1]
    logical = os.cpu_count() or physical_cores()
    mask = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(logical))
    allowed = len((_allowed_cpus() or set(range(logical))) | mask)
    usable = max(1, len(mask) * physical_cores() // max(logical, len(mask)))
    sharing = max(1, math.ceil(_local_ranks() * len(mask) / allowed))
    return max(1, usable // sharing)


def _check_count(n: object, name: str, where: str) -> int:
    if isinstance(n, bool) or not hasattr(n, "__index__"):
        raise TypeError(f"{where}: {name} must be an int number of threads (>= 1), got {n!r}")
    value = operator.index(n)  # type: ignore[arg-type]
    if value < 1:
        raise ValueError(
            f"{where}: {name} must be >= 1, got {value}; pass 1 to disable multi-threading"
        )
    return value


def get_num_threads() -> int:
    """The number of intra-op threads (torch.get_num_threads).

    The default, fixed at first use: MKL_NUM_THREADS if set, else OMP_NUM_THREADS, else
    the physical cores of the CPUs this process may run on (its affinity mask, counted in
    physical cores as far as the machine has fewer of those than logical CPUs), shared
    among the ranks expected on them, at least 1. Those ranks are the launcher's ranks on
    this host (LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS, or Slurm's
    SLURM_STEP_TASKS_PER_NODE; 1 without a launcher) times the share of the host's CPUs
    (those its cpuset allows) the mask covers, rounded up: unpinned ranks split the
    machine, ranks pinned to a core each get one thread, ranks bound to a socket split
    that socket. As in torch, an invalid value (not an integer >= 1) is ignored with a
    RuntimeWarning naming the variable and the value. The default leaves the BLAS pools
    alone (they read OMP_NUM_THREADS themselves); `set_num_threads` limits them.
    """
    global _num_threads
    if _num_threads is None:
        with _lock:
            if _num_threads is None:
                _num_threads = _default_num_threads()
    return _num_threads


def _apply(n: int) -> None:
    global _num_threads
    with _lock:
        _num_threads = n
        if _intraop_pool is not None and _intraop_pool.size > n - 1:
            _intraop_pool.resize(n - 1)  # it grows when a parallel_for needs more


def _limit_blas(n: int) -> Any:
    """Limit numpy's BLAS/OpenMP pools to `n` threads; the limiter (None without threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(limits=n)  # a no-op where no pool is loaded


def set_num_threads(n: int) -> None:
    """Set the number of intra-op threads (torch.set_num_threads); takes effect at once.

    It sizes `parallel_for`'s pool and, through threadpoolctl, limits the BLAS and OpenMP
    pools numpy loaded. It overrides OMP_NUM_THREADS and MKL_NUM_THREADS.

    Raises:
        TypeError: `n` is not an int.
        ValueError: `n` < 1.
    """
    n = _check_count(n, "n", "set_num_threads")
    _apply(n)
    _limit_blas(n)


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Use `n` intra-op threads inside the block, then restore the previous count and the
    BLAS/OpenMP pools' limits, on an exception too (like threadpoolctl's limits).

    Raises:
        TypeError: `n` is not an int.
        ValueError: `n` < 1.
    """
    n = _check_count(n, "n", "threads")
    previous, limiter = get_num_threads(), None
    try:
        _apply(n)
        limiter = _limit_blas(n)
        yield
    finally:
        _apply(previous)
        if limiter is not None:
            limiter.restore_original_limits()


def get_num_interop_threads() -> int:
    """The size of the inter-op pool that runs `fork` (torch.get_num_interop_threads).

    The default, as in torch, is the number of physical cores (logical where unknown).
    """
    return _interop_threads if _interop_threads is not None else physical_cores()


def set_num_interop_threads(n: int) -> None:
    """Set the size of the inter-op pool: once, before the first `fork` (as in torch).

    Raises:
        TypeError: `n` is not an int.
        ValueError: `n` < 1.
        RuntimeError: already set, or the pool already started.
    """
    global _interop_threads, _interop_fixed
    n = _check_count(n, "n", "set_num_interop_threads")
    with _lock:
        if _interop_fixed:
            raise RuntimeError(
                f"set_num_interop_threads({n}): the inter-op pool size can be set only once, "
                f"before its first use, and {_interop_fixed} (size {_interop_threads}); call "
                "set_num_interop_threads once at the start of the program, before any fork()"
            )
        _interop_threads, _interop_fixed = n, "set_num_interop_threads was already called"


def fork(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """Run `fn(*args, **kwargs)` on the inter-op pool (torch.jit.fork).

    Returns:
        A Future completed with fn's result or exception; see `wait`.
    """
    global _interop_pool, _interop_threads, _interop_fixed
    future = Future()

    def task() -> None:
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)

    with _lock:
        if _interop_pool is None:
            if not _interop_fixed:
                _interop_threads = get_num_interop_threads()
                _interop_fixed = "fork() already started the inter-op pool"
            _interop_pool = _Pool("distcomm-interop", get_num_interop_threads(), False)
        _interop_pool.tasks.put(task)
    return future


def wait(future: Future) -> Any:
    """The result of a `fork`ed call, waiting for it (torch.jit.wait); raises its exception."""
    return future.wait()


class _Batch:
    """The pieces of one parallel_for call, claimed one at a time by the caller and workers."""

    def __init__(self, fn: Callable[[int, int], None], bounds: list[int]) -> None:
        self.fn, self.bounds = fn, bounds
        self.errors: dict[int, BaseException] = {}
        self.lock = threading.Lock()
        self.claimed = self.finished = 0
        self.done = threading.Event()

    def run(self) -> None:
        """Run unclaimed pieces until none is left."""
        pieces = len(self.bounds) - 1
        while True:
            with self.lock:
                i = self.claimed
                if i == pieces:
                    return
                self.claimed += 1
            try:
                self.fn(self.bounds[i], self.bounds[i + 1])
            except BaseException as exc:
                self.errors[i] = exc
            with self.lock:
                self.finished += 1
                if self.finished == pieces:
                    self.done.set()


def parallel_for(count: int, fn: Callable[[int, int], None], *, min_chunk: int) -> None:
    """Call fn(start, stop) over contiguous pieces covering range(count), in parallel.

    There are at most get_num_threads() pieces of at least `min_chunk` items each; the
    calling thread runs pieces too and returns when all are done. With one piece (one
    thread, a small count, or a call from inside a piece) it is just fn(0, count).

    Raises:
        ValueError: `count` < 0 or `min_chunk` < 1.
        BaseException: the exception of the lowest failing piece, after all pieces ended.
    """
    global _intraop_pool
    if count < 0 or min_chunk < 1:
        raise ValueError(
            f"parallel_for: need count >= 0 and min_chunk >= 1, got {count} and {min_chunk}"
        )
    pieces = min(get_num_threads(), count // min_chunk)
    if pieces <= 1 or getattr(_local, "busy", False):
        fn(0, count)
        return
    batch = _Batch(fn, [i * count // pieces for i in range(pieces + 1)])
    with _lock:
        if _intraop_pool is None:
            _intraop_pool = _Pool("distcomm-intraop", pieces - 1, True)
        elif _intraop_pool.size < pieces - 1:
            _intraop_pool.resize(pieces - 1)
        for _ in range(pieces - 1):
            _intraop_pool.tasks.put(batch.run)
    _local.busy = True
    try:
        batch.run()
    finally:
        _local.busy = False
    batch.done.wait()
    if batch.errors:
        raise batch.errors[min(batch.errors)]


def parallel_info() -> str:
    """A report of the thread settings, like torch.__config__.parallel_info()."""
    env = "".join(
        f"\t{name} : {os.environ.get(name, '[not set]')}\n"
        for name in (*_THREAD_VARS, *LOCAL_SIZE_VARIABLES)
    )
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    lines = [
        "distcomm parallel settings:",
        f"\tget_num_threads() : {get_num_threads()}",
        f"\tget_num_interop_threads() : {get_num_interop_threads()}",
        "Environment variables:",
        env.rstrip("\n"),
        f"CPU cores : {physical_cores()} physical, {os.cpu_count() or '?'} logical",
        "CPU affinity : "
        + (
            "[unknown on this platform]" if affinity is None else f"{len(affinity)} CPUs {affinity}"
        ),
        "BLAS/OpenMP thread pools (threadpoolctl):",
    ]
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        lines.append("\t[threadpoolctl not installed: pip install threadpoolctl]")
    else:
        pools = threadpool_info()
        lines += [
            f"\t{p['internal_api']} {p.get('version') or '?'} ({p['user_api']}, "
            f"{p.get('threading_layer') or 'threading ?'}) : num_threads "
            f"{p['num_threads']}, {p['filepath']}"
            for p in pools
        ]
        if not pools:
            lines.append("\t[none loaded]")
    return "\n".join(lines) + "\n"


def _after_fork_in_child() -> None:
    """The parent's threads do not exist in a fork child: start from fresh pools and locks."""
    global _lock, _interop_pool, _intraop_pool
    _lock = threading.Lock()
    _interop_pool = _intraop_pool = None  # recreated on first use, the sizes kept
    _local.busy = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
