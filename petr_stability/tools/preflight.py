"""``petr-stability check``: the known config-level fp16 hazards of a PETR-family config, found before training.

Standard library only. Every check reads a plain config dict (MMCV 1.x or MMEngine, as
:func:`petr_stability.tools.patch_config.load_config` returns it) and returns :class:`Finding` records, so the
command line, the hook's ``before_run`` and the tests share one code path. A check fires only on what the config
says: where a fact it needs is unknown (the world size, the per-GPU batch, an epoch's length) it stays quiet.
"""
import copy
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .patch_config import _plain, _source_config, _zero_dropout, load_config

__all__ = [
    "CHECKS",
    "PETR_REFERENCE_GPUS",
    "Finding",
    "check_config",
    "check_runner_config",
    "format_findings",
    "log_findings",
    "main",
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
}
#: The GPU count the megvii PETR / StreamPETR configs were written for (their README trains on 8 GPUs); assumed for
#: an MMCV 1.x PETR-family config that declares neither ``num_gpus`` nor ``total_batch_size``.
PETR_REFERENCE_GPUS = 8

_BN_TYPES = frozenset(("BN", "BN1d", "BN2d", "BN3d", "BatchNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d"))
_MMCV1_DEFAULT_SCALE = 512.0  # Fp16OptimizerHook(loss_scale=512.) in MMCV 1.x
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
def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _pos_int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _get(cfg: Dict[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _dicts(node: Any, path: str) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """Every dict below ``node`` (lists and tuples followed) with its dotted path, depth first, in order."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _dicts(value, f"{path}.{key}")
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from _dicts(item, f"{path}[{i}]")


def _type_name(node: Dict[str, Any]) -> str:
    kind = node.get("type")
    return kind if isinstance(kind, str) else getattr(kind, "__name__", "")


def _family(cfg: Dict[str, Any]) -> Optional[str]:
    if isinstance(cfg.get("optim_wrapper"), dict):
        return "mmengine"
    if "optimizer" in cfg or "optimizer_config" in cfg:
        return "mmcv1"
    return None


def _wrappers(cfg: Dict[str, Any]) -> List[Tuple[str, Dict[str, Any]]]:
    """MMEngine optimizer wrappers with their paths (each member of an OptimWrapperDict-style config)."""
    ow = cfg["optim_wrapper"]
    nested = [(f"optim_wrapper.{k}", v) for k, v in ow.items() if isinstance(v, dict) and "optimizer" in v]
    return nested if nested and "optimizer" not in ow else [("optim_wrapper", ow)]


def _config_batch(cfg: Dict[str, Any]) -> Optional[Tuple[str, int]]:
    """The per-GPU batch the config trains with, and where it says so."""
    for key in ("train_dataloader.batch_size", "data.samples_per_gpu", "batch_size"):
        value = _pos_int(_get(cfg, key))
        if value is not None:
            return key, value
    return None


def _is_fp16_dtype(dtype: Any) -> bool:
    name = str(dtype)
    return "bfloat16" not in name and ("float16" in name or name == "half")


def _fp16_scales(cfg: Dict[str, Any], family: Optional[str]) -> List[Tuple[str, Any, bool]]:
    """(key, loss scale, is the default) for each fp16 optimizer of the run; empty for an fp32 (or bf16) run."""
    out: List[Tuple[str, Any, bool]] = []
    if family == "mmengine":
        for path, wrapper in _wrappers(cfg):
            if "AmpOptimWrapper" not in _type_name(wrapper):
                continue
            dtype = wrapper.get("dtype")
            if dtype is not None and not _is_fp16_dtype(dtype):
                continue
            out.append((f"{path}.loss_scale", wrapper.get("loss_scale", "dynamic"), "loss_scale" not in wrapper))
    elif family == "mmcv1":
        oc = cfg.get("optimizer_config")
        oc = oc if isinstance(oc, dict) else {}
        fp16 = cfg.get("fp16")
        # mmdet's train_detector builds Fp16OptimizerHook(**optimizer_config, **fp16) when `fp16` is set.
        if isinstance(fp16, dict):
            if "loss_scale" in fp16:
                out.append(("fp16.loss_scale", fp16["loss_scale"], False))
            elif "loss_scale" in oc:
                out.append(("optimizer_config.loss_scale", oc["loss_scale"], False))
            else:
                out.append(("fp16.loss_scale", _MMCV1_DEFAULT_SCALE, True))
        elif "Fp16OptimizerHook" in _type_name(oc):
            out.append(("optimizer_config.loss_scale", oc.get("loss_scale", _MMCV1_DEFAULT_SCALE),
                        "loss_scale" not in oc))
    return out


def _is_petr_family(cfg: Dict[str, Any]) -> bool:
    model = cfg.get("model")
    if not isinstance(model, dict):
        return False
    names = [_type_name(model)] + [_type_name(v) for v in model.values() if isinstance(v, dict)]
    return any("petr" in n.lower() for n in names)


@dataclass
class _Run:
    cfg: Dict[str, Any]
    family: Optional[str]
    world_size: Optional[int]
    batch: Optional[int]
    batch_key: str
    fp16: List[Tuple[str, Any, bool]]


# ---------------------------------------------------------------------------------------------- checks
def _lr_reference(run: _Run) -> Optional[Tuple[int, str]]:
    """The total batch the config's lr was written for, and how that is known."""
    cfg = run.cfg
    total = _pos_int(cfg.get("total_batch_size"))
    if total is not None:
        return total, f"total_batch_size={total}"
    gpus = _pos_int(cfg.get("num_gpus"))
    declared = _pos_int(cfg.get("batch_size"))
    per_gpu = ("batch_size", declared) if declared is not None else _config_batch(cfg)
    if gpus is not None and per_gpu is not None:
        return gpus * per_gpu[1], f"num_gpus={gpus} x {per_gpu[0]}={per_gpu[1]}"
    base = _pos_int(cfg.get("base_batch_size"))
    if base is not None:
        return base, f"base_batch_size={base}"
    if run.family == "mmcv1" and _is_petr_family(cfg) and per_gpu is not None:
        return (PETR_REFERENCE_GPUS * per_gpu[1],
                f"assumed: the {PETR_REFERENCE_GPUS} GPUs x {per_gpu[0]}={per_gpu[1]} the PETR/StreamPETR configs "
                "were written for; the config declares no num_gpus")
    return None


def _lr(run: _Run) -> Optional[Tuple[str, float]]:
    if run.family == "mmengine":
        path, wrapper = _wrappers(run.cfg)[0]
        key, lr = f"{path}.optimizer.lr", _get(wrapper, "optimizer.lr")
    else:
        key, lr = "optimizer.lr", _get(run.cfg, "optimizer.lr")
    return (key, lr) if _is_num(lr) and lr > 0 else None


def _check_lr(run: _Run) -> List[Finding]:
    if run.world_size is None or run.batch is None:
        return []
    actual = run.world_size * run.batch
    this_run = f"this run has {run.world_size} x {run.batch} = {actual}"
    asl = run.cfg.get("auto_scale_lr")
    if run.family == "mmengine" and isinstance(asl, dict) and _pos_int(asl.get("base_batch_size")):
        base = asl["base_batch_size"]
        enabled = asl.get("enable", False)
        if enabled or base == actual:
            return []
        smaller = actual < base
        return [Finding(
            "auto-scale-lr-off", "warning" if smaller else "info", "auto_scale_lr.enable", enabled,
            f"auto_scale_lr.base_batch_size={base} but {this_run} and MMEngine rescales the lr only with "
            + ("enable=True; too high an lr for the batch diverges (" + _LR_SOURCE + ")" if smaller else
               "enable=True; a bigger batch at the same lr is stable, only slower to converge"),
            f"auto_scale_lr = dict(enable=True, base_batch_size={base}) (tools/train.py --auto-scale-lr), "
            "or scale the lr by hand")]
    ref, lr = _lr_reference(run), _lr(run)
    if ref is None or lr is None or ref[0] == actual:
        return []
    total, how = ref
    (key, value), smaller = lr, actual < total
    suggested = value * actual / total
    return [Finding(
        "lr-not-scaled", "warning" if smaller else "info", key, value,
        f"the lr was written for a total batch of {total} ({how}) and {this_run}; "
        + ("too high an lr for the batch diverges in fp16 (" + _LR_SOURCE + ")" if smaller else
           "a bigger batch at the same lr is stable, only slower to converge (linear scaling rule)"),
        f"lr={suggested:.3g} (linear scaling: {value:g} x {actual}/{total}), or train on a total batch of {total}")]


def _check_static_scale(run: _Run) -> List[Finding]:
    out = []
    for key, scale, default in run.fp16:
        if not _is_num(scale):
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
    hits = [(p, _type_name(d)) for p, d in _dicts(run.cfg.get("model"), "model") if "flash" in _type_name(d).lower()]
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
            if _type_name(node) in _BN_TYPES and "norm" in path.rsplit(".", 1)[-1].lower():
                hits.append((f"{path}.type", _type_name(node)))
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
        keys = [f"{path}.clip_grad" for path, w in _wrappers(run.cfg) if w.get("clip_grad") is None]
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
    _zero_dropout(copy.deepcopy(model), "model", False, False, changes, [])
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
        if isinstance(hook, dict) and _type_name(hook).rsplit(".", 1)[-1] == "CheckInvalidLossHook":
            out.append(Finding(
                "check-invalid-loss-hook", "warning", f"custom_hooks[{i}].type", _type_name(hook),
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
        iter_based = isinstance(runner, dict) and "IterBased" in _type_name(runner)
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
            per_epoch = _pos_int(run.cfg.get("num_iters_per_epoch"))
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


_CHECK_ORDER: Tuple[Callable[[_Run], List[Finding]], ...] = (
    _check_lr, _check_static_scale, _check_flash, _check_bn, _check_clip, _check_dropout, _check_hooks,
    _check_checkpoints,
)


def _validate(name: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def check_config(cfg: Dict[str, Any], world_size: Optional[int] = None,
                 batch_per_gpu: Optional[int] = None) -> List[Finding]:
    """Runs every pre-flight check on a merged config; reads it, never changes it.

    Args:
        cfg: the merged config as plain dicts (see :func:`petr_stability.tools.patch_config.load_config`).
        world_size: the number of GPUs (processes) of the run. Defaults to None: unknown, and the checks that
            need it (the learning rate's batch) stay quiet.
        batch_per_gpu: the per-GPU batch. Defaults to None: read from ``train_dataloader.batch_size``
            (MMEngine), ``data.samples_per_gpu`` (MMCV 1.x) or a top-level ``batch_size``.

    Returns:
        The findings, in the order of :data:`CHECKS`' groups (learning rate, fp16, norms, clipping, dropout,
        hooks, checkpoints); empty when no known hazard is found.
    """
    if not isinstance(cfg, dict):
        raise TypeError(f"cfg must be a dict (a merged config), got {type(cfg).__name__}")
    world_size = _validate("world_size", world_size)
    batch_per_gpu = _validate("batch_per_gpu", batch_per_gpu)
    family = _family(cfg)
    if batch_per_gpu is not None:
        batch, batch_key = batch_per_gpu, "--batch-per-gpu"
    else:
        found = _config_batch(cfg)
        batch, batch_key = (found[1], found[0]) if found else (None, "")
    run = _Run(cfg, family, world_size, batch, batch_key, _fp16_scales(cfg, family))
    findings: List[Finding] = []
    for check in _CHECK_ORDER:
        findings.extend(check(run))
    return findings


def _as_dict(cfg_like: Any) -> Dict[str, Any]:
    if isinstance(cfg_like, dict):
        return _plain(cfg_like)
    if isinstance(cfg_like, str) and "\n" in cfg_like:
        # Config text: what mmdet / mmdet3d 0.x keep in runner.meta['config'] (the effective config, dumped).
        return _plain(_source_config(cfg_like, None)[0])
    to_dict = getattr(cfg_like, "to_dict", None)
    if callable(to_dict):
        return _plain(to_dict())
    inner = getattr(cfg_like, "_cfg_dict", None)
    if isinstance(inner, dict):
        return _plain(inner)
    raise TypeError(f"expected a config (dict, mmengine or mmcv Config), got {type(cfg_like).__name__}")


def check_runner_config(cfg_like: Any, world_size: Optional[int],
                        log: Optional[Callable[[str, str], None]] = None) -> List[Finding]:
    """The checks for a hook's ``before_run``: the run's effective config and its real world size; never raises.

    A pre-flight check must never fail a run: any error (an odd config, a bad argument) returns ``[]``. The
    caller should still wrap the call, and its own logging of the findings, in ``try/except Exception`` and log
    what it catches.

    Args:
        cfg_like: ``runner.cfg``: an mmengine ``Config`` (``to_dict()``), an mmcv 1.x ``Config`` (``_cfg_dict``),
            a dict, or config text (MMCV 1.x runners keep the effective config as ``runner.meta['config']``).
        world_size: the run's world size (``mmengine.dist.get_world_size()`` / ``mmcv.runner.get_dist_info()``).
        log: ``(message, level)`` callable; when given, a check that could not run is reported through it at
            level ``'info'``. Defaults to None (silent).

    Returns:
        The findings, or ``[]`` when the check could not run.
    """
    try:
        return check_config(_as_dict(cfg_like), world_size=world_size)
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


def main(args: Any) -> int:
    """Entry point of ``petr-stability check`` (``args`` from :mod:`petr_stability.cli`)."""
    try:
        cfg = load_config(args.config)
    except FileNotFoundError:
        raise
    except Exception as exc:  # a config is Python: any error while executing it is a bad input
        if isinstance(exc, (ValueError, TypeError)) and os.path.basename(args.config) in str(exc):
            raise
        raise ValueError(f"{args.config} could not be loaded: {type(exc).__name__}: {exc}") from exc
    findings = check_config(cfg, world_size=args.gpus, batch_per_gpu=args.batch_per_gpu)
    print(format_findings(findings))
    if args.strict and any(f.severity == "warning" for f in findings):
        return 1
    return 0
