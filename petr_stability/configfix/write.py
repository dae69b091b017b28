"""Formatting and writing a patched config: ``write_patched_config``, what the hook calls after an incident."""
import ast
import keyword
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .child import child_config
from .load import ConfigSource, load_config, read_config
from .origin import same_value
from .patch import ConfigChange, ConfigFix, apply_fix, strip_fault_injection

__all__ = ["PatchResult", "format_config", "format_changes", "write_text", "write_patched_config"]

_FAMILY_NAMES = {"mmengine": "MMEngine", "mmcv1": "MMCV 1.x"}


@dataclass
class PatchResult:
    """What :func:`write_patched_config` wrote.

    Attributes:
        path: the file written.
        kind: ``'child'`` (``_base_ = ['<original>']`` plus the changed keys) or ``'flat'`` (the whole config).
        changes: the values the fix changed (empty when the config already had it).
        notes: what the patcher could not do or chose not to (e.g. no transformer found in the head, the
            fire drill removed, why a flat file was written instead of a child).
        family: ``'mmengine'``, ``'mmcv1'`` or ``''``.
        fix: the fix that was applied.
        original: the file a child config inherits (None for a flat file).

    ``len(result)`` is the number of changes.
    """

    path: str
    kind: str
    changes: List[ConfigChange] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    family: str = ""
    fix: ConfigFix = field(default_factory=ConfigFix)
    original: Optional[str] = None

    def __len__(self) -> int:
        return len(self.changes)

    @property
    def summary(self) -> str:
        """One line for a log: the file, its kind, the fix and how many values it changed."""
        kind = f"a child config of {self.original}" if self.kind == "child" else "flat, self-contained"
        return f"wrote {self.path} ({kind}): {self.fix.describe()}; {_count(self.changes)}"


def _count(changes: List[ConfigChange]) -> str:
    return f"{len(changes)} value(s) changed" if changes else "no value changed"


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
    name = _FAMILY_NAMES.get(family, family or "unknown runner family")
    lines = [f"{len(changes)} change(s) ({name} config):"]
    lines += [f"  - {c.path}: {c.old!r}" + "\n" + f"  + {c.path}: {c.new!r}" for c in changes]
    lines += [f"  note: {n}" for n in notes]
    return "\n".join(lines)


def _check_out(out_path: Any) -> str:
    if not isinstance(out_path, (str, os.PathLike)):
        raise TypeError(f"out path must be a string, got {out_path!r}")
    out_path = os.path.abspath(os.fspath(out_path))
    if os.path.isdir(out_path):
        raise ValueError(f"output {out_path} is a directory; name the config file to write")
    return out_path


def write_text(out_path: str, text: str) -> None:
    """Writes ``text`` to ``out_path`` atomically (its directory is created; a reader never sees half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = out_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, out_path)


def _header(source: str, kind: str, fix: ConfigFix, changes: List[ConfigChange], notes: List[str]) -> str:
    how = ("inherits the file above and sets only what differs from it: the fix, and the run's own overrides"
           if kind == "child" else "_base_ files merged in, so this file loads from anywhere")
    lines = [f"Written by petr_stability from {source}", f"({how}).",
             f"Fix: {fix.describe()}; {_count(changes)}" + (":" if changes else "")]
    lines += [f"  {c}" for c in changes]
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def _child_text(patched: Dict[str, Any], original: str, fix: ConfigFix, changes: List[ConfigChange],
                notes: List[str], out_path: str, loader: Optional[str]) -> Optional[str]:
    """The child config's text, checked to load back to ``patched``; None (a note says why) for a flat file."""
    child, why = child_config(original, patched, loader)
    if child is None:
        notes.append(why)
        return None
    text = format_config(child, _header(os.path.abspath(original), "child", fix, changes, notes))
    probe = out_path + ".check.py"
    try:
        write_text(probe, text)
        same = same_value(load_config(probe, loader), patched)
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


def _check_fix(fix: Any) -> ConfigFix:
    if not isinstance(fix, ConfigFix):
        raise TypeError(f"fix must be a ConfigFix, got {fix!r}")
    return fix


def write_patched_config(cfg: Any, out_path: str, fix: ConfigFix, original_path: Optional[str] = None,
                         base_dir: Optional[str] = None, *, loader: Optional[str] = None,
                         child: bool = True) -> PatchResult:
    """Writes the run's effective config with exactly ``fix`` applied (and the fire drill removed).

    Where ``original_path`` is a ``.py`` file that exists and is not a ``read_base()`` config, a child config is
    written (``_base_ = ['<abs original_path>']`` plus only the keys that differ from that file: the fix and the
    run's own overrides; lists such as ``custom_hooks`` whole) and checked to load back to exactly the patched
    config; otherwise, or if that check fails, the whole patched config is written flat. The header and the
    result are written from the changes actually made.

    Args:
        cfg: the run's effective config (a dict, an mmengine or mmcv ``Config``, config text, a ``.py`` path, or a
            :class:`~.load.ConfigSource` read before).
        out_path: the file to write (its directory is created; written atomically).
        fix: what the run changed (see :class:`ConfigFix`).
        original_path: the config file the run was started from, for a child config. Defaults to None (the
            file itself when ``cfg`` is a path; else a flat file).
        base_dir: where relative ``_base_`` paths of config *text* are resolved. Defaults to the working dir.
        loader: ``'mmengine'`` or ``'mmcv'`` for reading files and text. Defaults to None (the default loader).
        child: write a child config where one can be. Defaults to True (False: always flat, as the CLI writes).

    Returns:
        A :class:`PatchResult`.
    """
    fix = _check_fix(fix)
    out_path = _check_out(out_path)
    src = cfg if isinstance(cfg, ConfigSource) else read_config(cfg, base_dir, loader)
    original = (original_path if original_path is not None else src.path) if child else None
    patched = strip_fault_injection(src.config)
    dropped = len(src.config.get("custom_hooks") or []) - len(patched.get("custom_hooks") or [])
    changes, notes, family = apply_fix(patched, fix)
    if dropped:
        notes.append(f"custom_hooks: {dropped} FaultInjectionHook entr{'y' if dropped == 1 else 'ies'} removed "
                     "(a fire drill; the next run must not replay it)")
    if original is not None and os.path.abspath(original) == out_path:
        notes.append(f"{out_path} is the original itself: written flat")
        original = None
    text = None
    if original is not None:
        text = _child_text(patched, original, fix, changes, notes, out_path, loader)
    kind = "child" if text is not None else "flat"
    if text is None:
        text = format_config(patched, _header(src.source, "flat", fix, changes, notes))
    write_text(out_path, text)
    return PatchResult(out_path, kind, changes, notes, family, fix,
                       os.path.abspath(original) if kind == "child" else None)
