"""Why a confirmed divergence happened (data, fp16 forward overflow, dynamics, a bug) and the actions for each cause.

:func:`classify` reads the replay report of :func:`~.diagnose.diagnose_step` (the failing batch re-run on the live
weights and on the newest confirmed snapshot's, same RNG and autocast, plus the fp32 re-run of the module that
overflowed) and a small :class:`CauseHistory`. The actions are pure functions over live torch objects that return
what they changed (:class:`~.remedies.Change`, old and new values), as the other remedies do:

- dynamics: :func:`scale_lr` (schedules included), :func:`reset_moments` of :func:`exploded_params`;
- forward overflow: :func:`force_fp32` / :func:`release_fp32` / :func:`fp32_modules` / :func:`apply_fp32`;
- after every rollback: :func:`reset_temporal_state`, and :func:`nonfinite_attributes` as its health check.

Data quarantine lives in :mod:`.quarantine`.
"""
import contextlib
import enum
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import distributed
from .diagnose import FP16_MAX
from .flags import HAS_FOREACH_NORM
from .health import all_finite
from .remedies import Change

__all__ = [
    "Cause",
    "Classification",
    "CauseHistory",
    "ACTIONS",
    "ADVICE",
    "classify",
    "recurring",
    "merge",
    "agree",
    "scale_lr",
    "reset_moments",
    "exploded_params",
    "force_fp32",
    "release_fp32",
    "is_fp32",
    "fp32_modules",
    "apply_fp32",
    "TEMPORAL_RESET_METHODS",
    "GENERIC_RESET_CLASSES",
    "reset_temporal_state",
    "nonfinite_attributes",
]


class Cause(str, enum.Enum):
    """The class of a confirmed divergence. A ``str`` enum: ``Cause.DATA == "data"`` in JSON and checkpoints."""

    DATA = "data"
    """The failing batch also breaks the healthy weights (or arrives non-finite): the samples are the fault.
    Action: quarantine them for the rest of the run, roll back, change no hyperparameter."""

    FORWARD_OVERFLOW = "forward_overflow"
    """A module's fp16 forward turned finite inputs (within fp16 range) into NaN/Inf, and the same module re-run
    alone in fp32 on the same inputs is finite and back within fp16 range. Action: run it in fp32 from then on."""

    DYNAMICS = "dynamics"
    """The failing batch trains fine on the healthy weights: the weights or optimizer state drifted there.
    Action: a ladder, one rung per incident: the known manual fix (transformer dropout 0, max_norm 1), then
    learning rate x 0.5, then reset the optimizer moments of the tensors whose gradients exploded, then stop."""

    STRUCTURAL = "structural"
    """Non-finite from the first iterations, a second batch breaking right after the first was quarantined, or a
    cause whose remedies are spent: a bug (a wrong transform, an op built for another environment, a config).
    Action: stop with the plugin's error, naming the evidence and what to look at."""

    UNKNOWN = "unknown"
    """The replay cannot tell (no healthy weights to compare with, the diagnosis failed or was switched off).
    Action: treated as dynamics, the guard's behaviour before classification."""

    def __str__(self) -> str:  # f"{cause}" gives "data" on every Python (3.11 changed str() of mixed-in enums)
        return self.value


#: Precedence when ranks (or the live and healthy re-runs) disagree: the most specific, cheapest-to-act evidence
#: wins. A rank whose batch is fine on healthy weights only received the other rank's NaN through the all-reduce.
_PRIORITY = {Cause.UNKNOWN: 0, Cause.DYNAMICS: 1, Cause.DATA: 2, Cause.FORWARD_OVERFLOW: 3, Cause.STRUCTURAL: 4}

#: The action taken for each cause (names for the incident record and the log).
ACTIONS: Dict[Cause, str] = {
    Cause.DATA: "quarantine the batch's samples; roll back; no hyperparameter changes",
    Cause.FORWARD_OVERFLOW: "run the module in fp32 from now on; roll back",
    Cause.DYNAMICS: "next rung of the ladder: the known manual fix (transformer dropout 0, max_norm 1), "
                    "then lr x 0.5, then reset the exploded tensors' optimizer moments; roll back",
    Cause.STRUCTURAL: "stop",
    Cause.UNKNOWN: "as dynamics",
}

