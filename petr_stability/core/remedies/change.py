"""The record every remedy returns: one setting it changed, with its old and new value."""
import math
from dataclasses import asdict, dataclass
from typing import Any, Dict

__all__ = ["Change"]


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
