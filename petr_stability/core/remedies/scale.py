"""The scale remedy: a static loss scale that stalled training (every step skipped) becomes dynamic."""
from typing import Any, Dict, List

from .base import Context, Remedy, When
from .change import Change

__all__ = ["ScaleDynamic"]


class ScaleDynamic(Remedy):
    """A stalled static loss scale becomes dynamic (the adapter knows where the scaler's mode lives); again on
    resume."""

    name = "scale"
    when = When.STALLED
    state_keys = ("scale_made_dynamic",)
    fixes = (("dynamic_loss_scale", "scale_made_dynamic"),)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.scale_made_dynamic = False

    def apply(self, ctx: Context) -> List[Change]:
        change = ctx.io.make_scale_dynamic() if self.enabled else None
        if change is None:
            return []
        self.scale_made_dynamic = True
        return [change]

    def resume(self, io: Any) -> None:
        if self.scale_made_dynamic:
            io.restore_scale_mode()

    def state_dict(self) -> Dict[str, Any]:
        return {"scale_made_dynamic": self.scale_made_dynamic}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scale_made_dynamic = bool(state.get("scale_made_dynamic", False))

    def summary(self, io: Any) -> Dict[str, Any]:
        return {"scale_made_dynamic": self.scale_made_dynamic}
