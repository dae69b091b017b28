"""NanGuardHook for MMEngine runners (plain MMEngine and mmdet3d 1.x scopes).

The hook forwards its lifecycle points to :class:`~petr_stability.adapters.driver.GuardDriver`: ``before_run``
(bind; allow MMEngine's own resume under torch >= 2.6 when the run resumes or loads), ``before_train`` (start),
``before_train_iter`` / ``after_train_iter``, ``after_train_epoch``, ``before_save_checkpoint`` /
``after_load_checkpoint``, ``after_train`` (finish). ``before_train_iter``, ``before_val_epoch`` and ``after_train``
also say which axis the visualizer's steps are on. Where things live in the runner is :class:`~.io.MMEngineIO`'s
business.
"""
from typing import Any, Dict, Optional

from mmengine.hooks import Hook

from ...core.config import GuardConfig
from ...core.distributed import is_distributed
from ...core.validate import check_bool
from ..driver import STATE_KEY, DrivenHook, GuardDriver
from .io import MMEngineIO, allow_mmengine_resume

__all__ = ["NanGuardHook"]


class NanGuardHook(DrivenHook, Hook):
    """Keeps fp16/fp32 training alive through NaN/Inf divergence: detects, remedies, rolls back, continues.

    Arguments are those of :class:`~petr_stability.core.config.GuardConfig` (every one validated when the
    hook is built), plus:

    Args:
        allow_mmengine_resume: under torch >= 2.6, when the run resumes or loads a checkpoint, let MMEngine's own
            loading read its checkpoints by adding exactly the types they pickle to torch's safe-load allowlist
            (process-wide, logged once). Defaults to True.
    """

    priority = "NORMAL"

    def __init__(self, allow_mmengine_resume: bool = True, **kwargs: Any) -> None:
        self.driver = GuardDriver(GuardConfig.from_arguments(kwargs))
        self.allow_mmengine_resume = check_bool("allow_mmengine_resume", allow_mmengine_resume)
        self.io: Optional[MMEngineIO] = None

    def before_run(self, runner: Any) -> None:
        self.io = MMEngineIO(runner)
        self.driver.bind(self.io)
        loads = getattr(runner, "_resume", False) or getattr(runner, "_load_from", None)
        if self.allow_mmengine_resume and loads:
            allow_mmengine_resume(self.io.log)

    def before_train(self, runner: Any) -> None:
        self.driver.start()

    def before_train_epoch(self, runner: Any) -> None:
        self.driver.before_epoch()

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        self.io.release_checkpoint_hooks()
        self.io.steps.train()
        self.driver.before_iter(data_batch)

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        # Runner.save_checkpoint (and so before_save_checkpoint) runs on rank 0 only, where no collective may
        # run: under DDP the state about to be saved is checked here instead, on every rank, and agreed.
        self.io.save_due = is_distributed() and self.io.checkpoint_due(batch_idx)
        self.driver.after_iter()

    def after_train_epoch(self, runner: Any) -> None:
        self.driver.after_epoch()

    def before_val_epoch(self, runner: Any) -> None:
        if self.io is not None:
            self.io.steps.validate()

    def after_train(self, runner: Any) -> None:
        self.io.steps.off()
        self.driver.finish()

    def before_save_checkpoint(self, runner: Any, checkpoint: Dict[str, Any]) -> None:
        if self.guard is not None:
            self.driver.before_save(checkpoint, self.io.fill_checkpoint)

    def after_load_checkpoint(self, runner: Any, checkpoint: Dict[str, Any]) -> None:
        self.driver.after_load(checkpoint, getattr(runner, "_resume", False), checkpoint.get(STATE_KEY))
