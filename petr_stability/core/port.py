"""The port between the core and a runner family: the typed records and the one abstract class an adapter fills in.

An adapter says *where* things live in its runner; *when* and *why* belong to the driver
(:mod:`~petr_stability.adapters.driver`) and the guard (:mod:`~petr_stability.core.guard`). docs/runners.md lists the
whole surface in one table.

Iteration numbering, stated once (docs/how-it-works.md): an iteration is named by its 1-based number, as the
runners' own logs show it (``Iter(train) [N/...]``, ``iter_N.pth``), and a *state at iteration N* is the state after
N completed iterations, so ``iter_N.pth``, a snapshot taken after iteration N and an incident at iteration N all
say N. A runner's own counter is the 0-based index of the running iteration until the loop increments it after the
last ``after_train_iter`` hook; :meth:`GuardIO.completed` and :meth:`GuardIO.rewind` are the only conversions.
"""
import abc
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from torch import nn

__all__ = ["Change", "StepReading", "ClipSetting", "Payload", "RunConfig", "GuardIO"]


@dataclass
class Change:
    """One setting the guard changed: what, and its value before and after."""

    target: str
    old: Any
    new: Any

    def as_dict(self) -> Dict[str, Any]:
        """JSON-ready: a non-finite float is written as its string (``'inf'``: JSON has no Infinity)."""
        return {"target": self.target, "old": _jsonable(self.old), "new": _jsonable(self.new)}


def _jsonable(value: Any) -> Any:
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


@dataclass
class StepReading:
    """What the runner saw of the iteration that just ran (host values it already read).

    Attributes:
        stepped: an optimizer step happened (False on gradient-accumulation iterations).
        grad_norm: that step's unscaled gradient norm, or None where none was observed.
        skipped_by_guard: the guard's fp32 skip dropped the step's gradients before the optimizer.
        loss: the iteration's total loss on this rank, or None.
    """

    stepped: bool
    grad_norm: Optional[float] = None
    skipped_by_guard: bool = False
    loss: Optional[float] = None


class ClipSetting:
    """One optimizer's live gradient-clip arguments, read and tightened through one place.

    Args:
        name: how logs and records name it (``optim_wrapper.clip_grad.max_norm``).
        kwargs: the live dict the runner passes to its clip function (edits take effect at the next step), or
            None where nothing clips.
    """

    def __init__(self, name: str, kwargs: Optional[Dict[str, Any]]) -> None:
        self.name = name
        self.kwargs = kwargs

    @property
    def kind(self) -> str:
        """``'norm'`` (``max_norm``), ``'value'`` (``clip_value``, MMEngine ``type='value'``) or ``'none'``."""
        if not self.kwargs:
            return "none"
        return "norm" if "max_norm" in self.kwargs else "value"

    @property
    def max_norm(self) -> Optional[float]:
        """The norm bound (``inf`` for the guard's observing clip), or None where it clips by value or not at all."""
        return float(self.kwargs["max_norm"]) if self.kind == "norm" else None

    def tighten(self, target: float) -> Optional[Change]:
        """``max_norm = min(current, target)``, never loosening a tighter clip; None when nothing changed (already
        tighter, or not a norm clip: a per-element ``clip_value`` of 1 is a different, far looser, bound than a global
        norm of 1, and is left as it is).

        Raises:
            ValueError: ``target`` is not a finite number > 0.
        """
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < math.inf:
            raise ValueError(f"max_norm must be a finite number > 0, got {target!r}")
        if self.kind != "norm":
            return None
        current = float(self.kwargs["max_norm"])
        if current <= target:
            return None
        self.kwargs["max_norm"] = target
        return Change(self.name, current, target)

    def set_max_norm(self, value: float) -> None:
        """Sets the bound outright (a resumed or adaptive remedy); ignored for value clipping."""
        if self.kind == "norm" and math.isfinite(value) and value > 0:
            self.kwargs["max_norm"] = float(value)

    def __repr__(self) -> str:
        return f"ClipSetting({self.name!r}, {self.kwargs!r})"


