"""``petr-stability patch-config``: writes the known manual fix (transformer dropout 0, max_norm 1) into a config.

Configs are read the way the runner reads them: with ``mmengine.Config`` where MMEngine is installed (``_base_``
files, ``{{_base_.x}}``, ``_base_.x`` references, ``read_base()`` configs), else with a standard-library loader
that executes the file as plain Python (MMCV-1-only environments; ``_base_.x`` references are supported there
too). ``custom_imports`` are data, never imported.

The CLI writes one self-contained file. :func:`write_patched_config` (what the hooks call after an incident)
takes the run's *effective* config and, where the original file can be reached, writes a short child config
(``_base_ = ['<original>']`` plus only the changed keys) instead.
"""
import ast
import copy
import keyword
import math
import os
import re
import shutil
import types
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

try:
    from mmengine.config import Config as _MMEngineConfig

    HAS_MMENGINE = True
except ImportError:  # an MMCV-1-only environment: the standard-library loader reads the config
    _MMEngineConfig = None
    HAS_MMENGINE = False

__all__ = [
    "DROPOUT_KEYS",
    "HAS_MMENGINE",
    "ConfigChange",
    "PatchResult",
    "load_config",
    "strip_fault_injection",
    "patch_config_dict",
    "child_overrides",
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
_FAULT_HOOK = "FaultInjectionHook"


@dataclass
class ConfigChange:
    """One value the patch changed: its dotted path, old and new value."""

    path: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.path}: {self.old!r} -> {self.new!r}"


@dataclass
class PatchResult:
    """What :func:`write_patched_config` wrote.

    Attributes:
        path: the file written.
        kind: ``'child'`` (``_base_ = ['<original>']`` plus the changed keys) or ``'flat'`` (the whole config).
        changes: the values the fix changed (empty when the config already had it).
        notes: what the patcher could not do or chose not to (e.g. no transformer found in the head, the
            fire drill removed, why a flat file was written instead of a child).
        family: ``'mmengine'`` or ``'mmcv1'``.

    ``len(result)`` is the number of changes, as callers of the older list-returning API read it.
    """

    path: str
    kind: str
    changes: List[ConfigChange] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    family: str = ""

    def __len__(self) -> int:
        return len(self.changes)


# ---------------------------------------------------------------------------------------------- loading
class _AttrDict(dict):
    """A dict whose keys also read as attributes, for ``_base_.x.y`` references (as MMEngine's ConfigDict)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"_base_ has no key {name!r}") from None


def _attr_view(value: Any) -> Any:
    if isinstance(value, dict):
        return _AttrDict((k, _attr_view(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_attr_view(v) for v in value]
    return copy.deepcopy(value)


def _plain(value: Any) -> Any:
    """Plain dicts and lists all the way down (ConfigDict, _AttrDict and mappings become dicts)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


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


def _base_files(tree: ast.Module, filename: str) -> List[str]:
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


def _uses_read_base(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.With):
            for item in node.items:
                call = item.context_expr
                if isinstance(call, ast.Call) and getattr(call.func, "id", getattr(call.func, "attr", "")) == \
                        "read_base":
                    return True
    return False


class _BaseRefs(ast.NodeTransformer):
    """``_base_.x`` (read, not the ``_base_ = [...]`` assignment) becomes ``__petr_base__.x``."""

    def visit_Attribute(self, node: ast.Attribute) -> Any:
        if isinstance(node.value, ast.Name) and node.value.id == "_base_" and isinstance(node.value.ctx, ast.Load):
            node.value = ast.copy_location(ast.Name(id="__petr_base__", ctx=ast.Load()), node.value)
            return node
        self.generic_visit(node)
        return node


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
    try:
        tree = ast.parse(text, filename)
    except SyntaxError as exc:
        raise ValueError(f"{filename} is not valid Python: {exc}") from exc
    if _uses_read_base(tree):
        raise ValueError(f"{filename} inherits with read_base() (an MMEngine lazy-import config); reading it needs "
                         "mmengine installed")
    base: Dict[str, Any] = {}
    for path in _base_files(tree, filename):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{filename}: _base_ file {path} does not exist")
        if path in seen:
            raise ValueError(f"{filename}: _base_ inheritance loops back to {path}")
        loaded = _load_stdlib(path, seen + (path,))
        dup = sorted(set(base) & set(loaded))
        if dup:
            raise ValueError(f"{filename}: key {dup[0]!r} is defined in more than one _base_ file")
        base.update(loaded)
    text = _BASE_VAR.sub(lambda m: f"__petr_base_var__({m.group(2)!r})", text)
    tree = ast.fix_missing_locations(_BaseRefs().visit(ast.parse(text, filename)))
    namespace: Dict[str, Any] = {
        "__file__": os.path.abspath(filename),
        "__name__": "__petr_stability_config__",
        "__petr_base_var__": lambda dotted: copy.deepcopy(_lookup(base, dotted, filename)),
        "__petr_base__": _attr_view(base),
    }
    exec(compile(tree, filename, "exec"), namespace)  # noqa: S102 - a config file is Python by design
    own = {k: _plain(v) for k, v in namespace.items() if _is_data(k, v)}
    return _merge(base, own)


