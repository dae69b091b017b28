"""The replay's hooks: every module's inputs, outputs and gradients checked in execution order, read in one go; and the
small value helpers every replay shares (fp16's range, max |x| over nested tensors, JSON-safe numbers, which inputs are
attention masks: their -inf is by design, docs/how-it-works.md)."""
import inspect
import math
from collections import defaultdict
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn

from ..flags import HAS_FORWARD_PRE_HOOK_KWARGS
from ..fp16 import FP16_MAX, reaches_fp16
from ..samples import MASK_NAME
from ..tree import iter_tensors

__all__ = ["mask_ok", "split_masks", "FP16_MAX", "tensors", "max_abs",
           "max_abs_in_fp16_reach", "num", "EXPLAIN", "Check", "Recorder", "largest", "nonfinite_params"]

_SIGNATURES: Dict[Any, Optional[inspect.Signature]] = {}


def mask_ok(t: torch.Tensor) -> bool:
    """A mask's values as designed: anything but NaN (``-inf`` bars a position; ``+inf`` is as deliberate)."""
    return not (t.is_floating_point() or t.is_complex()) or not bool(torch.isnan(t).any())


def _signature(module: nn.Module) -> Optional[inspect.Signature]:
    kind = type(module)
    if kind not in _SIGNATURES:
        try:
            _SIGNATURES[kind] = inspect.signature(module.forward)
        except (TypeError, ValueError):  # a builtin or C-level forward: only keyword arguments are named then
            _SIGNATURES[kind] = None
    return _SIGNATURES[kind]


def split_masks(module: nn.Module, args: Any, kwargs: Optional[Mapping[str, Any]]
                ) -> Tuple[Tuple[Any, Dict[str, Any]], List[Tuple[str, torch.Tensor]]]:
    """A module call's inputs without its masks, and the masks by argument name (:data:`~..samples.MASK_NAME`).

    Positional arguments are named by the module's ``forward`` signature (``nn.TransformerEncoderLayer``'s
    ``src_mask`` may come positionally); keyword arguments by their keys.

    Returns:
        ``((args, kwargs), masks)``: the arguments that are not masks (those passed positionally replaced by None,
        so positions keep their meaning), and ``[(name, tensor), ...]`` for every tensor passed as a mask.
    """
    kwargs = dict(kwargs or {})
    args = tuple(args) if isinstance(args, (list, tuple)) else (args,)
    masks: List[Tuple[str, torch.Tensor]] = []
    names: List[Optional[str]] = [None] * len(args)
    sig = _signature(module)
    if sig is not None:
        params = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        names[:len(params)] = [p.name for p in params[:len(args)]]
    kept_args = []
    for name, value in zip(names, args):
        if isinstance(name, str) and MASK_NAME.search(name.lower()) and isinstance(value, torch.Tensor):
            masks.append((name, value))
            kept_args.append(None)
        else:
            kept_args.append(value)
    kept_kwargs = {}
    for key, value in kwargs.items():
        if MASK_NAME.search(key.lower()) and isinstance(value, torch.Tensor):
            masks.append((key, value))
        else:
            kept_kwargs[key] = value
    return (tuple(kept_args), kept_kwargs), masks



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


EXPLAIN = {
    "input": "arrived non-finite at its input: made outside any module (the batch, or functional code in the "
             "caller's forward)",
    "parameter": "holds a non-finite parameter",
    "output": "its forward turned finite inputs and parameters into a non-finite output",
    "grad_input": "its backward produced a non-finite gradient for its input",
    "grad_output": "the gradient arriving at its output is non-finite (made outside any module, e.g. the loss)",
    "param_grad": "its backward produced a non-finite gradient for a parameter",
}


class Check:
    """One observed tensor: where it was seen and its max |x| (a 0-dim tensor until read, then a float)."""

    __slots__ = ("module", "kind", "where", "detail", "phase", "dtype", "key", "value", "designed")

    def __init__(self, module: str, kind: str, where: str, detail: str, phase: str, tensor: torch.Tensor,
                 key: int = 0, designed: bool = False) -> None:
        self.module, self.kind, self.where, self.detail, self.phase, self.key = module, kind, where, detail, phase, key
        #: A mask passed as an input (:mod:`~..watch.health`): -inf/+inf there is by design, NaN is not.
        self.designed = designed
        self.dtype = str(tensor.dtype).replace("torch.", "")
        # max |x| is NaN or Inf iff some element is; no host read here, so the re-run runs at full speed.
        self.value: Any = tensor.detach().abs().amax().float()


