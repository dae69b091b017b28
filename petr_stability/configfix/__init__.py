"""The config library under ``petr-stability patch-config`` / ``check`` and the hook's patched config.

Reading (:mod:`.load`, through the framework's own ``Config``), where each setting lives per runner family
(:mod:`.keys`), which file of a ``_base_`` tree set a value (:mod:`.origin`), what a run changed (:mod:`.fix`),
applying it (:mod:`.patch`), child configs (:mod:`.child`), writing (:mod:`.write`) and the pre-flight checks
(:mod:`.preflight`). Needs neither torch nor the rest of ``petr_stability``; reading a file or text needs mmengine
or MMCV 1.x, a dict needs neither.
"""
from .child import child_config, child_overrides
from .fix import KNOWN_MANUAL_FIX, ConfigFix
from .keys import FAMILIES, config_family
from .load import (
    LOADERS,
    ConfigSource,
    NoConfigLoaderError,
    available_loaders,
    default_loader,
    load_config,
    load_config_text,
    read_config,
)
from .origin import Provenance, provenance
from .patch import DROPOUT_KEYS, FLASH_EQUIVALENTS, ConfigChange, apply_fix, strip_fault_injection
from .preflight import (
    CHECKS,
    Finding,
    check_config,
    check_file,
    check_runner_config,
    format_findings,
    log_findings,
)
from .write import PatchResult, format_changes, format_config, write_patched_config

__all__ = [
    "ConfigFix",
    "KNOWN_MANUAL_FIX",
    "PatchResult",
    "ConfigChange",
    "write_patched_config",
    "apply_fix",
    "strip_fault_injection",
    "format_config",
    "format_changes",
    "child_config",
    "child_overrides",
    "LOADERS",
    "ConfigSource",
    "NoConfigLoaderError",
    "available_loaders",
    "default_loader",
    "load_config",
    "load_config_text",
    "read_config",
    "Provenance",
    "provenance",
    "FAMILIES",
    "config_family",
    "DROPOUT_KEYS",
    "FLASH_EQUIVALENTS",
    "CHECKS",
    "Finding",
    "check_config",
    "check_file",
    "check_runner_config",
    "format_findings",
    "log_findings",
]
