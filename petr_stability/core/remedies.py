"""Remedies as pure functions over live objects: tighten clipping, zero transformer dropout, probe the clip."""
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = [
    "Change",
    "TRANSFORMER_CLASSES",
    "DROPOUT_FLOAT_ATTRS",
    "observing_clip",
    "tighten_clip",
    "zero_transformer_dropout",
    "ClipProbe",
]

#: Classes whose instances (and every descendant module) form the detection head's transformer. Matched by
#: name along the MRO so that subclasses count and no framework has to be importable: MMCV's bricks, PETR's
#: attention and layers (megvii PETR, mmdet3d 1.4 ``projects/PETR``, StreamPETR), flash variants, torch's own.
TRANSFORMER_CLASSES: Tuple[str, ...] = (
    "BaseTransformerLayer",
    "TransformerLayerSequence",
    "MultiheadAttention",
    "FFN",
    "PETRMultiheadAttention",
    "PETRTransformerDecoderLayer",
    "PETRTransformerDecoder",
    "PETRTransformer",
    "PETRTemporalTransformer",
    "PETRTemporalDecoderLayer",
    "FlashMHA",
    "FlashAttention",
    "MultiScaleDeformableAttention",
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
)

#: Float attributes that hold a drop probability (``nn.MultiheadAttention.dropout``, ``FlashMHA``'s
#: ``inner_attn.dropout_p``, ``DropPath.drop_prob``): zeroed like ``nn.Dropout.p``.
DROPOUT_FLOAT_ATTRS: Tuple[str, ...] = ("dropout", "dropout_p", "drop_prob", "attn_drop", "proj_drop")


@dataclass
class Change:
    """One setting a remedy changed, with its old and new value."""

    target: str
    old: Any
    new: Any

    def as_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        for key in ("old", "new"):
            if isinstance(d[key], float) and not math.isfinite(d[key]):
                d[key] = str(d[key])
        return d


def observing_clip() -> Dict[str, float]:
    """Clip arguments that change nothing (``max_norm=inf``) but make the runner compute grad_norm."""
    return {"max_norm": math.inf, "norm_type": 2}


def tighten_clip(clip_kwargs: Optional[Dict[str, Any]], max_norm: float, target: str = "max_norm") -> Optional[Change]:
    """Sets ``clip_kwargs['max_norm'] = min(current, max_norm)`` in place; never loosens a tighter clip.

    Value clipping (``clip_value`` without ``max_norm``, MMEngine ``type='value'``) is left unchanged: a
    per-element bound of 1 is a different, far looser, constraint than a global norm of 1. Returns the
    change, or None when nothing changed.
    """
    if max_norm <= 0 or not math.isfinite(max_norm):
        raise ValueError(f"max_norm must be a finite number > 0, got {max_norm!r}")
    if not clip_kwargs or "max_norm" not in clip_kwargs:
        return None
    current = float(clip_kwargs["max_norm"])
    if current <= max_norm:
        return None
    clip_kwargs["max_norm"] = max_norm
    return Change(target, current, max_norm)


def _in_transformer(module: nn.Module, classes: Sequence[str]) -> bool:
    return any(cls.__name__ in classes for cls in type(module).__mro__)


def _excluded(name: str, exclude: Sequence[str]) -> bool:
    if name.startswith("module."):
        name = name[len("module.") :]
    return any(name == prefix or name.startswith(prefix + ".") for prefix in exclude)


def _scoped_modules(model: nn.Module, scope: str, exclude: Sequence[str]) -> Iterable[Tuple[str, nn.Module]]:
    if scope == "all":
        roots = [("", model)]
    else:
        roots = []
        for name, module in model.named_modules():
            if _in_transformer(module, TRANSFORMER_CLASSES) and not any(
                name == r or name.startswith(r + ".") for r, _ in roots if r
            ):
                roots.append((name, module))
    seen = set()
    for root_name, root in roots:
        for sub_name, module in root.named_modules(prefix=root_name):
            if id(module) in seen or _excluded(sub_name, exclude):
                continue
            seen.add(id(module))
            yield sub_name, module


