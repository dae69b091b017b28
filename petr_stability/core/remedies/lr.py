"""The learning-rate remedy: the rate times a factor, now and in every later value of its schedules."""
import math
from typing import Any, Dict, Iterable, List, Mapping

from ..causes import Cause
from ..validate import Setting, is_bool, is_int, is_number
from .base import Change, ConfigEntry, Context, Incident, Remedy, Run, Step, When

__all__ = ["scale_lr", "LrBackoff"]


def _check_factor(factor: Any) -> float:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (0 < factor < math.inf):
        raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
    return float(factor)


#: Scheduler attributes holding absolute learning rates (lists, or MMCV 1.x dicts of lists): torch's
#: ``base_lrs`` / ``_last_lr`` / ``max_lrs`` / ``min_lrs``, MMEngine's ``base_values`` / ``_last_value``, MMCV 1.x
#: ``LrUpdaterHook``'s ``base_lr`` / ``regular_lr``.
_SCHEDULER_LISTS = ("base_lrs", "_last_lr", "max_lrs", "min_lrs", "base_values", "_last_value", "base_lr",
                    "regular_lr")
#: Scalar floor attributes: torch/MMEngine ``eta_min``, MMCV 1.x ``min_lr``. Ratios (``eta_min_ratio``,
#: ``min_lr_ratio``) follow the scaled base by themselves.
_SCHEDULER_SCALARS = ("eta_min", "min_lr")
#: Param-group keys holding learning rates: the live one, torch's ``initial_lr``, OneCycle's ``max_lr``/``min_lr``.
_GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")


def _scaled(value: Any, factor: float) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value * factor
    if isinstance(value, list):
        return [_scaled(v, factor) for v in value]
    if isinstance(value, tuple):
        return tuple(_scaled(v, factor) for v in value)
    if isinstance(value, dict):
        return {k: _scaled(v, factor) for k, v in value.items()}
    return value


def scale_lr(optimizers: Iterable[Any], factor: float, schedulers: Iterable[Any] = ()) -> List[Change]:
    """Multiplies the learning rate by ``factor`` now and in every later value of its schedules, in place.

    Every param group's ``lr`` (and ``initial_lr``, OneCycle's ``max_lr`` / ``min_lr`` where present) is scaled;
    each scheduler's stored bases and floors too, duck-typed so no framework is imported: torch's LR schedulers
    (``base_lrs``, ``_last_lr``, ``eta_min``, ...), MMEngine's param schedulers whose ``param_name`` is ``'lr'``
    (``base_values``, ``_last_value``, ``eta_min``; a momentum scheduler is left alone), MMCV 1.x's
    ``LrUpdaterHook`` (``base_lr``, ``regular_lr``, ``min_lr``). Chainable schedules (cosine's recursive form,
    step, warmup factors) then continue at ``factor`` times the unscaled schedule, closed-form ones too.

    Args:
        optimizers: torch optimizers (anything with ``param_groups``).
        factor: the multiplier, > 0 (0.5 halves).
        schedulers: LR schedulers or MMCV 1.x LR hooks to scale with them. Defaults to ().

    Returns:
        One :class:`Change` per value changed (``optimizer0.group0.lr``, ``CosineAnnealingLR.base_lrs``, ...).

    Raises:
        ValueError: ``factor`` is not a finite number > 0.
    """
    factor = _check_factor(factor)
    changes: List[Change] = []
    for i, opt in enumerate(optimizers):
        for j, group in enumerate(opt.param_groups):
            for key in _GROUP_KEYS:
                value = group.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    group[key] = value * factor
                    changes.append(Change(f"optimizer{i}.group{j}.{key}", value, group[key]))
    for sched in schedulers:
        if getattr(sched, "param_name", "lr") != "lr":
            continue
        name = type(sched).__name__
        for attr in _SCHEDULER_LISTS + _SCHEDULER_SCALARS:
            value = getattr(sched, attr, None)
            if value is None or isinstance(value, bool) or (attr in _SCHEDULER_SCALARS and value == 0):
                continue
            if not isinstance(value, (int, float, list, tuple, dict)):
                continue
            new = _scaled(value, factor)
            setattr(sched, attr, new)
            changes.append(Change(f"{name}.{attr}", value, new))
    return changes


