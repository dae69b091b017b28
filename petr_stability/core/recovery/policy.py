"""Which remedies a confirmed divergence gets, from its agreed class: :data:`~..causes.CAUSE_TABLE` and the ladder.

The policy owns every remedy decision and the state behind it (persisted in the guard's checkpoint state): the
ladder's rung in the current chain, the known manual fix once applied, the learning-rate factor, the fp32 modules,
the quarantine and the history of incidents. It acts through the pure functions of :mod:`..remedies` and never
talks to other ranks: the class it acts on was agreed before (:mod:`.chain`).
"""
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..causes import Cause, Classification, row
from ..config import GuardConfig
from ..diagnosis.classify import CauseHistory
from ..port import GuardIO
from ..remedies import (
    Change,
    SkipList,
    apply_fp32,
    exploded_params,
    reset_moments,
    reset_temporal_state,
    scale_lr,
    zero_transformer_dropout,
)
from ..remedies.quarantine import QuarantineRefused, quarantine_samples
from ..samples import resolve_indices

__all__ = ["Rung", "LADDER", "KNOWN_FIX", "CausePolicy"]

#: Samples remembered for the recurrence rule (the newest kept): far more than any run's bad samples.
_MAX_SIGHTINGS = 100000

#: The name of the ladder's first rung, as code, docs and logs call it.
KNOWN_FIX = "the known manual fix (transformer dropout 0, max_norm 1)"


@dataclass(frozen=True)
class Rung:
    """One rung of the dynamics ladder.

    Attributes:
        name: how logs and records name it.
        remedies: the ``remedies=`` names it uses (a rung whose remedies are all off is climbed, changing nothing).
        when: ``'before restore'`` or ``'after restore'`` (what a restore puts back must be changed after it).
        apply: ``apply(policy, io, incident) -> [Change]``, with ``incident`` the recovery's 1-based number.
        prepare: what must be read before the restore, while the failing step's gradients still exist.
    """

    name: str
    remedies: Tuple[str, ...]
    when: str
    apply: Callable[["CausePolicy", GuardIO, int], List[Change]]
    prepare: Optional[Callable[["CausePolicy", GuardIO], None]] = None


def _known_fix(policy: "CausePolicy", io: GuardIO, incident: int) -> List[Change]:
    changes: List[Change] = []
    if "clip" in policy.remedies:
        target = policy.config.clip_target(incident)
        for clip in io.clip_settings():
            change = clip.tighten(target)
            if change:
                changes.append(change)
            if clip.kind == "norm":
                policy.clip_state[clip.name] = clip.max_norm
            elif clip.kind == "value":
                io.log(f"NanGuard: {clip.name} clips by value ({clip.kwargs}); the max_norm remedy does not apply",
                       "warning")
    if "dropout" in policy.remedies:
        changes.extend(policy.zero_dropout(io))
        policy.dropout_zeroed = True
    return changes


def _lr_backoff(policy: "CausePolicy", io: GuardIO, incident: int) -> List[Change]:
    if "lr" not in policy.remedies:
        return []
    policy.lr_factor *= policy.config.lr_backoff
    return scale_lr(io.optimizers(), policy.config.lr_backoff, io.lr_schedulers())


def _name_exploded(policy: "CausePolicy", io: GuardIO) -> None:
    # Named now, while the failing step's gradients are still there (MMCV 1.x keeps them; where the runner
    # already zeroed them, every tensor's moments are reset).
    if "moments" in policy.remedies:
        policy.exploded = exploded_params(io.model(), policy.config.exploded_ratio)


def _moments_reset(policy: "CausePolicy", io: GuardIO, incident: int) -> List[Change]:
    if "moments" not in policy.remedies:
        return []
    model = io.model()
    params = dict(model.named_parameters())
    names = policy.exploded or list(params)
    changes: List[Change] = []
    for opt in io.optimizers():
        changes += reset_moments(opt, [(n, params[n]) for n in names if n in params])
    return changes


#: The dynamics ladder, one rung per incident of a chain (a chain ends when a state taken after the latest recovery
#: is confirmed: that rung held); past the last rung the class is structural.
LADDER: Tuple[Rung, ...] = (
    Rung(KNOWN_FIX, ("clip", "dropout"), "before restore", _known_fix),
    Rung("learning rate backoff", ("lr",), "after restore", _lr_backoff),
    Rung("optimizer moments reset", ("moments",), "after restore", _moments_reset, prepare=_name_exploded),
)


