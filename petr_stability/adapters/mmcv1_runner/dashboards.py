"""What MMCV 1.x's logger hooks show of the guard and of a rollback: the log buffer, the loggers' steps, the text.

MMCV 1.x facts handled here (``mmcv/runner/log_buffer.py``, ``mmcv/runner/hooks/logger/``):

- Every logger hook writes ``runner.log_buffer.output``, which ``LogBuffer.average(interval)`` fills with the mean of
  each key's last ``interval`` values in ``val_history``. The guard's scalars are written into ``output`` itself,
  after every iteration: the loggers show their latest value, never a window mean (``incidents: 0.6250``), and
  ``average`` (which only visits ``val_history``) leaves them alone.
- A rollback takes the values its abandoned iterations logged (``loss``, ``grad_norm``, each ``loss_*``) out of
  ``val_history``, so that the next line's mean does not average a NaN in; the guard's own line shows them.
  ``time`` and ``data_time`` stay: that time was spent. The loggers clear the buffer as each epoch starts.
- Every logger but ``TextLoggerHook`` names its step ``get_iter(runner)`` = ``runner.iter + 1``, the counter a
  rollback sends back: it becomes the iterations run (TensorBoard, W&B, MLflow, ... never see a step go back).
  ``TextLoggerHook`` keeps the runner's iteration numbers, as the guard's log lines and records do.
- ``TensorboardLoggerHook`` (rank 0) has a ``SummaryWriter`` as ``writer``: incidents go there as text.
"""
from typing import Any, Callable, Dict, List, Optional

from mmcv.runner import LoggerHook, TextLoggerHook

__all__ = ["LogView"]

#: Log-buffer keys a rollback leaves in place: the time an abandoned iteration took was spent.
_TIMES = ("time", "data_time")


class LogView:
    """The guard's view of an MMCV 1.x runner's logging.

    Args:
        runner: the runner.
    """

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        #: Iterations rolled back so far: what the loggers' steps add to the runner's counter.
        self.lost = 0
        self.latest: Dict[str, float] = {}
        self._generation = 0
        self._entries = 0
        self._abandoned: Dict[str, float] = {}
        self._text_failed = False

    # -- the guard's scalars
    def publish(self, scalars: Dict[str, float], lost: int) -> None:
        """The guard's latest values into the buffer's output, where every logger reads them."""
        self.lost = lost
        self.latest.update(scalars)
        self.runner.log_buffer.output.update(self.latest)

    # -- the loggers' steps
    def count_iterations_run(self) -> List[str]:
        """Makes every logger but ``TextLoggerHook`` name its step by the iterations run; returns their names."""
        names = []
        for hook in self.runner.hooks:
            if isinstance(hook, LoggerHook) and not isinstance(hook, TextLoggerHook):
                get_iter = getattr(hook.get_iter, "nan_guard_original", hook.get_iter)  # a second run wraps once
                hook.get_iter = self._steps_run(hook, get_iter)
                names.append(type(hook).__name__)
        return names

    def _steps_run(self, hook: Any, get_iter: Callable[..., int]) -> Callable[..., int]:
        def steps_run(runner: Any, inner_iter: bool = False) -> int:
            step = get_iter(runner, inner_iter)
            return step if inner_iter and hook.by_epoch else step + self.lost  # an epoch's position stays

        steps_run.nan_guard_original = get_iter  # type: ignore[attr-defined]
        return steps_run

    # -- the log window across a rollback
    def _history(self) -> Dict[str, List[Any]]:
        return {k: v for k, v in self.runner.log_buffer.val_history.items() if k not in _TIMES}

    def mark(self) -> None:
        """As each iteration starts: a buffer that shrank was cleared (an epoch started), a new generation."""
        entries = sum(len(v) for v in self._history().values())
        if entries < self._entries:
            self._generation += 1
        self._entries = entries

    def window(self) -> Dict[str, Any]:
        """The buffer's place now, kept with a snapshot."""
        return {"generation": self._generation, "lengths": {k: len(v) for k, v in self._history().items()}}

    def rewind(self, window: Optional[Dict[str, Any]]) -> None:
        """Takes the values logged since ``window`` (a snapshot's) out of the buffer; all of them for a state
        without one (a checkpoint) or from before the buffer was last cleared."""
        buffer = self.runner.log_buffer
        same = window is not None and window.get("generation") == self._generation
        lengths = window.get("lengths", {}) if same else {}
        self._abandoned = {}
        for key, values in self._history().items():
            keep = min(int(lengths.get(key, 0)), len(values))
            if keep < len(values):
                self._abandoned[key] = values[-1]
            if keep:
                del values[keep:]
                del buffer.n_history[key][keep:]
            else:  # an empty history would average to NaN: the key goes
                del buffer.val_history[key]
                del buffer.n_history[key]
        self._entries = sum(len(v) for v in self._history().values())

    def say_rewound(self, log: Callable[..., None]) -> None:
        """After a rollback: the guard's line shows what the abandoned iterations logged last."""
        if self._abandoned:
            shown = ", ".join(f"{k}: {_fmt(v)}" for k, v in self._abandoned.items())
            log(f"NanGuard: the values the rolled-back iterations logged are kept out of the next log line's means; "
                f"the last of them: {shown}", "warning")
        self._abandoned = {}

    # -- text
    def add_text(self, tag: str, text: str, step: int, log: Callable[..., None]) -> None:
        """Writes ``text`` to every logger with a writer that takes text (``TensorboardLoggerHook`` on rank 0)."""
        for hook in self.runner.hooks:
            add = getattr(getattr(hook, "writer", None), "add_text", None)
            if not isinstance(hook, LoggerHook) or not callable(add):
                continue
            try:
                add(tag, text, step)
            except Exception as exc:  # a dashboard that fails must not end a run the guard saved
                if not self._text_failed:
                    log(f"NanGuard: could not write an incident to {type(hook).__name__} "
                        f"({type(exc).__name__}: {exc})", "warning")
                self._text_failed = True


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)
