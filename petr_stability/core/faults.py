"""Fault injection for fire drills: plant NaN/Inf in weights, gradients, the loss or a batch, on purpose."""
import difflib
import math
from dataclasses import dataclass, fields
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
    what = f"fault value must be a number or 'nan'/'inf'/'-inf', got {v!r}"
    if isinstance(v, str):
        try:
            return float(v)  # 'nan', 'inf', '-inf', '1e6'
        except ValueError:
            raise ValueError(f"{what} (could not convert it to a float)") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(what)
    return float(v)


def _int_list(v: Any, minimum: int) -> Optional[List[int]]:
    """``v`` as a list of ints >= ``minimum`` (an int is a list of one); None where it is not one."""
    if isinstance(v, int) and not isinstance(v, bool):
        v = [v]
    if not isinstance(v, (list, tuple)) or not v:
        return None
    if any(isinstance(i, bool) or not isinstance(i, int) or i < minimum for i in v):
        return None
    return list(v)


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
        if not isinstance(self.kind, str) or self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; choose from {list(FAULT_KINDS)}")
        iters = _int_list(self.iters, 1)
        if iters is None:
            shown = [self.iters] if isinstance(self.iters, int) and not isinstance(self.iters, bool) else self.iters
            raise ValueError(f"fault iters must be a non-empty list of integers >= 1, got {shown!r}")
        self.iters = iters
        self.value = _value(self.value)
        if self.ranks is not None:
            ranks = _int_list(self.ranks, 0)
            if ranks is None:
                shown = [self.ranks] if isinstance(self.ranks, int) and not isinstance(self.ranks, bool) else self.ranks
                raise ValueError(f"fault ranks must be None or a non-empty list of integers >= 0, got {shown!r}")
            self.ranks = ranks
        if self.param is not None and not isinstance(self.param, str):
            raise ValueError(f"fault param must be a parameter name (str) or None, got {self.param!r}")
        if self.param is not None and self.kind not in ("weights", "grads"):
            raise ValueError(f"fault param applies to 'weights' and 'grads' faults only, got param={self.param!r} "
                             f"for kind {self.kind!r}")

    def describe(self) -> str:
        """``'<kind> fault at iters [..]'``, as messages name a fault."""
        return f"{self.kind} fault at iters {list(self.iters)}"

    def check(self, model: nn.Module) -> None:
        """Raises ``ValueError`` if ``param`` cannot be hit in ``model`` (the names are the unwrapped model's).

        A missing name is reported with a few close names; a gradient fault also needs a parameter (not a buffer)
        that requires grad.
        """
        params = dict(model.named_parameters())
        if self.param is None:
            if self.kind in ("weights", "grads") and not any(p.requires_grad for p in params.values()):
                raise ValueError(f"the model has no trainable parameter for the {self.describe()}; name one with "
                                 f"param=")
            return
        buffers = dict(model.named_buffers())
        if self.param in params:
            if self.kind == "grads" and not params[self.param].requires_grad:
                raise ValueError(f"{self.describe()}: parameter {self.param!r} does not require grad (frozen); "
                                 f"its gradient is never computed, so the fault would never fire")
            return
        if self.param in buffers:
            if self.kind == "grads":
                raise ValueError(f"{self.describe()}: {self.param!r} is a buffer, not a parameter: a grads fault "
                                 f"needs a parameter (a weights fault can hit a buffer)")
            return
        names = list(params) + (list(buffers) if self.kind == "weights" else [])
        what = "parameter or buffer" if self.kind == "weights" else "parameter"
        close = difflib.get_close_matches(self.param, names, n=5, cutoff=0.6)
        if close:
            hint = "close names: " + ", ".join(repr(n) for n in close)
        else:
            hint = f"the model has {len(names)} names, e.g. " + ", ".join(repr(n) for n in names[:5])
        raise ValueError(f"{self.describe()}: no {what} named {self.param!r} in the model; {hint}")

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


_KEYS = tuple(f.name for f in fields(Fault))


def parse_faults(faults: Sequence[Any]) -> List[Fault]:
    """Builds :class:`Fault` objects from dicts (config form) or passes Faults through.

    Raises:
        TypeError: ``faults`` is not a list, or an entry is neither a dict nor a :class:`Fault`.
        ValueError: a dict lacks ``kind``/``iters``, has a key a fault does not take, or a value is invalid.
    """
    if isinstance(faults, (dict, Fault)):
        faults = [faults]
    if not isinstance(faults, (list, tuple)):
        raise TypeError(f"faults must be a list of dicts (or Faults), got {faults!r}")
    out = []
    for f in faults:
        if isinstance(f, Fault):
            out.append(f)
            continue
        if not isinstance(f, dict):
            raise TypeError(f"a fault is a dict (or a Fault), got {f!r}")
        unknown = sorted(k for k in f if k not in _KEYS)
        if unknown:
            raise ValueError(f"unknown fault key(s) {unknown}; a fault takes {list(_KEYS)}")
        if "kind" not in f or "iters" not in f:
            raise ValueError(f"a fault needs 'kind' and 'iters', got {dict(f)!r}")
        out.append(Fault(**f))
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

    def check(self, model: nn.Module, max_iters: Optional[int]) -> Optional[str]:
        """Checks the plan against the run as it starts (call it from ``before_run``).

        Args:
            model: the unwrapped model; every ``param`` must name something a fault of its kind can hit.
            max_iters: the run's last iteration (1-based, so also its length); None or 0 when unknown.

        Returns:
            One warning naming the faults (and their iterations) planned past ``max_iters``, or None.

        Raises:
            ValueError: a ``param`` the model does not have (with close names), a buffer or a frozen parameter
                for a ``'grads'`` fault.
        """
        for fault in self.faults:
            fault.check(model)
        if not max_iters:
            return None
        late = [f"{f.kind} fault at iters {[i for i in f.iters if i > max_iters]}"
                for f in self.faults if any(i > max_iters for i in f.iters)]
        if not late:
            return None
        return f"planned past the run's last iteration {max_iters}, these never fire: " + ", ".join(late)

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
