"""Runs one group's operations for the CPU message backends (`tcp`, `gloo`).

The runner owns what every collective needs whatever path its bytes take: the group's
sequence numbers, the op queues (collectives in issue order; sends on a queue of their
own so that a blocking `recv` never stops an earlier `isend`), the `Work` handed to the
caller with its timeout, and the failure fan-out: any error of a collective aborts the
group through the transport, which tells every peer, and every later operation raises
the first failure; a collective that completes after its group failed fails too (its
peers gave it up: their part may be missing), and a `Work.wait` that timed out hands the
caller its arrays back only once the aborted collective has left them. A timeout names
the late ranks in its error's `peer_ranks` (the path's, or those its diagnosis recorded
in the mailbox), and the abort passes them on.
The front end (`collectives.py`) adds the flight recorder and the stall inspector around
each call, for every backend alike; a backend's path only moves bytes (see `paths.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ...deadline import Deadline
from ...errors import DistBackendError, DistError, DistTimeoutError, GroupDestroyedError
from ...work import Work
from ..base import OpQueue
from .protocol import Call, Failure, Signature
from .transport.base import Transport

__all__ = ["Runner"]

#: how long a Work.wait that timed out waits for its aborted collective to leave the
#: caller's arrays (it does at its next look at the abort: a wait wakes at once, a copy
#: in flight ends) before raising anyway, with a warning
_SETTLE_S = 10.0

log = logging.getLogger(__name__)


class Runner:
    """Issues the collectives and sends of one group, in order, each with its `Work`.

    Args:
        transport: the group's transport; its mailbox records the group's failure.
        name: the backend's name, for the queue threads' names.
        describe: names an operation in messages (`Backend.describe`).
        timeout: the group timeout in seconds: each operation's deadline and
            `Work.wait`'s default.
    """

    def __init__(
        self,
        transport: Transport,
        name: str,
        describe: Callable[[str], str],
        timeout: float,
    ) -> None:
        self._transport = transport
        self._mailbox = transport.mailbox
        self._describe = describe
        self._descriptions: dict[str, str] = {}  # op -> describe(op), made once
        self.timeout = timeout
        self._collectives = OpQueue(f"distcomm-{name}-ops")
        self._sends = OpQueue(f"distcomm-{name}-send")
        #: the number the next collective gets (the peers number theirs the same way)
        self.seq = 0

    def collective(
        self,
        op: str,
        signature: Signature,
        step: Callable[..., None],
        args: tuple,
        outputs: list[Any],
        async_op: bool,
        why: Callable[[int], str],
    ) -> Work:
        """Run `step(call, *args)` as the group's next collective, in issue order.

        `call` is the `Call` (seq, signature, description, deadline) of the collective;
        `why(seq)` explains a `Work.wait` timeout. Any error aborts the group.
        """
        description = self._descriptions.get(op)
        if description is None:
            description = self._descriptions[op] = self._describe(op)
        if not async_op:
            # nothing runs or waits ahead: run it here and now, its waits bounded by the
            # call's deadline, and hand back a finished Work (nothing to wait on)
            done = self._collectives.run_now(
                description, outputs, self.timeout, self._run, signature, (step, args)
            )
            if done is not None:
                return done
        running: list[int] = []  # the seq, once the collective starts

        def explain() -> str:
            if running:
                return why(running[0])
            return "it had not started: operations issued before it are still running"

        def late() -> tuple[int, ...] | None:
            return self._mailbox.late(running[0]) if running else None

        work = Work(
            description,
            outputs,
            on_timeout=self.abort_on_timeout(description, explain, late),
            timeout=self.timeout,
            settle=_SETTLE_S,
        )

        # (step, args), taken by `run`: its closure (which a failed collective's traceback
        # keeps, by the frame's function) must not keep the arrays (see `OpQueue`)
        held = [(step, args)]

        def run() -> None:
            running.append(self.seq)
            self._run(description, signature, held.pop())

        return self._collectives.submit(run, work, async_op)

    def _run(
        self, description: str, signature: Signature, job: tuple[Callable[..., None], tuple]
    ) -> None:
        """Number the collective and run its step, `job` = (step, args) (the op queue is
        this caller's)."""
        step, args = job
        seq = self.seq
        self.seq += 1
        describe = f"{description} #{seq}"
        failure = self._mailbox.failure
        if failure is not None:
            raise failure.error(f"{describe}: the group was aborted earlier: ")
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %s", describe, signature.describe())
        try:
            step(Call(seq, signature, describe, Deadline(self.timeout)), *args)
            failure = self._mailbox.failure
            if failure is not None:  # it completed after the group was given up
                raise failure.error(f"{describe}: completed after its group was aborted: ")
        except DistError as exc:
            self._mailbox.blame(exc)  # a path may re-raise a peer's failure by its message
            if exc.peer_ranks is None and isinstance(exc, DistTimeoutError):
                exc.peer_ranks = self._mailbox.late(seq)  # a path that explained in words
            self._transport.abort(Failure(type(exc), str(exc), exc.peer_ranks))
            raise
        except BaseException as exc:
            self._transport.abort(Failure(DistBackendError, f"{describe} failed: {exc!r}"))
            raise

    def send(self, run: Callable[[], None], work: Work) -> Work:
        """Post `run()` (a send) behind the sends issued before it."""
        return self._sends.submit(run, work, async_op=True)

    def abort_on_timeout(
        self,
        description: str,
        why: Callable[[], str],
        late: Callable[[], tuple[int, ...] | None] | None = None,
    ) -> Callable[[float], BaseException]:
        """The Work.wait timeout handler of an operation that cannot be withdrawn: `why()`
        explains the delay, then `late()` names the late ranks (None: none named), which
        the error and the abort carry (`peer_ranks`)."""

        def on_timeout(seconds: float) -> BaseException:
            text = why()
            failure = Failure(
                DistTimeoutError,
                f"{description} did not complete within {seconds:.1f} s (Work.wait timeout): "
                f"{text}; the group is aborted because the operation cannot be abandoned "
                "half-way",
                late() if late is not None else None,
            )
            self._transport.abort(failure)
            return failure.error()

        return on_timeout

    def close(self) -> None:
        """Fail what is still queued (the group was destroyed) and join the queue threads."""
        error = GroupDestroyedError(
            f"{self._describe('operation')}: the process group was destroyed"
        )
        self._collectives.close(error)
        self._sends.close(error)
