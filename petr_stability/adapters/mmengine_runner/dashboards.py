"""What MMEngine's logging shows of the guard and of a rollback: the message hub, the visualizer's steps, the text.

MMEngine facts handled here (``mmengine/runner/log_processor.py``, ``mmengine/hooks/logger_hook.py``,
``mmengine/visualization``):

- ``LogProcessor`` shows each ``train/`` scalar of the message hub as its window mean where the name matches
  ``mean_pattern`` (``loss``, ``time``, ``grad_norm``: ``nan_guard/loss_scale`` too) and as its current value
  otherwise. The guard's scalars live in history buffers that hold one value: any statistic of them is the latest.
- ``LoggerHook`` gives the visualizer ``step=runner.iter + 1`` after a train iteration, and ``step=runner.iter``
  for validation metrics unless it logs them by epoch (``log_metric_by_epoch``): the counter a rollback sends back,
  so TensorBoard would draw over its own curve. While those steps are on the iteration axis, the visualizer's
  ``add_scalar`` / ``add_scalars`` add the iterations lost so far: the step is the iterations run.
- A rollback restores the message hub's scalar history with the state (``io.py``), which keeps the abandoned
  iterations out of the next line's means; the guard's own line shows what they logged last.
- Each vis backend's ``experiment`` is its writer; where it takes text (TensorBoard's ``SummaryWriter``), incidents
  go there as text. ``LocalVisBackend``, W&B and the others take none.
"""
import inspect
from typing import Any, Callable, Dict, Optional

from mmengine.hooks import LoggerHook
from mmengine.logging import HistoryBuffer

from .private import vis_backends

__all__ = ["StepsRun", "publish_latest", "abandoned_values", "add_text"]


class StepsRun:
    """The visualizer's steps on the iteration axis, made the iterations run (a rollback never sends them back).

    Args:
        runner: the runner; its visualizer's ``add_scalar`` / ``add_scalars`` are wrapped (once, however many runs).
    """

    def __init__(self, runner: Any) -> None:
        #: Iterations rolled back so far: what a step on the iteration axis gets added.
        self.lost = 0
        #: Whether the steps the visualizer is given now are iterations (train, and validation logged by iteration).
        self.on = False
        self._val_on_iterations = not any(getattr(h, "log_metric_by_epoch", False) for h in runner.hooks
                                          if isinstance(h, LoggerHook))
        visualizer = runner.visualizer
        for name in ("add_scalar", "add_scalars"):
            method = getattr(visualizer, name)
            setattr(visualizer, name, self._wrap(getattr(method, "nan_guard_original", method)))

    def train(self) -> None:
        """A train iteration starts: its steps are iterations."""
        self.on = True

    def validate(self) -> None:
        """Validation starts: its metrics are on the iteration axis unless logged by epoch."""
        self.on = self._val_on_iterations

    def off(self) -> None:
        """Training ended: steps are the runner's own again."""
        self.on = False

    def _wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(method)

        def steps_run(*args: Any, **kwargs: Any) -> Any:
            if self.on and self.lost:
                bound = signature.bind(*args, **kwargs)
                bound.arguments["step"] = bound.arguments.get("step", 0) + self.lost
                return method(*bound.args, **bound.kwargs)
            return method(*args, **kwargs)

        steps_run.nan_guard_original = method  # type: ignore[attr-defined]  # (not __wrapped__: master_only sets it)
        return steps_run


def publish_latest(message_hub: Any, scalars: Dict[str, float]) -> None:
    """Each of ``scalars`` into the hub as ``train/<name>``, in a history buffer of one value: whatever statistic
    the log processor takes (a window mean for ``nan_guard/loss_scale``), it is the latest value."""
    for key, value in scalars.items():
        name = f"train/{key}"
        if getattr(message_hub.log_scalars.get(name), "max_length", None) != 1:  # new, or an older run's
            message_hub.log_scalars[name] = HistoryBuffer(max_length=1)
        message_hub.update_scalar(name, value)


def abandoned_values(live: Dict[str, Any], restored: Dict[str, Any]) -> Dict[str, float]:
    """What the rolled-back iterations logged last: each loss and grad_norm buffer with more values than the
    restored one holds, its current value."""
    out = {}
    for name, buffer in live.items():
        key = name[len("train/"):]
        if not name.startswith("train/") or key.startswith("nan_guard/") or not ("loss" in key or "grad_norm" in key):
            continue
        kept: Optional[Any] = restored.get(name)
        if kept is None or len(buffer.data[0]) > len(kept.data[0]):
            out[key] = float(buffer.current())
    return out


def add_text(visualizer: Any, tag: str, text: str, step: int) -> Optional[str]:
    """Writes ``text`` to every vis backend whose writer takes text; returns the first failure, or None."""
    failure = None
    for name, backend in vis_backends(visualizer).items():
        try:
            add = getattr(backend.experiment, "add_text", None)
            if callable(add):
                add(tag, text, step)
        except Exception as exc:  # a dashboard that fails must not end a run the guard saved
            failure = failure or f"{name} ({type(exc).__name__}: {exc})"
    return failure
