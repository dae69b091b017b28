"""CPU stand-ins for MMCV 1.x's CUDA-only fp16 pieces, plus the PETR-shaped model with an MMCV-1 ``train_step``."""
from typing import Any, Dict, Optional

import torch
from mmcv.runner import HOOKS, Fp16OptimizerHook, GradientCumulativeFp16OptimizerHook, auto_fp16
from torch import nn

from ..core.flags import make_grad_scaler
from .data import ListDataset
from .petr_like import build_petr_like

__all__ = ["cpu_grad_scaler", "CPUFp16OptimizerHook", "CPUGradientCumulativeFp16OptimizerHook", "PETRLikeMMCV1",
           "ListDataset"]


def cpu_grad_scaler(loss_scale: Any) -> Any:
    """A CPU ``GradScaler`` for MMCV's ``loss_scale`` argument: a float (its start scale), a dict of ``GradScaler``
    arguments, or ``'dynamic'``."""
    if isinstance(loss_scale, float):
        return make_grad_scaler("cpu", init_scale=loss_scale)
    if isinstance(loss_scale, dict):
        return make_grad_scaler("cpu", **loss_scale)
    return make_grad_scaler("cpu")


@HOOKS.register_module(force=True)
class CPUFp16OptimizerHook(Fp16OptimizerHook):
    """MMCV's ``Fp16OptimizerHook`` (GradScaler variant) with a CPU ``torch.amp.GradScaler`` swapped in.

    MMCV builds ``torch.cuda.amp.GradScaler``, which disables itself without a GPU; everything else, the
    ``after_train_iter`` step logic and ``_scale_update_param`` included, is MMCV's unchanged.
    """

    def __init__(self, loss_scale: Any = 512.0, **kwargs: Any) -> None:
        super().__init__(loss_scale=loss_scale, **kwargs)
        self.loss_scaler = cpu_grad_scaler(loss_scale)


@HOOKS.register_module(force=True)
class CPUGradientCumulativeFp16OptimizerHook(GradientCumulativeFp16OptimizerHook):
    """MMCV's ``GradientCumulativeFp16OptimizerHook`` (steps every ``cumulative_iters`` iterations) with a CPU
    ``GradScaler``, as :class:`CPUFp16OptimizerHook`; its accumulation logic is MMCV's unchanged."""

    def __init__(self, loss_scale: Any = 512.0, **kwargs: Any) -> None:
        super().__init__(loss_scale=loss_scale, **kwargs)
        self.loss_scaler = cpu_grad_scaler(loss_scale)


class PETRLikeMMCV1(nn.Module):
    """The PETR-shaped model behind MMCV 1.x's ``train_step(data, optimizer)`` interface.

    ``fp16_enabled`` is flipped to True by MMCV's ``wrap_fp16_model`` (``Fp16OptimizerHook.before_run``), as
    mmdet's ``auto_fp16`` detectors are. On a GPU the forward is MMCV's own ``@auto_fp16`` (CUDA autocast, inputs
    cast to half), as mmdet3d's PETR ``extract_feat`` is; on the CPU, where that decorator's CUDA autocast does
    nothing, it runs under CPU fp16 autocast instead.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.net = build_petr_like(**kwargs)
        self.fp16_enabled = False

    def forward(self, inputs: torch.Tensor, cls_t: torch.Tensor, reg_t: torch.Tensor) -> Dict[str, torch.Tensor]:
        if inputs.is_cuda:
            return self._forward_auto_fp16(inputs, cls_t, reg_t)
        with torch.autocast("cpu", dtype=torch.float16, enabled=self.fp16_enabled):
            return self.net.losses(inputs, cls_t, reg_t)

    @auto_fp16(apply_to=("inputs",))
    def _forward_auto_fp16(self, inputs: torch.Tensor, cls_t: torch.Tensor, reg_t: torch.Tensor) -> Dict[str, Any]:
        return self.net.losses(inputs, cls_t, reg_t)

    def train_step(self, data: Dict[str, torch.Tensor], optimizer: Any = None, **kwargs: Any) -> Dict[str, Any]:
        losses = self(**data)
        loss = sum(losses.values())
        log_vars = {k: float(v) for k, v in losses.items()}
        log_vars["loss"] = float(loss)
        return dict(loss=loss, log_vars=log_vars, num_samples=int(data["inputs"].shape[0]))

    def val_step(self, data: Dict[str, torch.Tensor], optimizer: Optional[Any] = None, **kwargs: Any) -> Dict:
        with torch.no_grad():
            return self.train_step(data, optimizer)