def _load_stdlib(path: str, seen: Tuple[str, ...]) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return _execute(text, path, seen)


def load_config(path: str, use_mmengine: Optional[bool] = None) -> Dict[str, Any]:
    """Reads an MMEngine or MMCV 1.x Python config with its ``_base_`` files merged in.

    ``custom_imports`` is kept as data and never imported. With MMEngine, ``mmengine.Config.fromfile`` reads it
    (``_base_``, ``{{_base_.x}}``, ``_base_.x`` references, ``read_base()``); without it, the standard-library
    loader executes it as plain Python with the same inheritance rules (``read_base()`` configs need MMEngine).

    Args:
        path: the config file (``.py``).
        use_mmengine: read with MMEngine. Defaults to None (MMEngine where it is installed).

    Returns:
        The merged config as plain dicts, lists and scalars (``_delete_`` markers resolved and removed).

    Raises:
        FileNotFoundError: the file (or one of its ``_base_`` files) does not exist.
        ValueError: not a ``.py`` file, or executing it failed (the message names the file and the error).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"config path must be a string, got {path!r}")
    path = os.path.abspath(os.fspath(path))
    if not path.endswith(".py"):
        raise ValueError(f"only Python configs (.py) can be read, got {path}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path} does not exist")
    if use_mmengine is None:
        use_mmengine = HAS_MMENGINE
    try:
        if use_mmengine:
            if _MMEngineConfig is None:
                raise ValueError("use_mmengine=True but mmengine is not installed")
            return _plain(_MMEngineConfig.fromfile(path, import_custom_modules=False).to_dict())
        return _load_stdlib(path, (path,))
    except (ValueError, FileNotFoundError):
        raise
    except Exception as exc:  # NameError, ImportError, ... raised by the config's own code
        raise ValueError(f"could not read config {path}: {type(exc).__name__}: {exc}") from exc


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
            continue  # a backbone's drop_path_rate is a regularizer, not the fault the fix is for
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
    """Applies the known manual fix (transformer dropout 0, max_norm 1) to a merged config, in place.

    Every drop probability inside the detection head's transformer (any ``*head`` under ``model``, below a
    ``transformer``/``decoder``/``transformerlayers``/``attn_cfgs``/``ffn_cfgs`` key or a ``type`` naming a
    transformer, attention, encoder or decoder) becomes 0; ``max_norm`` becomes ``min(current, max_norm)`` in
    ``optim_wrapper.clip_grad`` (MMEngine) or ``optimizer_config.grad_clip`` (MMCV 1.x), added where absent.
    Backbones and necks are left alone.

    Args:
        cfg: the merged config (see :func:`load_config`).
        max_norm: the clipping bound. Defaults to 1.0.

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


def _is_fault_hook(hook: Any) -> bool:
    kind = hook.get("type") if isinstance(hook, Mapping) else None
    name = kind if isinstance(kind, str) else getattr(kind, "__name__", "")
    return name.rsplit(".", 1)[-1] == _FAULT_HOOK


