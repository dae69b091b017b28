"""NanGuardHook for MMEngine runners (plain MMEngine and mmdet3d 1.x scopes).

Lifecycle points used: ``before_run`` (build the guard; allow MMEngine's own resume under torch >= 2.6),
``before_train`` (install the clip probe, re-apply resumed remedies), ``before_train_iter`` (keep the batch and
the RNG state for a diagnosis: a reference and a host copy), ``after_train_iter`` (detect, snapshot, diagnose,
recover), ``before_save_checkpoint`` / ``after_load_checkpoint`` (persist state; never save or load a
non-finite checkpoint).
"""
import copy
import glob
import logging
import math
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from mmengine.hooks import CheckpointHook, EMAHook, Hook
from mmengine.logging import print_log
from mmengine.model import is_model_wrapper
from mmengine.optim import OptimWrapperDict

from ..core.diagnose import capture_rng
from ..core.distributed import get_rank, is_distributed
from ..core.errors import UnsafeCheckpointError
from ..core.flags import HAS_SAFE_GLOBALS, WEIGHTS_ONLY_IS_DEFAULT
from ..core.guard import GuardConfig, GuardIO, NanGuard
from ..core.health import all_finite, iter_tensors
from ..core.remedies import Change, ClipProbe, observing_clip
from ..core.safe_load import MMENGINE_CHECKPOINT_GLOBALS, resolve_globals, safe_load
from ..core.snapshot import copy_to_host, load_optimizer_state
from .common import write_config_fix

__all__ = ["NanGuardHook", "MMEngineIO"]

_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
STATE_KEY = "nan_guard"


