"""The config library under ``patch-config``, ``check`` and the hook's patched config; needs no torch, no core."""
from .child import child_config, child_overrides
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
from .patch import (
    DROPOUT_KEYS,
    FLASH_EQUIVALENTS,
    KNOWN_MANUAL_FIX,
    ConfigChange,
    ConfigFix,
    apply_fix,
    strip_fault_injection,
)
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
