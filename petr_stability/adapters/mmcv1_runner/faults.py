"""FaultInjectionHook for MMCV 1.x runners: a fire drill that plants NaN/Inf on purpose, loudly."""
import logging
from typing import Any, List, Optional, Sequence

from mmcv.parallel import is_module_wrapper
from mmcv.runner import Hook

from ...core.distributed import get_rank
from ...core.faults import Fault, FaultPlan

__all__ = ["FaultInjectionHook"]


def _max_iters(runner: Any) -> Optional[int]:
    """The run's length in iterations, None where it cannot be known before the run.

    ``EpochBasedRunner.run`` sets ``max_iters`` from the train loader before ``before_run``; a runner driven some
    other way may only know its epochs and its loader.
    """
    max_iters = getattr(runner, "max_iters", None)
    if isinstance(max_iters, int) and max_iters > 0:
        return max_iters
    max_epochs, loader = getattr(runner, "max_epochs", None), getattr(runner, "data_loader", None)
    try:
        return int(max_epochs) * len(loader) if max_epochs and loader is not None else None
    except TypeError:  # a loader without a length (an iterable dataset)
        return None


class FaultInjectionHook(Hook):
    """Injects planned faults to prove a setup recovers before a multi-day run. Never leave it on.

    Lifecycle points used: ``before_run`` (announce the plan; check every ``param`` against the unwrapped model,
    raising ``ValueError`` for a name it lacks, and warn once about faults planned past the last iteration),
    ``before_train_iter`` (poison weights or the
    batch, arm a gradient fault or a loss fault), ``after_train_iter`` (disarm the loss fault). Register it in
    ``custom_hooks`` (priority from the config; the class defines none, as MMCV 1.x requires).

    Args:
        faults: list of dicts (or :class:`~petr_stability.core.faults.Fault`): ``kind`` in
            ``'weights' | 'grads' | 'loss' | 'batch'``, ``iters`` (1-based, as logged), ``value``
            (``'nan'``, ``'inf'`` or a number), optional ``ranks`` and ``param``.
    """

    def __init__(self, faults: Sequence[Any]) -> None:
        self.plan = FaultPlan(faults)
        self.faults: List[Fault] = self.plan.faults

    def before_run(self, runner: Any) -> None:
        runner.logger.warning(f"FaultInjectionHook: ON - this run will be poisoned on purpose: {self.faults}")
        model = runner.model.module if is_module_wrapper(runner.model) else runner.model
        warning = self.plan.check(model, _max_iters(runner))
        if warning:
            runner.logger.warning(f"FaultInjectionHook: {warning}")

    def before_train_iter(self, runner: Any) -> None:
        model = runner.model.module if is_module_wrapper(runner.model) else runner.model
        for line in self.plan.inject(runner.iter, get_rank(), model, getattr(runner, "data_batch", None)):
            runner.logger.log(logging.WARNING, f"FaultInjectionHook: {line}")

    def after_train_iter(self, runner: Any) -> None:
        self.plan.disarm()
