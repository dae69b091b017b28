"""Version gates for torch features newer than the supported floor (torch >= 1.9): the only place that checks.

Each flag names the torch release that brought the feature, checked against that release's source; the package
calls a newer API only behind one of these flags or through a helper here (docs/versions.md has the audit).
"""
import contextlib
import inspect
from typing import Any, ContextManager, Iterator, Optional, Tuple

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = [
    "TORCH_VERSION",
    "HAS_TORCH_AMP_GRADSCALER",
    "HAS_WEIGHTS_ONLY",
    "HAS_SAFE_GLOBALS",
    "HAS_FOREACH_NORM",
    "HAS_AUTOCAST",
    "HAS_FORWARD_PRE_HOOK_KWARGS",
    "HAS_CHECKPOINT_USE_REENTRANT",
    "WEIGHTS_ONLY_IS_DEFAULT",
    "make_grad_scaler",
    "autocast",
    "autocast_off",
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

#: The device-generic ``torch.autocast(device_type, ...)`` and with it CPU autocast (torch >= 1.10; CPU fp16
#: autocast came later, bf16 first). torch 1.9 has only ``torch.cuda.amp.autocast`` (fp16, CUDA).
HAS_AUTOCAST = hasattr(torch, "autocast")

#: ``Module.register_forward_pre_hook(hook, with_kwargs=True)``: the hook sees keyword arguments (torch >= 2.0).
HAS_FORWARD_PRE_HOOK_KWARGS = "with_kwargs" in inspect.signature(nn.Module.register_forward_pre_hook).parameters

#: ``torch.utils.checkpoint.checkpoint(..., use_reentrant=...)`` is accepted (torch >= 1.11).
HAS_CHECKPOINT_USE_REENTRANT = "use_reentrant" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters


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


def autocast(device_type: str, dtype: Optional[torch.dtype] = None, enabled: bool = True) -> ContextManager[Any]:
    """``torch.autocast(device_type, dtype, enabled)`` on any supported torch.

    Args:
        device_type: ``'cuda'`` or ``'cpu'``.
        dtype: the lower precision; None for the device's default. Before torch 1.10 only CUDA float16 exists.
        enabled: False gives a block with autocast off for ``device_type``. Defaults to True.

    Raises:
        RuntimeError: enabling what this torch lacks (CPU autocast, or a CUDA dtype other than float16, on 1.9).
    """
    if HAS_AUTOCAST:
        kwargs = {} if dtype is None else {"dtype": dtype}
        return torch.autocast(device_type, enabled=enabled, **kwargs)
    if device_type == "cuda" and (not enabled or dtype in (None, torch.float16)):
        return torch.cuda.amp.autocast(enabled=enabled)
    if not enabled:
        return contextlib.nullcontext()  # no CPU autocast before torch 1.10: nothing to switch off
    raise RuntimeError(f"autocast on {device_type!r} with {dtype} needs torch >= 1.10, found {torch.__version__}")


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Turns CPU and CUDA autocast off inside the block (they are separate switches); nests and restores."""
    with contextlib.ExitStack() as stack:
        for device in ("cuda", "cpu"):
            stack.enter_context(autocast(device, enabled=False))
        yield
