"""Each step's verdict agreed across ranks off the critical path: issued at its own iteration, read at the next.

Why one iteration later, and why that is safe, is docs/distributed.md ("Agreeing off the critical path"); in short:
every rank must act on a step's verdict at the same point (the incident chain runs collectives), and a rank learns the
others' verdicts of step k for free once they have all issued them, which DDP's gradient all-reduce of step k + 1
guarantees. So each rank issues step k's verdict as an asynchronous MAX over the host gloo group at step k and reads
it at step k + 1, where it is already there; the few steps whose state the runner uses right after the guard (a
snapshot, a checkpoint save, the end of an epoch or of training) are agreed at once, as before.
"""
from typing import Any, Optional, Tuple

import torch

from .. import distributed
from .detector import Verdict

__all__ = ["StepAgreement"]


class StepAgreement:
    """Agrees one rank's step verdicts with every other rank's (element-wise MAX: the most severe one wins).

    Without a process group a verdict is its own, at once, and nothing travels (:meth:`defers` is False). Under one (a
    one-rank group included: one code path for 1 and N ranks), :meth:`submit` issues the verdict of the step in hand as
    an asynchronous all-reduce and returns at once; :meth:`take`, called by every rank at the next iteration (or
    before any other work of the guard, :meth:`pending`), waits for it and returns it with the step it belongs to. A
    step whose state the runner uses at once is agreed at once instead (:meth:`now`, a blocking all-reduce). Every rank
    must submit, take and agree at once at the same iterations: which steps wait may depend only on what every rank
    knows alike.

    Attributes:
        deferred: steps agreed one iteration later so far.
        blocking: steps agreed at once under a process group so far (one blocking all-reduce each).
    """

    def __init__(self) -> None:
        self._pending: Optional[Tuple[distributed.PendingMax, Any]] = None
        self._buffer = torch.zeros(1, dtype=torch.int64)
        self.deferred = 0
        self.blocking = 0

    @property
    def pending(self) -> bool:
        """A step's verdict is on its way (submitted, not yet taken)."""
        return self._pending is not None

    @staticmethod
    def defers() -> bool:
        """Whether step verdicts may travel to the next iteration: under a process group (the caller agrees a step
        whose state is used at once with :meth:`now` instead, by a rule every rank applies alike)."""
        return distributed.is_distributed()

    def submit(self, verdict: Verdict, step: Any) -> None:
        """Issues ``verdict`` of ``step`` (whatever the caller needs to act on it later) without waiting.

        Raises:
            RuntimeError: another step's verdict is still on its way (:meth:`take` it first).
        """
        if self._pending is not None:
            raise RuntimeError("StepAgreement: a step's verdict is still being agreed; take() it before submitting")
        self._pending = (distributed.reduce_max_async([int(verdict)], self._buffer), step)
        self.deferred += 1

    def take(self) -> Tuple[Verdict, Any]:
        """The agreed verdict of the step submitted last, and that step (waits where the others have not sent theirs
        yet; under DDP they have).

        Raises:
            RuntimeError: nothing was submitted, or the collective failed (a rank died).
        """
        if self._pending is None:
            raise RuntimeError("StepAgreement: no step's verdict is being agreed")
        pending, step = self._pending
        self._pending = None
        return Verdict(pending.wait()[0]), step

    def now(self, verdict: Verdict) -> Verdict:
        """``verdict`` agreed at once: a blocking all-reduce under a process group, ``verdict`` itself without one."""
        if not distributed.is_distributed():
            return Verdict(verdict)
        self.blocking += 1
        return Verdict(distributed.reduce_max([int(verdict)])[0])
