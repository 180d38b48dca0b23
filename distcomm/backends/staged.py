"""CuPy arrays on a CPU backend (gloo, mpi): every op on pinned host copies.

A group whose CPU backend also serves CUDA arrays (`stages_device_arrays`) gets this
adapter as its backend for CuPy arrays, so the device dispatch happens once, in the group,
instead of a CuPy check in every op of every such backend. Each op copies its inputs to
pinned host buffers (`distcomm.gpu.staging`), runs the CPU op synchronously, and copies
its outputs back; the returned Work is complete. A backend that takes device memory itself
(`takes_device_arrays()`: a CUDA-aware MPI) gets the CuPy arrays directly, after the
caller's current stream on each array's device is synchronised (the backend does the
same for point-to-point operations). Point-to-point operations go to the CPU backend
unchanged (mpi stages them itself, gloo refuses CuPy arrays).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..gpu.runtime import synchronize_arrays
from ..gpu.staging import HostStaging, run_staged
from ..ops import ReduceOp
from ..work import Work
from .base import Backend

__all__ = ["StagedBackend"]


class StagedBackend(Backend):
    """The CUDA face of a CPU backend: stages CuPy arrays through pinned host memory."""

    devices = ("cuda",)

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner.store, inner.rank, inner.size, inner.timeout, inner.group_name)
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]  # messages name the real backend
        self._staging: HostStaging | None = None

    def _run(
        self, op: str, call: Callable[..., Work], outputs: Sequence[Any], inputs: Sequence[Any]
    ) -> Work:
        """`call(*outputs, *inputs)` on host copies (or on the arrays, for a backend that
        takes device memory); the CPU op's errors are raised, as from a synchronous op."""
        if self.inner.takes_device_arrays():
            # the library reads and writes them outside CUDA's streams: the kernels queued
            # before, on each array's device, must have run
            synchronize_arrays([*outputs, *inputs])
            return call(*outputs, *inputs)
        if self._staging is None:
            self._staging = HostStaging()
        run_staged(lambda *hosts: call(*hosts).wait(), outputs, inputs, self._staging)
        return Work.completed(self.describe(op), [a for a in outputs if a is not None])

    def broadcast(self, array: Any, root: int, *, async_op: bool = False) -> Work:
        return self._run("broadcast", lambda a, _: self.inner.broadcast(a, root), [array], [array])

    def all_reduce(self, array: Any, op: ReduceOp, *, async_op: bool = False) -> Work:
        return self._run("all_reduce", lambda a, _: self.inner.all_reduce(a, op), [array], [array])

    def reduce(self, array: Any, root: int, op: ReduceOp, *, async_op: bool = False) -> Work:
        return self._run("reduce", lambda a, _: self.inner.reduce(a, root, op), [array], [array])

    def all_gather(self, output: Any, input: Any, *, async_op: bool = False) -> Work:
        return self._run("all_gather", self.inner.all_gather, [output], [input])

    def gather(self, output: Any | None, input: Any, root: int, *, async_op: bool = False) -> Work:
        return self._run("gather", lambda o, i: self.inner.gather(o, i, root), [output], [input])

    def scatter(self, output: Any, input: Any | None, root: int, *, async_op: bool = False) -> Work:
        return self._run("scatter", lambda o, i: self.inner.scatter(o, i, root), [output], [input])

    def reduce_scatter(
        self, output: Any, input: Any, op: ReduceOp, *, async_op: bool = False
    ) -> Work:
        return self._run(
            "reduce_scatter", lambda o, i: self.inner.reduce_scatter(o, i, op), [output], [input]
        )

    def all_to_all(
        self,
        output: Any,
        input: Any,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        *,
        async_op: bool = False,
    ) -> Work:
        return self._run(
            "all_to_all",
            lambda o, i: self.inner.all_to_all(o, i, output_splits, input_splits),
            [output],
            [input],
        )

    def send(self, array: Any, dst: int, tag: int) -> Work:
        return self.inner.send(array, dst, tag)

    def recv(self, array: Any, src: int | None, tag: int) -> Work:
        return self.inner.recv(array, src, tag)

    def barrier(self, *, async_op: bool = False) -> Work:
        return self.inner.barrier(async_op=async_op)

    def abort(self, reason: str) -> None:
        self.inner.abort(reason)

    def abort_reason(self) -> str | None:
        return self.inner.abort_reason()

    def add_abort_listener(self, fn: Callable[[str], None]) -> None:
        self.inner.add_abort_listener(fn)

    def shutdown(self) -> None:
        if self._staging is not None:
            self._staging.clear()
        self.inner.shutdown()
