"""NanGuardHook for MMCV 1.x runners (mmdet / mmdet3d 0.x: the original PETR and StreamPETR stack).

Lifecycle points used: ``before_run`` (build the guard, load its state from ``runner.meta``, install the clip
probe, re-apply resumed remedies), ``before_train_iter`` (mark the iteration in ``runner.meta`` so that a saved
checkpoint says where it was written), ``after_train_iter`` (detect, snapshot, recover, repair checkpoints),
``after_train_epoch`` (one cross-rank health check per epoch, after the epoch's checkpoint).

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
"""
import glob
import logging
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from mmcv.parallel import is_module_wrapper
from mmcv.runner import CheckpointHook, Hook, IterBasedRunner, OptimizerHook
from mmcv.runner import save_checkpoint as mmcv_save_checkpoint

from ..core.diagnose import capture_rng
from ..core.distributed import get_rank
from ..core.errors import NanGuardError
from ..core.guard import GuardConfig, GuardIO, NanGuard
from ..core.health import all_finite, iter_tensors, state_finite
from ..core.remedies import Change, ClipProbe, observing_clip
from ..core.safe_load import safe_load
from ..core.snapshot import copy_to_host

__all__ = ["NanGuardHook", "MMCV1IO", "STATE_KEY"]

_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
#: Key of the hook's state in ``runner.meta`` (saved in every checkpoint, as ``runner.meta['fp16']`` is).
STATE_KEY = "nan_guard"
#: Iteration counter at ``before_train_iter``, kept in the state so that a checkpoint tells an in-iteration
#: save (``meta['iter']`` is that iteration's 0-based counter) from an epoch-end save (already incremented).
_ITER_MARK = "iter_open"


