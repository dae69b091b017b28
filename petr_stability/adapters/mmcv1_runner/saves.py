"""Checkpoints an MMCV 1.x ``CheckpointHook`` wrote from a non-finite state: noticed as written, repaired after.

``CheckpointHook`` (NORMAL, registered before the guard) saves before the guard sees the step, so a save can hold the
iteration that went bad. Such a save is noticed as it is written (rank 0: its ``_save_checkpoint`` is master_only),
keeps ``max_keep_ckpts`` from deleting older files, forces a health check, and is rewritten from the restored state
after the recovery; on giving up it is renamed and ``latest.pth`` / ``hook_msgs['last_ckpt']`` name a finite file.
"""
import glob
import os
from typing import Any, Dict, List, Tuple

from mmcv.runner import CheckpointHook
from mmcv.runner import save_checkpoint as mmcv_save_checkpoint

from ...core.distributed import get_rank
from ...core.recovery.restore import checkpoint_finite
from ...core.safe_load import safe_load
from ...core.watch.health import by_design, state_finite
from ..driver import STATE_KEY

__all__ = ["SaveWatch"]


def _newest(out_dir: str) -> List[str]:
    files = [p for p in glob.glob(os.path.join(out_dir, "*.pth")) if not os.path.islink(p)]
    return [max(files, key=os.path.getmtime)] if files else []


class SaveWatch:
    """The saves of one MMCV 1.x runner, watched for non-finite states.

    Args:
        io: the runner's adapter (:class:`~.io.MMCV1IO`): its runner, model, optimizers, log and checkpoint files.
    """

    def __init__(self, io: Any) -> None:
        self.io = io
        self.runner = io.runner
        self.hooks = [h for h in self.runner.hooks if isinstance(h, CheckpointHook)]
        #: Checkpoint files written (rank 0) from a non-finite state and not yet repaired.
        self.poisoned: List[str] = []
        self._suspended_keep: List[Tuple[Any, int]] = []

    def install(self) -> None:
        """Wraps ``runner.save_checkpoint`` to notice a save of a non-finite state as it is written."""
        save = self.runner.save_checkpoint
        if getattr(save, "_nan_guard", False):
            return

        def checked_save(out_dir: str, *args: Any, **kwargs: Any) -> Any:
            finite = state_finite(self.io.model(), self.io.optimizers())
            before = set(glob.glob(os.path.join(out_dir, "*.pth")))
            result = save(out_dir, *args, **kwargs)
            if not finite:
                self._poisoned(out_dir, before)
            return result

        checked_save._nan_guard = True  # type: ignore[attr-defined]
        self.runner.save_checkpoint = checked_save

    def _poisoned(self, out_dir: str, before: set) -> None:
        written = sorted(p for p in set(glob.glob(os.path.join(out_dir, "*.pth"))) - before
                         if not os.path.islink(p)) or _newest(out_dir)
        self.poisoned.extend(p for p in written if p not in self.poisoned)
        # CheckpointHook deletes older files right after the save returns: not while the newest is poisoned.
        for hook in self.hooks:
            if hook.max_keep_ckpts > 0:
                self._suspended_keep.append((hook, hook.max_keep_ckpts))
                hook.max_keep_ckpts = -1
        self.io.log(f"NanGuard: checkpoint {written} was saved from a non-finite state; older checkpoints are kept "
                    "and it will be rewritten from the restored state", "warning")

    def release(self) -> None:
        """Gives ``max_keep_ckpts`` back to the checkpoint hooks after a suspended deletion."""
        for hook, keep in self._suspended_keep:
            hook.max_keep_ckpts = keep
        self._suspended_keep = []

    def rewrite(self, state: Dict[str, Any], at_epoch_end: bool) -> None:
        """Rewrites every poisoned checkpoint from the live (restored) state, atomically, with the guard's ``state``."""
        runner = self.runner
        meta_base = dict(runner.meta or {})
        for path in self.poisoned:
            meta = dict(meta_base)
            meta.update(epoch=runner.epoch + 1, iter=runner.iter)
            meta[STATE_KEY] = state
            tmp = path + ".nan_guard.tmp"
            mmcv_save_checkpoint(self.io.model(), tmp, optimizer=runner.optimizer, meta=meta)
            os.replace(tmp, path)
            done = runner.iter + (0 if at_epoch_end else 1)
            self.io.log(f"NanGuard: rewrote {path} from the restored state (iter {done})", "warning")
        self.poisoned = []

    def leave_finite(self) -> None:
        """On giving up: renames poisoned files and points ``latest.pth`` / ``last_ckpt`` at a finite one."""
        if get_rank() != 0:
            return  # rank 0 wrote the checkpoints; the others must not race it on the links (shared FS)
        for path in self.poisoned:
            if os.path.exists(path):
                os.replace(path, path + ".nonfinite")
                self.io.log(f"NanGuard: {path} holds a non-finite state; renamed to {path}.nonfinite", "error")
        self.poisoned = []
        good = None
        for path in self.io.checkpoint_files():
            try:
                if checkpoint_finite(safe_load(path, extra_globals=()), by_design(self.io.model())):
                    good = path
                    break
            except Exception:  # a foreign or truncated file is simply not a candidate
                continue
        for hook in self.hooks:
            link = os.path.join(hook.out_dir or self.io.work_dir, "latest.pth")
            if os.path.islink(link) or os.path.exists(link):
                os.remove(link)
            if good is not None and os.path.dirname(good) == os.path.dirname(link):
                os.symlink(os.path.basename(good), link)
        hook_msgs = (self.runner.meta or {}).get("hook_msgs", {})
        if good is not None:
            hook_msgs["last_ckpt"] = good
        else:
            hook_msgs.pop("last_ckpt", None)
