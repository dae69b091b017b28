"""The per-step watch: reads every iteration, agrees on a verdict across ranks, keeps snapshots, hands divergences on.

The driver (:mod:`~petr_stability.adapters.driver`) calls :meth:`NanGuard.after_iter` once per training iteration,
at the same hook point where snapshots are both taken and restored: whatever the runner does after that point
(scheduler steps, counter increments, checkpoint saves) then runs the same way after a restore as it did after
the capture, so counters, LR and schedulers stay consistent without special cases. Iterations are numbered as
:mod:`~petr_stability.core.port` states once: 1-based, and a state "at N" is the state after N iterations.

Every incident goes to :class:`~petr_stability.core.recovery.chain.IncidentChain`, one path for all: a confirmed
divergence, a stalled static scale, and a step that went wrong without diverging (an fp16 overflow, a skipped step, a
non-finite loss) are its entry points, and it returns their records. Remedies are reached through the events the
policy fires (:class:`~petr_stability.core.recovery.policy.CausePolicy`): the watch only watches.
"""
import math
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from ..configfix.patch import ConfigFix
from . import distributed
from .batches import BatchWatch
from .config import GuardConfig
from .port import GuardIO, StepReading
from .records import IncidentLog
from .recovery.chain import Entry, Incident, IncidentChain
from .recovery.policy import CausePolicy
from .recovery.restore import RestorePoints
from .recovery.snapshot import Snapshot
from .remedies.base import Remedy, When
from .watch.agreement import StepAgreement
from .watch.detector import Decision, DivergenceDetector, StepSignals, Verdict
from .watch.health import HealthChecks
from .watch.replicas import ReplicaCheck
from .watch.spikes import GradNormMonitor, StabilityWatch

__all__ = ["NanGuard", "HealthyPath", "skip_kind", "publish"]


class _Step(NamedTuple):
    """What acting on one step's verdict needs, kept while its verdict is agreed (one iteration later under a process
    group: docs/distributed.md, "Agreeing off the critical path")."""

    signals: StepSignals
    decision: Decision
    reading: StepReading
    snapshot_due: bool
    epoch: int
    #: Taken at the step's own iteration while its verdict is agreed; enters the ring only if that verdict is healthy.
    snapshot: Optional[Snapshot] = None


def skip_kind(signals: StepSignals) -> str:
    """An agreed OVERFLOW verdict: an ordinary fp16 overflow (the scale's doing: its loss is finite), a skipped step
    (fp16 whose forward itself is non-finite, or fp32 dropped by the guard), or a non-finite fp32 loss whose finite
    gradients were applied."""
    if signals.scale_mode != "none" and (signals.loss is None or math.isfinite(signals.loss)):
        return "overflow"
    return "skip" if signals.scale_mode != "none" or signals.step_applied is False else "nonfinite_loss"


def _chain_counter(name: str, doc: str) -> property:
    """A read-only property of the guard: the incident chain's counter ``name`` (the chain keeps and saves it)."""
    return property(lambda guard: getattr(guard.chain, name), doc=doc)


def _judged(stability: StabilityWatch, signals: StepSignals, decision: Decision) -> Decision:
    """A step the detector calls healthy, judged against the run's stable band (watch/spikes.py)."""
    if decision.verdict != Verdict.HEALTHY or not signals.stepped:
        return decision
    why = stability.judge(signals.loss, signals.grad_norm)
    return decision if why is None else Decision(Verdict.UNSTABLE, why)


