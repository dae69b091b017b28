"""What the cost benchmarks share: the PETR-shaped samples stacked into a batch, and a median wall time."""
import statistics
import time
from typing import Callable, Dict, List

import torch

__all__ = ["stack", "median_seconds"]


def stack(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """:func:`~petr_stability.testing.petr_like.make_batch` samples as one batch."""
    return {k: torch.stack([s[k] for s in samples]) for k in ("inputs", "cls_t", "reg_t")}


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
