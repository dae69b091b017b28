"""The checkpoint role of :class:`~.io.MMCV1IO`: the run's checkpoint files, one read as a restore point (its
completed iterations told apart by the guard's mark), the guard's state kept in ``runner.meta``, and the state of a
resumed run found again where ``IterBasedRunner.resume`` did not copy it."""
import glob
import os
from typing import Any, Dict, List, Optional, Tuple

from mmcv.runner import IterBasedRunner

from ...configfix.load import load_config_text
from ...core.port import Payload, RunConfig
from ...core.safe_load import safe_load
from ..driver import STATE_KEY

__all__ = ["CheckpointRole", "completed_iters", "ITER_MARK"]

#: Iteration counter at ``before_train_iter``, kept in the state so that a checkpoint tells an in-iteration
#: save (``meta['iter']`` is that iteration's 0-based counter) from an epoch-end save (already incremented).
ITER_MARK = "iter_open"


class CheckpointRole:
    """What :class:`~.io.MMCV1IO` does with checkpoints (it keeps ``runner``, ``work_dir``, ``saves``, ``opt_hook``,
    ``_fp16()``, ``run_config()`` and ``log()``)."""

    runner: Any
    work_dir: str
    saves: Any
    opt_hook: Any

    def checkpoint_files(self) -> List[str]:
        dirs = {self.work_dir} | {h.out_dir for h in self.saves.hooks if getattr(h, "out_dir", None)}
        paths = [p for d in dirs if d for p in glob.glob(os.path.join(d, "*.pth")) if not os.path.islink(p)]
        return sorted(set(paths), key=os.path.getmtime, reverse=True)

    def read_checkpoint(self, path: str) -> Tuple[Payload, Optional[Dict[str, Any]]]:
        # MMCV 1.x meta holds only builtins (strings, numbers, dicts, lists, tuples): no extra globals.
        ckpt = safe_load(path, extra_globals=())
        meta = ckpt.get("meta", {})
        optimizer = ckpt.get("optimizer", {})
        ckpt["optimizer"] = {"": optimizer} if "param_groups" in optimizer else optimizer
        ckpt["fp16"] = meta.get("fp16", {})
        payload = Payload(ckpt, completed_iters(meta, self.runner), int(meta.get("epoch", 0)), source=path,
                          strict=False)
        return payload, meta.get(STATE_KEY)

    def store_state(self, state: Dict[str, Any]) -> None:
        """Keeps the guard's state in ``runner.meta`` (saved in every checkpoint, as ``runner.meta['fp16']`` is)."""
        if self.runner.meta is None:
            self.runner.meta = {}
        mark = (self.runner.meta.get(STATE_KEY) or {}).get(ITER_MARK)
        self.runner.meta[STATE_KEY] = dict(state, **{ITER_MARK: mark})

    def resumed_state(self) -> Optional[Dict[str, Any]]:
        """The guard's state of a resumed run: ``runner.meta``, or the checkpoint ``IterBasedRunner.resume`` read."""
        state = (self.runner.meta or {}).get(STATE_KEY)
        if state is None and self.runner.iter > 0:
            state = self._state_of_resumed()
        return state

    def _state_of_resumed(self) -> Optional[Dict[str, Any]]:
        # IterBasedRunner.resume keeps its own runner.meta: find the checkpoint it resumed from by its counters.
        runner = self.runner
        for path in _resumed_from(self.run_config(), self.work_dir) + self.checkpoint_files():
            try:
                meta = safe_load(path, extra_globals=()).get("meta", {})
            except Exception:  # a foreign or truncated file is simply not the one
                continue
            if int(meta.get("iter", -1)) == runner.iter and int(meta.get("epoch", -1)) == runner.epoch:
                scaler_state = (meta.get("fp16") or {}).get("loss_scaler")
                if scaler_state is not None and self._fp16():
                    self.opt_hook.loss_scaler.load_state_dict(scaler_state)
                    runner.meta.setdefault("fp16", {})["loss_scaler"] = scaler_state
                self.log(f"NanGuard: resumed guard state (and loss scale) from {path}, which "
                         "IterBasedRunner.resume does not copy into runner.meta")
                return meta.get(STATE_KEY)
        return None


def completed_iters(meta: Dict[str, Any], runner: Any) -> int:
    """Iterations completed when an MMCV 1.x checkpoint was written.

    ``meta['iter']`` is the runner's counter at the save: the iteration's own 0-based counter for a save in
    ``after_train_iter`` (``IterBasedRunner``, or ``by_epoch=False``), the completed count for a save in
    ``after_train_epoch``. The guard's mark in ``meta['nan_guard']`` tells them apart; without it the runner
    type decides.
    """
    it = int(meta.get("iter", 0))
    mark = (meta.get(STATE_KEY) or {}).get(ITER_MARK)
    if mark is not None:
        return it + 1 if int(mark) == it else it
    return it + 1 if isinstance(runner, IterBasedRunner) else it


def _resumed_from(config: Optional[RunConfig], work_dir: str) -> List[str]:
    """The config's resume_from (mmdet / mmdet3d 0.x tools/train.py keep cfg.pretty_text in runner.meta): a checkpoint
    of another run's directory, which checkpoint_files() does not list."""
    if config is None:
        return []
    try:
        path = load_config_text(config.config, base_dir=work_dir).get("resume_from")
    except Exception:  # a config text that cannot be read again names no file
        return []
    return [path] if isinstance(path, str) and os.path.isfile(path) else []
