"""FaultInjectionHook for MMEngine runners: a fire drill that plants NaN/Inf on purpose, loudly."""
import logging
from typing import Any, List, Sequence

from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.model import is_model_wrapper

from ...core.distributed import get_rank
from ...core.faults import Fault, FaultPlan

__all__ = ["FaultInjectionHook"]


class FaultInjectionHook(Hook):
    """Injects planned faults to prove a setup recovers before a multi-day run. Never leave it on.

    Lifecycle points used: ``before_run`` (announce the plan; check every ``param`` against the unwrapped model,
    raising ``ValueError`` for a name it lacks, and warn once about faults planned past the last iteration),
    ``before_train_iter`` (poison weights or the
    batch, arm a gradient fault or a loss fault), ``after_train_iter`` (disarm the loss fault).

    Args:
        faults: list of dicts (or :class:`~petr_stability.core.faults.Fault`): ``kind`` in
            ``'weights' | 'grads' | 'loss' | 'batch'``, ``iters`` (1-based, as logged), ``value``
            (``'nan'``, ``'inf'`` or a number), optional ``ranks`` and ``param``.
    """

    priority = "NORMAL"

    def __init__(self, faults: Sequence[Any]) -> None:
        self.plan = FaultPlan(faults)
        self.faults: List[Fault] = self.plan.faults

    def _log(self, msg: str) -> None:
        print_log(f"FaultInjectionHook: {msg}", logger="current", level=logging.WARNING)

    def before_run(self, runner: Any) -> None:
        self._log(f"ON - this run will be poisoned on purpose: {self.faults}")
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        # The built loop only: runner.max_iters would build a train loop from its config in a test-only run.
        max_iters = getattr(getattr(runner, "_train_loop", None), "max_iters", None)
        warning = self.plan.check(model, max_iters if isinstance(max_iters, int) else None)
        if warning:
            self._log(warning)

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        for line in self.plan.inject(runner.iter, get_rank(), model, data_batch):
            self._log(line)

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        self.plan.disarm()
