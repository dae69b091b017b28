"""What an MMEngine checkpoint pickles besides tensors, and its safe loading (no mmengine import needed)."""
from typing import Any, Dict, Sequence

from ...core.safe_load import safe_load

__all__ = ["MMENGINE_CHECKPOINT_GLOBALS", "load_mmengine_checkpoint"]

#: Dotted names of the non-tensor globals an MMEngine checkpoint pickles: its message hub keeps
#: ``HistoryBuffer`` objects holding numpy arrays and scalars, and each buffer pickles its bound statistic
#: methods as ``getattr(buffer, 'mean')``. ``getattr`` is safe in this list because torch's weights-only
#: unpickler calls only allowlisted callables: whatever ``getattr`` returns can never be called.
MMENGINE_CHECKPOINT_GLOBALS: Sequence[str] = (
    "mmengine.logging.history_buffer.HistoryBuffer",
    "builtins.getattr",
    "_codecs.encode",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.dtypes.Float64DType",
    "numpy.dtypes.Float32DType",
    "numpy.dtypes.Int64DType",
    "numpy.dtypes.Int32DType",
    "numpy.dtypes.BoolDType",
)


def load_mmengine_checkpoint(path: str, map_location: Any = "cpu") -> Dict:
    """:func:`~petr_stability.core.safe_load.safe_load` with exactly the types MMEngine checkpoints pickle."""
    return safe_load(path, map_location=map_location, extra_globals=MMENGINE_CHECKPOINT_GLOBALS)
