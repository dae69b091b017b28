"""What a config must change (:class:`ConfigFix`: the settings the live guard runs with), and applying it to a merged
config dict: each setting where the config's runner family keeps it."""
import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

from .keys import config_family, fp16_loss_scales, is_number, optim_wrappers, plain

__all__ = [
    "KNOWN_MANUAL_FIX",
    "ConfigFix",
    "DROPOUT_KEYS",
    "FLASH_EQUIVALENTS",
    "GUARD_HOOK",
    "ConfigChange",
    "apply_fix",
    "dropout_walk",
    "strip_fault_injection",
]

#: How every message names the known manual fix; :meth:`ConfigFix.describe` fills in the real bound.
KNOWN_MANUAL_FIX = "the known manual fix (transformer dropout 0, max_norm {max_norm})"


def _num(value: float) -> str:
    return f"{value:g}"


@dataclass
class ConfigFix:
    """What a config must change to reproduce the settings the live guard runs with.

    Attributes:
        max_norm: the clip bound the guard lowered to (None: clipping unchanged).
        zero_dropout: the guard zeroed the head transformer's dropout.
        fp32_modules: module name -> its class name, modules the guard runs in fp32.
        lr_factor: product of the guard's learning-rate backoffs (1.0: none).
        dynamic_loss_scale: the guard turned a static loss scale dynamic.
        quarantine: the samples the guard quarantined (or refused): each by what it is (an identity dict: the leaf
            ``dataset``, ``inner_index``, ``part``, ids ``token`` / ``sample_idx`` / ``scene_token``), or, where
            nothing more is known of it, by dataset index (an int).
        carry: remedy name -> what it put in force that no config key holds, carried in the ``NanGuardHook`` entry
            (``carry={...}``) and re-applied by that remedy before the next run's first iteration.
        fallback: a field of this fix -> {remedy name: what to carry} where the config has no key for that field
            (``lr_factor`` without an optimizer ``lr``, ``dynamic_loss_scale`` without a static loss scale): carried
            then, instead of lost.
    """

    max_norm: Optional[float] = None
    zero_dropout: bool = False
    fp32_modules: Dict[str, str] = field(default_factory=dict)
    lr_factor: float = 1.0
    dynamic_loss_scale: bool = False
    quarantine: List[Any] = field(default_factory=list)
    carry: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    fallback: Dict[str, Dict[str, Dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_norm is not None and (isinstance(self.max_norm, bool) or
                                          not isinstance(self.max_norm, (int, float)) or
                                          not 0 < self.max_norm < math.inf):
            raise ValueError(f"max_norm must be a finite number > 0 or None, got {self.max_norm!r}")
        if isinstance(self.lr_factor, bool) or not isinstance(self.lr_factor, (int, float)) or \
                not 0 < self.lr_factor < math.inf:
            raise ValueError(f"lr_factor must be a finite number > 0, got {self.lr_factor!r}")
        if not isinstance(self.fp32_modules, dict) or not all(
                isinstance(k, str) and k and isinstance(v, str) for k, v in self.fp32_modules.items()):
            raise ValueError(f"fp32_modules must map module names to class names, got {self.fp32_modules!r}")
        if not isinstance(self.quarantine, (list, tuple, set, frozenset)) or not all(
                (isinstance(i, int) and not isinstance(i, bool) and i >= 0) or isinstance(i, dict)
                for i in self.quarantine):
            raise ValueError(f"quarantine must be a list of dataset indices (ints >= 0) or sample identities (dicts), "
                             f"got {self.quarantine!r}")
        self.quarantine = _merged([], list(self.quarantine))
        if not isinstance(self.carry, dict) or not all(isinstance(k, str) and k and isinstance(v, dict)
                                                       for k, v in self.carry.items()):
            raise ValueError(f"carry must map remedy names to dicts, got {self.carry!r}")
        self.zero_dropout, self.dynamic_loss_scale = bool(self.zero_dropout), bool(self.dynamic_loss_scale)

    @classmethod
    def known_manual_fix(cls, max_norm: float = 1.0) -> "ConfigFix":
        """The known manual fix: every transformer dropout 0 and ``max_norm = min(current, max_norm)``.

        Args:
            max_norm: the clip bound. Defaults to 1.0.
        """
        return cls(max_norm=max_norm, zero_dropout=True)

    @property
    def is_empty(self) -> bool:
        """True when the fix changes no setting."""
        return (self.max_norm is None and not self.zero_dropout and not self.fp32_modules and self.lr_factor == 1.0
                and not self.dynamic_loss_scale and not self.quarantine and not self.carry)

    def describe(self) -> str:
        """Exactly what the fix holds, e.g. ``'the known manual fix (transformer dropout 0, max_norm 1); lr x 0.5'``;
        ``'no setting changed'`` when empty."""
        parts: List[str] = []
        if self.zero_dropout and self.max_norm is not None:
            parts.append(KNOWN_MANUAL_FIX.format(max_norm=_num(self.max_norm)))
        elif self.max_norm is not None:
            parts.append(f"max_norm {_num(self.max_norm)}")
        elif self.zero_dropout:
            parts.append("transformer dropout 0")
        parts += [f"fp32: {name} ({cls})" for name, cls in self.fp32_modules.items()]
        if self.lr_factor != 1.0:
            parts.append(f"lr x {_num(self.lr_factor)}")
        if self.dynamic_loss_scale:
            parts.append("dynamic loss scale")
        if self.quarantine:
            parts.append(f"{len(self.quarantine)} sample(s) quarantined")
        if self.carry:
            parts.append(f"carried for {', '.join(sorted(self.carry))}")
        return "; ".join(parts) or "no setting changed"


#: Config keys that hold a drop probability, in every spelling the PETR family uses (megvii PETR / StreamPETR
#: ``dropout`` and ``ffn_dropout``; MMCV 2 / mmdet3d 1.x ``attn_drop``, ``proj_drop``, ``ffn_drop``,
#: ``dropout_layer=dict(drop_prob=...)``; timm-style ``*_rate``).
DROPOUT_KEYS = (
    "dropout", "attn_drop", "proj_drop", "ffn_dropout", "ffn_drop", "drop_prob", "dropout_p", "attn_dropout",
    "drop_rate", "attn_drop_rate", "proj_drop_rate", "ffn_drop_rate", "drop_path_rate",
)
#: Flash attention classes and their non-flash equivalent taking the same config keys: StreamPETR's
#: ``PETRMultiheadAttention`` takes ``PETRMultiheadFlashAttention``'s ``embed_dims``, ``num_heads``, ``attn_drop``,
#: ``proj_drop``, ``dropout_layer``, ``batch_first`` and ``dropout`` (``models/utils/petr_transformer.py``; its
#: ``test_speed`` config is the flash config with this one swap, as exiawsh/StreamPETR#42 advises).
FLASH_EQUIVALENTS = {"PETRMultiheadFlashAttention": "PETRMultiheadAttention"}
#: The hook whose ``custom_hooks`` entry carries ``fp32_modules=[...]`` and ``quarantine=[...]``.
GUARD_HOOK = "NanGuardHook"
_FAULT_HOOK = "FaultInjectionHook"
#: Keys (under a head) that open the transformer's part of the config.
_TRANSFORMER_KEYS = ("transformer", "transformerlayers", "attn_cfgs", "ffn_cfgs", "decoder", "encoder")
_TRANSFORMER_TYPES = ("Transformer", "Attention", "MHA", "Decoder", "Encoder")
#: Absolute learning rates in a schedule (ratios such as ``eta_min_ratio``, ``min_lr_ratio``, ``start_factor``
#: follow the scaled lr by themselves): MMEngine ``eta_min`` / ``OneCycleLR(eta_max)``, MMCV 1.x ``min_lr`` /
#: ``OneCycleLrUpdaterHook(max_lr)`` -- the floors and peaks the guard scales in the live schedulers.
_MMENGINE_LR_FLOORS = ("eta_min", "eta_max")
_MMCV1_LR_FLOORS = ("min_lr", "max_lr")


@dataclass
class ConfigChange:
    """One value the patch changed: its dotted path, old and new value (old None: the key was added)."""

    path: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.path}: {self.old!r} -> {self.new!r}"


def _short(kind: Any) -> str:
    name = kind if isinstance(kind, str) else getattr(kind, "__name__", "")
    return name.rsplit(".", 1)[-1]


def strip_fault_injection(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """A copy of ``cfg`` without ``FaultInjectionHook`` in ``custom_hooks`` (the next run must not replay a drill).

    Args:
        cfg: a merged config; left unchanged.

    Returns:
        The copy (plain dicts and lists).
    """
    out = copy.deepcopy(plain(cfg))
    hooks = out.get("custom_hooks")
    if isinstance(hooks, (list, tuple)):
        out["custom_hooks"] = [h for h in hooks if not (isinstance(h, Mapping) and _short(h.get("type")) ==
                                                        _FAULT_HOOK)]
    return out


# ---------------------------------------------------------------------------------------------- dropout
def _is_prob(value: Any) -> bool:
    return is_number(value) and value > 0


def dropout_walk(node: Any, path: str, changes: List[ConfigChange], found: List[str], in_head: bool = False,
                 in_tr: bool = False) -> None:
    """Zeroes every drop probability inside a detection head's transformer below ``node``, in place.

    Backbones and necks are skipped (a backbone's ``drop_path_rate`` is a regularizer, not the fault the fix is
    for). The pre-flight check runs this on a copy to count them.

    Args:
        node: a config node (``cfg['model']`` at the top).
        path: its dotted path (``'model'``).
        changes: receives one :class:`ConfigChange` per value zeroed.
        found: receives the path of each transformer part entered (empty: the config does not show one).
        in_head: ``node`` is inside a ``*head``. Defaults to False.
        in_tr: ``node`` is inside the head's transformer. Defaults to False.
    """
    if isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            dropout_walk(item, f"{path}[{i}]", changes, found, in_head, in_tr)
        return
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    if in_head and not in_tr and isinstance(kind, str) and any(t in kind for t in _TRANSFORMER_TYPES):
        in_tr = True
        found.append(path)
    for key, value in node.items():
        sub = f"{path}.{key}" if path else str(key)
        if in_tr and key in DROPOUT_KEYS and _is_prob(value):
            node[key] = 0.0 if isinstance(value, float) else 0
            changes.append(ConfigChange(sub, value, node[key]))
            continue
        if not isinstance(value, (dict, list, tuple)) or not isinstance(key, str):
            continue
        lowered = key.lower()
        if "backbone" in lowered or "neck" in lowered:
            continue
        head = in_head or lowered.endswith("head")
        tr = in_tr or (head and not lowered.endswith("head") and
                       ("transformer" in lowered or lowered in _TRANSFORMER_KEYS))
        if tr and not in_tr:
            found.append(sub)
        dropout_walk(value, sub, changes, found, head, tr)


def _apply_dropout(cfg: Dict[str, Any], changes: List[ConfigChange], notes: List[str]) -> bool:
    if not isinstance(cfg.get("model"), dict):
        raise ValueError("the config has no model dict; is this an MMEngine or MMCV 1.x training config?")
    found: List[str] = []
    dropout_walk(cfg["model"], "model", changes, found)
    if not found:
        notes.append("no transformer found in the detection head (model.*head); no dropout changed")
    return bool(found)


# ---------------------------------------------------------------------------------------------- clip
def _tighten(clip: Any, path: str, max_norm: float, changes: List[ConfigChange], notes: List[str]) -> Any:
    new_value = int(max_norm) if float(max_norm).is_integer() else max_norm
    if clip is None:
        clip = dict(max_norm=new_value, norm_type=2)
        changes.append(ConfigChange(path, None, copy.deepcopy(clip)))
        return clip
    if not isinstance(clip, dict):
        raise ValueError(f"{path} must be a dict or None, got {clip!r}")
    if "max_norm" not in clip:
        notes.append(f"{path} clips by value ({clip}); a max_norm does not apply there, left unchanged")
        return clip
    current = clip["max_norm"]
    if not is_number(current):
        raise ValueError(f"{path}.max_norm must be a number, got {current!r}")
    if current > max_norm:
        clip["max_norm"] = new_value
        changes.append(ConfigChange(f"{path}.max_norm", current, new_value))
    else:
        notes.append(f"{path}.max_norm is already {current:g} <= {max_norm:g}, left unchanged")
    return clip


def _apply_clip(cfg: Dict[str, Any], family: Optional[str], max_norm: float, changes: List[ConfigChange],
                notes: List[str]) -> None:
    wrappers = optim_wrappers(cfg)
    if family == "mmengine" and wrappers:
        for path, wrapper in wrappers:
            wrapper["clip_grad"] = _tighten(wrapper.get("clip_grad"), f"{path}.clip_grad", max_norm, changes, notes)
        return
    if family != "mmcv1":
        raise ValueError("the config has neither optim_wrapper (MMEngine) nor optimizer / optimizer_config "
                         "(MMCV 1.x); nothing to clip")
    oc = cfg.get("optimizer_config")
    if oc is None:
        oc = cfg["optimizer_config"] = {}
        changes.append(ConfigChange("optimizer_config", None, {}))
    if not isinstance(oc, dict):
        raise ValueError(f"optimizer_config must be a dict, got {oc!r}")
    oc["grad_clip"] = _tighten(oc.get("grad_clip"), "optimizer_config.grad_clip", max_norm, changes, notes)


# ---------------------------------------------------------------------------------------------- guard hook arguments
def _guard_hooks(cfg: Dict[str, Any]) -> List[Tuple[str, Dict[str, Any]]]:
    hooks = cfg.get("custom_hooks")
    return [(f"custom_hooks[{i}]", h) for i, h in enumerate(hooks if isinstance(hooks, (list, tuple)) else [])
            if isinstance(h, dict) and _short(h.get("type")) == GUARD_HOOK]


def _set_hook_list(cfg: Dict[str, Any], key: str, values: List[Any], changes: List[ConfigChange],
                   notes: List[str]) -> None:
    """``NanGuardHook(<key>=[...])`` in ``custom_hooks``: the values joined to the entry's own (:func:`_merged`)."""
    _set_hook_value(cfg, key, values, lambda old: _merged(list(old or []), values), changes, notes)


def _merged(old: List[Any], new: List[Any]) -> List[Any]:
    """``old`` and ``new`` as one list without repeats: the ints (dataset indices, names) sorted first, then the dicts
    (sample identities) in the order they came."""
    plain = sorted({v for v in old + new if not isinstance(v, dict)})
    dicts: List[Any] = []
    for v in old + new:
        if isinstance(v, dict) and v not in dicts:
            dicts.append(v)
    return plain + dicts


def _set_hook_carry(cfg: Dict[str, Any], carry: Mapping[str, Dict[str, Any]], changes: List[ConfigChange],
                    notes: List[str]) -> None:
    """``NanGuardHook(carry={remedy: state})``: each remedy's entry replaces the one the config had for it."""
    _set_hook_value(cfg, "carry", dict(carry), lambda old: dict(old or {}, **copy.deepcopy(dict(carry))), changes,
                    notes)


def _set_hook_value(cfg: Dict[str, Any], key: str, value: Any, combine: Callable[[Any], Any],
                    changes: List[ConfigChange], notes: List[str]) -> None:
    """``NanGuardHook(<key>=combine(its value))`` on every guard entry of ``custom_hooks``, a change where it differs;
    a note where the config has no such entry."""
    hooks = _guard_hooks(cfg)
    if not hooks:
        notes.append(f"custom_hooks has no {GUARD_HOOK} entry (the hook was added in code?): {key}={value!r} not "
                     "written; pass it to the hook yourself")
        return
    for path, hook in hooks:
        old = hook.get(key)
        new = combine(old)
        if old is None or (list(old) if isinstance(old, tuple) else old) != new:
            hook[key] = new
            changes.append(ConfigChange(f"{path}.{key}", copy.deepcopy(old), copy.deepcopy(new)))


# ---------------------------------------------------------------------------------------------- fp32 modules
def _attention_configs(node: Any, path: str, cls: str) -> Iterator[Tuple[str, Dict[str, Any]]]:
    if isinstance(node, dict):
        if _short(node.get("type")) == cls:
            yield path, node
        for key, value in node.items():
            yield from _attention_configs(value, f"{path}.{key}", cls)
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from _attention_configs(item, f"{path}[{i}]", cls)


def _flash_switch(cfg: Dict[str, Any], name: str, cls: str, changes: List[ConfigChange],
                  notes: List[str]) -> bool:
    """Switches the head's attention configs of flash class ``cls`` to the non-flash equivalent; False if none."""
    model = cfg.get("model")
    if cls not in FLASH_EQUIVALENTS or not isinstance(model, dict):
        return False
    top = name.split(".", 1)[0]
    heads = [top] if isinstance(model.get(top), dict) else [k for k in model if str(k).lower().endswith("head")]
    hits = [hit for head in heads for hit in _attention_configs(model[head], f"model.{head}", cls)]
    for path, node in hits:
        kind = node["type"]
        scope = kind.rsplit(".", 1)[0] + "." if isinstance(kind, str) and "." in kind else ""
        node["type"] = scope + FLASH_EQUIVALENTS[cls]
        changes.append(ConfigChange(f"{path}.type", kind, node["type"]))
    if hits:
        notes.append(f"{name} ({cls}) runs in fp32 in the live run; the config builds it as "
                     f"{FLASH_EQUIVALENTS[cls]} (no fp16 flash kernel), every attention built from "
                     f"{', '.join(p for p, _ in hits)} alike")
    return bool(hits)


def _apply_fp32(cfg: Dict[str, Any], modules: Mapping[str, str], changes: List[ConfigChange],
                notes: List[str]) -> None:
    rest = [name for name, cls in modules.items() if not _flash_switch(cfg, name, cls, changes, notes)]
    if rest:
        _set_hook_list(cfg, "fp32_modules", rest, changes, notes)


# ---------------------------------------------------------------------------------------------- learning rate
def _scale(node: Dict[str, Any], key: str, path: str, factor: float, changes: List[ConfigChange]) -> None:
    value = node.get(key)
    if is_number(value) and value > 0:
        node[key] = value * factor
        changes.append(ConfigChange(f"{path}.{key}", value, node[key]))


def _lr_schedulers(node: Any, path: str) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """MMEngine ``param_scheduler`` entries that schedule the lr (a list, one dict, or a dict of lists per
    optimizer); momentum schedulers are left out."""
    if isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from _lr_schedulers(item, f"{path}[{i}]")
    elif isinstance(node, dict) and "type" not in node:
        for key, value in node.items():
            yield from _lr_schedulers(value, f"{path}.{key}")
    elif isinstance(node, dict):
        kind = _short(node.get("type"))
        if node.get("param_name") == "lr" or (kind.endswith("LR") and "Momentum" not in kind):
            yield path, node


def _apply_lr(cfg: Dict[str, Any], family: Optional[str], factor: float, changes: List[ConfigChange],
              notes: List[str]) -> bool:
    before = len(changes)
    if family == "mmengine":
        for path, wrapper in optim_wrappers(cfg):
            if isinstance(wrapper.get("optimizer"), dict):
                _scale(wrapper["optimizer"], "lr", f"{path}.optimizer", factor, changes)
        for path, sched in _lr_schedulers(cfg.get("param_scheduler"), "param_scheduler"):
            for key in _MMENGINE_LR_FLOORS:
                _scale(sched, key, path, factor, changes)
    elif family == "mmcv1":
        if isinstance(cfg.get("optimizer"), dict):
            _scale(cfg["optimizer"], "lr", "optimizer", factor, changes)
        if isinstance(cfg.get("lr_config"), dict):
            for key in _MMCV1_LR_FLOORS:
                _scale(cfg["lr_config"], key, "lr_config", factor, changes)
    if len(changes) == before:
        notes.append(f"no learning rate found in the config (optim_wrapper.optimizer.lr / optimizer.lr): lr x "
                     f"{factor:g} not written")
    return len(changes) > before


# ---------------------------------------------------------------------------------------------- loss scale
def _apply_loss_scale(cfg: Dict[str, Any], family: Optional[str], changes: List[ConfigChange],
                      notes: List[str]) -> bool:
    static = [(key, scale, default) for key, scale, default in fp16_loss_scales(cfg, family) if is_number(scale)]
    if not static:
        notes.append("no static fp16 loss scale in the config (dynamic already, or not fp16): loss scale unchanged")
        return False
    for key, scale, default in static:
        parent, _, leaf = key.rpartition(".")
        node = cfg
        for part in parent.split("."):
            node = node[part]
        node[leaf] = "dynamic"
        changes.append(ConfigChange(key, None if default else scale, "dynamic"))
    return True


def apply_fix(cfg: Dict[str, Any], fix: ConfigFix) -> Tuple[List[ConfigChange], List[str], str]:
    """Applies exactly ``fix`` to a merged config, in place, where the config's runner family keeps each setting.

    ``max_norm`` -> ``min(current, max_norm)`` in ``optim_wrapper.clip_grad`` (each wrapper) or
    ``optimizer_config.grad_clip`` (added where absent); ``zero_dropout`` -> every drop probability of the head's
    transformer 0; ``fp32_modules`` -> a flash attention's config switched to its non-flash equivalent
    (:data:`FLASH_EQUIVALENTS`), any other module into ``NanGuardHook(fp32_modules=[...])``; ``lr_factor`` -> the
    optimizer's ``lr`` and the schedule's absolute floors (``eta_min``, ``min_lr``; ratios stay) times it;
    ``dynamic_loss_scale`` -> ``loss_scale='dynamic'``; ``quarantine`` -> ``NanGuardHook(quarantine=[...])``;
    ``carry`` -> ``NanGuardHook(carry={...})`` (each remedy's entry replaced).

    Args:
        cfg: the merged config (plain dicts), changed in place.
        fix: what to change.

    Returns:
        (changes, notes, family): notes say what could not be written or was left as it was; family is
        ``'mmengine'``, ``'mmcv1'`` or ``''`` (neither shows).
    """
    if not isinstance(fix, ConfigFix):
        raise TypeError(f"fix must be a ConfigFix, got {type(fix).__name__}")
    family = config_family(cfg)
    changes: List[ConfigChange] = []
    notes: List[str] = []
    written: Dict[str, bool] = {}
    if fix.zero_dropout:
        written["zero_dropout"] = _apply_dropout(cfg, changes, notes)
    if fix.max_norm is not None:
        _apply_clip(cfg, family, fix.max_norm, changes, notes)
    if fix.fp32_modules:
        _apply_fp32(cfg, fix.fp32_modules, changes, notes)
    if fix.lr_factor != 1.0:
        written["lr_factor"] = _apply_lr(cfg, family, fix.lr_factor, changes, notes)
    if fix.dynamic_loss_scale:
        written["dynamic_loss_scale"] = _apply_loss_scale(cfg, family, changes, notes)
    if fix.quarantine:
        _set_hook_list(cfg, "quarantine", list(fix.quarantine), changes, notes)
    carry = dict(fix.carry)
    for name, done in written.items():  # a setting the config has no key for is carried instead of lost
        for remedy, value in (fix.fallback.get(name) or {}).items() if not done else ():
            carry[remedy] = dict(carry.get(remedy) or {}, **value)
            notes.append(f"{name}: no key in the config; the NanGuardHook entry carries it ({remedy})")
    if carry:
        _set_hook_carry(cfg, carry, changes, notes)
    return changes, notes, family or ""
