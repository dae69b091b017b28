"""Small pieces both runner adapters share: writing the seed's fix into the work dir after an incident."""
import math
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..tools.patch_config import write_patched_config

__all__ = ["PATCHED_CONFIG_FILE", "write_config_fix"]

#: File the hooks write into the work dir after an incident, so that the next run starts stable.
PATCHED_CONFIG_FILE = "nan_guard_patched_config.py"


def write_config_fix(
    cfg_source: Any,
    work_dir: str,
    clip_settings: List[Tuple[str, Dict[str, Any]]],
    log: Callable[..., None],
) -> Optional[str]:
    """Writes ``<work_dir>/nan_guard_patched_config.py`` with the remedies applied in the live run.

    Args:
        cfg_source: an MMEngine ``Config`` (its file when it has one, else its text), a path, or config text.
        work_dir: the run's work dir.
        clip_settings: the live clip kwargs; their tightest finite ``max_norm`` goes into the file.
        log: the adapter's logger.

    Returns:
        The path written, or None (nothing to patch, or the config could not be parsed: logged, never raised,
        because a failure here must not end a recovered run).
    """
    filename = getattr(cfg_source, "filename", None)
    if filename and os.path.isfile(filename):
        source = filename
    elif isinstance(cfg_source, str):
        source = cfg_source
    else:
        source = getattr(cfg_source, "pretty_text", "") or ""
    if not source.strip():
        log("NanGuard: no config file or text to patch; skipped writing a patched config", "warning")
        return None
    norms = [float(kw["max_norm"]) for _, kw in clip_settings if kw and math.isfinite(float(kw.get("max_norm", 1)))]
    max_norm = min(norms) if norms else 1.0
    out = os.path.join(work_dir, PATCHED_CONFIG_FILE)
    try:
        changes = write_patched_config(source, out, max_norm=max_norm)
    except Exception as exc:  # a config the patcher cannot read must not end a recovered run
        log(f"NanGuard: could not write a patched config ({type(exc).__name__}: {exc})", "warning")
        return None
    log(f"NanGuard: wrote {out} ({len(changes)} change(s)): start the next run from it to keep the fix")
    return out