class LrBackoff(Remedy):
    """The ladder's second rung: every learning rate (and schedule) times ``lr_backoff``. It lasts: a restore to a
    state from before a backoff brings that state's rates back to the run's factor (its restore tag).

    It also answers a forward overflow whose replay shows the weights grew into it (``weights_grew``: the same batch
    stays finite in fp16 on the healthy weights), beside the fp32 remedy: the module in fp32 stops the overflow,
    the lower rate stops the growth that led there (``lr_on_overflow``; docs/demo.md measures both): by
    ``overflow_lr_backoff``, or by ``lr_backoff`` where the run left its stability band since its newest healthy
    state (``unstable_before``: the loss exploding says the rate is the cause; docs/zoo.md). An overflow
    that the healthy weights show too is the batch's or the architecture's: no learning-rate change.

    With ``lr_rewarm=N`` (0: never) it gives the rate back once the run is stable again: after N healthy iterations
    in a row (a rollback starts the count again) the factor is divided by ``lr_backoff`` (never above 1), then again
    after N more, until the schedule's own rate is back. Trouble that returns meets the ladder as before (a new chain
    whose first rung is in force climbs to this one: backed off again), and every re-warm that trouble followed
    doubles the wait before the next."""

    name = "lr"
    order = 50
    label = "learning rate x {lr_backoff:g} (schedules too)"
    causes = (Cause.DYNAMICS, Cause.UNKNOWN)
    assists = (Cause.FORWARD_OVERFLOW,)
    settings = (Setting("lr_backoff", 0.125, is_number(0.0, 1.0), "learning-rate factor of the dynamics ladder's "
                        "learning-rate rung (every param group and schedule). Tuned on the model zoo's seeds 0-9: a "
                        "rate 5-8x too high trains to its reference's quality at 0.125, not at 0.5 (docs/zoo.md)."),
                Setting("overflow_lr_backoff", 0.5, is_number(0.0, 1.0), "learning-rate factor of "
                        "``lr_on_overflow``, beside the module put in fp32, where the loss was stable up to the "
                        "overflow (tuned on the demo's seeds 0-9: 0.5 beats 0.25 and 0.125 there, docs/demo.md; "
                        "after a loss explosion ``lr_backoff`` applies, docs/zoo.md)."),
                Setting("lr_on_overflow", True, is_bool, "a forward overflow whose batch stays finite in fp16 on "
                        "the healthy weights (the weights grew into it: the learning rate drove them there) also "
                        "backs the learning rate off by ``overflow_lr_backoff``, beside the module in fp32; False: the "
                        "module in fp32 only (docs/demo.md measures both)."),
                Setting("lr_min_factor", 1 / 64, is_number(0.0, 1.0), "the dynamics ladder's learning-rate "
                        "rung repeats, one backoff per incident of a chain, while the factor stays at or above this "
                        "(1/64: two rungs at the default lr_backoff); then the next rung."),
                Setting("lr_rewarm", 0, is_int(0), "healthy iterations in a row after a learning-rate backoff "
                        "before the rate is raised again by ``1 / lr_backoff`` toward the schedule's (never above "
                        "it); 0: a backoff lasts the run (docs/demo.md measures both)."))
    state = ("lr_factor", "lr_rewarms", "lr_rewarm_wait", "lr_healthy_run", "lr_last_healthy")
    tags = ("lr_factor",)
    idle = {"lr_factor": 1.0}

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        #: The product of every learning-rate backoff (and re-warm) so far.
        self.lr_factor = 1.0
        #: Each re-warm: its iteration, the factor before and after.
        self.lr_rewarms: List[Dict[str, Any]] = []
        #: Healthy iterations the next re-warm waits for (``lr_rewarm``, doubled by every re-warm trouble followed).
        self.lr_rewarm_wait = 0
        #: Healthy iterations in a row since the last backoff, re-warm or rollback, and the latest one's number.
        self.lr_healthy_run = 0
        self.lr_last_healthy = -1

    def match(self, ctx: Context) -> bool:
        if ctx.event == When.HEALTHY:  # every healthy step: host numbers only
            return self.config.lr_rewarm > 0 and self.lr_factor < 1.0
        if ctx.event == When.AFTER_RESTORE and ctx.cls is not None and ctx.cls.cause == Cause.FORWARD_OVERFLOW:
            return self.config.lr_on_overflow and bool(ctx.cls.signals.get("weights_grew"))
        return ctx.event != When.RESTORED or ctx.io.restores_lr()

    def can_repeat(self, ctx: Context) -> bool:
        return self.lr_factor * self.config.lr_backoff >= self.config.lr_min_factor * (1 - 1e-9)

    def on_restored(self, run: Run, incident: Incident, restored: Mapping[str, Any]) -> List[Change]:
        # The restored optimizer and schedules predate a backoff: bring them back to the run's factor.
        then = float(restored.get("lr_factor", 1.0))
        return scale_lr(run.io.optimizers(), self.lr_factor / then, run.io.restored_lr_schedulers())

    def after_restore(self, run: Run, incident: Incident) -> List[Change]:
        # A forward overflow the weights grew into under a stable loss: the overflow's own factor. One that came
        # after the loss exploded (``unstable_before``) is the rate's doing: the dynamics factor.
        cls = incident.cls
        factor = self.config.overflow_lr_backoff if cls is not None and cls.cause == Cause.FORWARD_OVERFLOW and (
            not cls.signals.get("unstable_before")) else self.config.lr_backoff
        self.lr_factor *= factor
        # A backoff after a re-warm: that re-warm came too soon, the next one waits twice as long.
        self.lr_rewarm_wait = self.lr_rewarm_wait * 2 if self.lr_rewarms else self.config.lr_rewarm
        self.lr_healthy_run, self.lr_last_healthy = 0, -1
        return scale_lr(run.io.optimizers(), factor, run.io.lr_schedulers())

    def on_healthy(self, run: Run, step: Step) -> List[Change]:
        if step.iteration <= self.lr_last_healthy:  # the iteration went back: a rollback, stability counts afresh
            self.lr_healthy_run = 0
        self.lr_last_healthy = step.iteration
        self.lr_healthy_run += 1
        wait = self.lr_rewarm_wait or self.config.lr_rewarm  # a factor carried in from a patched config set no wait
        if self.lr_healthy_run < wait:
            return []
        raised = self.lr_factor / self.config.lr_backoff
        old, self.lr_factor = self.lr_factor, 1.0 if raised > 1.0 - 1e-9 else raised  # 0.3 * 0.3 / 0.3 / 0.3 is 1
        self.lr_rewarms.append({"iteration": step.iteration, "from": old, "to": self.lr_factor})
        self.lr_healthy_run = 0
        changes = scale_lr(run.io.optimizers(), self.lr_factor / old, run.io.lr_schedulers())
        run.io.log(f"NanGuard: learning rate re-warmed after {wait} healthy iterations (lr_rewarm): factor {old:g} -> "
                   f"{self.lr_factor:g} (schedules too)")
        return changes

    def load_value(self, key: str, value: Any) -> Any:
        if key == "lr_factor":
            return float(value)
        return [dict(r) for r in value] if key == "lr_rewarms" else int(value)

    def summary(self, io: Any) -> Dict[str, Any]:
        out: Dict[str, Any] = {"lr_factor": self.lr_factor}
        if self.lr_rewarms:
            out["lr_rewarms"] = [dict(r) for r in self.lr_rewarms]
        return out

    def config_entry(self, io: Any) -> ConfigEntry:
        if self.lr_factor == 1.0:
            return ConfigEntry()
        # Written into the config's lr and schedule; carried instead where it holds no lr (a user's scheduler).
        return ConfigEntry(fix={"lr_factor": self.lr_factor}, fallback={"lr_factor": {"lr_factor": self.lr_factor}})

    def reapply(self, carried: Mapping[str, Any], ctx: Context) -> List[Change]:
        """The next run's start, from a factor carried where its config holds no lr: every rate and schedule times
        it (a resumed run's optimizer holds the backed-off rates already: never at START)."""
        factor = float(carried.get("lr_factor", 1.0))
        if factor == 1.0:
            return []
        self.lr_factor = factor
        return scale_lr(ctx.io.optimizers(), factor, ctx.io.lr_schedulers())
