"""The demo's MMEngine stand-ins for tests, registered on import (tests only: the shipped demo registers them itself):
the CPU ``AmpOptimWrapper``, the PETR-shaped ``BaseModel``, and a model unlike PETR (:class:`Regressor`)."""
from typing import Any, Dict

from mmengine.model import BaseModel

from ..demo.amp import CPUAmpOptimWrapper, PETRLikeModel, register
from ..demo.data import ListDataset
from .plain import mlp, squared_error

__all__ = ["CPUAmpOptimWrapper", "PETRLikeModel", "ListDataset", "Regressor"]

register()


class Regressor(BaseModel):
    """A user's model unlike PETR: an MLP, no BatchNorm, no ``nan_to_num`` (a NaN feature makes only the loss and the
    gradients NaN); the batch is a list ``[x, y]`` (:class:`~.plain.Pairs`)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: Any, y: Any, mode: str = "loss") -> Dict[str, Any]:
        return {"loss": squared_error(self.net, x, y)}
