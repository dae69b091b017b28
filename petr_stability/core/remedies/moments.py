"""The moments remedy: the optimizer state of the tensors whose gradients exploded, cleared."""
import math
import statistics
from typing import Any, List, Mapping, Tuple

import torch
from torch import nn

from ..causes import Cause
from ..flags import HAS_FOREACH_NORM
from ..validate import Setting, is_number
from .base import Change, Incident, Remedy, Run

__all__ = ["reset_moments", "exploded_params", "MomentsReset"]


def _named(params: Any) -> List[Tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        return list(params.items())
    return [(p if isinstance(p, tuple) else (str(i), p)) for i, p in enumerate(params)]


def reset_moments(optimizer: Any, params: Any) -> List[Change]:
    """Clears the optimizer state (Adam/AdamW moments and step, SGD momentum) of the given tensors, in place.

    The next step re-initialises it as at the start of training, for those tensors only: a first moment
    poisoned by an exploded gradient, or a second moment inflated by it (which would freeze the tensor for
    thousands of steps), is gone. Other tensors keep theirs.

    Args:
        optimizer: a torch optimizer (``state`` keyed by parameter).
        params: ``(name, tensor)`` pairs or a ``{name: tensor}`` mapping (see :func:`exploded_params`).

    Returns:
        One :class:`Change` per tensor whose state was cleared: old = the state's keys (and step), new = "cleared".
    """
    changes: List[Change] = []
    state = optimizer.state
    for name, p in _named(params):
        entry = state.get(p)
        if not entry:
            continue
        keys = []
        for key in sorted(entry):
            value = entry[key]
            if key == "step":
                value = float(value) if isinstance(value, torch.Tensor) else value
                keys.append(f"step={value:g}" if isinstance(value, (int, float)) else "step")
            else:
                keys.append(str(key))
        del state[p]
        changes.append(Change(name, ", ".join(keys), "cleared"))
    return changes


def exploded_params(model: nn.Module, threshold_ratio: float = 100.0) -> List[str]:
    """Names of the parameters whose gradient exploded: non-finite, or a norm above ``threshold_ratio`` times the
    median gradient norm over all parameters with a gradient (scale-free, so a loss scaler's factor cancels).

    Reads every gradient's norm in one fused reduction and one host read; call it before gradients are cleared.

    Args:
        model: the unwrapped model.
        threshold_ratio: how far above the median counts as exploded (> 1). Defaults to 100.0.

    Returns:
        Parameter names in ``named_parameters`` order.

    Raises:
        ValueError: ``threshold_ratio`` is not a finite number > 1.
    """
    if (isinstance(threshold_ratio, bool) or not isinstance(threshold_ratio, (int, float))
            or not (1 < threshold_ratio < math.inf)):
        raise ValueError(f"threshold_ratio must be a finite number > 1, got {threshold_ratio!r}")
    named = [(n, p.grad.detach()) for n, p in model.named_parameters() if p.grad is not None and p.grad.numel()]
    if not named:
        return []
    grads = [g for _, g in named]
    if HAS_FOREACH_NORM:
        norms = [n.float().cpu() for n in torch._foreach_norm(grads, 2)]
    else:
        norms = [g.float().norm().cpu() for g in grads]
    values = torch.stack(norms).tolist()
    finite = [v for v in values if math.isfinite(v)]
    median = statistics.median(finite) if finite else math.inf
    limit = threshold_ratio * median
    return [n for (n, _), v in zip(named, values) if not math.isfinite(v) or (median > 0 and v > limit)]


class MomentsReset(Remedy):
    """The ladder's third rung: the optimizer moments of the tensors whose gradients exploded (``exploded_ratio``
    times the median), named before the restore and cleared after it; every tensor's where none is named."""

    name = "moments"
    order = 60
    label = "optimizer moments reset"
    causes = (Cause.DYNAMICS, Cause.UNKNOWN)
    settings = (Setting("exploded_ratio", 100.0, is_number(1.0), "on the ladder's third rung, tensors whose "
                        "gradient norm is this many times the median have their optimizer moments reset."),)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.exploded: List[str] = []

    def before_restore(self, run: Run, incident: Incident) -> None:
        # Named now, while the failing step's gradients are still there (MMCV 1.x keeps them; where the runner
        # already zeroed them, every tensor's moments are reset).
        self.exploded = exploded_params(run.io.model(), self.config.exploded_ratio)

    def after_restore(self, run: Run, incident: Incident) -> List[Change]:
        params = dict(run.io.model().named_parameters())
        names = self.exploded or list(params)
        changes: List[Change] = []
        for opt in run.io.optimizers():
            changes += reset_moments(opt, [(n, params[n]) for n in names if n in params])
        return changes
