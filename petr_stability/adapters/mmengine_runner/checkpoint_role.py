"""The checkpoint role of :class:`~.io.MMEngineIO`: the run's checkpoint files, one read as a restore point, one being
saved after a restore rewritten from the live state, and the ``CheckpointHook`` held past a rollback to the start."""
import copy
import glob
import os
from typing import Any, Dict, List, Optional, Tuple

from mmengine.hooks import CheckpointHook

from ...core.port import Payload
from ...core.recovery.snapshot import copy_to_host
from ..driver import STATE_KEY
from .checkpoints import load_mmengine_checkpoint
from .private import swap_ema_state_dict

__all__ = ["CheckpointRole"]


class CheckpointRole:
    """What :class:`~.io.MMEngineIO` does with checkpoints (it keeps ``runner``, ``work_dir``, ``model()``,
    ``_schedulers()``, ``_ema_hook()`` and ``_held_save_begin``)."""

    runner: Any
    work_dir: Optional[str]
    _held_save_begin: List[Tuple[Any, int]]

    def fill_checkpoint(self, checkpoint: Dict[str, Any], completed: int) -> None:
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
            swap_ema_state_dict(ema, checkpoint)
        checkpoint["meta"]["iter"] = completed

    def checkpoint_files(self) -> List[str]:
        # CheckpointHook.before_train already joined out_dir with the work dir's name, as it writes there.
        dirs = {self.work_dir} | {h.out_dir for h in self.runner.hooks if isinstance(h, CheckpointHook) and h.out_dir}
        return sorted({p for d in dirs for p in glob.glob(os.path.join(d, "*.pth")) if not os.path.islink(p)})

    def read_checkpoint(self, path: str) -> Tuple[Payload, Optional[Dict[str, Any]]]:
        ckpt = load_mmengine_checkpoint(path)
        if "ema_state_dict" in ckpt and self._ema_hook() is not None:
            # EMAHook saves the averaged weights as 'state_dict' (for deployment): swap them back, as it does.
            swap_ema_state_dict(self._ema_hook(), ckpt)
        if isinstance(ckpt.get("param_schedulers"), dict):
            ckpt["param_schedulers"] = [s for group in ckpt["param_schedulers"].values() for s in group]
        meta = ckpt.get("meta", {})
        ckpt.setdefault("param_schedulers", [])
        # MMEngine's meta['iter'] counts completed iterations: the guard's numbering already.
        payload = Payload(ckpt, int(meta.get("iter", 0)), int(meta.get("epoch", 0)), source=path, strict=False)
        return payload, ckpt.get(STATE_KEY)

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

    def hold_checkpoint_hooks(self) -> None:
        """After a recovery: a rollback to the start state leaves the counter at -1 for the hooks after the guard in
        this iteration; CheckpointHook would read (-1 + 1) % interval == 0 and save an iter_0.pth nobody asked for. Its
        save_begin is held past -1 until the next iteration starts (:meth:`release_checkpoint_hooks`)."""
        if self.runner.iter < 0:
            for hook in self.runner.hooks:
                if isinstance(hook, CheckpointHook) and not hook.by_epoch:
                    self._held_save_begin.append((hook, hook.save_begin))
                    hook.save_begin = 1

    def release_checkpoint_hooks(self) -> None:
        """As the next iteration starts: the checkpoint hooks held by :meth:`after_recovery` save as configured."""
        for hook, save_begin in self._held_save_begin:
            hook.save_begin = save_begin
        self._held_save_begin = []
