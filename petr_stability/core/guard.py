"""The per-step watch: reads every iteration, agrees on a verdict across ranks, keeps snapshots, hands divergences on.

The driver (:mod:`~petr_stability.adapters.driver`) calls :meth:`NanGuard.after_iter` once per training iteration,
at the same hook point where snapshots are both taken and restored: whatever the runner does after that point
(scheduler steps, counter increments, checkpoint saves) then runs the same way after a restore as it did after
the capture, so counters, LR and schedulers stay consistent without special cases. Iterations are numbered as
:mod:`~petr_stability.core.port` states once: 1-based, and a state "at N" is the state after N iterations.

A confirmed divergence goes to :class:`~petr_stability.core.recovery.chain.IncidentChain`, which owns recovery.
"""
import math
from typing import Any, Callable, Dict, List, Optional

from . import distributed
from .batches import BatchWatch
from .config import GuardConfig
from .port import GuardIO
from .records import Event, IncidentLog, step_record
from .recovery.chain import Incident, IncidentChain
from .recovery.policy import CausePolicy
from .recovery.restore import RestorePoints
from .samples import indices_of
from .watch.detector import Decision, DivergenceDetector, StepSignals, Verdict
from .watch.health import nonfinite_attributes, state_finite
from .watch.spikes import GradNormMonitor

