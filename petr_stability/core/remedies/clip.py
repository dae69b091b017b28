"""The clip remedy: ``max_norm = min(current, target)`` on every live clip setting, never loosening one."""
import math
from typing import Any, Dict, List, Optional

from ...configfix.fix import KNOWN_MANUAL_FIX
from ..causes import Cause
from .base import Context, Remedy, When
from .change import Change

__all__ = ["tighten_clip", "ClipRemedy"]


def tighten_clip(clip_kwargs: Optional[Dict[str, Any]], max_norm: float, target: str = "max_norm") -> Optional[Change]:
    """Sets ``clip_kwargs['max_norm'] = min(current, max_norm)`` in place; never loosens a tighter clip.

    Value clipping (``clip_value`` without ``max_norm``, MMEngine ``type='value'``) is left unchanged: a
    per-element bound of 1 is a different, far looser, constraint than a global norm of 1. Returns the
    change, or None when nothing changed.
    """
    if max_norm <= 0 or not math.isfinite(max_norm):
        raise ValueError(f"max_norm must be a finite number > 0, got {max_norm!r}")
    if not clip_kwargs or "max_norm" not in clip_kwargs:
        return None
    current = float(clip_kwargs["max_norm"])
    if current <= max_norm:
        return None
    clip_kwargs["max_norm"] = max_norm
    return Change(target, current, max_norm)


class ClipRemedy(Remedy):
    """Half of the ladder's first rung: every norm clip to ``min(current, target)`` (the schedule's target for this
    incident); the bound it set per clip setting is re-applied on resume."""

    name = "clip"
    causes = (Cause.DYNAMICS, Cause.UNKNOWN)
    rung = 1
    rung_name = KNOWN_MANUAL_FIX.format(max_norm=1)
    when = When.BEFORE_RESTORE
    state_keys = ("clip",)
    fixes = (("max_norm", "max_norm"),)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        #: The max_norm this remedy set, per clip setting.
        self.bounds: Dict[str, float] = {}

    def in_effect(self, ctx: Context) -> bool:
        target = self.config.clip_target(ctx.incident)
        return not self.enabled or all(c.max_norm is not None and c.max_norm <= target
                                       for c in ctx.io.clip_settings() if c.kind == "norm")

    def apply(self, ctx: Context) -> List[Change]:
        if not self.enabled:
            return []
        changes: List[Change] = []
        target = self.config.clip_target(ctx.incident)
        for clip in ctx.io.clip_settings():
            change = clip.tighten(target)
            if change:
                changes.append(change)
            if clip.kind == "norm":
                self.bounds[clip.name] = clip.max_norm
            elif clip.kind == "value":
                ctx.io.log(f"NanGuard: {clip.name} clips by value ({clip.kwargs}); the max_norm remedy does not "
                           "apply", "warning")
        return changes

    def resume(self, io: Any) -> None:
        for clip in io.clip_settings():
            if clip.name in self.bounds:
                change = clip.tighten(self.bounds[clip.name])
                if change:
                    io.log(f"NanGuard: resumed remedy {clip.name}: {change.old:g} -> {change.new:g}")

    def state_dict(self) -> Dict[str, Any]:
        return {"clip": dict(self.bounds)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.bounds = {str(k): float(v) for k, v in dict(state.get("clip", {})).items()}

    def summary(self, io: Any) -> Dict[str, Any]:
        return {"max_norm": min(self.bounds.values()) if self.bounds else None}
