"""Cause-aware recovery: which remedies a confirmed divergence gets, from the class its replay gives it.

=====================  ======================================================================================
class                  action (each remedy opt-out by name in ``remedies=``; every change recorded old -> new)
=====================  ======================================================================================
data                   quarantine the batch's samples for the rest of the run (``'quarantine'``); roll back
                       (not when the state was checked finite on every rank: the bad batch is just skipped); no
                       hyperparameter changes. Samples without ids: nothing quarantined. Past the skip list's
                       bound: structural.
forward overflow       the named module runs in fp32 from then on (``'fp32'``); roll back. Forced already:
                       structural.
dynamics / unknown     a ladder, one rung per incident of a chain (a chain ends when a state taken after the
                       latest recovery is confirmed: that rung held): 1. the known manual fix (transformer
                       dropout 0, max_norm 1: ``'clip'``, ``'dropout'``); 2. learning rate x ``lr_backoff`` on
                       every group and schedule (``'lr'``); 3. the optimizer moments of the tensors whose
                       gradients exploded reset (``'moments'``); then structural.
structural             stop with :class:`~.errors.StructuralDivergence`: the class, the evidence, what to look at.
=====================  ======================================================================================

After every rollback, modules holding temporal state outside ``state_dict()`` are reset (``'temporal'``).
"""
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from . import distributed
from .causes import (
    ADVICE,
    Cause,
    CauseHistory,
    Classification,
    agree,
    apply_fp32,
    classify,
    exploded_params,
    recurring,
    reset_moments,
    reset_temporal_state,
    scale_lr,
)
from .port import GuardIO
from .quarantine import SkipList, install_quarantine, resolve_indices, sample_ids
from .remedies import Change

__all__ = ["CausePolicy", "LADDER"]

#: The dynamics ladder's rungs, in order.
LADDER = ("the known manual fix (transformer dropout 0, max_norm 1)", "learning rate backoff",
          "optimizer moments reset")