class MMEngineIO(GuardIO):
    """Where an MMEngine runner keeps what the guard reads and changes."""

    def __init__(self, runner: Any, skip_nonfinite_fp32: bool = True, write_patched_config: bool = True) -> None:
        self.runner = runner
        self.work_dir = runner.work_dir
        self.skip_nonfinite_fp32 = skip_nonfinite_fp32
        self.write_patched_config = write_patched_config
        self.probes: List[ClipProbe] = []
        self.save_due = False
        self._batch: Any = None
        self._rng: Optional[Dict[str, Any]] = None

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

    def install_probes(self) -> None:
        """Makes every optimizer step visible: an observing clip where none is configured, then the probe."""
        self.probes = []
        for name, w in self._wrappers():
            if not getattr(w, "clip_grad_kwargs", None):
                w.clip_grad_kwargs = observing_clip()
                w.clip_func = torch.nn.utils.clip_grad_norm_
                w.grad_name = "grad_norm"
                self.log(f"NanGuard: {name} had no clip_grad; installed an observing clip (max_norm=inf) "
                         "so that grad_norm is computed")
            if not isinstance(w.clip_func, ClipProbe):
                amp = hasattr(w, "loss_scaler")
                w.clip_func = ClipProbe(w.clip_func, skip_nonfinite=self.skip_nonfinite_fp32 and not amp)
            self.probes.append(w.clip_func)

    # -- signals
    def read_step(self) -> Tuple[bool, Optional[float], bool]:
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
        return stepped, norm, skipped

    def loss(self) -> Optional[float]:
        scalars = self.runner.message_hub.log_scalars
        return float(scalars["train/loss"].current()) if "train/loss" in scalars else None

    def scaler(self) -> Tuple[Any, str]:
        for _, w in self._wrappers():
            if hasattr(w, "loss_scaler"):
                return w.loss_scaler, "dynamic" if w._scale_update_param is None else "static"
        return None, "none"

    def clip_settings(self) -> List[Tuple[str, Dict[str, Any]]]:
        return [(f"{name}.clip_grad.max_norm", w.clip_grad_kwargs) for name, w in self._wrappers()]

    def counters(self) -> Tuple[int, int]:
        return self.runner.iter, self.runner.epoch

    # -- diagnosis
    def keep_batch(self, data_batch: Any) -> None:
        """Keeps this iteration's batch (a reference) and the RNG state before its forward (a host copy)."""
        self._batch, self._rng = data_batch, capture_rng()

    def release_batch(self) -> None:
        self._batch = self._rng = None

    def rerun_forward(self) -> Optional[Callable[[], Any]]:
        if self._batch is None:
            return None
        model, data, wrapper = self.model(), self._batch, self._wrappers()[0][1]

        def forward() -> Any:
            # As BaseModel.train_step does, on the unwrapped model: a DDP forward on one rank alone would hang.
            with wrapper.optim_context(model):
                return model._run_forward(model.data_preprocessor(data, True), mode="loss")

        return forward

    def rerun_rng_state(self) -> Optional[Dict[str, Any]]:
        return self._rng

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
            "meta": {"iter": self.runner.iter, "epoch": self.runner.epoch},
            "state_dict": self.model().state_dict(),
            "optimizer": self.runner.optim_wrapper.state_dict(),
            "param_schedulers": [s.state_dict() for s in self._schedulers()],
            "message_hub": {"log_scalars": self.runner.message_hub.log_scalars},
            "inner_count": [w._inner_count for _, w in self._wrappers()],
        }
        ema = self._ema_hook()
        if ema is not None:  # the averaged weights go back with the model
            payload["ema_state_dict"] = ema.ema_model.state_dict()
        return payload

    def restore(self, payload: Dict[str, Any]) -> None:
        model = self.model()
        model.load_state_dict(payload["state_dict"], strict=not payload["meta"].get("from_disk", False))
        self._load_optim(payload["optimizer"])
        # Epoch-based schedulers follow the epoch, which a rollback never rewinds.
        for sched, state in zip(self._schedulers(), payload.get("param_schedulers", [])):
            if not getattr(sched, "by_epoch", False):
                sched.load_state_dict(copy.deepcopy(state))
        ema = self._ema_hook()
        if ema is not None and "ema_state_dict" in payload:
            ema.ema_model.load_state_dict(payload["ema_state_dict"], strict=False)
        hub = payload.get("message_hub", {})
        if "log_scalars" in hub:
            self.runner.message_hub._log_scalars = copy.deepcopy(hub["log_scalars"])
        loop = self.runner.train_loop
        loop._iter = int(payload["meta"]["iter"])
        counts = payload.get("inner_count")
        for i, (_, w) in enumerate(self._wrappers()):
            if counts is not None:
                w._inner_count = counts[i]
            else:
                w.initialize_count_status(model, loop._iter + 1, loop.max_iters)

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

    def fill_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        """Rewrites a checkpoint being saved from the live (just restored) state."""
        checkpoint["state_dict"] = copy_to_host(self.model().state_dict())
        if "optimizer" in checkpoint:
            checkpoint["optimizer"] = copy_to_host(self.runner.optim_wrapper.state_dict())
        if "param_schedulers" in checkpoint and isinstance(checkpoint["param_schedulers"], list):
            checkpoint["param_schedulers"] = [copy.deepcopy(s.state_dict()) for s in self._schedulers()]
        checkpoint["message_hub"] = copy.deepcopy(self.runner.message_hub.state_dict())
        ema = self._ema_hook()
        if ema is not None and "ema_state_dict" in checkpoint:  # EMAHook already swapped this dict: redo it
            checkpoint["ema_state_dict"] = copy_to_host(ema.ema_model.state_dict())
            ema._swap_ema_state_dict(checkpoint)
        checkpoint["meta"]["iter"] = self.runner.iter + 1

    def checkpoint_candidates(self) -> List[str]:
        paths = sorted(glob.glob(os.path.join(self.work_dir, "*.pth")), key=os.path.getmtime, reverse=True)
        return paths

    def load_payload(self, path: str) -> Dict[str, Any]:
        ckpt = safe_load(path)
        if "ema_state_dict" in ckpt and self._ema_hook() is not None:
            # EMAHook saves the averaged weights as 'state_dict' (for deployment): swap them back, as it does.
            self._ema_hook()._swap_ema_state_dict(ckpt)
        if isinstance(ckpt.get("param_schedulers"), dict):
            ckpt["param_schedulers"] = [s for group in ckpt["param_schedulers"].values() for s in group]
        meta = ckpt.get("meta", {})
        # A checkpoint's iter counts completed iterations; the guard restores at after_train_iter,
        # where the loop's own +1 follows.
        ckpt["meta"] = {"iter": int(meta.get("iter", 0)) - 1, "epoch": int(meta.get("epoch", 0)), "from_disk": True}
        ckpt.setdefault("param_schedulers", [])
        return ckpt

    def make_scale_dynamic(self) -> Optional[Change]:
        for name, w in self._wrappers():
            if hasattr(w, "loss_scaler") and w._scale_update_param is not None:
                old = w._scale_update_param
                w._scale_update_param = None
                return Change(f"{name}.loss_scale", old, "dynamic")
        return None

    def restore_scale_mode(self, dynamic: bool) -> None:
        if dynamic:
            for _, w in self._wrappers():
                if hasattr(w, "loss_scaler"):
                    w._scale_update_param = None

    def health_check_due(self) -> bool:
        return self.save_due

    def checkpoint_due(self, batch_idx: int) -> bool:
        """True when a CheckpointHook will save after this iteration (it runs later, on rank 0 only)."""
        runner = self.runner
        for hook in runner.hooks:
            if not isinstance(hook, CheckpointHook):
                continue
            if hook.by_epoch:
                if hook.end_of_epoch(runner.train_dataloader, batch_idx):
                    return True
            elif hook.every_n_train_iters(runner, hook.interval, hook.save_begin) or (
                    hook.save_last and hook.is_last_train_iter(runner)):
                return True
        return False

    def after_incident(self, record: Dict[str, Any]) -> None:
        if self.write_patched_config and get_rank() == 0:
            write_config_fix(self.runner.cfg, self.work_dir, self.clip_settings(), self.log)

    # -- output
    def log(self, msg: str, level: str = "info") -> None:
        print_log(msg, logger="current", level=_LEVELS.get(level, logging.INFO))

    def update_scalars(self, scalars: Dict[str, float]) -> None:
        for key, value in scalars.items():
            self.runner.message_hub.update_scalar(f"train/{key}", value)


