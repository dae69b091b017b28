"""Checkpoint loading that never runs arbitrary pickled code (``weights_only=True`` plus a scoped allowlist)."""
import contextlib
import importlib
import pickle
from typing import Any, Dict, Iterator, List, Sequence

import torch

from .errors import UnsafeCheckpointError
from .flags import HAS_SAFE_GLOBALS, HAS_WEIGHTS_ONLY

__all__ = ["resolve_globals", "safe_load", "allow_globals"]

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


def safe_load(path: str, map_location: Any = "cpu", extra_globals: Sequence[str] = ()) -> Dict:
    """Loads a checkpoint with ``weights_only=True`` and a minimal allowlist scoped to this call.

    Args:
        path: the file.
        map_location: as for ``torch.load``. Defaults to ``'cpu'``.
        extra_globals: dotted names of the non-tensor types the file may hold, allowed for this call only (a runner
            family's list: :data:`~petr_stability.adapters.mmengine_checkpoints.MMENGINE_CHECKPOINT_GLOBALS`).
            Defaults to none.

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
