"""The classes of a confirmed divergence and the one table saying what each is and what the guard does about it.

:data:`CAUSE_TABLE` is the only place the cause -> action rule is written; which remedies act on a class, and the
ladder's rungs, are read from :mod:`.remedies.registry`, so the table keeps no list of its own. The log line and the
incident record take its action text (with the live ``lr_backoff`` and the policy's ladder filled in),
docs/how-it-works.md's table is checked against it, and the report prints its text.
"""
import enum
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = ["Cause", "CauseRow", "CAUSE_TABLE", "PRIORITY", "row", "SampleVerdict", "Classification"]


class Cause(str, enum.Enum):
    """The class of a confirmed divergence (:data:`CAUSE_TABLE` says what each means and gets).

    A ``str`` enum: ``Cause.DATA == "data"`` in JSON and checkpoints.
    """

    DATA = "data"
    FORWARD_OVERFLOW = "forward_overflow"
    DYNAMICS = "dynamics"
    UNKNOWN = "unknown"
    STRUCTURAL = "structural"

    def __str__(self) -> str:  # f"{cause}" gives "data" on every Python (3.11 changed str() of mixed-in enums)
        return self.value


@dataclass(frozen=True)
class CauseRow:
    """One row of :data:`CAUSE_TABLE`.

    Attributes:
        cause: the class.
        label: how docs and reports name it.
        signal: what in the replay decides it.
        action: what the guard does (``{ladder}`` and ``{lr_backoff}`` are filled in by the policy; which remedies
            act on the class is theirs to say: :func:`~.remedies.registry.serving`).
        rolls_back: whether the action restores a state of this run.
        look_at: where a user looks when this class stops the run.
    """

    cause: Cause
    label: str
    signal: str
    action: str
    rolls_back: bool
    look_at: str


#: The cause -> action table, in the order docs/how-it-works.md lists it.
CAUSE_TABLE: Tuple[CauseRow, ...] = (
    CauseRow(Cause.FORWARD_OVERFLOW, "forward overflow",
             "a module's fp16 forward is the first to go non-finite from finite inputs within fp16 range (an "
             "attention mask's -inf is no such value), and it (or an enclosing call) re-run alone in fp32 on the "
             "same inputs is finite; the known-good batch overflows too, or no row breaks alone, or a batch with no "
             "sample in common overflowed it before",
             "run that module in fp32 from now on; where the same batch stays finite in fp16 on the healthy "
             "weights (the weights grew into the overflow), back to the newest confirmed state as for dynamics (not "
             "where the skip streak began: the grown state) and learning rate x {overflow_lr_backoff} (schedules "
             "too; lr_on_overflow), or x {lr_backoff} where the run left its stability band since its newest "
             "healthy state (the loss or grad_norm exploding before the overflow: the rate drove the weights "
             "there); roll back (already in fp32: structural)",
             True, "the module named runs in fp32; the patched config carries the switch"),
    CauseRow(Cause.DATA, "data",
             "the batch arrives non-finite at the model's input, or breaks the healthy weights too while a batch "
             "known to be good does not, or (weights finite, buffers or temporal state not) a batch since the healthy "
             "snapshot, replayed from it, is the first to make them non-finite, or an fp16 forward overflow is "
             "confined to some of its samples (re-run from the healthy state their rows break beside samples shown "
             "clean, the rest of the batch and the known-good batch stay finite); no replay: some of its samples "
             "hold non-finite values of their own",
             "quarantine the batch's samples (each under every index a dataset wrapper serves it by) for the rest "
             "of the run, within quarantine_fraction (past it: refused, the batch skipped; refused samples that "
             "break the run again, or the recovery budget spent on bad data: stop with BadDataError naming every "
             "bad sample); roll back unless the state was checked finite on every rank (then the batch is only "
             "skipped); no hyperparameter changes",
             True, "the quarantined samples are listed in the incident log (dataset index, "
                                    "sample_idx, token)"),
    CauseRow(Cause.DYNAMICS, "dynamics",
             "the failing batch trains fine on the healthy weights",
             "the next rung of the ladder ({ladder}); roll back; past the last rung: structural. The run's first "
             "divergence whose live parameters went non-finite between two steps (the failing step dropped by the "
             "loss scaler or the guard's skip: the training did not put the NaN there, whatever the loss did "
             "before): roll back alone, no setting changed, the ladder from the next divergence on",
             True, "the learning rate and its warm-up (every rung of the ladder was tried, the rate backed off down "
                   "to lr_min_factor, and divergences kept coming: lower the peak rate or lengthen the warm-up), the "
                   "scale of the loss terms, the gradient clip; the incident log names each rung tried"),
    CauseRow(Cause.UNKNOWN, "unknown",
             "no healthy weights to compare with, or the diagnosis was off or failed",
             "as dynamics", True,
             "keep diagnose=True and let snapshots be confirmed, so that the replay can compare"),
    CauseRow(Cause.STRUCTURAL, "structural",
             "a batch known to be good breaks the healthy weights too (or none has trained since the run's "
             "start), or the class's remedies are spent; no timing rule overrides evidence that the data is bad; "
             "a stop for a bug, bad data or no healthy state stands only where its verdict holds on the run's start "
             "state (else: dynamics, from there)",
             "stop with StructuralDivergence, naming the class, the evidence and what to look at",
             False,
             "what every batch goes through: the data pipeline's transforms (a wrong normalisation, degenerate "
             "boxes), custom CUDA ops built for another torch/CUDA, the loss terms, and the config (learning rate "
             "for the number of GPUs, loss scale); the incident log's diagnosis names the first module that "
             "produced NaN/Inf"),
)

