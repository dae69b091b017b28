"""Version gates for torch features newer than the supported floor (torch >= 1.10): the only place that checks."""
import inspect
from typing import Any, Tuple

import torch

__all__ = [
    "TORCH_VERSION",
    "HAS_TORCH_AMP_GRADSCALER",
    "HAS_WEIGHTS_ONLY",
    "HAS_SAFE_GLOBALS",
    "HAS_FOREACH_NORM",
    "WEIGHTS_ONLY_IS_DEFAULT",
    "make_grad_scaler",
]


def _parse(version: str) -> Tuple[int, int]:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


TORCH_VERSION = _parse(torch.__version__)

#: ``torch.amp.GradScaler(device)`` exists (torch >= 2.3); older torch only has ``torch.cuda.amp.GradScaler``.
HAS_TORCH_AMP_GRADSCALER = hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler")

#: ``torch.load(..., weights_only=...)`` is accepted (torch >= 1.13).
HAS_WEIGHTS_ONLY = "weights_only" in inspect.signature(torch.load).parameters

#: ``torch.serialization.safe_globals`` context manager (torch >= 2.5).
HAS_SAFE_GLOBALS = hasattr(torch.serialization, "safe_globals")

#: ``torch.load`` defaults to ``weights_only=True`` (torch >= 2.6): MMEngine 0.10.7 cannot resume there.
WEIGHTS_ONLY_IS_DEFAULT = TORCH_VERSION >= (2, 6)

#: ``torch._foreach_norm`` with an ``ord`` argument, one fused kernel per dtype/device group (torch >= 1.13).
HAS_FOREACH_NORM = hasattr(torch, "_foreach_norm") and TORCH_VERSION >= (1, 13)


def make_grad_scaler(device: str = "cuda", **kwargs: Any) -> Any:
    """Builds a ``GradScaler`` for ``device`` on any supported torch.

    Args:
        device: ``'cuda'`` or ``'cpu'``. CPU scaling needs torch >= 2.3.
        **kwargs: passed to the scaler (``init_scale``, ``growth_interval``, ...).
    """
    if HAS_TORCH_AMP_GRADSCALER:
        return torch.amp.GradScaler(device, **kwargs)
    if device != "cuda":
        raise RuntimeError(f"a GradScaler for device {device!r} needs torch >= 2.3, found {torch.__version__}")
    return torch.cuda.amp.GradScaler(**kwargs)
