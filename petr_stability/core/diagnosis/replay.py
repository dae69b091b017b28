"""Names the first module that produced a NaN/Inf: one re-run of the failing batch with module hooks, off the hot path.

Nothing here runs on a healthy step except :func:`~.sandbox.capture_rng` (two host-side copies of RNG state). On a
confirmed divergence :func:`diagnose` installs forward hooks on every module and gradient hooks on their inputs,
outputs and parameters (:class:`~.recorder.Recorder`), re-runs the failing batch's forward (and, when that is finite,
its backward), finds the first non-finite value in execution order, then removes every hook and puts the model back
as it found it (:class:`~.sandbox.ModelState`). When that value is a module's fp16 output from finite inputs, a
second, shorter re-run records that module's inputs and runs it alone in fp32 (:func:`~.fp32_check.fp32_check`):
the evidence that tells an fp16 forward overflow from everything else.
"""
import math
import time
from typing import Any, Callable, Dict, Mapping, Optional

import torch
from torch import nn

from .fp32_check import fp32_check as run_fp32_check
from .recorder import EXPLAIN, FP16_MAX, Check, Recorder, largest, nonfinite_params, num
from .sandbox import ModelState, capture_rng, rank_local, restore_rng, unwrap

__all__ = ["FP16_MAX", "COMPARE", "total_loss", "diagnose", "diagnose_step", "summarize"]


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


def _replay(rec: Recorder, state: ModelState, forward: Callable[[], Any], loss_scale: float, backward: bool,
            report: Dict[str, Any]) -> Optional[Check]:
    """The hooked forward (and backward, when the forward is finite); the first non-finite check, or None."""
    loss = total_loss(forward())
    rec.read()
    loss_value = float(loss.detach()) if loss is not None else None
    first = rec.first_nonfinite("forward")
    report["forward_finite"] = first is None and (loss_value is None or math.isfinite(loss_value))
    report["loss"] = None if loss_value is None else num(loss_value)
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
    return first


def _wants_fp32_check(first: Optional[Check]) -> bool:
    # A module's fp16 output, or an input a module's caller made (never the batch at the model's own input).
    return first is not None and first.phase == "forward" and (
        first.where == "output" or (first.where == "input" and first.module != "(model)"))


def _unused_parameter(model: nn.Module, rec: Recorder, first: Check, report: Dict[str, Any]) -> Optional[Dict]:
    """A non-finite parameter read directly by its owner's parent (``nn.MultiheadAttention``'s ``out_proj``, an
    Embedding's weight) never passes through the owner's own hooks: it is the answer when it is the non-finite one."""
    if first.where not in ("input", "output") or first.phase != "forward":
        return None
    unused = [n for n in report["nonfinite_parameters"] if rec.calls.get(n.rpartition(".")[0] or "(model)", 0) == 0]
    if not unused:
        return None
    owner, _, short = unused[0].rpartition(".")
    module = model.get_submodule(owner)
    return {"module": owner or "(model)", "type": type(module).__name__, "where": "parameter", "detail": short,
            "phase": "forward", "value": "nan/inf",
            "why": f"holds a non-finite parameter, read directly by {first.module} (its own forward never ran)"}


def _conclude(model: nn.Module, rec: Recorder, first: Optional[Check], report: Dict[str, Any], top: int) -> None:
    """``first``, ``reproduced`` and the magnitude summaries of the report."""
    named = _unused_parameter(model, rec, first, report) if first is not None else None
    if named is not None:
        report["first"] = named
        report.pop("fp32_check", None)  # the output was non-finite because of that parameter
    elif first is not None:
        report["first"] = {"module": first.module, "type": first.kind, "where": first.where, "detail": first.detail,
                           "phase": first.phase, "value": num(first.value), "dtype": first.dtype,
                           "why": EXPLAIN[first.where]}
    else:
        report["first"] = None
    report["reproduced"] = report["first"] is not None
    forward_checks = [c for c in rec.checks if c.phase == "forward"]
    over = []
    for c in forward_checks:
        if c.where == "output" and c.value > FP16_MAX and c.module not in over:
            over.append(c.module)
    report["over_fp16"] = over[:top]
    report["largest_outputs"] = largest(forward_checks, ("output",), top)
    report["largest_grads"] = largest([c for c in rec.checks if c.phase == "backward"],
                                      ("grad_output", "grad_input", "param_grad"), top)
    report["modules"] = len(rec.names)
    report["calls"] = sum(rec.calls.values())


