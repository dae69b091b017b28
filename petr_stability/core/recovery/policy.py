"""Which remedies a confirmed divergence gets, from its agreed class: :data:`~..causes.CAUSE_TABLE` and the ladder.

The policy only chooses and dispatches: the remedies themselves (what they change, their state, their part of the
summary) are the objects of :mod:`..remedies.registry`, and the ladder and each class's remedies are read from
there. The policy keeps what is its own: the rung climbed in the current chain and the history of incidents. It
never talks to other ranks: the class it acts on was agreed before (:mod:`.chain`).
"""
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..causes import Cause, Classification, row
from ..config import GuardConfig
from ..diagnosis.classify import CauseHistory
from ..port import GuardIO, Payload
from ..remedies import Change
from ..remedies.base import Context, When
from ..remedies.registry import LADDER, Remedies, Rung, ladder_text

__all__ = ["Rung", "LADDER", "CausePolicy"]


class CausePolicy:
    """The state of cause-aware recovery over a run, and the dispatch to its remedies.

    Args:
        config: the guard's settings.
    """

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.registry = Remedies(config)
        self.history = CauseHistory(first_iterations=config.first_iterations)
        #: Rungs climbed in the current chain of dynamics incidents (0: the next incident gets rung 1).
        self.rung = 0

    def __getattr__(self, name: str) -> Any:
        # A remedy's state read by its checkpoint key (policy.skip, policy.fp32): the registry's to name.
        if name in ("registry", "__setstate__") or name.startswith("__"):
            raise AttributeError(name)
        return self.registry.state_attribute(name)

    def context(self, io: GuardIO, **fields: Any) -> Context:
        """What the remedies get at one point of the run."""
        return Context(io, history=self.history, remedies=self.registry, **fields)

    # ------------------------------------------------------------------ the table, as text
    def action_text(self, cause: Cause) -> str:
        """The table's action for ``cause`` with this run's ladder and ``lr_backoff`` filled in."""
        return row(cause).action.format(ladder=ladder_text(self.config), lr_backoff=self.config.lr_backoff)

    def enabled(self, cause: Cause) -> bool:
        """Whether any remedy for ``cause`` is switched on."""
        return self.registry.serves(cause)

    # ------------------------------------------------------------------ setup and persistence
    def setup(self, io: GuardIO) -> None:
        """Re-applies the remedies recorded in a resumed state (once the runner's objects exist)."""
        for remedy in self.registry:
            remedy.resume(io)

    def skip_list(self, io: GuardIO) -> Any:
        """The quarantine the training loader's sampler honours (:meth:`..remedies.quarantine.Quarantine.skip_list`)."""
        return self.registry.get("quarantine").skip_list(io)

    def state_dict(self) -> Dict[str, Any]:
        """The remedies' state (top-level keys and the ``policy`` section) with the policy's own in that section."""
        state = self.registry.state_dict()
        state["policy"].update(history=self.history.state_dict(), rung=self.rung)
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.registry.load_state_dict(state)
        own = dict(state.get("policy") or {})
        self.history.load_state_dict(own.get("history", {}))
        self.rung = int(own.get("rung", 0))

    def summary(self, io: GuardIO) -> Dict[str, Any]:
        """The settings the remedies put in force, and the ladder's rungs that held."""
        return dict(self.registry.summary(io), held=[i["held"]["rung"] for i in self.history.incidents
                                                    if (i.get("held") or {}).get("rung")])

    def tags(self) -> Dict[str, Any]:
        """What a restore point records of the remedies (the learning-rate factor in force)."""
        return self.registry.tags()

    # ------------------------------------------------------------------ outside an incident
    def on_healthy(self, io: GuardIO, spikes: Any) -> None:
        """A healthy step: the remedies that act on every one (the adaptive clip)."""
        self.registry.at(When.HEALTHY, self.context(io, extra={"spikes": spikes}))

    def on_stall(self, io: GuardIO, iteration: int) -> List[Change]:
        """A static loss scale stalled training: what the stall's remedies changed (none: nothing could)."""
        return self.registry.at(When.STALLED, self.context(io, iteration=iteration))

    def recurring(self, io: GuardIO, named: List[Dict[str, Any]], epoch: int,
                  iteration: int) -> Optional[Tuple[List[Change], List[Dict[str, Any]], str]]:
        """Samples a wrong step named: (changes, samples, reason) for a ``recurring_sample`` record, or None."""
        return self.registry.get("quarantine").recurring(self.context(io, iteration=iteration), named, epoch)

    def after_incident(self, io: GuardIO) -> None:
        """An incident was handled: remedies that follow the others' settings catch up (the adaptive clip's base)."""
        ctx = self.context(io)
        for remedy in self.registry:
            remedy.after_incident(ctx)

    # ------------------------------------------------------------------ one incident
    def act(self, c: Classification, io: GuardIO, ids: Sequence[Dict[str, Any]], incident: int) -> List[Change]:
        """The remedies that need the failing step (its batches' ids, its gradients), before the restore.

        May turn ``c`` structural (edited in place) when its class has no remedy left.

        Args:
            c: the agreed class.
            io: the adapter.
            ids: the sample ids of the batches that broke (only the ranks whose own batch broke name theirs).
            incident: this recovery's 1-based number (the clip schedule's index).
        """
        c.action = self.action_text(c.cause)
        ctx = self.context(io, incident=incident, cls=c, ids=ids, iteration=int(c.signals.get("iteration") or 0))
        if c.cause == Cause.FORWARD_OVERFLOW and not self.enabled(Cause.FORWARD_OVERFLOW):
            c.signals["evidence_cause"] = Cause.FORWARD_OVERFLOW.value
            c.cause, c.evidence = Cause.DYNAMICS, c.evidence + "; the fp32 remedy is off: the ladder instead"
        if c.cause in (Cause.DYNAMICS, Cause.UNKNOWN):
            changes = self._climb(ctx)
        else:
            changes = [change for remedy in self.registry if c.cause in remedy.causes and remedy.when ==
                       When.BEFORE_RESTORE for change in remedy.apply(ctx)]
        c.action = self.action_text(c.cause)
        return changes

    def after_restore(self, c: Classification, io: GuardIO, payload: Payload,
                      incident: int) -> Tuple[List[Change], List[str]]:
        """After a rollback: what the restore undid brought back (a backoff re-applied to an older state), the
        ladder's later rungs, then every rollback's own remedies. Returns (changes, modules started afresh)."""
        ctx = self.context(io, incident=incident, cls=c, extra={"restored": payload})
        for remedy in self.registry:
            remedy.restored(ctx)
        changes: List[Change] = []
        if c.cause in (Cause.DYNAMICS, Cause.UNKNOWN) and 1 <= self.rung <= len(LADDER):
            changes = [change for remedy in self.registry.of_rung(self.rung) if remedy.when == When.AFTER_RESTORE
                       for change in remedy.apply(ctx)]
        fresh = [name for remedy in self.registry if remedy.when == When.AFTER_ROLLBACK
                 for name in remedy.after_rollback(ctx)]
        return changes, fresh

    def held(self, iteration: int) -> Optional[str]:
        """A recovery held (a state taken after it is confirmed): the chain ends; the rung that held, if any, is
        recorded with the newest incident (persisted with the guard's state)."""
        rung, self.rung = self.rung, 0
        last = self.history.last()
        if last is not None and "held" not in last:
            last["held"] = {"iteration": iteration, "rung": LADDER[rung - 1].name if rung else None}
        return LADDER[rung - 1].name if rung else None

    def record(self, c: Classification, iteration: int, restored_to: Optional[int]) -> None:
        """Remembers the incident by what its evidence showed (a data incident handled by the ladder is data)."""
        evidence = c.signals.get("evidence_cause")
        as_seen = Classification(Cause(evidence), c.evidence, c.modules) if evidence else c
        self.history.record(as_seen, iteration, restored_to)
        # Samples taken, or named but refused for the bound: either way the next batch breaking at once shows every
        # batch breaks. Samples that could not be named at all (an iterable dataset without ids) prove nothing.
        self.history.incidents[-1]["quarantined"] = bool(c.signals.get("quarantined") or c.signals.get("refused"))

    # ------------------------------------------------------------------ the ladder
    def _climb(self, ctx: Context) -> List[Change]:
        c = ctx.cls
        self.rung += 1
        if self.rung == 1 and all(r.in_effect(ctx) for r in self.registry.of_rung(1)):
            # A rollback that changes nothing is a rollback spent: a new chain starts at the next rung.
            self.rung = 2
            c.evidence += "; the known manual fix is in force already: the next rung"
        if self.rung > len(LADDER):
            self.history.mark_spent(Cause.DYNAMICS, "every rung of the ladder was tried")
            c.cause = Cause.STRUCTURAL
            c.evidence += f"; divergences kept coming after every rung ({', '.join(r.name for r in LADDER)})"
            return []
        members = self.registry.of_rung(self.rung)
        for remedy in members:
            remedy.prepare(ctx)
        return [change for remedy in members if remedy.when == When.BEFORE_RESTORE for change in remedy.apply(ctx)]
