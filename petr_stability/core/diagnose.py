"""Names the first module that produced a NaN/Inf: one re-run of the failing batch with module hooks, off the hot path.

Nothing here runs on a healthy step except :func:`capture_rng` (two host-side copies of RNG state). On a confirmed
divergence :func:`diagnose` installs forward hooks on every module and gradient hooks on their inputs, outputs
and parameters, re-runs the failing batch's forward (and, when that is finite, its backward), finds the first
non-finite value in execution order, then removes every hook and puts the model back as it found it. When that
value is a module's fp16 output from finite inputs, a second, shorter re-run records that module's inputs and runs
it alone in fp32 (``fp32_check``): the evidence that tells an fp16 forward overflow from everything else.
"""
import contextlib
import math
import time
from collections import defaultdict
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .tree import iter_tensors

__all__ = ["FP16_MAX", "COMPARE", "capture_rng", "restore_rng", "total_loss", "diagnose", "diagnose_step",
           "summarize"]

#: Largest finite float16 value: an activation or a scaled gradient beyond it overflows to Inf in fp16.
FP16_MAX = 65504.0

_EXPLAIN = {
    "input": "arrived non-finite at its input: made outside any module (the batch, or functional code in the "
             "caller's forward)",
    "parameter": "holds a non-finite parameter",
    "output": "its forward turned finite inputs and parameters into a non-finite output",
    "grad_input": "its backward produced a non-finite gradient for its input",
    "grad_output": "the gradient arriving at its output is non-finite (made outside any module, e.g. the loss)",
    "param_grad": "its backward produced a non-finite gradient for a parameter",
}


def capture_rng() -> Dict[str, Any]:
    """The CPU and current CUDA device RNG states.

    Host-side copies only (the CUDA state is a seed and an offset kept on the host): no device sync, cheap
    enough for every step.
    """
    state: Dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        state["cuda"] = torch.cuda.get_rng_state(device)
        state["cuda_device"] = device
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Sets the RNG states captured by :func:`capture_rng`."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], state["cuda_device"])


def total_loss(outputs: Any) -> Optional[torch.Tensor]:
    """The loss a runner would backpropagate: a tensor as is, or the sum over ``*loss*`` keys of a dict.

    Lists are summed and every term is averaged, as MMEngine's ``parse_losses`` and MMCV 1.x's
    ``_parse_losses`` do (without their cross-rank reduction of the logged values).
    """
    if isinstance(outputs, torch.Tensor):
        return outputs.float().mean()
    if not isinstance(outputs, Mapping):
        return None
    terms = []
    for key, value in outputs.items():
        if "loss" not in str(key):
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        terms.extend(v.float().mean() for v in values if isinstance(v, torch.Tensor))
    return sum(terms) if terms else None


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    # The core's one walker (core/tree.py); empty tensors have no max to read.
    return (t for t in iter_tensors(obj) if t.numel())


def _unwrap(model: nn.Module) -> nn.Module:
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model


def _num(value: float) -> Any:
    # JSON has no Inf/NaN: write them as strings, as the incident log does elsewhere.
    return value if math.isfinite(value) else str(value)


@contextlib.contextmanager
def _rank_local() -> Iterator[None]:
    """Makes ``torch.distributed.is_initialized()`` answer False for the duration of the re-run.

    Only the rank that saw the fault re-runs its batch, so any cross-rank reduction inside the forward
    (mmdet's ``reduce_mean`` in PETR's loss, ``SyncBatchNorm``) would wait forever for ranks that are not
    re-running; code that asks first computes locally instead. Scoped to the re-run, restored afterwards.
    """
    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    original = dist.is_initialized
    dist.is_initialized = lambda: False
    try:
        yield
    finally:
        dist.is_initialized = original