def zero_transformer_dropout(
    model: nn.Module, scope: str = "transformer", exclude: Sequence[str] = ("backbone", "img_backbone")
) -> List[Change]:
    """Sets every drop probability inside the transformer to 0, in place: half of the known manual fix
    (transformer dropout 0, max_norm 1).

    Covers ``nn.Dropout``-like modules (``p``, MMCV's ``Dropout`` included) and float probabilities
    (``nn.MultiheadAttention.dropout``, ``dropout_p``, ``DropPath.drop_prob``). The change survives
    ``model.train()`` because it edits the attributes the forward reads, not the mode.

    Args:
        model: the unwrapped model.
        scope: ``'transformer'`` (descendants of the classes in :data:`TRANSFORMER_CLASSES`) or ``'all'``.
        exclude: module-name prefixes left alone (backbone DropPath is a regularizer, not the fault).

    Returns:
        One :class:`Change` per attribute that was above 0, named ``'<module>.<attr>'``.
    """
    if scope not in ("transformer", "all"):
        raise ValueError(f"dropout scope must be 'transformer' or 'all', got {scope!r}")
    changes: List[Change] = []
    for name, module in _scoped_modules(model, scope, exclude):
        attrs = ("p",) if isinstance(module, nn.modules.dropout._DropoutNd) else ()
        for attr in attrs + DROPOUT_FLOAT_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, float) and not isinstance(value, bool) and value > 0:
                setattr(module, attr, 0.0)
                changes.append(Change(f"{name}.{attr}" if name else attr, value, 0.0))
    return changes


class ClipProbe:
    """Wraps a gradient-clip function to see every real optimizer step and its grad_norm.

    Both runner families compute the norm through one function (MMEngine ``OptimWrapper.clip_func``, MMCV
    1.x ``OptimizerHook.clip_grads``), called exactly once per optimizer step, so the probe knows which
    iterations stepped under gradient accumulation and reads the norm of that step, not the log's window
    average. The norm stays a tensor until :meth:`read`.

    Args:
        clip_fn: the wrapped function; called with the same arguments.
        skip_nonfinite: drop all gradients of a step whose norm is non-finite, so the optimizer skips it
            (``p.grad = None`` makes every torch optimizer leave the parameter and its state alone). Meant
            for fp32, where nothing else stops a NaN update; under a loss scaler leave it False.
    """

    def __init__(self, clip_fn: Callable[..., Any], skip_nonfinite: bool = False) -> None:
        self.clip_fn = clip_fn
        self.skip_nonfinite = skip_nonfinite
        self._calls = 0
        self._skipped = 0
        self._norm: Any = None

    def __call__(self, params: Iterable[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        params = list(params)
        norm = self.clip_fn(params, *args, **kwargs)
        self._calls += 1
        self._norm = norm
        if self.skip_nonfinite and isinstance(norm, torch.Tensor) and not bool(torch.isfinite(norm)):
            for p in params:
                p.grad = None
            self._skipped += 1
        return norm

    @property
    def stepped(self) -> bool:
        """Whether a step was seen since the last :meth:`read`."""
        return self._calls > 0

    def read(self, host_norm: Optional[float] = None) -> Tuple[bool, Optional[float], bool]:
        """Returns (stepped, grad_norm, skipped_by_probe) since the last read, and resets.

        Args:
            host_norm: the same step's norm as a float the runner already read (MMEngine's message hub, MMCV's
                log buffer). Passing it avoids a second device read of the norm tensor on CUDA.
        """
        stepped, norm, skipped = self._calls > 0, self._norm, self._skipped > 0
        self._calls, self._skipped, self._norm = 0, 0, None
        if stepped and host_norm is not None:
            return stepped, float(host_norm), skipped
        if isinstance(norm, torch.Tensor):
            norm = float(norm)
        return stepped, norm, skipped
