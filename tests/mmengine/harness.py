"""A tiny real MMEngine runner around the PETR-shaped model, with a CPU fp16 AmpOptimWrapper."""
import uuid
from typing import Any, Dict, List, Optional

import torch
from mmengine.runner import Runner

import petr_stability  # noqa: F401  (registers the hooks)
import petr_stability.testing.mmengine_cpu  # noqa: F401  (registers CPUAmpOptimWrapper, PETRLikeModel)
from petr_stability.testing.mmengine_cpu import ListDataset
from petr_stability.testing.petr_like import make_batch


def build_runner(
    work_dir: str,
    amp: Any = "dynamic",
    max_iters: Optional[int] = 40,
    max_epochs: Optional[int] = None,
    guard: Optional[Dict[str, Any]] = None,
    faults: Optional[List[dict]] = None,
    n_samples: int = 64,
    batch_size: int = 2,
    clip_grad: Optional[dict] = "default",
    checkpoint: Optional[dict] = None,
    extra_hooks: Optional[List[dict]] = None,
    resume: bool = False,
    lr: float = 2e-4,
    accumulative_counts: int = 1,
    model_kwargs: Optional[dict] = None,
    cfg: Optional[dict] = None,
    launcher: str = "none",
    seed: int = 0,
    paramwise_cfg: Optional[dict] = None,
    hooks_before_guard: Optional[List[dict]] = None,
    default_scope: str = "mmengine",
    amp_type: str = "CPUAmpOptimWrapper",
    visualizer: Optional[dict] = None,
) -> Runner:
    """Builds a runner; ``guard=None`` leaves NanGuardHook out, ``amp=None`` trains in fp32.

    ``amp_type='AmpOptimWrapper'`` is MMEngine's own (CUDA GradScaler and autocast; needs a GPU). ``visualizer``:
    the runner's visualizer config (its vis backends); None for MMEngine's default.
    """
    if clip_grad == "default":
        clip_grad = dict(max_norm=35, norm_type=2)
    wrapper = dict(type="OptimWrapper") if amp is None else dict(type=amp_type, loss_scale=amp)
    wrapper.update(optimizer=dict(type="AdamW", lr=lr, weight_decay=0.01), accumulative_counts=accumulative_counts)
    if paramwise_cfg is not None:
        wrapper["paramwise_cfg"] = paramwise_cfg
    if clip_grad is not None:
        wrapper["clip_grad"] = clip_grad
    by_epoch = max_epochs is not None
    train_cfg = dict(by_epoch=True, max_epochs=max_epochs) if by_epoch else dict(by_epoch=False, max_iters=max_iters)
    hooks: List[dict] = []
    if faults:
        hooks.append(dict(type="FaultInjectionHook", faults=faults))
    hooks.extend(hooks_before_guard or [])
    if guard is not None:
        hooks.append(dict(type="NanGuardHook", **guard))
    hooks.extend(extra_hooks or [])
    ckpt = dict(type="CheckpointHook", interval=10 ** 6, by_epoch=by_epoch)
    ckpt.update(checkpoint or {})
    return Runner(
        model=dict(type="PETRLikeModel", **(model_kwargs or {})),
        work_dir=work_dir,
        experiment_name=f"t{uuid.uuid4().hex[:10]}",
        train_dataloader=dict(
            dataset=ListDataset(make_batch(n_samples, num_query=(model_kwargs or {}).get("num_query", 32), seed=seed)),
            sampler=dict(type="DefaultSampler", shuffle=False),
            batch_size=batch_size,
            num_workers=0,
            collate_fn=dict(type="default_collate"),
        ),
        optim_wrapper=wrapper,
        param_scheduler=[dict(type="LinearLR", start_factor=0.1, by_epoch=False, begin=0, end=10)],
        train_cfg=train_cfg,
        default_hooks=dict(checkpoint=ckpt, logger=dict(type="LoggerHook", interval=5)),
        log_processor=dict(by_epoch=by_epoch),
        custom_hooks=hooks,
        resume=resume,
        default_scope=default_scope,
        randomness=dict(seed=seed),
        launcher=launcher,
        log_level="INFO",
        cfg=cfg or dict(),
        visualizer=visualizer,
    )


def guard_hook(runner: Runner) -> Any:
    for hook in runner.hooks:
        if type(hook).__name__ == "NanGuardHook":
            return hook
    raise LookupError("no NanGuardHook")


def params_finite(runner: Runner) -> bool:
    model = runner.model.module if hasattr(runner.model, "module") else runner.model
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())
