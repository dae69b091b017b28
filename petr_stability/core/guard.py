"""The framework-free guard: per-step detection, remedies, snapshots, rollback, budget and incident log.

A runner adapter subclasses :class:`GuardIO` to say where things live in its runner and calls
:meth:`NanGuard.after_iter` once per training iteration, at the same hook point where snapshots are both
taken and restored: whatever the runner does after that point (scheduler steps, counter increments,
checkpoint saves) then runs the same way after a restore as it did after the capture, so counters, LR and
schedulers stay consistent without special cases.
"""
import abc
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import distributed
from .detector import Decision, DetectorConfig, DivergenceDetector, StepSignals, Verdict
from .diagnose import diagnose_step, summarize
from .errors import NanGuardGaveUp, NoHealthyStateError, UnsafeCheckpointError
from .health import all_finite, first_nonfinite, iter_tensors, state_finite
from .incidents import IncidentLog
from .remedies import Change, tighten_clip, zero_transformer_dropout
from .snapshot import Snapshot, SnapshotRing, copies_done, copy_to_host, payload_nbytes

__all__ = ["GuardConfig", "GuardIO", "NanGuard", "REMEDIES"]

#: Remedy names accepted by ``remedies=``.
REMEDIES = ("clip", "dropout", "rollback", "scale")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


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
        max_norm: target of the clip remedy, ``max_norm = min(current, target)``: the seed's 1. Defaults
            to 1.0.
        max_norm_schedule: optional targets per incident (``[10, 3, 1]`` tightens step by step); the last one
            stays. Overrides ``max_norm``. Defaults to None.
        remedies: which of ``'clip'``, ``'dropout'``, ``'rollback'``, ``'scale'`` (a stalled static scale
            becomes dynamic) to apply. Defaults to all four.
        dropout_scope: ``'transformer'`` or ``'all'``. Defaults to ``'transformer'``.
        dropout_exclude: module-name prefixes whose dropout is left alone. Defaults to the backbones.
        skip_nonfinite_fp32: in fp32, drop a step with a non-finite gradient before the optimizer applies it
            (as a loss scaler does) instead of letting NaN into the weights. Defaults to True.
        restore_from_checkpoints: when no confirmed snapshot exists, roll back to the newest finite
            checkpoint in the work dir. Defaults to True.
        write_patched_config: after an incident, rank 0 writes ``<work_dir>/nan_guard_patched_config.py``: the
            run's config with the seed's fix (transformer dropout 0, the live ``max_norm``), so that the next
            run starts stable. Defaults to True.
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
    snapshot_copies: str = "rank"
    detector: DetectorConfig = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.detector = DetectorConfig(self.patience, self.min_loss_scale, self.static_patience)
        _check_int("check_interval", self.check_interval, 1)
        if not isinstance(self.diagnose, bool):
            raise TypeError(f"diagnose must be a bool, got {self.diagnose!r}")
        _check_int("snapshot_interval", self.snapshot_interval, 1)
        _check_int("confirm_steps", self.confirm_steps, 0)
        _check_int("keep_snapshots", self.keep_snapshots, 2)
        _check_int("max_recoveries", self.max_recoveries, 0)
        targets = list(self.max_norm_schedule) if self.max_norm_schedule is not None else [self.max_norm]
        if not targets:
            raise ValueError("max_norm_schedule must not be empty")
        for value in targets:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ValueError(f"max_norm must be a finite number > 0, got {value!r}")
        if isinstance(self.remedies, str):
            raise TypeError(f"remedies must be a list of names, got the string {self.remedies!r}")
        unknown = [r for r in self.remedies if r not in REMEDIES]
        if unknown:
            raise ValueError(f"unknown remedy {unknown[0]!r}; choose from {list(REMEDIES)}")
        if self.dropout_scope not in ("transformer", "all"):
            raise ValueError(f"dropout_scope must be 'transformer' or 'all', got {self.dropout_scope!r}")
        for name in ("skip_nonfinite_fp32", "restore_from_checkpoints", "write_patched_config"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.snapshot_copies not in ("rank", "node"):
            raise ValueError(f"snapshot_copies must be 'rank' or 'node', got {self.snapshot_copies!r}")
        if isinstance(self.dropout_exclude, str):
            raise TypeError(f"dropout_exclude must be a list of prefixes, got the string {self.dropout_exclude!r}")

    def clip_target(self, incident: int) -> float:
        """max_norm target for the ``incident``-th recovery (1-based)."""
        targets = list(self.max_norm_schedule) if self.max_norm_schedule is not None else [self.max_norm]
        return float(targets[min(incident, len(targets)) - 1])


class GuardIO(abc.ABC):
    """Where a runner keeps what the guard reads and changes. One small subclass per runner family.

    A *payload* is a dict of state dicts as the adapter's checkpoints hold them (``state_dict``,
    ``optimizer``, ...) plus ``meta`` with ``iter`` and ``epoch``; the guard copies it to the host and hands
    it back unchanged to :meth:`restore`.
    """

    work_dir: Optional[str] = None

    @abc.abstractmethod
    def model(self) -> nn.Module:
        """The unwrapped model."""

    @abc.abstractmethod
    def optimizers(self) -> List[Any]:
        """The torch optimizers."""

    @abc.abstractmethod
    def read_step(self) -> Tuple[bool, Optional[float], bool]:
        """(stepped, grad_norm, skipped_by_guard) of the iteration that just ran (from the clip probe)."""

    @abc.abstractmethod
    def loss(self) -> Optional[float]:
        """This iteration's total loss on this rank, as a host float already read by the runner."""

    @abc.abstractmethod
    def scaler(self) -> Tuple[Any, str]:
        """(loss scaler or None, ``'dynamic'`` | ``'static'`` | ``'none'``)."""

    @abc.abstractmethod
    def clip_settings(self) -> List[Tuple[str, Dict[str, Any]]]:
        """(name, live clip kwargs dict) for each optimizer; edits take effect at the next step."""

    @abc.abstractmethod
    def capture(self) -> Dict[str, Any]:
        """The live state to snapshot (references are fine: the guard copies)."""

    @abc.abstractmethod
    def restore(self, payload: Dict[str, Any]) -> None:
        """Loads a payload into the live objects and sets the iteration counter to ``payload['meta']['iter']``."""

    @abc.abstractmethod
    def counters(self) -> Tuple[int, int]:
        """(iteration, epoch) as the runner counts them now."""

    @abc.abstractmethod
    def log(self, msg: str, level: str = "info") -> None:
        """Writes through the runner's logger."""

    def update_scalars(self, scalars: Dict[str, float]) -> None:
        """Publishes scalars to the runner's log/visualization backends."""

    def checkpoint_candidates(self) -> List[str]:
        """Checkpoint files to fall back on, newest first."""
        return []

    def load_payload(self, path: str) -> Dict[str, Any]:
        """Reads a checkpoint file into a payload (safe loading)."""
        raise NotImplementedError

    def make_scale_dynamic(self) -> Optional[Change]:
        """Turns a static loss scale into a dynamic one; None where there is none to change."""
        return None

    def restore_scale_mode(self, dynamic: bool) -> None:
        """Re-applies a scale-mode remedy after a resume."""

    def after_incident(self, record: Dict[str, Any]) -> None:
        """Called on every rank after an incident was handled and logged (for example to write a patched config)."""

    def health_check_due(self) -> bool:
        """True when this rank wants a full health check on this iteration (e.g. it just saved a non-finite
        checkpoint); the verdict is agreed across ranks as usual."""
        return False

    def rerun_forward(self) -> Optional[Callable[[], Any]]:
        """A zero-argument callable re-running this iteration's forward on the unwrapped model, in the training
        autocast context, returning its loss (dict); None where the adapter cannot (no diagnosis then)."""
        return None

    def rerun_rng_state(self) -> Optional[Dict[str, Any]]:
        """RNG state captured before this iteration's forward (:func:`~.diagnose.capture_rng`), or None."""
        return None


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
        self.recoveries = 0
        self.stalls = 0
        self.iterations_lost = 0
        self.skipped_steps = 0
        self.dropout_zeroed = False
        self.scale_made_dynamic = False
        self.actions_tried: List[str] = []
        self._clip_state: Dict[str, float] = {}
        self._last_restored: Optional[Snapshot] = None
        self._failed_paths: set = set()
        self._last_restored_path: Optional[str] = None
        self.last_diagnosis: Optional[Dict[str, Any]] = None

    # ------------------------------------------------------------------ setup and persistence
    def setup(self) -> None:
        """Re-applies remedies recorded in a resumed state (call once the runner's objects exist)."""
        for name, kwargs in self.io.clip_settings():
            if name in self._clip_state:
                change = tighten_clip(kwargs, self._clip_state[name], target=name)
                if change:
                    self.io.log(f"NanGuard: resumed remedy {name}: {change.old:g} -> {change.new:g}")
        if self.dropout_zeroed:
            changes = self._zero_dropout()
            if changes:
                self.io.log(f"NanGuard: resumed remedy: {len(changes)} transformer dropout(s) set to 0")
        if self.scale_made_dynamic:
            self.io.restore_scale_mode(dynamic=True)
        self._publish()

    def state_dict(self) -> Dict[str, Any]:
        return {
            "version": 1,
            "recoveries": self.recoveries,
            "stalls": self.stalls,
            "iterations_lost": self.iterations_lost,
            "skipped_steps": self.skipped_steps,
            "dropout_zeroed": self.dropout_zeroed,
            "scale_made_dynamic": self.scale_made_dynamic,
            "clip": dict(self._clip_state),
            "actions_tried": list(self.actions_tried),
            "detector": self.detector.state_dict(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.recoveries = int(state.get("recoveries", 0))
        self.stalls = int(state.get("stalls", 0))
        self.iterations_lost = int(state.get("iterations_lost", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.dropout_zeroed = bool(state.get("dropout_zeroed", False))
        self.scale_made_dynamic = bool(state.get("scale_made_dynamic", False))
        self._clip_state = {str(k): float(v) for k, v in dict(state.get("clip", {})).items()}
        self.actions_tried = list(state.get("actions_tried", []))
        self.detector.load_state_dict(state.get("detector", {}))

    # ------------------------------------------------------------------ the per-iteration path
    def after_iter(self) -> Decision:
        """Runs once per training iteration, after the optimizer step; returns the agreed decision."""
        iteration, _ = self.io.counters()
        stepped, grad_norm, skipped = self.io.read_step()
        scaler, mode = self.io.scaler()
        signals = StepSignals(iteration, stepped, grad_norm, self.io.loss(), None, mode)
        if skipped:
            signals.step_applied = False
        # The first healthy step of a run (or after the ring was emptied) is snapshotted at once, so a state to
        # return to exists as early as possible; then every snapshot_interval iterations.
        snapshot_due = stepped and (len(self.ring) == 0 or (iteration + 1) % self.config.snapshot_interval == 0)
        if signals.suspicious:
            signals.loss_scale = _scale_of(scaler)
            signals.weights_finite = self._healthy(optimizer=True)
        elif snapshot_due or self.io.health_check_due():
            signals.weights_finite = self._healthy(optimizer=True)
        elif (iteration + 1) % self.config.check_interval == 0:
            signals.weights_finite = self._healthy(optimizer=False)
        if signals.loss_scale is None and signals.weights_finite is not None:
            # A check already waited for the device here: publish the scale too, for the logs and the report.
            signals.loss_scale = _scale_of(scaler)

        decision = self.detector.observe(signals)
        agreed = Verdict(distributed.reduce_max([int(decision.verdict)])[0])
        if agreed != decision.verdict:
            decision = Decision(agreed, f"another rank reported {agreed.name} ({decision.reason or 'here: healthy'})")

        if agreed == Verdict.HEALTHY:
            if stepped:
                self.ring.tick()
                if snapshot_due:
                    self._snapshot(iteration)
        elif agreed == Verdict.OVERFLOW:
            self.skipped_steps += 1
            scale = "" if signals.loss_scale is None else f", loss scale now {signals.loss_scale:g}"
            self.io.log(f"NanGuard: harmless overflow at iter {iteration + 1}: step skipped{scale} ({decision.reason})")
        elif agreed == Verdict.STALLED:
            self.skipped_steps += 1
            self._on_stall(signals, decision)
        else:
            self._recover(signals, decision)
        self._publish(signals.loss_scale)
        return decision

    def _healthy(self, optimizer: bool) -> bool:
        return state_finite(self.io.model(), self.io.optimizers() if optimizer else ())

    def _snapshot(self, iteration: int) -> None:
        # Pinned host memory and asynchronous copies where the model lives on a GPU.
        device = next((p.device for p in self.io.model().parameters()), None)
        pin = device is not None and device.type == "cuda"
        if self._holds_no_tensors():
            # The node's leader keeps the tensors; this rank keeps the structure and its own small state.
            payload = distributed.strip_tensors(self.io.capture())[0]
        else:
            payload = copy_to_host(self.io.capture(), reuse=self.ring.recyclable(), pin=pin)
        # No host wait: the copies are queued on the current stream ahead of anything that writes the state
        # again (docs/gpu.md: why not a side stream); the host waits only when it reads the snapshot.
        _, epoch = self.io.counters()
        snap = Snapshot(iteration, epoch, payload, nbytes=payload_nbytes(payload), copied=copies_done(pin, device))
        self.ring.add(snap)

    # ------------------------------------------------------------------ remedies and rollback
    def _zero_dropout(self) -> List[Change]:
        return zero_transformer_dropout(self.io.model(), self.config.dropout_scope, self.config.dropout_exclude)

    def _apply_remedies(self, incident: int) -> List[Change]:
        changes: List[Change] = []
        if "clip" in self.config.remedies:
            target = self.config.clip_target(incident)
            for name, kwargs in self.io.clip_settings():
                change = tighten_clip(kwargs, target, target=name)
                if change:
                    changes.append(change)
                if kwargs and "max_norm" in kwargs:
                    self._clip_state[name] = float(kwargs["max_norm"])
                elif kwargs:
                    self.io.log(f"NanGuard: {name} clips by value ({kwargs}); the max_norm remedy does not apply",
                                "warning")
        if "dropout" in self.config.remedies:
            dropout = self._zero_dropout()
            self.dropout_zeroed = True
            changes.extend(dropout)
        return changes

    def _on_stall(self, signals: StepSignals, decision: Decision) -> None:
        change = self.io.make_scale_dynamic() if "scale" in self.config.remedies else None
        if change is None:
            self._recover(signals, Decision(Verdict.DIVERGED, decision.reason + "; no scale remedy available"))
            return
        self.stalls += 1
        self.scale_made_dynamic = True
        self.detector.reset()
        self.actions_tried.append(f"iter {signals.iteration + 1}: {change.target} {change.old} -> {change.new}")
        record = self._record("stalled", signals, decision, [change])
        self.incidents.write(record)
        self.io.after_incident(record)
        self.io.log(
            f"NanGuard: static loss scale stalled training at iter {signals.iteration + 1} ({decision.reason}); "
            f"{change.target}: {change.old} -> {change.new}",
            "warning",
        )

    def _diagnose(self, signals: StepSignals) -> Optional[Dict[str, Any]]:
        # A rank whose own step was clean would only re-run a clean batch: only those that saw the fault do.
        saw_fault = signals.suspicious or signals.weights_finite is False or not distributed.is_distributed()
        forward = self.io.rerun_forward() if self.config.diagnose and saw_fault else None
        if forward is None:
            return None
        try:
            snap = self.ring.newest_confirmed()
            weights = snap.ready_payload().get("state_dict") if snap is not None else None
            if not weights or not all(isinstance(v, torch.Tensor) for v in weights.values()):
                weights = None  # e.g. snapshot_copies='node' away from the node's leader: no tensors here
            scale = signals.loss_scale if signals.loss_scale is not None else _scale_of(self.io.scaler()[0])
            report = diagnose_step(self.io.model(), forward, rng_state=self.io.rerun_rng_state(),
                                   loss_scale=scale or 1.0, healthy_weights=weights,
                                   healthy_from=f"snapshot of iter {snap.iteration + 1}" if weights else "")
        except Exception as exc:  # the diagnosis must never stand between a divergence and its recovery
            report = {"error": f"{type(exc).__name__}: {exc}"}
        report["rank"] = distributed.get_rank()
        self.io.log(f"NanGuard: diagnosis of iter {signals.iteration + 1} (rank {report['rank']}): "
                    f"{summarize(report)}", "warning")
        return report

    def _recover(self, signals: StepSignals, decision: Decision) -> None:
        iteration, epoch = self.io.counters()
        # Before any remedy: the re-run needs the dropout and weights that the failing step ran with.
        self.last_diagnosis = self._diagnose(signals)
        if self.recoveries >= self.config.max_recoveries:
            self._give_up(signals, decision, NanGuardGaveUp,
                          f"the recovery budget is spent ({self.recoveries} of max_recoveries="
                          f"{self.config.max_recoveries})")
        changes = self._apply_remedies(self.recoveries + 1)
        restored: Dict[str, Any] = {}
        lost = 0
        if "rollback" in self.config.remedies:
            target = self._pick_target()
            if target is None:
                self._give_up(signals, decision, NoHealthyStateError,
                              "no healthy state to roll back to: no snapshot is confirmed yet "
                              f"(each needs confirm_steps={self.config.confirm_steps} clean steps) and no finite "
                              "checkpoint was found in the work dir", changes)
            payload, restored, snap = target
            self.io.restore(payload)
            self._last_restored = snap
            lost = max(0, iteration - int(restored["iteration"]))
            restored_iter, _ = self.io.counters()
            restored["iteration_now"] = restored_iter
        self.detector.reset()
        self.io.read_step()  # forget the failed step's probe reading
        self.recoveries += 1
        self.iterations_lost += lost
        for change in changes:
            self.actions_tried.append(f"iter {iteration + 1}: {change.target} {change.old} -> {change.new}")
        if restored:
            self.actions_tried.append(f"iter {iteration + 1}: rollback to {restored['source']} "
                                      f"(iter {restored['iteration'] + 1})")
        record = self._record("divergence", signals, decision, changes)
        record.update(restored_from=restored or None, iterations_lost=lost, epoch=epoch, diagnosis=self.last_diagnosis)
        self.incidents.write(record)
        self.io.after_incident(record)
        where = (f"rolled back to iter {restored['iteration'] + 1} from {restored['source']}, "
                 f"{lost} iteration(s) lost" if restored else "no rollback (disabled)")
        self.io.log(
            f"NanGuard: divergence at iter {iteration + 1} ({decision.reason}); recovery "
            f"{self.recoveries}/{self.config.max_recoveries}: {where}; {len(changes)} setting(s) changed",
            "warning",
        )
        for change in changes:
            self.io.log(f"NanGuard:   {change.target}: {change.old} -> {change.new}", "warning")

    def _pick_target(self) -> Optional[Tuple[Dict[str, Any], Dict[str, Any], Optional[Snapshot]]]:
        newest = self.ring.newest_confirmed()
        if newest is not None and newest is self._last_restored:
            # Recovering from it failed again before any newer state proved healthy: step further back.
            newest.failed = True
            self.io.log(f"NanGuard: the state of iter {newest.iteration + 1} diverged again; stepping back", "warning")
        self.ring.discard_unconfirmed()
        snap = self.ring.newest_confirmed()
        if snap is not None:
            self._last_restored_path = None
            payload = snap.ready_payload()
            if self.config.snapshot_copies == "node" and distributed.is_distributed():
                group, leader, _ = distributed.node_group()
                payload = distributed.broadcast_payload(payload, src=leader, group=group, known_structure=True)
            return payload, {"source": "memory", "iteration": snap.iteration}, snap
        if not self.config.restore_from_checkpoints:
            return None
        return self._checkpoint_target()

    def _holds_no_tensors(self) -> bool:
        if self.config.snapshot_copies != "node" or not distributed.is_distributed():
            return False
        return distributed.node_group()[1] != distributed.get_rank()

    def _checkpoint_target(self) -> Optional[Tuple[Dict[str, Any], Dict[str, Any], Optional[Snapshot]]]:
        if self._last_restored_path is not None:
            # Restored from it and diverged again with no snapshot confirmed since: try an older one.
            self._failed_paths.add(self._last_restored_path)
        # Rank 0 alone lists, reads and checks the files; the others receive its choice and its tensors, so
        # no shared filesystem is needed and every rank restores the same state (or gives up together).
        found = self._read_checkpoint() if distributed.get_rank() == 0 else None
        path = distributed.broadcast_object(found[0] if found else None)
        if path is None:
            return None
        payload = distributed.broadcast_payload(found[1] if found else None)
        if found is None:
            self.io.log(f"NanGuard: received checkpoint {path} from rank 0")
        self._last_restored_path = path
        return payload, {"source": path, "iteration": int(payload["meta"]["iter"])}, None

    def _read_checkpoint(self) -> Optional[Tuple[str, Dict[str, Any]]]:
        for path in self.io.checkpoint_candidates():
            if path in self._failed_paths:
                continue
            try:
                payload = self.io.load_payload(path)
            except Exception as exc:  # a truncated or foreign file must not end the recovery
                self.io.log(f"NanGuard: skipping checkpoint {path}: {type(exc).__name__}: {exc}", "warning")
                self._failed_paths.add(path)
                continue
            if not all_finite(iter_tensors(payload)):
                self.io.log(f"NanGuard: skipping checkpoint {path}: it holds non-finite values", "warning")
                self._failed_paths.add(path)
                continue
            return path, payload
        return None

    def _give_up(self, signals: StepSignals, decision: Decision, error: type, why: str,
                 changes: Sequence[Change] = ()) -> None:
        record = self._record("gave_up", signals, decision, list(changes))
        record["why"] = why
        record["diagnosis"] = self.last_diagnosis
        self.incidents.write(record)
        tried = "\n".join(f"  - {a}" for a in self.actions_tried) or "  (nothing yet)"
        log = self.incidents.path or "(no work dir: no incident log)"
        msg = (f"NanGuard gave up at iter {signals.iteration + 1}: {why}. Last divergence: {decision.reason}.\n"
               f"Tried so far:\n{tried}\nIncident log: {log}")
        self.io.log(msg, "error")
        raise error(msg)

    def _record(self, event: str, signals: StepSignals, decision: Decision, changes: List[Change]) -> Dict[str, Any]:
        return {
            "event": event,
            "iteration": signals.iteration + 1,
            "reason": decision.reason,
            "verdict": decision.verdict.name,
            "signals": signals.as_dict(),
            "actions": [c.as_dict() for c in changes],
            "recoveries": self.recoveries,
            "max_recoveries": self.config.max_recoveries,
            "world_size": distributed.get_world_size(),
        }

    def _publish(self, loss_scale: Optional[float] = None) -> None:
        scalars: Dict[str, float] = {
            "nan_guard/incidents": float(self.recoveries + self.stalls),
            "nan_guard/skipped_steps": float(self.skipped_steps),
        }
        norms = [float(kw["max_norm"]) for _, kw in self.io.clip_settings() if kw and "max_norm" in kw]
        if norms:
            scalars["nan_guard/max_norm"] = min(norms)
        if loss_scale is not None:
            scalars["nan_guard/loss_scale"] = loss_scale
        self.io.update_scalars(scalars)

    # ------------------------------------------------------------------ checkpoints
    def all_ranks_healthy(self, healthy_here: bool) -> bool:
        """Agrees across ranks on a health reading taken outside :meth:`after_iter`."""
        return distributed.reduce_max([0 if healthy_here else 1])[0] == 0

    def recover_now(self, reason: str) -> None:
        """Runs the recovery path at once (a non-finite state found outside a step's own signals)."""
        iteration, _ = self.io.counters()
        signals = StepSignals(iteration, weights_finite=False)
        self._recover(signals, Decision(Verdict.DIVERGED, reason))
        self._publish()

    def check_checkpoint(self, checkpoint: Dict[str, Any], what: str) -> None:
        """Raises :class:`UnsafeCheckpointError` if a checkpoint's tensors are not all finite."""
        if all_finite(iter_tensors(checkpoint.get("state_dict", checkpoint))) and all_finite(
            iter_tensors(checkpoint.get("optimizer", {}))
        ):
            return
        bad = first_nonfinite(
            (k, v) for k, v in dict(checkpoint.get("state_dict", {})).items() if isinstance(v, torch.Tensor)
        )
        raise UnsafeCheckpointError(
            f"{what} holds non-finite values (first: {bad or 'optimizer state'}); refusing to use it. "
            "Pick an earlier checkpoint; the incident log in the work dir says when training diverged."
        )


def _scale_of(scaler: Any) -> Optional[float]:
    if scaler is None:
        return None
    get_scale = getattr(scaler, "get_scale", None)
    if get_scale is not None:
        return float(get_scale())
    scale = getattr(scaler, "loss_scale", None)
    return float(scale) if scale is not None else None
