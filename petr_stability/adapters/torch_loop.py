"""GuardIO for a plain PyTorch training loop (no runner): the guard in a hand-written loop, benchmarks, tests."""
import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..core.guard import GuardIO
from ..core.remedies import ClipProbe
from ..core.snapshot import load_optimizer_state

__all__ = ["TorchLoopIO"]


class TorchLoopIO(GuardIO):
    """Adapter for a loop you write yourself.

    In the loop: call :meth:`clip` where you would call ``clip_grad_norm_`` (it is the probe), set
    :attr:`last_loss` to the step's loss as a float you already read, call ``guard.after_iter()`` after the
    optimizer step, then ``io.iter += 1``. A rollback sets :attr:`iter` back.

    Args:
        model: the model (unwrapped).
        optimizer: a torch optimizer.
        scaler: a ``GradScaler`` or None (fp32).
        clip_kwargs: arguments of ``clip_grad_norm_``; edited in place by the clip remedy.
        work_dir: where the incident log goes; None for none.
        skip_nonfinite_fp32: drop non-finite fp32 steps before the optimizer applies them.
        log_fn: where log lines go. Defaults to ``print``.
    """

    def __init__(self, model: nn.Module, optimizer: Any, scaler: Any = None,
                 clip_kwargs: Optional[Dict[str, Any]] = None, work_dir: Optional[str] = None,
                 skip_nonfinite_fp32: bool = True, log_fn: Callable[[str], Any] = print) -> None:
        self.work_dir = work_dir
        self.net = model
        self.opt = optimizer
        self.grad_scaler = scaler
        self.clip_kwargs = dict(clip_kwargs or {"max_norm": float("inf"), "norm_type": 2})
        self.probe = ClipProbe(torch.nn.utils.clip_grad_norm_, skip_nonfinite=skip_nonfinite_fp32 and scaler is None)
        self.iter = 0
        self.epoch = 0
        self.last_loss: Optional[float] = None
        self.log_fn = log_fn
        self.scalars: Dict[str, float] = {}

    def clip(self, params: Any) -> Any:
        """Clips (and observes) the gradients of ``params`` with the live clip arguments."""
        return self.probe(params, **self.clip_kwargs)

    def model(self) -> nn.Module:
        return self.net

    def optimizers(self) -> List[Any]:
        return [self.opt]

    def read_step(self) -> Tuple[bool, Optional[float], bool]:
        return self.probe.read()

    def loss(self) -> Optional[float]:
        return self.last_loss

    def scaler(self) -> Tuple[Any, str]:
        if self.grad_scaler is None:
            return None, "none"
        return self.grad_scaler, "dynamic"

    def clip_settings(self) -> List[Tuple[str, Dict[str, Any]]]:
        return [("clip.max_norm", self.clip_kwargs)]

    def capture(self) -> Dict[str, Any]:
        state = {"meta": {"iter": self.iter, "epoch": self.epoch}, "state_dict": self.net.state_dict(),
                 "optimizer": self.opt.state_dict()}
        if self.grad_scaler is not None:
            state["scaler"] = self.grad_scaler.state_dict()
        return state

    def restore(self, payload: Dict[str, Any]) -> None:
        self.net.load_state_dict(payload["state_dict"])
        load_optimizer_state(self.opt, payload["optimizer"])
        if self.grad_scaler is not None and "scaler" in payload:
            self.grad_scaler.load_state_dict(copy.deepcopy(payload["scaler"]))
        self.iter = int(payload["meta"]["iter"])

    def counters(self) -> Tuple[int, int]:
        return self.iter, self.epoch

    def log(self, msg: str, level: str = "info") -> None:
        self.log_fn(f"[{level}] {msg}")

    def update_scalars(self, scalars: Dict[str, float]) -> None:
        self.scalars.update(scalars)
