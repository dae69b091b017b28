"""Pre-flight checks: the known config-level fp16 hazards of a PETR-family config, found before training.

Every check reads a plain config dict (MMCV 1.x or MMEngine, as :func:`~petr_stability.configfix.load.load_config`
returns it) and returns :class:`Finding` records, so ``petr-stability check``, the hook's start and the tests share
one code path. A check fires only on what the config says: where a fact it needs is unknown (the world size, the
per-GPU batch, an epoch's length, the lr a batch was declared for) it stays quiet.
"""
import copy
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .keys import (
    FAMILIES,
    batch_setting,
    config_family,
    fp16_loss_scales,
    get_path,
    is_number,
    optim_wrappers,
    positive_int,
    type_name,
)
from .load import load_config, read_config
from .origin import Provenance, provenance
from .patch import dropout_walk

__all__ = [
    "CHECKS",
    "PETR_REFERENCE_GPUS",
    "Finding",
    "check_config",
    "check_file",
    "check_runner_config",
    "format_findings",
    "log_findings",
]

#: Every check's stable id and what it looks for (docs/preflight.md has the evidence behind each).
CHECKS: Dict[str, str] = {
    "lr-not-scaled": "the learning rate was written for another total batch than this run's",
    "auto-scale-lr-off": "MMEngine auto_scale_lr disabled while world size x batch differs from base_batch_size",
    "static-loss-scale": "fp16 with a static loss scale",
    "fp16-flash-attention": "flash / fused attention in fp16",
    "bn-batch-one": "BatchNorm in the neck or head with one sample per GPU and no SyncBN",
    "no-grad-clip": "no gradient clipping at all",
    "transformer-dropout": "drop probabilities > 0 in the head's transformer",
    "check-invalid-loss-hook": "mmdet's CheckInvalidLossHook in custom_hooks",
    "rare-checkpoints": "checkpoints rarer than once per epoch (or none)",
    "single-checkpoint-kept": "max_keep_ckpts=1",
    "carried": "what an earlier run's guard put in force that this run re-applies before its first iteration",
}
#: The GPU count the megvii PETR / StreamPETR configs were written for (their README trains on 8 GPUs); assumed for
#: an MMCV 1.x PETR-family config that declares neither ``num_gpus`` nor ``total_batch_size``.
PETR_REFERENCE_GPUS = 8

_BN_TYPES = frozenset(("BN", "BN1d", "BN2d", "BN3d", "BatchNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d"))
_LR_SOURCE = "megvii-research/PETR#51 and HorizonRobotics/Sparse4D#66 were fixed by lowering the lr"


@dataclass(frozen=True)
class Finding:
    """One hazard found in a config.

    Attributes:
        check: the check's stable id (a key of :data:`CHECKS`).
        severity: ``'warning'`` (a known cause of NaN/Inf or of lost work) or ``'info'``.
        key: the dotted config key the value was read from.
        value: the value read there (``None`` where the key is absent or set to None).
        why: one line saying why it matters, with the source of the fact.
        fix: what to write instead.
    """

    check: str
    severity: str
    key: str
    value: Any
    why: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.severity}] {self.check}: {self.key}={self.value!r}"


# ---------------------------------------------------------------------------------------------- reading
def _dicts(node: Any, path: str) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """Every dict below ``node`` (lists and tuples followed) with its dotted path, depth first, in order."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _dicts(value, f"{path}.{key}")
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from _dicts(item, f"{path}[{i}]")


def _is_petr_family(cfg: Dict[str, Any]) -> bool:
    model = cfg.get("model")
    if not isinstance(model, dict):
        return False
    names = [type_name(model)] + [type_name(v) for v in model.values() if isinstance(v, dict)]
    return any("petr" in n.lower() for n in names)


@dataclass
class _Run:
    cfg: Dict[str, Any]
    family: Optional[str]
    world_size: Optional[int]
    batch: Optional[int]
    batch_key: str
    fp16: List[Tuple[str, Any, bool]]
    origins: Optional[Provenance] = None

    def declared_for(self, key: str, lr_key: str) -> bool:
        """A batch declaration counts unless the config's file tree shows it was written for another lr."""
        return self.origins is None or self.origins.declared_for(key, lr_key) is not False

    def batch_text(self) -> str:
        """``this run has 2 x 2 = 4 (data.samples_per_gpu=2 per GPU)``: the run's total and where its batch is."""
        where = (f"--batch-per-gpu {self.batch}" if self.batch_key == "--batch-per-gpu" else
                 f"{self.batch_key}={self.batch} per GPU")
        return f"this run has {self.world_size} x {self.batch} = {self.world_size * self.batch} ({where})"


