"""Where an MMEngine runner (plain MMEngine and mmdet3d 1.x scopes) keeps what the guard reads and changes."""
import copy
import logging
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from mmengine.hooks import EMAHook
from mmengine.logging import MMLogger
from mmengine.model import is_model_wrapper
from mmengine.optim import OptimWrapperDict
from mmengine.runner import IterBasedTrainLoop

from ...core.flags import HAS_SAFE_GLOBALS, WEIGHTS_ONLY_IS_DEFAULT
from ...core.port import ClipSetting, GuardIO, Payload, RunConfig, StepReading
from ...core.recovery.snapshot import load_optimizer_state
from ...core.remedies import Change
from ...core.safe_load import resolve_globals
from ...core.watch.probe import ClipProbe, observing_clip
from .checkpoint_role import CheckpointRole
from .checkpoints import MMENGINE_CHECKPOINT_GLOBALS
from .dashboards import StepsRun, abandoned_values, add_text, publish_latest
from .private import inner_count, set_inner_count, set_log_scalars, set_loop_iter

__all__ = ["MMEngineIO", "allow_mmengine_resume"]


_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class MMEngineIO(CheckpointRole, GuardIO):
    """Where an MMEngine runner keeps what the guard reads and changes."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.work_dir = runner.work_dir
        self.probes: List[ClipProbe] = []
        #: A CheckpointHook saves after this iteration (set by the hook, read as health_check_due).
        self.save_due = False
        self._held_save_begin: List[Tuple[Any, int]] = []
        #: The visualizer's steps on the iteration axis: the iterations run (the hook says when they are).
        self.steps = StepsRun(runner)
        self.log("NanGuard: the visualizer's steps on the iteration axis count the iterations run, so that a rollback "
                 "never sends them back (the text log keeps the runner's iteration numbers)")
        self._abandoned: Dict[str, float] = {}
        self._text_failed = False

    # -- objects
    def _wrappers(self) -> List[Tuple[str, Any]]:
        ow = self.runner.optim_wrapper
        if isinstance(ow, OptimWrapperDict):
            return [(f"optim_wrapper.{k}", w) for k, w in ow.items()]
        return [("optim_wrapper", ow)]

    def model(self) -> torch.nn.Module:
        model = self.runner.model
        return model.module if is_model_wrapper(model) else model

    def optimizers(self) -> List[Any]:
        return [w.optimizer for _, w in self._wrappers()]

    def install_probes(self, skip_nonfinite_fp32: bool) -> None:
        """Makes every optimizer step visible: an observing clip where none is configured, then the probe."""
        self.probes = []
        for name, w in self._wrappers():
            observing = not getattr(w, "clip_grad_kwargs", None)
            if observing:
                w.clip_grad_kwargs = observing_clip()
                w.clip_func = torch.nn.utils.clip_grad_norm_
                w.grad_name = "grad_norm"
                self.log(f"NanGuard: {name} had no clip_grad; installed an observing clip (max_norm=inf) "
                         "so that the guard reads grad_norm (the log shows none, as without the guard)")
            if not isinstance(w.clip_func, ClipProbe):
                amp = hasattr(w, "loss_scaler")
                w.clip_func = ClipProbe(w.clip_func, skip_nonfinite=skip_nonfinite_fp32 and not amp, quiet=observing)
            self.probes.append(w.clip_func)

    # -- signals
    def read_step(self) -> StepReading:
        stepped, skipped, norms = False, False, []
        # With one optimizer, MMEngine already read this step's norm into the message hub: reuse that float
        # instead of reading the tensor from the device again.
        hub = self.runner.message_hub.log_scalars.get("train/grad_norm") if len(self.probes) == 1 else None
        for probe in self.probes:
            s, n, k = probe.read(hub.current() if hub is not None and probe.stepped else None)
            stepped, skipped = stepped or s, skipped or k
            if n is not None:
                norms.append(n)
        # One global norm over all optimizers; NaN and Inf propagate.
        norm = math.sqrt(sum(n * n for n in norms)) if norms else None
        scalars = self.runner.message_hub.log_scalars
        loss = float(scalars["train/loss"].current()) if "train/loss" in scalars else None
        return StepReading(stepped, norm, skipped, loss)

    def _amp(self) -> Optional[Any]:
        return next((w for _, w in self._wrappers() if hasattr(w, "loss_scaler")), None)

    def scale_mode(self) -> str:
        amp = self._amp()
        if amp is None:
            return "none"
        return "dynamic" if amp._scale_update_param is None else "static"

    def loss_scale(self) -> Optional[float]:
        amp = self._amp()
        return None if amp is None else float(amp.loss_scaler.get_scale())

    def clip_settings(self) -> List[ClipSetting]:
        return [ClipSetting(f"{name}.clip_grad.max_norm", w.clip_grad_kwargs) for name, w in self._wrappers()]

    def counter(self) -> Tuple[int, int]:
        return self.runner.iter, self.runner.epoch

    def set_counter(self, value: int) -> None:
        set_loop_iter(self.runner.train_loop, value)

    # -- diagnosis
    def rerun_forward(self, batch: Any) -> Optional[Callable[[], Any]]:
        if batch is None:
            return None
        model, data, wrapper = self.model(), batch, self._wrappers()[0][1]

        def forward() -> Any:
            # As BaseModel.train_step does, on the unwrapped model: a DDP forward on one rank alone would hang.
            with wrapper.optim_context(model):
                return model._run_forward(model.data_preprocessor(data, True), mode="loss")

        return forward

    # -- state
    def _schedulers(self) -> List[Any]:
        ps = self.runner.param_schedulers
        if ps is None:
            return []
        if isinstance(ps, dict):
            return [s for group in ps.values() for s in group]
        return list(ps)

    def _ema_hook(self) -> Optional[Any]:
        for hook in self.runner.hooks:
            if isinstance(hook, EMAHook) and getattr(hook, "ema_model", None) is not None:
                return hook
        return None

    def capture(self) -> Dict[str, Any]:
        payload = {
            "state_dict": self.model().state_dict(),
            "optimizer": self.runner.optim_wrapper.state_dict(),
            "param_schedulers": [s.state_dict() for s in self._schedulers()],
            "message_hub": {"log_scalars": self.runner.message_hub.log_scalars},
            "inner_count": [inner_count(w) for _, w in self._wrappers()],
        }
        ema = self._ema_hook()
        if ema is not None:  # the averaged weights go back with the model
            payload["ema_state_dict"] = ema.ema_model.state_dict()
        return payload

    def restore(self, payload: Payload) -> None:
        model, completed, state = self.model(), payload.iteration, payload.state
        model.load_state_dict(state["state_dict"], strict=payload.strict)
        self._load_optim(state["optimizer"])
        # Epoch-based schedulers follow the epoch, which a rollback never rewinds.
        for sched, sched_state in zip(self._schedulers(), state.get("param_schedulers", [])):
            if not getattr(sched, "by_epoch", False):
                sched.load_state_dict(copy.deepcopy(sched_state))
        ema = self._ema_hook()
        if ema is not None and "ema_state_dict" in state:
            ema.ema_model.load_state_dict(state["ema_state_dict"], strict=False)
        hub = state.get("message_hub", {})
        if "log_scalars" in hub:
            # The abandoned iterations' values leave the next line's means with them; the guard's line shows them.
            self._abandoned = abandoned_values(self.runner.message_hub.log_scalars, hub["log_scalars"])
            set_log_scalars(self.runner.message_hub, copy.deepcopy(hub["log_scalars"]))
        # Gradient accumulation: the restored iteration's window, with nothing of the abandoned path's partial one.
        # A snapshot is a stepped iteration's state (its window closed: zero gradients, the count it had); a checkpoint
        # file or a resumed start inside a window restarts it from zero gradients at the count of its finished
        # iterations, as MMEngine's own resume from that state does, so windows keep their boundaries.
        counts = state.get("inner_count")
        for i, (_, w) in enumerate(self._wrappers()):
            w.zero_grad()
            set_inner_count(w, counts[i] if counts is not None else completed)
        model.zero_grad()  # parameters outside every optimizer too

    def _load_optim(self, state: Dict[str, Any]) -> None:
        # OptimWrapper.load_state_dict would alias CPU tensors of the snapshot and pops its 'loss_scaler' key.
        ow = self.runner.optim_wrapper
        states = state if isinstance(ow, OptimWrapperDict) else {None: state}
        for key, w_state in states.items():
            w = ow if key is None else ow[key]
            w_state = dict(w_state)
            scaler_state = w_state.pop("loss_scaler", None)
            load_optimizer_state(w.optimizer, w_state)
            if scaler_state is not None and hasattr(w, "loss_scaler"):
                w.loss_scaler.load_state_dict(copy.deepcopy(scaler_state))

    def make_scale_dynamic(self) -> Optional[Change]:
        for name, w in self._wrappers():
            if hasattr(w, "loss_scaler") and w._scale_update_param is not None:
                old = w._scale_update_param
                w._scale_update_param = None
                return Change(f"{name}.loss_scale", old, "dynamic")
        return None

    def restore_scale_mode(self) -> None:
        for _, w in self._wrappers():
            if hasattr(w, "loss_scaler"):
                w._scale_update_param = None

    def health_check_due(self) -> bool:
        return self.save_due

    def verdict_due_now(self) -> bool:
        # issue 35: a save follows (the hook's save_due, every rank alike), or a validation of this state (an
        # iteration-based loop validates right after the iteration; an epoch-based one after the epoch, where the
        # driver has acted on the last verdict).
        return self.save_due or self._validation_follows()

    def _validation_follows(self) -> bool:
        loop = self.runner.train_loop
        if not isinstance(loop, IterBasedTrainLoop) or self.runner.val_loop is None:
            return False
        done = self.runner.iter + 1
        return done >= loop.val_begin and (done % loop.val_interval == 0 or done == loop.max_iters)

    def train_loader(self) -> Any:
        loop = getattr(self.runner, "_train_loop", None)
        loader = getattr(loop, "dataloader", None) if loop is not None and not isinstance(loop, dict) else None
        return loader

    def live_loader_iterator(self) -> Any:
        loop = getattr(self.runner, "_train_loop", None)
        # IterBasedTrainLoop makes its iterator with the loop (_InfiniteDataloaderIterator._iterator).
        return getattr(getattr(loop, "dataloader_iterator", None), "_iterator", None)

    def lr_schedulers(self) -> List[Any]:
        return [s for s in self._schedulers() if getattr(s, "param_name", "lr") == "lr"]

    def restored_lr_schedulers(self) -> List[Any]:
        return [s for s in self.lr_schedulers() if not getattr(s, "by_epoch", False)]

    def after_recovery(self, state: Dict[str, Any], inside: bool) -> None:
        if self._abandoned:
            shown = ", ".join(f"{k}: {v:.4f}" for k, v in self._abandoned.items())
            self.log("NanGuard: the values the rolled-back iterations logged are kept out of the next log line's "
                     f"means; the last of them: {shown}", "warning")
            self._abandoned = {}
        self.hold_checkpoint_hooks()

    def run_config(self) -> Optional[RunConfig]:
        cfg = getattr(self.runner, "cfg", None)
        return RunConfig(cfg, getattr(cfg, "filename", None)) if cfg else None  # a Runner built without a config

    # -- output
    def log(self, msg: str, level: str = "info") -> None:
        # stacklevel: the log line names the guard's function that wrote it, not this method.
        MMLogger.get_current_instance().log(_LEVELS.get(level, logging.INFO), msg, stacklevel=2)

    def update_scalars(self, scalars: Dict[str, float], iterations_lost: int = 0) -> None:
        self.steps.lost = iterations_lost
        publish_latest(self.runner.message_hub, scalars)

    def add_text(self, tag: str, text: str, step: int) -> None:
        failure = add_text(self.runner.visualizer, tag, text, step)
        if failure and not self._text_failed:
            self.log(f"NanGuard: could not write an incident to the vis backend {failure}", "warning")
        self._text_failed = self._text_failed or bool(failure)


def allow_mmengine_resume(log: Callable[..., None]) -> None:
    """Lets MMEngine 0.10's own ``resume`` / ``load_from`` read its checkpoints under torch >= 2.6.

    torch >= 2.6 loads with ``weights_only=True``, which refuses the ``HistoryBuffer`` and numpy objects MMEngine
    pickles; exactly those types are added to torch's allowlist (process-wide, as ``torch.load`` offers no other
    way to reach MMEngine's call), and one line says so.
    """
    if WEIGHTS_ONLY_IS_DEFAULT and HAS_SAFE_GLOBALS:
        types = resolve_globals(MMENGINE_CHECKPOINT_GLOBALS)
        torch.serialization.add_safe_globals(types)
        log(f"NanGuard: this run loads a checkpoint under torch >= 2.6 (weights_only=True); allowed the {len(types)} "
            "types MMEngine checkpoints pickle (HistoryBuffer, numpy arrays) so that MMEngine can read them")
