"""The scale remedy: a static loss scale that stalled training (every step skipped) becomes dynamic."""
from typing import Any, List

from .base import Change, ConfigEntry, Context, Incident, Remedy, Run, When

__all__ = ["ScaleDynamic"]


class ScaleDynamic(Remedy):
    """A stalled static loss scale becomes dynamic (the adapter knows where the scaler's mode lives); again on
    resume."""

    name = "scale"
    order = 40
    label = "dynamic loss scale"
    state = ("scale_made_dynamic",)
    idle = {"scale_made_dynamic": False}

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.scale_made_dynamic = False

    def match(self, ctx: Context) -> bool:
        return ctx.event == When.STALLED or self.scale_made_dynamic

    def on_start(self, run: Run) -> None:
        run.io.restore_scale_mode()

    def on_stalled(self, run: Run, incident: Incident) -> List[Change]:
        change = run.io.make_scale_dynamic()
        if change is None:
            return []
        self.scale_made_dynamic = True
        return [change]

    def load_value(self, key: str, value: Any) -> Any:
        return bool(value)

    def config_entry(self, io: Any) -> ConfigEntry:
        # Written as loss_scale='dynamic'; carried instead where the config holds no static scale to change.
        return ConfigEntry(fix={"dynamic_loss_scale": True},
                           fallback={"dynamic_loss_scale": {"scale_made_dynamic": True}})
