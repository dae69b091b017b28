"""Data and models shaped unlike the project's own, for the attribution tests: a tutorial-style dataset of ``(x, y)``
tuples with no ids, and the small MLP a user would train on it (torch only)."""
from typing import List, Sequence

import torch
from torch import nn

from .fetches import guard_replay

__all__ = ["Pairs", "mlp", "squared_error"]


class Pairs(torch.utils.data.Dataset):
    """``(x, y)`` tuples, no ids, no infos: what a tutorial dataset looks like. The samples in ``bad`` hold NaN
    features (a corrupt record); ``served`` lists every index the loader read, in order (the guard's replays of
    rebuilt batches are ``replayed``).

    Args:
        n: samples.
        bad: dataset indices of the corrupt samples.
    """

    def __init__(self, n: int, bad: Sequence[int]) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
        for i in bad:
            self.x[i, :3] = float("nan")
        self.served: List[int] = []
        self.replayed: List[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple:
        (self.replayed if guard_replay() else self.served).append(int(i))
        return self.x[i], self.y[i]


def mlp() -> nn.Module:
    """The user's model: an MLP over :class:`Pairs`' features, no BatchNorm, no ``nan_to_num`` (seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def squared_error(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Its loss: a NaN feature makes the loss and every gradient NaN."""
    return ((net(x) - y) ** 2).mean()
