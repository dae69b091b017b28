"""A small dense regressor and its data, for the evidence-rule tests of both runner families (torch only): every
sample is as good as every other unless a test makes one degenerate, and each carries its ``sample_idx``."""
from typing import Any, Dict, Iterable, List

import torch
from torch import nn

from .fetches import guard_replay

__all__ = ["DenseData", "dense_net", "dense_loss"]


class DenseData(torch.utils.data.Dataset):
    """``{'inputs', 'target', 'sample_idx'}`` samples; ``fetches`` lists every index the loader read, in order (the
    guard's replays of rebuilt batches apart, in ``replayed``).

    Args:
        n: samples.
        degenerate: indices whose target is 1e20: finite, but its squared error is not even in fp32 (a degenerate box
            whose regression target blew up in a transform). Defaults to ().
    """

    def __init__(self, n: int, degenerate: Iterable[int] = ()) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 16, generator=g), torch.randn(n, 8, generator=g)
        for i in degenerate:
            self.y[i] = 1e20
        self.fetches: List[int] = []
        self.replayed: List[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        (self.replayed if guard_replay() else self.fetches).append(int(i))
        return {"inputs": self.x[i], "target": self.y[i], "sample_idx": f"tok{i:03d}"}

    def last_pass(self) -> List[int]:
        """The indices of the last ``len(self)`` fetches, sorted: every index once where the last pass served all."""
        return sorted(self.fetches[-len(self):])


def dense_net() -> nn.Module:
    """The user's model: an MLP with no normalization and a dense head (seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))


def dense_loss(net: nn.Module, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Its squared error (computed in the forward's precision: fp16 under autocast overflows past 65504)."""
    return ((net(inputs) - target) ** 2).mean()
