"""A tiny real MMCV 1.x runner around the PETR-shaped model, with hooks registered as mmdet / mmdet3d 0.x do."""
import copy
import logging
import uuid
from typing import Any, Dict, List, Optional

import torch
from mmcv.runner import EpochBasedRunner, Hook, IterBasedRunner, build_optimizer
from torch.utils.data import DataLoader

import petr_stability  # noqa: F401  (registers the hooks)
from petr_stability.testing.mmcv1_cpu import ListDataset, PETRLikeMMCV1
from petr_stability.testing.petr_like import SEED_LAYER_CFG, make_batch

MODEL = dict(num_layers=1, num_query=16, layer_cfg=SEED_LAYER_CFG)


class LRRecorder(Hook):
    """Records (runner.iter, lr) as each iteration starts, after LrUpdaterHook has set the LR."""

    def __init__(self) -> None:
        self.steps: List[tuple] = []

    def before_train_iter(self, runner: Any) -> None:
        self.steps.append((runner.iter, runner.optimizer.param_groups[0]["lr"]))


def build_runner(
    work_dir: str,
    runner: str = "epoch",
    amp: Any = "dynamic",
    max_epochs: int = 2,
    max_iters: int = 20,
    n_samples: int = 16,
    batch_size: int = 2,
    guard: Optional[Dict[str, Any]] = None,
    faults: Optional[List[dict]] = None,
    grad_clip: Optional[dict] = "default",
    checkpoint: Optional[dict] = None,
    lr_config: Optional[dict] = None,
    lr: float = 2e-4,
    meta: Optional[dict] = None,
    seed: int = 0,
    fp16_type: str = "CPUFp16OptimizerHook",
    device: str = "cpu",
    cumulative_iters: int = 1,
    log_hooks: Optional[List[dict]] = None,
) -> Any:
    """Builds a runner; ``guard=None`` leaves NanGuardHook out, ``amp=None`` trains in fp32 (OptimizerHook).

    ``cumulative_iters > 1`` accumulates gradients over that many iterations with MMCV's
    ``GradientCumulativeOptimizerHook`` (fp32) or its fp16 variant (:class:`CPUGradientCumulativeFp16OptimizerHook`).
    ``log_hooks``: the logger hooks of ``log_config`` (every 5 iterations). Defaults to a ``TextLoggerHook``.

    ``device='cuda'`` trains as mmdet's ``train_detector`` does on one GPU (the model in ``MMDataParallel``);
    with ``fp16_type='Fp16OptimizerHook'`` (MMCV's own: CUDA GradScaler) it is the setting users run.
    """
    torch.manual_seed(seed)
    model = PETRLikeMMCV1(**MODEL)
    if device == "cuda":
        from mmcv.parallel import MMDataParallel

        model = MMDataParallel(model.cuda(), device_ids=[torch.cuda.current_device()])
    optimizer = build_optimizer(model, dict(type="AdamW", lr=lr, weight_decay=0.01))
    logger = logging.getLogger(f"mmcv1-test-{uuid.uuid4().hex[:8]}")
    logger.setLevel(logging.INFO)
    cls = EpochBasedRunner if runner == "epoch" else IterBasedRunner
    kwargs = dict(max_epochs=max_epochs) if runner == "epoch" else dict(max_iters=max_iters)
    r = cls(model=model, optimizer=optimizer, work_dir=work_dir, logger=logger, meta=dict(meta or {}), **kwargs)
    if grad_clip == "default":
        grad_clip = dict(max_norm=35, norm_type=2)
    if amp is None:
        optimizer_config = dict(type="OptimizerHook", grad_clip=grad_clip)
    else:
        optimizer_config = dict(type=fp16_type, loss_scale=amp, grad_clip=grad_clip)
    if cumulative_iters > 1:
        optimizer_config.update(type="GradientCumulativeOptimizerHook" if amp is None
                                else "CPUGradientCumulativeFp16OptimizerHook", cumulative_iters=cumulative_iters)
    ckpt = dict(interval=10 ** 6, by_epoch=runner == "epoch")
    ckpt.update(checkpoint or {})
    custom: List[dict] = []
    if faults:
        custom.append(dict(type="FaultInjectionHook", faults=faults))
    if guard is not None:
        custom.append(dict(type="NanGuardHook", **guard))
    r.register_training_hooks(
        lr_config or dict(policy="fixed"),
        optimizer_config,
        ckpt,
        dict(interval=5, hooks=log_hooks or [dict(type="TextLoggerHook")]),
        custom_hooks_config=custom,
    )
    r.loader = DataLoader(ListDataset(make_batch(n_samples, num_query=MODEL["num_query"], seed=seed)),
                          batch_size=batch_size, shuffle=False)
    return r


def run(r: Any) -> None:
    r.run([r.loader], [("train", 1)])


def guard_hook(r: Any) -> Any:
    for hook in r.hooks:
        if type(hook).__name__ == "NanGuardHook":
            return hook
    raise LookupError("no NanGuardHook")


def opt_hook(r: Any) -> Any:
    for hook in r.hooks:
        if hasattr(hook, "clip_grads"):
            return hook
    raise LookupError("no OptimizerHook")


def params_finite(r: Any) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in r.model.parameters())  # a wrapper's too (the module's)


def mean_loss(r: Any, n: int = 16) -> float:
    """Mean loss over the first ``n`` samples, as training sees it (batch statistics, a fixed dropout draw).

    Eval mode would read BatchNorm running statistics, which a dozen steps leave far from settled.
    """
    model = copy.deepcopy(r.model).train()
    batch = torch.utils.data.default_collate([r.loader.dataset[i] for i in range(n)])
    torch.manual_seed(0)
    with torch.no_grad():
        return float(sum(model(**batch).values()))
