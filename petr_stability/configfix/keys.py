"""Where a merged config keeps each setting, per runner family: one place that tells MMEngine from MMCV 1.x."""
from typing import Any, Dict, List, Mapping, Optional, Tuple

__all__ = [
    "FAMILIES",
    "MMCV1_DEFAULT_LOSS_SCALE",
    "config_family",
    "get_path",
    "type_name",
    "optim_wrappers",
    "batch_setting",
    "fp16_loss_scales",
    "is_number",
    "positive_int",
    "plain",
]

#: The runner families, as every result of this package names them.
FAMILIES = ("mmengine", "mmcv1")
#: ``Fp16OptimizerHook(loss_scale=512.)``: MMCV 1.x's default, a static scale.
MMCV1_DEFAULT_LOSS_SCALE = 512.0
#: The per-GPU batch key each family's runner reads (MMEngine's Runner builds ``train_dataloader``; mmdet / mmdet3d
#: 0.x ``train_detector`` builds its loaders from ``data.samples_per_gpu``).
_BATCH_KEYS = {"mmengine": "train_dataloader.batch_size", "mmcv1": "data.samples_per_gpu"}


def plain(value: Any) -> Any:
    """Plain dicts, lists and tuples all the way down (``ConfigDict`` and other mappings become dicts)."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return value


def is_number(value: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_int(value: Any) -> Optional[int]:
    """``value`` when it is an int >= 1 (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def get_path(cfg: Any, dotted: str) -> Any:
    """The value at a dotted key of nested dicts (``'optim_wrapper.optimizer.lr'``); None where absent."""
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def type_name(node: Mapping[str, Any]) -> str:
    """A config dict's ``type`` as a name (a class given as the type gives its ``__name__``)."""
    kind = node.get("type")
    return kind if isinstance(kind, str) else getattr(kind, "__name__", "")


def config_family(cfg: Mapping[str, Any]) -> Optional[str]:
    """The runner family a merged config trains under: ``'mmengine'``, ``'mmcv1'`` or None (neither shows).

    ``optimizer_config`` decides first: only MMCV 1.x runners read it and no MMEngine-era ``_base_`` file writes it,
    while an MMCV 1.x project config (StreamPETR, PETR) whose ``_base_`` paths reach an mmdet3d 1.x checkout
    inherits MMEngine keys (``train_dataloader``, ``default_hooks``, even ``optim_wrapper``) it never trains with.
    Then ``optim_wrapper`` (MMEngine), then ``optimizer`` / ``lr_config`` / ``runner`` / ``data`` (MMCV 1.x), then
    ``train_dataloader`` / ``param_scheduler`` / ``train_cfg`` (MMEngine).
    """
    if "optimizer_config" in cfg:
        return "mmcv1"
    if isinstance(cfg.get("optim_wrapper"), dict):
        return "mmengine"
    if any(k in cfg for k in ("optimizer", "lr_config", "runner")) or isinstance(cfg.get("data"), dict):
        return "mmcv1"
    if any(k in cfg for k in ("train_dataloader", "param_scheduler", "train_cfg")):
        return "mmengine"
    return None


def optim_wrappers(cfg: Mapping[str, Any]) -> List[Tuple[str, Dict[str, Any]]]:
    """MMEngine optimizer wrappers with their dotted paths (each member of an ``OptimWrapperDict``-style config)."""
    ow = cfg.get("optim_wrapper")
    if not isinstance(ow, dict):
        return []
    nested = [(f"optim_wrapper.{k}", v) for k, v in ow.items() if isinstance(v, dict) and "optimizer" in v]
    return nested if nested and "optimizer" not in ow else [("optim_wrapper", ow)]


def batch_setting(cfg: Mapping[str, Any], family: Optional[str]) -> Optional[Tuple[str, int]]:
    """The per-GPU batch the config trains with and the key it was read from: the family's own key, else a
    top-level ``batch_size`` (StreamPETR declares one); None where neither holds an int >= 1."""
    keys = [_BATCH_KEYS[family]] if family in _BATCH_KEYS else list(_BATCH_KEYS.values())
    for key in keys + ["batch_size"]:
        value = positive_int(get_path(cfg, key))
        if value is not None:
            return key, value
    return None


def _is_fp16_dtype(dtype: Any) -> bool:
    name = str(dtype)
    return "bfloat16" not in name and ("float16" in name or name == "half")


def fp16_loss_scales(cfg: Mapping[str, Any], family: Optional[str]) -> List[Tuple[str, Any, bool]]:
    """(dotted key, loss scale, is the default) for each fp16 optimizer of the run; empty for fp32 (or bf16).

    The key is where a config sets that optimizer's scale: MMEngine ``AmpOptimWrapper.loss_scale`` (default
    ``'dynamic'``); MMCV 1.x ``fp16.loss_scale`` or ``optimizer_config.loss_scale`` (mmdet's ``train_detector``
    builds ``Fp16OptimizerHook(**optimizer_config, **fp16)`` when ``fp16`` is set; default a static 512).
    """
    out: List[Tuple[str, Any, bool]] = []
    if family == "mmengine":
        for path, wrapper in optim_wrappers(cfg):
            dtype = wrapper.get("dtype")
            if "AmpOptimWrapper" in type_name(wrapper) and (dtype is None or _is_fp16_dtype(dtype)):
                out.append((f"{path}.loss_scale", wrapper.get("loss_scale", "dynamic"), "loss_scale" not in wrapper))
    elif family == "mmcv1":
        oc = cfg.get("optimizer_config")
        oc = oc if isinstance(oc, dict) else {}
        fp16 = cfg.get("fp16")
        if isinstance(fp16, dict):
            if "loss_scale" in fp16:
                out.append(("fp16.loss_scale", fp16["loss_scale"], False))
            elif "loss_scale" in oc:
                out.append(("optimizer_config.loss_scale", oc["loss_scale"], False))
            else:
                out.append(("fp16.loss_scale", MMCV1_DEFAULT_LOSS_SCALE, True))
        elif "Fp16OptimizerHook" in type_name(oc):
            out.append(("optimizer_config.loss_scale", oc.get("loss_scale", MMCV1_DEFAULT_LOSS_SCALE),
                        "loss_scale" not in oc))
    return out
