"""Recovery from a confirmed divergence, as one small state machine: diagnose, classify, agree, act, restore, record.

Every incident walks :data:`TRANSITIONS` from :attr:`Step.DIAGNOSE`; any step may end the run instead
(:attr:`Step.GIVE_UP`: the record, then the error). Only :attr:`Step.AGREE` and :attr:`Step.RESTORE` talk to the
other ranks, each once, so every rank takes the same path; the rest is decided locally.

Incidents form a *chain* until a recovery holds (a state taken after the latest recovery is confirmed): within a
chain each restore point is used at most once and the dynamics ladder climbs one rung per incident; when it holds,
the chain closes (:meth:`IncidentChain.close_if_held`) and everything may be used again.

The chain calls nothing back: :meth:`IncidentChain.run` returns the incident with its record (and, when the run must
stop, the error to raise once the record is written).
"""
import enum
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set

from .. import distributed
from ..batches import BatchWatch
from ..causes import Cause, Classification, row
from ..config import GuardConfig
from ..diagnosis import batch_broke, classify, diagnose_step, from_inputs, merge, recurring, summarize
from ..diagnosis.window import trace_incident, window_samples
from ..errors import BadDataError, NanGuardGaveUp, NoHealthyStateError, StructuralDivergence
from ..port import GuardIO, Payload
from ..records import Event, step_record
from ..remedies import Change
from ..remedies.quarantine import bad_data_advice
from ..watch.detector import Decision, StepSignals
from .policy import CausePolicy
from .restore import RESTORE_ORDER, RestorePoints, as_tensors

__all__ = ["Step", "TRANSITIONS", "Incident", "IncidentChain"]


class Step(str, enum.Enum):
    """Where an incident stands."""

    DIAGNOSE = "diagnose"  #: a rank whose step broke replays its batch (rank-local, on live and healthy weights)
    CLASSIFY = "classify"  #: that rank's class, from its replay
    AGREE = "agree"  #: one collective: every rank's class, its batch's samples, its health reading
    ACT = "act"  #: the policy's remedies for the agreed class (which may turn out structural)
    RESTORE = "restore"  #: the next restore point of this run, or none (bad data met a finite state)
    RECORD = "record"  #: the counters, the log lines, the incident record
    GIVE_UP = "give_up"  #: the record and the guard's error, for the caller to write and raise
    DONE = "done"  #: training goes on


#: Every step an incident may take next.
TRANSITIONS: Dict[Step, tuple] = {
    Step.DIAGNOSE: (Step.CLASSIFY,),
    Step.CLASSIFY: (Step.AGREE,),
    Step.AGREE: (Step.ACT, Step.GIVE_UP),
    Step.ACT: (Step.RESTORE, Step.GIVE_UP),
    Step.RESTORE: (Step.RECORD, Step.GIVE_UP),
    Step.RECORD: (Step.DONE,),
    Step.GIVE_UP: (Step.DONE,),
}


@dataclass
class Incident:
    """One confirmed divergence as it moves through the steps (what each step leaves for the next)."""

    signals: StepSignals
    decision: Decision
    inside: bool
    iteration: int
    epoch: int
    batch: Any = None
    rng: Optional[Dict[str, Any]] = None
    attributes: List[str] = field(default_factory=list)
    diagnosis: Optional[Dict[str, Any]] = None
    local: Optional[Classification] = None
    cls: Optional[Classification] = None
    ids: List[Dict[str, Any]] = field(default_factory=list)
    state_ok: bool = False
    changes: List[Change] = field(default_factory=list)
    restored: Optional[Payload] = None
    temporal: List[str] = field(default_factory=list)
    lost: int = 0
    stop: Optional[tuple] = None  # (error type, why) once the run must end
    record: Optional[Dict[str, Any]] = None  #: the incident record, once written out by RECORD or GIVE_UP
    error: Optional[Exception] = None  #: the error to raise after writing the record (GIVE_UP)
    #: issue 35: completed iterations when the guard acts on it (``iteration`` + 1 where the ranks agreed on the step's
    #: verdict during the next iteration; 0: ``iteration``). The run trained that far on the path it abandons.
    acted_at: int = 0