def strip_fault_injection(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """A copy of ``cfg`` without ``FaultInjectionHook`` in ``custom_hooks`` (the next run must not replay a drill).

    Args:
        cfg: a merged config; left unchanged.

    Returns:
        The copy (plain dicts and lists).
    """
    out = copy.deepcopy(_plain(cfg))
    hooks = out.get("custom_hooks")
    if isinstance(hooks, (list, tuple)):
        out["custom_hooks"] = [h for h in hooks if not _is_fault_hook(h)]
    return out


# ---------------------------------------------------------------------------------------------- child configs
def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                             and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


def _override(old: Any, new: Any) -> Any:
    """What a child config writes so that inheriting ``old`` gives ``new``."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return copy.deepcopy(new)  # lists and scalars replace whole
    if set(old) - set(new) or old.get("type") != new.get("type"):
        # a removed key, or another type whose other keys must not be inherited: replace the dict whole
        return dict(_delete_=True, **copy.deepcopy(new)) if all(isinstance(k, str) for k in new) else None
    out = {}
    for key, value in new.items():
        if key not in old:
            out[key] = copy.deepcopy(value)
        elif not _same(old[key], value):
            sub = _override(old[key], value)
            if sub is None:
                return None
            out[key] = sub
    return out


def child_overrides(original: Mapping[str, Any], target: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The top-level keys a child of ``original`` must set to load as ``target``.

    Dicts are narrowed to the keys that differ (``_delete_=True`` where a key went away or the ``type``
    changed); lists and scalars are written whole, as inheritance replaces them.

    Args:
        original: the merged config of the file the child inherits.
        target: the merged config the child must load as.

    Returns:
        The overrides, or None when no child can express ``target`` (a top-level key of ``original`` is gone).
    """
    if set(original) - set(target):
        return None
    out: Dict[str, Any] = {}
    for key, value in target.items():
        if key not in original:
            out[key] = copy.deepcopy(value)
        elif not _same(original[key], value):
            sub = _override(original[key], value)
            if sub is None:
                return None
            out[key] = sub
    return out


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
    """Writes config values as a Python config file (``_base_`` first when present).

    Args:
        cfg: top-level keys and their values (dicts, lists, tuples, strings, numbers, booleans, None).
        header: comment lines at the top. Defaults to "".

    Returns:
        The file's text (checked to parse).
    """
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


def _check_out(out_path: str) -> str:
    if not isinstance(out_path, (str, os.PathLike)):
        raise TypeError(f"out path must be a string, got {out_path!r}")
    out_path = os.path.abspath(os.fspath(out_path))
    if os.path.isdir(out_path):
        raise ValueError(f"output {out_path} is a directory; name the config file to write")
    return out_path


def _write_text(out_path: str, text: str) -> None:
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    tmp = out_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, out_path)  # a reader never sees half a file


def _header(source: str, kind: str, changes: List[ConfigChange], notes: List[str]) -> str:
    how = ("inherits the file above and sets only what differs from it: the fix, and the run's own overrides"
           if kind == "child" else "_base_ files merged in, so this file loads from anywhere")
    lines = [f"Written by petr_stability from {source}", f"({how}).",
             "The known manual fix (transformer dropout 0, max_norm 1); changes:"]
    lines += [f"  {c}" for c in changes] or ["  (none)"]
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def _source_config(cfg: Any, base_dir: Optional[str]) -> Tuple[Dict[str, Any], str, Optional[str]]:
    """(merged config, a description of where it came from, its file when it is one)."""
    if isinstance(cfg, Mapping) or hasattr(cfg, "to_dict"):
        merged = cfg.to_dict() if hasattr(cfg, "to_dict") and not isinstance(cfg, dict) else cfg
        return _plain(merged), "the run's effective config", None
    if isinstance(cfg, os.PathLike):
        cfg = os.fspath(cfg)
    if not isinstance(cfg, str):
        raise TypeError(f"cfg must be a config dict, a .py path or config text, got {type(cfg).__name__}")
    if "\n" not in cfg:
        path = os.path.abspath(cfg)
        return load_config(path), path, path
    pseudo = os.path.join(os.path.abspath(base_dir or os.getcwd()), "__config_text__.py")
    return _execute(cfg, pseudo, (pseudo,)), "config text", None


