"""A dataset over an in-memory list of samples (torch only), shared by both runner families' test stand-ins."""
from typing import List

from torch.utils.data import Dataset

__all__ = ["ListDataset"]


class ListDataset(Dataset):
    """A dataset over a list of samples."""

    def __init__(self, samples: List[dict]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return self.samples[i]