class CausePolicy:
    """The state of cause-aware recovery over a run (persisted in the guard's state) and its steps.

    Args:
        remedies: the enabled remedy names.
        lr_backoff: the learning-rate factor of the ladder's second rung.
        exploded_ratio: a gradient norm this many times the median marks a tensor as exploded (third rung).
        temporal_reset: method names that reset temporal state after a rollback.
        quarantine_fraction: the skip list's bound, as a fraction of the dataset.
        first_iterations: a divergence this early whose batch breaks the start weights too is structural.
    """

    def __init__(self, remedies: List[str], lr_backoff: float, exploded_ratio: float, temporal_reset: List[str],
                 quarantine_fraction: float, first_iterations: int) -> None:
        self.remedies = remedies
        self.lr_backoff = lr_backoff
        self.exploded_ratio = exploded_ratio
        self.temporal_reset = temporal_reset
        self.quarantine_fraction = quarantine_fraction
        self.history = CauseHistory(first_iterations=first_iterations)
        self.skip: Optional[SkipList] = None
        self.fp32: List[str] = []
        #: Rungs climbed in the current chain of dynamics incidents (0: the next incident gets rung 1).
        self.rung = 0
        #: The product of every learning-rate backoff so far.
        self.lr_factor = 1.0
        self._exploded: List[str] = []

    # ------------------------------------------------------------------ setup and persistence
    def setup(self, io: GuardIO) -> None:
        """Re-applies the persisted fp32 modules to a (resumed) run."""
        if self.fp32:
            for change in apply_fp32(io.model(), self.fp32):
                io.log(f"NanGuard: resumed remedy: {change.target} runs in fp32")

    def attach_data(self, io: GuardIO) -> bool:
        """Puts the quarantine sampler into the training loader once it exists; True once done (or impossible).

        Called as iterations start until it succeeds: MMCV 1.x hands the loader to the runner only then. A loader
        whose iterator already started picks the wrapper up at its next pass (the next epoch), which is when a
        quarantined sample would come round again.
        """
        if "quarantine" not in self.remedies:
            return True
        loader = io.train_loader()
        if loader is None:
            return False
        size = io.dataset_size()
        skip = SkipList(size, max_fraction=self.quarantine_fraction)
        if self.skip is not None:
            skip.load_state_dict(self.skip.state_dict())
            if len(skip):
                io.log(f"NanGuard: resumed quarantine of {len(skip)} sample(s): dataset indices {list(skip)}")
        self.skip = skip
        install_quarantine(loader, self.skip)
        return True

    def state_dict(self) -> Dict[str, Any]:
        return {"history": self.history.state_dict(), "skip": None if self.skip is None else self.skip.state_dict(),
                "fp32": list(self.fp32), "rung": self.rung, "lr_factor": self.lr_factor}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.history.load_state_dict(state.get("history", {}))
        if state.get("skip"):
            self.skip = SkipList(max(1, int(state["skip"].get("dataset_size", 1))),
                                 max_fraction=self.quarantine_fraction)
            self.skip.load_state_dict(state["skip"])
        self.fp32 = list(state.get("fp32", []))
        self.rung = int(state.get("rung", 0))
        self.lr_factor = float(state.get("lr_factor", 1.0))

    # ------------------------------------------------------------------ one incident
    def classify(self, report: Optional[Dict[str, Any]], iteration: int) -> Classification:
        """The class every rank acts on (a collective: every rank calls it at the same point).

        Back-to-back data incidents make a run structural only when every rank's batch broke: bad samples on
        one rank of many (a corrupt scene) are data however often they come; a bug breaks every rank's batches.
        """
        local = classify(report, self.history, iteration, recurrence=False) if report is not None else None
        if local is None and not distributed.is_distributed():
            local = classify(None, self.history, iteration, recurrence=False)
        agreed = agree(local)
        everywhere = len(agreed.ranks) >= distributed.get_world_size() and all(
            r == Cause.DATA.value for r in agreed.ranks.values())
        return recurring(agreed, self.history, iteration) if everywhere or not agreed.ranks else agreed

    def held(self, iteration: int) -> Optional[str]:
        """A recovery held (a state taken after it is confirmed): the chain ends; the rung that held, if any, is
        recorded with the newest incident (persisted with the guard's state)."""
        rung, self.rung = self.rung, 0
        last = self.history.last()
        if last is not None and "held" not in last:
            last["held"] = {"iteration": iteration, "rung": LADDER[rung - 1] if rung else None}
        return LADDER[rung - 1] if rung else None

    def before_rollback(self, c: Classification, io: GuardIO, batch: Any, state_finite: bool,
                        known_fix_in_effect: bool = False) -> List[Change]:
        """Actions that need the failing step's state (its batch, its gradients); may turn ``c`` structural.

        Args:
            c: the agreed class (edited in place when the class changes).
            io: the adapter.
            batch: this rank's failing batch, or None where this rank's step was clean.
            state_finite: the live state was checked finite on every rank that checked it.
            known_fix_in_effect: the first rung's settings are all in force already (a new chain then starts at the
                second rung: a rollback that changes nothing is a rollback spent).
        """
        changes: List[Change] = []
        if c.cause == Cause.DATA:
            changes = self._quarantine(c, io, batch)
            if changes is None:  # nothing to name: the batch goes by; hyperparameters were never the problem
                c.evidence += "; its samples cannot be named (no sample ids in the batch): nothing quarantined"
                changes = []
        if c.cause == Cause.FORWARD_OVERFLOW and "fp32" not in self.remedies:
            c.signals["evidence_cause"] = Cause.FORWARD_OVERFLOW.value
            c.cause, c.evidence = Cause.DYNAMICS, c.evidence + "; the fp32 remedy is off: the ladder instead"
        if c.cause == Cause.FORWARD_OVERFLOW:
            if all(m in self.fp32 for m in c.modules):
                self.history.mark_spent(Cause.FORWARD_OVERFLOW, f"{c.modules} already run in fp32")
                c.cause = Cause.STRUCTURAL
                c.evidence += "; the module already runs in fp32"
                return []
            changes = apply_fp32(io.model(), c.modules)
            self.fp32.extend(m for m in c.modules if m not in self.fp32)
        if c.cause in (Cause.DYNAMICS, Cause.UNKNOWN):
            self.rung += 1
            if self.rung == 1 and known_fix_in_effect:
                self.rung = 2
                c.evidence += "; the known manual fix is in force already: the next rung"
            if self.rung > len(LADDER):
                self.history.mark_spent(Cause.DYNAMICS, "every rung of the ladder was tried")
                c.cause = Cause.STRUCTURAL
                c.evidence += f"; divergences kept coming after every rung ({', '.join(LADDER)})"
            elif self.rung == 3 and "moments" in self.remedies:
                # Named now, while the failing step's gradients are still there (MMCV 1.x keeps them; where the
                # runner already zeroed them, every tensor's moments are reset).
                self._exploded = exploded_params(io.model(), self.exploded_ratio)
        return changes

    def after_rollback(self, c: Classification, io: GuardIO, restored_lr_factor: float) -> List[Change]:
        """Actions on the restored state: the ladder's later rungs, the LR backoff re-applied, temporal state."""
        changes: List[Change] = []
        if io.restores_lr() and restored_lr_factor != self.lr_factor:
            # The restored optimizer and schedules predate a backoff: bring them back to the run's factor.
            scale_lr(io.optimizers(), self.lr_factor / restored_lr_factor, io.restored_lr_schedulers())
        if c.cause in (Cause.DYNAMICS, Cause.UNKNOWN):
            if self.rung == 2 and "lr" in self.remedies:
                changes += scale_lr(io.optimizers(), self.lr_backoff, io.lr_schedulers())
                self.lr_factor *= self.lr_backoff
            elif self.rung == 3 and "moments" in self.remedies:
                model = io.model()
                names = self._exploded or [n for n, _ in model.named_parameters()]
                params = dict(model.named_parameters())
                for opt in io.optimizers():
                    changes += reset_moments(opt, [(n, params[n]) for n in names if n in params])
        return changes

    def reset_temporal(self, io: GuardIO) -> List[str]:
        """After a rollback: modules whose state lives outside ``state_dict()`` start afresh."""
        if "temporal" not in self.remedies or not self.temporal_reset:
            return []
        return reset_temporal_state(io.model(), self.temporal_reset)

    def record(self, c: Classification, iteration: int, restored_to: Optional[int]) -> None:
        """Remembers the incident by what its evidence showed (a data incident handled by the ladder is data)."""
        evidence = c.signals.get("evidence_cause")
        as_seen = Classification(Cause(evidence), c.evidence, c.modules) if evidence else c
        self.history.record(as_seen, iteration, restored_to)
        self.history.incidents[-1]["quarantined"] = bool(c.signals.get("quarantined"))

    @staticmethod
    def advice() -> str:
        return ADVICE[Cause.STRUCTURAL]

    # ------------------------------------------------------------------ data
    def _quarantine(self, c: Classification, io: GuardIO, batch: Any) -> Optional[List[Change]]:
        if "quarantine" not in self.remedies or self.skip is None:
            return None
        ids = sample_ids(batch) if batch is not None else []
        if distributed.is_distributed():  # one rank's bad sample is skipped everywhere it occurs
            gathered: List[Any] = [None] * distributed.get_world_size()
            dist.all_gather_object(gathered, ids, group=distributed._host_group())
            ids = [i for part in gathered for i in (part or [])]
        indices = sorted(set(resolve_indices(io.dataset(), ids))) if ids else []
        if not indices:
            return None
        before = len(self.skip)
        if not self.skip.add(indices, {"iteration": c.signals.get("iteration")}):
            self.history.mark_spent(Cause.DATA, f"the skip list is full ({self.skip.capacity} samples)")
            c.signals.update(evidence_cause=Cause.DATA.value, refused=ids)
            c.cause = Cause.STRUCTURAL
            c.evidence += f"; quarantining {indices} would pass the bound of {self.skip.capacity} sample(s)"
            return []
        c.signals["quarantined"] = ids
        return [Change("quarantine.samples", before, len(self.skip))]
