"""The `tcp` backend: every op over the TCP transport with the simple algorithms.

The op set is written once here for both CPU message backends; `gloo` subclasses it
with its tuned algorithms and its choice of path (`engine/paths.py`); everything below
the op set (runner, paths, algorithms, transport, shared memory) is the engine (`engine/`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from ..arrays import dtype_code
from ..deadline import Deadline
from ..errors import DistBackendError, DistError, DistTimeoutError
from ..ops import ReduceOp
from ..store.base import Store
from ..work import Work
from .base import Backend, BackendOptions
from .engine import algorithms as algo
from .engine.paths import TcpPath
from .engine.protocol import NO_REDOP, OP_CODES, P2P, Failure, Header, Signature, as_bytes
from .engine.runner import Runner
from .engine.scratch import ScratchPool
from .engine.transport.mailbox import Mailbox
from .engine.transport.tcp import TcpTransport, link_timeout

__all__ = ["TcpBackend"]


class TcpBackend(Backend):
    """Portable baseline backend: TCP between the ranks that talk, CPU arrays.

    The backend is three parts: the TCP transport (the group's channel on the process's
    connections, made on first use and shared by every group, and the mailbox that
    matches incoming messages), the `Runner` (issue order,
    sequence numbers, `Work`, timeouts, aborts) and the path its collectives take,
    chosen once in `_choose_path`: here always `TcpPath`, the algorithm `self.tuning`
    picks (the class's `tuning_preset` with DISTCOMM_TUNING applied) over TCP. A
    subclass sets its own preset and may choose another path. Point-to-point messages
    always use the TCP connections.
    """

    name = "tcp"
    devices = ("cpu",)
    #: the algorithm thresholds of this backend, before DISTCOMM_TUNING
    tuning_preset: ClassVar[algo.Tuning] = algo.Tuning.simple()

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: float,
        group_name: str = "",
        *,
        global_ranks: Sequence[int] | None = None,
        process_store: Store | None = None,
        setup_round: int | None = None,
    ) -> None:
        super().__init__(store, rank, size, timeout, group_name)
        self.tuning = algo.Tuning.from_env(self.tuning_preset)
        label = f"{self.label()} {self.name} backend (group '{self.group_name}')"
        self._transport = TcpTransport(
            store,
            rank,
            size,
            Deadline(timeout),
            label,
            link_timeout=link_timeout(timeout),
            global_ranks=global_ranks,
            process_store=process_store,
            generation=setup_round,
        )
        self._runner = Runner(self._transport, self.name, self.describe, timeout)
        self._transport.mailbox.add_listener(self._maybe_failed)
        self._scratch = ScratchPool()
        self._closed = False
        self._tcp = TcpPath(self._transport, self.tuning, self._scratch)
        try:
            self._path = self._choose_path(store)
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def from_options(cls, options: BackendOptions, pg_options: Any = None) -> TcpBackend:
        """The backend of one group: its ranks' process ranks and the job's store let it
        share the process's connections with the other groups (`transport/fabric.py`)."""
        return cls(
            options.store,
            options.group_rank,
            options.group_size,
            options.timeout,
            options.group_id,
            global_ranks=options.global_ranks_in_group or None,
            process_store=options.process_store,
            setup_round=options.setup_round,
        )

    def _choose_path(self, store: Store) -> Any:
        """The path every collective of this group takes (see `paths.py`)."""
        return self._tcp

    @property
    def transport(self) -> str:
        """How this group's collectives travel: "tcp", "shm" (one host) or "shm+tcp"
        (shared memory within each host, TCP between them)."""
        return self._path.name

    def _collective(
        self,
        op: str,
        signature: Signature,
        step: Callable[..., None],
        args: tuple,
        outputs: list[Any],
        async_op: bool,
    ) -> Work:
        return self._runner.collective(
            op, signature, step, args, outputs, async_op, self._path.diagnose
        )

    # -- the op set ------------------------------------------------------------------------

    def broadcast(self, array: Any, root: int, *, async_op: bool = False) -> Work:
        return self._collective(
            "broadcast",
            Signature.of("broadcast", array, root=root),
            self._path.broadcast,
            (array, root),
            [array],
            async_op,
        )

    def all_reduce(self, array: Any, op: ReduceOp, *, async_op: bool = False) -> Work:
        return self._collective(
            "all_reduce",
            Signature.of("all_reduce", array, op),
            self._path.all_reduce,
            (array, op),
            [array],
            async_op,
        )

    def reduce(self, array: Any, root: int, op: ReduceOp, *, async_op: bool = False) -> Work:
        return self._collective(
            "reduce",
            Signature.of("reduce", array, op, root),
            self._path.reduce,
            (array, root, op),
            [array],
            async_op,
        )

    def all_gather(self, output: Any, input: Any, *, async_op: bool = False) -> Work:
        return self._collective(
            "all_gather",
            Signature.of("all_gather", input),
            self._path.all_gather,
            (output, input),
            [output],
            async_op,
        )

    def gather(self, output: Any | None, input: Any, root: int, *, async_op: bool = False) -> Work:
        return self._collective(
            "gather",
            Signature.of("gather", input, root=root),
            self._path.gather,
            (output, input, root),
            [output] if output is not None else [],
            async_op,
        )

    def scatter(self, output: Any, input: Any | None, root: int, *, async_op: bool = False) -> Work:
        return self._collective(
            "scatter",
            Signature.of("scatter", output, root=root),
            self._path.scatter,
            (output, input, root),
            [output],
            async_op,
        )

    # gather and scatter with a size per rank, which only the root knows: the signature
    # leaves the count out (-1), and the root's receives or the peers' own check the sizes

    def gather_v(
        self,
        output: Any | None,
        input: Any,
        counts: Sequence[int] | None,
        root: int,
        *,
        async_op: bool = False,
    ) -> Work:
        return self._collective(
            "gather",
            Signature.of("gather", input, root=root, count=-1),
            self._path.gather_v,
            (output, input, counts, root),
            [output] if output is not None else [],
            async_op,
        )

    def scatter_v(
        self,
        output: Any,
        input: Any | None,
        counts: Sequence[int] | None,
        root: int,
        *,
        async_op: bool = False,
    ) -> Work:
        return self._collective(
            "scatter",
            Signature.of("scatter", output, root=root, count=-1),
            self._path.scatter_v,
            (output, input, counts, root),
            [output],
            async_op,
        )

    def reduce_scatter(
        self, output: Any, input: Any, op: ReduceOp, *, async_op: bool = False
    ) -> Work:
        return self._collective(
            "reduce_scatter",
            Signature.of("reduce_scatter", output, op),
            self._path.reduce_scatter,
            (output, input, op),
            [output],
            async_op,
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
        return self._collective(
            "all_to_all",
            Signature.of("all_to_all", input, count=-1),
            self._path.all_to_all,
            (output, input, output_splits, input_splits),
            [output],
            async_op,
        )

    def barrier(self, *, async_op: bool = False) -> Work:
        return self._collective(
            "barrier", Signature(OP_CODES["barrier"]), self._path.barrier, (), [], async_op
        )

    # -- point to point -------------------------------------------------------------------

    def send(self, array: Any, dst: int, tag: int) -> Work:
        description = self.describe(f"send to rank {dst} (tag {tag})")
        payload = as_bytes(array)
        header = Header(
            P2P,
            OP_CODES["send"],
            dtype_code(array.dtype),
            NO_REDOP,
            root=-1,
            seq=tag,
            count=array.size,
            nbytes=len(payload),
        )

        # the payload, taken by `run`: its closure (which a failed send's traceback keeps,
        # by the frame's function) must not keep a view of the caller's buffer
        held = [payload]

        def run() -> None:
            data = held.pop()
            try:
                self._transport.send(dst, header, data, Deadline(self.timeout))
            except DistError as exc:
                self._transport.abort(Failure(type(exc), f"{description}: {exc}", exc.peer_ranks))
                raise type(exc)(f"{description}: {exc}") from exc

        def why() -> str:
            return (
                f"rank {dst} is not reading its connection (hung or stopped?), or "
                "sends issued before this one are still being written"
            )

        work = Work(
            description,
            [array],
            on_timeout=self._runner.abort_on_timeout(description, why),
            timeout=self.timeout,
        )
        return self._runner.send(run, work)

    def recv(self, array: Any, src: int | None, tag: int) -> Work:
        peer = "any rank" if src is None else f"rank {src}"
        description = self.describe(f"recv from {peer} (tag {tag})")
        mailbox = self._transport.mailbox
        holder: list[Any] = []  # the posted receive, until withdrawn

        def on_timeout(seconds: float) -> BaseException:
            error = DistTimeoutError(
                f"{description}: no message arrived within {seconds:.1f} s "
                "(did the sender call send with the same tag and this rank as dst?)"
            )
            if holder:
                if mailbox.cancel(holder[0]):
                    # withdrawn, never to complete: the Work (which keeps this handler)
                    # must not keep it, nor the caller's buffer it holds
                    holder.clear()
                else:
                    holder[0].wait(self.timeout)  # matched already: its payload is arriving
            return error

        work = Work(description, [array], on_timeout=on_timeout, timeout=self.timeout)

        def done(recv: Any) -> None:
            if recv.error is not None:
                message = str(recv.error)
                if not message.startswith("[rank"):
                    message = f"{description}: {message}"
                work.fail(type(recv.error)(message))
            else:
                work.complete(recv.source)

        holder.append(
            mailbox.post(
                src,
                Mailbox.p2p_key(src, tag),
                as_bytes(array),
                dtype_code(array.dtype),
                None,
                callback=done,
            )
        )
        return work

    # -- lifecycle -------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        self._transport.abort(Failure(DistBackendError, reason))

    def abort_reason(self) -> str | None:
        failure = self._transport.mailbox.failure
        return None if failure is None else failure.message

    def _maybe_failed(self) -> None:
        """(any thread) The mailbox failed or a peer left: tell the abort listeners of a
        failure."""
        failure = self._transport.mailbox.failure
        if failure is not None:
            self.notify_abort(failure.message)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._runner.close()
        self._transport.close()
        self._scratch.clear()
        path = getattr(self, "_path", None)  # None when choosing it failed
        if path is not None:
            path.close()
