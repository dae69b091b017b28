"""Steps that went wrong without diverging: a harmless overflow, a skipped fp16 or fp32 step, a non-finite loss.

:class:`SkippedSteps` counts them, logs them, names the samples that broke them and hands those to the policy (a
sample seen in two epochs is quarantined there); it returns the records the watch writes.
"""
import math
from typing import Any, Dict, List, NamedTuple, Optional

from ..batches import BatchWatch
from ..errors import BadDataError
from ..records import Event
from ..remedies.change import Change
from ..remedies.quarantine import short_samples
from .detector import Decision, StepSignals, Verdict

__all__ = ["Skip", "SkippedSteps"]


class Skip(NamedTuple):
    """A record to write for a step that went wrong (``emit``: also an incident the driver acts on; ``error``: the
    run stops with it once the record is written)."""

    event: Event
    decision: Decision
    changes: List[Change]
    fields: Dict[str, Any]
    emit: bool
    error: Optional[BaseException] = None


class SkippedSteps:
    """The skipped-step counters and what each such step leaves.

    Args:
        io: the runner adapter.
        batches: this rank's batches.
        policy: the remedies by class (:class:`~..recovery.policy.CausePolicy`).
    """

    def __init__(self, io: Any, batches: BatchWatch, policy: Any) -> None:
        self.io, self.batches, self.policy = io, batches, policy
        self.skipped_steps = 0
        self.fp32_skips = 0

    def overflow(self, signals: StepSignals, decision: Decision) -> List[Skip]:
        """An agreed OVERFLOW verdict: the records to write, in order."""
        scaled = signals.scale_mode != "none"
        if scaled and (signals.loss is None or math.isfinite(signals.loss)):
            self.skipped_steps += 1
            scale = "" if signals.loss_scale is None else f", loss scale now {signals.loss_scale:g}"
            self.io.log(f"NanGuard: harmless overflow at iter {signals.iteration}: step skipped{scale} "
                        f"({decision.reason})")
            # Ordinary overflows are the scale's doing: only samples whose own values overflow fp16 are blamed.
            return self._learn(signals, self.batches.blame_flagged())
        # fp32 has no loss scaler, and no loss scale makes a forward non-finite (the loss comes before the scaling):
        # nothing here is ordinary. Every such step is an event in the incident log (which step, which samples of
        # which rank: what a user needs to find bad data).
        skipped = scaled or signals.step_applied is False
        if skipped:
            self.skipped_steps += 1
            self.fp32_skips += 0 if scaled else 1
        named = self.batches.blame(fp16=scaled)
        what = ("fp16 step skipped by the loss scaler: the forward itself is non-finite" if scaled else
                "fp32 step skipped before the optimizer applied it" if skipped else "non-finite loss, step applied")
        record = Skip(Event.SKIP if skipped else Event.NONFINITE_LOSS, decision, [], {"batch": named or None}, False)
        self.io.log(f"NanGuard: {what} at iter {signals.iteration} ({decision.reason})"
                    + (f"; samples: {short_samples(named)}" if named else ""), "warning")
        return [record] + (self._learn(signals, named) if skipped else [])

    def _learn(self, signals: StepSignals, named: List[Dict[str, Any]]) -> List[Skip]:
        # Samples that made steps go wrong in two different epochs are named and quarantined (the same list on
        # every rank, so every rank decides the same).
        try:
            found = self.policy.recurring(self.io, named, self.batches.epoch_of(signals.iteration), signals.iteration)
        except BadDataError as exc:  # a sample the quarantine's bound refused is back: a data problem, not a bug
            self.io.log(str(exc), "error")
            return [Skip(Event.GAVE_UP, Decision(Verdict.DIVERGED, "refused bad samples broke the run again"), [],
                         {"why": str(exc), "batch": exc.samples}, True, exc)]
        if found is None:
            return []
        changes, samples, reason = found
        return [Skip(Event.RECURRING_SAMPLE, Decision(Verdict.OVERFLOW, reason), changes,
                     {"batch": samples, "quarantined": bool(changes)}, True)]

    def state_dict(self) -> Dict[str, Any]:
        return {"skipped_steps": self.skipped_steps, "fp32_skips": self.fp32_skips}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.fp32_skips = int(state.get("fp32_skips", 0))
