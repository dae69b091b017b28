"""The adaptive clip: on healthy steps, clip at the recent grad_norm mean + ``spike_z`` standard deviations, never
looser than the configured (or the clip remedy's) ``max_norm``."""
from typing import Any, Dict, List

from .base import Context, Remedy, When
from .change import Change
from .clip import ClipRemedy

__all__ = ["AdaptiveClip"]


class AdaptiveClip(Remedy):
    """Switched by ``adaptive_clip`` (not ``remedies=``); reads the grad-norm monitor the watch keeps
    (``ctx.extra['spikes']``)."""

    name = "adaptive_clip"
    switched = False
    when = When.HEALTHY

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        #: The configured max_norm per clip setting (lowered by the clip remedy): never clipped above.
        self.base: Dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.config.adaptive_clip)

    def resume(self, io: Any) -> None:
        self.base = {c.name: c.max_norm for c in io.clip_settings() if c.kind == "norm"}

    def apply(self, ctx: Context) -> List[Change]:
        spikes = ctx.extra["spikes"]
        if self.enabled and spikes.ready:
            for clip in ctx.io.clip_settings():
                base = self.base.get(clip.name)
                if clip.kind == "norm" and base is not None:
                    clip.set_max_norm(spikes.clip_bound(base))
        return []

    def after_incident(self, ctx: Context) -> None:
        for name, value in ctx.remedies.get(ClipRemedy.name).bounds.items():
            self.base[name] = min(self.base.get(name, value), value)