class _Check:
    """One observed tensor: where it was seen and its max |x| (a 0-dim tensor until read, then a float)."""

    __slots__ = ("module", "kind", "where", "detail", "phase", "dtype", "key", "value")

    def __init__(self, module: str, kind: str, where: str, detail: str, phase: str, tensor: torch.Tensor,
                 key: int = 0) -> None:
        self.module, self.kind, self.where, self.detail, self.phase, self.key = module, kind, where, detail, phase, key
        self.dtype = str(tensor.dtype).replace("torch.", "")
        # max |x| is NaN or Inf iff some element is; no host read here, so the re-run runs at full speed.
        self.value: Any = tensor.detach().abs().amax().float()


class _Recorder:
    """Owns every hook of one diagnosis and the checks they record, in execution order."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = {}
        for name, module in model.named_modules(remove_duplicate=False):
            self.names.setdefault(module, name or "(model)")
        self.kinds = {m: type(m).__name__ for m in self.names}
        self.phase = "forward"
        self.checks: List[_Check] = []
        self.calls: Dict[str, int] = defaultdict(int)
        self.handles: List[Any] = []
        self.read_upto = 0

    def install(self) -> None:
        for module in self.names:
            try:
                handle = module.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
            except TypeError:  # torch < 2.0: no keyword arguments
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

    def _add(self, module: nn.Module, where: str, detail: str, tensor: torch.Tensor, key: int = 0) -> None:
        self.checks.append(_Check(self.names.get(module, "?"), self.kinds.get(module, type(module).__name__), where,
                                  detail, self.phase, tensor, key))

    def _grad_fn(self, module: nn.Module, where: str, detail: str, key: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if grad is not None and grad.is_floating_point() and grad.numel():
                self._add(module, where, detail, grad, key)
        return hook

    def _watch_grad(self, module: nn.Module, obj: Any, where: str) -> None:
        for t in _tensors(obj):
            if t.requires_grad:
                self.handles.append(t.register_hook(self._grad_fn(module, where, "", id(t))))

    def _pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        # In the backward phase a forward is activation checkpointing recomputing a block: its values were
        # already checked in the forward, so only its gradients (which exist only now, for a reentrant
        # checkpoint that ran its first forward under no_grad) are watched.
        if self.phase == "forward":
            for t in _tensors((args, kwargs)):
                self._add(module, "input", "", t)
            for pname, p in module.named_parameters(recurse=False):
                if p.is_floating_point() and p.numel():
                    self._add(module, "parameter", pname, p)
        self._watch_grad(module, (args, kwargs), "grad_input")

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.phase == "forward":
            self.calls[self.names.get(module, "?")] += 1
            for t in _tensors(output):
                self._add(module, "output", "", t)
        self._watch_grad(module, output, "grad_output")

    def read(self) -> None:
        """Brings the values recorded since the last read to the host: one transfer per device."""
        pending = self.checks[self.read_upto:]
        by_device: Dict[torch.device, List[_Check]] = defaultdict(list)
        for check in pending:
            by_device[check.value.device].append(check)
        for checks in by_device.values():
            for check, value in zip(checks, torch.stack([c.value for c in checks]).cpu().tolist()):
                check.value = float(value)
        self.read_upto = len(self.checks)

    def first_nonfinite(self, phase: str) -> Optional[_Check]:
        checks = [c for c in self.checks if c.phase == phase]
        for i, check in enumerate(checks):
            if math.isfinite(check.value):
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


def _largest(checks: List[_Check], wheres: Tuple[str, ...], top: int) -> List[Dict[str, Any]]:
    per_module: Dict[str, _Check] = {}
    for check in checks:
        if check.where not in wheres:
            continue
        best = per_module.get(check.module)
        key = math.inf if math.isnan(check.value) else check.value
        if best is None or key > (math.inf if math.isnan(best.value) else best.value):
            per_module[check.module] = check
    ranked = sorted(per_module.values(), key=lambda c: -(math.inf if math.isnan(c.value) else c.value))
    return [{"module": c.module, "type": c.kind, "max_abs": _num(c.value), "dtype": c.dtype,
             "over_fp16": c.value > FP16_MAX} for c in ranked[:top]]


class _Found(BaseException):
    """Ends the fp32 check's re-run at the offending output. Not an ``Exception``: a forward's own
    ``except Exception`` must not swallow it."""


def _max_abs(obj: Any) -> float:
    """max |x| over every floating tensor in ``obj`` (NaN when any is NaN); one host read."""
    values = [t.detach().abs().amax().float().cpu() for t in _tensors(obj)]
    return float(torch.stack(values).max()) if values else 0.0


def _fp32_check(model: nn.Module, forward: Callable[[], Any], rng_state: Optional[Mapping[str, Any]],
                target_name: str, where: str = "output") -> Dict[str, Any]:
    """Re-runs the batch up to the first non-finite output of ``target_name``, then that module alone in fp32.

    With ``where='input'`` the re-run stops where ``target_name`` first *receives* a non-finite input: functional
    code of the calling module made it (an attention's own ``softmax(q @ k.T)`` before its ``out_proj``), so the
    calls enclosing it, from the inside out, are the candidates. The dtype is no gate: a module adding an fp32
    residual returns float32 although its overflow happened in fp16, and a re-run that changes nothing (no
    autocast) never reports a fix.

    The re-run records, for every module call on the way in, its inputs and the RNG state just before it, and stops
    when the target returns its non-finite output. Then the target, and if need be each enclosing call from the
    inside out (never the model itself: that is fp32 training), runs alone under :func:`~.causes.force_fp32` on
    those inputs (so its dropout draws the same masks). The first one whose inputs were finite and within fp16
    range and whose fp32 output is finite and within fp16 range is ``fixed_by``: running it in fp32 removes the
    overflow without moving it downstream (an output past 65504 would overflow again where the next fp16 op casts
    it down).
    """
    from .causes import force_fp32, release_fp32  # causes imports FP16_MAX from this module

    t0 = time.perf_counter()
    names: Dict[nn.Module, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(module, name or "(model)")
    target = model if target_name == "(model)" else model.get_submodule(target_name)
    result: Dict[str, Any] = {"module": target_name, "type": type(target).__name__, "where": where}
    stack: List[Tuple[nn.Module, Any, Any, Dict[str, Any]]] = []
    path: List[Tuple[nn.Module, Any, Any, Dict[str, Any]]] = []
    handles = []

    def pre(module: nn.Module, args: Any, kwargs: Any = None) -> None:
        if where == "input" and module is target and not path and not math.isfinite(_max_abs((args, kwargs))):
            path.extend(stack[::-1])  # the calls whose code made this input, from the inside out
            raise _Found()
        stack.append((module, args, kwargs, capture_rng()))

    def post(module: nn.Module, args: Any, output: Any) -> None:
        entry = stack.pop() if stack else None
        if (where == "output" and module is target and entry is not None and not path
                and not math.isfinite(_max_abs(output))):
            path.extend([entry] + stack[::-1])  # the target, then its enclosing calls from the inside out
            raise _Found()

    for module in names:
        try:
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        except TypeError:  # torch < 2.0: keyword arguments are not seen (such a call is re-run without them)
            handles.append(module.register_forward_pre_hook(lambda m, a: pre(m, a, None)))
        handles.append(module.register_forward_hook(post))
    try:
        if rng_state is not None:
            restore_rng(rng_state)
        with torch.enable_grad(), _rank_local():
            try:
                forward()
            except _Found:
                pass
    except Exception as exc:  # the check is evidence, never a reason for the diagnosis to fail
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for handle in handles:
            handle.remove()
    result["reproduced"] = bool(path)
    tried: List[Dict[str, Any]] = []
    fixed_by = None
    for module, args, kwargs, rng in path:
        if module is model:
            break
        inputs = _max_abs((args, kwargs))
        entry: Dict[str, Any] = {"module": names.get(module, "?"), "type": type(module).__name__,
                                 "inputs_max_abs": _num(inputs),
                                 "inputs_within_fp16": math.isfinite(inputs) and inputs <= FP16_MAX}
        try:
            change = force_fp32(module)
            try:
                restore_rng(rng)
                with torch.no_grad(), _rank_local():
                    out = module(*args, **(kwargs or {}))
            finally:
                if change is not None:
                    release_fp32(module)
            value = _max_abs(out)
            entry.update(finite=math.isfinite(value), max_abs=_num(value),
                         within_fp16=math.isfinite(value) and value <= FP16_MAX)
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
        tried.append(entry)
        if entry["inputs_within_fp16"] and entry.get("within_fp16"):
            fixed_by = entry
            break
    result["tried"] = tried
    result["fixed_by"] = fixed_by["module"] if fixed_by else None
    result["max_abs"] = fixed_by["max_abs"] if fixed_by else None
    result["seconds"] = round(time.perf_counter() - t0, 4)
    return result


def _nonfinite_params(model: nn.Module) -> List[str]:
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


class _ModelState:
    """What a diagnosis may change in the model, saved so that it can be put back exactly."""

    def __init__(self, model: nn.Module, params: bool) -> None:
        self.modes = [(m, m.training) for m in model.modules()]
        self.grads = [(p, p.grad) for p in model.parameters()]
        # Train-mode BatchNorm updates its running statistics on the re-run.
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.params = [(p, p.detach().clone()) for p in model.parameters()] if params else []

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in self.buffers + self.params:
                t.copy_(saved)
        for p, grad in self.grads:
            p.grad = grad
        for m, mode in self.modes:
            m.training = mode


def diagnose(model: nn.Module, forward: Callable[[], Any], rng_state: Optional[Mapping[str, Any]] = None,
             loss_scale: float = 1.0, weights: Optional[Mapping[str, torch.Tensor]] = None, backward: bool = True,
             top: int = 8, fp32_check: bool = True) -> Dict[str, Any]:
    """Re-runs one forward (and backward) with hooks on every module and reports where NaN/Inf first appeared.

    Args:
        model: the unwrapped model (a DDP forward on one rank alone would wait for the others).
        forward: re-runs the failing batch's forward on ``model`` inside the training autocast context and
            returns the loss tensor or loss dict.
        rng_state: RNG state from :func:`capture_rng` before the failing step, so dropout draws the same masks.
            Defaults to None (the current state).
        loss_scale: multiplies the loss before the backward, as the loss scaler did. Defaults to 1.0.
        weights: a state dict to run on instead of the live weights (a healthy snapshot when the live ones are
            already non-finite); the live ones are put back afterwards. Defaults to None.
        backward: run the backward when the forward is finite. Defaults to True.
        top: how many modules to list by magnitude. Defaults to 8.
        fp32_check: when the first non-finite value is a module's half-precision forward output (its inputs and
            parameters finite), re-run that module alone in fp32 on its recorded inputs (``fp32_check`` in the
            report, see :func:`_fp32_check`). Defaults to True.

    Returns:
        A JSON-ready report: ``first`` (module, type, where, detail, phase, value, why) or None when the re-run
        stays finite (``reproduced`` False), ``forward_finite``, ``backward``, ``loss``, ``over_fp16`` (modules
        whose output passed 65504, in execution order), ``largest_outputs`` / ``largest_grads`` (max |x| per
        module), ``nonfinite_parameters``, ``modules``, ``seconds``, and ``fp32_check`` when it ran (``module``,
        ``reproduced``, ``tried``: per module its inputs' and fp32 output's max |x|, ``fixed_by``: the module
        whose fp32 run is finite and within fp16 range, or None). Every hook is removed and the model's modes,
        gradients, buffers and weights are restored, also when ``forward`` raises.
    """
    t0 = time.perf_counter()
    model = _unwrap(model)
    rec = _Recorder(model)
    state = _ModelState(model, params=weights is not None)
    rng_now = capture_rng()
    report: Dict[str, Any] = {"loss_scale": float(loss_scale)}
    try:
        if weights is not None:
            report["live_nonfinite_parameters"] = _nonfinite_params(model)[:top]
            missing, _ = model.load_state_dict(dict(weights), strict=False)
            report["weights_missing"] = len(missing)
        report["nonfinite_parameters"] = _nonfinite_params(model)[:top]
        rec.install()
        if rng_state is not None:
            restore_rng(rng_state)
        with torch.enable_grad(), _rank_local():
            loss = total_loss(forward())
            rec.read()
            loss_value = float(loss.detach()) if loss is not None else None
            first = rec.first_nonfinite("forward")
            report["forward_finite"] = first is None and (loss_value is None or math.isfinite(loss_value))
            report["loss"] = None if loss_value is None else _num(loss_value)
            if not backward:
                report["backward"] = "not requested"
            elif not report["forward_finite"]:
                report["backward"] = "skipped: the forward is not finite"
            elif loss is None or not loss.requires_grad:
                report["backward"] = "skipped: no differentiable loss"
            else:
                for p, _ in state.grads:
                    p.grad = None
                rec.phase = "backward"
                (loss * loss_scale).backward()
                rec.read()
                first = rec.first_nonfinite("backward")
                report["backward"] = "run"
            del loss
        if fp32_check and first is not None and first.phase == "forward" and (
                first.where == "output" or (first.where == "input" and first.module != "(model)")):
            rec.remove()
            report["fp32_check"] = _fp32_check(model, forward, rng_state, first.module, first.where)
    finally:
        rec.remove()
        state.restore()
        restore_rng(rng_now)
    if first is not None and first.where in ("input", "output") and first.phase == "forward":
        # A parameter read directly by its owner's parent (nn.MultiheadAttention's out_proj, an Embedding's
        # weight) never passes through the owner's own hooks: name it when it is the non-finite one.
        unused = [n for n in report["nonfinite_parameters"] if rec.calls.get(n.rpartition(".")[0] or "(model)", 0) == 0]
        if unused:
            owner, _, short = unused[0].rpartition(".")
            module = model.get_submodule(owner)
            report["first"] = {"module": owner or "(model)", "type": type(module).__name__, "where": "parameter",
                               "detail": short, "phase": "forward", "value": "nan/inf",
                               "why": f"holds a non-finite parameter, read directly by {first.module} "
                                      "(its own forward never ran)"}
            first = None
            report.pop("fp32_check", None)  # the output was non-finite because of that parameter
    if first is not None:
        report["first"] = {"module": first.module, "type": first.kind, "where": first.where, "detail": first.detail,
                           "phase": first.phase, "value": _num(first.value), "dtype": first.dtype,
                           "why": _EXPLAIN[first.where]}
    report.setdefault("first", None)
    report["reproduced"] = report["first"] is not None
    forward_checks = [c for c in rec.checks if c.phase == "forward"]
    seen, over = set(), []
    for c in forward_checks:
        if c.where == "output" and c.value > FP16_MAX and c.module not in seen:
            seen.add(c.module)
            over.append(c.module)
    report["over_fp16"] = over[:top]
    report["largest_outputs"] = _largest(forward_checks, ("output",), top)
    report["largest_grads"] = _largest([c for c in rec.checks if c.phase == "backward"],
                                       ("grad_output", "grad_input", "param_grad"), top)
    report["modules"] = len(rec.names)
    report["calls"] = sum(rec.calls.values())
    report["seconds"] = round(time.perf_counter() - t0, 4)
    return report


#: When :func:`diagnose_step` re-runs the batch on the healthy weights too.
COMPARE = ("weights", "reproduced", "always")


def diagnose_step(model: nn.Module, forward: Callable[[], Any], rng_state: Optional[Mapping[str, Any]] = None,
                  loss_scale: float = 1.0, healthy_weights: Optional[Mapping[str, torch.Tensor]] = None,
                  healthy_from: str = "", compare: str = "weights", fp32_check: bool = True) -> Dict[str, Any]:
    """:func:`diagnose` on the live weights, then, if those are already non-finite, once more on healthy ones.

    Live non-finite weights name the module that holds them, but not what put NaN there; a second re-run of the
    same batch on the last healthy weights tells whether this batch breaks healthy weights too
    (``on_healthy_weights``): the data-versus-dynamics evidence of :func:`~.causes.classify`, which wants it
    also when the live weights are still finite (``compare='reproduced'``).

    Args:
        model: the unwrapped model.
        forward: as for :func:`diagnose`.
        rng_state: as for :func:`diagnose`. Defaults to None.
        loss_scale: as for :func:`diagnose`. Defaults to 1.0.
        healthy_weights: the last healthy state dict (a confirmed snapshot's). Defaults to None.
        healthy_from: where those weights come from, for the report. Defaults to "".
        compare: when to re-run on the healthy weights: ``'weights'`` (the live weights are non-finite),
            ``'reproduced'`` (that, or the live re-run reproduces the fault), ``'always'``. Defaults to
            ``'weights'``.
        fp32_check: as for :func:`diagnose`, on both re-runs. Defaults to True.

    Returns:
        The :func:`diagnose` report, with ``on_healthy_weights`` when the second re-run happened.

    Raises:
        ValueError: ``compare`` is not one of :data:`COMPARE`.
    """
    if compare not in COMPARE:
        raise ValueError(f"compare must be one of {list(COMPARE)}, got {compare!r}")
    report = diagnose(model, forward, rng_state=rng_state, loss_scale=loss_scale, fp32_check=fp32_check)
    wanted = (bool(report["nonfinite_parameters"]) or compare == "always"
              or (compare == "reproduced" and report["reproduced"]))
    if wanted and healthy_weights is not None:
        again = diagnose(model, forward, rng_state=rng_state, loss_scale=loss_scale, weights=healthy_weights,
                         fp32_check=fp32_check)
        report["on_healthy_weights"] = {
            "weights": healthy_from,
            "reproduced": again["reproduced"],
            "first": again["first"],
            "forward_finite": again["forward_finite"],
            "over_fp16": again["over_fp16"],
            "backward": again["backward"],
            "fp32_check": again.get("fp32_check"),
            "seconds": again["seconds"],
        }
    return report


def summarize(report: Mapping[str, Any]) -> str:
    """One log line for a :func:`diagnose` report."""
    if report.get("error"):
        return f"diagnosis failed: {report['error']}"
    first = report.get("first")
    if first:
        what = f"{first['where']} {first['detail']}".strip()
        line = (f"first non-finite value in {first['module']} ({first['type']}, {what}, {first['phase']}): "
                f"{first['why']}")
    else:
        line = "the re-run of the failing batch stays finite (not reproduced: a transient fault, or one from " \
               "outside the model's forward and backward)"
    if report.get("over_fp16"):
        line += f"; output past fp16 range ({FP16_MAX:g}) in {', '.join(report['over_fp16'][:3])}"
    if report.get("nonfinite_parameters"):
        line += f"; non-finite parameters: {', '.join(report['nonfinite_parameters'][:3])}"
    check = report.get("fp32_check")
    if check and check.get("fixed_by"):
        line += f"; re-run alone in fp32, {check['fixed_by']} is finite: an fp16 forward overflow"
    elif check and check.get("tried"):
        line += f"; re-run alone in fp32, {check['module']} does not come back within fp16 range"
    healthy = report.get("on_healthy_weights")
    if healthy:
        where = healthy["first"]["module"] if healthy["first"] else None
        line += (f"; on the healthy weights ({healthy['weights']}) the batch "
                 + (f"breaks again, first in {where}" if where else "stays finite"))
    return line + f" [{report.get('seconds', 0):.2f}s]"
