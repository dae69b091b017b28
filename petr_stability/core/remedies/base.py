"""What a remedy is: one vertical slice, in one file, that the incident chain reaches through events only.

A remedy declares what it matches (the events of :class:`When` it takes, the incident classes it serves), does its
work in :meth:`Remedy.apply` and returns an :class:`Outcome` (what it changed, and what that adds to the evidence),
declares its settings (:class:`~..validate.Setting`, validated and documented where the remedy is), its state (the
attributes one generic pass saves in every checkpoint, :attr:`Remedy.state`) and restore tags (those a restore point
records, :attr:`Remedy.tags`), its summary and its patched-config entry (:meth:`Remedy.config_entry`). The registry
(:mod:`.registry`) calls a remedy only for an event it matches; a remedy that never acts is never called on an
incident. A user's package registers its own with :func:`~.registry.register_remedy` (docs/remedies.md).
"""
import copy
import enum
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..causes import Cause, Classification, SampleVerdict
from ..port import Change
from ..validate import Setting

__all__ = ["When", "Change", "Target", "Outcome", "ConfigEntry", "Context", "Run", "Incident", "Step", "HANDLERS",
           "Remedy", "Setting"]


class When(str, enum.Enum):
    """The events of a run the incident chain (and the watch) fire at remedies."""

    START = "start"  #: before the first iteration: re-apply what a resumed state or the patched config carries
    ATTACH = "attach data"  #: the training loader exists: what it must never serve (:attr:`Outcome.exclude`)
    HEALTHY = "healthy step"  #: every healthy optimizer step
    SKIPPED = "skipped step"  #: a step went wrong without diverging, and evidence names samples of its batch
    STALLED = "stalled"  #: a static loss scale skipped step after step
    BEFORE_RESTORE = "before restore"  #: a divergence, with the failing step at hand (its batch, its gradients)
    RESTORED = "restored"  #: a restore put back a state whose tags differ from the live ones: bring back what it undid
    AFTER_RESTORE = "after restore"  #: what a restore puts back must be changed after it
    AFTER_ROLLBACK = "after rollback"  #: after every rollback (and before a replay on healthy weights), any class
    HANDLED = "incident handled"  #: an incident was handled (recovered, or a stalled scale made dynamic)
    SPENT = "budget spent"  #: the recovery budget is spent on this class: name what the run stops on


@dataclass(frozen=True)
class Target:
    """A value a remedy puts in force in every optimizer param group, declared instead of set in place: the
    framework applies it, and applies it again after every rollback, on resume and in the next run (``carry=``), in
    every runner family; it never applies it twice (docs/remedies.md, "Declared targets").

    Attributes:
        key: the param group's key (``'weight_decay'``, ``'momentum'``), or an element of a tuple one
            (``'betas[1]'``). A group without it is left alone.
        value: the value to set, or with ``relative`` the factor of the configured value.
        relative: ``value`` times the configured value: the group's value when the remedy first declared the key in
            this run (or, in a run the patched config started, at its start), saved with the guard's state so that a
            resumed run multiplies the same value again. Defaults to False.
    """

    key: str
    value: float
    relative: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not re.fullmatch(r"[A-Za-z_]\w*(\[\d+\])?", self.key):
            raise ValueError(f"Target.key must be a param group's key, or 'key[i]' for a tuple's element, got "
                             f"{self.key!r}")
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) or not math.isfinite(self.value):
            raise ValueError(f"Target.value must be a finite number, got {self.value!r}")


@dataclass(frozen=True)
class Outcome:
    """What a remedy did at one event.

    Attributes:
        changes: the settings it changed (old and new values). Defaults to ().
        evidence: appended to the class's evidence (``'; ...'``). Defaults to "".
        signals: merged into the class's signals (JSON-ready). Defaults to {}.
        cause: the class becomes this one (e.g. structural: the class's remedies are spent). Defaults to None.
        exclude: at :attr:`When.ATTACH`, a container of dataset indices the loader must never serve. Defaults to None.
        targets: values it puts in force from now on (:class:`Target`): the framework applies them (their changes
            join :attr:`changes`) and keeps them in force. A key declared again replaces the earlier target.
            Defaults to ().
        samples: what it did with the samples evidence named (:class:`~..causes.SampleVerdict`: quarantined,
            refused, a stop on bad data), read by the chain as the class's ``samples`` and written in the record's
            signals. Defaults to None.
    """

    changes: Tuple[Change, ...] = ()
    evidence: str = ""
    signals: Mapping[str, Any] = field(default_factory=dict)
    cause: Optional[Cause] = None
    exclude: Any = None
    targets: Tuple[Target, ...] = ()
    samples: Optional[SampleVerdict] = None

    @classmethod
    def of(cls, result: Union["Outcome", Sequence[Change], None]) -> "Outcome":
        """A remedy's return value as an :class:`Outcome` (a list of changes, or None, is accepted too)."""
        if isinstance(result, Outcome):
            return result
        return cls(tuple(result or ()))

    def applied_to(self, c: Classification) -> Classification:
        """``c`` with this outcome's evidence, signals and class (a new object: classes are immutable)."""
        if not (self.evidence or self.signals or self.cause or self.samples):
            return c
        samples = self.samples or c.samples
        return c.but(cause=self.cause or c.cause, evidence=c.evidence + self.evidence, samples=samples,
                     signals={**c.signals, **self.signals, **(self.samples.signals() if self.samples else {})})


