"""``ConfigFix``: what a config must change to reproduce the settings the live guard runs with."""
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

__all__ = ["ConfigFix", "KNOWN_MANUAL_FIX"]

#: How every message names the known manual fix; :meth:`ConfigFix.describe` fills in the real bound.
KNOWN_MANUAL_FIX = "the known manual fix (transformer dropout 0, max_norm {max_norm})"


def _num(value: float) -> str:
    return f"{value:g}"


@dataclass
class ConfigFix:
    """What a config must change to reproduce the settings the live guard runs with.

    Attributes:
        max_norm: the clip bound the guard lowered to (None: clipping unchanged).
        zero_dropout: the guard zeroed the head transformer's dropout.
        fp32_modules: module name -> its class name, modules the guard runs in fp32.
        lr_factor: product of the guard's learning-rate backoffs (1.0: none).
        dynamic_loss_scale: the guard turned a static loss scale dynamic.
        quarantine: dataset indices the guard quarantined.
    """

    max_norm: Optional[float] = None
    zero_dropout: bool = False
    fp32_modules: Dict[str, str] = field(default_factory=dict)
    lr_factor: float = 1.0
    dynamic_loss_scale: bool = False
    quarantine: List[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_norm is not None and (isinstance(self.max_norm, bool) or
                                          not isinstance(self.max_norm, (int, float)) or
                                          not 0 < self.max_norm < math.inf):
            raise ValueError(f"max_norm must be a finite number > 0 or None, got {self.max_norm!r}")
        if isinstance(self.lr_factor, bool) or not isinstance(self.lr_factor, (int, float)) or \
                not 0 < self.lr_factor < math.inf:
            raise ValueError(f"lr_factor must be a finite number > 0, got {self.lr_factor!r}")
        if not isinstance(self.fp32_modules, dict) or not all(
                isinstance(k, str) and k and isinstance(v, str) for k, v in self.fp32_modules.items()):
            raise ValueError(f"fp32_modules must map module names to class names, got {self.fp32_modules!r}")
        if not isinstance(self.quarantine, (list, tuple, set, frozenset)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.quarantine):
            raise ValueError(f"quarantine must be a list of dataset indices (ints >= 0), got {self.quarantine!r}")
        self.quarantine = sorted(set(self.quarantine))
        self.zero_dropout, self.dynamic_loss_scale = bool(self.zero_dropout), bool(self.dynamic_loss_scale)

    @classmethod
    def known_manual_fix(cls, max_norm: float = 1.0) -> "ConfigFix":
        """The known manual fix: every transformer dropout 0 and ``max_norm = min(current, max_norm)``.

        Args:
            max_norm: the clip bound. Defaults to 1.0.
        """
        return cls(max_norm=max_norm, zero_dropout=True)

    @property
    def is_empty(self) -> bool:
        """True when the fix changes no setting."""
        return (self.max_norm is None and not self.zero_dropout and not self.fp32_modules and self.lr_factor == 1.0
                and not self.dynamic_loss_scale and not self.quarantine)

    def describe(self) -> str:
        """Exactly what the fix holds, e.g. ``'the known manual fix (transformer dropout 0, max_norm 1); lr x 0.5'``;
        ``'no setting changed'`` when empty."""
        parts: List[str] = []
        if self.zero_dropout and self.max_norm is not None:
            parts.append(KNOWN_MANUAL_FIX.format(max_norm=_num(self.max_norm)))
        elif self.max_norm is not None:
            parts.append(f"max_norm {_num(self.max_norm)}")
        elif self.zero_dropout:
            parts.append("transformer dropout 0")
        parts += [f"fp32: {name} ({cls})" for name, cls in self.fp32_modules.items()]
        if self.lr_factor != 1.0:
            parts.append(f"lr x {_num(self.lr_factor)}")
        if self.dynamic_loss_scale:
            parts.append("dynamic loss scale")
        if self.quarantine:
            parts.append(f"{len(self.quarantine)} sample(s) quarantined")
        return "; ".join(parts) or "no setting changed"
