"""Every incident, as one small state machine: diagnose, classify, agree, act, restore, record.

Three entry points (:class:`Entry`) walk the same :data:`TRANSITIONS` from :attr:`Step.DIAGNOSE`: a confirmed
divergence, a stalled static loss scale, and a step that went wrong without diverging (an fp16 overflow, a skipped
step, a non-finite loss). What they do differently is one small strategy object per entry type (:class:`_Kind`:
diagnose, classify, act, record); the chain runs the shared steps and never branches on the entry type. Each
gathers this rank's evidence (a sample is blamed only by evidence about that sample,
:class:`Evidence`), agrees with the other ranks in one collective, fires its events at the remedies through the
policy (which never names one), and writes records of one schema. Any step may end the run instead
(:attr:`Step.GIVE_UP`: the record, then the error). Only :attr:`Step.AGREE`, :attr:`Step.RESTORE` and (on the way to
a stop) :attr:`Step.VERIFY` talk to the
other ranks, each at most once, so every rank takes the same path; the rest is decided locally.

Divergences form a *chain* until a recovery holds (a state taken after the latest recovery is confirmed): within a
chain each restore point is used at most once and the dynamics ladder climbs one rung per incident; when it holds,
the chain closes (:meth:`IncidentChain.close_if_held`) and everything may be used again.

The chain calls nothing back: :meth:`IncidentChain.run` returns the incident with its records (and, when the run
must stop, the error to raise once the records are written).
"""
import enum
import functools
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from .. import distributed
from ..batches import BatchWatch
from ..causes import Cause, Classification, row
from ..config import GuardConfig
from ..diagnosis import batch_broke, classify, diagnose, diagnose_step, from_inputs, merge, recurring, summarize
from ..diagnosis.window import isolate_rows, rebuilder, trace_incident, window_samples
from ..errors import BadDataError, NanGuardGaveUp, NoHealthyStateError, StructuralDivergence
from ..port import GuardIO, Payload
from ..records import Event, step_record
from ..remedies.base import Change, When
from ..samples import named_samples, suspect_rows
from ..skiplist import bad_data_advice, short_samples
from ..watch.detector import Decision, StepSignals, Verdict
from .policy import CausePolicy
from .restore import RESTORE_ORDER, RestorePoints, as_tensors

__all__ = ["Entry", "Step", "TRANSITIONS", "Incident", "Agreement", "OWN_VALUES", "ISOLATED", "TRACED", "Evidence",
           "IncidentChain"]


class Entry(str, enum.Enum):
    """How an incident enters the chain."""

    DIVERGENCE = "divergence"  #: a confirmed divergence: replay, classify, the class's remedies, roll back
    STALL = "stall"  #: a static loss scale skipping every step: the stall's remedies (none: a divergence)
    SKIP = "skip"  #: a step that went wrong without diverging: recorded, its samples named by evidence only


class Step(str, enum.Enum):
    """Where an incident stands."""

    DIAGNOSE = "diagnose"  #: this rank's evidence (rank-local: the replay, the samples it names)
    CLASSIFY = "classify"  #: that rank's class, from its evidence
    AGREE = "agree"  #: one collective: every rank's class, the samples evidence names, its health reading
    ACT = "act"  #: the events the entry fires at the remedies (which may turn the class structural)
    RESTORE = "restore"  #: the next restore point of this run, or none (bad data met a finite state; not a divergence)
    RECORD = "record"  #: the counters, the log lines, the records
    #: Before a stop for a bug, bad data or no healthy state: does the verdict hold on the run's start state (one
    #: collective)? Where it does not, the incident is answered as dynamics from there.
    VERIFY = "verify"
    GIVE_UP = "give_up"  #: the record and the guard's error, for the caller to write and raise
    DONE = "done"  #: training goes on


