"""The demo's MMEngine pieces: a CPU stand-in for the CUDA-only ``AmpOptimWrapper`` and the PETR-shaped model as a
``BaseModel``. Registered by :func:`register` (the demo calls it), never on import."""
import contextlib
from typing import Any, Iterator

import torch
from mmengine.model import BaseModel
from mmengine.optim import AmpOptimWrapper, OptimWrapper
from mmengine.registry import MODELS, OPTIM_WRAPPERS

from ..core.flags import autocast, make_grad_scaler
from .model import build_petr_like

__all__ = ["CPUAmpOptimWrapper", "PETRLikeModel", "register"]


class CPUAmpOptimWrapper(AmpOptimWrapper):
    """``AmpOptimWrapper`` on the CPU: MMEngine's own step logic, a CPU GradScaler and CPU fp16 autocast.

    MMEngine's class asserts a GPU in ``__init__`` and its CPU autocast accepts only bfloat16; nothing else
    differs, so ``step`` (unscale, clip, scaler step, scaler update) is MMEngine's unchanged.
    """

    def __init__(self, loss_scale: Any = "dynamic", dtype: Any = None, use_fsdp: bool = False, **kwargs: Any):
        OptimWrapper.__init__(self, **kwargs)
        self._scale_update_param = None
        if loss_scale == "dynamic":
            self.loss_scaler = make_grad_scaler("cpu")
        elif isinstance(loss_scale, float):
            self._scale_update_param = loss_scale
            self.loss_scaler = make_grad_scaler("cpu", init_scale=loss_scale)
        elif isinstance(loss_scale, dict):
            self.loss_scaler = make_grad_scaler("cpu", **loss_scale)
        else:
            raise TypeError(f"loss_scale must be 'dynamic', a float or a dict, got {loss_scale!r}")
        self.cast_dtype = None

    @contextlib.contextmanager
    def optim_context(self, model: torch.nn.Module) -> Iterator[None]:
        with OptimWrapper.optim_context(self, model), autocast("cpu", torch.float16):
            yield


class PETRLikeModel(BaseModel):
    """The PETR-shaped model behind MMEngine's ``BaseModel`` interface (``mode='loss'`` only)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.net = build_petr_like(**kwargs)

    def forward(self, inputs: torch.Tensor, cls_t: Any = None, reg_t: Any = None, mode: str = "loss") -> Any:
        return self.net.losses(inputs, cls_t, reg_t)


def register() -> None:
    """Registers :class:`CPUAmpOptimWrapper` and :class:`PETRLikeModel` with MMEngine's registries (idempotent)."""
    OPTIM_WRAPPERS.register_module(module=CPUAmpOptimWrapper, force=True)
    MODELS.register_module(module=PETRLikeModel, force=True)
