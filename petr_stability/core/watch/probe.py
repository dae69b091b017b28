"""The step sensor: a wrapper around the runner's clip function that sees every optimizer step and its grad_norm."""
import math
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

__all__ = ["ClipProbe", "observing_clip"]


def observing_clip() -> Dict[str, float]:
    """Clip arguments that change nothing (``max_norm=inf``) but make the runner compute grad_norm."""
    return {"max_norm": math.inf, "norm_type": 2}



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
        quiet: return None to the runner instead of the norm, for the guard's own observing clip (installed where
            none is configured): the runner then logs no ``grad_norm``, exactly as without the guard, and a
            skipped step's inf or NaN norm reaches no log. The guard still reads the norm. Defaults to False.
    """

    def __init__(self, clip_fn: Callable[..., Any], skip_nonfinite: bool = False, quiet: bool = False) -> None:
        self.clip_fn = clip_fn
        self.skip_nonfinite = skip_nonfinite
        self.quiet = quiet
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
        return None if self.quiet else norm

    @property
    def stepped(self) -> bool:
        """Whether a step was seen since the last :meth:`read`."""
        return self._calls > 0

    def read(self, host_norm: Optional[float] = None) -> Tuple[bool, Optional[float], bool]:
        """Returns (stepped, grad_norm, skipped_by_probe) since the last read, and resets.

        Args:
            host_norm: the same step's norm as a float the runner already read (MMEngine's message hub, MMCV's
                log buffer). Passing it avoids a second device read of the norm tensor on CUDA. Ignored when
                :attr:`quiet` (the runner logged none: what it holds is another's, or an older one).
        """
        stepped, norm, skipped = self._calls > 0, self._norm, self._skipped > 0
        self._calls, self._skipped, self._norm = 0, 0, None
        if stepped and host_norm is not None and not self.quiet:
            return stepped, float(host_norm), skipped
        if isinstance(norm, torch.Tensor):
            norm = float(norm)
        return stepped, norm, skipped
