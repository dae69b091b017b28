"""FaultInjectionHook for MMCV 1.x runners: a fire drill that plants NaN/Inf on purpose, loudly."""
import logging
from typing import Any, List, Sequence

from mmcv.parallel import is_module_wrapper
from mmcv.runner import Hook

from ..core.distributed import get_rank
from ..core.faults import Fault, FaultPlan

__all__ = ["FaultInjectionHook"]


class FaultInjectionHook(Hook):
    """Injects planned faults to prove a setup recovers before a multi-day run. Never leave it on.

    Lifecycle points used: ``before_run`` (announce the plan), ``before_train_iter`` (poison weights or the
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

    def before_train_iter(self, runner: Any) -> None:
        model = runner.model.module if is_module_wrapper(runner.model) else runner.model
        for line in self.plan.inject(runner.iter, get_rank(), model, getattr(runner, "data_batch", None)):
            runner.logger.log(logging.WARNING, f"FaultInjectionHook: {line}")

    def after_train_iter(self, runner: Any) -> None:
        self.plan.disarm()
