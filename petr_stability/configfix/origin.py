"""Which file of a config's ``_base_`` tree set a value: a batch size declared for another lr is not this lr's."""
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Set

from .load import base_files, load_config

__all__ = ["OVERRIDES", "Provenance", "provenance", "same_value"]

#: The origin of a value the run's effective config holds but its file does not (``--cfg-options``, code).
OVERRIDES = "<the run's overrides>"
_MISSING = object()


def same_value(a: Any, b: Any) -> bool:
    """Config equality: lists equal tuples, ints equal floats of the same value (not bools), NaN equals NaN."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    return (type(a) is type(b) or numbers) and a == b


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


@dataclass
class Provenance:
    """The ``_base_`` tree of a config file, each file with its own merged config.

    Attributes:
        top: the file the run was started from (or :data:`OVERRIDES` above it, see :meth:`with_overrides`).
        configs: file -> the merged config that file loads as.
        bases: file -> its ``_base_`` files.
    """

    top: str
    configs: Dict[str, Dict[str, Any]]
    bases: Dict[str, List[str]] = field(default_factory=dict)

    def origin(self, key: str) -> Optional[str]:
        """The file that set the value at a dotted key (the deepest file holding that same value); None if absent."""
        where = self.top
        value = _get(self.configs[where], key)
        if value is _MISSING:
            return None
        while True:
            for base in self.bases.get(where, []):
                if same_value(_get(self.configs[base], key), value):
                    where = base  # inherited unchanged (a file re-setting the same value changes nothing)
                    break
            else:
                return where

    def ancestors(self, path: str) -> Set[str]:
        """Every file ``path`` inherits, directly or through its bases."""
        out: Set[str] = set()
        todo = list(self.bases.get(path, []))
        while todo:
            base = todo.pop()
            if base not in out:
                out.add(base)
                todo.extend(self.bases.get(base, []))
        return out

    def declared_for(self, key: str, lr_key: str) -> Optional[bool]:
        """Whether the value at ``key`` (a batch declaration) was written for the lr at ``lr_key``: set in the file
        that set the lr, or in a file inheriting that one. False where the lr was set later, over it (an
        mmdet3d schedule file's ``auto_scale_lr`` under a project config with its own lr), or in a file beside
        it; None where either is absent."""
        decl, lr = self.origin(key), self.origin(lr_key)
        if decl is None or lr is None:
            return None
        return decl == lr or lr in self.ancestors(decl)

    def with_overrides(self, effective: Mapping[str, Any]) -> "Provenance":
        """This tree with the run's effective config above it: a value that differs from the file's is the run's."""
        configs = dict(self.configs)
        configs[OVERRIDES] = dict(effective)
        bases = dict(self.bases)
        bases[OVERRIDES] = [self.top]
        return Provenance(OVERRIDES, configs, bases)


def provenance(path: str, loader: Optional[str] = None) -> Optional[Provenance]:
    """Reads a config file's ``_base_`` tree, each file with the framework's own loader.

    Args:
        path: the config file.
        loader: ``'mmengine'`` or ``'mmcv'``. Defaults to None (the default loader).

    Returns:
        The :class:`Provenance`, or None where the tree cannot be read file by file (``read_base()``, a
        package-scoped base, a file that does not load on its own).
    """
    path = os.path.abspath(path)
    configs: Dict[str, Dict[str, Any]] = {}
    bases: Dict[str, List[str]] = {}
    todo = [path]
    try:
        while todo:
            current = todo.pop()
            if current in configs:
                continue
            found = base_files(current)
            if found is None:
                return None
            configs[current], bases[current] = load_config(current, loader), found
            todo.extend(found)
    except (OSError, ValueError, ImportError):
        return None
    return Provenance(path, configs, bases)