#: Precedence when ranks (or the live and healthy re-runs) disagree: the most specific, cheapest-to-act evidence
#: wins. A rank whose batch is fine on healthy weights only received the other rank's NaN through the all-reduce.
PRIORITY: Dict[Cause, int] = {Cause.UNKNOWN: 0, Cause.DYNAMICS: 1, Cause.DATA: 2, Cause.FORWARD_OVERFLOW: 3,
                              Cause.STRUCTURAL: 4}


def row(cause: Cause) -> CauseRow:
    """The table's row for ``cause``."""
    return next(r for r in CAUSE_TABLE if r.cause == Cause(cause))


@dataclass(frozen=True)
class SampleVerdict:
    """What the remedies did with the samples an incident's evidence named (the quarantine's answer): the incident
    chain reads these fields, and the record shows them as ``cause.signals`` (:meth:`signals`). Samples are dicts as
    the records write them (index, and the sample's id where the dataset has one).

    Attributes:
        quarantined: taken out of the run now. Defaults to ().
        refused: named, but the quarantine's bound refused them (their batch skipped). Defaults to ().
        recurring: named at two skipped steps (quarantined or refused): a ``recurring_sample`` record. Defaults to ().
        stored: the quarantined samples by what they are (leaf dataset, inner index, token), as the next run resolves
            them. Defaults to ().
        bad_data: not None: the run stops with ``BadDataError`` naming these (samples the bound refused broke it
            again, or the budget is spent on late bad data). Defaults to None.
        reason: why they recurred (the recurring record's decision). Defaults to "".
    """

    quarantined: Tuple[Mapping[str, Any], ...] = ()
    refused: Tuple[Mapping[str, Any], ...] = ()
    recurring: Tuple[Mapping[str, Any], ...] = ()
    stored: Tuple[Mapping[str, Any], ...] = ()
    bad_data: Optional[Tuple[Mapping[str, Any], ...]] = None
    reason: str = ""

    def signals(self) -> Dict[str, Any]:
        """The record's keys (``cause.signals``), those set only: the incident log's schema (docs/incidents.md)."""
        out: Dict[str, Any] = {}
        if self.recurring:
            out.update(recurring=list(self.recurring), reason=self.reason)
        if self.recurring or self.quarantined:
            out.update(quarantined=list(self.quarantined), stored=list(self.stored))
        if self.refused:
            out["refused"] = list(self.refused)
        if self.bad_data is not None:
            out["bad_data"] = list(self.bad_data)
        return out


@dataclass(frozen=True)
class Classification:
    """One divergence's class with the evidence for it: plain immutable data (:meth:`but` gives a changed copy).

    Attributes:
        cause: the class.
        evidence: one sentence saying which signal decided it.
        modules: for forward overflow, the modules to run in fp32 (more than one after a merge). Defaults to ().
        signals: the readings behind the evidence (JSON-ready; never changed in place). Defaults to {}.
        ranks: which ranks reported which cause, once agreed. Defaults to {}.
        action: what the guard does for it (the table's text, filled in by the policy). Defaults to "".
        samples: what the remedies did with the samples evidence named (:class:`SampleVerdict`; None: nothing).
            Defaults to None.
    """

    cause: Cause
    evidence: str
    modules: Tuple[str, ...] = ()
    signals: Mapping[str, Any] = field(default_factory=dict)
    ranks: Mapping[str, str] = field(default_factory=dict)
    action: str = ""
    samples: Optional[SampleVerdict] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "cause", Cause(self.cause))
        object.__setattr__(self, "modules", tuple(self.modules))
        object.__setattr__(self, "signals", dict(self.signals))
        object.__setattr__(self, "ranks", dict(self.ranks))
        if not self.action:  # the table's text; the policy writes this run's ladder and lr_backoff into it
            object.__setattr__(self, "action", row(self.cause).action.format(ladder="the ladder's rungs",
                                                                             lr_backoff="lr_backoff",
                                                                             overflow_lr_backoff="overflow_lr_backoff"))

    def but(self, **changes: Any) -> "Classification":
        """A copy with ``changes`` (``signals`` replaces the whole mapping: merge it yourself)."""
        if "cause" in changes and "action" not in changes and Cause(changes["cause"]) != self.cause:
            changes["action"] = ""  # the new class's own action text
        return replace(self, **changes)

    def with_signals(self, **signals: Any) -> "Classification":
        """A copy with ``signals`` merged into its signals."""
        return replace(self, signals={**self.signals, **signals})

    def as_dict(self) -> Dict[str, Any]:
        """JSON-ready form for the incident record."""
        return {"cause": self.cause.value, "evidence": self.evidence, "action": self.action,
                "modules": list(self.modules), "signals": dict(self.signals), "ranks": dict(self.ranks)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Classification":
        """The inverse of :meth:`as_dict`."""
        return cls(Cause(d["cause"]), str(d.get("evidence", "")), tuple(d.get("modules", [])),
                   dict(d.get("signals", {})), dict(d.get("ranks", {})), str(d.get("action", "")))
