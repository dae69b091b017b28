"""A remedy of your own, registered from your package: Adam's beta2 lowered on a dynamics incident, as the OPT-175B
logbook did by hand (docs/remedies.md walks through it). An absolute target: the value it sets is its setting's.

``custom_imports=dict(imports=['petr_stability', 'beta2_remedy'])`` imports this file, which registers the remedy;
``NanGuardHook(remedies=[dict(type='beta2')])`` switches it on, beside the defaults. Nothing in petr_stability changes.
"""
from petr_stability.core.causes import Cause
from petr_stability.core.remedies import Incident, Outcome, Remedy, Run, Setting, Target, register_remedy
from petr_stability.core.validate import is_number

__all__ = ["Beta2Backoff"]


@register_remedy
class Beta2Backoff(Remedy):
    """On a dynamics incident, every Adam-style param group's beta2 to ``beta2_target`` (a shorter memory of the
    squared gradients: a spike no longer freezes a tensor for thousands of steps)."""

    name = "beta2"  # its remedies= name
    label = "Adam beta2 to {beta2_target:g}"  # how the cause table's action (and the ladder's text) names it
    causes = (Cause.DYNAMICS, Cause.UNKNOWN)  # the classes it serves
    settings = (Setting("beta2_target", 0.95, is_number(0.0, 1.0), "the beta2 a dynamics incident sets (Adam's "
                        "default 0.999 remembers a gradient spike for ~1000 steps; 0.95 for ~20)."),)

    def after_restore(self, run: Run, incident: Incident) -> Outcome:
        # Called once per incident of a class it serves, after the rollback. The target is declared, not set: the
        # guard applies it to every group that has betas, and keeps it in force after every later rollback, on
        # resume and in the next run.
        target = self.config.beta2_target
        return Outcome(targets=(Target("betas[1]", target),), evidence=f"; Adam beta2 {target:g}")
