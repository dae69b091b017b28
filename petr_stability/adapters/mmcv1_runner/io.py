"""Where an MMCV 1.x runner (mmdet / mmdet3d 0.x: the original PETR and StreamPETR stack) keeps what the guard reads.

MMCV 1.x facts this adapter handles (``docs``: RUNNER-INTERNALS, "MMCV 1.x"):

- The optimizer step happens in ``OptimizerHook.after_train_iter`` (ABOVE_NORMAL), before this hook (NORMAL);
  ``CheckpointHook`` (NORMAL, registered first) also runs before it, so a checkpoint may hold the state of the
  iteration that went bad. Saves of a non-finite state are noticed as they happen (rank 0), keep
  ``max_keep_ckpts`` from deleting older files, force a health check, and are rewritten from the restored state
  after the recovery, so ``latest.pth`` and ``hook_msgs['last_ckpt']`` end up naming a finite file.
- ``EpochBasedRunner``: ``_epoch`` is never rewound and ``_inner_iter`` is left to the loop (it is the position
  in the epoch's data, reassigned from ``enumerate`` each iteration: data moves on, the epoch finishes its
  batches). ``_iter`` is rewound, so iteration-based LR (``LrUpdaterHook.before_train_iter``) follows the
  restored counter; the run ends after ``max_epochs`` with ``runner.iter`` short by the iterations lost.
- ``IterBasedRunner``: ``_iter`` is rewound, so the run still performs ``max_iters`` counted steps (on new data).
- A restore keeps the live optimizer hyperparameters (LR, momentum): MMCV has no scheduler state, the LR and
  momentum hooks derive them from the counters, and an epoch-based LR is only set at the epoch's start.
- ``GradientCumulativeOptimizerHook`` and its fp16 variant place their window by ``runner.iter`` (``every_n_iters``,
  ``is_last_iter``) and take ``divisible_iters`` / ``remainder_iters`` from ``max_iters``: the rewound ``_iter`` puts
  the run back on the restored iteration's window, and a restore zeroes what the abandoned path summed.
"""
import logging
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from mmcv.parallel import is_module_wrapper
from mmcv.runner import IterBasedRunner, OptimizerHook

from ...core.port import ClipSetting, GuardIO, Payload, RunConfig, StepReading
from ...core.recovery.snapshot import copy_to_host
from ...core.remedies import Change
from ...core.watch.probe import ClipProbe, observing_clip
from ..driver import STATE_KEY
from .checkpoint_role import ITER_MARK as _ITER_MARK
from .checkpoint_role import CheckpointRole, completed_iters
from .dashboards import LogView
from .saves import SaveWatch

__all__ = ["MMCV1IO", "completed_iters"]


