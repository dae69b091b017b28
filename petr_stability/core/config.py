"""Every setting of the guard (the hook's arguments), validated when the hook is built."""
import difflib
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Sequence

from .remedies.registry import REMEDIES
from .validate import check_bool, check_choice, check_indices, check_int, check_list, check_names, check_number
from .watch.detector import DetectorConfig

__all__ = ["GuardConfig", "REMEDIES"]

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
        quarantine_fraction: at most this fraction of the dataset's samples is quarantined as bad data (at least
            one); a batch past it is refused and skipped, and refused samples that break the run again stop it with
            :class:`~.errors.BadDataError`. Defaults to 0.001.
        first_iterations: a data divergence within this many iterations is structural at once (the first batches
            break the weights the run started from), unless the batch known to be good trains fine or the batch's
            own values are non-finite (evidence that the data is bad). 0 turns the rule off: a bug that breaks every
            batch is stopped by the batch known to be good breaking too. Defaults to 0.
        spike_window / spike_z / spike_warmup: the grad_norm early warning (a running z-score over the host float
            the runner already logs): window, threshold in standard deviations, values before it speaks.
            Defaults to 100, 3.0, 25.
        adaptive_clip: clip at the recent mean + ``spike_z`` standard deviations of grad_norm, never looser than
            the configured ``max_norm`` (docs/demo.md says when it helps). Defaults to False.
        snapshot_copies: ``'rank'`` (every rank keeps its own snapshots) or ``'node'`` (one copy per node,
            on the node's lowest rank, sent to the others over gloo on restore; for replicated DDP state only,
            not sharded optimizers). Defaults to ``'rank'``.
        quarantine_recurring: a sample (by dataset index) that makes a step go wrong in two different epochs (an
            fp32 step skipped, an fp16 overflow its own values caused, a divergence) is named in one log line and one
            record and quarantined within ``quarantine_fraction``. Defaults to True.
        fp32_modules: modules (names as ``model.named_modules()`` gives them) run in fp32 from the start: what an
            earlier run's forward-overflow remedy learnt, as its patched config carries it. Defaults to ().
        quarantine: dataset indices never served, from the start (an earlier run's quarantine, as its patched config
            carries it); they do not use up this run's ``quarantine_fraction``. Defaults to ().
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
    fp32_modules: Sequence[str] = ()
    quarantine: Sequence[int] = ()
    quarantine_recurring: bool = True
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
        self.fp32_modules = check_names("fp32_modules", self.fp32_modules)
        self.quarantine = check_indices("quarantine", self.quarantine)
        check_bool("quarantine_recurring", self.quarantine_recurring)

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any], owner: str = "NanGuardHook") -> "GuardConfig":
        """The settings from a hook's keyword arguments; an unknown name is refused naming it and the closest
        argument (``TypeError``), not the dataclass behind it."""
        names = [f.name for f in fields(cls) if f.init]
        for key in arguments:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"{owner} got an unknown argument {key!r}{hint} (its arguments: "
                                "docs/configuration.md)")
        return cls(**arguments)

    def clip_target(self, incident: int) -> float:
        """max_norm target for the ``incident``-th recovery (1-based)."""
        targets = list(self.max_norm_schedule) if self.max_norm_schedule is not None else [self.max_norm]
        return float(targets[min(incident, len(targets)) - 1])