@dataclass(frozen=True)
class ConfigEntry:
    """A remedy's part of the patched config: what the next run needs to start where this one stands.

    Attributes:
        fix: :class:`~petr_stability.configfix.ConfigFix` fields, written where the config keeps them (``max_norm``,
            ``zero_dropout``, ``lr_factor``, ...). Defaults to {}.
        carry: what the config cannot express, carried in the ``NanGuardHook`` entry (``carry={name: ...}``) and
            given back to :meth:`Remedy.reapply` before the next run's first iteration. Defaults to {}.
        fallback: what to carry instead where the config has no key for a ``fix`` field (``{field: carry}``: an
            lr factor where the config holds no ``lr``). Defaults to {}.
    """

    fix: Mapping[str, Any] = field(default_factory=dict)
    carry: Mapping[str, Any] = field(default_factory=dict)
    fallback: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Context:
    """What a remedy may read when it acts (plain data and the adapter; remedies return what they change).

    Attributes:
        io: the runner adapter (:class:`~..port.GuardIO`).
        config: the guard's settings.
        event: the event fired.
        cls: the agreed class of the incident, where there is one. Defaults to None.
        incident: this recovery's 1-based number (the clip schedule's index). Defaults to 0.
        iteration: the iteration it acts at. Defaults to 0.
        samples: the samples evidence names (each a dict: ``index``, ids, ``rank``). Defaults to ().
        epoch: the pass over the data the iteration belongs to. Defaults to 0.
        history: the run's :class:`~..diagnosis.classify.CauseHistory`. Defaults to None.
        restored: at :attr:`When.RESTORED`, the restored point's tags. Defaults to {}.
        extra: what one point of the run hands its remedies (the grad-norm monitor). Defaults to {}.
        peers: the run's other remedies by name, for one that follows another's setting. Defaults to {}.
    """

    io: Any
    config: Any
    event: When
    cls: Optional[Classification] = None
    incident: int = 0
    iteration: int = 0
    samples: Sequence[Mapping[str, Any]] = ()
    epoch: int = 0
    history: Any = None
    restored: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)
    peers: Mapping[str, "Remedy"] = field(default_factory=dict)


@dataclass(frozen=True)
class Run:
    """What every event gives a remedy: the run it acts in.

    Attributes:
        io: the runner adapter (:class:`~..port.GuardIO`: the model, the optimizers, the clip, the log).
        config: the guard's settings (its own among them, by name).
        peers: the run's remedies by name, for one that follows another's setting. Defaults to {}.
    """

    io: Any
    config: Any
    peers: Mapping[str, "Remedy"] = field(default_factory=dict)


@dataclass(frozen=True)
class Incident:
    """What the incident events give a remedy (:attr:`When.SKIPPED`, :attr:`When.STALLED`,
    :attr:`When.BEFORE_RESTORE`, :attr:`When.RESTORED`, :attr:`When.AFTER_RESTORE`, :attr:`When.SPENT`).

    Attributes:
        cls: the agreed class of the incident (None for a stalled scale, which has none).
        number: this recovery's 1-based number (the clip schedule's index; 0 outside a divergence).
        iteration: the iteration it happened at.
        samples: the samples evidence names, each a dict (``index``, ids, ``rank``): at skipped step, before restore
            and budget spent; () elsewhere.
        epoch: the pass over the data the iteration belongs to.
        history: the run's :class:`~..diagnosis.classify.CauseHistory` (None at stalled).
    """

    cls: Optional[Classification]
    number: int = 0
    iteration: int = 0
    samples: Sequence[Mapping[str, Any]] = ()
    epoch: int = 0
    history: Any = None


@dataclass(frozen=True)
class Step:
    """What :attr:`When.HEALTHY` gives a remedy: the healthy step.

    Attributes:
        iteration: its number (1-based, as logged).
        spikes: the run's grad-norm monitor (:class:`~..watch.spikes.SpikeMonitor`: its window's mean and spread).
    """

    iteration: int
    spikes: Any = None