__all__ = ["NanGuard"]


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
        self.points = RestorePoints(io, config.keep_snapshots, config.confirm_steps,
                                    config.restore_from_checkpoints, config.snapshot_copies == "node")
        self.policy = CausePolicy(config)
        self.batches = BatchWatch(io)
        self.chain = IncidentChain(config, io, self.points, self.policy, self.batches, self._emit, self._recovered,
                                   self.incidents.path)
        self.spikes = GradNormMonitor(config.spike_window, config.spike_z, config.spike_warmup)
        self.stalls = 0
        self.skipped_steps = 0
        self.fp32_skips = 0
        self.scale_made_dynamic = False
        #: The configured max_norm per clip setting (lowered by remedies): adaptive clipping never goes above it.
        self._clip_base: Dict[str, float] = {}
        self._bad_attributes: List[str] = []
        #: Called on every rank with each incident record after it was written (the driver writes the patched
        #: config there).
        self.listeners: List[Callable[[Dict[str, Any]], None]] = []

    @property
    def recoveries(self) -> int:
        """Rollbacks (or no-rollback recoveries) so far in the run."""
        return self.chain.recoveries

    @property
    def run_id(self) -> str:
        """Names this run in every checkpoint it saves."""
        return self.points.run_id

    # ------------------------------------------------------------------ setup and persistence
    def setup(self) -> None:
        """Re-applies remedies recorded in a resumed state (call once the runner's objects exist)."""
        self.policy.setup(self.io)
        if self.scale_made_dynamic:
            self.io.restore_scale_mode()
        self._clip_base = {c.name: c.max_norm for c in self.io.clip_settings() if c.kind == "norm"}
        self._publish()

    def attach_data(self) -> None:
        """As an epoch or an iteration starts: the sample tracker (and quarantine) go into the training loader once
        it exists."""
        if not self.batches.attached and self.io.train_loader() is not None:
            self.batches.attach(self.policy.skip_list(self.io), self.io.log)

    def begin(self, batch: Any, rng: Optional[Dict[str, Any]]) -> None:
        """As an iteration starts: its batch (a reference) and RNG state (a host copy), for a diagnosis."""
        self.attach_data()
        self.batches.begin(batch, rng)

    def capture_start(self) -> None:
        """Keeps the state the run starts from (before its first step, or right after resume): a restore point
        that exists before any snapshot is confirmed. Costs one snapshot of host memory."""
        iteration, epoch = self.io.completed(inside=False)
        self.points.start = self.points.take(iteration, epoch, recycle=False, generation=self.recoveries,
                                             lr_factor=self.policy.lr_factor)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "version": 2,
            "run_id": self.points.run_id,
            **self.chain.state_dict(),
            "stalls": self.stalls,
            "skipped_steps": self.skipped_steps,
            "fp32_skips": self.fp32_skips,
            "dropout_zeroed": self.policy.dropout_zeroed,
            "scale_made_dynamic": self.scale_made_dynamic,
            "clip": dict(self.policy.clip_state),
            "detector": self.detector.state_dict(),
            "policy": self.policy.state_dict(),
            "spikes": self.spikes.state_dict(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.points.run_id = str(state.get("run_id", self.points.run_id))
        self.chain.load_state_dict(state)
        self.stalls = int(state.get("stalls", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.fp32_skips = int(state.get("fp32_skips", 0))
        self.policy.dropout_zeroed = bool(state.get("dropout_zeroed", False))
        self.scale_made_dynamic = bool(state.get("scale_made_dynamic", False))
        self.policy.clip_state = {str(k): float(v) for k, v in dict(state.get("clip", {})).items()}
        self.detector.load_state_dict(state.get("detector", {}))
        self.policy.load_state_dict(state.get("policy", {}))
        self.spikes.load_state_dict(state.get("spikes", {}))

    def summary(self) -> Dict[str, Any]:
        """What the guard did so far in this run, for reports, the demo and the patched config (JSON-ready; the
        incident log has the details): counts, the settings in force (``max_norm`` the known manual fix set or None,
        ``dropout_zeroed``, ``lr_factor``, ``scale_made_dynamic``, ``fp32_modules`` as name -> class, the
        ``quarantined`` dataset indices) and the ladder's rungs that held."""
        skip, model, clip = self.policy.skip, self.io.model(), self.policy.clip_state
        return {"recoveries": self.recoveries, "stalls": self.stalls, "iterations_lost": self.chain.iterations_lost,
                "skipped_steps": self.skipped_steps, "max_norm": min(clip.values()) if clip else None,
                "dropout_zeroed": self.policy.dropout_zeroed, "lr_factor": self.policy.lr_factor,
                "scale_made_dynamic": self.scale_made_dynamic,
                "fp32_modules": {m: type(model if m == "(model)" else model.get_submodule(m)).__name__
                                 for m in self.policy.fp32},
                "quarantined": [] if skip is None else list(skip),
                "held": [i["held"]["rung"] for i in self.policy.history.incidents
                         if (i.get("held") or {}).get("rung")]}

    # ------------------------------------------------------------------ the per-iteration path
    def after_iter(self) -> Decision:
        """Runs once per training iteration, after the optimizer step; returns the agreed decision."""
        iteration, _ = self.io.completed(inside=True)
        reading = self.io.read_step()
        signals = StepSignals(iteration, reading.stepped, reading.grad_norm, reading.loss, None, self.io.scale_mode())
        if reading.skipped_by_guard:
            signals.step_applied = False
        # The first healthy step of a run (or after the ring was emptied) is snapshotted at once, so a state to
        # return to exists as early as possible; then every snapshot_interval iterations.
        snapshot_due = reading.stepped and (len(self.points.ring) == 0
                                            or iteration % self.config.snapshot_interval == 0)
        self._check(signals, snapshot_due)
        decision = self.detector.observe(signals)
        agreed = Verdict(distributed.reduce_max([int(decision.verdict)])[0])
        if agreed != decision.verdict:
            decision = Decision(agreed, f"another rank reported {agreed.name} ({decision.reason or 'here: healthy'})")
        if agreed == Verdict.HEALTHY:
            if reading.stepped:
                self._on_healthy(reading.grad_norm, iteration, snapshot_due)
        elif agreed == Verdict.OVERFLOW:
            self._on_overflow(signals, decision)
        elif agreed == Verdict.STALLED:
            self.skipped_steps += 1
            self._on_stall(signals, decision)
        else:
            self._recover(signals, decision, inside=True)
        self.batches.end(iteration, healthy=agreed == Verdict.HEALTHY and reading.stepped)
        self._publish(signals.loss_scale)
        return decision

    def _check(self, signals: StepSignals, snapshot_due: bool) -> None:
        """The health checks this step gets: at once when suspicious, on snapshot and save steps, then routinely."""
        if signals.suspicious:
            signals.loss_scale = self.io.loss_scale()
            signals.weights_finite = self._healthy(optimizer=True)
        elif snapshot_due or self.io.health_check_due():
            signals.weights_finite = self._healthy(optimizer=True)
        elif signals.iteration % self.config.check_interval == 0:
            signals.weights_finite = self._healthy(optimizer=False)
        if signals.loss_scale is None and signals.weights_finite is not None:
            # A check already waited for the device here: publish the scale too, for the logs and the report.
            signals.loss_scale = self.io.loss_scale()

    def _on_healthy(self, grad_norm: Optional[float], iteration: int, snapshot_due: bool) -> None:
        self._watch_grad_norm(grad_norm, iteration)
        self.points.ring.tick()
        self.chain.close_if_held()
        if snapshot_due:
            _, epoch = self.io.completed(inside=True)
            self.points.ring.add(self.points.take(iteration, epoch, recycle=True, generation=self.recoveries,
                                                  lr_factor=self.policy.lr_factor))

    def _watch_grad_norm(self, grad_norm: Optional[float], iteration: int) -> None:
        # The early warning and the adaptive clip read the host float the runner logged: no device read.
        if grad_norm is None:
            return
        warning = self.spikes.observe(grad_norm, iteration)
        if warning:
            self.io.log(f"NanGuard: early warning: {warning}", "warning")
        if self.config.adaptive_clip and self.spikes.ready:
            for clip in self.io.clip_settings():
                base = self._clip_base.get(clip.name)
                if clip.kind == "norm" and base is not None:
                    clip.set_max_norm(self.spikes.clip_bound(base))

    def _on_overflow(self, signals: StepSignals, decision: Decision) -> None:
        scaled = signals.scale_mode != "none"
        if scaled and (signals.loss is None or math.isfinite(signals.loss)):
            self.skipped_steps += 1
            scale = "" if signals.loss_scale is None else f", loss scale now {signals.loss_scale:g}"
            self.io.log(f"NanGuard: harmless overflow at iter {signals.iteration}: step skipped{scale} "
                        f"({decision.reason})")
            # Ordinary overflows are the scale's doing: only samples whose own values overflow fp16 are blamed.
            self._learn(signals, self.batches.blame_flagged())
            return
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
        self.incidents.write(self._step_record(Event.SKIP if skipped else Event.NONFINITE_LOSS, signals, decision,
                                               batch=named or None))
        self.io.log(f"NanGuard: {what} at iter {signals.iteration} ({decision.reason})"
                    + (f"; samples: {_short_samples(named)}" if named else ""), "warning")
        if skipped:
            self._learn(signals, named)

    def _learn(self, signals: StepSignals, named: List[Dict[str, Any]]) -> None:
        """Samples that made steps go wrong in two different epochs are named and quarantined (the same list on
        every rank, so every rank decides the same)."""
        if not named:
            return
        indices = indices_of(named, self.io.dataset())
        recurring = self.policy.sighted(indices, self.batches.epoch_of(signals.iteration))
        if not recurring:
            return
        changes, why = self.policy.quarantine_recurring(self.io, recurring, signals.iteration)
        samples = [s for s in named if s.get("index") in recurring] or [{"index": i} for i in recurring]
        epochs = sorted({e for i in recurring for e in self.policy.sightings.get(i, [])})
        reason = f"made steps go wrong in epochs {epochs}" + ("" if changes else f"; not quarantined: {why}")
        self.io.log(f"NanGuard: sample(s) {_short_samples(samples)} {reason}"
                    + ("; quarantined for the rest of the run" if changes else ""), "warning")
        self._emit(self._step_record(Event.RECURRING_SAMPLE, signals, Decision(Verdict.OVERFLOW, reason), changes,
                                     batch=samples, quarantined=bool(changes)))

    def _on_stall(self, signals: StepSignals, decision: Decision) -> None:
        change = self.io.make_scale_dynamic() if "scale" in self.config.remedies else None
        if change is None:
            self._recover(signals, Decision(Verdict.DIVERGED, decision.reason + "; no scale remedy available"),
                          inside=True)
            return
        self.stalls += 1
        self.scale_made_dynamic = True
        self.detector.reset()
        self.chain.actions_tried.append(f"iter {signals.iteration}: {change.target} {change.old} -> {change.new}")
        self.io.log(f"NanGuard: static loss scale stalled training at iter {signals.iteration} ({decision.reason}); "
                    f"{change.target}: {change.old} -> {change.new}", "warning")
        self._emit(self._step_record(Event.STALLED, signals, decision, [change]))

    def _healthy(self, optimizer: bool) -> bool:
        model = self.io.model()
        if not state_finite(model, self.io.optimizers() if optimizer else ()):
            return False
        if optimizer:
            # Tensors modules hold as plain attributes (StreamPETR's memory queue): outside state_dict(), hidden by
            # PETR's nan_to_num, and carried into every later step. Checked with the full checks only (cheap).
            bad = nonfinite_attributes(model)
            self._bad_attributes = bad
            if bad:
                self.io.log(f"NanGuard: non-finite values in module attributes outside the state dict: "
                            f"{', '.join(bad[:5])}", "warning")
                return False
        return True

    # ------------------------------------------------------------------ recovery
    def _recover(self, signals: StepSignals, decision: Decision, inside: bool) -> None:
        iteration, epoch = self.io.completed(inside)
        self.chain.run(Incident(signals, decision, inside, iteration, epoch, self.batches.batch, self.batches.rng,
                                list(self._bad_attributes)))
        for name, value in self.policy.clip_state.items():
            self._clip_base[name] = min(self._clip_base.get(name, value), value)

    def _recovered(self, inside: bool) -> None:
        self.detector.reset()
        self.io.read_step()  # forget the failed step's probe reading
        self.io.after_recovery(self.state_dict(), inside)

    def recover_now(self, reason: str, inside: bool) -> None:
        """Runs the recovery path at once (a non-finite state found outside a step's own signals)."""
        iteration, _ = self.io.completed(inside)
        self._recover(StepSignals(iteration, weights_finite=False), Decision(Verdict.DIVERGED, reason), inside)
        self._publish()

    def all_ranks_healthy(self, healthy_here: bool) -> bool:
        """Agrees across ranks on a health reading taken outside :meth:`after_iter`."""
        return distributed.reduce_max([0 if healthy_here else 1])[0] == 0

    # ------------------------------------------------------------------ records and scalars
    def _step_record(self, event: Event, signals: StepSignals, decision: Decision, changes: List[Any] = (),
                     **fields: Any) -> Dict[str, Any]:
        extra = {"nonfinite_attributes": list(self._bad_attributes)} if self._bad_attributes else {}
        return step_record(event, signals, decision, list(changes), self.recoveries, self.config.max_recoveries,
                           distributed.get_world_size(), **extra, **fields)

    def _emit(self, record: Dict[str, Any]) -> None:
        self.incidents.write(record)
        for listener in self.listeners:
            listener(record)

    def _publish(self, loss_scale: Optional[float] = None) -> None:
        scalars: Dict[str, float] = {
            "nan_guard/incidents": float(self.recoveries + self.stalls),
            "nan_guard/skipped_steps": float(self.skipped_steps),
        }
        norms = [clip.max_norm for clip in self.io.clip_settings() if clip.kind == "norm"]
        if norms:
            scalars["nan_guard/max_norm"] = min(norms)
        if loss_scale is not None:
            scalars["nan_guard/loss_scale"] = loss_scale
        self.io.update_scalars(scalars)


def _short_samples(samples: List[Dict[str, Any]], limit: int = 4) -> str:
    shown = ", ".join(", ".join(f"{k}={v}" for k, v in s.items()).join("()") for s in samples[:limit])
    return shown + (f" and {len(samples) - limit} more" if len(samples) > limit else "")
