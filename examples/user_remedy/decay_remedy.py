"""A remedy of your own with a relative target: the weight decay halved on each dynamics incident
(docs/remedies.md, "A relative target"). Registered on import, as beta2_remedy.py is."""
from typing import Any

from petr_stability.core.causes import Cause
from petr_stability.core.remedies import Incident, Outcome, Remedy, Run, Setting, Target, register_remedy
from petr_stability.core.validate import is_number

__all__ = ["DecayBackoff"]


@register_remedy
class DecayBackoff(Remedy):
    """Each dynamics incident multiplies the weight decay by ``decay_factor``, relative to the config's value."""

    name = "decay"
    label = "weight decay x {decay_factor:g}"
    causes = (Cause.DYNAMICS, Cause.UNKNOWN)
    settings = (Setting("decay_factor", 0.5, is_number(0.0, 1.0), "weight-decay factor per dynamics incident."),)
    state = ("decay_scale",)  # saved in every checkpoint, carried to the next run
    idle = {"decay_scale": 1.0}  # its summary while it has not acted

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.decay_scale = 1.0  # the product of every backoff so far

    def after_restore(self, run: Run, incident: Incident) -> Outcome:
        self.decay_scale *= self.config.decay_factor  # once per incident: the method is called once per incident
        # Relative to the configured value, whatever the groups hold now: a resume or a rollback re-applies the same
        # value, never decay_factor once more.
        return Outcome(targets=(Target("weight_decay", self.decay_scale, relative=True),),
                       evidence=f"; weight decay x {self.decay_scale:g}")