#: Each event's method (:class:`Remedy`), in the order of a run (docs/remedies.md, "The events").
HANDLERS: Mapping[When, str] = {
    When.START: "on_start", When.ATTACH: "on_attach", When.HEALTHY: "on_healthy", When.SKIPPED: "on_skipped",
    When.STALLED: "on_stalled", When.BEFORE_RESTORE: "before_restore", When.RESTORED: "on_restored",
    When.AFTER_RESTORE: "after_restore", When.AFTER_ROLLBACK: "after_rollback", When.HANDLED: "on_handled",
    When.SPENT: "on_spent"}

_Result = Union[Outcome, List[Change], None]


class Remedy:
    """One remedy. Subclasses set the class attributes and override what they do.

    Class attributes:
        name: its ``remedies=`` name (how logs, records, docs and the registry call it).
        causes: the incident classes it serves at :attr:`When.BEFORE_RESTORE` / :attr:`When.AFTER_RESTORE` (the
            dynamics class's remedies are the ladder's rungs: ``ladder=``). Other events are for any class.
        assists: classes it acts on at those events only beside the remedies that serve them, where its
            :meth:`match` finds the evidence for it; it serves none of them (without their own remedies switched
            on, such a class counts as unserved). Defaults to ().
        events: the events it takes; it is called for no other.
        switch: ``'remedies'`` (on when ``remedies=`` names it) or the name of the bool setting that switches it.
        restore: it is the rollback's switch: an incident of a class it serves rolls back while it is on. It takes no
            event for that (the chain asks; it is never called). Defaults to False.
        settings: its settings (the hook's arguments it adds), validated and documented here.
        state: the attributes saved in checkpoints by the registry's one generic pass, under
            ``remedies.<name>`` (their values at construction are the defaults an old checkpoint without them loads).
        order: where it fires among the remedies taking one event (lower first; equal: registration order). The
            built-ins declare 10 to 100 (the rollback's switch at 30, the learning rate at 50); defaults to 1000,
            after them.
        tags: the :attr:`state` attributes each restore point records, so that a restore can bring them back
            (:attr:`When.RESTORED` fires only where a restored tag differs from the live value).
        idle: its summary while it has not acted (the registry reads it without calling the remedy).
        label: how the cause table's action names it, with its settings' values filled in (``'learning rate x
            {lr_backoff:g}'``).

    Args:
        config: the guard's settings (:class:`~..config.GuardConfig`).
    """

    name: str = ""
    causes: Tuple[Cause, ...] = ()
    assists: Tuple[Cause, ...] = ()
    events: Tuple[When, ...] = ()
    switch: str = "remedies"
    restore: bool = False
    settings: Tuple[Setting, ...] = ()
    state: Tuple[str, ...] = ()
    order: int = 1000
    tags: Tuple[str, ...] = ()
    idle: Mapping[str, Any] = {}
    label: str = ""

    def __init__(self, config: Any) -> None:
        self.config = config

    @property
    def enabled(self) -> bool:
        """Switched on for this run (read by the registry; a remedy need not check it)."""
        if self.switch == "remedies":
            return self.name in self.config.remedies
        return bool(getattr(self.config, self.switch))

    def text(self) -> str:
        """How the cause table's action names it: :attr:`label` with this run's values of its settings."""
        return (self.label or self.name).format(**{s.name: getattr(self.config, s.name) for s in self.settings})

    def match(self, ctx: Context) -> bool:
        """Whether it acts at ``ctx`` beyond what it declares (an event it takes, a class it serves, switched on).
        Defaults to True."""
        return True

    def in_effect(self, ctx: Context) -> bool:
        """Everything it would set is in force already (a rung whose remedies all are is skipped). Defaults to
        False."""
        return False

    def can_repeat(self, ctx: Context) -> bool:
        """On a rung that repeats (:attr:`~.registry.Rung.repeat`): whether it can act once more on the next incident
        of the chain, its rung climbed again instead of the next. Defaults to False."""
        return False

    def apply(self, ctx: Context) -> _Result:
        """Acts at ``ctx.event``: calls that event's method (:data:`HANDLERS`) with what is valid there. Returns what
        it changed (an :class:`Outcome`, or just a list of changes). A remedy overrides the event's method, not this
        (an older remedy that overrides this one method keeps working)."""
        method, arguments = self._typed(ctx)
        return method(*arguments)

    def handler(self, ctx: Context) -> Tuple[Callable[..., _Result], Tuple[Any, ...]]:
        """The method ``ctx.event`` calls and its arguments: :meth:`apply` where the remedy overrides it, else the
        event's own method (the policy calls it: one method per event, no dispatch inside the remedy)."""
        if type(self).apply is not Remedy.apply:
            return self.apply, (ctx,)
        return self._typed(ctx)

    def _typed(self, ctx: Context) -> Tuple[Callable[..., _Result], Tuple[Any, ...]]:
        run = Run(ctx.io, ctx.config, ctx.peers)
        method = getattr(self, HANDLERS[ctx.event])
        if ctx.event == When.HEALTHY:
            return method, (run, Step(ctx.iteration, ctx.extra.get("spikes")))
        if ctx.event in (When.START, When.ATTACH, When.AFTER_ROLLBACK, When.HANDLED):
            return method, (run,)
        incident = Incident(ctx.cls, ctx.incident, ctx.iteration, tuple(ctx.samples), ctx.epoch, ctx.history)
        return method, ((run, incident, dict(ctx.restored)) if ctx.event == When.RESTORED else (run, incident))

    # ------------------------------------------------------------------ one method per event, in the order of a run
    def on_start(self, run: Run) -> _Result:
        """Before the first iteration, after a resume loaded its state: re-apply what it had put in force."""

    def on_attach(self, run: Run) -> _Result:
        """The training loader exists: ``Outcome(exclude=...)``, the dataset indices it must never serve."""

    def on_healthy(self, run: Run, step: Step) -> _Result:
        """Every healthy optimizer step (host numbers only: it runs on the hot path)."""

    def on_skipped(self, run: Run, incident: Incident) -> _Result:
        """A step went wrong without diverging (a skipped step, a refused batch), and evidence names samples of its
        batch (``incident.samples``)."""

    def on_stalled(self, run: Run, incident: Incident) -> _Result:
        """A static loss scale skipped step after step (``incident.cls`` is None)."""

    def before_restore(self, run: Run, incident: Incident) -> _Result:
        """A divergence of a class it serves, the failing step at hand (its batch, its gradients), before the
        rollback: what must be read from the failing state (the clip, the dropouts, which tensors exploded)."""

    def on_restored(self, run: Run, incident: Incident, restored: Mapping[str, Any]) -> _Result:
        """A restore put back a point whose :attr:`tags` (``restored``: its own, by attribute) differ from the live
        ones: bring back what the restore undid."""

    def after_restore(self, run: Run, incident: Incident) -> _Result:
        """A divergence of a class it serves, after the rollback: what the restore point's state must not undo (a
        :class:`Target` declared here is kept in force by the guard)."""

    def after_rollback(self, run: Run) -> _Result:
        """After every rollback, any class (and before a replay on healthy weights): start afresh what the restore
        does not hold (a temporal memory)."""

    def on_handled(self, run: Run) -> _Result:
        """An incident was handled (recovered, or a stalled scale made dynamic)."""

    def on_spent(self, run: Run, incident: Incident) -> _Result:
        """The recovery budget is spent on ``incident.cls``: ``Outcome(evidence=...)`` names what the run stops on."""

    def summary(self, io: Any) -> Dict[str, Any]:
        """Its part of the guard's summary (JSON-ready) once it acted. Defaults to its :attr:`state` values."""
        return {key: copy.deepcopy(getattr(self, key)) for key in self.state}

    def config_entry(self, io: Any) -> ConfigEntry:
        """What the patched config must hold once it acted. Defaults to carrying its :attr:`state` (given back to
        :meth:`reapply` in the next run)."""
        return ConfigEntry(carry={key: copy.deepcopy(getattr(self, key)) for key in self.state})

    def carry_in(self, carried: Mapping[str, Any]) -> None:
        """The next run's start: takes what :meth:`config_entry` carried as its state (then :attr:`When.START`
        fires, as after a resume)."""
        for key in self.state:
            if key in carried:
                setattr(self, key, copy.deepcopy(carried[key]))

    def reapply(self, carried: Mapping[str, Any], ctx: Context) -> List[Change]:
        """:meth:`carry_in`, then acts as at :attr:`When.START`; returns what that changed. The guard calls
        :meth:`carry_in` and fires the event itself (the targets an ``on_start`` declares are kept in force); a
        remedy that overrides this method is called instead, as before."""
        self.carry_in(carried)
        if When.START not in self.events or not self.match(ctx):
            return []
        return list(Outcome.of(self.apply(ctx)).changes)

    def load_value(self, key: str, value: Any) -> Any:
        """A state value read from a checkpoint, as the attribute holds it. Defaults to a copy of ``value``."""
        return copy.deepcopy(value)
