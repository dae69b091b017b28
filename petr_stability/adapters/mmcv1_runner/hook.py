"""NanGuardHook for MMCV 1.x runners (mmdet / mmdet3d 0.x: the original PETR and StreamPETR stack).

The hook forwards its lifecycle points to :class:`~petr_stability.adapters.driver.GuardDriver`: ``before_run``
(bind, the guard's state from ``runner.meta``, start), ``before_train_iter`` (also marks the iteration in
``runner.meta`` so that a saved checkpoint says where it was written), ``after_train_iter``, ``after_train_epoch``
(one cross-rank health check per epoch, after the epoch's checkpoint), ``after_run`` (finish). Where things live in
the runner is :class:`~.io.MMCV1IO`'s business.
"""
from typing import Any, Optional

from mmcv.runner import Hook

from ...core.config import GuardConfig
from ...core.distributed import get_rank
from ...core.watch.health import state_finite
from ..driver import DrivenHook, GuardDriver
from .io import MMCV1IO

__all__ = ["NanGuardHook"]


class NanGuardHook(DrivenHook, Hook):
    """Keeps fp16/fp32 training alive through NaN/Inf divergence: detects, remedies, rolls back, continues.

    Arguments are those of :class:`~petr_stability.core.config.GuardConfig`, every one validated when the hook
    is built. Register it as mmdet / mmdet3d 0.x do: ``custom_hooks = [dict(type='NanGuardHook')]``
    (priority NORMAL, the default; MMCV 1.x sets ``priority`` itself, so the class defines none).
    """

    def __init__(self, **kwargs: Any) -> None:
        self.driver = GuardDriver(GuardConfig.from_arguments(kwargs))
        self.io: Optional[MMCV1IO] = None

    def before_run(self, runner: Any) -> None:
        self.io = MMCV1IO(runner)
        self.driver.bind(self.io)
        self.driver.load_state(self.io.resumed_state())
        if get_rank() == 0:
            self.io.saves.install()
        self.driver.start()

    def before_train_epoch(self, runner: Any) -> None:
        # EpochBasedRunner sets its data_loader just before this point and makes the epoch's iterator just after.
        self.driver.before_epoch()

    def before_train_iter(self, runner: Any) -> None:
        self.io.mark_iter_start()
        self.driver.before_iter(getattr(runner, "data_batch", None))

    def after_train_iter(self, runner: Any) -> None:
        self.driver.after_iter()

    def after_train_epoch(self, runner: Any) -> None:
        # The epoch's checkpoint was written before this hook ran: one agreed health check per epoch.
        self.driver.after_epoch(not self.io.saves.poisoned and state_finite(self.io.model(), self.io.optimizers()))

    def after_run(self, runner: Any) -> None:
        self.driver.finish()