class CausePolicy:
    """The state of cause-aware recovery over a run and the remedies it applies.

    Args:
        config: the guard's settings.
    """

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.remedies = list(config.remedies)
        self.history = CauseHistory(first_iterations=config.first_iterations)
        self.skip: Optional[SkipList] = None
        self.fp32: List[str] = []
        #: Rungs climbed in the current chain of dynamics incidents (0: the next incident gets rung 1).
        self.rung = 0
        #: The product of every learning-rate backoff so far.
        self.lr_factor = 1.0
        #: The max_norm the known manual fix set, per clip setting (re-applied on resume).
        self.clip_state: Dict[str, float] = {}
        self.dropout_zeroed = False
        self.exploded: List[str] = []
        #: Dataset index -> the (at most two) epochs in which it made a step go wrong.
        self.sightings: Dict[int, List[int]] = {}

    # ------------------------------------------------------------------ the table, as text
    def action_text(self, cause: Cause) -> str:
        """The table's action for ``cause`` with this run's ladder and ``lr_backoff`` filled in."""
        ladder = ", then ".join(r.name if r.name != "learning rate backoff" else
                                f"learning rate x {self.config.lr_backoff:g} (schedules too)" for r in LADDER)
        return row(cause).action.format(ladder=ladder, lr_backoff=self.config.lr_backoff)

    def enabled(self, cause: Cause) -> bool:
        """Whether any remedy the table lists for ``cause`` is switched on."""
        return any(name in self.remedies for name in row(cause).remedies)

    # ------------------------------------------------------------------ setup and persistence
    def zero_dropout(self, io: GuardIO) -> List[Change]:
        """The dropout half of the known manual fix, with the configured scope."""
        return zero_transformer_dropout(io.model(), self.config.dropout_scope, self.config.dropout_exclude)

    def setup(self, io: GuardIO) -> None:
        """Re-applies the remedies recorded in a resumed state (once the runner's objects exist)."""
        for clip in io.clip_settings():
            if clip.name in self.clip_state:
                change = clip.tighten(self.clip_state[clip.name])
                if change:
                    io.log(f"NanGuard: resumed remedy {clip.name}: {change.old:g} -> {change.new:g}")
        if self.dropout_zeroed:
            changes = self.zero_dropout(io)
            if changes:
                io.log(f"NanGuard: resumed remedy: {len(changes)} transformer dropout(s) set to 0")
        for change in apply_fp32(io.model(), self.fp32):
            io.log(f"NanGuard: resumed remedy: {change.target} runs in fp32")
        configured = [m for m in self.config.fp32_modules if m not in self.fp32]
        for change in apply_fp32(io.model(), configured):
            io.log(f"NanGuard: {change.target} runs in fp32 (fp32_modules)")
        self.fp32.extend(configured)

    def skip_list(self, io: GuardIO) -> Any:
        """The quarantine the training loader's sampler honours, sized for its dataset (once the loader exists):
        a :class:`~..remedies.quarantine.SkipList` carrying a resumed run's quarantine and the ``quarantine`` argument,
        or an empty set where the quarantine is off."""
        if "quarantine" not in self.remedies:
            return set()
        pinned = list(self.config.quarantine)
        skip = SkipList(io.dataset_size(), max_fraction=self.config.quarantine_fraction, allowance=len(pinned))
        if self.skip is not None:
            skip.load_state_dict(self.skip.state_dict())
            if len(skip):
                io.log(f"NanGuard: resumed quarantine of {len(skip)} sample(s): dataset indices {list(skip)}")
        if pinned:
            skip.add(pinned, {"from": "quarantine"})
            io.log(f"NanGuard: {len(pinned)} sample(s) quarantined from the start (quarantine): dataset indices "
                   f"{pinned}")
        self.skip = skip
        return skip

    def sighted(self, indices: Sequence[int], epoch: int) -> List[int]:
        """Remembers that these samples made a step go wrong in ``epoch``; returns those now seen in two different
        epochs and not yet quarantined (``quarantine_recurring``)."""
        recurring = []
        for index in indices:
            epochs = self.sightings.setdefault(int(index), [])
            if epoch not in epochs:
                epochs.append(epoch)
                del epochs[:-2]  # two epochs decide
            quarantined = self.skip is not None and index in self.skip
            if len(epochs) >= 2 and not quarantined and self.config.quarantine_recurring:
                recurring.append(int(index))
        while len(self.sightings) > _MAX_SIGHTINGS:  # oldest first (dicts keep insertion order)
            self.sightings.pop(next(iter(self.sightings)))
        return recurring

    def quarantine_recurring(self, io: GuardIO, indices: List[int], iteration: int) -> Tuple[List[Change], str]:
        """Quarantines samples that recurred (within the bound); the changes, or none and why."""
        if not self.enabled(Cause.DATA):
            return [], "the quarantine remedy is off"
        if self.skip is None:
            return [], "no training loader to quarantine through"
        try:
            return quarantine_samples(self.skip, indices, {"iteration": iteration, "recurring": True}), ""
        except QuarantineRefused as exc:
            return [], str(exc)

    def state_dict(self) -> Dict[str, Any]:
        return {"history": self.history.state_dict(), "skip": None if self.skip is None else self.skip.state_dict(),
                "fp32": list(self.fp32), "rung": self.rung, "lr_factor": self.lr_factor,
                "sightings": {str(k): list(v) for k, v in self.sightings.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.history.load_state_dict(state.get("history", {}))
        if state.get("skip"):
            # The bound is this run's, set once the loader (and its dataset's size) is known: attach_data.
            self.skip = SkipList(0, max_fraction=self.config.quarantine_fraction)
            self.skip.load_state_dict(state["skip"])
        self.fp32 = list(state.get("fp32", []))
        self.rung = int(state.get("rung", 0))
        self.lr_factor = float(state.get("lr_factor", 1.0))
        self.sightings = {int(k): [int(e) for e in v] for k, v in dict(state.get("sightings", {})).items()}

    # ------------------------------------------------------------------ one incident
    def act(self, c: Classification, io: GuardIO, ids: Sequence[Dict[str, Any]], incident: int) -> List[Change]:
        """The remedies that need the failing step (its batches' ids, its gradients), before the restore.

        May turn ``c`` structural (edited in place) when its class has no remedy left.

        Args:
            c: the agreed class.
            io: the adapter.
            ids: the sample ids of the batches that broke (only the ranks whose own batch broke name theirs).
            incident: this recovery's 1-based number (the clip schedule's index).
        """
        c.action = self.action_text(c.cause)
        changes: List[Change] = []
        if c.cause == Cause.DATA:
            changes = self._quarantine(c, io, ids)
        if c.cause == Cause.FORWARD_OVERFLOW and not self.enabled(Cause.FORWARD_OVERFLOW):
            c.signals["evidence_cause"] = Cause.FORWARD_OVERFLOW.value
            c.cause, c.evidence = Cause.DYNAMICS, c.evidence + "; the fp32 remedy is off: the ladder instead"
        if c.cause == Cause.FORWARD_OVERFLOW:
            changes = self._fp32(c, io)
        if c.cause in (Cause.DYNAMICS, Cause.UNKNOWN):
            changes = self._climb(c, io, incident)
        c.action = self.action_text(c.cause)
        return changes

    def after_restore(self, c: Classification, io: GuardIO, restored_lr_factor: float, incident: int) -> List[Change]:
        """The remedies a restore would undo (the ladder's later rungs), and the backoff re-applied to old states."""
        if io.restores_lr() and restored_lr_factor != self.lr_factor:
            # The restored optimizer and schedules predate a backoff: bring them back to the run's factor.
            scale_lr(io.optimizers(), self.lr_factor / restored_lr_factor, io.restored_lr_schedulers())
        if c.cause in (Cause.DYNAMICS, Cause.UNKNOWN) and 1 <= self.rung <= len(LADDER):
            rung = LADDER[self.rung - 1]
            if rung.when == "after restore":
                return rung.apply(self, io, incident)
        return []

    def reset_temporal(self, io: GuardIO) -> List[str]:
        """After a rollback: modules whose state lives outside ``state_dict()`` start afresh."""
        if "temporal" not in self.remedies or not self.config.temporal_reset:
            return []
        return reset_temporal_state(io.model(), self.config.temporal_reset)

    def held(self, iteration: int) -> Optional[str]:
        """A recovery held (a state taken after it is confirmed): the chain ends; the rung that held, if any, is
        recorded with the newest incident (persisted with the guard's state)."""
        rung, self.rung = self.rung, 0
        last = self.history.last()
        if last is not None and "held" not in last:
            last["held"] = {"iteration": iteration, "rung": LADDER[rung - 1].name if rung else None}
        return LADDER[rung - 1].name if rung else None

    def record(self, c: Classification, iteration: int, restored_to: Optional[int]) -> None:
        """Remembers the incident by what its evidence showed (a data incident handled by the ladder is data)."""
        evidence = c.signals.get("evidence_cause")
        as_seen = Classification(Cause(evidence), c.evidence, c.modules) if evidence else c
        self.history.record(as_seen, iteration, restored_to)
        # Samples taken, or named but refused for the bound: either way the next batch breaking at once shows every
        # batch breaks. Samples that could not be named at all (an iterable dataset without ids) prove nothing.
        self.history.incidents[-1]["quarantined"] = bool(c.signals.get("quarantined") or c.signals.get("refused"))

    def known_fix_in_effect(self, io: GuardIO, incident: int) -> bool:
        """Every enabled setting of the known manual fix is in force already (max_norm at or below its target,
        transformer dropout zeroed)."""
        target = self.config.clip_target(incident)
        clip_done = "clip" not in self.remedies or all(
            c.max_norm is not None and c.max_norm <= target for c in io.clip_settings() if c.kind == "norm")
        return clip_done and ("dropout" not in self.remedies or self.dropout_zeroed)

    # ------------------------------------------------------------------ by class
    def _quarantine(self, c: Classification, io: GuardIO, ids: Sequence[Dict[str, Any]]) -> List[Change]:
        indices = sorted(set(resolve_indices(io.dataset(), ids))) if ids else []
        if not self.enabled(Cause.DATA) or self.skip is None or not indices:
            # Nothing to name: the batch goes by; hyperparameters were never the problem.
            if not self.enabled(Cause.DATA) or self.skip is None:
                why = "the quarantine is off"
            elif ids:
                carried = sorted({k for i in ids for k in i if k != "rank"})
                why = f"the ids it carries ({', '.join(carried)}) name no single dataset index"
            else:
                why = "no dataset indices known and no sample ids in the batch"
            c.evidence += f"; its samples cannot be named ({why}): nothing quarantined"
            return []
        try:
            changes = quarantine_samples(self.skip, indices, {"iteration": c.signals.get("iteration")})
        except QuarantineRefused as exc:
            c.signals["refused"] = list(ids)
            if self.skip.full:  # earlier incidents took the whole bound: too much bad data to be data
                self.history.mark_spent(Cause.DATA, f"the skip list is full ({self.skip.capacity} samples)")
                c.signals["evidence_cause"] = Cause.DATA.value
                c.cause = Cause.STRUCTURAL
                c.evidence += f"; {exc}, and the list is full"
            else:  # the batch is larger than the room left: skipped, nothing quarantined (a second one: structural)
                c.evidence += f"; {exc}: nothing quarantined, the batch is skipped"
            return []
        c.signals["quarantined"] = list(ids)
        return changes

    def _fp32(self, c: Classification, io: GuardIO) -> List[Change]:
        if all(m in self.fp32 for m in c.modules):
            self.history.mark_spent(Cause.FORWARD_OVERFLOW, f"{c.modules} already run in fp32")
            c.cause = Cause.STRUCTURAL
            c.evidence += "; the module already runs in fp32"
            return []
        changes = apply_fp32(io.model(), c.modules)
        self.fp32.extend(m for m in c.modules if m not in self.fp32)
        return changes

    def _climb(self, c: Classification, io: GuardIO, incident: int) -> List[Change]:
        self.rung += 1
        if self.rung == 1 and self.known_fix_in_effect(io, incident):
            # A rollback that changes nothing is a rollback spent: a new chain starts at the next rung.
            self.rung = 2
            c.evidence += "; the known manual fix is in force already: the next rung"
        if self.rung > len(LADDER):
            self.history.mark_spent(Cause.DYNAMICS, "every rung of the ladder was tried")
            c.cause = Cause.STRUCTURAL
            c.evidence += f"; divergences kept coming after every rung ({', '.join(r.name for r in LADDER)})"
            return []
        rung = LADDER[self.rung - 1]
        if rung.prepare is not None:
            rung.prepare(self, io)
        return rung.apply(self, io, incident) if rung.when == "before restore" else []
