"""Finiteness checks over weights, buffers, optimizer state and nested checkpoint contents, as fused reductions; and
what is non-finite by design.

Two things do, in the models users train:

- **attention masks passed as inputs**: the float masks of ``nn.Transformer*`` and ``nn.MultiheadAttention``
  (``nn.TransformerEncoder`` turns a bool mask into a float one, ``-inf`` where attention is barred), MMCV's
  ``MultiheadAttention`` (``attn_mask``, ``key_padding_mask``), additive masks and biases. An input is a mask by the
  name of the argument it is passed as (:func:`~..samples.is_mask_name`); a mask
  may hold ``-inf``/``+inf``, never NaN.
- **state non-finite in the run's start state and unchanged since**: a causal mask registered as a buffer
  (``register_buffer('mask', torch.triu(torch.full((L, L), float('-inf')), 1))``), or kept as a plain attribute.
  :class:`ByDesign` keeps a copy of each such tensor as the run starts; one that still holds exactly those values
  is by design, one that changed (or holds NaN) is not.

What breaks is what the model did not mean: NaN anywhere; Inf in a loss, a gradient, a parameter, optimizer state,
a module's output, or in a buffer that was finite at the start or has changed. A batch that arrives holding NaN/Inf
(outside its masks) is still bad data.
"""
import weakref
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from torch import nn

from ..flags import HAS_FOREACH_NORM
from ..tree import iter_tensors

__all__ = [
    "ByDesign",
    "by_design",
    "HealthChecks",
    "iter_tensors",
    "all_finite",
    "first_nonfinite",
    "model_tensors",
    "optimizer_tensors",
    "state_finite",
    "state_dict_finite",
    "nonfinite_buffers",
    "attribute_tensors",
    "nonfinite_attributes",
]


def _nonfinite_without_nan(t: torch.Tensor) -> bool:
    return bool(t.numel()) and (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()) \
        and not bool(torch.isnan(t).any())


