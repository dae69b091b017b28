"""The fp32 counterfactual: the module that overflowed, re-run alone in fp32 on the inputs it had."""
import math
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from ..flags import HAS_FORWARD_PRE_HOOK_KWARGS
from ..remedies.fp32 import force_fp32, release_fp32
from .recorder import FP16_MAX, mask_ok, max_abs, max_abs_in_fp16_reach, num, split_masks
from .sandbox import capture_rng, rank_local, restore_rng

__all__ = ["fp32_check"]


class _Found(BaseException):
    """Ends the fp32 check's re-run at the offending output. Not an ``Exception``: a forward's own
    ``except Exception`` must not swallow it."""


_Call = Tuple[nn.Module, Any, Any, Dict[str, Any]]  # (module, args, kwargs, RNG state just before the call)


def _module_names(model: nn.Module) -> Dict[nn.Module, str]:
    names: Dict[nn.Module, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(module, name or "(model)")
    return names


def _record_path(model: nn.Module, names: Dict[nn.Module, str], forward: Callable[[], Any],
                 rng_state: Optional[Mapping[str, Any]], target: nn.Module, where: str,
                 result: Dict[str, Any]) -> List[_Call]:
    """Re-runs the batch up to the fault at ``target``; the calls to try, from the inside out."""
    stack: List[_Call] = []
    path: List[_Call] = []
    handles = []

    def pre(module: nn.Module, args: Any, kwargs: Any = None) -> None:
        if where == "input" and module is target and not path and not _inputs_as_designed(module, args, kwargs):
            path.extend(stack[::-1])  # the calls whose code made this input, from the inside out
            raise _Found()
        stack.append((module, args, kwargs, capture_rng()))

    def post(module: nn.Module, args: Any, output: Any) -> None:
        entry = stack.pop() if stack else None
        if (where == "output" and module is target and entry is not None and not path
                and not math.isfinite(max_abs(output))):
            path.extend([entry] + stack[::-1])  # the target, then its enclosing calls from the inside out
            raise _Found()

    for module in names:
        if HAS_FORWARD_PRE_HOOK_KWARGS:
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        else:  # torch < 2.0: keyword arguments are not seen (such a call is re-run without them)
            handles.append(module.register_forward_pre_hook(lambda m, a: pre(m, a, None)))
        handles.append(module.register_forward_hook(post))
    try:
        if rng_state is not None:
            restore_rng(rng_state)
        with torch.enable_grad(), rank_local():
            try:
                forward()
            except _Found:
                pass
    except Exception as exc:  # the check is evidence, never a reason for the diagnosis to fail
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for handle in handles:
            handle.remove()
    return path


def _inputs_as_designed(module: nn.Module, args: Any, kwargs: Any) -> bool:
    """A call's inputs finite, but for the -inf/+inf of the masks passed to it (:mod:`~..watch.health`)."""
    values, masks = split_masks(module, args, kwargs)
    return math.isfinite(max_abs(values)) and all(mask_ok(t) for _, t in masks)


def _run_alone_in_fp32(module: nn.Module, name: str, args: Any, kwargs: Any, rng: Mapping[str, Any]) -> Dict:
    """One recorded call re-run under :func:`~..remedies.fp32.force_fp32`: its inputs' and output's max |x|."""
    values, masks = split_masks(module, args, kwargs)
    # A mask's -inf is by design (watch/health.py): the inputs in fp16's reach are the rest; a NaN mask is not.
    inputs = max_abs_in_fp16_reach(values) if all(mask_ok(t) for _, t in masks) else math.nan
    entry: Dict[str, Any] = {"module": name, "type": type(module).__name__, "inputs_max_abs": num(inputs),
                             "inputs_within_fp16": math.isfinite(inputs) and inputs <= FP16_MAX}
    try:
        change = force_fp32(module)
        try:
            restore_rng(rng)
            with torch.no_grad(), rank_local():
                out = module(*args, **(kwargs or {}))
        finally:
            if change is not None:
                release_fp32(module)
        value = max_abs(out)
        entry.update(finite=math.isfinite(value), max_abs=num(value),
                     within_fp16=math.isfinite(value) and value <= FP16_MAX)
    except Exception as exc:
        entry["error"] = f"{type(exc).__name__}: {exc}"
    return entry


def fp32_check(model: nn.Module, forward: Callable[[], Any], rng_state: Optional[Mapping[str, Any]],
               target_name: str, where: str = "output") -> Dict[str, Any]:
    """Re-runs the batch up to the first non-finite output of ``target_name``, then that module alone in fp32.

    With ``where='input'`` the re-run stops where ``target_name`` first *receives* a non-finite input: functional
    code of the calling module made it (an attention's own ``softmax(q @ k.T)`` before its ``out_proj``), so the
    calls enclosing it, from the inside out, are the candidates. The dtype is no gate: a module adding an fp32
    residual returns float32 although its overflow happened in fp16, and a re-run that changes nothing (no
    autocast) never reports a fix.

    The re-run records, for every module call on the way in, its inputs and the RNG state just before it, and stops
    when the target returns its non-finite output. Then the target, and if need be each enclosing call from the
    inside out (never the model itself: that is fp32 training), runs alone under
    :func:`~..remedies.fp32.force_fp32` on those inputs (so its dropout draws the same masks). The first one whose
    inputs were finite and within fp16 range (those fp16 code can see: a float64 timestamp in seconds never enters
    an fp16 op) and whose fp32 output is finite and within fp16 range is ``fixed_by``:
    running it in fp32 removes the overflow without moving it downstream (an output past 65504 would overflow again
    where the next fp16 op casts it down).
    """
    t0 = time.perf_counter()
    names = _module_names(model)
    target = model if target_name == "(model)" else model.get_submodule(target_name)
    result: Dict[str, Any] = {"module": target_name, "type": type(target).__name__, "where": where}
    path = _record_path(model, names, forward, rng_state, target, where, result)
    result["reproduced"] = bool(path)
    tried: List[Dict[str, Any]] = []
    fixed_by = None
    for module, args, kwargs, rng in path:
        if module is model:
            break
        entry = _run_alone_in_fp32(module, names.get(module, "?"), args, kwargs, rng)
        tried.append(entry)
        if entry["inputs_within_fp16"] and entry.get("within_fp16"):
            fixed_by = entry
            break
    result["tried"] = tried
    result["fixed_by"] = fixed_by["module"] if fixed_by else None
    result["max_abs"] = fixed_by["max_abs"] if fixed_by else None
    result["seconds"] = round(time.perf_counter() - t0, 4)
    return result
