"""Small value helpers every replay shares: fp16's range, max |x| over nested tensors, JSON-safe numbers."""
import math
from typing import Any, Iterator

import torch
from torch import nn

from ..fp16 import FP16_MAX, reaches_fp16
from ..tree import iter_tensors

__all__ = ["FP16_MAX", "tensors", "max_abs", "max_abs_in_fp16_reach", "num", "unwrap"]


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The floating tensors inside ``obj`` that hold values (the core's one walker; empty ones have no max)."""
    return (t for t in iter_tensors(obj) if t.numel())


def max_abs(obj: Any) -> float:
    """max |x| over every floating tensor in ``obj`` (NaN when any is NaN); one host read."""
    values = [t.detach().abs().amax().float().cpu() for t in tensors(obj)]
    return float(torch.stack(values).max()) if values else 0.0


def max_abs_in_fp16_reach(obj: Any) -> float:
    """:func:`max_abs` over the tensors fp16 code can see (:func:`~..fp16.reaches_fp16`: not float64), and NaN when
    any tensor at all holds NaN/Inf: what decides whether inputs are "within fp16 range"."""
    values = list(tensors(obj))
    if any(not bool(torch.isfinite(t).all()) for t in values):
        return math.nan
    reach = [t.detach().abs().amax().float().cpu() for t in values if reaches_fp16(t)]
    return float(torch.stack(reach).max()) if reach else 0.0


def num(value: float) -> Any:
    """``value`` as JSON can hold it: Inf/NaN as strings, as the incident log writes them elsewhere."""
    return value if math.isfinite(value) else str(value)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP / DataParallel wrapper (a DDP forward on one rank alone would wait for the others)."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model
