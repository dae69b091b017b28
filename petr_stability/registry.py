"""Registers the hooks with every runner family that is installed: MMEngine's ``HOOKS`` and MMCV 1.x's.

Many PETR environments hold both (mmdet3d 0.x on mmcv-full 1.x, plus mmengine pulled in by another tool). Each
family is imported only where its own import works, and one family failing to import never hides the other:
the reason is kept in :data:`IMPORT_ERRORS`.
"""
import contextlib
import logging
import warnings
from typing import Any, Dict, Iterator, Optional, Tuple

__all__ = ["NanGuardHook", "FaultInjectionHook", "RUNNER_FAMILY", "RUNNER_FAMILIES", "IMPORT_ERRORS"]

NanGuardHook: Optional[Any] = None
FaultInjectionHook: Optional[Any] = None
#: The families the hooks are registered with, MMEngine first.
RUNNER_FAMILIES: Tuple[str, ...] = ()
#: ``'mmengine'``, ``'mmcv1'`` or None (core only): the family whose hooks :data:`NanGuardHook` names.
RUNNER_FAMILY: Optional[str] = None
#: Why an installed family could not be registered (family -> error text).
IMPORT_ERRORS: Dict[str, str] = {}


@contextlib.contextmanager
def _quiet_mmcv1_import() -> Iterator[None]:
    """Importing MMCV 1.x announces its 2.0 release (a UserWarning) and makes torch log where CUDA_HOME is: neither is
    about the run, and ``petr-stability --version`` must print the version only. Only those two, only during this
    import (a training script has imported mmcv long before this line)."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="On January 1, 2023, MMCV will release v2.0.0")
            yield
    finally:
        logger.setLevel(level)


def _mmcv_major() -> Optional[int]:
    try:
        with _quiet_mmcv1_import():
            import mmcv
    except ImportError:
        return None
    return int(str(getattr(mmcv, "__version__", "0")).split(".")[0] or 0)


def _register_mmengine() -> Tuple[Any, Any]:
    from mmengine.registry import HOOKS

    from .adapters.mmengine_runner.faults import FaultInjectionHook as Faults
    from .adapters.mmengine_runner.hook import NanGuardHook as Guard

    HOOKS.register_module(module=Guard, force=True)
    HOOKS.register_module(module=Faults, force=True)
    return Guard, Faults


def _register_mmcv1() -> Tuple[Any, Any]:
    with _quiet_mmcv1_import():
        from mmcv.runner import HOOKS

    from .adapters.mmcv1_runner.faults import FaultInjectionHook as Faults
    from .adapters.mmcv1_runner.hook import NanGuardHook as Guard

    HOOKS.register_module(module=Guard, force=True)
    HOOKS.register_module(module=Faults, force=True)
    return Guard, Faults


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


_families = []
if _installed("mmengine"):
    _families.append(("mmengine", _register_mmengine))
if _installed("mmcv") and _mmcv_major() == 1:
    _families.append(("mmcv1", _register_mmcv1))
for _index, (_family, _register) in enumerate(_families):
    try:
        _guard, _faults = _register()
    except Exception as _exc:
        if not RUNNER_FAMILIES and _index == len(_families) - 1:
            raise  # nothing could be registered: a broken install fails loudly here
        # A broken family must not hide the other; the reason is said once and stays inspectable.
        IMPORT_ERRORS[_family] = f"{type(_exc).__name__}: {_exc}"
        warnings.warn(f"petr_stability: hooks not registered with {_family}: {IMPORT_ERRORS[_family]}",
                      RuntimeWarning, stacklevel=2)
        continue
    RUNNER_FAMILIES += (_family,)
    if NanGuardHook is None:
        NanGuardHook, FaultInjectionHook, RUNNER_FAMILY = _guard, _faults, _family
