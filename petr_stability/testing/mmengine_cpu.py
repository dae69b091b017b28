"""The demo's MMEngine stand-ins for tests, registered on import (tests only: the shipped demo registers them itself):
the CPU ``AmpOptimWrapper`` and the PETR-shaped ``BaseModel``."""
from ..demo.amp import CPUAmpOptimWrapper, PETRLikeModel, register
from ..demo.data import ListDataset

__all__ = ["CPUAmpOptimWrapper", "PETRLikeModel", "ListDataset"]

register()
