"""``petr-stability patch-config``: writes the seed's fix (head transformer dropout 0, max_norm <= 1) into a config.

Standard library only. The config is executed as plain Python, the way MMEngine and MMCV 1.x read it, without
importing its ``custom_imports`` (only the names are data); ``_base_`` files are merged in, so the written file
is self-contained and loads from any directory.
"""
import ast
import copy
import keyword
import math
import os
import re
import types
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

__all__ = [
    "DROPOUT_KEYS",
    "ConfigChange",
    "load_config",
    "patch_config_dict",
    "format_config",
    "format_changes",
    "write_patched_config",
    "main",
]

#: Config keys that hold a drop probability, in every spelling the PETR family uses (megvii PETR / StreamPETR
#: ``dropout`` and ``ffn_dropout``; MMCV 2 / mmdet3d 1.x ``attn_drop``, ``proj_drop``, ``ffn_drop``,
#: ``dropout_layer=dict(drop_prob=...)``; timm-style ``*_rate``).
DROPOUT_KEYS = (
    "dropout", "attn_drop", "proj_drop", "ffn_dropout", "ffn_drop", "drop_prob", "dropout_p", "attn_dropout",
    "drop_rate", "attn_drop_rate", "proj_drop_rate", "ffn_drop_rate", "drop_path_rate",
)
#: Keys (under a head) that open the transformer's part of the config.
_TRANSFORMER_KEYS = ("transformer", "transformerlayers", "attn_cfgs", "ffn_cfgs", "decoder", "encoder")
_TRANSFORMER_TYPES = ("Transformer", "Attention", "MHA", "Decoder", "Encoder")
_BASE_VAR = re.compile(r"""(['"]?)\{\{\s*_base_\.([\w.]+)\s*\}\}\1""")


@dataclass
class ConfigChange:
    """One value the patch changed: its dotted path, old and new value."""

    path: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.path}: {self.old!r} -> {self.new!r}"


# ---------------------------------------------------------------------------------------------- loading
def _predefined(text: str, filename: str) -> str:
    name = os.path.basename(filename)
    values = {
        "fileDirname": os.path.dirname(os.path.abspath(filename)),
        "fileBasename": name,
        "fileBasenameNoExtension": os.path.splitext(name)[0],
        "fileExtname": os.path.splitext(name)[1],
    }
    for key, value in values.items():
        text = re.sub(r"\{\{\s*" + key + r"\s*\}\}", value.replace("\\", "/"), text)
    return text


def _base_files(text: str, filename: str) -> List[str]:
    try:
        tree = ast.parse(text, filename)
    except SyntaxError as exc:
        raise ValueError(f"{filename} is not valid Python: {exc}") from exc
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_base_" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError as exc:
                raise ValueError(f"{filename}: _base_ must be a string or a list of strings") from exc
            bases = [value] if isinstance(value, str) else list(value)
            if not all(isinstance(b, str) for b in bases):
                raise ValueError(f"{filename}: _base_ must be a string or a list of strings, got {value!r}")
            here = os.path.dirname(os.path.abspath(filename))
            return [b if os.path.isabs(b) else os.path.normpath(os.path.join(here, b)) for b in bases]
    return []