class MMCV1IO(GuardIO):
    """Where an MMCV 1.x runner keeps what the guard reads and changes."""

    def __init__(self, runner: Any, skip_nonfinite_fp32: bool = True) -> None:
        self.runner = runner
        self.skip_nonfinite_fp32 = skip_nonfinite_fp32
        self.opt_hook: Optional[Any] = next((h for h in runner.hooks if isinstance(h, OptimizerHook)), None)
        self.ckpt_hooks = [h for h in runner.hooks if isinstance(h, CheckpointHook)]
        self.work_dir = runner.work_dir
        self.probe: Optional[ClipProbe] = None
        #: Added to a restored counter: 1 when restoring after the loop's own ``_iter += 1`` (epoch end).
        self.restore_offset = 0
        self.rng: Optional[Dict[str, Any]] = None
        #: Checkpoint files written (rank 0) from a non-finite state and not yet repaired.
        self.poisoned_saves: List[str] = []
        self._suspended_keep: List[Tuple[Any, int]] = []
        self._logged_norms = 0

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

    def install_probe(self) -> None:
        """Makes every optimizer step visible: an observing clip where none is configured, then the probe."""
        hook = self.opt_hook
        if hook is None:
            self.log("NanGuard: no OptimizerHook registered; the guard sees no optimizer step", "warning")
            return
        if not hook.grad_clip:
            hook.grad_clip = observing_clip()
            self.log("NanGuard: optimizer_config had no grad_clip; installed an observing clip (max_norm=inf) "
                     "so that grad_norm is computed")
        if not isinstance(hook.clip_grads, ClipProbe):
            hook.clip_grads = ClipProbe(hook.clip_grads, skip_nonfinite=self.skip_nonfinite_fp32 and not self._fp16())
        self.probe = hook.clip_grads

    # -- signals
    def _norm_history(self) -> List[float]:
        return self.runner.log_buffer.val_history.get("grad_norm") or []

    def mark_iter_start(self) -> None:
        """Called as each iteration starts, to know whether the OptimizerHook logs a grad_norm during it."""
        self._logged_norms = len(self._norm_history())

    def read_step(self) -> Tuple[bool, Optional[float], bool]:
        if self.probe is None:
            return False, None, False
        # The OptimizerHook logs float(grad_norm) right after the clip: when exactly one norm was logged during
        # this iteration, it is this step's, and reusing it saves a second device read on CUDA.
        history = self._norm_history()
        logged = history[-1] if len(history) == self._logged_norms + 1 else None
        return self.probe.read(logged if self.probe.stepped else None)

    def loss(self) -> Optional[float]:
        outputs = getattr(self.runner, "outputs", None) or {}
        log_vars = outputs.get("log_vars") or {}
        if "loss" in log_vars:
            return float(log_vars["loss"])
        history = self.runner.log_buffer.val_history.get("loss")
        return float(history[-1]) if history else None

    def scaler(self) -> Tuple[Any, str]:
        if self._fp16():
            return self.opt_hook.loss_scaler, "dynamic" if self.opt_hook._scale_update_param is None else "static"
        return None, "none"

    def clip_settings(self) -> List[Tuple[str, Dict[str, Any]]]:
        if self.opt_hook is None or not self.opt_hook.grad_clip:
            return []
        return [("optimizer_config.grad_clip.max_norm", self.opt_hook.grad_clip)]

    def counters(self) -> Tuple[int, int]:
        return self.runner.iter, self.runner.epoch

    # -- state
    def _optim_state(self) -> Dict[str, Any]:
        return {k: o.state_dict() for k, o in self._optimizers().items()}

    def capture(self) -> Dict[str, Any]:
        payload = {
            "meta": {"iter": self.runner.iter, "epoch": self.runner.epoch},
            "state_dict": self.model().state_dict(),
            "optimizer": self._optim_state(),
        }
        if self._fp16():
            payload["fp16"] = {"loss_scaler": self.opt_hook.loss_scaler.state_dict()}
        return payload

    def restore(self, payload: Dict[str, Any]) -> None:
        model = self.model()
        model.load_state_dict(payload["state_dict"], strict=not payload["meta"].get("from_disk", False))
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
        self.runner._iter = int(payload["meta"]["iter"]) + self.restore_offset

    # -- diagnosis
    def rerun_forward(self) -> Optional[Callable[[], Any]]:
        data = getattr(self.runner, "data_batch", None)  # MMCV keeps it until after after_train_iter
        if data is None:
            return None
        wrapper, model = self.runner.model, self.model()

        def forward() -> Any:
            batch = data
            if is_module_wrapper(wrapper) and hasattr(wrapper, "scatter"):
                # As MMDataParallel.train_step does, then the unwrapped module: a DDP forward on one rank hangs.
                inputs, _ = wrapper.scatter((data,), {}, getattr(wrapper, "device_ids", None) or [-1])
                batch = inputs[0][0]
            # Not train_step: mmdet's _parse_losses all-reduces its log values. auto_fp16 sits in the model.
            return model(**batch)

        return forward

    def rerun_rng_state(self) -> Optional[Dict[str, Any]]:
        return self.rng

    def checkpoint_candidates(self) -> List[str]:
        dirs = {self.work_dir} | {h.out_dir for h in self.ckpt_hooks if getattr(h, "out_dir", None)}
        paths = [p for d in dirs if d for p in glob.glob(os.path.join(d, "*.pth")) if not os.path.islink(p)]
        return sorted(set(paths), key=os.path.getmtime, reverse=True)

    def load_payload(self, path: str) -> Dict[str, Any]:
        # MMCV 1.x meta holds only builtins (strings, numbers, dicts, lists, tuples): no extra globals.
        ckpt = safe_load(path, extra_globals=())
        meta = ckpt.get("meta", {})
        ckpt["meta"] = {"iter": completed_iters(meta, self.runner) - 1, "epoch": int(meta.get("epoch", 0)),
                        "from_disk": True}
        optimizer = ckpt.get("optimizer", {})
        ckpt["optimizer"] = {"": optimizer} if "param_groups" in optimizer else optimizer
        ckpt["fp16"] = meta.get("fp16", {})
        return ckpt

    def make_scale_dynamic(self) -> Optional[Change]:
        if self._fp16() and self.opt_hook._scale_update_param is not None:
            old = self.opt_hook._scale_update_param
            self.opt_hook._scale_update_param = None
            return Change("optimizer_config.loss_scale", old, "dynamic")
        return None

    def restore_scale_mode(self, dynamic: bool) -> None:
        if dynamic and self._fp16():
            self.opt_hook._scale_update_param = None

    # -- checkpoints written by CheckpointHook (rank 0 only: its _save_checkpoint is master_only)
    def health_check_due(self) -> bool:
        return bool(self.poisoned_saves)

    def watch_saves(self) -> None:
        """Wraps ``runner.save_checkpoint`` to notice a save of a non-finite state as it is written."""
        save = self.runner.save_checkpoint
        if getattr(save, "_nan_guard", False):
            return

        def checked_save(out_dir: str, *args: Any, **kwargs: Any) -> Any:
            finite = state_finite(self.model(), self.optimizers())
            before = set(glob.glob(os.path.join(out_dir, "*.pth")))
            result = save(out_dir, *args, **kwargs)
            if not finite:
                written = sorted(p for p in set(glob.glob(os.path.join(out_dir, "*.pth"))) - before
                                 if not os.path.islink(p)) or self._newest(out_dir)
                self.poisoned_saves.extend(p for p in written if p not in self.poisoned_saves)
                # CheckpointHook deletes older files right after this returns: not while the newest is poisoned.
                for hook in self.ckpt_hooks:
                    if hook.max_keep_ckpts > 0:
                        self._suspended_keep.append((hook, hook.max_keep_ckpts))
                        hook.max_keep_ckpts = -1
                self.log(f"NanGuard: checkpoint {written} was saved from a non-finite state; older checkpoints "
                         "are kept and it will be rewritten from the restored state", "warning")
            return result

        checked_save._nan_guard = True  # type: ignore[attr-defined]
        self.runner.save_checkpoint = checked_save

    @staticmethod
    def _newest(out_dir: str) -> List[str]:
        files = [p for p in glob.glob(os.path.join(out_dir, "*.pth")) if not os.path.islink(p)]
        return [max(files, key=os.path.getmtime)] if files else []

    def resume_keep(self) -> None:
        """Gives ``max_keep_ckpts`` back to the checkpoint hooks after a suspended deletion."""
        for hook, keep in self._suspended_keep:
            hook.max_keep_ckpts = keep
        self._suspended_keep = []

    def repair_saves(self, state: Dict[str, Any], at_epoch_end: bool) -> None:
        """Rewrites every poisoned checkpoint from the live (restored) state, atomically."""
        meta_base = dict(self.runner.meta or {})
        for path in self.poisoned_saves:
            meta = dict(meta_base)
            meta.update(epoch=self.runner.epoch + 1, iter=self.runner.iter)
            meta[STATE_KEY] = dict(state, **{_ITER_MARK: self.runner.iter - (1 if at_epoch_end else 0)})
            tmp = path + ".nan_guard.tmp"
            optimizer = self.runner.optimizer
            mmcv_save_checkpoint(self.model(), tmp, optimizer=optimizer, meta=meta)
            os.replace(tmp, path)
            self.log(f"NanGuard: rewrote {path} from the restored state (iter {self.runner.iter})", "warning")
        self.poisoned_saves = []

    def quarantine_saves(self) -> None:
        """On giving up: renames poisoned files and points ``latest.pth`` / ``last_ckpt`` at a finite one."""
        if get_rank() != 0:
            return  # rank 0 wrote the checkpoints; the others must not race it on the links (shared FS)
        for path in self.poisoned_saves:
            if os.path.exists(path):
                os.replace(path, path + ".nonfinite")
                self.log(f"NanGuard: {path} holds a non-finite state; renamed to {path}.nonfinite", "error")
        self.poisoned_saves = []
        good = None
        for path in self.checkpoint_candidates():
            try:
                if all_finite(iter_tensors(safe_load(path, extra_globals=()))):
                    good = path
                    break
            except Exception:  # a foreign or truncated file is simply not a candidate
                continue
        for hook in self.ckpt_hooks:
            link = os.path.join(hook.out_dir or self.work_dir, "latest.pth")
            if os.path.islink(link) or os.path.exists(link):
                os.remove(link)
            if good is not None and os.path.dirname(good) == os.path.dirname(link):
                os.symlink(os.path.basename(good), link)
        hook_msgs = (self.runner.meta or {}).get("hook_msgs", {})
        if good is not None:
            hook_msgs["last_ckpt"] = good
        else:
            hook_msgs.pop("last_ckpt", None)

    # -- output
    def log(self, msg: str, level: str = "info") -> None:
        self.runner.logger.log(_LEVELS.get(level, logging.INFO), msg)

    def update_scalars(self, scalars: Dict[str, float]) -> None:
        self.runner.log_buffer.update(dict(scalars))