class HealthyPath:
    """What the run keeps from its healthy steps: the restore points (a snapshot of the first healthy step, then every
    ``snapshot_interval`` iterations, one where trouble starts, one ahead of a verdict still being agreed), their
    confirmation by stable steps, the stable band and the grad_norm early warning, the remedies' healthy event, and the
    chain closing once a recovery held.

    Args:
        config: the settings.
        io: the runner adapter.
        points: the run's restore points.
        policy: the remedies' policy (their restore tags, their healthy event).
        chain: the incident chain (its generation counter; it closes on a confirmed state).
    """

    def __init__(self, config: GuardConfig, io: GuardIO, points: RestorePoints, policy: CausePolicy,
                 chain: IncidentChain) -> None:
        self.config, self.io, self.points, self.policy, self.chain = config, io, points, policy, chain
        self.spikes = GradNormMonitor(config.spike_window, config.spike_z, config.spike_warmup)
        #: Healthy means stable: an applied step whose loss or grad_norm leaves the run's band confirms no snapshot.
        self.stability = StabilityWatch(config.stability_window, config.stability_z, config.stability_ratio,
                                        config.stability_warmup)

    def due(self, stepped: bool, iteration: int) -> bool:
        """Whether this step's state is snapshotted: the first healthy step of a run (or after the ring was emptied)
        at once, so a state to return to exists as early as possible; then every ``snapshot_interval`` iterations."""
        return stepped and (len(self.points.ring) == 0 or iteration % self.config.snapshot_interval == 0)

    def judged(self, step: "_Step") -> "_Step":
        """The step with its trouble snapshot where a streak of skipped steps starts: the first skipped step left the
        last applied step's weights, checked finite (not inside a loss explosion: the state before the streak is on
        its path then, no restore point)."""
        if step.decision.streak_start and step.signals.weights_finite is True and self.stability.trouble_since is None:
            return step._replace(snapshot=self.ahead(step.signals.iteration, step.epoch, at_trouble=True))
        return step

    def ahead(self, iteration: int, epoch: int, at_trouble: bool = False) -> Snapshot:
        """The snapshot of a step whose verdict is still being agreed (or where trouble starts), taken now (the state
        moves on). It reuses the buffers of the ring's next evictable snapshot, which leaves the ring now on every
        rank alike (no more host memory), and it enters the ring once the step's agreed verdict allows (a state of a
        path that diverged never does)."""
        snap = self._take(iteration, epoch, at_trouble)
        self.points.ring.add(snap)  # evicts the snapshot whose buffers it reused, as every add does...
        self.points.ring.snapshots.remove(snap)  # ...and waits outside the ring for its verdict
        return snap

    def step(self, signals: StepSignals, stable: bool, why: str, snapshot_due: bool,
             taken: Optional[Snapshot] = None) -> None:
        """An applied step agreed healthy (``stable``) or out of the band."""
        iteration = signals.iteration
        if signals.grad_norm is not None:  # from the host float the runner logged: no device read
            warning = self.spikes.observe(signals.grad_norm, iteration)
            if warning:
                self.io.log(f"NanGuard: early warning: {warning}", "warning")
        if self.stability.update(signals.loss, signals.grad_norm, not stable, iteration):
            self.io.log(f"NanGuard: trouble at iter {iteration}: {why}; no snapshot is confirmed until "
                        f"{self.config.confirm_steps} stable steps in a row follow it", "warning")
        self.points.ring.trouble_since = self.stability.trouble_since
        self.points.ring.tick(stable)
        if stable:
            self.policy.on_healthy(self.io, self.spikes, iteration)
            self.chain.close_if_held()
        if taken is not None:  # taken at its own iteration, its verdict agreed healthy since
            self.points.ring.add(taken)
        elif snapshot_due:
            _, epoch = self.io.completed(inside=True)
            self.points.ring.add(self._take(iteration, epoch))

    def _take(self, iteration: int, epoch: int, at_trouble: bool = False) -> Snapshot:
        """A snapshot for the ring, into the buffers of its next evictable one, tagged with the remedies' state."""
        return self.points.take(iteration, epoch, recycle=True, generation=self.chain.recoveries,
                                tags=self.policy.tags(), at_trouble=at_trouble)