class Recorder:
    """Owns every hook of one diagnosis and the checks they record, in execution order."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = {}
        for name, module in model.named_modules(remove_duplicate=False):
            self.names.setdefault(module, name or "(model)")
        self.kinds = {m: type(m).__name__ for m in self.names}
        self.phase = "forward"
        self.checks: List[Check] = []
        self.calls: Dict[str, int] = defaultdict(int)
        self.handles: List[Any] = []
        self.read_upto = 0

    def install(self) -> None:
        for module in self.names:
            if HAS_FORWARD_PRE_HOOK_KWARGS:
                handle = module.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
            else:  # torch < 2.0: keyword arguments are not seen
                handle = module.register_forward_pre_hook(lambda m, args: self._pre_hook(m, args, None))
            self.handles.append(handle)
            self.handles.append(module.register_forward_hook(self._post_hook))
        for pname, p in self.model.named_parameters():
            if p.requires_grad:
                owner, _, short = pname.rpartition(".")
                module = self.model.get_submodule(owner)
                self.handles.append(p.register_hook(self._grad_fn(module, "param_grad", short, 0)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _add(self, module: nn.Module, where: str, detail: str, tensor: torch.Tensor, key: int = 0,
             designed: bool = False) -> None:
        self.checks.append(Check(self.names.get(module, "?"), self.kinds.get(module, type(module).__name__), where,
                                  detail, self.phase, tensor, key, designed))

    def _grad_fn(self, module: nn.Module, where: str, detail: str, key: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if grad is not None and grad.is_floating_point() and grad.numel():
                self._add(module, where, detail, grad, key)
        return hook

    def _watch_grad(self, module: nn.Module, obj: Any, where: str) -> None:
        for t in tensors(obj):
            if t.requires_grad:
                self.handles.append(t.register_hook(self._grad_fn(module, where, "", id(t))))

    def _pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        # In the backward phase a forward is activation checkpointing recomputing a block: its values were
        # already checked in the forward, so only its gradients (which exist only now, for a reentrant
        # checkpoint that ran its first forward under no_grad) are watched.
        if self.phase == "forward":
            values, masks = split_masks(module, args, kwargs)
            for t in tensors(values):
                self._add(module, "input", "", t)
            for name, t in masks:
                if t.numel() and t.is_floating_point():
                    self._add(module, "input", name, t, designed=True)
            for pname, p in module.named_parameters(recurse=False):
                if p.is_floating_point() and p.numel():
                    self._add(module, "parameter", pname, p)
        self._watch_grad(module, (args, kwargs), "grad_input")

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.phase == "forward":
            self.calls[self.names.get(module, "?")] += 1
            for t in tensors(output):
                self._add(module, "output", "", t)
        self._watch_grad(module, output, "grad_output")

    def read(self) -> None:
        """Brings the values recorded since the last read to the host: one transfer per device."""
        pending = self.checks[self.read_upto:]
        by_device: Dict[torch.device, List[Check]] = defaultdict(list)
        for check in pending:
            by_device[check.value.device].append(check)
        for checks in by_device.values():
            for check, value in zip(checks, torch.stack([c.value for c in checks]).cpu().tolist()):
                check.value = float(value)
        self.read_upto = len(self.checks)

    def first_nonfinite(self, phase: str) -> Optional[Check]:
        checks = [c for c in self.checks if c.phase == phase]
        for i, check in enumerate(checks):
            if math.isfinite(check.value) or (check.designed and not math.isnan(check.value)):
                continue
            if check.where == "grad_output":
                # Hooks on one tensor fire together: the module whose backward made that gradient (a consumer
                # of this output, seen as grad_input) is the better answer when it is there.
                for other in checks[i + 1:]:
                    if other.key != check.key:
                        break
                    if other.where == "grad_input" and not math.isfinite(other.value):
                        return other
            return check
        return None


def largest(checks: List[Check], wheres: Tuple[str, ...], top: int) -> List[Dict[str, Any]]:
    per_module: Dict[str, Check] = {}
    for check in checks:
        if check.where not in wheres:
            continue
        best = per_module.get(check.module)
        key = math.inf if math.isnan(check.value) else check.value
        if best is None or key > (math.inf if math.isnan(best.value) else best.value):
            per_module[check.module] = check
    ranked = sorted(per_module.values(), key=lambda c: -(math.inf if math.isnan(c.value) else c.value))
    return [{"module": c.module, "type": c.kind, "max_abs": num(c.value), "dtype": c.dtype,
             "over_fp16": c.value > FP16_MAX} for c in ranked[:top]]


def nonfinite_params(model: nn.Module) -> List[str]:
    named = [(n, p) for n, p in model.named_parameters() if p.is_floating_point() and p.numel()]
    if not named:
        return []
    by_device: Dict[torch.device, List[Tuple[str, torch.Tensor]]] = defaultdict(list)
    for name, p in named:
        by_device[p.device].append((name, p.detach().abs().amax().float()))
    bad = set()
    for items in by_device.values():
        values = torch.stack([v for _, v in items]).cpu().tolist()
        bad.update(name for (name, _), v in zip(items, values) if not math.isfinite(v))
    return [n for n, _ in named if n in bad]


