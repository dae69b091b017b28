"""The framework-free guard: per-step detection, remedies, snapshots, restore points, budget and incident log.

The driver (:mod:`~petr_stability.core.driver`) calls :meth:`NanGuard.after_iter` once per training iteration,
at the same hook point where snapshots are both taken and restored: whatever the runner does after that point
(scheduler steps, counter increments, checkpoint saves) then runs the same way after a restore as it did after
the capture, so counters, LR and schedulers stay consistent without special cases. Iterations are numbered as
:mod:`~petr_stability.core.port` states once: 1-based, and a state "at N" is the state after N iterations.
"""
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from . import distributed
from .causes import Cause, Classification, nonfinite_attributes
from .detector import Decision, DetectorConfig, DivergenceDetector, StepSignals, Verdict
from .diagnose import diagnose_step, summarize
from .errors import NanGuardGaveUp, NoHealthyStateError, StructuralDivergence, UnsafeCheckpointError
from .health import all_finite, first_nonfinite, state_finite
from .incidents import IncidentLog
from .policy import CausePolicy
from .port import GuardIO, Payload
from .quarantine import sample_ids
from .remedies import Change, zero_transformer_dropout
from .snapshot import Snapshot, SnapshotRing, copies_done, copy_to_host
from .spikes import GradNormMonitor
from .tree import iter_tensors, nbytes
from .validate import check_bool, check_choice, check_int, check_list, check_names, check_number

__all__ = ["GuardConfig", "GuardIO", "NanGuard", "REMEDIES", "RESTORE_ORDER"]

#: Remedy names accepted by ``remedies=`` (docs/how-it-works.md, "Cause-aware recovery").
REMEDIES = ("clip", "dropout", "rollback", "scale", "lr", "moments", "quarantine", "fp32", "temporal")

#: Where a rollback looks, in this order; each point is tried at most once per incident chain (until a state
#: taken after the latest recovery is confirmed). docs/how-it-works.md, "Restore points", says why.
RESTORE_ORDER = (
    "confirmed snapshots, newest first",
    "unconfirmed snapshots of this run, newest first",
    "the state the run started from (before its first step, or right after resume)",
    "this run's finite checkpoints, newest first",
)


