"""Finiteness checks over weights, buffers, optimizer state and nested checkpoint contents, as fused reductions."""
import math
from collections import defaultdict
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from .flags import HAS_FOREACH_NORM

__all__ = [
    "iter_tensors",
    "all_finite",
    "first_nonfinite",
    "is_finite_number",
    "model_tensors",
    "optimizer_tensors",
]


def is_finite_number(value: Optional[float]) -> bool:
    """True for a finite float; None (no reading) counts as finite."""
    return value is None or math.isfinite(value)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yields every floating-point tensor inside nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from iter_tensors(value)


def model_tensors(model: nn.Module, buffers: bool = True) -> List[torch.Tensor]:
    """Parameters and floating-point buffers (BatchNorm statistics move even on skipped steps)."""
    tensors = [p.detach() for p in model.parameters()]
    if buffers:
        tensors.extend(b for b in model.buffers() if b.is_floating_point())
    return tensors


def optimizer_tensors(optimizer: Any) -> List[torch.Tensor]:
    """Floating-point tensors of an optimizer's per-parameter state (Adam moments, momentum buffers)."""
    state = getattr(optimizer, "state", None)
    if state is None:
        return []
    return list(iter_tensors(list(state.values())))


def _group_amax(tensors: List[torch.Tensor]) -> torch.Tensor:
    # The max of |x| is NaN or inf iff some element is: one exact reduction, no boolean masks.
    if HAS_FOREACH_NORM:
        norms = torch._foreach_norm(tensors, float("inf"))
        return torch.stack([n.float() for n in norms]).max()
    return torch.stack([t.detach().abs().max().float() for t in tensors]).max()


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when every element of every tensor is finite.

    One fused max-abs reduction per (device, dtype) group and a single host read in all, so the cost is
    one pass over the data; empty tensors are ignored.
    """
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        if t.numel():
            groups[(t.device, t.dtype)].append(t.detach())
    if not groups:
        return True
    maxima = [_group_amax(ts).to("cpu") for ts in groups.values()]
    return bool(torch.isfinite(torch.stack(maxima)).all())


def first_nonfinite(named: Iterable[Tuple[str, torch.Tensor]]) -> Optional[str]:
    """Name of the first tensor holding NaN/Inf, or None (slow path, used only after a failed check)."""
    for name, t in named:
        if t.numel() and (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            return name
    return None
