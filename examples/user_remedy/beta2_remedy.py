"""A remedy of your own, registered from your package: Adam's beta2 lowered on a dynamics incident, as the OPT-175B
logbook did by hand (docs/remedies.md walks through it).

``custom_imports=dict(imports=['petr_stability', 'beta2_remedy'])`` imports this file, which registers the remedy;
``NanGuardHook(remedies=[dict(type='beta2')])`` switches it on, beside the defaults. Nothing in petr_stability changes.
"""
from typing import Any, List

from petr_stability.core.causes import Cause
from petr_stability.core.remedies import Change, Context, Outcome, Remedy, Setting, When, register_remedy
from petr_stability.core.validate import is_number

__all__ = ["Beta2Backoff"]


@register_remedy
class Beta2Backoff(Remedy):
    """On a dynamics incident, every Adam-style param group's beta2 to ``beta2_target`` (a shorter memory of the
    squared gradients: a spike no longer freezes a tensor for thousands of steps). Re-applied at the start of a
    resumed run, and of the next run from the patched config."""

    name = "beta2"  # its remedies= name
    label = "Adam beta2 to {beta2_target:g}"  # how the cause table's action (and the ladder's text) names it
    causes = (Cause.DYNAMICS, Cause.UNKNOWN)  # the classes it serves
    # It is called at these events only: after the rollback (the optimizer's param groups are part of the state a
    # rollback restores: set before it, the new beta2 would be undone), after a restore to a point taken before it
    # acted (its restore tag differs), and at the start of a resumed run or of the next one from the patched config.
    events = (When.START, When.AFTER_RESTORE, When.RESTORED)
    settings = (Setting("beta2_target", 0.95, is_number(0.0, 1.0), "the beta2 a dynamics incident sets (Adam's "
                        "default 0.999 remembers a gradient spike for ~1000 steps; 0.95 for ~20)."),)
    state = ("beta2",)  # saved in every checkpoint (one generic pass), given back on resume
    tags = ("beta2",)  # recorded with every restore point
    idle = {"beta2": None}  # its part of the guard's summary while it has not acted (it is not called for that)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.beta2 = None  # the beta2 it put in force (None: none yet)

    def match(self, ctx: Context) -> bool:
        # At the start of a run, only where a resumed checkpoint or the patched config carries a beta2 to re-apply.
        return ctx.event != When.START or self.beta2 is not None

    def apply(self, ctx: Context) -> Outcome:
        target = self.config.beta2_target if ctx.event == When.AFTER_RESTORE else self.beta2
        changes: List[Change] = []
        for i, optimizer in enumerate(ctx.io.optimizers()):
            for j, group in enumerate(optimizer.param_groups):
                betas = group.get("betas")
                if betas is not None and betas[1] != target:
                    changes.append(Change(f"optimizer{i}.group{j}.betas[1]", betas[1], target))
                    group["betas"] = (betas[0], target)
        self.beta2 = target
        return Outcome(tuple(changes), evidence=f"; Adam beta2 {target:g}" if changes else "")