@dataclass
class GuardConfig:
    """Every setting of the guard; defaults are sized for PETR on nuScenes-scale runs.

    Attributes:
        patience: K of :class:`~petr_stability.core.detector.DetectorConfig`. Defaults to 3.
        min_loss_scale: a dynamic loss scale below this is a divergence. Defaults to 1.0.
        static_patience: M, consecutive skipped steps under a static scale before it counts as stalled.
            Defaults to 5.
        check_interval: iterations between routine health checks of weights and buffers (one fused
            reduction and one host read; suspicious steps are checked at once anyway). BatchNorm statistics
            can turn NaN without any gradient showing it. Defaults to 50.
        diagnose: on a confirmed divergence, re-run the failing batch once with module hooks and name the first
            module that produced NaN/Inf (see docs/diagnosis.md); healthy steps only keep a reference to the batch
            and a host copy of the RNG state. Defaults to True.
        snapshot_interval: iterations between in-memory snapshots. PETR's ~1 s iterations make 200 about
            3 minutes of lost work at worst, against a checkpoint per epoch (~3500 iterations on nuScenes
            with batch 8). Defaults to 200.
        confirm_steps: W, clean steps after a snapshot before it counts as healthy. Defaults to 50.
        keep_snapshots: snapshots kept in host memory (>= 2). Three keep two confirmed states while a third
            is pending, so a recovery that fails again can step back once without touching the disk.
            Defaults to 3.
        max_recoveries: rollbacks allowed in a run before giving up with :class:`NanGuardGaveUp`.
            Defaults to 5.
        max_norm: target of the clip remedy, ``max_norm = min(current, target)``: the known manual fix's 1. Defaults
            to 1.0.
        max_norm_schedule: optional targets per incident (``[10, 3, 1]`` tightens step by step); the last one
            stays. Overrides ``max_norm``. Defaults to None.
        remedies: which of ``'clip'``, ``'dropout'``, ``'rollback'``, ``'scale'`` (a stalled static scale
            becomes dynamic) to apply. Defaults to all four.
        dropout_scope: ``'transformer'`` or ``'all'``. Defaults to ``'transformer'``.
        dropout_exclude: module-name prefixes whose dropout is left alone. Defaults to the backbones.
        skip_nonfinite_fp32: in fp32, drop a step with a non-finite gradient before the optimizer applies it
            (as a loss scaler does) instead of letting NaN into the weights. Defaults to True.
        restore_from_checkpoints: after the in-memory states, try this run's own finite checkpoints (newest
            first; another run's files in the same work dir are never used). Defaults to True.
        write_patched_config: after an incident and on giving up, rank 0 writes
            ``<work_dir>/nan_guard_patched_config.py``: the run's effective config with the known manual fix
            (transformer dropout 0, the live ``max_norm``), so that the next run starts stable. Defaults to True.
        lr_backoff: learning-rate factor of the dynamics ladder's second rung (every group and schedule).
            Defaults to 0.5.
        exploded_ratio: on the ladder's third rung, tensors whose gradient norm is this many times the median have
            their optimizer moments reset. Defaults to 100.0.
        temporal_reset: methods called after every rollback on modules that have them, to clear state kept outside
            ``state_dict()`` (StreamPETR's ``reset_memory``; ``reset`` only on Sparse4D's ``InstanceBank``).
            Defaults to ``('reset_memory', 'reset')``.
        quarantine_fraction: at most this fraction of the dataset is quarantined as bad data; past it the run is
            structural. Defaults to 0.001.
        first_iterations: a data divergence within this many iterations is structural at once (the first batches
            break the weights the run started from). 0 turns the rule off: a bug that breaks every batch is still
            stopped at its second incident by the recurrence rule, and one bad early sample is quarantined.
            Defaults to 0.
        spike_window / spike_z / spike_warmup: the grad_norm early warning (a running z-score over the host float
            the runner already logs): window, threshold in standard deviations, values before it speaks.
            Defaults to 100, 3.0, 25.
        adaptive_clip: clip at the recent mean + ``spike_z`` standard deviations of grad_norm, never looser than
            the configured ``max_norm`` (docs/demo.md says when it helps). Defaults to False.
        snapshot_copies: ``'rank'`` (every rank keeps its own snapshots) or ``'node'`` (one copy per node,
            on the node's lowest rank, sent to the others over gloo on restore; for replicated DDP state only,
            not sharded optimizers). Defaults to ``'rank'``.
    """

    patience: int = 3
    min_loss_scale: float = 1.0
    static_patience: int = 5
    check_interval: int = 50
    diagnose: bool = True
    snapshot_interval: int = 200
    confirm_steps: int = 50
    keep_snapshots: int = 3
    max_recoveries: int = 5
    max_norm: float = 1.0
    max_norm_schedule: Optional[Sequence[float]] = None
    remedies: Sequence[str] = REMEDIES
    dropout_scope: str = "transformer"
    dropout_exclude: Sequence[str] = ("backbone", "img_backbone")
    skip_nonfinite_fp32: bool = True
    restore_from_checkpoints: bool = True
    write_patched_config: bool = True
    lr_backoff: float = 0.5
    exploded_ratio: float = 100.0
    temporal_reset: Sequence[str] = ("reset_memory", "reset")
    quarantine_fraction: float = 0.001
    first_iterations: int = 0
    spike_window: int = 100
    spike_z: float = 3.0
    spike_warmup: int = 25
    adaptive_clip: bool = False
    snapshot_copies: str = "rank"
    detector: DetectorConfig = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.detector = DetectorConfig(self.patience, self.min_loss_scale, self.static_patience)
        check_int("check_interval", self.check_interval, 1)
        check_bool("diagnose", self.diagnose)
        check_int("snapshot_interval", self.snapshot_interval, 1)
        check_int("confirm_steps", self.confirm_steps, 0)
        check_int("keep_snapshots", self.keep_snapshots, 2)
        check_int("max_recoveries", self.max_recoveries, 0)
        check_number("max_norm", self.max_norm)
        if self.max_norm_schedule is not None:
            schedule = check_list("max_norm_schedule", self.max_norm_schedule)
            if not schedule:
                raise ValueError("max_norm_schedule must not be empty, got []")
            for value in schedule:
                check_number("max_norm_schedule entry", value)
        self.remedies = check_names("remedies", self.remedies, REMEDIES)
        check_choice("dropout_scope", self.dropout_scope, ("transformer", "all"))
        self.dropout_exclude = check_names("dropout_exclude", self.dropout_exclude)
        for name in ("skip_nonfinite_fp32", "restore_from_checkpoints", "write_patched_config"):
            check_bool(name, getattr(self, name))
        check_choice("snapshot_copies", self.snapshot_copies, ("rank", "node"))
        check_number("lr_backoff", self.lr_backoff)
        if self.lr_backoff >= 1:
            raise ValueError(f"lr_backoff must be a number in (0, 1), got {self.lr_backoff!r}")
        check_number("exploded_ratio", self.exploded_ratio, above=1.0)
        self.temporal_reset = check_names("temporal_reset", self.temporal_reset)
        check_number("quarantine_fraction", self.quarantine_fraction, above=0.0)
        if self.quarantine_fraction > 1:
            raise ValueError(f"quarantine_fraction must be a number in (0, 1], got {self.quarantine_fraction!r}")
        check_int("first_iterations", self.first_iterations, 0)
        check_int("spike_window", self.spike_window, 2)
        check_number("spike_z", self.spike_z)
        check_int("spike_warmup", self.spike_warmup, 2)
        check_bool("adaptive_clip", self.adaptive_clip)

    def clip_target(self, incident: int) -> float:
        """max_norm target for the ``incident``-th recovery (1-based)."""
        targets = list(self.max_norm_schedule) if self.max_norm_schedule is not None else [self.max_norm]
        return float(targets[min(incident, len(targets)) - 1])