# ---------------------------------------------------------------------------------------------- checks
def _lr_reference(run: _Run, lr_key: str) -> Optional[Tuple[int, str]]:
    """The total batch the config's lr was written for, and how that is known."""
    cfg = run.cfg

    def declared(key: str) -> Optional[int]:
        value = positive_int(cfg.get(key))
        return value if value is not None and run.declared_for(key, lr_key) else None

    total = declared("total_batch_size")
    if total is not None:
        return total, f"total_batch_size={total}"
    gpus, per_gpu_declared = declared("num_gpus"), declared("batch_size")
    per_gpu = ("batch_size", per_gpu_declared) if per_gpu_declared is not None else batch_setting(cfg, run.family)
    if gpus is not None and per_gpu is not None:
        return gpus * per_gpu[1], f"num_gpus={gpus} x {per_gpu[0]}={per_gpu[1]}"
    base = declared("base_batch_size")
    if base is not None:
        return base, f"base_batch_size={base}"
    if run.family == "mmcv1" and _is_petr_family(cfg) and per_gpu is not None:
        return (PETR_REFERENCE_GPUS * per_gpu[1],
                f"assumed: the {PETR_REFERENCE_GPUS} GPUs x {per_gpu[0]}={per_gpu[1]} the PETR/StreamPETR configs "
                "were written for; the config declares no num_gpus")
    return None


def _lr(run: _Run) -> Optional[Tuple[str, float]]:
    if run.family == "mmengine":
        wrappers = optim_wrappers(run.cfg)
        if not wrappers:
            return None
        path, wrapper = wrappers[0]
        key, lr = f"{path}.optimizer.lr", get_path(wrapper, "optimizer.lr")
    else:
        key, lr = "optimizer.lr", get_path(run.cfg, "optimizer.lr")
    return (key, lr) if is_number(lr) and lr > 0 else None


def _check_auto_scale_lr(run: _Run, lr_key: Optional[str]) -> Optional[List[Finding]]:
    """MMEngine's ``auto_scale_lr``; None where it says nothing about this lr (absent, or written for another)."""
    asl = run.cfg.get("auto_scale_lr")
    if run.family != "mmengine" or not isinstance(asl, dict) or not positive_int(asl.get("base_batch_size")):
        return None
    if lr_key is not None and not run.declared_for("auto_scale_lr.base_batch_size", lr_key):
        return None  # e.g. an mmdet3d schedule file's base under a project config that sets its own lr
    base, enabled = asl["base_batch_size"], asl.get("enable", False)
    actual = run.world_size * run.batch
    if enabled or base == actual:
        return []
    smaller = actual < base
    return [Finding(
        "auto-scale-lr-off", "warning" if smaller else "info", "auto_scale_lr.enable", enabled,
        f"auto_scale_lr.base_batch_size={base} but {run.batch_text()} and MMEngine rescales the lr only with "
        + ("enable=True; too high an lr for the batch diverges (" + _LR_SOURCE + ")" if smaller else
           "enable=True; a bigger batch at the same lr is stable, only slower to converge"),
        f"auto_scale_lr = dict(enable=True, base_batch_size={base}) (tools/train.py --auto-scale-lr), "
        "or scale the lr by hand")]


def _check_lr(run: _Run) -> List[Finding]:
    if run.world_size is None or run.batch is None:
        return []
    lr = _lr(run)
    scaled = _check_auto_scale_lr(run, lr[0] if lr else None)
    if scaled is not None:
        return scaled
    ref = _lr_reference(run, lr[0]) if lr else None
    actual = run.world_size * run.batch
    if ref is None or lr is None or ref[0] == actual:
        return []
    total, how = ref
    (key, value), smaller = lr, actual < total
    suggested = value * actual / total
    return [Finding(
        "lr-not-scaled", "warning" if smaller else "info", key, value,
        f"the lr was written for a total batch of {total} ({how}) and {run.batch_text()}; "
        + ("too high an lr for the batch diverges in fp16 (" + _LR_SOURCE + ")" if smaller else
           "a bigger batch at the same lr is stable, only slower to converge (linear scaling rule)"),
        f"lr={suggested:.3g} (linear scaling: {value:g} x {actual}/{total}), or train on a total batch of {total}")]