def completed_iters(meta: Dict[str, Any], runner: Any) -> int:
    """Iterations completed when an MMCV 1.x checkpoint was written.

    ``meta['iter']`` is the runner's counter at the save: the iteration's own 0-based counter for a save in
    ``after_train_iter`` (``IterBasedRunner``, or ``by_epoch=False``), the completed count for a save in
    ``after_train_epoch``. The guard's mark in ``meta['nan_guard']`` tells them apart; without it the runner
    type decides.
    """
    it = int(meta.get("iter", 0))
    mark = (meta.get(STATE_KEY) or {}).get(_ITER_MARK)
    if mark is not None:
        return it + 1 if int(mark) == it else it
    return it + 1 if isinstance(runner, IterBasedRunner) else it


class NanGuardHook(Hook):
    """Keeps fp16/fp32 training alive through NaN/Inf divergence: detects, remedies, rolls back, continues.

    Arguments are those of :class:`~petr_stability.core.guard.GuardConfig`, every one validated when the hook
    is built. Register it as mmdet / mmdet3d 0.x do: ``custom_hooks = [dict(type='NanGuardHook')]``
    (priority NORMAL, the default; MMCV 1.x sets ``priority`` itself, so the class defines none).
    """

    def __init__(self, **kwargs: Any) -> None:
        self.config = GuardConfig(**kwargs)
        self.io: Optional[MMCV1IO] = None
        self.guard: Optional[NanGuard] = None

    def _store(self, runner: Any) -> Dict[str, Any]:
        if runner.meta is None:
            runner.meta = {}
        state = self.guard.state_dict()
        state[_ITER_MARK] = runner.meta.get(STATE_KEY, {}).get(_ITER_MARK)
        runner.meta[STATE_KEY] = state
        return state

    def before_run(self, runner: Any) -> None:
        self.io = MMCV1IO(runner, self.config.skip_nonfinite_fp32)
        self.guard = NanGuard(self.config, self.io)
        state = (runner.meta or {}).get(STATE_KEY)
        if state is None and runner.iter > 0:
            state = self._state_of_resumed(runner)
        if state:
            self.guard.load_state_dict(state)
        self.io.install_probe()
        if get_rank() == 0:
            self.io.watch_saves()
        self.guard.setup()
        self._store(runner)

    def _state_of_resumed(self, runner: Any) -> Optional[Dict[str, Any]]:
        # IterBasedRunner.resume keeps its own runner.meta: find the checkpoint it resumed from by its counters.
        for path in self.io.checkpoint_candidates():
            try:
                meta = safe_load(path, extra_globals=()).get("meta", {})
            except Exception:  # a foreign or truncated file is simply not the one
                continue
            if int(meta.get("iter", -1)) == runner.iter and int(meta.get("epoch", -1)) == runner.epoch:
                scaler_state = (meta.get("fp16") or {}).get("loss_scaler")
                if scaler_state is not None and self.io._fp16():
                    self.io.opt_hook.loss_scaler.load_state_dict(scaler_state)
                    runner.meta.setdefault("fp16", {})["loss_scaler"] = scaler_state
                self.io.log(f"NanGuard: resumed guard state (and loss scale) from {path}, which "
                            "IterBasedRunner.resume does not copy into runner.meta")
                return meta.get(STATE_KEY)
        return None

    def before_train_iter(self, runner: Any) -> None:
        runner.meta[STATE_KEY][_ITER_MARK] = runner.iter
        self.io.mark_iter_start()
        if self.config.diagnose:
            self.io.rng = capture_rng()  # host copies: the dropout masks of a re-run match the failing step

    def after_train_iter(self, runner: Any) -> None:
        recoveries = self.guard.recoveries
        try:
            self.guard.after_iter()
        except NanGuardError:
            self.io.quarantine_saves()
            raise
        finally:
            self.io.rng = None
        state = self._store(runner)
        if self.guard.recoveries > recoveries and self.io.poisoned_saves:
            self.io.repair_saves(state, at_epoch_end=False)
        self.io.resume_keep()

    def after_train_epoch(self, runner: Any) -> None:
        # The epoch's checkpoint was written before this hook ran: one agreed health check per epoch.
        healthy = not self.io.poisoned_saves and state_finite(self.io.model(), self.io.optimizers())
        if not self.guard.all_ranks_healthy(healthy):
            self.io.restore_offset = 1  # the loop has already counted the epoch's last iteration
            try:
                self.guard.recover_now("non-finite state at the end of the epoch")
            except NanGuardError:
                self.io.quarantine_saves()
                raise
            finally:
                self.io.restore_offset = 0
            state = self._store(runner)
            if self.io.poisoned_saves:
                self.io.repair_saves(state, at_epoch_end=True)
        self._store(runner)
        self.io.resume_keep()