@dataclass
class _Point:
    """One restore point: where it lives and how to read it (lazily: a checkpoint is read only when tried)."""

    key: str
    kind: str
    iteration: int
    read: Callable[[], Optional[Payload]] = field(repr=False)
    snapshot: Optional[Snapshot] = field(default=None, repr=False)


class NanGuard:
    """Watches every step and recovers from a confirmed divergence.

    Args:
        config: the settings.
        io: the runner adapter.
    """

    def __init__(self, config: GuardConfig, io: GuardIO) -> None:
        self.config = config
        self.io = io
        self.detector = DivergenceDetector(config.detector)
        self.ring = SnapshotRing(config.keep_snapshots, config.confirm_steps)
        self.incidents = IncidentLog(io.work_dir, enabled=distributed.get_rank() == 0)
        #: Names this run in every checkpoint it saves: a rollback only ever uses checkpoints carrying it.
        self.run_id = uuid.uuid4().hex
        self.recoveries = 0
        self.stalls = 0
        self.iterations_lost = 0
        self.skipped_steps = 0
        self.fp32_skips = 0
        self.dropout_zeroed = False
        self.scale_made_dynamic = False
        self.actions_tried: List[str] = []
        self._clip_state: Dict[str, float] = {}
        self.start: Optional[Snapshot] = None
        self._tried: set = set()
        self._foreign_logged = False
        self.last_diagnosis: Optional[Dict[str, Any]] = None
        self.policy = CausePolicy(list(config.remedies), config.lr_backoff, config.exploded_ratio,
                                  list(config.temporal_reset), config.quarantine_fraction, config.first_iterations)
        self.spikes = GradNormMonitor(config.spike_window, config.spike_z, config.spike_warmup)
        #: The configured max_norm per clip setting (lowered by remedies): adaptive clipping never goes above it.
        self._clip_base: Dict[str, float] = {}
        self._data_attached = False
        self._bad_attributes: List[str] = []
        #: Called on every rank with each incident record after it was written (the driver writes the patched
        #: config there).
        self.listeners: List[Callable[[Dict[str, Any]], None]] = []
        #: The batch and RNG state of the running iteration, kept by the driver for a diagnosis.
        self.batch: Any = None
        self.rng: Optional[Dict[str, Any]] = None

    # ------------------------------------------------------------------ setup and persistence
    def setup(self) -> None:
        """Re-applies remedies recorded in a resumed state (call once the runner's objects exist)."""
        for clip in self.io.clip_settings():
            if clip.name in self._clip_state:
                change = clip.tighten(self._clip_state[clip.name])
                if change:
                    self.io.log(f"NanGuard: resumed remedy {clip.name}: {change.old:g} -> {change.new:g}")
        if self.dropout_zeroed:
            changes = self._zero_dropout()
            if changes:
                self.io.log(f"NanGuard: resumed remedy: {len(changes)} transformer dropout(s) set to 0")
        if self.scale_made_dynamic:
            self.io.restore_scale_mode()
        self.policy.setup(self.io)
        self._clip_base = {c.name: c.max_norm for c in self.io.clip_settings() if c.kind == "norm"}
        self._publish()

    def attach_data(self) -> None:
        """As an iteration starts: the quarantine sampler goes into the training loader once it exists."""
        if not self._data_attached:
            self._data_attached = self.policy.attach_data(self.io)

    def capture_start(self) -> None:
        """Keeps the state the run starts from (before its first step, or right after resume): a restore point
        that exists before any snapshot is confirmed. Costs one snapshot of host memory."""
        iteration, epoch = self.io.completed(inside=False)
        self.start = self._take_snapshot(iteration, epoch, recycle=False)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "version": 2,
            "run_id": self.run_id,
            "recoveries": self.recoveries,
            "stalls": self.stalls,
            "iterations_lost": self.iterations_lost,
            "skipped_steps": self.skipped_steps,
            "fp32_skips": self.fp32_skips,
            "dropout_zeroed": self.dropout_zeroed,
            "scale_made_dynamic": self.scale_made_dynamic,
            "clip": dict(self._clip_state),
            "actions_tried": list(self.actions_tried),
            "detector": self.detector.state_dict(),
            "policy": self.policy.state_dict(),
            "spikes": self.spikes.state_dict(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.run_id = str(state.get("run_id", self.run_id))
        self.recoveries = int(state.get("recoveries", 0))
        self.stalls = int(state.get("stalls", 0))
        self.iterations_lost = int(state.get("iterations_lost", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.fp32_skips = int(state.get("fp32_skips", 0))
        self.dropout_zeroed = bool(state.get("dropout_zeroed", False))
        self.scale_made_dynamic = bool(state.get("scale_made_dynamic", False))
        self._clip_state = {str(k): float(v) for k, v in dict(state.get("clip", {})).items()}
        self.actions_tried = list(state.get("actions_tried", []))
        self.detector.load_state_dict(state.get("detector", {}))
        self.policy.load_state_dict(state.get("policy", {}))
        self.spikes.load_state_dict(state.get("spikes", {}))

    # ------------------------------------------------------------------ the per-iteration path
    def after_iter(self) -> Decision:
        """Runs once per training iteration, after the optimizer step; returns the agreed decision."""
        iteration, _ = self.io.completed(inside=True)
        reading = self.io.read_step()
        mode = self.io.scale_mode()
        signals = StepSignals(iteration, reading.stepped, reading.grad_norm, reading.loss, None, mode)
        if reading.skipped_by_guard:
            signals.step_applied = False
        # The first healthy step of a run (or after the ring was emptied) is snapshotted at once, so a state to
        # return to exists as early as possible; then every snapshot_interval iterations.
        snapshot_due = reading.stepped and (len(self.ring) == 0 or iteration % self.config.snapshot_interval == 0)
        if signals.suspicious:
            signals.loss_scale = self.io.loss_scale()
            signals.weights_finite = self._healthy(optimizer=True)
        elif snapshot_due or self.io.health_check_due():
            signals.weights_finite = self._healthy(optimizer=True)
        elif iteration % self.config.check_interval == 0:
            signals.weights_finite = self._healthy(optimizer=False)
        if signals.loss_scale is None and signals.weights_finite is not None:
            # A check already waited for the device here: publish the scale too, for the logs and the report.
            signals.loss_scale = self.io.loss_scale()

        decision = self.detector.observe(signals)
        agreed = Verdict(distributed.reduce_max([int(decision.verdict)])[0])
        if agreed != decision.verdict:
            decision = Decision(agreed, f"another rank reported {agreed.name} ({decision.reason or 'here: healthy'})")

        if agreed == Verdict.HEALTHY:
            if reading.stepped:
                self._watch_grad_norm(reading.grad_norm)
                self.ring.tick()
                self._maybe_close_chain()
                if snapshot_due:
                    self._snapshot(iteration)
        elif agreed == Verdict.OVERFLOW:
            self._on_overflow(signals, decision)
        elif agreed == Verdict.STALLED:
            self.skipped_steps += 1
            self._on_stall(signals, decision)
        else:
            self._recover(signals, decision)
        self._publish(signals.loss_scale)
        return decision

    def _watch_grad_norm(self, grad_norm: Optional[float]) -> None:
        # The early warning and the adaptive clip read the host float the runner logged: no device read.
        if grad_norm is None:
            return
        warning = self.spikes.observe(grad_norm)
        if warning:
            self.io.log(f"NanGuard: early warning: {warning}", "warning")
        if self.config.adaptive_clip and self.spikes.ready:
            for clip in self.io.clip_settings():
                base = self._clip_base.get(clip.name)
                if clip.kind == "norm" and base is not None:
                    clip.set_max_norm(self.spikes.clip_bound(base))

    def _on_overflow(self, signals: StepSignals, decision: Decision) -> None:
        if signals.scale_mode != "none":
            self.skipped_steps += 1
            scale = "" if signals.loss_scale is None else f", loss scale now {signals.loss_scale:g}"
            self.io.log(f"NanGuard: harmless overflow at iter {signals.iteration}: step skipped{scale} "
                        f"({decision.reason})")
            return
        # fp32 has no loss scaler: nothing here is ordinary. Every such step is an event in the incident log
        # (which step, which batch: what a user needs to find bad data).
        skipped = signals.step_applied is False
        if skipped:
            self.skipped_steps += 1
            self.fp32_skips += 1
        what = "fp32 step skipped before the optimizer applied it" if skipped else "non-finite loss, step applied"
        record = self._record("skip" if skipped else "nonfinite_loss", signals, decision, [])
        record["batch"] = (sample_ids(self.batch) or None) if self.batch is not None else None
        self.incidents.write(record)
        self.io.log(f"NanGuard: {what} at iter {signals.iteration} ({decision.reason})", "warning")

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

    def _take_snapshot(self, iteration: int, epoch: int, recycle: bool) -> Snapshot:
        """A host copy of the live state. Pinned host memory and asynchronous copies where the model lives on a
        GPU, with an event marking their end: no host wait here (the copies are queued on the current stream ahead
        of anything that writes the state again; docs/gpu.md says why not a side stream); the host waits only when
        it reads the snapshot. ``recycle``: copy into the ring's oldest snapshot instead of allocating."""
        if self._holds_no_tensors():
            # The node's leader keeps the tensors; this rank keeps the structure and its own small state.
            payload, device, pin = distributed.strip_tensors(self.io.capture())[0], None, False
        else:
            device = next((p.device for p in self.io.model().parameters()), None)
            pin = device is not None and device.type == "cuda"
            payload = copy_to_host(self.io.capture(), reuse=self.ring.recyclable() if recycle else None, pin=pin)
        return Snapshot(iteration, epoch, payload, nbytes=nbytes(payload), copied=copies_done(pin, device),
                        generation=self.recoveries, lr_factor=self.policy.lr_factor)

    def _snapshot(self, iteration: int) -> None:
        _, epoch = self.io.completed(inside=True)
        self.ring.add(self._take_snapshot(iteration, epoch, recycle=True))

    def _maybe_close_chain(self) -> None:
        # A state taken after the latest recovery proved healthy: the recovery held, the incident chain ends and
        # every restore point may be tried again by a later, unrelated incident.
        if self._tried:
            snap = self.ring.newest_confirmed()
            if snap is not None and snap.generation == self.recoveries:
                self._tried.clear()
                rung = self.policy.held(snap.iteration)
                if rung:
                    self.io.log(f"NanGuard: the recovery held (the state of iter {snap.iteration} is confirmed); "
                                f"the ladder's rung that held: {rung}")

    # ------------------------------------------------------------------ remedies and rollback
    def _zero_dropout(self) -> List[Change]:
        return zero_transformer_dropout(self.io.model(), self.config.dropout_scope, self.config.dropout_exclude)

    def _apply_remedies(self, incident: int) -> List[Change]:
        changes: List[Change] = []
        if "clip" in self.config.remedies:
            target = self.config.clip_target(incident)
            for clip in self.io.clip_settings():
                change = clip.tighten(target)
                if change:
                    changes.append(change)
                if clip.kind == "norm":
                    self._clip_state[clip.name] = clip.max_norm
                    self._clip_base[clip.name] = min(self._clip_base.get(clip.name, clip.max_norm), clip.max_norm)
                elif clip.kind == "value":
                    self.io.log(f"NanGuard: {clip.name} clips by value ({clip.kwargs}); the max_norm remedy does "
                                "not apply", "warning")
        if "dropout" in self.config.remedies:
            changes.extend(self._zero_dropout())
            self.dropout_zeroed = True
        return changes

    def _known_fix_in_effect(self) -> bool:
        """Every enabled setting of the known manual fix is in force already (max_norm at or below its target,
        transformer dropout zeroed)."""
        target = self.config.clip_target(self.recoveries + 1)
        clip_done = "clip" not in self.config.remedies or all(
            c.max_norm is not None and c.max_norm <= target for c in self.io.clip_settings() if c.kind == "norm")
        return clip_done and ("dropout" not in self.config.remedies or self.dropout_zeroed)

    def _on_stall(self, signals: StepSignals, decision: Decision) -> None:
        change = self.io.make_scale_dynamic() if "scale" in self.config.remedies else None
        if change is None:
            self._recover(signals, Decision(Verdict.DIVERGED, decision.reason + "; no scale remedy available"))
            return
        self.stalls += 1
        self.scale_made_dynamic = True
        self.detector.reset()
        self.actions_tried.append(f"iter {signals.iteration}: {change.target} {change.old} -> {change.new}")
        record = self._record("stalled", signals, decision, [change])
        self.io.log(
            f"NanGuard: static loss scale stalled training at iter {signals.iteration} ({decision.reason}); "
            f"{change.target}: {change.old} -> {change.new}",
            "warning",
        )
        self._emit(record)

    def _diagnose(self, signals: StepSignals) -> Optional[Dict[str, Any]]:
        # A rank whose own step was clean would only re-run a clean batch: only those that saw the fault do.
        saw_fault = signals.suspicious or signals.weights_finite is False or not distributed.is_distributed()
        forward = self.io.rerun_forward(self.batch) if self.config.diagnose and saw_fault else None
        if forward is None:
            return None
        try:
            snap = self.ring.newest_confirmed() or self.start
            weights = snap.ready_payload().get("state_dict") if snap is not None else None
            if not weights or not all(isinstance(v, torch.Tensor) for v in weights.values()):
                weights = None  # e.g. snapshot_copies='node' away from the node's leader: no tensors here
            scale = signals.loss_scale if signals.loss_scale is not None else self.io.loss_scale()
            where = "the run's start state" if snap is self.start else f"snapshot of iter {snap.iteration}" if snap \
                else ""
            report = diagnose_step(self.io.model(), forward, rng_state=self.rng, loss_scale=scale or 1.0,
                                   healthy_weights=weights, healthy_from=where if weights else "",
                                   compare="reproduced")
        except Exception as exc:  # the diagnosis must never stand between a divergence and its recovery
            report = {"error": f"{type(exc).__name__}: {exc}"}
        report["rank"] = distributed.get_rank()
        self.io.log(f"NanGuard: diagnosis of iter {signals.iteration} (rank {report['rank']}): "
                    f"{summarize(report)}", "warning")
        return report

    def _recover(self, signals: StepSignals, decision: Decision, inside: bool = True) -> None:
        iteration, epoch = self.io.completed(inside)
        # Before any remedy: the re-run needs the dropout and weights that the failing step ran with.
        self.last_diagnosis = self._diagnose(signals)
        # Every rank classifies (a collective) and acts on the same class.
        cls = self.policy.classify(self.last_diagnosis, iteration)
        cls.signals.setdefault("iteration", iteration)
        if self.recoveries >= self.config.max_recoveries:
            self._give_up(signals, decision, NanGuardGaveUp,
                          f"the recovery budget is spent ({self.recoveries} of max_recoveries="
                          f"{self.config.max_recoveries})", cls=cls)
        # Only a rank whose own step broke (it ran the diagnosis) names its batch for the quarantine.
        batch = self.batch if self.last_diagnosis is not None else None
        state_ok = self._state_checked_finite(signals)
        changes = (self.policy.before_rollback(cls, self.io, batch, state_ok, self._known_fix_in_effect())
                   if cls.cause != Cause.STRUCTURAL else [])
        if cls.cause == Cause.STRUCTURAL:
            self._give_up(signals, decision, StructuralDivergence,
                          f"the divergence is structural: {cls.evidence}. Look at: {self.policy.advice()}", cls=cls)
        if cls.cause in (Cause.DYNAMICS, Cause.UNKNOWN) and self.policy.rung == 1:
            changes += self._apply_remedies(self.recoveries + 1)
        for change in changes:
            self.actions_tried.append(f"iter {iteration}: {change.target} {change.old} -> {change.new}")
        restored: Dict[str, Any] = {}
        lost = 0
        # Bad data met a state checked finite on every rank (the scaler or the fp32 skip kept it out): the state is
        # not what broke, so the run goes on from it, nothing lost.
        keep_state = cls.cause == Cause.DATA and state_ok
        if "rollback" in self.config.remedies and not keep_state:
            payload = self._next_restore_point(iteration)
            if payload is None:
                tried = ", ".join(sorted(self._tried)) or "none existed"
                self._give_up(signals, decision, NoHealthyStateError,
                              f"no healthy state of this run is left to roll back to (tried: {tried}; the order is: "
                              + "; ".join(RESTORE_ORDER) + ")", changes, cls)
            self.io.restore(payload)
            self.io.rewind(payload.iteration, inside)
            # States newer than the one restored belong to the abandoned path.
            self.ring.snapshots = [s for s in self.ring.snapshots if s.iteration <= payload.iteration]
            lost = max(0, iteration - payload.iteration)
            restored = {"source": payload.source, "iteration": payload.iteration}
            self.actions_tried.append(f"iter {iteration}: rollback to {payload.source} (iter {payload.iteration})")
            later = self.policy.after_rollback(cls, self.io, payload.lr_factor)
            for change in later:
                self.actions_tried.append(f"iter {iteration}: {change.target} {change.old} -> {change.new}")
            changes += later
            reset = self.policy.reset_temporal(self.io)
            if reset:
                self.io.log(f"NanGuard: temporal state reset after the rollback: {', '.join(reset)}")
                restored["temporal_reset"] = reset
        self.detector.reset()
        self.io.read_step()  # forget the failed step's probe reading
        self.recoveries += 1
        self.iterations_lost += lost
        self.policy.record(cls, iteration, restored.get("iteration"))
        record = self._record("divergence", signals, decision, changes)
        record.update(restored_from=restored or None, iterations_lost=lost, epoch=epoch, diagnosis=self.last_diagnosis,
                      cause=cls.as_dict())
        if restored:
            where = f"rolled back to iter {restored['iteration']} from {restored['source']}, {lost} iteration(s) lost"
        else:
            where = "no rollback (the state is finite on every rank: the bad batch is skipped)" if keep_state else \
                "no rollback (disabled)"
        self.io.log(
            f"NanGuard: divergence at iter {iteration} ({decision.reason}); cause: {cls.cause.value} "
            f"({cls.evidence}); recovery {self.recoveries}/{self.config.max_recoveries}: {where}; "
            f"{len(changes)} setting(s) changed",
            "warning",
        )
        for change in changes:
            self.io.log(f"NanGuard:   {change.target}: {change.old} -> {change.new}", "warning")
        if restored:
            self.io.log(f"NanGuard: the iteration counter restarts at {restored['iteration'] + 1}; checkpoints of the "
                        "replayed iterations will be written again", "warning")
        self.io.after_recovery(self.state_dict(), inside)
        self._emit(record)

    # ------------------------------------------------------------------ restore points
    def _restore_points(self, now: int) -> Iterator[_Point]:
        ring = self.ring
        confirmed = [s for s in reversed(ring.snapshots) if ring.is_confirmed(s)]
        pending = [s for s in reversed(ring.snapshots) if not ring.is_confirmed(s) and not s.failed]
        for kind, snaps in (("memory", confirmed), ("memory (unconfirmed)", pending)):
            for snap in snaps:
                yield _Point(f"snapshot of iter {snap.iteration} (path {snap.generation})", kind, snap.iteration,
                             lambda snap=snap: self._snapshot_payload(snap), snap)
        if self.start is not None:
            yield _Point(f"start state (iter {self.start.iteration})", "start", self.start.iteration,
                         lambda: self._snapshot_payload(self.start, "start"), self.start)
        if self.config.restore_from_checkpoints:
            yield _Point("checkpoints", "checkpoint", -1, lambda: self._checkpoint_payload(now))

    def _next_restore_point(self, now: int) -> Optional[Payload]:
        payload = self._first_untried_point(now)
        start = self.start
        if payload is None and start is not None and now - start.iteration > 1:
            # Every point is spent, but the run's start state cannot be what diverged when training went on from it
            # for more than one iteration, on data that moved on: it is the last healthy state of this run, and is
            # tried again (bounded by max_recoveries) rather than giving up while it exists. A run whose steps after
            # a restore are all loss-scale calibration (no snapshot can be confirmed) needs this.
            self._tried.discard(f"start state (iter {start.iteration})")
            payload = self._first_untried_point(now)
        return payload

    def _first_untried_point(self, now: int) -> Optional[Payload]:
        for point in self._restore_points(now):
            if point.key in self._tried:
                continue
            if point.kind != "checkpoint":
                self._tried.add(point.key)
                if point.kind != "memory":
                    self.io.log(f"NanGuard: no confirmed snapshot is left; using {point.kind} state of iter "
                                f"{point.iteration}", "warning")
            payload = point.read()
            if payload is not None:
                return payload
        return None

    @staticmethod
    def _state_checked_finite(signals: StepSignals) -> bool:
        """Every rank that checked its state at this step found it finite, and at least one checked (a collective).

        DDP replicas hold the same weights, so one rank's check speaks for the state of all.
        """
        bad, checked = distributed.reduce_max([int(signals.weights_finite is False),
                                               int(signals.weights_finite is True)])
        return bool(checked) and not bad

    def _snapshot_payload(self, snap: Snapshot, source: str = "memory") -> Payload:
        payload = snap.ready_payload()
        if self.config.snapshot_copies == "node" and distributed.is_distributed():
            group, leader, _ = distributed.node_group()
            payload = distributed.broadcast_payload(payload, src=leader, group=group, known_structure=True)
        return Payload(payload, snap.iteration, snap.epoch, source=source, lr_factor=snap.lr_factor)

    def _holds_no_tensors(self) -> bool:
        if self.config.snapshot_copies != "node" or not distributed.is_distributed():
            return False
        return distributed.node_group()[1] != distributed.get_rank()

    def _checkpoint_payload(self, now: int) -> Optional[Payload]:
        # Rank 0 alone lists, reads and checks the files; the others receive its choice and its tensors, so
        # no shared filesystem is needed and every rank restores the same state (or gives up together).
        found = self._read_own_checkpoint(now) if distributed.get_rank() == 0 else None
        meta = distributed.broadcast_object(
            None if found is None else (found.source, found.iteration, found.epoch, found.lr_factor))
        if meta is None:
            return None
        state = distributed.broadcast_payload(found.state if found is not None else None)
        if found is None:
            self.io.log(f"NanGuard: received checkpoint {meta[0]} from rank 0")
        self._tried.add(meta[0])
        return Payload(state, meta[1], meta[2], source=meta[0], strict=False, lr_factor=meta[3])

    def _read_own_checkpoint(self, now: int) -> Optional[Payload]:
        candidates: List[Tuple[int, str, Payload]] = []
        foreign: List[str] = []
        for path in self.io.checkpoint_files():
            if path in self._tried:
                continue
            try:
                payload, guard_state = self.io.read_checkpoint(path)
            except Exception as exc:  # a truncated or foreign file must not end the recovery
                self.io.log(f"NanGuard: skipping checkpoint {path}: {type(exc).__name__}: {exc}", "warning")
                self._tried.add(path)
                continue
            if (guard_state or {}).get("run_id") != self.run_id or payload.iteration > now:
                foreign.append(f"{path} (iter {payload.iteration})")
                continue
            payload.lr_factor = float(((guard_state or {}).get("policy") or {}).get("lr_factor", 1.0))
            candidates.append((payload.iteration, path, payload))
        if foreign and not self._foreign_logged:
            self._foreign_logged = True
            self.io.log(f"NanGuard: ignoring {len(foreign)} checkpoint(s) not written by this run before iter {now} "
                        f"(another run's, or from an abandoned later path): {', '.join(foreign[:5])}", "warning")
        for _, path, payload in sorted(candidates, key=lambda c: c[0], reverse=True):
            if all_finite(iter_tensors(payload.state)):
                return payload
            self.io.log(f"NanGuard: skipping checkpoint {path}: it holds non-finite values", "warning")
            self._tried.add(path)
        return None

    # ------------------------------------------------------------------ records and errors
    def _give_up(self, signals: StepSignals, decision: Decision, error: type, why: str,
                 changes: Sequence[Change] = (), cls: Optional[Classification] = None) -> None:
        record = self._record("gave_up", signals, decision, list(changes))
        record["why"] = why
        record["diagnosis"] = self.last_diagnosis
        record["cause"] = None if cls is None else cls.as_dict()
        tried = "\n".join(f"  - {a}" for a in self.actions_tried) or "  (nothing yet)"
        log = self.incidents.path or "(no work dir: no incident log)"
        msg = (f"NanGuard gave up at iter {signals.iteration}: {why}. Last divergence: {decision.reason}.\n"
               f"Remedies and rollbacks so far:\n{tried}\nIncident log: {log}")
        self.io.log(msg, "error")
        self._emit(record)
        raise error(msg)

    def _emit(self, record: Dict[str, Any]) -> None:
        self.incidents.write(record)
        for listener in self.listeners:
            listener(record)

    def _record(self, event: str, signals: StepSignals, decision: Decision, changes: List[Change]) -> Dict[str, Any]:
        return {
            "event": event,
            "iteration": signals.iteration,
            "reason": decision.reason,
            "verdict": decision.verdict.name,
            "signals": signals.as_dict(),
            "actions": [c.as_dict() for c in changes],
            "recoveries": self.recoveries,
            "max_recoveries": self.config.max_recoveries,
            "world_size": distributed.get_world_size(),
            **({"nonfinite_attributes": list(self._bad_attributes)} if self._bad_attributes else {}),
        }

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

    # ------------------------------------------------------------------ outside the step
    def all_ranks_healthy(self, healthy_here: bool) -> bool:
        """Agrees across ranks on a health reading taken outside :meth:`after_iter`."""
        return distributed.reduce_max([0 if healthy_here else 1])[0] == 0

    def recover_now(self, reason: str, inside: bool) -> None:
        """Runs the recovery path at once (a non-finite state found outside a step's own signals)."""
        iteration, _ = self.io.completed(inside)
        signals = StepSignals(iteration, weights_finite=False)
        self._recover(signals, Decision(Verdict.DIVERGED, reason), inside)
        self._publish()

    @staticmethod
    def check_checkpoint(checkpoint: Dict[str, Any], what: str) -> None:
        """Raises :class:`UnsafeCheckpointError` if a checkpoint's model or optimizer tensors are not all finite."""
        if checkpoint_finite(checkpoint):
            return
        bad = first_nonfinite(
            (k, v) for k, v in dict(checkpoint.get("state_dict", {})).items() if isinstance(v, torch.Tensor)
        )
        raise UnsafeCheckpointError(
            f"{what} holds non-finite values (first: {bad or 'optimizer state'}); refusing to use it. "
            "Pick an earlier checkpoint; the incident log in the work dir says when training diverged."
        )


def checkpoint_finite(checkpoint: Dict[str, Any]) -> bool:
    """The one "is this checkpoint finite" rule: its model weights and its optimizer state."""
    return all_finite(iter_tensors(checkpoint.get("state_dict", checkpoint))) and all_finite(
        iter_tensors(checkpoint.get("optimizer", {})))