def write_patched_config(cfg: Any, out_path: str, max_norm: float = 1.0, original_path: Optional[str] = None,
                         base_dir: Optional[str] = None) -> PatchResult:
    """Writes the known manual fix (transformer dropout 0, max_norm 1) of a config; what the hooks call.

    The fire drill (``FaultInjectionHook``) is taken out of ``custom_hooks``. Where ``original_path`` is a
    ``.py`` file that exists and is not a ``read_base()`` config, a child config is written
    (``_base_ = ['<abs original_path>']`` plus only the keys that differ from that file: the fix and the run's
    own overrides; lists such as ``custom_hooks`` whole) and checked to load back to exactly the patched config;
    otherwise, or if that check fails, the whole patched config is written flat. The notes say which and why.

    Args:
        cfg: the run's effective config (a dict or an MMEngine ``Config``, already merged, overrides included),
            or, for older callers, a ``.py`` path or config source text.
        out_path: the file to write (its directory is created; written atomically).
        max_norm: the clipping bound. Defaults to 1.0.
        original_path: the config file the run was started from, for a child config. Defaults to None (the
            file itself when ``cfg`` is a path; else a flat file).
        base_dir: where relative ``_base_`` paths of config *text* are resolved. Defaults to the working dir.

    Returns:
        A :class:`PatchResult` (path, kind ``'child'`` or ``'flat'``, changes, notes, family).
    """
    out_path = _check_out(out_path)
    merged, source, own_file = _source_config(cfg, base_dir)
    if original_path is None:
        original_path = own_file
    patched = strip_fault_injection(merged)
    notes: List[str] = []
    dropped = len(merged.get("custom_hooks") or []) - len(patched.get("custom_hooks") or [])
    if dropped:
        notes.append(f"custom_hooks: {dropped} FaultInjectionHook entr{'y' if dropped == 1 else 'ies'} removed "
                     "(a fire drill; the next run must not replay it)")
    changes, patch_notes, family = patch_config_dict(patched, max_norm)
    notes = patch_notes + notes
    if original_path is not None and os.path.abspath(original_path) == out_path:
        notes.append(f"{out_path} is the original itself: written flat")
        original_path = None
    text, kind = None, "flat"
    if original_path is not None:
        text = _child_text(patched, os.path.abspath(original_path), changes, notes, out_path)
        kind = "child" if text is not None else "flat"
    if text is None:
        text = format_config(patched, _header(source, "flat", changes, notes))
    _write_text(out_path, text)
    return PatchResult(out_path, kind, changes, notes, family)


def _child_text(patched: Dict[str, Any], original: str, changes: List[ConfigChange], notes: List[str],
                out_path: str) -> Optional[str]:
    """The child config's text, or None (a note says why) when only a flat file can be written."""
    if not (original.endswith(".py") and os.path.isfile(original)):
        notes.append(f"original config {original} is not a .py file the next run can reach: written flat")
        return None
    try:
        with open(original, encoding="utf-8") as f:
            lazy = _uses_read_base(ast.parse(f.read(), original))
        if lazy:
            notes.append(f"{original} inherits with read_base() (lazy import), which a _base_ child cannot "
                         "inherit: written flat")
            return None
        overrides = child_overrides(load_config(original), patched)
    except (OSError, ValueError, SyntaxError) as exc:
        notes.append(f"original config {original} could not be read ({exc}): written flat")
        return None
    if overrides is None:
        notes.append(f"the run's config drops top-level keys of {original}, which a child cannot: written flat")
        return None
    text = format_config(dict(_base_=[original], **overrides), _header(original, "child", changes, notes))
    probe = out_path + ".check.py"
    try:
        _write_text(probe, text)
        same = _same(_plain(load_config(probe)), patched)
    except Exception as exc:  # the check must never stop the flat file from being written
        notes.append(f"the child config did not load back ({type(exc).__name__}: {exc}): written flat")
        return None
    finally:
        if os.path.exists(probe):
            os.remove(probe)
    if not same:
        notes.append("the child config did not load back to the run's config: written flat")
        return None
    return text


def main(args: Any) -> int:
    """Entry point of ``petr-stability patch-config`` (``args`` from :mod:`petr_stability.cli`)."""
    config = os.path.abspath(args.config)
    if not config.endswith(".py"):
        raise ValueError(f"CONFIG must be a Python config file (.py), got {args.config}")
    if not os.path.isfile(config):
        raise FileNotFoundError(f"config file {config} does not exist")
    in_place = bool(getattr(args, "in_place", False))
    out = args.out if args.out is not None else (config if in_place else None)
    if out is None:
        raise ValueError("name the file to write with -o OUT, or pass --in-place to overwrite CONFIG "
                         "(the original is kept as CONFIG.bak)")
    out = _check_out(out)
    same = os.path.exists(out) and os.path.samefile(out, config) or out == config
    if same and not in_place:
        raise ValueError(f"-o {out} is CONFIG itself; pass --in-place to overwrite it (the original is kept as "
                         f"{out}.bak)")
    merged = load_config(config)
    patched = strip_fault_injection(merged)
    changes, notes, family = patch_config_dict(patched, args.max_norm)
    if len(patched.get("custom_hooks") or []) != len(merged.get("custom_hooks") or []):
        notes.append("custom_hooks: FaultInjectionHook removed (a fire drill; the next run must not replay it)")
    text = format_config(patched, _header(config, "flat", changes, notes))
    if same:
        shutil.copy2(config, config + ".bak")
    _write_text(out, text)
    print(format_changes(changes, notes, family))
    if same:
        print(f"kept the original as {config}.bak")
    print(f"written: {out}")
    return 0