def _check_static_scale(run: _Run) -> List[Finding]:
    out = []
    for key, scale, default in run.fp16:
        if not is_number(scale):
            continue  # 'dynamic' or a GradScaler kwargs dict: the scale backs off on overflow
        where = " (not set: Fp16OptimizerHook's default)" if default else ""
        out.append(Finding(
            "static-loss-scale", "warning", key, scale,
            f"a static loss scale{where} never backs off: any gradient above 65504/{scale:g} overflows fp16 and "
            "its step is skipped, every step once gradients outgrow it (megvii-research/PETR#105 recommends "
            "loss_scale='dynamic')",
            f"{key}='dynamic'"))
    return out


def _check_flash(run: _Run) -> List[Finding]:
    if not run.fp16:
        return []
    hits = [(p, type_name(d)) for p, d in _dicts(run.cfg.get("model"), "model") if "flash" in type_name(d).lower()]
    if not hits:
        return []
    more = f" ({len(hits)} such modules)" if len(hits) > 1 else ""
    return [Finding(
        "fp16-flash-attention", "warning", f"{hits[0][0]}.type", hits[0][1],
        f"flash attention computes softmax and sums in fp16 under fp16 training{more}; NaN losses were traced to "
        "it (AlmoonYsl/OPEN#5)",
        "type='PETRMultiheadAttention' (exiawsh/StreamPETR#42 swaps it in), or keep flash attention with "
        "NanGuardHook watching")]


def _check_bn(run: _Run) -> List[Finding]:
    model = run.cfg.get("model")
    if run.batch != 1 or run.cfg.get("sync_bn") or not isinstance(model, dict):
        return []
    hits = []
    for name, part in model.items():
        lowered = str(name).lower()
        if "backbone" in lowered or not ("neck" in lowered or lowered.endswith("head")):
            continue
        for path, node in _dicts(part, f"model.{name}"):
            if type_name(node) in _BN_TYPES and "norm" in path.rsplit(".", 1)[-1].lower():
                hits.append((f"{path}.type", type_name(node)))
    if not hits:
        return []
    more = f" ({len(hits)} BatchNorm configs)" if len(hits) > 1 else ""
    return [Finding(
        "bn-batch-one", "warning", hits[0][0], hits[0][1],
        f"BatchNorm{more} sees one sample per GPU ({run.batch_key}=1): its batch statistics are noise "
        "(fundamentalvision/BEVFormer#136; zhanghang1989/ResNeSt#146: NaN at a small per-GPU batch, SyncBN advised)",
        "norm_cfg=dict(type='SyncBN') (MMEngine: sync_bn='torch') on several GPUs, or GN, or a per-GPU batch > 1")]


def _check_clip(run: _Run) -> List[Finding]:
    why = ("nothing bounds an update when a bad batch arrives; the PETR configs ship max_norm=35 and the known manual "
           "fix (transformer dropout 0, max_norm 1) lowers it (HorizonRobotics/Sparse4D#109: a tighter clip stopped "
           "a divergence)")
    if run.family == "mmengine":
        keys = [f"{path}.clip_grad" for path, w in optim_wrappers(run.cfg) if w.get("clip_grad") is None]
    elif run.family == "mmcv1" and isinstance(run.cfg.get("optimizer_config"), dict):
        keys = ["optimizer_config.grad_clip"] if run.cfg["optimizer_config"].get("grad_clip") is None else []
    else:
        keys = []
    return [Finding("no-grad-clip", "warning", key, None, why, f"{key}=dict(max_norm=35, norm_type=2)")
            for key in keys]


