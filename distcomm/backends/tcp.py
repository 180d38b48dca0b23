"""The `tcp` backend: every op over the TCP transport with the simple algorithms."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from ..arrays import dtype_code
from ..deadline import Deadline
from ..errors import DistBackendError, DistError, DistTimeoutError
from ..ops import ReduceOp
from ..store.base import Store
from ..work import Work
from . import algorithms as algo
from .base import Backend, OpQueue
from .protocol import NO_REDOP, OP_CODES, P2P, Failure, Header, Signature, as_bytes
from .transport.exchange import Exchange, ScratchPool, SubExchange, diagnose
from .transport.mailbox import Mailbox
from .transport.tcp import TcpTransport, link_timeout

__all__ = ["TcpBackend"]

log = logging.getLogger(__name__)


class TcpBackend(Backend):
    """Portable baseline backend: TCP between every pair of ranks, CPU arrays.

    Collectives run in issue order on one queue; sends are posted to a second queue
    so a blocking `recv` never stops an earlier `isend`; receives are matched as
    messages arrive. Each collective runs the algorithm `self.tuning` picks: the class's
    `tuning_preset` with DISTCOMM_TUNING applied (a subclass sets its own preset).
    """

    name = "tcp"
    devices = ("cpu",)
    #: the algorithm thresholds of this backend, before DISTCOMM_TUNING
    tuning_preset: ClassVar[algo.Tuning] = algo.Tuning.simple()

    def __init__(
        self, store: Store, rank: int, size: int, timeout: float, group_name: str = ""
    ) -> None:
        super().__init__(store, rank, size, timeout, group_name)
        self.tuning = algo.Tuning.from_env(self.tuning_preset)
        label = f"{self.label()} {self.name} backend (group '{self.group_name}')"
        self._transport = TcpTransport(
            store, rank, size, Deadline(timeout), label, link_timeout=link_timeout(timeout)
        )
        self._collectives = OpQueue(f"distcomm-{self.name}-ops")
        self._sends = OpQueue(f"distcomm-{self.name}-send")
        self._seq = 0
        self._scratch = ScratchPool()
        self._closed = False

    # -- running collectives ----------------------------------------------------------------

    def _run_collective(
        self,
        op: str,
        signature: Signature,
        body: Callable[[int, str, Deadline], None],
        outputs: list[Any],
        async_op: bool,
        why: Callable[[int], str],
    ) -> Work:
        """Run `body(seq, describe, deadline)` as the group's next collective, in issue order.

        `why(seq)` explains a Work.wait timeout. Any error aborts the group.
        """
        description = self.describe(op)
        running: list[int] = []  # the seq, once the collective starts

        def explain() -> str:
            if running:
                return why(running[0])
            return "it had not started: operations issued before it are still running"

        work = Work(
            description,
            outputs,
            on_timeout=self._abort_on_timeout(description, explain),
            timeout=self.timeout,
        )

        def run() -> None:
            seq = self._seq
            running.append(seq)
            self._seq += 1
            describe = f"{description} #{seq}"
            failure = self._transport.mailbox.failure
            if failure is not None:
                raise failure.kind(f"{describe}: the group was aborted earlier: {failure.message}")
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s: %s", describe, signature.describe())
            try:
                body(seq, describe, Deadline(self.timeout))
            except DistError as exc:
                self._transport.abort(Failure(type(exc), str(exc)))
                raise
            except BaseException as exc:
                self._transport.abort(Failure(DistBackendError, f"{describe} failed: {exc!r}"))
                raise

        return self._collectives.submit(run, work, async_op)

    def _exchange(
        self,
        seq: int,
        signature: Signature,
        describe: str,
        deadline: Deadline,
        body: Callable[[Exchange], None],
        ranks: list[int] | None = None,
    ) -> None:
        """Run `body(ex)` over TCP among `ranks` (default: every rank of the group)."""
        if ranks is None:
            ex = Exchange(self._transport, seq, signature, deadline, describe, self._scratch)
        else:
            ex = SubExchange(
                self._transport, seq, signature, deadline, describe, self._scratch, ranks
            )
        mailbox = self._transport.mailbox
        mailbox.begin_collective(seq, signature)
        ex.announce()
        body(ex)
        mailbox.finish_collective(seq, signature)

    def _collective(
        self,
        op: str,
        signature: Signature,
        body: Callable[[Exchange], None],
        outputs: list[Any],
        async_op: bool,
    ) -> Work:
        return self._run_collective(
            op,
            signature,
            lambda seq, describe, deadline: self._exchange(
                seq, signature, describe, deadline, body
            ),
            outputs,
            async_op,
            lambda seq: diagnose(self._transport, seq),
        )

    def _abort_on_timeout(
        self, description: str, why: Callable[[], str]
    ) -> Callable[[float], BaseException]:
        """The Work.wait timeout handler of an operation that cannot be withdrawn."""

        def on_timeout(seconds: float) -> BaseException:
            failure = Failure(
                DistTimeoutError,
                f"{description} did not complete within {seconds:.1f} s (Work.wait timeout): "
                f"{why()}; the group is aborted because the operation cannot be abandoned "
                "half-way",
            )
            self._transport.abort(failure)
            return failure.error()

        return on_timeout

    # -- the op set ------------------------------------------------------------------------

    def broadcast(self, array: Any, root: int, *, async_op: bool = False) -> Work:
        return self._collective(
            "broadcast",
            Signature.of("broadcast", array, root=root),
            lambda ex: algo.broadcast(ex, array, root, self.tuning),
            [array],
            async_op,
        )

    def all_reduce(self, array: Any, op: ReduceOp, *, async_op: bool = False) -> Work:
        return self._collective(
            "all_reduce",
            Signature.of("all_reduce", array, op),
            lambda ex: algo.all_reduce(ex, array, op, self.tuning),
            [array],
            async_op,
        )

    def reduce(self, array: Any, root: int, op: ReduceOp, *, async_op: bool = False) -> Work:
        return self._collective(
            "reduce",
            Signature.of("reduce", array, op, root),
            lambda ex: algo.reduce(ex, array, root, op, self.tuning),
            [array],
            async_op,
        )

    def all_gather(self, output: Any, input: Any, *, async_op: bool = False) -> Work:
        return self._collective(
            "all_gather",
            Signature.of("all_gather", input),
            lambda ex: algo.all_gather(ex, output, input, self.tuning),
            [output],
            async_op,
        )

    def gather(self, output: Any | None, input: Any, root: int, *, async_op: bool = False) -> Work:
        return self._collective(
            "gather",
            Signature.of("gather", input, root=root),
            lambda ex: algo.gather(ex, output, input, root, self.tuning),
            [output] if output is not None else [],
            async_op,
        )

    def scatter(self, output: Any, input: Any | None, root: int, *, async_op: bool = False) -> Work:
        return self._collective(
            "scatter",
            Signature.of("scatter", output, root=root),
            lambda ex: algo.scatter(ex, output, input, root, self.tuning),
            [output],
            async_op,
        )

    def reduce_scatter(
        self, output: Any, input: Any, op: ReduceOp, *, async_op: bool = False
    ) -> Work:
        return self._collective(
            "reduce_scatter",
            Signature.of("reduce_scatter", output, op),
            lambda ex: algo.reduce_scatter(ex, output, input, op, self.tuning),
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
            lambda ex: algo.all_to_all(ex, output, input, output_splits, input_splits, self.tuning),
            [output],
            async_op,
        )

    def barrier(self, *, async_op: bool = False) -> Work:
        return self._collective(
            "barrier",
            Signature(OP_CODES["barrier"]),
            lambda ex: algo.barrier(ex, self.tuning),
            [],
            async_op,
        )

    # -- point to point -------------------------------------------------------------------

    def send(self, array: Any, dst: int, tag: int) -> Work:
        description = self.describe(f"send to rank {dst} (tag {tag})")
        payload = as_bytes(array)
        header = Header(
            P2P, OP_CODES["send"], dtype_code(array.dtype), NO_REDOP, root=-1, seq=tag,
            count=array.size, nbytes=len(payload),
        )

        def run() -> None:
            try:
                self._transport.send(dst, header, payload, Deadline(self.timeout))
            except DistError as exc:
                self._transport.abort(Failure(type(exc), f"{description}: {exc}"))
                raise type(exc)(f"{description}: {exc}") from None

        def why() -> str:
            return (
                f"rank {dst} is not reading its connection (hung or stopped?), or "
                "sends issued before this one are still being written"
            )

        work = Work(
            description,
            [array],
            on_timeout=self._abort_on_timeout(description, why),
            timeout=self.timeout,
        )
        return self._sends.submit(run, work, async_op=True)

    def recv(self, array: Any, src: int | None, tag: int) -> Work:
        peer = "any rank" if src is None else f"rank {src}"
        description = self.describe(f"recv from {peer} (tag {tag})")
        mailbox = self._transport.mailbox
        holder: list[Any] = []

        def on_timeout(seconds: float) -> BaseException:
            error = DistTimeoutError(
                f"{description}: no message arrived within {seconds:.1f} s "
                "(did the sender call send with the same tag and this rank as dst?)"
            )
            if holder and not mailbox.cancel(holder[0]):
                holder[0].event.wait(self.timeout)  # matched already: its payload is arriving
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

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        error = DistBackendError(f"{self.describe('operation')}: the process group was destroyed")
        self._collectives.close(error)
        self._sends.close(error)
        self._transport.close()
        self._scratch.clear()
