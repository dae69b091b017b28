"""GuardIO for a plain PyTorch training loop (no runner): the guard in a hand-written loop, benchmarks, tests."""
import contextlib
import copy
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..core.port import ClipSetting, GuardIO, Payload, RunConfig, StepReading
from ..core.recovery.snapshot import load_optimizer_state
from ..core.watch.probe import ClipProbe

__all__ = ["TorchLoopIO"]


class TorchLoopIO(GuardIO):
    """Adapter for a loop you write yourself, driven by :class:`~petr_stability.adapters.driver.GuardDriver`.

    In the loop: ``driver.before_iter(batch)``; forward, backward; call :meth:`clip` where you would call
    ``clip_grad_norm_`` (it is the probe); the optimizer step; set :attr:`last_loss` to the step's loss as a float
    you already read; ``driver.after_iter()``; then ``io.iter += 1``. After the loop, ``driver.finish()``. A rollback
    sets :attr:`iter` back. ``iter`` is the 0-based index of the running iteration, as in the runners.

    Args:
        model: the model (unwrapped).
        optimizer: a torch optimizer.
        scaler: a ``GradScaler`` or None (fp32).
        clip_kwargs: arguments of ``clip_grad_norm_``; edited in place by the clip remedy. Defaults to an
            observing clip (``max_norm=inf``).
        work_dir: where the incident log goes; None for none.
        log_fn: where log lines go. Defaults to ``print``.
        config: the run's config (any dict), for the patched config written after an incident. Defaults to None.
        loader: the training ``DataLoader`` (bad samples are quarantined through its sampler). Defaults to None.
        schedulers: torch LR schedulers (a learning-rate backoff scales them too). Defaults to ().
        writer: a TensorBoard ``SummaryWriter`` (anything with ``add_scalar`` / ``add_text``): the guard's scalars
            after every iteration and each incident as text, at the iterations run (a rollback never sends the step
            back). Defaults to None.
        max_iters: the loop's last iteration count, where known: under a process group its verdict is then agreed
            at once (the others are agreed during the next iteration; without it, call ``driver.after_epoch()``
            after the last iteration). Defaults to None.
        forward: ``forward(model, batch) -> loss`` (a tensor, or a dict of ``*loss*`` tensors), the loop's own loss
            computation: with it the guard re-runs a failing batch (on the live weights, the healthy ones, and the
            last good batch) to tell bad data from training dynamics and from an fp16 overflow in one module; without
            it there is no replay diagnosis. Defaults to None.
        autocast: a zero-argument callable returning the context manager the loop's forward runs in (``lambda:
            torch.autocast('cpu', dtype=torch.float16)``), so that a replay computes in the training precision.
            Defaults to None (a null context: the forward as it is).
    """

    def __init__(self, model: nn.Module, optimizer: Any, scaler: Any = None,
                 clip_kwargs: Optional[Dict[str, Any]] = None, work_dir: Optional[str] = None,
                 log_fn: Callable[[str], Any] = print, config: Optional[Dict[str, Any]] = None, loader: Any = None,
                 schedulers: Sequence[Any] = (), writer: Any = None, max_iters: Optional[int] = None,
                 forward: Optional[Callable[[nn.Module, Any], Any]] = None,
                 autocast: Optional[Callable[[], ContextManager[Any]]] = None) -> None:
        self.work_dir = work_dir
        self.net = model
        self.opt = optimizer
        self.grad_scaler = scaler
        self.clip_kwargs = dict(clip_kwargs or {"max_norm": float("inf"), "norm_type": 2})
        self.probe = ClipProbe(torch.nn.utils.clip_grad_norm_, skip_nonfinite=scaler is None)
        self.iter = 0
        self.epoch = 0
        self.last_loss: Optional[float] = None
        self.log_fn = log_fn
        self.scalars: Dict[str, float] = {}
        self.config = config
        self.loader = loader
        self.schedulers = list(schedulers)
        self.writer = writer
        self.max_iters = max_iters
        self.forward = forward
        self.autocast = autocast if autocast is not None else contextlib.nullcontext

    def clip(self, params: Any) -> Any:
        """Clips (and observes) the gradients of ``params`` with the live clip arguments."""
        if self.clip_kwargs:
            return self.probe(params, **self.clip_kwargs)
        return self.probe(params, max_norm=float("inf"))

    def model(self) -> nn.Module:
        return self.net

    def optimizers(self) -> List[Any]:
        return [self.opt]

    def install_probes(self, skip_nonfinite_fp32: bool) -> None:
        self.probe.skip_nonfinite = skip_nonfinite_fp32 and self.grad_scaler is None

    def read_step(self) -> StepReading:
        stepped, norm, skipped = self.probe.read()
        return StepReading(stepped, norm, skipped, self.last_loss)

    def scale_mode(self) -> str:
        return "none" if self.grad_scaler is None else "dynamic"

    def loss_scale(self) -> Optional[float]:
        return None if self.grad_scaler is None else float(self.grad_scaler.get_scale())

    def clip_settings(self) -> List[ClipSetting]:
        return [ClipSetting("clip.max_norm", self.clip_kwargs)]

    def capture(self) -> Dict[str, Any]:
        state = {"state_dict": self.net.state_dict(), "optimizer": self.opt.state_dict()}
        if self.grad_scaler is not None:
            state["scaler"] = self.grad_scaler.state_dict()
        return state

    def restore(self, payload: Payload) -> None:
        state = payload.state
        self.net.load_state_dict(state["state_dict"], strict=payload.strict)
        load_optimizer_state(self.opt, state["optimizer"])
        self.net.zero_grad()  # a loop accumulating gradients: a partial window belongs to the abandoned path
        if self.grad_scaler is not None and "scaler" in state:
            self.grad_scaler.load_state_dict(copy.deepcopy(state["scaler"]))

    def counter(self) -> Tuple[int, int]:
        return self.iter, self.epoch

    def set_counter(self, value: int) -> None:
        self.iter = value

    def verdict_due_now(self) -> bool:
        return self.max_iters is not None and self.iter + 1 >= self.max_iters

    def train_loader(self) -> Any:
        return self.loader

    def rerun_forward(self, batch: Any) -> Optional[Callable[[], Any]]:
        if self.forward is None or batch is None:
            return None
        model, forward, autocast = self.net, self.forward, self.autocast

        def run() -> Any:
            # The loop's forward on the unwrapped model, in the training precision (the replay's contract).
            with autocast():
                return forward(model, batch)

        return run

    def lr_schedulers(self) -> List[Any]:
        return self.schedulers

    def run_config(self) -> Optional[RunConfig]:
        return None if self.config is None else RunConfig(self.config)

    def log(self, msg: str, level: str = "info") -> None:
        self.log_fn(f"[{level}] {msg}")

    def update_scalars(self, scalars: Dict[str, float], iterations_lost: int = 0) -> None:
        self.scalars.update(scalars)
        if self.writer is not None:  # published inside an iteration: iter + 1 completed
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, self.iter + 1 + iterations_lost)

    def add_text(self, tag: str, text: str, step: int) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)
