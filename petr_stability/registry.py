"""Registers the hooks with whichever runner family is installed (MMEngine first, else MMCV 1.x)."""
from typing import Any, Optional

__all__ = ["NanGuardHook", "FaultInjectionHook", "RUNNER_FAMILY"]

NanGuardHook: Optional[Any] = None
FaultInjectionHook: Optional[Any] = None
#: ``'mmengine'``, ``'mmcv1'`` or None (core only).
RUNNER_FAMILY: Optional[str] = None


def _mmcv_major() -> Optional[int]:
    try:
        import mmcv
    except ImportError:
        return None
    return int(str(getattr(mmcv, "__version__", "0")).split(".")[0] or 0)


try:
    import mmengine  # noqa: F401
except ImportError:
    mmengine = None

if mmengine is not None:
    from mmengine.registry import HOOKS

    from .adapters.mmengine_faults import FaultInjectionHook
    from .adapters.mmengine_hook import NanGuardHook

    HOOKS.register_module(module=NanGuardHook, force=True)
    HOOKS.register_module(module=FaultInjectionHook, force=True)
    RUNNER_FAMILY = "mmengine"
elif _mmcv_major() == 1:
    from mmcv.runner import HOOKS

    from .adapters.mmcv1_faults import FaultInjectionHook
    from .adapters.mmcv1_hook import NanGuardHook

    HOOKS.register_module(module=NanGuardHook, force=True)
    HOOKS.register_module(module=FaultInjectionHook, force=True)
    RUNNER_FAMILY = "mmcv1"