def _check_dropout(run: _Run) -> List[Finding]:
    model = run.cfg.get("model")
    if not isinstance(model, dict):
        return []
    changes: List[Any] = []
    # patch-config's own walk, on a copy: the same notion of "the head's transformer" as the fix it writes.
    dropout_walk(copy.deepcopy(model), "model", changes, [])
    if not changes:
        return []
    return [Finding(
        "transformer-dropout", "info", changes[0].path, changes[0].old,
        f"{len(changes)} drop probabilities > 0 (max {max(c.old for c in changes):g}) in the detection head's "
        "transformer; the known manual fix (transformer dropout 0, max_norm 1) sets them to 0 after a divergence "
        "(README), as NanGuardHook does in the live run",
        "leave them for NanGuardHook to zero on a divergence, or write them as 0: petr-stability patch-config")]


def _check_hooks(run: _Run) -> List[Finding]:
    hooks = run.cfg.get("custom_hooks")
    out = []
    for i, hook in enumerate(hooks if isinstance(hooks, (list, tuple)) else []):
        if isinstance(hook, dict) and type_name(hook).rsplit(".", 1)[-1] == "CheckInvalidLossHook":
            out.append(Finding(
                "check-invalid-loss-hook", "warning", f"custom_hooks[{i}].type", type_name(hook),
                "it asserts torch.isfinite(loss) with logger.info(...) as the message, so the run dies with "
                "'AssertionError: None' (mmdet checkloss_hook.py), and PETR heads nan_to_num their losses "
                "(petr_head.py), so it misses NaN there",
                "remove it: NanGuardHook watches loss, gradients and weights and recovers instead of stopping"))
    return out


def _checkpoint_cfg(run: _Run) -> Optional[Tuple[str, Any, bool]]:
    """(key, checkpoint hook config, by_epoch default), or None where the config leaves the default."""
    cfg = run.cfg
    if run.family == "mmengine":
        hooks = cfg.get("default_hooks")
        if not isinstance(hooks, dict) or "checkpoint" not in hooks:
            return None  # the runner's own CheckpointHook(interval=1)
        return "default_hooks.checkpoint", hooks["checkpoint"], True
    if run.family == "mmcv1" and "checkpoint_config" in cfg:
        # MMCV 1.x IterBasedRunner.register_training_hooks sets by_epoch=False unless the config says otherwise.
        runner = cfg.get("runner")
        iter_based = isinstance(runner, dict) and "IterBased" in type_name(runner)
        return "checkpoint_config", cfg["checkpoint_config"], not iter_based
    return None


def _check_checkpoints(run: _Run) -> List[Finding]:
    found = _checkpoint_cfg(run)
    if found is None:
        return []
    key, ckpt, by_epoch_default = found
    source = "a restart, and NanGuardHook's last resort, start from the newest checkpoint (docs/how-it-works.md)"
    fix = f"{key}=dict(interval=1) per epoch (by_epoch=False: interval = one epoch's iterations or fewer)"
    if ckpt is None:
        return [Finding("rare-checkpoints", "warning", key, None, f"no checkpoints at all; {source}", fix)]
    if not isinstance(ckpt, dict):
        return []
    out = []
    interval = ckpt.get("interval", -1)
    by_epoch = ckpt.get("by_epoch", by_epoch_default)
    rare = None
    if isinstance(interval, int) and not isinstance(interval, bool):
        if interval <= 0:
            rare = f"interval={interval} saves only at the end of training"
        elif by_epoch and interval > 1:
            rare = f"one checkpoint every {interval} epochs: a restart loses up to {interval} epochs"
        elif not by_epoch:
            per_epoch = positive_int(run.cfg.get("num_iters_per_epoch"))
            if per_epoch is not None and interval > per_epoch:
                rare = (f"one checkpoint every {interval} iterations, more than an epoch "
                        f"(num_iters_per_epoch={per_epoch})")
    if rare is not None:
        out.append(Finding("rare-checkpoints", "warning", f"{key}.interval", interval, f"{rare}; {source}", fix))
    keep = ckpt.get("max_keep_ckpts", -1)
    if keep == 1 and not isinstance(keep, bool):
        out.append(Finding(
            "single-checkpoint-kept", "warning", f"{key}.max_keep_ckpts", keep,
            "the one file kept can be a save made after the weights went bad, with no healthy one left to restart "
            "from (docs/how-it-works.md: a poisoned save is noticed only as it happens)",
            f"{key}.max_keep_ckpts=3 (or more)"))
    return out