@dataclass
class Payload:
    """A state to restore: the adapter's state dicts plus where it came from.

    Attributes:
        state: what :meth:`GuardIO.capture` returned (host copies), or a checkpoint's dicts.
        iteration: completed iterations when it was taken (the numbering above).
        epoch: the runner's epoch counter then.
        source: ``'memory'``, ``'start'`` or the checkpoint's path.
        strict: load the model's state dict strictly (False for checkpoint files, which may lack buffers).
        tags: what the remedies recorded with this state (``{'<remedy>.<attribute>': value}``, their declared
            :attr:`~.remedies.base.Remedy.tags`), so that a restore can bring back what it undoes.
    """

    state: Dict[str, Any]
    iteration: int
    epoch: int
    source: str = "memory"
    strict: bool = True
    tags: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class RunConfig:
    """The run's effective config, for the patched config written after an incident.

    Attributes:
        config: the config object the runner was built from (MMEngine ``Config``, MMCV ``Config``) or a dict.
        filename: the file it was loaded from, where the next run can reach it; None otherwise.
    """

    config: Any
    filename: Optional[str] = None


class GuardIO(abc.ABC):
    """Where a runner keeps what the guard reads and changes. One small subclass per runner family.

    Required: the abstract methods. The others have defaults that mean "this runner has none". The driver calls
    them; an adapter never decides anything.
    """

    #: The run's work dir (incident log, patched config); None for none.
    work_dir: Optional[str] = None

    # -- objects
    @abc.abstractmethod
    def model(self) -> nn.Module:
        """The unwrapped model."""

    @abc.abstractmethod
    def optimizers(self) -> List[Any]:
        """The torch optimizers."""

    # -- signals
    @abc.abstractmethod
    def install_probes(self, skip_nonfinite_fp32: bool) -> None:
        """Wraps each clip function in a :class:`~.watch.probe.ClipProbe` (an observing clip where none is set)."""

    @abc.abstractmethod
    def read_step(self) -> StepReading:
        """The iteration that just ran, from the probes and the runner's logged floats; resets the probes."""

    @abc.abstractmethod
    def scale_mode(self) -> str:
        """``'dynamic'``, ``'static'`` (fp16 loss scaler) or ``'none'`` (fp32)."""

    def loss_scale(self) -> Optional[float]:
        """The loss scale now (a device read on CUDA: the guard asks only on checked steps), or None."""
        return None

    @abc.abstractmethod
    def clip_settings(self) -> List[ClipSetting]:
        """Each optimizer's live clip arguments."""

    # -- state and counters
    @abc.abstractmethod
    def capture(self) -> Dict[str, Any]:
        """The live state to snapshot (references are fine: the guard copies)."""

    @abc.abstractmethod
    def restore(self, payload: Payload) -> None:
        """Loads ``payload.state`` into the live objects (never aliasing it: it may be restored again), with zero
        gradients and gradient-accumulation counters consistent with ``payload.iteration``: no partial window of the
        abandoned path survives."""

    @abc.abstractmethod
    def counter(self) -> Tuple[int, int]:
        """The runner's raw (iteration counter, epoch counter)."""

    @abc.abstractmethod
    def set_counter(self, value: int) -> None:
        """Sets the runner's raw iteration counter."""

    def completed(self, inside: bool) -> Tuple[int, int]:
        """(completed iterations, epoch); ``inside`` is True between an iteration's start and the loop's increment."""
        raw, epoch = self.counter()
        return raw + (1 if inside else 0), epoch

    def rewind(self, completed: int, inside: bool) -> None:
        """Sets the counter so that the next iteration to run is ``completed + 1``."""
        self.set_counter(completed - (1 if inside else 0))

    # -- output
    @abc.abstractmethod
    def log(self, msg: str, level: str = "info") -> None:
        """Writes through the runner's logger (``'info'``, ``'warning'``, ``'error'``)."""

    def update_scalars(self, scalars: Dict[str, float], iterations_lost: int = 0) -> None:
        """Publishes the guard's scalars to the runner's log and visualization backends, each as its latest value
        (never a mean over a logging window).

        Args:
            scalars: name -> value, every value finite.
            iterations_lost: iterations rolled back so far in the run. The runner's completed iterations plus these
                are the iterations run: the step the backends are given (the runner's own scalars too), so that a
                rollback never sends a dashboard's step axis back. Defaults to 0.
        """

    def add_text(self, tag: str, text: str, step: int) -> None:
        """Writes a text event (an incident: cause, action, samples) to every backend that takes text.

        Args:
            tag: the event's name (``nan_guard/incident``).
            text: Markdown.
            step: the iterations run when it happened (the step axis of :meth:`update_scalars`).
        """

    # -- optional capabilities
    def make_scale_dynamic(self) -> Optional[Change]:
        """Turns a static loss scale into a dynamic one; None where there is none to change."""
        return None

    def restore_scale_mode(self) -> None:
        """Re-applies the dynamic-scale remedy after a resume."""

    def checkpoint_files(self) -> List[str]:
        """Checkpoint files in the run's checkpoint dirs (work dir and ``out_dir``), any order."""
        return []

    def read_checkpoint(self, path: str) -> Tuple[Payload, Optional[Dict[str, Any]]]:
        """Reads a checkpoint file (safe loading): its payload and the guard state saved in it (None if absent)."""
        raise NotImplementedError

    def store_state(self, state: Dict[str, Any]) -> None:
        """Keeps the guard's state where the runner's next checkpoint save picks it up (MMCV 1.x ``runner.meta``)."""

    def run_config(self) -> Optional[RunConfig]:
        """The run's effective config, or None where the runner has none."""
        return None

    def rerun_forward(self, batch: Any) -> Optional[Callable[[], Any]]:
        """A zero-argument callable re-running this iteration's forward on the unwrapped model, in the training
        autocast context, returning its loss (dict); None where the adapter cannot (no diagnosis then).

        Args:
            batch: the batch the driver kept at the iteration's start (None where the runner does not pass it).
        """
        return None

    def dataset(self) -> Any:
        """The training dataset (for naming quarantined samples), or None. Defaults to the loader's."""
        return getattr(self.train_loader(), "dataset", None)

    def dataset_size(self) -> int:
        """``len`` of the training dataset, or 0 where unknown (no quarantine then)."""
        dataset = self.dataset()
        try:
            return len(dataset) if dataset is not None else 0
        except TypeError:  # an iterable dataset has no length
            return 0

    def train_loader(self) -> Any:
        """The training ``DataLoader``, for the sample tracker and the quarantine (before its first iterator where
        the runner allows), or None."""
        return None

    def live_loader_iterator(self) -> Any:
        """The training loader's iterator where the runner made it before the guard could reach the loader (MMEngine's
        ``IterBasedTrainLoop``, MMCV 1.x's ``IterBasedRunner``), or None."""
        return None

    def lr_schedulers(self) -> List[Any]:
        """Every learning-rate schedule, for a backoff that must last (torch/MMEngine schedulers, MMCV LR hooks)."""
        return []

    def restored_lr_schedulers(self) -> List[Any]:
        """The schedules a :meth:`restore` resets from the payload (a backoff is re-applied to them)."""
        return []

    def restores_lr(self) -> bool:
        """Whether :meth:`restore` puts the payload's learning rates back (else the live ones are kept)."""
        return True

    def health_check_due(self) -> bool:
        """True when this rank wants a full health check on this iteration (a checkpoint save follows or happened)."""
        return False

    def verdict_due_now(self) -> bool:
        """True when the runner uses this iteration's state right after the guard's work (a checkpoint save, a
        validation, the end of an epoch or of training): under a process group the guard then agrees on this step's
        verdict at once instead of during the next iteration (docs/distributed.md). Must be the same on every rank:
        nothing rank-local may decide it (a collective follows)."""
        return False

    def after_recovery(self, state: Dict[str, Any], inside: bool) -> None:
        """After a rollback, with the guard's new state: repair what the runner wrote from the abandoned path."""

    def before_give_up(self) -> None:
        """The run is about to stop with the guard's error: leave the work dir pointing at finite files."""

    def after_step(self) -> None:
        """End of the guard's per-iteration work (undo temporary changes made for it)."""