class NanGuardHook(Hook):
    """Keeps fp16/fp32 training alive through NaN/Inf divergence: detects, remedies, rolls back, continues.

    Arguments are those of :class:`~petr_stability.core.guard.GuardConfig` (every one validated when the
    hook is built), plus:

    Args:
        allow_mmengine_resume: under torch >= 2.6, let MMEngine's own ``resume=True`` load its checkpoints by
            adding exactly the types they pickle to torch's safe-load allowlist (process-wide, logged).
            Defaults to True.
    """

    priority = "NORMAL"

    def __init__(self, allow_mmengine_resume: bool = True, **kwargs: Any) -> None:
        self.config = GuardConfig(**kwargs)
        if not isinstance(allow_mmengine_resume, bool):
            raise TypeError(f"allow_mmengine_resume must be a bool, got {allow_mmengine_resume!r}")
        self.allow_mmengine_resume = allow_mmengine_resume
        self.io: Optional[MMEngineIO] = None
        self.guard: Optional[NanGuard] = None

    def before_run(self, runner: Any) -> None:
        self.io = MMEngineIO(runner, self.config.skip_nonfinite_fp32, self.config.write_patched_config)
        self.guard = NanGuard(self.config, self.io)
        if self.allow_mmengine_resume and WEIGHTS_ONLY_IS_DEFAULT and HAS_SAFE_GLOBALS:
            types = resolve_globals(MMENGINE_CHECKPOINT_GLOBALS)
            torch.serialization.add_safe_globals(types)
            self.io.log(
                "NanGuard: torch >= 2.6 loads checkpoints with weights_only=True, which MMEngine 0.10.x cannot "
                f"resume from; allowed exactly these {len(types)} types process-wide: "
                + ", ".join(f"{t.__module__}.{t.__qualname__}" for t in types),
                "warning",
            )

    def before_train(self, runner: Any) -> None:
        self.io.install_probes()
        self.guard.setup()

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        if self.config.diagnose:
            self.io.keep_batch(data_batch)

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        # Runner.save_checkpoint (and so before_save_checkpoint) runs on rank 0 only, where no collective may
        # run: under DDP the state about to be saved is checked here instead, on every rank, and agreed.
        self.io.save_due = is_distributed() and self.io.checkpoint_due(batch_idx)
        self.guard.after_iter()
        self.io.release_batch()

    def before_save_checkpoint(self, runner: Any, checkpoint: Dict[str, Any]) -> None:
        if self.guard is None:
            return
        ok = all_finite(iter_tensors(checkpoint.get("state_dict", {}))) and all_finite(
            iter_tensors(checkpoint.get("optimizer", {})))
        if not ok and is_distributed():
            # Rank 0 alone cannot roll back (the others would not follow); after_train_iter checked this
            # state on every rank, so this is a save from outside the train loop: refuse it.
            raise UnsafeCheckpointError("NanGuard: refusing to save a checkpoint with non-finite values")
        if not ok:  # single process here: no other rank to agree with
            self.guard.recover_now("non-finite state found while saving a checkpoint")
            self.io.fill_checkpoint(checkpoint)
        checkpoint[STATE_KEY] = self.guard.state_dict()

    def after_load_checkpoint(self, runner: Any, checkpoint: Dict[str, Any]) -> None:
        try:
            self.guard.check_checkpoint(checkpoint, "the checkpoint being loaded")
        except UnsafeCheckpointError:
            self.io.log("NanGuard: refusing a non-finite checkpoint", "error")
            raise
        if getattr(runner, "_resume", False) and STATE_KEY in checkpoint:
            self.guard.load_state_dict(checkpoint[STATE_KEY])
