"""Which runner family an environment can import, found without importing it.

MMEngine's stack (mmengine + mmcv 2.x / mmcv-lite) and MMCV 1.x are both ``mmcv`` and never share one environment
(mmengine itself may sit beside MMCV 1.x: many PETR environments have both).
A test that needs a family skips where it is not installed; where it is installed but fails to import (a missing
dependency), the import error must surface, not turn into a skip. The modules are located as ``import`` would
find them (package metadata can disagree: a folder put first on ``sys.path`` hides an installed distribution).
"""
import importlib.util
import os

__all__ = ["has_mmengine", "has_mmcv1", "require"]


def has_mmengine() -> bool:
    """The MMEngine runner stack: ``mmengine`` importable with mmcv 2.x / mmcv-lite (or none), not MMCV 1.x.

    An MMCV 1.x environment may hold mmengine too (the hooks then register with both); its runners are MMCV's.
    """
    return importlib.util.find_spec("mmengine") is not None and not has_mmcv1()


def has_mmcv1() -> bool:
    """``mmcv`` is importable and is 1.x: only MMCV 1.x has the ``mmcv/runner`` package."""
    spec = importlib.util.find_spec("mmcv")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(os.path.isfile(os.path.join(d, "runner", "__init__.py")) for d in spec.submodule_search_locations)


def require(family: str) -> None:
    """Skips the calling test module (or test) unless ``family`` ('mmengine' or 'mmcv1') is installed."""
    import pytest

    if not (has_mmengine() if family == "mmengine" else has_mmcv1()):
        other = "an MMCV 1.x" if family == "mmengine" else "an MMEngine"
        pytest.skip(f"needs {family} installed ({other} environment runs the other cases)", allow_module_level=True)
