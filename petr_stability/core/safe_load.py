"""Checkpoint loading that never runs arbitrary pickled code (``weights_only=True`` plus a scoped allowlist)."""
import contextlib
import importlib
import pickle
from typing import Any, Dict, Iterator, List, Sequence

import torch

from .errors import UnsafeCheckpointError
from .flags import HAS_SAFE_GLOBALS, HAS_WEIGHTS_ONLY

__all__ = ["MMENGINE_CHECKPOINT_GLOBALS", "resolve_globals", "safe_load", "allow_globals"]

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


def resolve_globals(names: Sequence[str]) -> List[Any]:
    """Imports each dotted name that exists in this environment; absent ones are skipped."""
    found = []
    for name in names:
        module_name, _, attr = name.rpartition(".")
        try:
            module = importlib.import_module(module_name)
            obj = getattr(module, attr)
        except (ImportError, AttributeError):
            continue
        if not any(obj is f for f in found):  # numpy.core and numpy._core name the same objects
            found.append(obj)
    return found


@contextlib.contextmanager
def allow_globals(names: Sequence[str]) -> Iterator[None]:
    """Allows ``names`` for ``weights_only`` loads inside the block only (no-op before torch 2.5)."""
    if not HAS_SAFE_GLOBALS:
        yield
        return
    with torch.serialization.safe_globals(resolve_globals(names)):
        yield


def safe_load(path: str, map_location: Any = "cpu", extra_globals: Sequence[str] = MMENGINE_CHECKPOINT_GLOBALS) -> Dict:
    """Loads a checkpoint with ``weights_only=True`` and a minimal allowlist scoped to this call.

    Raises:
        UnsafeCheckpointError: the file asks for a global outside the allowlist (a malicious or foreign
            pickle): the message says which one. Truncated files raise the underlying error.
    """
    if not HAS_WEIGHTS_ONLY:
        raise UnsafeCheckpointError(
            f"cannot load {path} safely: torch {torch.__version__} has no weights_only loading (needs >= 1.13)"
        )
    try:
        with allow_globals(extra_globals):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"refused to load {path}: it needs a type outside the safe allowlist, so it could run code "
            f"when unpickled ({str(exc).splitlines()[0]})"
        ) from exc