def diagnose(model: nn.Module, forward: Callable[[], Any], rng_state: Optional[Mapping[str, Any]] = None,
             loss_scale: float = 1.0, weights: Optional[Mapping[str, torch.Tensor]] = None, backward: bool = True,
             top: int = 8, fp32_check: bool = True, setup: Optional[Callable[[], Any]] = None) -> Dict[str, Any]:
    """Re-runs one forward (and backward) with hooks on every module and reports where NaN/Inf first appeared.

    Args:
        model: the unwrapped model (a DDP forward on one rank alone would wait for the others).
        forward: re-runs the failing batch's forward on ``model`` inside the training autocast context and
            returns the loss tensor or loss dict.
        rng_state: RNG state from :func:`~.sandbox.capture_rng` before the failing step, so dropout draws the same
            masks. Defaults to None (the current state).
        loss_scale: multiplies the loss before the backward, as the loss scaler did. Defaults to 1.0.
        weights: a state dict to run on instead of the live weights (a healthy snapshot when the live ones are
            already non-finite); the live ones are put back afterwards. Defaults to None.
        backward: run the backward when the forward is finite. Defaults to True.
        top: how many modules to list by magnitude. Defaults to 8.
        fp32_check: when the first non-finite value is a module's half-precision forward output (its inputs and
            parameters finite), re-run that module alone in fp32 on its recorded inputs (``fp32_check`` in the
            report, see :func:`~.fp32_check.fp32_check`). Defaults to True.
        setup: called once the weights are in place, before the re-run: puts the rest of the model's state (its
            temporal memory outside ``state_dict()``) where ``weights`` had it; undone with everything else after.
            Defaults to None.

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
    model = unwrap(model)
    rec = Recorder(model)
    state = ModelState(model, params=weights is not None)
    rng_now = capture_rng()
    report: Dict[str, Any] = {"loss_scale": float(loss_scale)}
    try:
        if weights is not None:
            report["live_nonfinite_parameters"] = nonfinite_params(model)[:top]
            missing, _ = model.load_state_dict(dict(weights), strict=False)
            report["weights_missing"] = len(missing)
            report["state_setup"] = setup() if setup is not None else None
        report["nonfinite_parameters"] = nonfinite_params(model)[:top]
        rec.install()
        if rng_state is not None:
            restore_rng(rng_state)
        with torch.enable_grad(), rank_local():
            first = _replay(rec, state, forward, loss_scale, backward, report)
        if fp32_check and _wants_fp32_check(first):
            rec.remove()
            report["fp32_check"] = run_fp32_check(model, forward, rng_state, first.module, first.where)
    finally:
        rec.remove()
        state.restore()
        restore_rng(rng_now)
    _conclude(model, rec, first, report, top)
    report["seconds"] = round(time.perf_counter() - t0, 4)
    return report


#: When :func:`diagnose_step` re-runs the batch on the healthy weights too.
COMPARE = ("weights", "reproduced", "always")


def diagnose_step(model: nn.Module, forward: Callable[[], Any], rng_state: Optional[Mapping[str, Any]] = None,
                  loss_scale: float = 1.0, healthy_weights: Optional[Mapping[str, torch.Tensor]] = None,
                  healthy_from: str = "", compare: str = "weights", fp32_check: bool = True,
                  good_forward: Optional[Callable[[], Any]] = None, good_rng: Optional[Mapping[str, Any]] = None,
                  good_from: str = "", healthy_setup: Optional[Callable[[], Any]] = None) -> Dict[str, Any]:
    """:func:`diagnose` on the live weights, then, if those are already non-finite, once more on healthy ones.

    Live non-finite weights name the module that holds them, but not what put NaN there; a second re-run of the
    same batch on the last healthy weights tells whether this batch breaks healthy weights too
    (``on_healthy_weights``): the data-versus-dynamics evidence of :func:`~.classify.classify`, which wants it
    also when the live weights are still finite (``compare='reproduced'``). That re-run backpropagates the
    unscaled loss: an overflow the loss scale alone causes is the scaler's to skip, not the batch's doing.

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
        good_forward: re-runs a batch known to be good (the last healthy iteration's) the same way. When the failing
            batch breaks the healthy weights too, that batch is re-run on them as well (``good_batch``): if it
            breaks too, every batch does (a bug, or a forward overflow), not this batch's data. Defaults to None.
        good_rng: the good batch's RNG state. Defaults to None.
        good_from: where the good batch comes from, for the report. Defaults to "".
        healthy_setup: run after the healthy weights are loaded, before each re-run on them: the model's temporal
            state (a memory outside ``state_dict()``) as of those weights, so that a memory the live weights poisoned
            never makes a good batch look bad (:func:`diagnose`'s ``setup``). Defaults to None.

    Returns:
        The :func:`diagnose` report, with ``on_healthy_weights`` when the second re-run happened and ``good_batch``
        when the third did.

    Raises:
        ValueError: ``compare`` is not one of :data:`COMPARE`.
    """
    if compare not in COMPARE:
        raise ValueError(f"compare must be one of {list(COMPARE)}, got {compare!r}")
    report = diagnose(model, forward, rng_state=rng_state, loss_scale=loss_scale, fp32_check=fp32_check)
    wanted = (bool(report["nonfinite_parameters"]) or compare == "always"
              or (compare == "reproduced" and report["reproduced"]))
    if wanted and healthy_weights is not None:
        # Unscaled: a gradient that overflows only because of the loss scale is the scaler's to skip (a dynamic
        # scale calibrating overflows on every batch), not a sign that this batch breaks these weights.
        again = diagnose(model, forward, rng_state=rng_state, loss_scale=1.0, weights=healthy_weights,
                         fp32_check=fp32_check, setup=healthy_setup)
        report["on_healthy_weights"] = {"weights": healthy_from, **_brief(again)}
        if again["reproduced"] and good_forward is not None:
            good = diagnose(model, good_forward, rng_state=good_rng, loss_scale=1.0, weights=healthy_weights,
                            fp32_check=fp32_check, setup=healthy_setup)
            report["good_batch"] = {"batch": good_from, "weights": healthy_from, **_brief(good)}
    return report


def _brief(report: Mapping[str, Any]) -> Dict[str, Any]:
    """The part of a second re-run's report the first one carries."""
    keys = ("reproduced", "first", "forward_finite", "over_fp16", "backward")
    setup = {"state_setup": report["state_setup"]} if report.get("state_setup") else {}
    return {**{k: report[k] for k in keys}, **setup, "fp32_check": report.get("fp32_check"),
            "seconds": report["seconds"]}


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
    good = report.get("good_batch")
    if good:
        line += f"; {good['batch']}, known to be good, " + ("breaks there too" if good["reproduced"] else
                                                           "stays finite there")
    window = report.get("window")
    if window:
        line += (f"; replayed from iter {window.get('since')}, the batch of iter {window.get('iteration')} is the "
                 f"first to poison {', '.join((window.get('poisoned') or [])[:2])}: dataset indices "
                 f"{window.get('blamed')}{' (not narrowed)' if window.get('ambiguous') else ''}" if window.get("found")
                 else f"; the window since iter {window.get('since')} names no batch "
                      f"({window.get('why') or window.get('error')})") + f" [{window.get('seconds', 0):.2f}s]"
    return line + f" [{report.get('seconds', 0):.2f}s]"
