"""petr_stability: keeps long fp16 training runs of PETR-family 3D detectors alive under OpenMMLab runners.

``import petr_stability`` registers ``NanGuardHook`` with whichever runner family is installed (MMEngine's
``HOOKS`` registry, or MMCV 1.x's ``mmcv.runner.HOOKS``). The core (detection, remedies, snapshots, incident
log) needs torch only.
"""
from .core.config import GuardConfig
from .core.errors import (
    BadDataError,
    NanGuardError,
    NanGuardGaveUp,
    NoHealthyStateError,
    ReplicaDriftError,
    StructuralDivergence,
    UnsafeCheckpointError,
)
from .core.guard import NanGuard
from .core.port import GuardIO
from .core.records import INCIDENT_FILE, read_incidents
from .core.remedies import tighten_clip, zero_transformer_dropout
from .core.safe_load import safe_load
from .core.watch.detector import DetectorConfig, DivergenceDetector, StepSignals, Verdict
from .core.watch.probe import ClipProbe, observing_clip
from .registry import RUNNER_FAMILY, FaultInjectionHook, NanGuardHook

__version__ = "0.1.0"

__all__ = [
    "NanGuardHook",
    "FaultInjectionHook",
    "RUNNER_FAMILY",
    "GuardConfig",
    "GuardIO",
    "NanGuard",
    "DetectorConfig",
    "DivergenceDetector",
    "StepSignals",
    "Verdict",
    "NanGuardError",
    "NanGuardGaveUp",
    "NoHealthyStateError",
    "StructuralDivergence",
    "BadDataError",
    "ReplicaDriftError",
    "UnsafeCheckpointError",
    "read_incidents",
    "INCIDENT_FILE",
    "tighten_clip",
    "zero_transformer_dropout",
    "observing_clip",
    "ClipProbe",
    "safe_load",
    "__version__",
]
