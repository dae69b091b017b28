"""The adaptive clip: on healthy steps, clip at the recent grad_norm mean + ``spike_z`` standard deviations, never
looser than the configured (or the clip remedy's) ``max_norm``."""
from typing import Any, Dict

from ..validate import Setting, is_bool
from .base import Remedy, Run, Step
from .clip import ClipRemedy

__all__ = ["AdaptiveClip"]


class AdaptiveClip(Remedy):
    """Switched by ``adaptive_clip`` (not ``remedies=``); reads the grad-norm monitor the watch keeps
    (``ctx.extra['spikes']``) and follows the clip remedy's bound after each incident."""

    name = "adaptive_clip"
    order = 100
    label = "adaptive clip"
    switch = "adaptive_clip"
    settings = (Setting("adaptive_clip", False, is_bool, "clip at the recent mean + ``spike_z`` standard deviations "
                        "of grad_norm, never looser than the configured ``max_norm`` (docs/demo.md says when it "
                        "helps)."),)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        #: The configured max_norm per clip setting (lowered by the clip remedy): never clipped above.
        self.base: Dict[str, float] = {}

    def on_start(self, run: Run) -> None:
        self.base = {c.name: c.max_norm for c in run.io.clip_settings() if c.kind == "norm"}

    def on_healthy(self, run: Run, step: Step) -> None:
        if step.spikes.ready:
            for clip in run.io.clip_settings():
                base = self.base.get(clip.name)
                if clip.kind == "norm" and base is not None:
                    clip.set_max_norm(step.spikes.clip_bound(base))

    def on_handled(self, run: Run) -> None:
        clip = run.peers.get(ClipRemedy.name)
        for name, value in (clip.bounds if isinstance(clip, ClipRemedy) else {}).items():
            self.base[name] = min(self.base.get(name, value), value)
