"""The `gloo` backend: the fast CPU path.

The same engine as `tcp` (TCP mesh, mailbox, algorithms) with the tuned algorithm
table. When every rank of the group shares this host, collectives run over shared
memory instead (`intranode.py`: one synchronisation per collective and single-copy
transfers between the ranks' arrays); point-to-point messages and the failure signals
still use the TCP connections. `DISTCOMM_GLOO_TRANSPORT=tcp` forces TCP for everything.

CuPy arrays are staged through pinned host memory (copied in, reduced on the CPU,
copied back), as the original gloo did for CUDA tensors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from ..deadline import Deadline
from ..errors import DistBackendError, DistError
from ..gpu.staging import is_cupy_array
from ..ops import ReduceOp
from ..store.base import Store
from ..work import Work
from . import algorithms as algo
from .intranode import IntraNode, same_host_setup
from .tcp import TcpBackend
from .transport.base import OP_CODES, Failure, Signature

__all__ = ["GlooBackend", "transport_mode"]

log = logging.getLogger(__name__)

_MODES = ("auto", "tcp")


def transport_mode(environ: Any = os.environ) -> str:
    """DISTCOMM_GLOO_TRANSPORT: "auto" (shared memory on one host, default) or "tcp".

    Raises:
        ValueError: another value.
    """
    mode = environ.get("DISTCOMM_GLOO_TRANSPORT", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(
            f"DISTCOMM_GLOO_TRANSPORT={mode!r} is not valid: use 'auto' (shared memory between "
            "ranks on one host, TCP otherwise) or 'tcp' (TCP for everything)")
    return mode


class GlooBackend(TcpBackend):
    """Fast CPU backend: tuned algorithms, shared memory within a host, TCP across hosts."""

    name = "gloo"
    devices = ("cpu", "cuda")
    tuning_preset = algo.Tuning.tuned()

    def __init__(self, store: Store, rank: int, size: int, timeout: float,
                 group_name: str = "") -> None:
        mode = transport_mode()
        super().__init__(store, rank, size, timeout, group_name)
        self._engine: IntraNode | None = None
        self._staging: Any = None
        if size > 1:
            try:
                self._engine = self._setup_engine(store, mode)
            except BaseException:
                super().shutdown()
                raise

    def _setup_engine(self, store: Store, mode: str) -> IntraNode | None:
        outcome = same_host_setup(store, self.rank, self.size, Deadline(self.timeout), mode)
        if isinstance(outcome, str):
            log.info("%s: collectives over TCP: %s", self.describe("setup"), outcome)
            return None
        segment, pids = outcome
        log.info("%s: collectives over shared memory", self.describe("setup"))
        return IntraNode(segment, pids, self.rank, self.size, self._transport.mailbox,
                         inline_max=self.tuning.shm_inline_max, chunk=self.tuning.shm_chunk)

    @property
    def transport(self) -> str:
        """"shm" when this group's collectives use shared memory, else "tcp"."""
        return "shm" if self._engine is not None else "tcp"

    # -- running collectives in shared memory ------------------------------------------------

    def _local(self, op: str, signature: Signature,
               body: Callable[[IntraNode, int, Signature], None], outputs: list[Any],
               async_op: bool) -> Work:
        engine = self._engine
        assert engine is not None
        description = self.describe(op)
        running: list[int] = []

        def why() -> str:
            if running:
                return engine.diagnose(running[0])
            return "it had not started: operations issued before it are still running"

        work = Work(description, outputs, on_timeout=self._abort_on_timeout(description, why),
                    timeout=self.timeout)

        def run() -> None:
            seq = self._seq
            running.append(seq)
            self._seq += 1
            describe = f"{description} #{seq}"
            failure = self._transport.mailbox.failure
            if failure is not None:
                raise failure.kind(f"{describe}: the group was aborted earlier: "
                                   f"{failure.message}")
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s: %s (shared memory)", describe, signature.describe())
            engine.begin(describe, Deadline(self.timeout))
            try:
                body(engine, seq, signature)
            except DistError as exc:
                self._transport.abort(Failure(type(exc), str(exc)))
                raise
            except BaseException as exc:
                self._transport.abort(Failure(DistBackendError, f"{describe} failed: {exc!r}"))
                raise

        return self._collectives.submit(run, work, async_op)

    def _staged(self, call: Callable[..., Work], outputs: Sequence[Any],
                inputs: Sequence[Any]) -> Work | None:
        """Run `call(*host_outputs, *host_inputs)` on pinned host copies when an array is a
        CuPy array (in-place arrays are listed as both); None for host arrays."""
        if not any(is_cupy_array(a) for a in (*outputs, *inputs)):
            return None
        from ..gpu.staging import HostStaging, run_staged

        if self._staging is None:
            self._staging = HostStaging()
        run_staged(call, outputs, inputs, self._staging)
        work = Work(self.describe("staged operation"), list(outputs), timeout=self.timeout)
        work.complete(None)
        return work

    # -- the op set ------------------------------------------------------------------------

    def broadcast(self, array: Any, root: int, *, async_op: bool = False) -> Work:
        staged = self._staged(lambda a, _: self.broadcast(a, root), [array], [array])
        if staged is not None:
            return staged
        if self._engine is None:
            return super().broadcast(array, root, async_op=async_op)
        return self._local("broadcast", self._signature("broadcast", array, root=root),
                           lambda e, s, g: e.broadcast(s, g, array, root), [array], async_op)

    def all_reduce(self, array: Any, op: ReduceOp, *, async_op: bool = False) -> Work:
        staged = self._staged(lambda a, _: self.all_reduce(a, op), [array], [array])
        if staged is not None:
            return staged
        if self._engine is None:
            return super().all_reduce(array, op, async_op=async_op)
        return self._local("all_reduce", self._signature("all_reduce", array, op),
                           lambda e, s, g: e.all_reduce(s, g, array, op), [array], async_op)

    def reduce(self, array: Any, root: int, op: ReduceOp, *, async_op: bool = False) -> Work:
        staged = self._staged(lambda a, _: self.reduce(a, root, op), [array], [array])
        if staged is not None:
            return staged
        if self._engine is None:
            return super().reduce(array, root, op, async_op=async_op)
        return self._local("reduce", self._signature("reduce", array, op, root),
                           lambda e, s, g: e.reduce(s, g, array, root, op), [array], async_op)

    def all_gather(self, output: Any, input: Any, *, async_op: bool = False) -> Work:
        staged = self._staged(lambda o, i: self.all_gather(o, i), [output], [input])
        if staged is not None:
            return staged
        if self._engine is None:
            return super().all_gather(output, input, async_op=async_op)
        return self._local("all_gather", self._signature("all_gather", input),
                           lambda e, s, g: e.all_gather(s, g, output, input), [output],
                           async_op)

    def gather(self, output: Any | None, input: Any, root: int, *,
               async_op: bool = False) -> Work:
        staged = self._staged(lambda o, i: self.gather(o, i, root), [output], [input])
        if staged is not None:
            return staged
        if self._engine is None:
            return super().gather(output, input, root, async_op=async_op)
        return self._local("gather", self._signature("gather", input, root=root),
                           lambda e, s, g: e.gather(s, g, output, input, root),
                           [output] if output is not None else [], async_op)

    def scatter(self, output: Any, input: Any | None, root: int, *,
                async_op: bool = False) -> Work:
        staged = self._staged(lambda o, i: self.scatter(o, i, root), [output], [input])
        if staged is not None:
            return staged
        if self._engine is None:
            return super().scatter(output, input, root, async_op=async_op)
        return self._local("scatter", self._signature("scatter", output, root=root),
                           lambda e, s, g: e.scatter(s, g, output, input, root), [output],
                           async_op)

    def reduce_scatter(self, output: Any, input: Any, op: ReduceOp, *,
                       async_op: bool = False) -> Work:
        staged = self._staged(lambda o, i: self.reduce_scatter(o, i, op), [output], [input])
        if staged is not None:
            return staged
        if self._engine is None:
            return super().reduce_scatter(output, input, op, async_op=async_op)
        return self._local("reduce_scatter", self._signature("reduce_scatter", output, op),
                           lambda e, s, g: e.reduce_scatter(s, g, output, input, op), [output],
                           async_op)

    def all_to_all(self, output: Any, input: Any, output_splits: Sequence[int],
                   input_splits: Sequence[int], *, async_op: bool = False) -> Work:
        staged = self._staged(
            lambda o, i: self.all_to_all(o, i, output_splits, input_splits), [output], [input])
        if staged is not None:
            return staged
        if self._engine is None:
            return super().all_to_all(output, input, output_splits, input_splits,
                                      async_op=async_op)
        return self._local(
            "all_to_all", self._signature("all_to_all", input, count=-1),
            lambda e, s, g: e.all_to_all(s, g, output, input, output_splits, input_splits),
            [output], async_op)

    def barrier(self, *, async_op: bool = False) -> Work:
        if self._engine is None:
            return super().barrier(async_op=async_op)
        return self._local("barrier", Signature(OP_CODES["barrier"]),
                           lambda e, s, g: e.barrier(s, g), [], async_op)

    def send(self, array: Any, dst: int, tag: int) -> Work:
        self._host_only(array, "send")
        return super().send(array, dst, tag)

    def recv(self, array: Any, src: int | None, tag: int) -> Work:
        self._host_only(array, "recv")
        return super().recv(array, src, tag)

    def _host_only(self, array: Any, op: str) -> None:
        if is_cupy_array(array):
            raise TypeError(
                f"{self.describe(op)}: the gloo backend does not {op} CuPy arrays; copy the "
                "array to the host (array.get()) or use a group with the nccl backend")

    # -- lifecycle -------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        super().shutdown()
        if self._engine is not None:
            self._engine.close()
        if self._staging is not None:
            self._staging.clear()

