"""The clip remedy: ``max_norm = min(current, target)`` on every live clip setting, never loosening one."""
import math
from typing import Any, Dict, Optional

from .change import Change

__all__ = ["tighten_clip"]


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
