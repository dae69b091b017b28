"""Tells the loss scaler's ordinary overflows from a real divergence, one optimizer step at a time."""
import enum
import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

__all__ = ["Verdict", "StepSignals", "DetectorConfig", "DivergenceDetector", "Decision"]


class Verdict(enum.IntEnum):
    """Outcome of one step, ordered by severity so that ranks agree by taking the maximum."""

    HEALTHY = 0
    #: An applied, finite step whose loss or grad_norm left the run's stable band (watch/spikes.py): healthy to the
    #: detector, trouble to the restore points (no snapshot is confirmed by it; its batch is no known-good one).
    UNSTABLE = 1
    #: A skipped step the loss scaler (or, in fp32, the guard's skip) absorbed, or a non-finite loss whose
    #: gradients were finite: harmless on its own, counted toward ``patience``.
    OVERFLOW = 2
    #: A static loss scale is skipping every step: weights are intact but nothing trains.
    STALLED = 3
    #: Training state is, or is about to be, poisoned: remedies and rollback are due.
    DIVERGED = 4


@dataclass
class StepSignals:
    """What one training iteration shows, read after its optimizer step.

    Attributes:
        iteration: the iteration's 1-based number (docs/how-it-works.md, "Iteration numbering").
        stepped: False on gradient-accumulation iterations that did not step (no verdict is drawn there).
        grad_norm: the unscaled gradient norm of this step, or None where it is not observed.
        loss: the total loss of this iteration (per rank), or None.
        loss_scale: the scale after the scaler's update; only read on suspicious steps (it costs a sync).
        scale_mode: ``'dynamic'``, ``'static'`` or ``'none'`` (fp32: a non-finite gradient is applied).
        step_applied: whether the optimizer really applied this step's update (False when a scaler or
            the guard's fp32 skip dropped it). None means unknown: inferred from ``scale_mode``.
        weights_finite: result of a weight/buffer health check run on this step, or None if none ran.
        trouble_since: the first unstable step of the trouble in course when an incident came (watch/spikes.py), or
            None: how long the loss or grad_norm had been out of the run's band before it.
        unstable_since: the first step judged unstable since the newest healthy state (the newest confirmed
            snapshot, else the run's start) when an incident came, the trouble since ended included; None: the run
            was stable since that state.
    """

    iteration: int
    stepped: bool = True
    grad_norm: Optional[float] = None
    loss: Optional[float] = None
    loss_scale: Optional[float] = None
    scale_mode: str = "none"
    step_applied: Optional[bool] = None
    weights_finite: Optional[bool] = None
    trouble_since: Optional[int] = None
    unstable_since: Optional[int] = None

    @property
    def suspicious(self) -> bool:
        """A non-finite grad_norm or loss: worth reading the scale and checking the weights."""
        return not _finite(self.grad_norm) or not _finite(self.loss)

    def as_dict(self) -> Dict[str, Any]:
        return {k: (_jsonable(v)) for k, v in asdict(self).items()}