#: Every step an incident may take next (a stall no remedy answers goes round again, as a divergence).
TRANSITIONS: Dict[Step, tuple] = {
    Step.DIAGNOSE: (Step.CLASSIFY,),
    Step.CLASSIFY: (Step.AGREE,),
    Step.AGREE: (Step.ACT, Step.VERIFY),
    Step.ACT: (Step.RESTORE, Step.VERIFY, Step.DIAGNOSE),
    Step.RESTORE: (Step.RECORD, Step.VERIFY),
    Step.VERIFY: (Step.GIVE_UP, Step.ACT, Step.RESTORE, Step.RECORD),
    Step.RECORD: (Step.DONE,),
    Step.GIVE_UP: (Step.DONE,),
}


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed on, in :attr:`Step.AGREE`: plain immutable data.

    Attributes:
        cls: the agreed class (None for a skipped step or a stall no rank classified).
        samples: the samples evidence named on every rank (each with its ``rank`` where there is more than one).
        listed: the samples of the batches that broke, on the ranks where they broke (a skipped step's record).
        state_ok: every rank that checked found its state finite (DDP replicas hold the same weights).
    """

    cls: Optional[Classification]
    samples: tuple = ()
    listed: tuple = ()
    state_ok: bool = False


@dataclass
class Incident:
    """One incident as it moves through the steps (what each step leaves for the next)."""

    signals: StepSignals
    decision: Decision
    inside: bool
    iteration: int
    epoch: int
    batch: Any = None
    rng: Optional[Dict[str, Any]] = None
    attributes: List[str] = field(default_factory=list)
    entry: Entry = Entry.DIVERGENCE
    kind: str = ""  #: a skipped step's: ``'overflow'``, ``'skip'`` or ``'nonfinite_loss'``
    data_epoch: int = 0  #: the pass over the data the iteration belongs to (a sample's sightings count passes)
    diagnosis: Optional[Dict[str, Any]] = None
    local: Optional[Classification] = None
    mine: Dict[str, Any] = field(default_factory=dict)  #: this rank's part of the agreement
    agreed: Optional[Agreement] = None
    cls: Optional[Classification] = None
    changes: List[Change] = field(default_factory=list)
    restored: Optional[Payload] = None
    temporal: List[str] = field(default_factory=list)
    lost: int = 0
    stop: Optional[tuple] = None  # (error type, why) once the run must end
    records: List[Dict[str, Any]] = field(default_factory=list)  #: written out by RECORD or GIVE_UP, in order
    error: Optional[Exception] = None  #: the error to raise after writing the records (GIVE_UP)
    #: Completed iterations when the guard acts on it (``iteration`` + 1 where the ranks agreed on the step's verdict
    #: during the next iteration, docs/distributed.md; 0: ``iteration``). The run trained that far on the path it
    #: abandons.
    acted_at: int = 0

    @property
    def record(self) -> Optional[Dict[str, Any]]:
        """The incident's main record (its last)."""
        return self.records[-1] if self.records else None


#: How a record says what named a sample.
OWN_VALUES = "its own values are non-finite (or past fp16's range under fp16)"
ISOLATED = "replayed from the healthy state, it breaks it beside samples shown clean; the rest of its batch does not"
TRACED = "replayed from the healthy snapshot, it poisons state kept with finite weights (the window trace)"


def _tagged(samples: List[Dict[str, Any]], why: str) -> List[Dict[str, Any]]:
    return [dict(s, evidence=why) for s in samples]


class Evidence:
    """This rank's replays and the samples they name.

    The one rule: a sample is blamed only by evidence about that sample: its own values (non-finite, or past fp16's
    range under fp16: :meth:`~..batches.BatchWatch.flagged`), a replay from the healthy state that isolates it
    (:func:`~..diagnosis.window.isolate_rows`: it breaks that state beside samples shown clean while the rest of its
    batch does not), or the window trace (:func:`~..diagnosis.window.trace_incident`: it poisoned state kept with
    finite weights). Having been in a batch that broke, overflowed or was skipped is no evidence about a sample.
    Every sample named carries ``evidence`` saying which of the three named it.

    Args:
        io: the runner adapter.
        points: the run's restore points (the healthy state replays start from).
        batches: this rank's batches.
        fresh_state: starts the temporal state afresh for a replay on healthy weights, as a rollback would (the
            remedies that take :attr:`~..remedies.base.When.AFTER_ROLLBACK`); returns the modules reset.
    """

    def __init__(self, io: GuardIO, points: RestorePoints, batches: BatchWatch,
                 fresh_state: Callable[[], List[str]]) -> None:
        self.io, self.points, self.batches, self.fresh_state = io, points, batches, fresh_state

    # ------------------------------------------------------------------ a divergence's replay
    def replay(self, iteration: int, signals: Any, batch: Any, rng: Any, min_loss_scale: float) -> Optional[Dict]:
        """The failing batch re-run on the live and the healthy weights (and the batch known to be good), the window
        trace where the batch does not break, and the rows isolated where it does; None where it cannot re-run."""
        forward = self.io.rerun_forward(batch)
        if forward is None:
            return None
        try:
            report = self._replay(iteration, signals, forward, rng, min_loss_scale)
        except Exception as exc:  # the diagnosis must never stand between a divergence and its recovery
            report = {"error": f"{type(exc).__name__}: {exc}", "traceback": _trace(exc)}
        report["rank"] = distributed.get_rank()
        self.io.log(f"NanGuard: diagnosis of iter {iteration} (rank {report['rank']}): {summarize(report)}",
                    "warning")
        return report

    def _replay(self, iteration: int, signals: Any, forward: Callable[[], Any], rng: Any,
                min_loss_scale: float) -> Dict[str, Any]:
        snap, weights, where = self.points.healthy_weights()
        scale = signals.loss_scale if signals.loss_scale is not None else self.io.loss_scale()
        good = self.batches
        good_forward = self.io.rerun_forward(good.good_batch) if good.good_batch is not None else None
        report = diagnose_step(self.io.model(), forward, rng_state=rng, loss_scale=scale or 1.0,
                               healthy_weights=weights, healthy_from=where if weights else "", compare="reproduced",
                               good_forward=good_forward, good_rng=good.good_rng,
                               good_from=f"the batch of iter {good.good_iteration}" if good_forward else "",
                               healthy_setup=self.fresh_state)
        floor = signals.loss_scale is not None and signals.loss_scale < min_loss_scale
        if good.good_batch is None and snap is self.points.start and (signals.scale_mode != "dynamic" or floor):
            # No batch known to be good: every batch since the start state broke, this one included, and no
            # calibration of a dynamic scale explains it (the scale fell past its floor with no step applied).
            report["untrained_batches"] = good.untrained + 1
        if batch_broke(report):
            # The batch breaks the healthy state: which of its samples do, each by itself (never the whole batch).
            if not good.flagged(signals.scale_mode != "none"):
                isolation = self.isolation()
                if isolation is not None:
                    report["isolation"] = isolation
            return report
        # State poisoned with finite weights (BatchNorm statistics, a memory) by a batch other than the one in hand
        # (that one does not break): the batch of the window since the healthy snapshot that did it.
        window = trace_incident(self.io.model(), self.io.train_loader(), weights, getattr(snap, "iteration", 0),
                                good.served_through(iteration), self.io.rerun_forward, lambda _: self.fresh_state())
        if window is not None:
            report["window"] = window
        return report

    def _rows(self) -> Tuple[List[int], List[Dict[str, Any]]]:
        """The dataset indices and samples of every batch the step in hand applies: the earlier batches of its
        accumulation window (rebuilt from their indices), then the batch in hand."""
        earlier = [i for _, idx in self.batches.window() for i in idx]
        samples = named_samples(earlier, None, self.io.dataset()) if earlier else []
        return earlier + list(self.batches.indices or []), samples + self.batches.samples()

    def isolation(self) -> Optional[Dict[str, Any]]:
        """:func:`~..diagnosis.window.isolate_rows` for the step's batches (the batch in hand, and the earlier batches
        of its accumulation window) from the healthy state, beside the batch known to be good; None where it cannot
        run (no healthy weights, no dataset indices, no loader)."""
        _, weights, where = self.points.healthy_weights()
        (indices, _), loader = self._rows(), self.io.train_loader()
        if weights is None or not indices or getattr(loader, "dataset", None) is None:
            return None
        report = isolate_rows(self.io.model(), weights, indices, rebuilder(loader), self.io.rerun_forward,
                              clean=self.batches.good_indices(), reset=lambda _: self.fresh_state())
        report["from"] = where
        return report

    def window_flagged(self) -> List[Dict[str, Any]]:
        """Samples of the earlier batches of the accumulation window (rebuilt from their indices) that hold non-finite
        values of their own: their gradients are in the step in hand, their batch is not."""
        loader, window = self.io.train_loader(), self.batches.window()
        if not window or getattr(loader, "dataset", None) is None:
            return []
        rebuild, out = rebuilder(loader), []
        for _, indices in window:
            batch = rebuild(indices)
            samples = named_samples(indices, batch, loader.dataset)
            out += [samples[r] for r in suspect_rows(batch, len(indices), fp16=False) if r < len(samples)]
        return _tagged(out, OWN_VALUES)

    # ------------------------------------------------------------------ before a stop
    def overturned(self, error: type, cls: Classification, batch: Any, rng: Any) -> Optional[Classification]:
        """Whether a stop's verdict holds on the oldest stable state held (the run's start state), every rank's
        evidence agreed (one gather; a stop stands only where no rank shows otherwise): the batch known to be good (else
        the failing one) trains fine there, so no bug breaks every batch and there is a healthy state to return to;
        for bad data, the failing batch trains fine there, so it is not the data. Returns the incident as dynamics
        (signal ``overturned``: the error it no longer raises) or None (the verdict holds, or nothing could re-run)."""
        found = self._on_start_state(batch, rng)
        if found is not None:
            breaks = found["failing"] if error is BadDataError or found.get("good") is None else found["good"]
            found["holds"] = bool(breaks)
        views = distributed.gather(found)
        shown = [v for v in views if v is not None and not v["holds"]]
        if not shown:
            return None
        which = "the failing batch" if error is BadDataError or shown[0].get("good") is None else \
            "the batch known to be good"
        return Classification(Cause.DYNAMICS, f"{cls.evidence}; but on {shown[0]['from']} {which} trains fine: "
                                              f"not a bug and not the data, the state was on a divergent path (no "
                                              f"{error.__name__}: answered as dynamics from there)",
                              signals={"evidence_cause": cls.cause.value, "overturned": error.__name__,
                                       "on_start_state": shown[0]})

    def _on_start_state(self, batch: Any, rng: Any) -> Optional[Dict[str, Any]]:
        """The failing batch and the batch known to be good re-run (forward and backward, unscaled) on the run's start
        state, temporal state afresh: whether each breaks there; None where they cannot run."""
        start = self.points.start
        weights = as_tensors(start.ready_payload()) if start is not None else None
        forward = self.io.rerun_forward(batch) if batch is not None else None
        if weights is None or forward is None:
            return None
        good = self.batches
        good_forward = self.io.rerun_forward(good.good_batch) if good.good_batch is not None else None
        try:
            found: Dict[str, Any] = {"from": self.points.start_key()}
            for key, fwd, state in (("failing", forward, rng), ("good", good_forward, good.good_rng)):
                if fwd is not None:
                    found[key] = diagnose(self.io.model(), fwd, rng_state=state, weights=weights, fp32_check=False,
                                          setup=self.fresh_state)["reproduced"]
            return found
        except Exception as exc:  # evidence only: a re-run that fails overturns nothing
            self.io.log(f"NanGuard: the re-run on the start state failed: {type(exc).__name__}: {exc}", "warning")
            return None

    # ------------------------------------------------------------------ naming samples
    def named(self, diagnosis: Optional[Dict[str, Any]], fp16: bool, replayed: bool) -> List[Dict[str, Any]]:
        """The samples this rank blames in a divergence: those the window trace found, else those of the accumulation
        window's earlier batches holding non-finite values, else, where its own batch broke on replay (or no replay
        ran), those whose own values are bad, else those the replay isolated."""
        traced = window_samples(diagnosis, self.io.dataset())
        if traced:
            return _tagged(traced, TRACED)
        earlier = self.window_flagged()
        if earlier:
            return earlier
        if replayed and not batch_broke(diagnosis):
            return []
        flagged = self.batches.flagged(fp16)
        if flagged:
            return _tagged(flagged, OWN_VALUES)
        return self._isolated((diagnosis or {}).get("isolation"))

    def _isolated(self, isolation: Optional[Dict[str, Any]]) -> List[Dict[str, Any]]:
        if not isolation or not isolation.get("rows"):
            return []
        samples = self._rows()[1]
        return _tagged([samples[r] for r in isolation["rows"] if r < len(samples)], ISOLATED)

    def _listed(self, named: List[Dict[str, Any]], fp16: bool) -> List[Dict[str, Any]]:
        """The samples a skipped step's record lists: the batch in hand's suspects (its samples holding bad values,
        where only some do, else all of it), unless evidence names only samples of earlier batches of its accumulation
        window (then those: the batch in hand did not break the step)."""
        in_hand = set(self.batches.indices or [])
        earlier = [{k: v for k, v in s.items() if k != "evidence"} for s in named
                   if s.get("index") is not None and int(s["index"]) not in in_hand]
        if earlier and len(earlier) == len(named):
            return earlier
        return earlier + self.batches.suspects(fp16)

    def skipped(self, kind: str, fp16: bool) -> Dict[str, Any]:
        """A step that went wrong without diverging, on this rank: the samples its record lists (``listed``: the
        batch's, where it broke on this rank) and those evidence names (``named``); an ordinary fp16 overflow names
        only samples whose own values overflow fp16 (the scale's doing otherwise), and replays nothing. Under gradient
        accumulation the step applies the whole window: the earlier batches' samples count as the batch in hand's."""
        if kind == "overflow":
            flagged = self.batches.flagged(fp16=True) + self.window_flagged()
            return {"listed": flagged, "named": _tagged(flagged, OWN_VALUES), "isolation": None}
        broke = not distributed.is_distributed() or self.batches.replays_broken()
        if not broke:
            return {"listed": [], "named": [], "isolation": None}
        flagged = self.window_flagged() + _tagged(self.batches.flagged(fp16), OWN_VALUES)
        isolation = self.isolation() if not flagged and kind == "skip" else None
        named = flagged or self._isolated(isolation)
        listed = self._listed(named, fp16)
        return {"listed": listed, "named": named, "isolation": isolation}


def _trace(exc: BaseException, frames: int = 4) -> List[str]:
    """The last few frames of a failed diagnosis, ``file:line in function``: enough to find the call that broke."""
    return [f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
            for f in traceback.extract_tb(exc.__traceback__)[-frames:]]


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
        self.evidence = Evidence(io, points, batches, functools.partial(policy.fresh_state, io))
        self.log_path = log_path or "(no work dir: no incident log)"
        self.recoveries = self.iterations_lost = self.stalls = self.skipped_steps = self.fp32_skips = 0
        self.actions_tried: List[str] = []
        #: Restore points used in the open chain (empty: no chain open).
        self.tried: Set[str] = set()
        self._handlers = {Step.DIAGNOSE: self._diagnose, Step.CLASSIFY: self._classify, Step.AGREE: self._agree,
                          Step.ACT: self._act, Step.RESTORE: self._restore, Step.RECORD: self._record,
                          Step.VERIFY: self._verify, Step.GIVE_UP: self._give_up}

    def run(self, incident: Incident) -> Incident:
        """Walks ``incident`` from :attr:`Step.DIAGNOSE` to :attr:`Step.DONE`; returns it with its ``records`` (and,
        through :attr:`Step.GIVE_UP`, its ``error``: the caller writes the records, then raises)."""
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
        snap = self.points.ring.newest_confirmed() if self.tried else None
        if snap is None or snap.generation != self.recoveries:
            return None
        self.tried.clear()
        rung = self.policy.held(snap.iteration)
        if rung:
            self.io.log(f"NanGuard: the recovery held (the state of iter {snap.iteration} is confirmed); the "
                        f"ladder's rung that held: {rung}")
        return rung

    # ------------------------------------------------------------------ the shared steps
    def _diagnose(self, inc: Incident) -> Step:
        _KINDS[inc.entry].diagnose(self, inc, inc.signals.scale_mode != "none")
        return Step.CLASSIFY

    def _classify(self, inc: Incident) -> Step:
        inc.local = _KINDS[inc.entry].classify(self, inc)
        return Step.AGREE

    def _agree(self, inc: Incident) -> Step:
        views = distributed.gather({"cls": None if inc.local is None else inc.local.as_dict(), **inc.mine,
                                    "checked": inc.signals.weights_finite})
        many = len(views) > 1

        def ranked(key: str) -> tuple:
            return tuple(dict(s, rank=r) if many else dict(s) for r, v in enumerate(views) for s in v.get(key, []))

        kind = _KINDS[inc.entry]
        classes = [None if v["cls"] is None else Classification.from_dict(v["cls"]) for v in views]
        agreed = merge(classes) if any(c is not None for c in classes) or kind.always_classed else None
        # DDP replicas hold the same weights: one rank's finite check speaks for the state of all.
        state_ok = any(v["checked"] is True for v in views) and not any(v["checked"] is False for v in views)
        inc.agreed = Agreement(agreed, ranked("named"), ranked("listed"), state_ok)
        return kind.agreed(self, inc, len(views))

    def _act(self, inc: Incident) -> Step:
        return _KINDS[inc.entry].act(self, inc)

    def _verify(self, inc: Incident) -> Step:
        """A stop for a bug, bad data or no healthy state stands only where its verdict holds on the run's start state
        (:meth:`Evidence.overturned`); else the incident is dynamics, answered from the start state."""
        rechecked = inc.stop[0] in _RECHECKED and inc.cls is not None and not inc.cls.signals.get("spent")
        overturned = self.evidence.overturned(inc.stop[0], inc.cls, inc.batch, inc.rng) if (
            rechecked and self.config.diagnose) else None
        if overturned is None:
            return Step.GIVE_UP
        inc.cls, inc.stop = overturned, None
        if self.recoveries >= self.config.max_recoveries:
            inc.stop = (NanGuardGaveUp, f"{overturned.evidence}; but the recovery budget is spent")
            return Step.GIVE_UP
        return _KINDS[inc.entry].overturned(inc)

    def _restore(self, inc: Incident) -> Step:
        # Bad data met a state checked finite on every rank (the scaler or the fp32 skip kept it out): the state is
        # not what broke, so the run goes on from it, nothing lost. Nothing but a divergence rolls back.
        if not _KINDS[inc.entry].rolls_back or not self.policy.rolls_back(inc.cls, self.io) or (
                inc.cls.cause == Cause.DATA and inc.agreed.state_ok):
            return Step.RECORD
        # Bad data leaves the restore point it rolls back to as healthy as it was: the next data incident may use it
        # again (a burst of bad batches rolls back to the same point, batch by batch). Other causes spend it.
        spent = set(self.tried) if inc.cls.cause == Cause.DATA else self.tried
        payload = self.points.start_payload(spent) if inc.cls.signals.get("overturned") else self.points.next(
            inc.iteration, spent, trouble_first=_state_was_fine(inc.cls), unstable_since=inc.signals.unstable_since)
        if payload is None:
            tried = ", ".join(sorted(self.tried)) or "none existed"
            inc.stop = (NoHealthyStateError, f"no healthy state of this run is left to roll back to (tried: {tried}; "
                                             "the order is: " + "; ".join(RESTORE_ORDER) + ")")
            return Step.VERIFY
        self.io.restore(payload)
        self.io.rewind(payload.iteration, inc.inside)
        self.batches.rewind(payload.iteration)
        self.points.drop_after(payload.iteration)
        inc.restored, inc.lost = payload, max(0, max(inc.iteration, inc.acted_at) - payload.iteration)
        self.actions_tried.append(f"iter {inc.iteration}: rollback to {payload.source} (iter {payload.iteration})")
        inc.cls, later, inc.temporal = self.policy.after_restore(inc.cls, self.io, payload, self.recoveries + 1)
        self.note(inc.iteration, later)
        inc.changes += later
        if inc.temporal:
            self.io.log(f"NanGuard: temporal state reset after the rollback: {', '.join(inc.temporal)}")
        return Step.RECORD

    def _record(self, inc: Incident) -> Step:
        inc.records = _KINDS[inc.entry].record(self, inc)
        return Step.DONE

    def _give_up(self, inc: Incident) -> Step:
        error, why = inc.stop
        changes = inc.changes if error is NoHealthyStateError else []
        batch = _KINDS[inc.entry].stopped_on(inc)
        inc.records = [self._base(inc, Event.GAVE_UP, changes, why=why,
                                  **({"batch": batch} if batch is not None else {}))]
        tried = "\n".join(f"  - {a}" for a in self.actions_tried) or "  (nothing yet)"
        msg = (f"NanGuard gave up at iter {inc.signals.iteration}: {why}. Last divergence: {inc.decision.reason}.\n"
               f"Remedies and rollbacks so far:\n{tried}\nIncident log: {self.log_path}")
        self.io.log(msg, "error")
        inc.error = error(msg, list(_bad_data(inc.cls) or [])) if error is BadDataError else error(msg)
        return Step.DONE

    def note(self, iteration: int, changes: List[Change]) -> None:
        """Adds ``changes`` to the actions tried, which the give-up message lists."""
        self.actions_tried += [f"iter {iteration}: {c.target} {c.old} -> {c.new}" for c in changes]

    def _base(self, inc: Incident, event: Event, changes: List[Change], decision: Optional[Decision] = None,
              cls: Any = "incident's", **fields: Any) -> Dict[str, Any]:
        """One record schema for every entry and event: the step, the changes, the class, the samples evidence
        named, the restore and the diagnosis, then the event's own fields."""
        samples = list(inc.agreed.samples) if inc.agreed is not None else []
        cls = inc.cls if cls == "incident's" else cls
        common = {"epoch": inc.epoch, "cause": None if cls is None else cls.as_dict(), "samples": samples,
                  "restored_from": None, "iterations_lost": 0, "diagnosis": inc.diagnosis}
        extra = {"nonfinite_attributes": list(inc.attributes)} if inc.attributes else {}
        if inc.acted_at > inc.iteration:  # agreed during the next iteration (under a process group)
            extra["acted_at"] = inc.acted_at
        return step_record(event, inc.signals, decision or inc.decision, list(changes), self.recoveries,
                           self.config.max_recoveries, distributed.get_world_size(), **extra,
                           **dict(common, **fields))

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> Dict[str, Any]:
        return {**{k: getattr(self, k) for k in _COUNTERS}, "actions_tried": list(self.actions_tried)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for k in _COUNTERS:
            setattr(self, k, int(state.get(k, 0)))
        self.actions_tried = list(state.get("actions_tried", []))


_COUNTERS = ("recoveries", "iterations_lost", "stalls", "skipped_steps", "fp32_skips")


class _Kind:
    """What an entry type does at the steps where the entries differ; :class:`IncidentChain` runs the shared steps
    (agree, verify, restore, give up, the record schema) and never branches on the entry type."""

    #: Agreed on as a class even where no rank classified it (a divergence always has one).
    always_classed = False
    #: It may roll back (the policy says whether this class does).
    rolls_back = False

    def diagnose(self, chain: IncidentChain, inc: Incident, fp16: bool) -> None:
        """This rank's evidence (rank-local)."""

    def classify(self, chain: IncidentChain, inc: Incident) -> Optional[Classification]:
        """This rank's class, from its evidence (None: none)."""
        return None

    def agreed(self, chain: IncidentChain, inc: Incident, ranks: int) -> Step:
        """After the agreement (``inc.agreed``): the next step."""
        return Step.ACT

    def act(self, chain: IncidentChain, inc: Incident) -> Step:
        """The events it fires at the remedies; the next step."""
        raise NotImplementedError

    def overturned(self, inc: Incident) -> Step:
        """Where a stop's verdict did not hold on the start state: the next step."""
        return Step.RECORD  # nothing to roll back, nobody to stop

    def record(self, chain: IncidentChain, inc: Incident) -> List[Dict[str, Any]]:
        """Its records (the counters counted)."""
        raise NotImplementedError

    def stopped_on(self, inc: Incident) -> Optional[List[Dict[str, Any]]]:
        """The samples its give-up record names as its batch (None: no batch field)."""
        return None


def _between_steps(c: Classification, inc: Incident) -> Classification:
    """A dynamics divergence whose live parameters went non-finite although no step applied a non-finite update (a
    loss scaler, or the guard's fp32 skip, dropped the failing step) carries the signal ``between_steps``: the
    training did not put the NaN there (a write from outside the optimizer). A parameter changes only through an
    optimizer step, and every step applied had finite gradients (the scaler and the skip drop the others), so this
    holds whatever the loss did before: a loss explosion in course is no evidence the dynamics wrote the NaN (issue
    43: the zoo's ``temporal`` model, whose noisy loss left the band a step before the write, took the ladder)."""
    params = (inc.diagnosis or {}).get("nonfinite_parameters") or []
    dropped = inc.signals.scale_mode != "none" or inc.signals.step_applied is False
    if c.cause != Cause.DYNAMICS or not params or not dropped:
        return c
    return c.but(evidence=c.evidence + f"; the live parameters ({', '.join(params[:3])}) went non-finite between "
                                       "two steps: no optimizer step applied a non-finite update (the failing one "
                                       "was dropped)",
                 signals={**c.signals, "between_steps": True})


def _state_was_fine(c: Classification) -> bool:
    """Whether the state where the trouble started is a restore point for ``c``: bad data, or a forward overflow the
    healthy weights show too (every batch overflows, or this batch's data does). An overflow the weights grew into
    (``weights_grew``) says the opposite: the state where its skip streak began is the grown one, on the growth's path,
    and the run goes back to its newest confirmed state, as for dynamics (issue 43: the demo's too-high rate, seeds
    0-9, 5 -> 9 of 10 guarded runs inside the reference's spread)."""
    return c.cause == Cause.DATA or (c.cause == Cause.FORWARD_OVERFLOW and not _grew(c))


def _grew(c: Classification) -> bool:
    """A forward overflow whose batch stays finite in fp16 on the healthy weights: the weights grew into it."""
    return c.cause == Cause.FORWARD_OVERFLOW and bool(c.signals.get("weights_grew"))


def _grew_unstable(c: Classification, inc: Incident) -> Classification:
    """A forward overflow the weights grew into after the run left its stability band (its loss or grad_norm judged
    unstable since the newest healthy state: an explosion, in course or ended, before the overflow) carries the signal
    ``unstable_before``: the learning rate drove the weights there, and the states since the explosion began lie on
    its path. It is answered as dynamics is: the rate x ``lr_backoff`` (the module in fp32 as well), back to the newest
    confirmed state from before the trouble (as every overflow the weights grew into: :func:`_state_was_fine`)."""
    since = inc.signals.unstable_since
    if not _grew(c) or since is None:
        return c
    return c.but(evidence=c.evidence + f"; the run left its stability band at iter {since}, after its newest healthy "
                                       "state (its loss or grad_norm exploding before the overflow): the learning "
                                       "rate drove the weights there",
                 signals={**c.signals, "unstable_before": True})


class _Divergence(_Kind):
    """A confirmed divergence: replay, classify, the class's remedies, roll back."""

    always_classed = rolls_back = True

    def diagnose(self, chain: IncidentChain, inc: Incident, fp16: bool) -> None:
        # A rank whose own step was clean would only re-run a clean batch: only those that saw the fault do.
        saw = inc.signals.suspicious or inc.signals.weights_finite is False or not distributed.is_distributed()
        if chain.config.diagnose and saw:
            inc.diagnosis = chain.evidence.replay(inc.iteration, inc.signals, inc.batch, inc.rng,
                                                  chain.config.min_loss_scale)
        inc.mine = {"named": chain.evidence.named(inc.diagnosis, fp16, inc.diagnosis is not None), "listed": []}

    def classify(self, chain: IncidentChain, inc: Incident) -> Optional[Classification]:
        history = chain.policy.history
        if inc.diagnosis is not None:
            local = classify(inc.diagnosis, history, inc.iteration, recurrence=False)
            own = [x for x in inc.mine["named"] if x.get("evidence") == OWN_VALUES]
            if own and local.cause in (Cause.DYNAMICS, Cause.UNKNOWN):
                # The batch in hand trains fine, but an earlier batch of its accumulation window holds NaN/Inf.
                local = from_inputs(own, inc.iteration)
            return _grew_unstable(_between_steps(local, inc), inc)
        # No replay: the batch's own values are the evidence there is (a sample holding NaN is bad data).
        local = from_inputs(inc.mine["named"], inc.iteration) if inc.batch is not None else None
        if local is None and not distributed.is_distributed():
            local = classify(None, history, inc.iteration, recurrence=False)
        return local

    def agreed(self, chain: IncidentChain, inc: Incident, ranks: int) -> Step:
        inc.cls = _recurrence(inc.agreed.cls, chain.policy.history, ranks, inc.iteration)
        inc.cls = inc.cls.but(action=chain.policy.action_text(inc.cls.cause))
        if chain.recoveries < chain.config.max_recoveries:
            return Step.ACT
        spent = f"the recovery budget is spent ({chain.recoveries} of max_recoveries={chain.config.max_recoveries})"
        if inc.cls.cause == Cause.DATA and chain.policy.enabled(Cause.DATA):
            # Bad data, batch after batch, past the budget: a data problem (a transform that breaks every sample,
            # a corrupt shard), named sample by sample, not a bug in the model.
            c = chain.policy.spent(inc.cls, chain.io, _bare(inc.agreed.samples))
            inc.cls = c.but(evidence=c.evidence + f"; {spent}, every divergence of late bad data: look at what every "
                                                  "sample goes through (the data pipeline's transforms, a wrong "
                                                  "normalisation) and at the files of the samples named")
            if _bad_data(inc.cls) is not None:
                _bad_data_stop(inc)
                return Step.VERIFY
        inc.stop = (NanGuardGaveUp, spent)
        return Step.VERIFY

    def act(self, chain: IncidentChain, inc: Incident) -> Step:
        if inc.cls.cause != Cause.STRUCTURAL:
            inc.cls, inc.changes = chain.policy.before_restore(inc.cls, chain.io, _bare(inc.agreed.samples),
                                                               chain.recoveries + 1)
        if _bad_data(inc.cls):  # samples the bound refused broke the run again: data, not a bug
            _bad_data_stop(inc)
            return Step.VERIFY
        if inc.cls.cause == Cause.STRUCTURAL:
            inc.changes = []
            inc.stop = (StructuralDivergence, f"the divergence is structural: {inc.cls.evidence}. Look at: "
                                              f"{row(_looked_at(inc.cls)).look_at}")
            return Step.VERIFY
        chain.note(inc.iteration, inc.changes)
        return Step.RESTORE

    def overturned(self, inc: Incident) -> Step:
        return Step.RESTORE if inc.cls.signals["overturned"] == NoHealthyStateError.__name__ else Step.ACT

    def record(self, chain: IncidentChain, inc: Incident) -> List[Dict[str, Any]]:
        chain.recoveries += 1
        chain.iterations_lost += inc.lost
        restored = None if inc.restored is None else {"source": inc.restored.source,
                                                      "iteration": inc.restored.iteration}
        if restored and inc.temporal:
            restored["temporal_reset"] = inc.temporal
        chain.policy.record(inc.cls, inc.iteration, None if inc.restored is None else inc.restored.iteration)
        records = [chain._base(inc, Event.DIVERGENCE, inc.changes, restored_from=restored, iterations_lost=inc.lost)]
        where = ("no rollback (the state is finite on every rank: the bad batch is skipped)"
                 if chain.policy.rolls_back(inc.cls, chain.io) else "no rollback (disabled)")
        _log_recovery(chain.io, inc, f"recovery {chain.recoveries}/{chain.config.max_recoveries}", where)
        return records


class _Stall(_Kind):
    """A static loss scale skipping every step: the stall's remedies (none answering: a divergence from here)."""

    def diagnose(self, chain: IncidentChain, inc: Incident, fp16: bool) -> None:
        chain.skipped_steps += 1

    def act(self, chain: IncidentChain, inc: Incident) -> Step:
        inc.changes = list(chain.policy.event(When.STALLED, chain.io, iteration=inc.iteration).changes)
        if inc.changes:
            chain.note(inc.iteration, inc.changes)
            return Step.RESTORE
        # No remedy could answer the stall: a divergence, from its first step.
        inc.entry, inc.mine, inc.local = Entry.DIVERGENCE, {}, None
        inc.decision = Decision(Verdict.DIVERGED, inc.decision.reason + "; no scale remedy available")
        return Step.DIAGNOSE

    def record(self, chain: IncidentChain, inc: Incident) -> List[Dict[str, Any]]:
        chain.stalls += 1
        chain.io.log(f"NanGuard: static loss scale stalled training at iter {inc.iteration} "
                     f"({inc.decision.reason}); " + "; ".join(f"{c.target}: {c.old} -> {c.new}"
                                                               for c in inc.changes), "warning")
        return [chain._base(inc, Event.STALLED, inc.changes)]


class _Skip(_Kind):
    """A step that went wrong without diverging: recorded, its samples named by evidence only."""

    def diagnose(self, chain: IncidentChain, inc: Incident, fp16: bool) -> None:
        found = chain.evidence.skipped(inc.kind, fp16)
        inc.mine = {"named": found["named"], "listed": found["listed"]}
        if found["isolation"] is not None:
            inc.diagnosis = {"isolation": found["isolation"]}

    def classify(self, chain: IncidentChain, inc: Incident) -> Optional[Classification]:
        named = inc.mine["named"]
        return Classification(Cause.DATA, f"evidence names {len(named)} sample(s) of the batch",
                              signals={"iteration": inc.iteration}) if named else None

    def act(self, chain: IncidentChain, inc: Incident) -> Step:
        samples = _bare(inc.agreed.samples)
        if not samples or inc.kind == "nonfinite_loss":
            return Step.RESTORE
        base = inc.agreed.cls or Classification(Cause.DATA, "evidence names samples of the batch")
        outcome = chain.policy.event(When.SKIPPED, chain.io, base, samples=samples, iteration=inc.iteration,
                                     epoch=inc.data_epoch)
        inc.changes = list(outcome.changes)
        inc.cls = outcome.applied_to(base)
        if _bad_data(inc.cls) is not None:
            inc.cls = inc.cls.but(evidence=outcome.evidence.lstrip("; "))
            inc.decision = Decision(Verdict.DIVERGED, "refused bad samples broke the run again")
            _bad_data_stop(inc)
            return Step.VERIFY
        chain.note(inc.iteration, inc.changes)
        return Step.RESTORE

    def record(self, chain: IncidentChain, inc: Incident) -> List[Dict[str, Any]]:
        scaled, skipped = inc.signals.scale_mode != "none", inc.kind in ("overflow", "skip")
        chain.skipped_steps += skipped
        chain.fp32_skips += inc.kind == "skip" and not scaled
        listed = list(inc.agreed.listed) or None
        chain.io.log(_skip_line(inc, listed), "info" if inc.kind == "overflow" else "warning")
        # The skip's record holds what the evidence showed; what the remedies did with it is the recurring record's.
        records = [] if inc.kind == "overflow" else [
            chain._base(inc, Event.SKIP if skipped else Event.NONFINITE_LOSS, [], batch=listed, cls=inc.agreed.cls)]
        verdict = inc.cls.samples if inc.cls is not None else None
        if verdict is not None and verdict.recurring:
            records.append(chain._base(inc, Event.RECURRING_SAMPLE, inc.changes, batch=list(verdict.recurring),
                                       quarantined=bool(verdict.quarantined),
                                       decision=Decision(Verdict.OVERFLOW, verdict.reason)))
        return records

    def stopped_on(self, inc: Incident) -> Optional[List[Dict[str, Any]]]:
        return list(_bad_data(inc.cls) or []) if inc.cls else None


#: Each entry type's steps (:class:`_Kind`).
_KINDS: Dict[Entry, _Kind] = {Entry.DIVERGENCE: _Divergence(), Entry.STALL: _Stall(), Entry.SKIP: _Skip()}


#: The stops whose verdict must hold on the run's start state first (:meth:`IncidentChain._verify`).
_RECHECKED = (StructuralDivergence, BadDataError, NoHealthyStateError)


def _looked_at(cls: Classification) -> Cause:
    """Whose row says where to look when ``cls`` stops the run: the dynamics ladder spent points at the rate, not at
    what every batch goes through."""
    return Cause.DYNAMICS if cls.signals.get("spent") == "ladder" else Cause.STRUCTURAL


def _bad_data(cls: Optional[Classification]) -> Optional[Tuple[Dict[str, Any], ...]]:
    """The samples the run stops on as bad data (None: no such verdict): what the remedies' :class:`SampleVerdict`
    says."""
    return cls.samples.bad_data if cls is not None and cls.samples is not None else None


def _bad_data_stop(inc: Incident) -> None:
    inc.stop = (BadDataError, f"a data problem, not a bug: {inc.cls.evidence}. {bad_data_advice(_bad_data(inc.cls))}")


def _bare(samples: Any) -> List[Dict[str, Any]]:
    """Samples as remedies take them: without the record's ``evidence`` tag."""
    return [{k: v for k, v in s.items() if k != "evidence"} for s in samples]


def _recurrence(agreed: Classification, history: Any, ranks: int, iteration: int) -> Classification:
    """The agreed class after the back-to-back data rule, which makes a run structural only when every rank's batch
    broke: bad samples on one rank of many (a corrupt scene) are data however often they come; a bug breaks every
    rank's batches."""
    everywhere = len(agreed.ranks) >= ranks and all(r == Cause.DATA.value for r in agreed.ranks.values())
    c = recurring(agreed, history, iteration) if everywhere or not agreed.ranks else agreed
    return c if "iteration" in c.signals else c.with_signals(iteration=iteration)


def _skip_line(inc: Incident, listed: Optional[List[Dict[str, Any]]]) -> str:
    """The log line of a step that went wrong without diverging."""
    if inc.kind == "overflow":
        scale = "" if inc.signals.loss_scale is None else f", loss scale now {inc.signals.loss_scale:g}"
        # A dynamic scale's overflow is its calibration; a static scale never backs off, so there a skipped step is a
        # step lost (a bad sample whose loss the model's nan_to_num kept finite looks the same): not called harmless.
        what = "harmless overflow" if inc.signals.scale_mode == "dynamic" else "gradient overflow under a static scale"
        return f"NanGuard: {what} at iter {inc.iteration}: step skipped{scale} ({inc.decision.reason})"
    what = ("fp16 step skipped by the loss scaler: the forward itself is non-finite" if inc.signals.scale_mode != "none"
            else "fp32 step skipped before the optimizer applied it" if inc.kind == "skip" else
            "non-finite loss, step applied")
    return (f"NanGuard: {what} at iter {inc.iteration} ({inc.decision.reason})"
            + (f"; samples: {short_samples(listed)}" if listed else ""))


def _log_recovery(io: GuardIO, inc: Incident, budget: str, unrolled: str) -> None:
    """The log lines of a recovered divergence: class, evidence, restore, every change and sample quarantined."""
    where = (f"rolled back to iter {inc.restored.iteration} from {inc.restored.source}, {inc.lost} iteration(s) lost"
             if inc.restored is not None else unrolled)
    c = inc.cls
    io.log(f"NanGuard: divergence at iter {inc.iteration} ({inc.decision.reason}); cause: {c.cause.value} "
           f"({c.evidence}); {budget}: {where}; {len(inc.changes)} setting(s) changed", "warning")
    for change in inc.changes:
        io.log(f"NanGuard:   {change.target}: {change.old} -> {change.new}", "warning")
    for sample in (c.samples.quarantined if c.samples is not None else ()):
        io.log("NanGuard:   quarantined: " + ", ".join(f"{k}={v}" for k, v in sample.items() if k != "evidence"),
               "warning")
    if inc.restored is not None:
        io.log(f"NanGuard: the iteration counter restarts at {inc.restored.iteration + 1}; checkpoints of the "
               "replayed iterations will be written again", "warning")
