"""Fault injection for fire drills: plant NaN/Inf in weights, gradients, the loss or a batch, on purpose."""
import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
from torch import nn

from .tree import iter_tensors

__all__ = [
    "FAULT_KINDS",
    "Fault",
    "FaultPlan",
    "parse_faults",
    "poison_weights",
    "arm_grad_fault",
    "poison_loss",
    "poison_batch",
]

#: What a fault can hit.
FAULT_KINDS = ("weights", "grads", "loss", "batch")


def _value(v: Any) -> float:
    if isinstance(v, str):
        v = float(v)  # 'nan', 'inf', '-inf', '1e6'
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"fault value must be a number or 'nan'/'inf', got {v!r}")
    return float(v)


@dataclass
class Fault:
    """One planned fault.

    Attributes:
        kind: one of :data:`FAULT_KINDS`.
        iters: iterations to hit, 1-based as the log prints them.
        value: what to plant (``nan``, ``inf``, or a finite number: for ``'batch'`` a factor that scales the
            inputs, e.g. 1e6 to push fp16 activations past 65504).
        ranks: ranks to hit; None means all.
        param: parameter name for ``'weights'`` / ``'grads'``; None means the first trainable parameter.
    """

    kind: str
    iters: Sequence[int]
    value: float = math.nan
    ranks: Optional[Sequence[int]] = None
    param: Optional[str] = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; choose from {list(FAULT_KINDS)}")
        if isinstance(self.iters, int):
            self.iters = [self.iters]
        if not self.iters or any(isinstance(i, bool) or not isinstance(i, int) or i < 1 for i in self.iters):
            raise ValueError(f"fault iters must be a non-empty list of integers >= 1, got {self.iters!r}")
        self.value = _value(self.value)

    def hits(self, iteration: int, rank: int) -> bool:
        """True once per planned iteration (``iteration`` is the runner's 0-based counter).

        A rollback sets the counter back, so the same iteration number comes round again; a real fault
        rides on data that has moved on by then, so a planted one fires only the first time too.
        """
        fired = self.__dict__.setdefault("_fired", set())
        if (iteration + 1) not in self.iters or (self.ranks is not None and rank not in self.ranks):
            return False
        if iteration + 1 in fired:
            return False
        fired.add(iteration + 1)
        return True


def parse_faults(faults: Sequence[Any]) -> List[Fault]:
    """Builds :class:`Fault` objects from dicts (config form) or passes Faults through."""
    if isinstance(faults, (dict, Fault)):
        faults = [faults]
    out = []
    for f in faults:
        out.append(f if isinstance(f, Fault) else Fault(**f))
    return out


def _param(model: nn.Module, name: Optional[str], buffers: bool = False) -> "tuple[str, torch.Tensor]":
    for pname, p in model.named_parameters():
        if (name is None and p.requires_grad) or pname == name:
            return pname, p
    if buffers and name is not None:
        for bname, b in model.named_buffers():
            if bname == name:
                return bname, b
    raise ValueError(f"no parameter{' or buffer' if buffers else ''} named {name!r} in the model")


def poison_weights(model: nn.Module, value: float = math.nan, param: Optional[str] = None) -> str:
    """Writes ``value`` into the first element of a parameter (or a named buffer); returns its name."""
    name, p = _param(model, param, buffers=True)
    with torch.no_grad():
        p.view(-1)[0] = value
    return name


def arm_grad_fault(model: nn.Module, value: float = math.inf, param: Optional[str] = None) -> str:
    """Makes the next backward write ``value`` into one gradient element of a parameter (once)."""
    name, p = _param(model, param)
    handle: List[Any] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        handle[0].remove()
        grad = grad.clone()
        grad.view(-1)[0] = value
        return grad

    handle.append(p.register_hook(hook))
    return name


def poison_loss(outputs: Any, value: float = math.nan) -> Any:
    """Returns the loss dict with every loss tensor multiplied by ``value`` (NaN/Inf propagate)."""
    if isinstance(outputs, dict):
        return {k: (v * value if isinstance(v, torch.Tensor) and "loss" in k else v) for k, v in outputs.items()}
    if isinstance(outputs, torch.Tensor):
        return outputs * value
    return outputs


def poison_batch(batch: Any, value: float) -> int:
    """Scales (finite ``value``) or overwrites (NaN/Inf) every floating tensor of a batch in place.

    Returns how many tensors were hit.
    """
    hit = list(iter_tensors(batch))
    with torch.no_grad():
        for t in hit:
            if math.isfinite(value):
                t.mul_(value)
            else:
                t.fill_(value)
    return len(hit)


class FaultPlan:
    """The faults of a run and what planting them takes; the fire-drill hooks of both runner families wrap it.

    Args:
        faults: dicts (config form) or :class:`Fault` objects.
    """

    def __init__(self, faults: Sequence[Any]) -> None:
        self.faults = parse_faults(faults)
        self._handle: Optional[Any] = None

    def inject(self, iteration: int, rank: int, model: nn.Module, batch: Any = None) -> List[str]:
        """Plants every fault due at ``iteration`` (0-based) on ``rank``; returns one log line per fault."""
        lines = []
        for fault in self.faults:
            if not fault.hits(iteration, rank):
                continue
            if fault.kind == "weights":
                where = poison_weights(model, fault.value, fault.param)
            elif fault.kind == "grads":
                where = arm_grad_fault(model, fault.value, fault.param)
            elif fault.kind == "batch":
                where = f"{poison_batch(batch, fault.value)} batch tensor(s)"
            else:
                self._handle = model.register_forward_hook(
                    lambda m, i, out, value=fault.value: poison_loss(out, value))
                where = "the loss"
            lines.append(f"iter {iteration + 1}, rank {rank}: planted {fault.value} in {fault.kind} ({where})")
        return lines

    def disarm(self) -> None:
        """Removes a loss fault's forward hook after its iteration."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
