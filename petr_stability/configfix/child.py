"""Child configs: ``_base_ = ['<original>']`` plus only the keys a run's patched config changes."""
import copy
import os
from typing import Any, Dict, Mapping, Optional, Tuple

from .load import load_config, uses_read_base
from .origin import same_value

__all__ = ["child_overrides", "child_config"]


def _override(old: Any, new: Any) -> Any:
    """What a child config writes so that inheriting ``old`` gives ``new`` (None: it cannot)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return copy.deepcopy(new)  # lists and scalars replace whole
    if set(old) - set(new) or old.get("type") != new.get("type"):
        # a removed key, or another type whose other keys must not be inherited: replace the dict whole
        return dict(_delete_=True, **copy.deepcopy(new)) if all(isinstance(k, str) for k in new) else None
    out = {}
    for key, value in new.items():
        if key not in old:
            out[key] = copy.deepcopy(value)
        elif not same_value(old[key], value):
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
        elif not same_value(original[key], value):
            sub = _override(original[key], value)
            if sub is None:
                return None
            out[key] = sub
    return out


def child_config(original: str, target: Mapping[str, Any],
                 loader: Optional[str] = None) -> Tuple[Optional[Dict[str, Any]], str]:
    """A child config of the file ``original`` that loads as ``target``, or why there is none.

    Args:
        original: the config file the run was started from.
        target: the merged config the child must load as.
        loader: ``'mmengine'`` or ``'mmcv'`` for reading ``original``. Defaults to None (the default loader).

    Returns:
        (``{'_base_': [original], **overrides}``, ``''``), or (None, the reason, for a note).
    """
    original = os.path.abspath(original)
    if not (original.endswith(".py") and os.path.isfile(original)):
        return None, f"original config {original} is not a .py file the next run can reach: written flat"
    if uses_read_base(original):
        return None, (f"{original} inherits with read_base() (lazy import), which a _base_ child cannot inherit: "
                      "written flat")
    try:
        overrides = child_overrides(load_config(original, loader), target)
    except (OSError, ValueError, ImportError) as exc:
        return None, f"original config {original} could not be read ({exc}): written flat"
    if overrides is None:
        return None, f"the run's config drops top-level keys of {original}, which a child cannot: written flat"
    return dict(_base_=[original], **overrides), ""