def _finite(value: Optional[float]) -> bool:
    return value is None or math.isfinite(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


@dataclass
class DetectorConfig:
    """Thresholds of the detector; each default carries its reason.

    Attributes:
        patience: K. Consecutive non-finite steps that the loss scaler no longer answers by lowering the
            scale (or, in fp32 with the guard's skip, consecutive skipped steps), and consecutive non-finite
            losses, before a divergence is declared. One or two in a row are ordinary (a bad batch, an
            overflow right after the scale grew); three means the scaler is not fixing it. Defaults to 3.
        min_loss_scale: a dynamic scale below this is a divergence. At 1.0 fp16 gradients are no longer
            amplified, so overflowing still means the gradients themselves are Inf/NaN (Megatron and
            DeepSpeed floor their scalers at 1 for this reason). Defaults to 1.0.
        static_patience: M. Consecutive skipped steps under a static scale before the run is declared
            stalled. A static scale never backs off, so once gradients outgrow it every step is skipped;
            one or two skips at PETR's ``loss_scale=512.`` are ordinary. Defaults to 5.
        max_scale_fall: F. A streak of skipped steps during which the dynamic scale falls to ``F`` times below
            the *fitted* scale is a divergence. The fitted scale is the scale after the first skip of the latest
            streak that followed an applied step: the gradients fitted under about twice that, so falling
            ``F``-fold below it means they grew ``2F``-fold within one streak, which no scale explains (a forward
            pass that overflows fp16 overflows at every scale). The scaler's own calibration at the start
            (``init_scale`` 2**16 or 2**30 halving 6-14 times before the first applied step) never counts: nothing
            is fitted yet; nor does calibrating again from the start state after a rollback (it comes down from
            above to the same level). Measured (docs/demo.md, "Detecting sooner"): ordinary streaks after an
            applied step are one skip long (a batch past the scale's headroom); at 16 and the usual backoff of 0.5
            the fifth consecutive skip fires, against the eleventh or twelfth by ``min_loss_scale`` from 1024.
            ``math.inf`` turns the rule off. Defaults to 16.0.
        fall_warmup: applied steps of the run before the ``max_scale_fall`` rule applies: while the rate warms up the
            gradients grow step by step and a scale fitted after a few steps falls with them, which a healthy run's
            scaler settles by itself (measured on the model zoo's causal transformer at its stable rate: a fall of 16x
            after 2 applied steps, the scale then settling at 64). The guard passes ``scale_fall_warmup``. Defaults
            to 20.
    """

    patience: int = 3
    min_loss_scale: float = 1.0
    static_patience: int = 5
    max_scale_fall: float = 16.0
    fall_warmup: int = 20

    def __post_init__(self) -> None:
        if isinstance(self.fall_warmup, bool) or not isinstance(self.fall_warmup, int) or self.fall_warmup < 0:
            raise ValueError(f"fall_warmup must be an integer >= 0, got {self.fall_warmup!r}")
        for name in ("patience", "static_patience"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.min_loss_scale, (int, float)) or not (0 < self.min_loss_scale < math.inf):
            raise ValueError(f"min_loss_scale must be a finite number > 0, got {self.min_loss_scale!r}")
        if (isinstance(self.max_scale_fall, bool) or not isinstance(self.max_scale_fall, (int, float))
                or not (1 < self.max_scale_fall <= math.inf)):
            raise ValueError(f"max_scale_fall must be a number > 1 (math.inf: off), got {self.max_scale_fall!r}")


@dataclass
class Decision:
    """The detector's verdict on one step and why."""

    verdict: Verdict
    reason: str = ""
    #: The first skipped step of a streak that follows an applied step: its weights are the last applied step's,
    #: the closest restore point before the streak (the guard keeps it while the streak lasts).
    streak_start: bool = False


class DivergenceDetector:
    """Stateful per-step classifier; no framework types, no tensors.

    Rules, in order (first match wins):

    1. non-finite weights, buffers or optimizer state: DIVERGED at once;
    2. fp32 (``scale_mode='none'``) and a non-finite *gradient* that was applied: DIVERGED at once;
    3. a dynamic scale below ``min_loss_scale``: DIVERGED;
    4. ``patience`` consecutive non-finite losses: DIVERGED (the forward itself is non-finite; the loss is
       computed before scaling, so no scale can cause or cure it). In fp32 a non-finite loss with finite
       gradients counts here and nowhere else;
    5. ``patience`` consecutive non-finite steps whose dynamic scale did not fall, or ``patience`` consecutive
       fp32 steps skipped for a non-finite gradient, or a skip streak whose dynamic scale fell
       ``max_scale_fall``-fold below the scale the gradients fitted (a streak no scale explains; after the first
       ``fall_warmup`` applied steps of the run): DIVERGED;
    6. ``static_patience`` consecutive skipped steps under a static scale: STALLED;
    7. any other non-finite step: OVERFLOW (the scaler or the guard's fp32 skip kept it out of the weights, or
       only the loss was non-finite);
    8. otherwise HEALTHY, and every streak resets.
    """

    def __init__(self, config: Optional[DetectorConfig] = None) -> None:
        self.config = config or DetectorConfig()
        #: The dynamic scale after the first skip of the latest streak that followed an applied step: the
        #: gradients fitted under about twice it. Kept across :meth:`reset`.
        self.fitted_scale: Optional[float] = None
        #: Applied steps of the run so far (kept across :meth:`reset`): the ``max_scale_fall`` rule waits for warm-up.
        self.applied_steps = 0
        self.reset()

    def reset(self) -> None:
        """Forgets streaks (after a rollback the state that produced them is gone) and that the last step was
        applied; the fitted scale stays (a restored scaler is at or above it, or calibrates back down to it)."""
        self._clear_streaks()
        #: The last optimizer step was applied (since the start or the last reset).
        self.applied = False

    def _clear_streaks(self) -> None:
        self.overflow_streak = 0
        self.stuck_streak = 0
        self.loss_streak = 0
        self.last_scale: Optional[float] = None

    def observe(self, s: StepSignals) -> Decision:
        """Classifies one iteration; iterations that did not step change nothing. The reason names the signal."""
        cfg = self.config
        if s.weights_finite is False:
            return Decision(Verdict.DIVERGED, "non-finite weights, buffers or optimizer state")
        if not s.stepped:
            return Decision(Verdict.HEALTHY, "no optimizer step on this iteration")
        if not s.suspicious:
            self._clear_streaks()
            self.applied = True
            self.applied_steps += 1
            return Decision(Verdict.HEALTHY)

        grad_bad, loss_bad = not _finite(s.grad_norm), not _finite(s.loss)
        self.loss_streak = self.loss_streak + 1 if loss_bad else 0
        what = f"grad_norm={s.grad_norm}, loss={s.loss}"
        if s.scale_mode == "none":
            return self._observe_fp32(s, grad_bad, what)
        self.overflow_streak += 1
        starts = s.scale_mode == "dynamic" and self.overflow_streak == 1 and self.applied and s.loss_scale is not None
        if starts:
            self.fitted_scale = s.loss_scale
        self.applied = False
        if s.scale_mode == "dynamic" and s.loss_scale is not None and s.loss_scale < cfg.min_loss_scale:
            return Decision(
                Verdict.DIVERGED, f"dynamic loss scale fell to {s.loss_scale:g} < min_loss_scale={cfg.min_loss_scale:g}"
            )
        if self.loss_streak >= cfg.patience:
            return Decision(Verdict.DIVERGED, f"{self.loss_streak} consecutive non-finite losses ({what})")
        if s.scale_mode == "dynamic":
            fell = self.last_scale is None or s.loss_scale is None or s.loss_scale < self.last_scale
            self.stuck_streak = 0 if fell else self.stuck_streak + 1
            self.last_scale = s.loss_scale
            if self.stuck_streak >= cfg.patience:
                return Decision(
                    Verdict.DIVERGED,
                    f"{self.stuck_streak} consecutive overflows with the loss scale no longer falling ({what})",
                )
            if self.fitted_scale is not None and s.loss_scale is not None and self.applied_steps >= cfg.fall_warmup \
                    and s.loss_scale * cfg.max_scale_fall <= self.fitted_scale:
                return Decision(
                    Verdict.DIVERGED,
                    f"{self.overflow_streak} consecutive skipped steps with the loss scale down to {s.loss_scale:g}, "
                    f"{self.fitted_scale / s.loss_scale:g}x below the scale the gradients fitted "
                    f"({self.fitted_scale:g}; max_scale_fall={cfg.max_scale_fall:g}): no scale explains the "
                    f"overflows ({what})",
                )
        elif self.overflow_streak >= cfg.static_patience:
            return Decision(
                Verdict.STALLED,
                f"{self.overflow_streak} consecutive skipped steps under a static loss scale of {s.loss_scale}",
            )
        return Decision(Verdict.OVERFLOW, f"skipped step ({what}), streak {self.overflow_streak}", streak_start=starts)

    def _observe_fp32(self, s: StepSignals, grad_bad: bool, what: str) -> Decision:
        # No loss scaler: a non-finite gradient is never ordinary. It is a divergence when it reached the weights,
        # and a skipped step (streak counted) when the guard's skip kept it out. A non-finite loss whose
        # gradients are finite (a logging-only loss term) never touched the weights: only its streak counts.
        cfg = self.config
        applied = s.step_applied if s.step_applied is not None else True
        if grad_bad and applied:
            return Decision(Verdict.DIVERGED, f"fp32 step applied a non-finite gradient ({what})")
        self.overflow_streak = self.overflow_streak + 1 if grad_bad else 0
        if self.loss_streak >= cfg.patience:
            return Decision(Verdict.DIVERGED, f"{self.loss_streak} consecutive non-finite losses ({what})")
        if self.overflow_streak >= cfg.patience:
            return Decision(Verdict.DIVERGED,
                            f"{self.overflow_streak} consecutive skipped fp32 steps: non-finite gradients ({what})")
        if grad_bad:
            return Decision(Verdict.OVERFLOW, f"fp32 step skipped: non-finite gradient ({what}), "
                                              f"streak {self.overflow_streak}")
        return Decision(Verdict.OVERFLOW, f"non-finite loss with finite gradients ({what}), streak "
                                          f"{self.loss_streak}; the step was applied")

    def state_dict(self) -> Dict[str, Any]:
        return {
            "overflow_streak": self.overflow_streak,
            "stuck_streak": self.stuck_streak,
            "loss_streak": self.loss_streak,
            "last_scale": self.last_scale,
            "fitted_scale": self.fitted_scale,
            "applied_steps": self.applied_steps,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.overflow_streak = int(state.get("overflow_streak", 0))
        self.stuck_streak = int(state.get("stuck_streak", 0))
        self.loss_streak = int(state.get("loss_streak", 0))
        self.last_scale = state.get("last_scale")
        # Not restored: a resumed scaler may start again from its init_scale, and a step applied before the save is
        # no evidence that the gradients fit that scale.
        self.applied = False
        self.applied_steps = int(state.get("applied_steps", 0))
        fitted = state.get("fitted_scale")
        self.fitted_scale = None if fitted is None else float(fitted)
