"""What a remedy is: one object with its name, the causes it serves, when it acts, what it changes and its state.

Each remedy file holds its pure function(s) and one :class:`Remedy` subclass; :mod:`.registry` lists them, and
everything else (``remedies=``, :data:`~..causes.CAUSE_TABLE`'s remedies, the dynamics ladder, the checkpoint state,
the summary and the patched config) is read from there.
"""
import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..causes import Cause, Classification
from .change import Change

__all__ = ["When", "Context", "Remedy"]


class When(str, enum.Enum):
    """The point of the run at which a remedy acts."""

    BEFORE_RESTORE = "before restore"  #: with the failing step at hand (its batch, its gradients)
    AFTER_RESTORE = "after restore"  #: what a restore puts back must be changed after it
    RESTORE = "restore"  #: the rollback itself (the incident chain's restore step)
    AFTER_ROLLBACK = "after rollback"  #: after every rollback, whatever the class
    STALLED = "stalled"  #: a static loss scale skipped step after step
    HEALTHY = "healthy step"  #: every healthy optimizer step
    RECURRING = "recurring sample"  #: a sample made steps go wrong in two epochs


@dataclass
class Context:
    """What a remedy may read and change when it acts.

    Attributes:
        io: the runner adapter (:class:`~..port.GuardIO`).
        history: the run's :class:`~..diagnosis.classify.CauseHistory`.
        incident: this recovery's 1-based number (the clip schedule's index). Defaults to 0.
        iteration: the iteration it acts at. Defaults to 0.
        cls: the agreed class of the divergence, where there is one (remedies may add to its evidence). Defaults to
            None.
        ids: the sample ids of the batches that broke. Defaults to [].
        remedies: the run's remedies (:class:`~.registry.Remedies`), for one that reads another. Defaults to None.
        extra: what one point of the run hands its remedies (the grad-norm monitor, a restored payload). Defaults
            to {}.
    """

    io: Any
    history: Any = None
    incident: int = 0
    iteration: int = 0
    cls: Optional[Classification] = None
    ids: Sequence[Dict[str, Any]] = ()
    remedies: Any = None
    extra: Dict[str, Any] = field(default_factory=dict)


class Remedy:
    """One remedy: subclasses set the class attributes and override what they do.

    Class attributes:
        name: its ``remedies=`` name (how logs, records and docs call it).
        switched: whether ``remedies=`` switches it (False: its own setting does, e.g. ``adaptive_clip``).
        causes: the classes of :data:`~..causes.CAUSE_TABLE` it serves.
        rung: its rung of the dynamics ladder (1-based; 0: none).
        rung_name: the rung's name, given by the rung's first remedy.
        when: when it acts (:class:`When`).
        section: where its state sits in the guard's checkpoint state: ``''`` (top level) or ``'policy'``.
        state_keys: its keys there (the layout test keeps every other file from naming them).
        fixes: the patched config's :class:`~petr_stability.configfix.ConfigFix` field it fills, from which key of
            its summary.

    Args:
        config: the guard's settings (:class:`~..config.GuardConfig`).
    """

    name: str = ""
    switched: bool = True
    causes: Tuple[Cause, ...] = ()
    rung: int = 0
    rung_name: str = ""
    when: When = When.BEFORE_RESTORE
    section: str = ""
    state_keys: Tuple[str, ...] = ()
    fixes: Tuple[Tuple[str, str], ...] = ()

    def __init__(self, config: Any) -> None:
        self.config = config

    @property
    def enabled(self) -> bool:
        """Switched on for this run."""
        return self.name in self.config.remedies

    @classmethod
    def rung_text(cls, config: Any) -> str:
        """How the cause table's action names its rung with this run's settings."""
        return cls.rung_name

    def prepare(self, ctx: Context) -> None:
        """Reads what the remedy will need after the restore, while the failing step still exists."""

    def in_effect(self, ctx: Context) -> bool:
        """Everything it would set is in force already (a rung whose remedies all are is skipped)."""
        return False

    def apply(self, ctx: Context) -> List[Change]:
        """Acts; returns what it changed."""
        return []

    def restored(self, ctx: Context) -> None:
        """A restore put back an older state (``ctx.extra['restored']``, the payload): bring back what it undid."""

    def after_rollback(self, ctx: Context) -> List[str]:
        """After every rollback; returns the names of what it started afresh."""
        return []

    def after_incident(self, ctx: Context) -> None:
        """An incident was handled (recovered, or a stalled scale made dynamic)."""

    def tags(self) -> Dict[str, Any]:
        """What each restore point records of this remedy (so that a restore can bring it back)."""
        return {}

    def resume(self, io: Any) -> None:
        """Re-applies what a resumed state recorded (once the runner's objects exist)."""

    def state_dict(self) -> Dict[str, Any]:
        """Its state, under :attr:`state_keys`."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """The inverse of :meth:`state_dict` (missing keys: the defaults, so old checkpoints load)."""

    def summary(self, io: Any) -> Dict[str, Any]:
        """Its part of the guard's summary (JSON-ready): the settings it put in force."""
        return {}
