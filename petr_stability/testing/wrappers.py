"""Dataset wrappers shaped like mmdet 2.x's and mmdet3d 0.17 / 1.0rc's (not installed in the test environments; the
seed-stack suite trains through the real ones), and a leaf that counts what it serves, for the tests that plant one
bad sample served under many indices."""
from collections import Counter
from typing import Any, List

import torch

from .fetches import guard_replay

__all__ = ["CBGSLike", "RepeatLike", "ClassBalancedLike", "Counted"]


class Counted:
    """A dataset that records every index it serves to the loader (``served``, in order; the guard's replays of
    rebuilt batches apart, ``replayed``) and counts them (``fetches``)."""

    def __init__(self, dataset: Any) -> None:
        self.base = dataset  # not ``dataset``: a leaf, not a wrapper to map through
        self.served: List[int] = []
        self.replayed: List[int] = []

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> Any:
        (self.replayed if guard_replay() else self.served).append(int(i))
        return self.base[i]

    @property
    def fetches(self) -> Counter:
        return Counter(self.served)

    @property
    def samples(self) -> Any:
        """The wrapped dataset's samples (what a test corrupts)."""
        return self.base.samples


class CBGSLike:
    """mmdet3d 0.17 / 1.0rc's ``CBGSDataset`` by its attributes: ``dataset`` and ``sample_indices``, each sample drawn
    under several indices (seeded)."""

    def __init__(self, dataset: Any, copies: int = 3, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.dataset = dataset
        self.sample_indices = torch.randint(0, len(dataset), (copies * len(dataset),), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.sample_indices)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self.sample_indices[i]]


class RepeatLike:
    """mmdet 2.x's ``RepeatDataset``: ``dataset``, ``times``, ``_ori_len``."""

    def __init__(self, dataset: Any, times: int) -> None:
        self.dataset, self.times, self._ori_len = dataset, times, len(dataset)

    def __len__(self) -> int:
        return self.times * self._ori_len

    def __getitem__(self, i: int) -> Any:
        return self.dataset[i % self._ori_len]


class ClassBalancedLike:
    """mmdet 2.x's ``ClassBalancedDataset``: ``dataset`` and ``repeat_indices`` (sample i repeated 1 + i % 3 times)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.repeat_indices = [i for i in range(len(dataset)) for _ in range(1 + i % 3)]

    def __len__(self) -> int:
        return len(self.repeat_indices)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self.repeat_indices[i]]
