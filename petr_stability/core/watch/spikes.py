"""A NaN-safe running z-score of grad_norm: spike warnings and an adaptive clip bound (pure Python, no torch)."""
import math
from collections import deque
from typing import Any, Deque, Dict, Optional

__all__ = ["GradNormMonitor", "SPIKE_RATIO"]

#: A spike is warned about when it is at least this many times the running mean, besides its z-score.
SPIKE_RATIO = 3.0


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


class GradNormMonitor:
    """Running mean and standard deviation of the last ``window`` finite grad_norm values.

    Fed once per optimizer step with the grad_norm the runner already logged as a host float (no device
    read). Non-finite values (a loss scaler's overflow steps) are left out of the statistics. A value above
    ``mean + z * std`` of the values before it enters the window at that bound, not at its raw size (as ZClip
    does), so one spike does not widen the bound for the next. It is warned about only when it is also at least
    :data:`SPIKE_RATIO` times the mean (llm-foundry's ``KillLossSpike`` test): grad_norm is heavy-tailed, and a
    z-score alone fires on healthy runs now and then.

    Args:
        window: how many recent finite values the statistics cover. Defaults to 100.
        z: how many standard deviations above the mean a spike starts. Defaults to 3.0.
        warmup: finite values needed before warnings and the adaptive bound start. Defaults to 25.
    """

    def __init__(self, window: int = 100, z: float = 3.0, warmup: int = 25) -> None:
        _check_int("window", window, 2)
        _check_positive("z", z)
        _check_int("warmup", warmup, 2)
        self.window = window
        self.z = float(z)
        self.warmup = warmup
        self._values: Deque[float] = deque(maxlen=window)
        self.count = 0  # finite values observed in all
        self.steps = 0  # observe() calls, finite or not
        self.in_spike = False

    @property
    def ready(self) -> bool:
        """True once ``warmup`` finite values were seen."""
        return self.count >= self.warmup and len(self._values) >= 2

    @property
    def mean(self) -> float:
        """Mean of the window (NaN while empty)."""
        return math.fsum(self._values) / len(self._values) if self._values else math.nan

    @property
    def std(self) -> float:
        """Population standard deviation of the window (NaN while empty)."""
        if not self._values:
            return math.nan
        mean = self.mean
        return math.sqrt(math.fsum((v - mean) ** 2 for v in self._values) / len(self._values))

    def _bound(self) -> float:
        return self.mean + self.z * self.std

    def observe(self, grad_norm: float, iteration: Optional[int] = None) -> Optional[str]:
        """Adds one step's grad_norm; returns a warning text on the first step of a spike, else None.

        Args:
            grad_norm: the step's gradient norm as a host float (NaN/Inf allowed: skipped).
            iteration: the step's 1-based iteration, for the warning. Defaults to None (the warning counts the
                steps observed).
        """
        if isinstance(grad_norm, bool) or not isinstance(grad_norm, (int, float)):
            raise TypeError(f"grad_norm must be a number, got {grad_norm!r}")
        self.steps += 1
        value = float(grad_norm)
        if not math.isfinite(value):
            return None
        warning = None
        if self.ready:
            mean, std = self.mean, self.std
            bound = mean + self.z * std
            if value > bound:
                if not self.in_spike and value >= SPIKE_RATIO * mean:
                    where = f"iter {iteration}" if iteration is not None else f"step {self.steps}"
                    warning = (f"grad_norm spike at {where}: {value:.4g} > mean {mean:.4g} + {self.z:g} x std "
                               f"{std:.4g} = {bound:.4g}, {value / mean:.3g} x the mean (last "
                               f"{len(self._values)} steps)")
                self.in_spike = True
                value = bound
            else:
                self.in_spike = False
        self._values.append(value)
        self.count += 1
        return warning

    def clip_bound(self, max_norm: float) -> float:
        """Adaptive clip: ``min(max_norm, mean + z * std)`` once warmed up, else ``max_norm``.

        Args:
            max_norm: the configured bound; the result is never looser.
        """
        _check_positive("max_norm", max_norm)
        if not self.ready:
            return float(max_norm)
        bound = self._bound()
        if not math.isfinite(bound) or bound <= 0:
            return float(max_norm)
        return min(float(max_norm), bound)

    def state_dict(self) -> Dict[str, Any]:
        """Everything :meth:`load_state_dict` needs to continue exactly."""
        return {"version": 1, "values": list(self._values), "count": self.count, "steps": self.steps,
                "in_spike": self.in_spike}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output; missing keys take their fresh values."""
        self._values = deque((float(v) for v in state.get("values", [])), maxlen=self.window)
        self.count = int(state.get("count", len(self._values)))
        self.steps = int(state.get("steps", self.count))
        self.in_spike = bool(state.get("in_spike", False))
