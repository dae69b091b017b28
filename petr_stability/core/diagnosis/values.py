"""Small value helpers every replay shares: fp16's range, max |x| over nested tensors, JSON-safe numbers."""
import math
from typing import Any, Iterator

import torch
from torch import nn

from ..tree import iter_tensors

__all__ = ["FP16_MAX", "tensors", "max_abs", "num", "unwrap"]

#: Largest finite float16 value: an activation or a scaled gradient beyond it overflows to Inf in fp16.
FP16_MAX = 65504.0


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The floating tensors inside ``obj`` that hold values (the core's one walker; empty ones have no max)."""
    return (t for t in iter_tensors(obj) if t.numel())


def max_abs(obj: Any) -> float:
    """max |x| over every floating tensor in ``obj`` (NaN when any is NaN); one host read."""
    values = [t.detach().abs().amax().float().cpu() for t in tensors(obj)]
    return float(torch.stack(values).max()) if values else 0.0


def num(value: float) -> Any:
    """``value`` as JSON can hold it: Inf/NaN as strings, as the incident log writes them elsewhere."""
    return value if math.isfinite(value) else str(value)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP / DataParallel wrapper (a DDP forward on one rank alone would wait for the others)."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model