def _lookup(cfg: Dict[str, Any], dotted: str, filename: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ValueError(f"{filename}: {{{{_base_.{dotted}}}}} names nothing in its _base_ files")
        node = node[part]
    return node


def _merge(base: Dict[str, Any], child: Dict[str, Any]) -> Dict[str, Any]:
    """MMEngine/MMCV inheritance: dicts merge key by key unless ``_delete_=True``; anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in child.items():
        if isinstance(value, dict):
            value = dict(value)
            delete = bool(value.pop("_delete_", False))
            if not delete and isinstance(out.get(key), dict):
                out[key] = _merge(out[key], value)
                continue
            out[key] = _merge({}, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _is_data(name: str, value: Any) -> bool:
    if name.startswith("__") or name == "_base_":
        return False
    return not isinstance(value, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type))


def _execute(text: str, filename: str, seen: Tuple[str, ...]) -> Dict[str, Any]:
    text = _predefined(text, filename)
    base: Dict[str, Any] = {}
    for path in _base_files(text, filename):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{filename}: _base_ file {path} does not exist")
        if path in seen:
            raise ValueError(f"{filename}: _base_ inheritance loops back to {path}")
        loaded = load_config(path, _seen=seen + (path,))
        dup = sorted(set(base) & set(loaded))
        if dup:
            raise ValueError(f"{filename}: key {dup[0]!r} is defined in more than one _base_ file")
        base.update(loaded)
    text = _BASE_VAR.sub(lambda m: f"__petr_base_var__({m.group(2)!r})", text)
    namespace: Dict[str, Any] = {
        "__file__": os.path.abspath(filename),
        "__name__": "__petr_stability_config__",
        "__petr_base_var__": lambda dotted: copy.deepcopy(_lookup(base, dotted, filename)),
    }
    exec(compile(text, filename, "exec"), namespace)  # noqa: S102 - a config file is Python by design
    own = {k: v for k, v in namespace.items() if _is_data(k, v)}
    return _merge(base, own)


def load_config(path: str, _seen: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """Reads an MMEngine or MMCV 1.x Python config with its ``_base_`` files merged in.

    ``custom_imports`` is kept as data and never imported; ``{{_base_.x}}`` references and the predefined
    ``{{ fileDirname }}``-style variables are substituted as MMEngine does.

    Args:
        path: the config file (``.py``).

    Returns:
        The merged config as plain dicts, lists and scalars (``_delete_`` markers resolved and removed).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"config path must be a string, got {path!r}")
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path} does not exist")
    if not path.endswith(".py"):
        raise ValueError(f"only Python configs (.py) are supported, got {path}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return _execute(text, path, _seen or (path,))


# ---------------------------------------------------------------------------------------------- patching
def _is_prob(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _zero_dropout(node: Any, path: str, in_head: bool, in_tr: bool, changes: List[ConfigChange],
                  found: List[str]) -> None:
    if isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            _zero_dropout(item, f"{path}[{i}]", in_head, in_tr, changes, found)
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
            new = 0.0 if isinstance(value, float) else 0
            node[key] = new
            changes.append(ConfigChange(sub, value, new))
            continue
        if not isinstance(value, (dict, list, tuple)) or not isinstance(key, str):
            continue
        lowered = key.lower()
        if "backbone" in lowered or "neck" in lowered:
            continue  # a backbone's drop_path_rate is a regularizer, not the seed's fault
        head = in_head or lowered.endswith("head")
        tr = in_tr or (head and not lowered.endswith("head") and
                       ("transformer" in lowered or lowered in _TRANSFORMER_KEYS))
        if tr and not in_tr:
            found.append(sub)
        _zero_dropout(value, sub, head, tr, changes, found)


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
    if isinstance(current, bool) or not isinstance(current, (int, float)):
        raise ValueError(f"{path}.max_norm must be a number, got {current!r}")
    if current > max_norm:
        clip["max_norm"] = new_value
        changes.append(ConfigChange(f"{path}.max_norm", current, new_value))
    else:
        notes.append(f"{path}.max_norm is already {current:g} <= {max_norm:g}, left unchanged")
    return clip


def patch_config_dict(cfg: Dict[str, Any], max_norm: float = 1.0) -> Tuple[List[ConfigChange], List[str], str]:
    """Applies the seed's fix to a merged config, in place.

    Every drop probability inside the detection head's transformer (any ``*head`` under ``model``, below a
    ``transformer``/``decoder``/``transformerlayers``/``attn_cfgs``/``ffn_cfgs`` key or a ``type`` naming a
    transformer, attention, encoder or decoder) becomes 0; ``max_norm`` becomes ``min(current, max_norm)`` in
    ``optim_wrapper.clip_grad`` (MMEngine) or ``optimizer_config.grad_clip`` (MMCV 1.x), added where absent.
    Backbones and necks are left alone.

    Args:
        cfg: the merged config (see :func:`load_config`).
        max_norm: the clipping bound. Defaults to 1.0 (the seed's).

    Returns:
        (changes, notes, family) with family ``'mmengine'`` or ``'mmcv1'``.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not 0 < max_norm < math.inf:
        raise ValueError(f"max_norm must be a finite number > 0, got {max_norm!r}")
    changes: List[ConfigChange] = []
    notes: List[str] = []
    if not isinstance(cfg.get("model"), dict):
        raise ValueError("the config has no model dict; is this an MMEngine or MMCV 1.x training config?")
    found: List[str] = []
    _zero_dropout(cfg["model"], "model", False, False, changes, found)
    if not found:
        notes.append("no transformer found in the detection head (model.*head); no dropout changed")
    if "optim_wrapper" in cfg:
        family = "mmengine"
        ow = cfg["optim_wrapper"]
        if not isinstance(ow, dict):
            raise ValueError(f"optim_wrapper must be a dict, got {ow!r}")
        nested = {k: v for k, v in ow.items() if isinstance(v, dict) and "optimizer" in v}
        targets = nested if nested and "optimizer" not in ow else {"": ow}
        for name, wrapper in targets.items():
            path = f"optim_wrapper.{name}.clip_grad" if name else "optim_wrapper.clip_grad"
            wrapper["clip_grad"] = _tighten(wrapper.get("clip_grad"), path, max_norm, changes, notes)
    elif "optimizer_config" in cfg or "optimizer" in cfg:
        family = "mmcv1"
        oc = cfg.get("optimizer_config")
        if oc is None:
            oc = cfg["optimizer_config"] = {}
            changes.append(ConfigChange("optimizer_config", None, {}))
        if not isinstance(oc, dict):
            raise ValueError(f"optimizer_config must be a dict, got {oc!r}")
        oc["grad_clip"] = _tighten(oc.get("grad_clip"), "optimizer_config.grad_clip", max_norm, changes, notes)
    else:
        raise ValueError("the config has neither optim_wrapper (MMEngine) nor optimizer / optimizer_config "
                         "(MMCV 1.x); nothing to clip")
    return changes, notes, family


# ---------------------------------------------------------------------------------------------- writing
def _fmt(value: Any, indent: int, where: str) -> str:
    pad, inner = " " * indent, " " * (indent + 4)
    if isinstance(value, dict):
        if not value:
            return "dict()"
        idents = all(isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k) for k in value)
        items = []
        for k, v in value.items():
            body = _fmt(v, indent + 4, f"{where}.{k}")
            items.append(f"{inner}{k}={body}" if idents else f"{inner}{_fmt(k, indent + 4, where)}: {body}")
        open_, close = ("dict(", ")") if idents else ("{", "}")
        return open_ + "\n" + ",\n".join(items) + ",\n" + pad + close
    if isinstance(value, (list, tuple)):
        open_, close = ("[", "]") if isinstance(value, list) else ("(", ")")
        if not value:
            return open_ + close
        parts = [_fmt(v, indent + 4, f"{where}[{i}]") for i, v in enumerate(value)]
        flat = ", ".join(parts)
        if "\n" not in flat and len(flat) + indent < 100:
            return open_ + flat + ("," if isinstance(value, tuple) and len(value) == 1 else "") + close
        return open_ + "\n" + ",\n".join(inner + p for p in parts) + ",\n" + pad + close
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    raise TypeError(f"config value at {where} is a {type(value).__name__} ({value!r}); only dicts, lists, "
                    "tuples, strings, numbers, booleans and None can be written")


def format_config(cfg: Dict[str, Any], header: str = "") -> str:
    """Writes a merged config as a self-contained Python config file (no ``_base_``)."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for key, value in cfg.items():
        if not (isinstance(key, str) and key.isidentifier()):
            raise ValueError(f"top-level config key {key!r} is not a Python identifier")
        lines.append(f"{key} = {_fmt(value, 0, key)}")
    text = "\n".join(lines) + "\n"
    ast.parse(text)  # never write a file that cannot load
    return text


def format_changes(changes: List[ConfigChange], notes: List[str], family: str) -> str:
    """A readable diff: one line per changed value, then notes on what was left as it was."""
    name = {"mmengine": "MMEngine", "mmcv1": "MMCV 1.x"}.get(family, family)
    lines = [f"{len(changes)} change(s) ({name} config):"]
    lines += [f"  - {c.path}: {c.old!r}" + "\n" + f"  + {c.path}: {c.new!r}" for c in changes]
    lines += [f"  note: {n}" for n in notes]
    return "\n".join(lines)


def write_patched_config(cfg_path_or_text: str, out_path: str, max_norm: float = 1.0,
                         base_dir: Optional[str] = None) -> List[ConfigChange]:
    """Writes the seed's fix of a config to ``out_path``; meant also for a hook after an incident.

    Args:
        cfg_path_or_text: a config file path, or config source text (e.g. MMEngine's ``runner.cfg.pretty_text``).
        out_path: the file to write (its directory is created).
        max_norm: the clipping bound. Defaults to 1.0.
        base_dir: where relative ``_base_`` paths of config *text* are resolved. Defaults to the working dir.

    Returns:
        The changes made (empty when the config already had the fix).
    """
    return _patch_and_write(cfg_path_or_text, out_path, max_norm, base_dir)[0]


def _patch_and_write(cfg_path_or_text: str, out_path: str, max_norm: float,
                     base_dir: Optional[str]) -> Tuple[List[ConfigChange], List[str], str]:
    if not isinstance(cfg_path_or_text, str):
        raise TypeError(f"cfg_path_or_text must be a path or config text, got {type(cfg_path_or_text).__name__}")
    if "\n" not in cfg_path_or_text and cfg_path_or_text.endswith(".py"):
        source = os.path.abspath(cfg_path_or_text)
        cfg = load_config(source)
    else:
        source = "(config text)"
        pseudo = os.path.join(os.path.abspath(base_dir or os.getcwd()), "__config_text__.py")
        cfg = _execute(cfg_path_or_text, pseudo, (pseudo,))
    changes, notes, family = patch_config_dict(cfg, max_norm)
    header = (f"Written by `petr-stability patch-config` from {source}\n"
              f"(_base_ files merged in, so this file loads from anywhere). Changes:\n"
              + "\n".join(f"  {c}" for c in changes) + ("\n" if changes else "  (none)\n"))
    text = format_config(cfg, header)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(out_dir, exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(text)
    return changes, notes, family


def main(args: Any) -> int:
    """Entry point of ``petr-stability patch-config`` (``args`` from :mod:`petr_stability.cli`)."""
    changes, notes, family = _patch_and_write(args.config, args.out, args.max_norm, None)
    print(format_changes(changes, notes, family))
    print(f"written: {args.out}")
    return 0
