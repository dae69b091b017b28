"""A dataset with one sample that poisons BatchNorm's running statistics while every weight stays finite, for the
window-trace tests of both runner families (torch only, with :mod:`.causes_models`' MMCV bricks)."""
from typing import Dict

from .causes_models import IdentifiedDataset
from .fetches import guard_replay

__all__ = ["HUGE", "HugeSample"]

#: Finite in fp32; its square is not, so a batch holding it beside ordinary samples overflows BatchNorm's variance.
HUGE = 1e20


class HugeSample(IdentifiedDataset):
    """:class:`~.causes_models.IdentifiedDataset` whose sample ``bad`` holds huge, finite features everywhere (a raw
    sensor dump, a unit bug); counts the loader's fetches per index (``fetches``) apart from the guard's window
    trace's (``traced``).

    Args:
        n: number of samples.
        bad: the dataset index of the huge sample.
        value: its features. Defaults to :data:`HUGE`.
        drop_ids: leave ``sample_idx`` out of the batch (the infos still list it). Defaults to False.
    """

    def __init__(self, n: int, bad: int, value: float = HUGE, drop_ids: bool = False) -> None:
        super().__init__(n, num_query=16)
        self.huge, self.value, self.drop_ids = bad, value, drop_ids
        self.fetches: Dict[int, int] = {}
        self.traced: Dict[int, int] = {}

    def __getitem__(self, i: int) -> dict:
        counts = self.traced if guard_replay() else self.fetches
        counts[int(i)] = counts.get(int(i), 0) + 1
        sample = super().__getitem__(i)
        if int(i) == self.huge:
            sample = dict(sample, inputs=sample["inputs"].clone().fill_(self.value))
        if self.drop_ids:
            sample.pop("sample_idx", None)
        return sample