_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class MMCV1IO(CheckpointRole, GuardIO):
    """Where an MMCV 1.x runner keeps what the guard reads and changes."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.opt_hook: Optional[Any] = next((h for h in runner.hooks if isinstance(h, OptimizerHook)), None)
        self.work_dir = runner.work_dir
        self.probe: Optional[ClipProbe] = None
        #: Checkpoint saves of a non-finite state, noticed as they happen and repaired after the recovery.
        self.saves = SaveWatch(self)
        self._logged_norms = 0
        #: The loggers: the guard's latest values, a rollback's values kept out of the means, steps, text.
        self.logs = LogView(runner)
        counted = self.logs.count_iterations_run()
        if counted:
            self.log(f"NanGuard: the steps of {', '.join(counted)} count the iterations run, so that a rollback never "
                     "sends them back (the text log keeps the runner's iteration numbers)")

    # -- objects
    def model(self) -> torch.nn.Module:
        model = self.runner.model
        return model.module if is_module_wrapper(model) else model

    def _optimizers(self) -> Dict[str, Any]:
        opt = self.runner.optimizer
        return dict(opt) if isinstance(opt, dict) else {"": opt}

    def optimizers(self) -> List[Any]:
        return list(self._optimizers().values())

    def _fp16(self) -> bool:
        return self.opt_hook is not None and hasattr(self.opt_hook, "loss_scaler") and hasattr(
            self.opt_hook, "_scale_update_param")

    def install_probes(self, skip_nonfinite_fp32: bool) -> None:
        """Makes every optimizer step visible: an observing clip where none is configured, then the probe."""
        hook = self.opt_hook
        if hook is None:
            self.log("NanGuard: no OptimizerHook registered; the guard sees no optimizer step", "warning")
            return
        observing = not hook.grad_clip
        if observing:
            hook.grad_clip = observing_clip()
            self.log("NanGuard: optimizer_config had no grad_clip; installed an observing clip (max_norm=inf) "
                     "so that the guard reads grad_norm (the log shows none, as without the guard)")
        if not isinstance(hook.clip_grads, ClipProbe):
            hook.clip_grads = ClipProbe(hook.clip_grads, skip_nonfinite=skip_nonfinite_fp32 and not self._fp16(),
                                        quiet=observing)
        self.probe = hook.clip_grads

    # -- signals
    def _norm_history(self) -> List[float]:
        return self.runner.log_buffer.val_history.get("grad_norm") or []

    def read_step(self) -> StepReading:
        if self.probe is None:
            return StepReading(False, loss=self._loss())
        # The OptimizerHook logs float(grad_norm) right after the clip: when exactly one norm was logged during
        # this iteration, it is this step's, and reusing it saves a second device read on CUDA.
        history = self._norm_history()
        logged = history[-1] if len(history) == self._logged_norms + 1 else None
        stepped, norm, skipped = self.probe.read(logged if self.probe.stepped else None)
        return StepReading(stepped, norm, skipped, self._loss())

    def _loss(self) -> Optional[float]:
        outputs = getattr(self.runner, "outputs", None) or {}
        log_vars = outputs.get("log_vars") or {}
        if "loss" in log_vars:
            return float(log_vars["loss"])
        history = self.runner.log_buffer.val_history.get("loss")
        return float(history[-1]) if history else None

    def scale_mode(self) -> str:
        if not self._fp16():
            return "none"
        return "dynamic" if self.opt_hook._scale_update_param is None else "static"

    def loss_scale(self) -> Optional[float]:
        if not self._fp16():
            return None
        scaler = self.opt_hook.loss_scaler
        get_scale = getattr(scaler, "get_scale", None)  # torch GradScaler; mmcv's own LossScaler has loss_scale
        return float(get_scale()) if get_scale is not None else float(scaler.loss_scale)

    def clip_settings(self) -> List[ClipSetting]:
        if self.opt_hook is None:
            return []
        return [ClipSetting("optimizer_config.grad_clip.max_norm", self.opt_hook.grad_clip or None)]

    def counter(self) -> Tuple[int, int]:
        return self.runner.iter, self.runner.epoch

    def set_counter(self, value: int) -> None:
        self.runner._iter = value

    # -- state
    def _optim_state(self) -> Dict[str, Any]:
        return {k: o.state_dict() for k, o in self._optimizers().items()}

    def capture(self) -> Dict[str, Any]:
        payload = {
            "state_dict": self.model().state_dict(),
            "optimizer": self._optim_state(),
            "log_window": self.logs.window(),
        }
        if self._fp16():
            payload["fp16"] = {"loss_scaler": self.opt_hook.loss_scaler.state_dict()}
        return payload

    def restore(self, payload: Payload) -> None:
        model, strict, payload = self.model(), payload.strict, payload.state
        model.load_state_dict(payload["state_dict"], strict=strict)
        self.logs.rewind(payload.get("log_window"))
        on_cpu = next(model.parameters()).device.type == "cpu"
        for key, opt in self._optimizers().items():
            state = payload["optimizer"].get(key) if key else payload["optimizer"].get("", payload["optimizer"])
            if state is None:
                continue
            # torch optimizers keep CPU tensors as given: copy, or later steps would write into the snapshot.
            state = copy_to_host(state) if on_cpu else state
            live = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            opt.load_state_dict(state)
            # LR and momentum come from the updater hooks and the counters, not from the snapshot.
            for group, hyper in zip(opt.param_groups, live):
                group.update(hyper)
            opt.zero_grad()
        model.zero_grad()  # a partly accumulated gradient belongs to the abandoned path
        scaler_state = (payload.get("fp16") or {}).get("loss_scaler")
        if self._fp16() and scaler_state is not None:
            # MMCV restores the scaler from runner.meta in before_run only.
            self.opt_hook.loss_scaler.load_state_dict(dict(scaler_state))
            self.runner.meta.setdefault("fp16", {})["loss_scaler"] = self.opt_hook.loss_scaler.state_dict()

    # -- diagnosis
    def rerun_forward(self, batch: Any) -> Optional[Callable[[], Any]]:
        if batch is None:
            return None
        wrapper, model, optimizer = self.runner.model, self.model(), self.runner.optimizer

        def forward() -> Any:
            inputs, kwargs = (batch, optimizer), {}
            if is_module_wrapper(wrapper) and hasattr(wrapper, "scatter"):
                # As MMDataParallel / MMDistributedDataParallel.train_step scatter, then the unwrapped module: a DDP
                # forward on one rank alone would wait for the others.
                scattered, scattered_kwargs = wrapper.scatter(inputs, kwargs,
                                                              getattr(wrapper, "device_ids", None) or [-1])
                inputs, kwargs = scattered[0], scattered_kwargs[0]
            if hasattr(model, "train_step"):
                # The model's own train_step, as the runner calls it (whatever it does with the batch: a dict for
                # mmdet's detectors, a list or its own unpacking elsewhere). The replay runs rank-local, so the
                # all-reduce in mmdet's _parse_losses reduces nothing.
                return model.train_step(*inputs, **kwargs)
            return model(**inputs[0])

        return forward

    def make_scale_dynamic(self) -> Optional[Change]:
        if self._fp16() and self.opt_hook._scale_update_param is not None:
            old = self.opt_hook._scale_update_param
            self.opt_hook._scale_update_param = None
            return Change("optimizer_config.loss_scale", old, "dynamic")
        return None

    def restore_scale_mode(self) -> None:
        if self._fp16():
            self.opt_hook._scale_update_param = None

    def verdict_due_now(self) -> bool:
        # issue 35: the end of training (no hook acts on a later verdict) and, in an EpochBasedRunner, of each epoch
        # (the epoch's CheckpointHook save and the guard's epoch check follow); the same on every rank.
        runner = self.runner
        if runner.iter + 1 >= runner.max_iters:
            return True
        loader = getattr(runner, "data_loader", None)
        return not isinstance(runner, IterBasedRunner) and loader is not None and runner.inner_iter + 1 >= len(loader)

    # -- checkpoints written by CheckpointHook (rank 0 only: its _save_checkpoint is master_only)
    def health_check_due(self) -> bool:
        return bool(self.saves.poisoned)

    def after_step(self) -> None:
        self.saves.release()

    def after_recovery(self, state: Dict[str, Any], inside: bool) -> None:
        """Rewrites every poisoned checkpoint from the live (restored) state, and keeps the timing hooks' arithmetic
        valid: ``TextLoggerHook`` divides by ``iter - start_iter + 1``, which a rollback to the run's start state
        (counter -1 until the loop's increment) would make 0."""
        for hook in self.runner.hooks:
            start = getattr(hook, "start_iter", None)
            if isinstance(start, int) and start > self.runner.iter:
                hook.start_iter = self.runner.iter
        at_epoch_end = not inside
        self.saves.rewrite(dict(state, **{_ITER_MARK: self.runner.iter - (1 if at_epoch_end else 0)}), at_epoch_end)
        self.logs.say_rewound(self.log)

    def before_give_up(self) -> None:
        self.saves.leave_finite()

    # -- output
    def mark_iter_start(self) -> None:
        """As each iteration starts: its counter into the stored state (a save tells an in-iteration save from an
        epoch-end one), and the grad_norm log's length (did the OptimizerHook log one during it)."""
        self.runner.meta[STATE_KEY][_ITER_MARK] = self.runner.iter
        self._logged_norms = len(self._norm_history())
        self.logs.mark()

    def train_loader(self) -> Any:
        # Set by the runner as training starts (EpochBasedRunner.train, IterBasedRunner.train: an IterLoader); before
        # that, the loader the runner's run() was given (_given_loader).
        loader = getattr(self.runner, "data_loader", None) or _given_loader(self.runner)
        return getattr(loader, "_dataloader", loader)

    def live_loader_iterator(self) -> Any:
        # IterBasedRunner's IterLoader made its iterator before the run started (IterLoader.iter_loader).
        return getattr(getattr(self.runner, "data_loader", None), "iter_loader", None)

    def lr_schedulers(self) -> List[Any]:
        return [h for h in self.runner.hooks if type(h).__name__.endswith("LrUpdaterHook")]

    def restores_lr(self) -> bool:
        return False  # restore keeps the live LR; the LR hooks recompute it from their (scaled) bases

    def run_config(self) -> Optional[RunConfig]:
        # mmdet / mmdet3d 0.x tools/train.py put the effective config (overrides merged) into runner.meta and
        # dump it into the work dir under the config's name: the next run can reach that file.
        meta = self.runner.meta or {}
        text = meta.get("config")
        if not text:
            return None
        dumped = os.path.join(self.work_dir, str(meta.get("exp_name", ""))) if meta.get("exp_name") else None
        return RunConfig(text, dumped if dumped and dumped.endswith(".py") else None)

    def log(self, msg: str, level: str = "info") -> None:
        # stacklevel: the log line names the guard's function that wrote it, not this method.
        self.runner.logger.log(_LEVELS.get(level, logging.INFO), msg, stacklevel=2)

    def update_scalars(self, scalars: Dict[str, float], iterations_lost: int = 0) -> None:
        self.logs.publish(scalars, iterations_lost)

    def add_text(self, tag: str, text: str, step: int) -> None:
        self.logs.add_text(tag, text, step, self.log)


def _given_loader(runner: Any) -> Any:
    """The training ``DataLoader`` ``runner.run(data_loaders, workflow)`` was given, read from its frame while its hooks
    run (``before_run``): MMCV 1.x's ``IterBasedRunner`` keeps it in that local until its first iteration has fetched a
    batch (it sets ``runner.data_loader`` only then, and its ``IterLoader`` makes the iterator, with any workers'
    prefetch, right after ``before_run``), so this is the one moment a quarantine carried from an earlier run can go in
    before the first batch. None outside ``run()`` or where the frame is not MMCV's."""
    frame = sys._getframe(1)
    while frame is not None:
        names = frame.f_locals
        if frame.f_code.co_name == "run" and names.get("self") is runner and "data_loaders" in names:
            flows = [mode for mode, _ in names.get("workflow") or []]
            loaders = names["data_loaders"]
            return loaders[flows.index("train")] if "train" in flows and len(loaders) == len(flows) else None
        frame = frame.f_back
    return None
