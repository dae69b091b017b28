"""FaultInjectionHook for MMCV 1.x runners: a fire drill that plants NaN/Inf on purpose, loudly."""
import logging
from typing import Any, List, Optional, Sequence

from mmcv.parallel import is_module_wrapper
from mmcv.runner import Hook

from ..core.distributed import get_rank
from ..core.faults import Fault, arm_grad_fault, parse_faults, poison_batch, poison_loss, poison_weights

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
        self.faults: List[Fault] = parse_faults(faults)
        self._handle: Optional[Any] = None

    def before_run(self, runner: Any) -> None:
        runner.logger.warning(f"FaultInjectionHook: ON - this run will be poisoned on purpose: {self.faults}")

    def before_train_iter(self, runner: Any) -> None:
        model = runner.model.module if is_module_wrapper(runner.model) else runner.model
        rank = get_rank()
        for fault in self.faults:
            if not fault.hits(runner.iter, rank):
                continue
            if fault.kind == "weights":
                where = poison_weights(model, fault.value, fault.param)
            elif fault.kind == "grads":
                where = arm_grad_fault(model, fault.value, fault.param)
            elif fault.kind == "batch":
                where = f"{poison_batch(getattr(runner, 'data_batch', None), fault.value)} batch tensor(s)"
            else:
                self._handle = model.register_forward_hook(
                    lambda m, i, out, value=fault.value: poison_loss(out, value))
                where = "the loss"
            runner.logger.log(logging.WARNING, f"FaultInjectionHook: iter {runner.iter + 1}, rank {rank}: "
                              f"planted {fault.value} in {fault.kind} ({where})")

    def after_train_iter(self, runner: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