def _check_carried(run: _Run) -> List[Finding]:
    """A patched config's NanGuardHook entry: what it carries (``carry=``, per remedy), the samples it keeps out
    (``quarantine=``) and the modules it runs in fp32, each re-applied before the first iteration."""
    hooks = run.cfg.get("custom_hooks")
    out = []
    for i, hook in enumerate(hooks if isinstance(hooks, (list, tuple)) else []):
        if not (isinstance(hook, dict) and type_name(hook).rsplit(".", 1)[-1] == "NanGuardHook"):
            continue
        for remedy, state in sorted(dict(hook.get("carry") or {}).items()):
            listed = ", ".join(f"{k}={_brief(v)}" for k, v in dict(state).items())
            out.append(Finding("carried", "info", f"custom_hooks[{i}].carry.{remedy}", state,
                               f"re-applied by the {remedy!r} remedy before the first iteration, each value logged "
                               f"({listed})", "nothing to do: this is the earlier run's state, carried on purpose"))
        for key in ("quarantine", "fp32_modules"):
            if hook.get(key):
                out.append(Finding("carried", "info", f"custom_hooks[{i}].{key}", hook[key],
                                   f"{len(hook[key])} entr{'y' if len(hook[key]) == 1 else 'ies'} applied before the "
                                   "first iteration (samples resolved through this run's own dataset wrappers)"
                                   if key == "quarantine" else "modules run in fp32 from the first iteration",
                                   "nothing to do: this is the earlier run's state, carried on purpose"))
    return out


def _brief(value: Any) -> str:
    if isinstance(value, (list, tuple)) and len(value) > 3:
        return f"[{', '.join(map(str, value[:3]))}, ... ({len(value)} in all)]"
    return repr(value)


_CHECK_ORDER: Tuple[Callable[[_Run], List[Finding]], ...] = (
    _check_lr, _check_static_scale, _check_flash, _check_bn, _check_clip, _check_dropout, _check_hooks,
    _check_checkpoints, _check_carried,
)