def _named_state(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    return [(n, b) for n, b in model.named_buffers() if b.is_floating_point()] + attribute_tensors(model)


class ByDesign:
    """The buffers and plain-attribute tensors of a model that hold ``-inf``/``+inf`` (and no NaN) in the run's start
    state: a copy of each, kept on its device (masks are small), so that "unchanged since" is one comparison.

    Build it with :meth:`capture` before the first step (the guard does, as the run starts); :func:`by_design` finds
    it again from the model.
    """

    def __init__(self, tensors: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        self.tensors: Dict[str, torch.Tensor] = dict(tensors or {})

    @classmethod
    def capture(cls, model: nn.Module) -> "ByDesign":
        """Keeps the model's state that is non-finite by design now, and registers it for :func:`by_design`."""
        found = cls({name: t.detach().clone() for name, t in _named_state(model) if _nonfinite_without_nan(t)})
        _CAPTURED[model] = found
        return found

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def names(self) -> List[str]:
        """The names held by design, as ``named_buffers()`` / the state dict name them."""
        return list(self.tensors)

    def allows(self, name: str, t: torch.Tensor) -> bool:
        """Whether ``t``, found non-finite under ``name``, is as designed: held so at the start, no NaN, unchanged."""
        ref = self.tensors.get(_strip(name))
        if ref is None or t.shape != ref.shape or bool(torch.isnan(t).any()):
            return False
        return bool(torch.equal(t.detach(), ref.to(device=t.device, dtype=t.dtype)))

    def split(self, named: Iterable[Tuple[str, torch.Tensor]]) -> Tuple[List[torch.Tensor], List[Tuple[str, Any]]]:
        """``named`` parted into the tensors to check as usual and the ``(name, tensor)`` pairs held by design."""
        usual, designed = [], []
        for name, t in named:
            (designed.append((name, t)) if _strip(name) in self.tensors else usual.append(t))
        return usual, designed

    def broken(self, designed: Iterable[Tuple[str, Any]]) -> List[str]:
        """The names among ``designed`` whose tensor is non-finite and not as designed (changed, or NaN)."""
        return [name for name, t in designed if isinstance(t, torch.Tensor) and t.numel()
                and not bool(torch.isfinite(t).all()) and not self.allows(name, t)]


def _strip(name: str) -> str:
    # DDP's and MMEngine's wrappers prefix the unwrapped model's names with "module."
    return name[len("module."):] if name.startswith("module.") else name


_CAPTURED: "weakref.WeakKeyDictionary[nn.Module, ByDesign]" = weakref.WeakKeyDictionary()


def by_design(model: Optional[nn.Module]) -> ByDesign:
    """What :meth:`ByDesign.capture` kept for ``model`` (empty where nothing was captured: then nothing non-finite is
    by design)."""
    if model is None:
        return ByDesign()
    found = _CAPTURED.get(model)
    if found is None and hasattr(model, "module"):
        found = _CAPTURED.get(model.module)
    return found if found is not None else ByDesign()


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


def state_finite(model: nn.Module, optimizers: Iterable[Any] = (), design: Optional[ByDesign] = None) -> bool:
    """True when the model's parameters and floating buffers, and the optimizers' state, are all finite, but for
    buffers non-finite by design (``design``; defaults to what :meth:`ByDesign.capture` kept for
    ``model``)."""
    design = by_design(model) if design is None else design
    tensors = [p.detach() for p in model.parameters()]
    buffers, designed = design.split((n, b) for n, b in model.named_buffers() if b.is_floating_point())
    tensors.extend(buffers)
    for opt in optimizers:
        tensors.extend(optimizer_tensors(opt))
    return all_finite(tensors) and not design.broken(designed)


def nonfinite_buffers(model: nn.Module, design: Optional[ByDesign] = None) -> List[str]:
    """Names of the floating buffers holding NaN/Inf, but for those non-finite by design (slow path)."""
    design = by_design(model) if design is None else design
    return [name for name, b in model.named_buffers() if b.is_floating_point() and b.numel()
            and not bool(torch.isfinite(b).all()) and not design.allows(name, b)]


def state_dict_finite(state: Mapping[str, Any], design: Optional[ByDesign] = None) -> bool:
    """A state dict (name -> tensor) finite but for the entries non-finite by design."""
    design = design if design is not None else ByDesign()
    usual, designed = design.split((str(k), v) for k, v in state.items() if isinstance(v, torch.Tensor))
    nested = [v for v in state.values() if not isinstance(v, torch.Tensor)]
    return all_finite(t for t in usual if t.is_floating_point() or t.is_complex()) and all_finite(
        iter_tensors(nested)) and not design.broken(designed)


def _group_norm(tensors: List[torch.Tensor]) -> torch.Tensor:
    # The L2 norm is NaN/Inf whenever an element is (inf**2 = inf, NaN propagates): one fused, vectorized
    # reduction per group (a single kernel on CUDA). It can also overflow on huge finite values (fp16 tensors
    # with a norm past 65504), so a non-finite result is confirmed exactly before anyone acts on it.
    if HAS_FOREACH_NORM:
        norms = torch._foreach_norm(tensors, 2)
        return torch.stack([n.float() for n in norms]).sum()
    return torch.stack([t.detach().float().norm() for t in tensors]).sum()


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when every element of every tensor is finite.

    One fused L2-norm reduction per (device, dtype) group and a single host read in all: about one read pass
    over the data. Only when that says non-finite, an exact element check confirms it (finite values whose
    norm overflows are not a fault). Empty tensors are ignored.
    """
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        if t.numel():
            groups[(t.device, t.dtype)].append(t.detach())
    if not groups:
        return True
    norms = [_group_norm(ts).to("cpu") for ts in groups.values()]
    if bool(torch.isfinite(torch.stack(norms)).all()):
        return True
    return all(bool(torch.isfinite(t).all()) for ts in groups.values() for t in ts)


def first_nonfinite(named: Iterable[Tuple[str, torch.Tensor]]) -> Optional[str]:
    """Name of the first tensor holding NaN/Inf, or None (slow path, used only after a failed check)."""
    for name, t in named:
        if t.numel() and (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            return name
    return None


def attribute_tensors(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for the floating tensors modules hold as plain attributes (not parameters or buffers; lists
    and tuples of tensors included): StreamPETR's memory queue, Sparse4D's instance bank."""
    registered = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    found = []
    for mname, module in model.named_modules():
        for attr, value in vars(module).items():
            items = [(attr, value)] if isinstance(value, torch.Tensor) else (
                [(f"{attr}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, (list, tuple)) else [])
            for key, t in items:
                if (isinstance(t, torch.Tensor) and id(t) not in registered and t.numel()
                        and (t.is_floating_point() or t.is_complex())):
                    found.append((f"{mname}.{key}" if mname else key, t))
    return found


def nonfinite_attributes(model: nn.Module, design: Optional[ByDesign] = None) -> List[str]:
    """Names of floating tensors held as plain module attributes (not parameters or buffers, lists/tuples of
    tensors included) that hold NaN/Inf: StreamPETR's memory queue, Sparse4D's instance bank; not those non-finite
    by design (a mask kept as an attribute since the run's start, unchanged).

    Cheap: one fused reduction and one host read when all is finite; each tensor is checked only when not.
    """
    named = attribute_tensors(model)
    if all_finite(t for _, t in named):
        return []
    design = by_design(model) if design is None else design
    return [n for n, t in named if not bool(torch.isfinite(t).all()) and not design.allows(n, t)]


class HealthChecks:
    """The finiteness of the live state, but for what is non-finite by design (:class:`ByDesign`, captured from the
    model as the guard is built and again as the run starts).

    Args:
        model: the model (unwrapped).
    """

    def __init__(self, model: nn.Module) -> None:
        self.design = ByDesign.capture(model)
        #: Plain-attribute tensors the last full check found non-finite (StreamPETR's memory queue).
        self.bad_attributes: List[str] = []

    def capture_design(self, model: nn.Module) -> None:
        """What holds -inf/+inf by design in the run's start state (before its first step, or right after resume)."""
        self.design = ByDesign.capture(model)

    def healthy(self, model: nn.Module, optimizers: Optional[List[Any]], log: Any) -> bool:
        """The model's parameters and buffers finite; with ``optimizers`` (a full check, else None) their state and
        the plain-attribute tensors too, those found non-finite named through ``log(msg, level)``."""
        if not state_finite(model, optimizers or (), self.design):
            return False
        if optimizers is not None:
            # Tensors modules hold as plain attributes (StreamPETR's memory queue): outside state_dict(), hidden by
            # PETR's nan_to_num, and carried into every later step. Checked with the full checks only (cheap).
            self.bad_attributes = nonfinite_attributes(model, self.design)
            if self.bad_attributes:
                log(f"NanGuard: non-finite values in module attributes outside the state dict: "
                    f"{', '.join(self.bad_attributes[:5])}", "warning")
                return False
        return True
