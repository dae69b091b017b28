"""What a replay may change in the model, saved first and put back exactly afterwards."""
import torch
from torch import nn

__all__ = ["ModelState"]


class ModelState:
    """What a diagnosis may change in the model, saved so that it can be put back exactly."""

    def __init__(self, model: nn.Module, params: bool) -> None:
        self.modes = [(m, m.training) for m in model.modules()]
        self.grads = [(p, p.grad) for p in model.parameters()]
        # Train-mode BatchNorm updates its running statistics on the re-run.
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.params = [(p, p.detach().clone()) for p in model.parameters()] if params else []

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in self.buffers + self.params:
                t.copy_(saved)
        for p, grad in self.grads:
            p.grad = grad
        for m, mode in self.modes:
            m.training = mode