def _validate(name: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def check_config(cfg: Dict[str, Any], world_size: Optional[int] = None, batch_per_gpu: Optional[int] = None,
                 family: Optional[str] = None, origins: Optional[Provenance] = None) -> List[Finding]:
    """Runs every pre-flight check on a merged config; reads it, never changes it.

    Args:
        cfg: the merged config as plain dicts (see :func:`~petr_stability.configfix.load.load_config`).
        world_size: the number of GPUs (processes) of the run. Defaults to None: unknown, and the checks that
            need it (the learning rate's batch) stay quiet.
        batch_per_gpu: the per-GPU batch. Defaults to None: read from the family's own key
            (``train_dataloader.batch_size`` for MMEngine, ``data.samples_per_gpu`` for MMCV 1.x), else a top-level
            ``batch_size``.
        family: ``'mmengine'`` or ``'mmcv1'``, where the caller knows the runner. Defaults to None (read from the
            config, :func:`~petr_stability.configfix.keys.config_family`).
        origins: the config's ``_base_`` tree (:func:`~petr_stability.configfix.origin.provenance`), so that a
            batch declared for another lr is not compared with this one. Defaults to None (every declaration counts).

    Returns:
        The findings, in the order of :data:`CHECKS`' groups (learning rate, fp16, norms, clipping, dropout,
        hooks, checkpoints); empty when no known hazard is found.
    """
    if not isinstance(cfg, dict):
        raise TypeError(f"cfg must be a dict (a merged config), got {type(cfg).__name__}")
    world_size = _validate("world_size", world_size)
    batch_per_gpu = _validate("batch_per_gpu", batch_per_gpu)
    if family not in (None,) + FAMILIES:
        raise ValueError(f"family must be one of {list(FAMILIES)} or None, got {family!r}")
    family = family or config_family(cfg)
    if batch_per_gpu is not None:
        batch, batch_key = batch_per_gpu, "--batch-per-gpu"
    else:
        found = batch_setting(cfg, family)
        batch, batch_key = (found[1], found[0]) if found else (None, "")
    run = _Run(cfg, family, world_size, batch, batch_key, fp16_loss_scales(cfg, family), origins)
    findings: List[Finding] = []
    for check in _CHECK_ORDER:
        findings.extend(check(run))
    return findings


def check_file(path: str, world_size: Optional[int] = None, batch_per_gpu: Optional[int] = None,
               loader: Optional[str] = None) -> List[Finding]:
    """:func:`check_config` on a config file, with its ``_base_`` tree read for where each batch was declared.

    Args:
        path: the config file (``.py``).
        world_size: see :func:`check_config`.
        batch_per_gpu: see :func:`check_config`.
        loader: ``'mmengine'`` or ``'mmcv'``. Defaults to None (the default loader).

    Returns:
        The findings.

    Raises:
        FileNotFoundError, ValueError: as :func:`~petr_stability.configfix.load.load_config`.
    """
    world_size, batch_per_gpu = _validate("world_size", world_size), _validate("batch_per_gpu", batch_per_gpu)
    cfg = load_config(path, loader)
    return check_config(cfg, world_size, batch_per_gpu, origins=provenance(path, loader))


def _runner_origins(cfg_like: Any, cfg: Dict[str, Any], filename: Optional[str]) -> Optional[Provenance]:
    """The ``_base_`` tree of the file the run was started from, with the run's overrides above it."""
    filename = filename if filename is not None else getattr(cfg_like, "filename", None)
    if not isinstance(filename, str) or not filename.endswith(".py") or not os.path.isfile(filename):
        return None
    tree = provenance(filename)
    return tree.with_overrides(cfg) if tree is not None else None


def check_runner_config(cfg_like: Any, world_size: Optional[int], log: Optional[Callable[[str, str], None]] = None,
                        filename: Optional[str] = None, family: Optional[str] = None) -> List[Finding]:
    """The checks for a hook's ``before_run``: the run's effective config and its real world size; never raises.

    A pre-flight check must never fail a run: any error (an odd config, a bad argument) returns ``[]``. The
    caller should still wrap the call, and its own logging of the findings, in ``try/except Exception`` and log
    what it catches.

    Args:
        cfg_like: ``runner.cfg``: an mmengine or mmcv 1.x ``Config``, a dict, or config text (MMCV 1.x runners keep
            the effective config as ``runner.meta['config']``).
        world_size: the run's world size (``mmengine.dist.get_world_size()`` / ``mmcv.runner.get_dist_info()``).
        log: ``(message, level)`` callable; when given, a check that could not run is reported through it at
            level ``'info'``. Defaults to None (silent).
        filename: the config file the run was started from, for where each batch was declared. Defaults to None
            (``cfg_like.filename`` where it has one).
        family: the runner family, where the caller knows it. Defaults to None (read from the config).

    Returns:
        The findings, or ``[]`` when the check could not run.
    """
    try:
        cfg = read_config(cfg_like).config
        return check_config(cfg, world_size=world_size, family=family,
                            origins=_runner_origins(cfg_like, cfg, filename))
    except Exception as exc:  # noqa: BLE001 - advice only; the run goes on whatever happens here
        if log is not None:
            try:
                log(f"NanGuard: pre-flight check skipped: {type(exc).__name__}: {exc}", "info")
            except Exception:  # noqa: BLE001, S110 - a broken logger must not fail the run either
                pass
        return []


# ---------------------------------------------------------------------------------------------- output
def format_findings(findings: List[Finding]) -> str:
    """The findings as text, one block per finding: severity, id, ``key=value``, why and fix."""
    if not findings:
        return "pre-flight check: no known fp16 hazard found"
    warnings = sum(f.severity == "warning" for f in findings)
    lines = [f"pre-flight check: {warnings} warning(s), {len(findings) - warnings} info"]
    for f in findings:
        lines.append(f"{f.severity.upper()} - {f.check}: {f.key}={f.value!r}")
        lines.append(f"    why: {f.why}")
        lines.append(f"    fix: {f.fix}")
    return "\n".join(lines)


def log_findings(findings: List[Finding], log: Callable[[str, str], None]) -> None:
    """Writes one log line per finding through ``log(message, level)``, level being the finding's severity.

    Args:
        findings: from :func:`check_config` or :func:`check_runner_config`.
        log: e.g. the runner adapter's ``log(msg, level)`` (``'warning'`` / ``'info'``).
    """
    for f in findings:
        log(f"NanGuard: pre-flight [{f.check}] {f.key}={f.value!r}: {f.why}. Fix: {f.fix}", f.severity)