class NanGuard:
    """Watches every step; a confirmed divergence goes to the incident chain.

    Args:
        config: the settings.
        io: the runner adapter.
    """

    def __init__(self, config: GuardConfig, io: GuardIO) -> None:
        self.config = config
        self.io = io
        self.detector = DivergenceDetector(config.detector)
        self.incidents = IncidentLog(io.work_dir, enabled=distributed.get_rank() == 0)
        self.policy = CausePolicy(config)
        self.points = RestorePoints(io, config.keep_snapshots, config.confirm_steps,
                                    config.restore_from_checkpoints, config.snapshot_copies == "node",
                                    self.policy.remedies.tags_in)
        self.batches = BatchWatch(io)
        self.chain = IncidentChain(config, io, self.points, self.policy, self.batches, self.incidents.path)
        #: The healthy steps' job: restore points, their confirmation, the stable band, the early warning.
        self.healthy = HealthyPath(config, io, self.points, self.policy, self.chain)
        self.spikes, self.stability = self.healthy.spikes, self.healthy.stability
        #: Each step's verdict agreed across ranks: under a process group one iteration later, off the critical path.
        self.agreement = StepAgreement()
        #: The health checks each step gets (what holds -inf/+inf by design as the run starts is no incident).
        self.checks = HealthChecks(io.model())
        #: Data-parallel replicas compared every replica_check_interval iterations (read one iteration later; never
        #: without a process group of two ranks or more: only plain attributes of it are read then).
        self.replicas = ReplicaCheck(config.replica_check_interval, config.max_recoveries, self.incidents.path)
        #: Every record written since the driver last took them (:meth:`take_records`), on every rank.
        self.records: List[Dict[str, Any]] = []

    def remedy(self, name: str) -> Remedy:
        """The run's remedy called ``name``: ``guard.remedy('quarantine').skip_list``,
        ``guard.remedy('lr').lr_factor``."""
        return self.policy.remedy(name)

    recoveries = _chain_counter("recoveries", "Rollbacks (or no-rollback recoveries) so far in the run.")
    stalls = _chain_counter("stalls", "Stalled static scales made dynamic so far.")
    skipped_steps = _chain_counter("skipped_steps", "Steps skipped so far (by a loss scaler, or by the guard in fp32).")
    fp32_skips = _chain_counter("fp32_skips", "fp32 steps the guard skipped so far.")

    @property
    def run_id(self) -> str:
        """Names this run in every checkpoint it saves."""
        return self.points.run_id

    # ------------------------------------------------------------------ setup and persistence
    def setup(self) -> None:
        """Re-applies what a resumed state recorded and what the patched config carries (call once the runner's
        objects exist)."""
        self.policy.start(self.io)
        self._publish()

    def attach_data(self) -> None:
        """As an epoch or an iteration starts: the sample tracker (and what the remedies keep out of the loader, the
        quarantine) go into the training loader once it exists."""
        if not self.batches.attached and self.io.train_loader() is not None:
            self.batches.attach(self.policy.attach(self.io), self.io.log)

    def begin(self, batch: Any, rng: Optional[Dict[str, Any]]) -> None:
        """As an iteration starts: its batch (a reference) and RNG state (a host copy), for a diagnosis."""
        self.attach_data()
        self.batches.begin(batch, rng)

    def capture_start(self) -> None:
        """Keeps the state the run starts from (before its first step, or right after resume): a restore point
        that exists before any snapshot is confirmed. Costs one snapshot of host memory."""
        iteration, epoch = self.io.completed(inside=False)
        self.checks.capture_design(self.io.model())  # the run's start state (a resumed one included)
        self.points.start = self.points.take(iteration, epoch, recycle=False, generation=self.recoveries,
                                             tags=self.policy.tags())
        if distributed.get_world_size() > 1:  # every rank: one comparison of the copies the run starts from
            self.replicas.start(self.io, iteration)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "version": 2,
            "run_id": self.points.run_id,
            **self.chain.state_dict(),
            **self.policy.state_dict(),
            "detector": self.detector.state_dict(),
            "spikes": self.spikes.state_dict(),
            "stability": self.stability.state_dict(),
            "replicas": dict(self.replicas.counts),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.points.run_id = str(state.get("run_id", self.points.run_id))
        self.chain.load_state_dict(state)
        self.policy.load_state_dict(state)
        self.detector.load_state_dict(state.get("detector", {}))
        self.spikes.load_state_dict(state.get("spikes", {}))
        self.stability.load_state_dict(state.get("stability", {}))
        self.points.ring.trouble_since = self.stability.trouble_since
        self.replicas.load_state_dict(state.get("replicas", {}))

    def summary(self) -> Dict[str, Any]:
        """What the guard did so far in this run, for reports, the demo and the patched config (JSON-ready; the
        incident log has the details): counts, the settings the remedies put in force (each remedy's
        :meth:`~.remedies.base.Remedy.summary`) and the ladder's rungs that held."""
        return {"recoveries": self.recoveries, "stalls": self.stalls, "iterations_lost": self.chain.iterations_lost,
                "skipped_steps": self.skipped_steps, **self.policy.summary(self.io)}

    def config_fix(self) -> ConfigFix:
        """What a config must change to start where the live run stands (:meth:`~.recovery.policy.CausePolicy.
        config_fix`)."""
        return self.policy.config_fix(self.io)

    # ------------------------------------------------------------------ the per-iteration path
    def after_iter(self) -> Decision:
        """Runs once per training iteration, after the optimizer step; returns the agreed decision it acted on. Under
        a process group that is mostly the previous step's, this one's being agreed meanwhile (docs/distributed.md,
        "Agreeing off the critical path"); this rank's own decision where none came."""
        iteration, epoch = self.io.completed(inside=True)
        reading = self.io.read_step()
        signals = StepSignals(iteration, reading.stepped, reading.grad_norm, reading.loss, None, self.io.scale_mode())
        if reading.skipped_by_guard:
            signals.step_applied = False
        snapshot_due = self.healthy.due(reading.stepped, iteration)
        self._check(signals, snapshot_due)
        judged = _judged(self.stability, signals, self.detector.observe(signals))
        step = self.healthy.judged(_Step(signals, judged, reading, snapshot_due, epoch))
        decision, rolled_back = self._act_on_pending(True) if self.agreement.pending else (step.decision, False)
        if self.replicas.pending is not None:  # a replica check issued at an earlier iteration
            step = self._read_replicas(True, step)
        if rolled_back:
            pass  # this iteration belongs to the abandoned path: its verdict is never sent
        elif self.agreement.defers() and len(self.points.ring) > 0 and not self.io.verdict_due_now():
            if snapshot_due and step.snapshot is None:
                step = step._replace(snapshot=self.healthy.ahead(iteration, epoch))
            self.agreement.submit(step.decision.verdict, step)
            self.batches.hold()
        else:
            decision = self._act(self.agreement.now(step.decision.verdict), step, inside=True)
        if self.replicas.on and iteration % self.replicas.interval == 0 and self.io.completed(True)[0] == iteration:
            self.replicas.issue(self.io, signals, epoch, self.recoveries)  # not rolled back: read at the next one
        self._publish(signals.loss_scale)
        return decision

    def _act(self, agreed: Verdict, step: _Step, inside: bool) -> Decision:
        """Acts on a step's agreed verdict (this iteration's, or the previous one's under a process group)."""
        signals, decision, reading = step.signals, step.decision, step.reading
        if agreed != decision.verdict:
            decision = Decision(agreed, f"another rank reported {agreed.name} ({decision.reason or 'here: healthy'})")
        if agreed in (Verdict.HEALTHY, Verdict.UNSTABLE):
            if reading.stepped:
                self.healthy.step(signals, agreed == Verdict.HEALTHY, decision.reason, step.snapshot_due,
                                  step.snapshot)
        elif agreed == Verdict.OVERFLOW:
            if step.snapshot is not None and step.snapshot.at_trouble:
                self.points.ring.add(step.snapshot)  # where the trouble started: bad data's restore point
            self._run(self._incident(Entry.SKIP, signals, decision, inside, step.epoch, skip_kind(signals)))
        elif agreed == Verdict.STALLED:
            self._run(self._incident(Entry.STALL, signals, decision, inside, step.epoch))
        else:
            self._run(self._incident(Entry.DIVERGENCE, signals, decision, inside, step.epoch))
        # A step out of the stable band is no batch known to be good (the counterfactual's), though it trained.
        self.batches.end(signals.iteration, healthy=agreed == Verdict.HEALTHY and reading.stepped,
                         stepped=reading.stepped)
        return decision

    def _act_on_pending(self, inside: bool) -> Tuple[Decision, bool]:
        """Acts on the step whose verdict was being agreed, its batch back in hand meanwhile; returns the decision and
        whether it rolled back (the running iteration's batch is then abandoned with its path)."""
        counter = self.io.counter()
        running = self.batches.take_held()
        decision = self._act(*self.agreement.take(), inside=inside)
        if self.io.counter() != counter:
            return decision, True
        self.batches.put_back(running)
        return decision, False

    def settle(self, inside: bool) -> bool:
        """Acts on a step's verdict still being agreed, and reads a replica check still in flight (under a process
        group), before the guard works outside :meth:`after_iter` (an epoch's end, the end of training); every rank
        calls it at the same point. Returns whether that rolled the state back."""
        if not self.agreement.pending and self.replicas.pending is None:
            return False
        rolled_back = self.agreement.pending and self._act_on_pending(inside)[1]
        if self.replicas.pending is not None:
            self._read_replicas(inside)
        self._publish()
        return rolled_back

    def _read_replicas(self, inside: bool, step: Optional[_Step] = None) -> Optional[_Step]:
        """Reads the replica check in flight (every rank at the same point) and acts on it (watch/replicas.py): a drift
        is recorded and repaired, and no snapshot taken since every copy was last known the same stays a restore point
        (it may hold the drifted copy: docs/distributed.md, "Replicas that drift apart")."""
        outcome = self.replicas.conclude(self.io, self.io.completed(inside)[0], self.recoveries)
        self._emit(outcome.records)
        if outcome.error is not None:
            raise outcome.error
        if outcome.repaired:
            self.points.drop_after(outcome.clean_since)
            step = None if step is None else step._replace(snapshot=None)
        return step

    def _check(self, signals: StepSignals, snapshot_due: bool) -> None:
        """The health checks this step gets: at once when suspicious, on snapshot and save steps, then routinely."""
        full = signals.suspicious or snapshot_due or self.io.health_check_due()
        if signals.suspicious:
            signals.loss_scale = self.io.loss_scale()
        if full or signals.iteration % self.config.check_interval == 0:
            signals.weights_finite = self.checks.healthy(self.io.model(), self.io.optimizers() if full else None,
                                                         self.io.log)
        if signals.loss_scale is None and signals.weights_finite is not None:
            # A check already waited for the device here: publish the scale too, for the logs and the report.
            signals.loss_scale = self.io.loss_scale()

    # ------------------------------------------------------------------ recovery
    def _incident(self, entry: Entry, signals: StepSignals, decision: Decision, inside: bool,
                  epoch: Optional[int] = None, kind: str = "") -> Incident:
        # The step's own iteration and epoch; acted on now, at `acted_at` (one iteration later under a group).
        acted_at, now_epoch = self.io.completed(inside)
        signals.trouble_since = self.stability.trouble_since
        healthy = self.points.healthy()
        signals.unstable_since = self.stability.unstable_after(healthy.iteration if healthy is not None else -1)
        data_epoch = self.batches.epoch_of(signals.iteration) if entry == Entry.SKIP else None
        epoch = now_epoch if epoch is None else epoch
        return Incident(signals, decision, inside, signals.iteration, epoch, self.batches.batch, self.batches.rng,
                        list(self.checks.bad_attributes), entry=entry, kind=kind,
                        data_epoch=epoch if data_epoch is None else data_epoch, acted_at=acted_at)

    def _run(self, incident: Incident) -> Incident:
        """Runs an incident through the chain and writes its records (the error, if any, after them)."""
        incident = self.chain.run(incident)
        if incident.error is not None:  # the records first, then the error
            self._emit(incident.records)
            raise incident.error
        if incident.entry == Entry.SKIP:
            self._emit(incident.records)
            return incident
        self.detector.reset()
        if incident.entry == Entry.DIVERGENCE:
            self.io.read_step()  # forget the failed step's probe reading
            self.io.after_recovery(self.state_dict(), incident.inside)
        self._emit(incident.records)
        self.policy.event(When.HANDLED, self.io)
        return incident

    def recover_now(self, reason: str, inside: bool) -> None:
        """Runs the recovery path at once (a non-finite state found outside a step's own signals), after
        :meth:`settle`."""
        if self.settle(inside):  # that restored a healthy state: the state found non-finite is gone
            return
        iteration, _ = self.io.completed(inside)
        self._run(self._incident(Entry.DIVERGENCE, StepSignals(iteration, weights_finite=False),
                                 Decision(Verdict.DIVERGED, reason), inside))
        self._publish()

    def all_ranks_healthy(self, healthy_here: bool) -> bool:
        """Agrees across ranks on a health reading taken outside :meth:`after_iter`: a blocking all-reduce, once per
        epoch at most (the driver settles a verdict still being agreed first: :meth:`settle`)."""
        return distributed.reduce_max([0 if healthy_here else 1])[0] == 0

    # ------------------------------------------------------------------ records and scalars
    def _emit(self, records: List[Dict[str, Any]]) -> None:
        """Writes ``records`` and keeps them for the driver (the patched config follows an incident's)."""
        for record in records:
            self.incidents.write(record)
            self.records.append(record)

    def take_records(self) -> List[Dict[str, Any]]:
        """The records written since the last call (the driver writes the patched config after an incident's)."""
        records, self.records = self.records, []
        return records

    def _publish(self, loss_scale: Optional[float] = None) -> None:
        publish(self.io, self.incidents, self.recoveries + self.stalls, self.skipped_steps,
                self.chain.iterations_lost, loss_scale)


def publish(io: GuardIO, incidents: IncidentLog, count: int, skipped: int, lost: int,
            loss_scale: Optional[float]) -> None:
    """The guard's scalars (each its latest value, at the iterations run: the runner's counter plus ``lost``) and
    each new incident as a text event at the iteration it happened."""
    scalars: Dict[str, float] = {"nan_guard/incidents": float(count), "nan_guard/skipped_steps": float(skipped)}
    # Finite values only: the observing clip's inf is no bound, and a dashboard's JSON has no Infinity.
    norms = [clip.max_norm for clip in io.clip_settings() if clip.kind == "norm"]
    if norms and math.isfinite(min(norms)):
        scalars["nan_guard/max_norm"] = min(norms)
    if loss_scale is not None and math.isfinite(loss_scale):  # fp16 only: fp32 has no loss scale
        scalars["nan_guard/loss_scale"] = loss_scale
    io.update_scalars(scalars, lost)
    for record in incidents.take_unshown():  # at the iterations run when it happened
        step = record["iteration"] + lost - int(record.get("iterations_lost") or 0)
        io.add_text("nan_guard/incident", incidents.describe(record), step)
