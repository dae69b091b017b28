"""The clip remedy: ``max_norm = min(current, target)`` on every live clip setting, never loosening one."""
from typing import Any, Dict, List, Optional, Tuple

from ...configfix.patch import KNOWN_MANUAL_FIX
from ..causes import Cause
from ..port import ClipSetting
from ..validate import Setting, check_list, check_number, is_number
from .base import Change, ConfigEntry, Context, Incident, Remedy, Run

__all__ = ["tighten_clip", "ClipRemedy"]


def tighten_clip(clip_kwargs: Optional[Dict[str, Any]], max_norm: float, target: str = "max_norm") -> Optional[Change]:
    """Sets ``clip_kwargs['max_norm'] = min(current, max_norm)`` in place; never loosens a tighter clip.

    Value clipping (``clip_value`` without ``max_norm``, MMEngine ``type='value'``) is left unchanged: a
    per-element bound of 1 is a different, far looser, constraint than a global norm of 1. Returns the
    change (named ``target``), or None when nothing changed.
    """
    return ClipSetting(target, clip_kwargs).tighten(max_norm)


def _schedule(name: str, value: Any) -> Optional[Tuple[float, ...]]:
    if value is None:
        return None
    targets = check_list(name, value)
    if not targets:
        raise ValueError(f"{name} must not be empty, got {value!r}")
    return tuple(check_number(f"{name} entry", t) for t in targets)


class ClipRemedy(Remedy):
    """Half of the ladder's first rung: every norm clip to ``min(current, target)`` (the schedule's target for this
    incident); the bound it set per clip setting is re-applied on resume."""

    name = "clip"
    order = 10
    label = KNOWN_MANUAL_FIX.format(max_norm=1)
    causes = (Cause.DYNAMICS, Cause.UNKNOWN)
    settings = (
        Setting("max_norm", 1.0, is_number(), "target of the clip remedy, ``max_norm = min(current, target)``: the "
                "known manual fix's 1."),
        Setting("max_norm_schedule", None, _schedule, "optional targets per incident (``[10, 3, 1]`` tightens step "
                "by step); the last one stays. Overrides ``max_norm``."),
    )
    state = ("clip",)
    idle = {"max_norm": None}

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        #: The max_norm this remedy set, per clip setting.
        self.clip: Dict[str, float] = {}

    @property
    def bounds(self) -> Dict[str, float]:
        """The max_norm this remedy set, per clip setting."""
        return dict(self.clip)

    def target(self, incident: int) -> float:
        """max_norm target for the ``incident``-th recovery (1-based)."""
        schedule = self.config.max_norm_schedule
        targets = list(schedule) if schedule is not None else [self.config.max_norm]
        return float(targets[min(max(incident, 1), len(targets)) - 1])

    def in_effect(self, ctx: Context) -> bool:
        target = self.target(ctx.incident)
        return all(c.max_norm is not None and c.max_norm <= target for c in ctx.io.clip_settings() if c.kind == "norm")

    def before_restore(self, run: Run, incident: Incident) -> List[Change]:
        changes: List[Change] = []
        target = self.target(incident.number)
        for clip in run.io.clip_settings():
            change = clip.tighten(target)
            if change:
                changes.append(change)
            if clip.kind == "norm":
                self.clip[clip.name] = clip.max_norm
            elif clip.kind == "value":
                run.io.log(f"NanGuard: {clip.name} clips by value ({clip.kwargs}); the max_norm remedy does not "
                           "apply", "warning")
        return changes

    def on_start(self, run: Run) -> List[Change]:
        io, changes = run.io, []
        for clip in io.clip_settings():
            if clip.name in self.clip:
                change = clip.tighten(self.clip[clip.name])
                if change:
                    io.log(f"NanGuard: resumed remedy {clip.name}: {change.old:g} -> {change.new:g}")
                    changes.append(change)
        return changes

    def load_value(self, key: str, value: Any) -> Any:
        return {str(k): float(v) for k, v in dict(value or {}).items()}

    def summary(self, io: Any) -> Dict[str, Any]:
        return {"max_norm": min(self.clip.values()) if self.clip else None}

    def config_entry(self, io: Any) -> ConfigEntry:
        return ConfigEntry(fix={"max_norm": min(self.clip.values())} if self.clip else {})