class IncidentChain:
    """Runs an incident through the steps and keeps the chain's state (restore points tried) and the run's counters.

    Args:
        config: the guard's settings.
        io: the runner adapter.
        points: the run's restore points.
        policy: the remedies by class.
        batches: this rank's batches (the failing one, the last good one, their samples).
        log_path: the incident log's path, for the error message (None: no work dir).
    """

    def __init__(self, config: GuardConfig, io: GuardIO, points: RestorePoints, policy: CausePolicy,
                 batches: BatchWatch, log_path: Optional[str]) -> None:
        self.config, self.io, self.points, self.policy, self.batches = config, io, points, policy, batches
        self.log_path = log_path or "(no work dir: no incident log)"
        self.recoveries = 0
        self.iterations_lost = 0
        self.actions_tried: List[str] = []
        #: Restore points used in the open chain (empty: no chain open).
        self.tried: Set[str] = set()
        self._handlers = {Step.DIAGNOSE: self._diagnose, Step.CLASSIFY: self._classify, Step.AGREE: self._agree,
                          Step.ACT: self._act, Step.RESTORE: self._restore, Step.RECORD: self._record,
                          Step.GIVE_UP: self._give_up}

    def run(self, incident: Incident) -> Incident:
        """Walks ``incident`` from :attr:`Step.DIAGNOSE` to :attr:`Step.DONE`; returns it with its ``record`` (and,
        through :attr:`Step.GIVE_UP`, its ``error``: the caller writes the record, then raises)."""
        step = Step.DIAGNOSE
        while step != Step.DONE:
            following = self._handlers[step](incident)
            if following not in TRANSITIONS.get(step, ()):
                raise RuntimeError(f"incident chain: no transition {step.value} -> {following.value}")
            step = following
        return incident

    def close_if_held(self) -> Optional[str]:
        """On a healthy step: a state taken after the latest recovery is confirmed, so the recovery held and the chain
        closes. Returns the ladder's rung that held (or None)."""
        if not self.tried:
            return None
        snap = self.points.ring.newest_confirmed()
        if snap is None or snap.generation != self.recoveries:
            return None
        self.tried.clear()
        rung = self.policy.held(snap.iteration)
        if rung:
            self.io.log(f"NanGuard: the recovery held (the state of iter {snap.iteration} is confirmed); the "
                        f"ladder's rung that held: {rung}")
        return rung

    # ------------------------------------------------------------------ the steps
    def _diagnose(self, inc: Incident) -> Step:
        # A rank whose own step was clean would only re-run a clean batch: only those that saw the fault do.
        saw_fault = inc.signals.suspicious or inc.signals.weights_finite is False or not distributed.is_distributed()
        forward = self.io.rerun_forward(inc.batch) if self.config.diagnose and saw_fault else None
        if forward is None:
            return Step.CLASSIFY
        try:
            report = self._replay(inc, forward)
        except Exception as exc:  # the diagnosis must never stand between a divergence and its recovery
            report = {"error": f"{type(exc).__name__}: {exc}", "traceback": _trace(exc)}
        report["rank"] = distributed.get_rank()
        self.io.log(f"NanGuard: diagnosis of iter {inc.iteration} (rank {report['rank']}): {summarize(report)}",
                    "warning")
        inc.diagnosis = report
        return Step.CLASSIFY

    def _replay(self, inc: Incident, forward: Callable[[], Any]) -> Dict[str, Any]:
        snap = self.points.healthy()
        weights = as_tensors(snap.ready_payload()) if snap is not None else None
        where = ("the run's start state" if snap is self.points.start else f"snapshot of iter {snap.iteration}"
                 if snap is not None else "")
        scale = inc.signals.loss_scale if inc.signals.loss_scale is not None else self.io.loss_scale()
        good = self.batches
        good_forward = self.io.rerun_forward(good.good_batch) if good.good_batch is not None else None
        report = diagnose_step(self.io.model(), forward, rng_state=inc.rng, loss_scale=scale or 1.0,
                               healthy_weights=weights, healthy_from=where if weights else "", compare="reproduced",
                               good_forward=good_forward, good_rng=good.good_rng,
                               good_from=f"the batch of iter {good.good_iteration}" if good_forward else "",
                               healthy_setup=self._healthy_temporal)
        floor = inc.signals.loss_scale is not None and inc.signals.loss_scale < self.config.min_loss_scale
        if good.good_batch is None and snap is self.points.start and (inc.signals.scale_mode != "dynamic" or floor):
            # No batch known to be good: every batch since the start state broke, this one included, and no
            # calibration of a dynamic scale explains it (the scale fell past its floor with no step applied).
            report["untrained_batches"] = good.untrained + 1
        # State poisoned with finite weights (BatchNorm statistics, a memory) by a batch other than the one in hand
        # (that one does not break): the batch of the window since the healthy snapshot that did it.
        window = None if batch_broke(report) else trace_incident(
            self.io.model(), self.io.train_loader(), weights, getattr(snap, "iteration", 0),
            good.served_through(inc.iteration), self.io.rerun_forward, lambda _: self._healthy_temporal())
        if window is not None:
            report["window"] = window
        return report

    def _healthy_temporal(self) -> List[str]:
        """The temporal state of the healthy moment for a re-run on its weights: the memory the live weights wrote
        (NaN once they broke) started afresh, as a rollback to that state does (the re-run puts it back after)."""
        return self.policy.registry.get("temporal").after_rollback(self.policy.context(self.io))

    def _classify(self, inc: Incident) -> Step:
        history = self.policy.history
        if inc.diagnosis is not None:
            inc.local = classify(inc.diagnosis, history, inc.iteration, recurrence=False)
        else:
            # No replay: the batch's own values are the evidence there is (a sample holding NaN is bad data).
            fp16 = inc.signals.scale_mode != "none"
            inc.local = from_inputs(self.batches.flagged(fp16), inc.iteration) if inc.batch is not None else None
            if inc.local is None and not distributed.is_distributed():
                inc.local = classify(None, history, inc.iteration, recurrence=False)
        return Step.AGREE

    def _agree(self, inc: Incident) -> Step:
        # Only a rank whose own batch breaks on replay names its samples (the others only received the NaN through
        # the gradient all-reduce), and within it the samples whose own values are bad, where only some are.
        fp16 = inc.signals.scale_mode != "none"
        mine = {"cls": None if inc.local is None else inc.local.as_dict(),
                "ids": self._named_here(inc, fp16),
                "checked": inc.signals.weights_finite}
        views = distributed.gather(mine)
        agreed = merge([None if v["cls"] is None else Classification.from_dict(v["cls"]) for v in views])
        # Back-to-back data incidents make a run structural only when every rank's batch broke: bad samples on one
        # rank of many (a corrupt scene) are data however often they come; a bug breaks every rank's batches.
        everywhere = len(agreed.ranks) >= len(views) and all(r == Cause.DATA.value for r in agreed.ranks.values())
        inc.cls = recurring(agreed, self.policy.history, inc.iteration) if everywhere or not agreed.ranks else agreed
        inc.cls.signals.setdefault("iteration", inc.iteration)
        inc.cls.action = self.policy.action_text(inc.cls.cause)
        inc.ids = [dict(i, rank=r) if len(views) > 1 else i for r, v in enumerate(views) for i in v["ids"]]
        # DDP replicas hold the same weights: one rank's finite check speaks for the state of all.
        inc.state_ok = any(v["checked"] is True for v in views) and not any(v["checked"] is False for v in views)
        if self.recoveries >= self.config.max_recoveries:
            spent = f"the recovery budget is spent ({self.recoveries} of max_recoveries={self.config.max_recoveries})"
            if inc.cls.cause == Cause.DATA and self.policy.enabled(Cause.DATA):
                # Bad data, batch after batch, past the budget: a data problem (a transform that breaks every sample,
                # a corrupt shard), named sample by sample, not a bug in the model.
                inc.cls.signals["bad_data"] = self.policy.registry.get("quarantine").spent(self.io.dataset(), inc.ids)
                inc.cls.evidence += (f"; {spent}, every divergence of late bad data: look at what every sample goes "
                                     "through (the data pipeline's transforms, a wrong normalisation) and at the "
                                     "files of the samples named")
                self._bad_data_stop(inc)
                return Step.GIVE_UP
            inc.stop = (NanGuardGaveUp, spent)
            return Step.GIVE_UP
        return Step.ACT

    def _act(self, inc: Incident) -> Step:
        c = inc.cls
        if c.cause != Cause.STRUCTURAL:
            inc.changes = self.policy.act(c, self.io, inc.ids, self.recoveries + 1)
        if c.signals.get("bad_data"):  # samples the bound refused broke the run again: data, not a bug
            self._bad_data_stop(inc)
            return Step.GIVE_UP
        if c.cause == Cause.STRUCTURAL:
            inc.changes = []
            inc.stop = (StructuralDivergence, f"the divergence is structural: {c.evidence}. Look at: "
                                              f"{row(Cause.STRUCTURAL).look_at}")
            return Step.GIVE_UP
        self.note(inc.iteration, inc.changes)
        return Step.RESTORE

    def _named_here(self, inc: Incident, fp16: bool) -> List[Dict[str, Any]]:
        """The samples this rank blames: those the window trace found, else, where its own batch broke on replay, its
        suspects, else, where no replay ran, the samples holding bad values of their own; none otherwise."""
        traced = window_samples(inc.diagnosis, self.io.dataset())
        if traced:
            return traced
        if batch_broke(inc.diagnosis):
            return self.batches.suspects(fp16)
        if inc.local is not None and inc.local.signals.get("flagged_inputs"):
            return self.batches.flagged(fp16)
        return []

    def _bad_data_stop(self, inc: Incident) -> None:
        inc.stop = (BadDataError, f"a data problem, not a bug: {inc.cls.evidence}. "
                                  f"{bad_data_advice(inc.cls.signals['bad_data'])}")

    def _restore(self, inc: Incident) -> Step:
        # Bad data met a state checked finite on every rank (the scaler or the fp32 skip kept it out): the state is
        # not what broke, so the run goes on from it, nothing lost.
        if "rollback" not in self.config.remedies or self._keeps_state(inc):
            return Step.RECORD
        # Bad data leaves the restore point it rolls back to as healthy as it was: the next data incident may use it
        # again (a burst of bad batches rolls back to the same point, batch by batch). Other causes spend it.
        spent = set(self.tried) if inc.cls.cause == Cause.DATA else self.tried
        payload = self.points.next(inc.iteration, spent)
        if payload is None:
            tried = ", ".join(sorted(self.tried)) or "none existed"
            inc.stop = (NoHealthyStateError, f"no healthy state of this run is left to roll back to (tried: {tried}; "
                                             "the order is: " + "; ".join(RESTORE_ORDER) + ")")
            return Step.GIVE_UP
        self.io.restore(payload)
        self.io.rewind(payload.iteration, inc.inside)
        self.points.drop_after(payload.iteration)
        inc.restored, inc.lost = payload, max(0, max(inc.iteration, inc.acted_at) - payload.iteration)
        self.actions_tried.append(f"iter {inc.iteration}: rollback to {payload.source} (iter {payload.iteration})")
        later, inc.temporal = self.policy.after_restore(inc.cls, self.io, payload, self.recoveries + 1)
        self.note(inc.iteration, later)
        inc.changes += later
        if inc.temporal:
            self.io.log(f"NanGuard: temporal state reset after the rollback: {', '.join(inc.temporal)}")
        return Step.RECORD

    def _record(self, inc: Incident) -> Step:
        self.recoveries += 1
        self.iterations_lost += inc.lost
        restored = None if inc.restored is None else {"source": inc.restored.source,
                                                      "iteration": inc.restored.iteration}
        if restored and inc.temporal:
            restored["temporal_reset"] = inc.temporal
        self.policy.record(inc.cls, inc.iteration, None if inc.restored is None else inc.restored.iteration)
        inc.record = self._base(inc, Event.DIVERGENCE, inc.changes, restored_from=restored, iterations_lost=inc.lost,
                                epoch=inc.epoch, diagnosis=inc.diagnosis, cause=inc.cls.as_dict())
        self._log_recovery(inc)
        return Step.DONE

    def _give_up(self, inc: Incident) -> Step:
        error, why = inc.stop
        changes = inc.changes if error is NoHealthyStateError else []
        inc.record = self._base(inc, Event.GAVE_UP, changes, why=why, diagnosis=inc.diagnosis,
                                cause=None if inc.cls is None else inc.cls.as_dict())
        tried = "\n".join(f"  - {a}" for a in self.actions_tried) or "  (nothing yet)"
        msg = (f"NanGuard gave up at iter {inc.signals.iteration}: {why}. Last divergence: {inc.decision.reason}.\n"
               f"Remedies and rollbacks so far:\n{tried}\nIncident log: {self.log_path}")
        self.io.log(msg, "error")
        inc.error = error(msg, inc.cls.signals["bad_data"]) if error is BadDataError else error(msg)
        return Step.DONE

    # ------------------------------------------------------------------ helpers
    def _keeps_state(self, inc: Incident) -> bool:
        return not row(inc.cls.cause).rolls_back or (inc.cls.cause == Cause.DATA and inc.state_ok)

    def note(self, iteration: int, changes: List[Change]) -> None:
        """Adds ``changes`` to the actions tried, which the give-up message lists."""
        for change in changes:
            self.actions_tried.append(f"iter {iteration}: {change.target} {change.old} -> {change.new}")

    def _base(self, inc: Incident, event: Event, changes: List[Change], **fields: Any) -> Dict[str, Any]:
        if inc.acted_at > inc.iteration:  # issue 35: agreed during the next iteration
            fields["acted_at"] = inc.acted_at
        return self.record(event, inc.signals, inc.decision, changes, inc.attributes, **fields)

    def record(self, event: Event, signals: StepSignals, decision: Decision, changes: List[Change],
               attributes: List[str], **fields: Any) -> Dict[str, Any]:
        """The one builder of the guard's records (an incident's, a skipped step's, a stall's): the step, the
        changes, the run's recovery count and, where modules hold non-finite attributes, their names."""
        extra = {"nonfinite_attributes": list(attributes)} if attributes else {}
        return step_record(event, signals, decision, list(changes), self.recoveries, self.config.max_recoveries,
                           distributed.get_world_size(), **extra, **fields)

    def _log_recovery(self, inc: Incident) -> None:
        if inc.restored is not None:
            where = (f"rolled back to iter {inc.restored.iteration} from {inc.restored.source}, {inc.lost} "
                     "iteration(s) lost")
        elif "rollback" in self.config.remedies:
            where = "no rollback (the state is finite on every rank: the bad batch is skipped)"
        else:
            where = "no rollback (disabled)"
        c = inc.cls
        self.io.log(f"NanGuard: divergence at iter {inc.iteration} ({inc.decision.reason}); cause: {c.cause.value} "
                    f"({c.evidence}); recovery {self.recoveries}/{self.config.max_recoveries}: {where}; "
                    f"{len(inc.changes)} setting(s) changed", "warning")
        for change in inc.changes:
            self.io.log(f"NanGuard:   {change.target}: {change.old} -> {change.new}", "warning")
        for sample in c.signals.get("quarantined") or []:
            self.io.log("NanGuard:   quarantined: " + ", ".join(f"{k}={v}" for k, v in sample.items()), "warning")
        if inc.restored is not None:
            self.io.log(f"NanGuard: the iteration counter restarts at {inc.restored.iteration + 1}; checkpoints of "
                        "the replayed iterations will be written again", "warning")

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> Dict[str, Any]:
        return {"recoveries": self.recoveries, "iterations_lost": self.iterations_lost,
                "actions_tried": list(self.actions_tried)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.recoveries = int(state.get("recoveries", 0))
        self.iterations_lost = int(state.get("iterations_lost", 0))
        self.actions_tried = list(state.get("actions_tried", []))


def _trace(exc: BaseException, frames: int = 4) -> List[str]:
    """The last few frames of a failed diagnosis, ``file:line in function``: enough to find the call that broke."""
    return [f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
            for f in traceback.extract_tb(exc.__traceback__)[-frames:]]