#: What to look at, for the error a structural stop raises.
ADVICE: Dict[Cause, str] = {
    Cause.STRUCTURAL: "look at what every batch goes through: the data pipeline's transforms (a wrong "
                      "normalisation, degenerate boxes), custom CUDA ops built for another torch/CUDA, the loss "
                      "terms, and the config (learning rate for the number of GPUs, loss scale); the incident log's "
                      "diagnosis names the first module that produced NaN/Inf",
    Cause.DATA: "the quarantined samples are listed in the incident log (dataset index, sample_idx, token)",
    Cause.FORWARD_OVERFLOW: "the module named runs in fp32; patch-config can write its config switch",
    Cause.DYNAMICS: "the ladder's rung that held is in the incident log",
    Cause.UNKNOWN: "enable diagnose=True and keep snapshots confirmed so the replay can compare",
}


@dataclass
class Classification:
    """One divergence's class with the evidence for it.

    Attributes:
        cause: the class.
        evidence: one sentence saying which signal decided it.
        modules: for forward overflow, the modules to run in fp32 (more than one after :func:`merge`).
            Defaults to [].
        signals: the readings behind the evidence (JSON-ready). Defaults to {}.
        ranks: which ranks reported which cause, after :func:`agree`. Defaults to {}.
    """

    cause: Cause
    evidence: str
    modules: List[str] = field(default_factory=list)
    signals: Dict[str, Any] = field(default_factory=dict)
    ranks: Dict[str, str] = field(default_factory=dict)

    @property
    def action(self) -> str:
        """The action for this class (:data:`ACTIONS`)."""
        return ACTIONS[self.cause]

    def as_dict(self) -> Dict[str, Any]:
        """JSON-ready form for the incident record."""
        return {"cause": self.cause.value, "evidence": self.evidence, "action": self.action,
                "modules": list(self.modules), "signals": dict(self.signals), "ranks": dict(self.ranks)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Classification":
        """The inverse of :meth:`as_dict`."""
        return cls(Cause(d["cause"]), str(d.get("evidence", "")), list(d.get("modules", [])),
                   dict(d.get("signals", {})), dict(d.get("ranks", {})))


class CauseHistory:
    """What earlier incidents were and which causes have no remedy left: the memory :func:`classify` needs.

    Args:
        first_iterations: a data incident at an iteration (1-based, counted from the start of training) up to this
            one is structural: the first batches break the weights the run started from. Defaults to 10.
        recurrence_window: a data incident fewer than this many iterations after the rollback of the previous
            data incident is structural: a second batch breaking at once means every batch breaks (a bug), not
            one sample. Defaults to 50.
    """

    def __init__(self, first_iterations: int = 10, recurrence_window: int = 50) -> None:
        for name, value in (("first_iterations", first_iterations), ("recurrence_window", recurrence_window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        self.first_iterations = first_iterations
        self.recurrence_window = recurrence_window
        self.incidents: List[Dict[str, Any]] = []
        self.spent: Dict[str, str] = {}

    def record(self, classification: Classification, iteration: int, restored_to: Optional[int] = None) -> None:
        """Adds an incident: its class, the iteration it happened at and the iteration rolled back to."""
        self.incidents.append({"iteration": int(iteration), "cause": classification.cause.value,
                               "modules": list(classification.modules),
                               "restored_to": None if restored_to is None else int(restored_to)})

    def last(self) -> Optional[Dict[str, Any]]:
        """The newest recorded incident, or None."""
        return self.incidents[-1] if self.incidents else None

    def count(self, cause: Cause) -> int:
        """How many incidents had this cause."""
        return sum(1 for i in self.incidents if i["cause"] == Cause(cause).value)

    def clean_since_last(self, iteration: int) -> Optional[int]:
        """Iterations trained since the newest incident's rollback point (or the incident itself); None if none."""
        last = self.last()
        if last is None:
            return None
        start = last["restored_to"] if last["restored_to"] is not None else last["iteration"]
        return max(0, int(iteration) - start)

    def mark_spent(self, cause: Cause, why: str) -> None:
        """Records that ``cause`` has no remedy left (the ladder's last rung, the skip list's bound, ...)."""
        self.spent[Cause(cause).value] = why

    def is_spent(self, cause: Cause) -> bool:
        """Whether ``cause`` has no remedy left."""
        return Cause(cause).value in self.spent

    def state_dict(self) -> Dict[str, Any]:
        return {"version": 1, "incidents": [dict(i) for i in self.incidents], "spent": dict(self.spent)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.incidents = [dict(i) for i in state.get("incidents", [])]
        self.spent = {str(k): str(v) for k, v in dict(state.get("spent", {})).items()}


# ---------------------------------------------------------------------------------------------- classification
def _overflow_module(report: Mapping[str, Any]) -> Optional[str]:
    check = report.get("fp32_check") or {}
    return check.get("fixed_by")


def _evidence_cause(report: Mapping[str, Any]) -> Tuple[Cause, str, List[str], Dict[str, Any]]:
    first = report.get("first") or {}
    healthy = report.get("on_healthy_weights")
    signals: Dict[str, Any] = {"reproduced": bool(report.get("reproduced")),
                               "first": {k: first.get(k) for k in ("module", "where", "dtype")} if first else None,
                               "healthy_compared": healthy is not None}
    # An fp16 overflow fixed by fp32, on the live weights or (when those already hold NaN) on the healthy ones.
    for where, rep in (("live", report), ("healthy", healthy or {})):
        module = _overflow_module(rep)
        if module:
            check = rep["fp32_check"]
            signals["fp32_check"] = {k: check.get(k) for k in ("module", "fixed_by", "max_abs")}
            made = (f"is made by the code that feeds {check['module']} (its input)" if check.get("where") == "input"
                    else f"appears in the fp16 forward of {check['module']} from finite inputs within fp16 range")
            return (Cause.FORWARD_OVERFLOW,
                    f"on the {where} weights the first NaN/Inf {made}, and {module} re-run alone in fp32 on the same "
                    f"inputs is finite (max |x| {check.get('max_abs')}, within {FP16_MAX:g})", [module], signals)
    if first and first.get("where") == "input" and first.get("module") == "(model)":
        return Cause.DATA, "the batch itself arrives holding NaN/Inf at the model's input", [], signals
    if healthy is not None:
        weights = healthy.get("weights") or "the last healthy weights"
        if healthy.get("reproduced"):
            where = (healthy.get("first") or {}).get("module")
            return (Cause.DATA, f"the same batch breaks the healthy weights too ({weights}; first in {where})", [],
                    signals)
        return Cause.DYNAMICS, f"the same batch trains fine on the healthy weights ({weights})", [], signals
    if report.get("reproduced"):
        return (Cause.UNKNOWN, "the batch breaks the live weights, but there are no healthy weights to re-run it "
                               "on (no confirmed snapshot)", [], signals)
    return (Cause.UNKNOWN, "the re-run of the failing batch stays finite and there are no healthy weights to "
                           "compare with", [], signals)


def classify(report: Optional[Mapping[str, Any]], history: Optional[CauseHistory] = None,
             iteration: Optional[int] = None, recurrence: bool = True) -> Classification:
    """Classifies one confirmed divergence from its replay report.

    The replay decides (fp16 overflow fixed by fp32 > a non-finite batch or one that breaks the healthy weights =
    data > fine on the healthy weights = dynamics > unknown); a data (or reproduced unknown) divergence within
    ``history.first_iterations`` is structural (the first batches break the start weights); then that cause
    becomes structural when its remedies are spent
    (:meth:`CauseHistory.mark_spent`), or, for data, when the previous incident was data too and fewer than
    ``history.recurrence_window`` iterations trained since its rollback (every batch breaks).

    Args:
        report: a :func:`~.diagnose.diagnose_step` report (``compare='reproduced'`` gives the healthy
            comparison whenever the live re-run reproduces); None when no diagnosis ran.
        history: earlier incidents. Defaults to None (an empty history with its defaults).
        iteration: the iteration of this incident (1-based, the guard's numbering). Defaults to None (unknown: no
            first-iterations rule).
        recurrence: apply the back-to-back data rule here. The guard applies it after the ranks agreed instead
            (:func:`recurring`), and only when every rank's batch broke. Defaults to True.

    Returns:
        The :class:`Classification`.
    """
    history = history if history is not None else CauseHistory()
    if not report:
        return Classification(Cause.UNKNOWN, "no diagnosis ran (diagnose=False, or the adapter cannot re-run the "
                                             "batch)")
    if report.get("error"):
        return Classification(Cause.UNKNOWN, f"the diagnosis failed: {report['error']}")
    cause, evidence, modules, signals = _evidence_cause(report)
    early = iteration is not None and iteration <= history.first_iterations
    if early and (cause == Cause.DATA or (cause == Cause.UNKNOWN and report.get("reproduced"))):
        # The run's first batches already break the weights it started from: nothing ever trained healthily.
        return Classification(Cause.STRUCTURAL,
                              f"{evidence}; at iteration {iteration}, within the first {history.first_iterations} "
                              "iterations: the model never trained healthily",
                              modules, dict(signals, evidence_cause=cause.value, iteration=iteration))
    if cause != Cause.UNKNOWN and history.is_spent(cause):
        return Classification(Cause.STRUCTURAL, f"{evidence}; and the remedies for {cause} are spent "
                                                f"({history.spent[cause.value]}): divergences keep coming on new data",
                              modules, dict(signals, evidence_cause=cause.value))
    c = Classification(cause, evidence, modules, signals)
    return recurring(c, history, iteration) if recurrence else c


def recurring(c: Classification, history: CauseHistory, iteration: Optional[int]) -> Classification:
    """A data divergence fewer than ``history.recurrence_window`` iterations after the previous data incident (its
    rollback point, or the incident itself where the run went on without one), whose samples were quarantined, is
    structural: the batches keep breaking, not one sample. Returns ``c`` unchanged otherwise."""
    last = history.last()
    # Only after a quarantine: its samples are gone, yet the next batch breaks too. Without one (no sample ids),
    # two bad batches in a row are a burst of bad data as much as a bug.
    if (c.cause != Cause.DATA or last is None or last["cause"] != Cause.DATA.value or iteration is None
            or not last.get("quarantined", True)):
        return c
    clean = history.clean_since_last(iteration)
    if clean is None or clean >= history.recurrence_window:
        return c
    return Classification(Cause.STRUCTURAL, f"{c.evidence}; and only {clean} iteration(s) after the previous bad "
                                            "batch: every batch breaks, not one sample",
                          c.modules, dict(c.signals, evidence_cause=Cause.DATA.value, clean_iterations=clean),
                          dict(c.ranks))


def merge(classifications: Sequence[Optional[Classification]]) -> Classification:
    """One class from several (ranks): the highest precedence wins; its overflow modules are united.

    Precedence: structural > forward overflow > data > dynamics > unknown. ``None`` entries (ranks that saw no
    fault and ran no diagnosis) are ignored; with none left the result is unknown.
    """
    present = [(i, c) for i, c in enumerate(classifications) if c is not None]
    if not present:
        return Classification(Cause.UNKNOWN, "no rank classified the divergence")
    _, best = max(present, key=lambda ic: (_PRIORITY[ic[1].cause], -ic[0]))
    modules: List[str] = []
    for _, c in present:
        if c.cause == best.cause:
            modules.extend(m for m in c.modules if m not in modules)
    ranks = {str(i): c.cause.value for i, c in present}
    return Classification(best.cause, best.evidence, modules, dict(best.signals), ranks)


def agree(local: Optional[Classification]) -> Classification:
    """:func:`merge` over every rank's classification, so all ranks act on the same class.

    Every rank must call it at the same point (a rank that ran no diagnosis passes None). Uses the guard's gloo
    host group: no device traffic. Without a process group it is :func:`merge` of ``[local]``.
    """
    if not distributed.is_distributed():
        return merge([local])
    gathered: List[Any] = [None] * distributed.get_world_size()
    # The guard's host group (gloo): CPU objects only, whatever the training backend.
    dist.all_gather_object(gathered, None if local is None else local.as_dict(),
                           group=distributed._host_group())
    return merge([None if d is None else Classification.from_dict(d) for d in gathered])


# ---------------------------------------------------------------------------------------------- dynamics
def _check_factor(factor: Any) -> float:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (0 < factor < math.inf):
        raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
    return float(factor)


#: Scheduler attributes holding absolute learning rates (lists, or MMCV 1.x dicts of lists): torch's
#: ``base_lrs`` / ``_last_lr`` / ``max_lrs`` / ``min_lrs``, MMEngine's ``base_values`` / ``_last_value``, MMCV 1.x
#: ``LrUpdaterHook``'s ``base_lr`` / ``regular_lr``.
_SCHEDULER_LISTS = ("base_lrs", "_last_lr", "max_lrs", "min_lrs", "base_values", "_last_value", "base_lr",
                    "regular_lr")
#: Scalar floor attributes: torch/MMEngine ``eta_min``, MMCV 1.x ``min_lr``. Ratios (``eta_min_ratio``,
#: ``min_lr_ratio``) follow the scaled base by themselves.
_SCHEDULER_SCALARS = ("eta_min", "min_lr")
#: Param-group keys holding learning rates: the live one, torch's ``initial_lr``, OneCycle's ``max_lr``/``min_lr``.
_GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")


def _scaled(value: Any, factor: float) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value * factor
    if isinstance(value, list):
        return [_scaled(v, factor) for v in value]
    if isinstance(value, tuple):
        return tuple(_scaled(v, factor) for v in value)
    if isinstance(value, dict):
        return {k: _scaled(v, factor) for k, v in value.items()}
    return value


def scale_lr(optimizers: Iterable[Any], factor: float, schedulers: Iterable[Any] = ()) -> List[Change]:
    """Multiplies the learning rate by ``factor`` now and in every later value of its schedules, in place.

    Every param group's ``lr`` (and ``initial_lr``, OneCycle's ``max_lr`` / ``min_lr`` where present) is scaled;
    each scheduler's stored bases and floors too, duck-typed so no framework is imported: torch's LR schedulers
    (``base_lrs``, ``_last_lr``, ``eta_min``, ...), MMEngine's param schedulers whose ``param_name`` is ``'lr'``
    (``base_values``, ``_last_value``, ``eta_min``; a momentum scheduler is left alone), MMCV 1.x's
    ``LrUpdaterHook`` (``base_lr``, ``regular_lr``, ``min_lr``). Chainable schedules (cosine's recursive form,
    step, warmup factors) then continue at ``factor`` times the unscaled schedule, closed-form ones too.

    Args:
        optimizers: torch optimizers (anything with ``param_groups``).
        factor: the multiplier, > 0 (0.5 halves).
        schedulers: LR schedulers or MMCV 1.x LR hooks to scale with them. Defaults to ().

    Returns:
        One :class:`Change` per value changed (``optimizer0.group0.lr``, ``CosineAnnealingLR.base_lrs``, ...).

    Raises:
        ValueError: ``factor`` is not a finite number > 0.
    """
    factor = _check_factor(factor)
    changes: List[Change] = []
    for i, opt in enumerate(optimizers):
        for j, group in enumerate(opt.param_groups):
            for key in _GROUP_KEYS:
                value = group.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    group[key] = value * factor
                    changes.append(Change(f"optimizer{i}.group{j}.{key}", value, group[key]))
    for sched in schedulers:
        if getattr(sched, "param_name", "lr") != "lr":
            continue
        name = type(sched).__name__
        for attr in _SCHEDULER_LISTS + _SCHEDULER_SCALARS:
            value = getattr(sched, attr, None)
            if value is None or isinstance(value, bool) or (attr in _SCHEDULER_SCALARS and value == 0):
                continue
            if not isinstance(value, (int, float, list, tuple, dict)):
                continue
            new = _scaled(value, factor)
            setattr(sched, attr, new)
            changes.append(Change(f"{name}.{attr}", value, new))
    return changes


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


# ---------------------------------------------------------------------------------------------- forward overflow
_HALF = (torch.float16, torch.bfloat16)
_MARK = "_petr_stability_fp32"


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    # Both device types: CPU and CUDA autocast are separate switches. torch.autocast exists from torch 1.10 on;
    # disabling needs no dtype support, so no version gate.
    with contextlib.ExitStack() as stack:
        for device in ("cuda", "cpu"):
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _to_fp32(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in _HALF else obj
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = _to_fp32(v)
        return out
    if isinstance(obj, (list, tuple)):
        items = [_to_fp32(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


class _Fp32Forward:
    """Stands in for a module's ``forward``: autocast off inside, half-precision floating inputs cast to float32.

    Kept as an instance attribute of the module (what ``nn.Module.__call__`` calls), so hooks, ``state_dict`` and
    the module's identity are untouched; a plain object (not a closure) so copies and pickles of the model keep it.
    """

    def __init__(self, module: nn.Module, prior: Any, fp16_flags: List[Tuple[nn.Module, Any]]) -> None:
        self.module = module
        self.prior = prior  # an instance forward that was already there, or None for the class's own
        self.fp16_flags = fp16_flags  # (module, old fp16_enabled) switched off for MMCV's @auto_fp16

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _autocast_off():
            args, kwargs = _to_fp32(args), _to_fp32(kwargs)
            if self.prior is not None:
                return self.prior(*args, **kwargs)
            return type(self.module).forward(self.module, *args, **kwargs)


def is_fp32(module: nn.Module) -> bool:
    """Whether :func:`force_fp32` is in effect on ``module``."""
    return isinstance(module.__dict__.get("forward"), _Fp32Forward)


def force_fp32(module: nn.Module, name: str = "") -> Optional[Change]:
    """Runs ``module`` in fp32 from now on: autocast (CPU and CUDA) off inside its forward, half-precision
    floating inputs cast up to float32; its output stays float32 (downstream autocast ops cast as they need).

    Idempotent. MMCV 1.x's ``@auto_fp16`` re-enters autocast where ``fp16_enabled`` is set: that flag is switched
    off on the module and its descendants too (and put back by :func:`release_fp32`). Copies and pickles of the
    model keep the setting; after a resume into a fresh model, re-apply it with :func:`apply_fp32` from the names
    :func:`fp32_modules` gave.

    Args:
        module: the module (a submodule of the unwrapped model).
        name: its name, for the change record. Defaults to "" (the class name).

    Returns:
        ``Change(name, 'autocast', 'float32')``, or None when it already ran in fp32.
    """
    if is_fp32(module):
        return None
    prior = module.__dict__.get("forward")
    flags = []
    for sub in module.modules():
        if getattr(sub, "fp16_enabled", False) is True:
            flags.append((sub, True))
            sub.fp16_enabled = False
    module.forward = _Fp32Forward(module, prior, flags)
    return Change(name or type(module).__name__, "autocast", "float32")


def release_fp32(module: nn.Module, name: str = "") -> Optional[Change]:
    """Undoes :func:`force_fp32`. Returns the change, or None when the module was not forced."""
    wrapper = module.__dict__.get("forward")
    if not isinstance(wrapper, _Fp32Forward):
        return None
    if wrapper.prior is not None:
        module.forward = wrapper.prior
    else:
        del module.forward
    for sub, value in wrapper.fp16_flags:
        sub.fp16_enabled = value
    return Change(name or type(module).__name__, "float32", "autocast")


def fp32_modules(model: nn.Module) -> List[str]:
    """Names of the modules :func:`force_fp32` put in fp32, for the guard's checkpoint state."""
    return [name or "(model)" for name, m in model.named_modules() if is_fp32(m)]


def apply_fp32(model: nn.Module, names: Iterable[str]) -> List[Change]:
    """:func:`force_fp32` on each named module (after a resume); returns the changes made.

    Raises:
        ValueError: a name is not a module of ``model``.
    """
    changes = []
    for name in names:
        try:
            module = model if name == "(model)" else model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"no module named {name!r} in the model (cannot run it in fp32)") from None
        change = force_fp32(module, name)
        if change is not None:
            changes.append(change)
    return changes


# ---------------------------------------------------------------------------------------------- temporal state
#: Methods that reset state a module keeps outside ``state_dict()``: StreamPETR's heads ``reset_memory()``
#: (memory_embedding, memory_reference_point, memory_timestamp, memory_egopose, memory_velo), Sparse4D's
#: ``InstanceBank.reset()`` (cached features, anchors, confidences).
TEMPORAL_RESET_METHODS: Tuple[str, ...] = ("reset_memory", "reset")

#: Generic method names and the only classes (matched by name along the MRO) on which they are called: ``reset``
#: means something else on many modules (optimizer-like helpers, metrics, custom layers), so it runs only on
#: Sparse4D's ``InstanceBank``. A name not listed here (``reset_memory``) is specific enough to call on any module.
GENERIC_RESET_CLASSES: Dict[str, Tuple[str, ...]] = {"reset": ("InstanceBank",)}

#: Never called, whatever the arguments: they re-initialise weights or statistics a rollback just restored.
_FORBIDDEN = ("reset_parameters", "_reset_parameters", "reset_running_stats", "init_weights")


def reset_temporal_state(model: nn.Module, method_names: Sequence[str] = TEMPORAL_RESET_METHODS,
                         generic_classes: Optional[Mapping[str, Sequence[str]]] = None) -> List[str]:
    """Calls each module's temporal-state reset method (after a rollback, so no memory computed by the poisoned
    weights survives: ``memory * prev_exists`` keeps NaN, as NaN * 0 = NaN).

    Args:
        model: the unwrapped model.
        method_names: methods to call where a module has them. Defaults to :data:`TEMPORAL_RESET_METHODS`.
        generic_classes: for generic names, the class names allowed to have them called. Defaults to None
            (:data:`GENERIC_RESET_CLASSES`).

    Returns:
        The names of the modules reset (``'(model)'`` for the model itself), in ``named_modules`` order.

    Raises:
        TypeError: ``method_names`` is a string.
        ValueError: a name re-initialises weights (``reset_parameters``, ``init_weights``, ...).
    """
    if isinstance(method_names, str):
        raise TypeError(f"method_names must be a list of names, got the string {method_names!r}")
    for method in method_names:
        if method in _FORBIDDEN:
            raise ValueError(f"{method!r} re-initialises weights or statistics; it is never called as a "
                             "temporal-state reset")
    generic = GENERIC_RESET_CLASSES if generic_classes is None else generic_classes
    reset: List[str] = []
    for name, module in model.named_modules():
        classes = {cls.__name__ for cls in type(module).__mro__}
        done = False
        for method in method_names:
            fn = getattr(module, method, None)
            if not callable(fn) or isinstance(fn, nn.Module):
                continue
            if method in generic and not classes.intersection(generic[method]):
                continue
            fn()
            done = True
        if done:
            reset.append(name or "(model)")
    return reset


def _attr_tensors(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
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


def nonfinite_attributes(model: nn.Module) -> List[str]:
    """Names of floating tensors held as plain module attributes (not parameters or buffers, lists/tuples of
    tensors included) that hold NaN/Inf: StreamPETR's memory queue, Sparse4D's instance bank.

    Cheap: one fused reduction and one host read when all is finite; each tensor is checked only when not.
    """
    named = _attr_tensors(model)
    if all_finite(t for _, t in named):
        return []
    return [n for n, t in named if not bool(torch.isfinite(t).all())]
