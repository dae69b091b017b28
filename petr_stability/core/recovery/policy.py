"""One run's remedies (:class:`Remedies`), and which of them an incident gets (:class:`CausePolicy`): the cause table
and the ladder.

:class:`Remedies` holds an instance of every registered remedy type: it fires an event only at the remedies that take
and match it, saves and loads their declared state in one generic pass, and reads the idle ones without calling them.
The policy chooses and fires events; the remedies (what they change, their state, their part of the summary and of
the patched config) are reached through the events they take only. The policy keeps
what is its own: the rung climbed in the current chain and the history of incidents. It never talks to other ranks
and never changes a class in place: every step returns a new :class:`~..causes.Classification`.
"""
import copy
from dataclasses import replace
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

from ...configfix.patch import ConfigFix
from ..causes import Cause, Classification, row
from ..config import GuardConfig
from ..diagnosis.classify import CauseHistory
from ..port import GuardIO, Payload
from ..remedies.base import Change, ConfigEntry, Context, Outcome, Remedy, When
from ..remedies.registry import LADDER, REMEDY_TYPES, Rung, ladder_of, serving
from ..remedies.targets import CARRY_KEY, Targets

__all__ = ["Rung", "LADDER", "Remedies", "CausePolicy"]

#: Where checkpoints written before every remedy had its own ``remedies.<name>`` entry kept the built-ins' state: the
#: guard state's top level and its ``policy`` section (read back when a checkpoint has no entry for the remedy).
_LEGACY_SECTIONS = ("", "policy")


class Remedies:
    """One run's remedies: an instance of each registered type, their state, their summary, and who acts when.

    Args:
        config: the guard's settings.
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self.all: Tuple[Remedy, ...] = tuple(cls(config) for cls in REMEDY_TYPES.values())
        self.by_name: Dict[str, Remedy] = {r.name: r for r in self.all}
        self.ladder = ladder_of(getattr(config, "ladder", None))
        self._defaults = {r.name: {k: copy.deepcopy(getattr(r, k)) for k in r.state} for r in self.all}
        self._by_event: Dict[When, List[Remedy]] = {e: [r for r in self.all if e in r.events] for e in When}
        #: Remedies that changed something in this run (their summary and patched-config entry are asked for).
        self.acted: set = set()
        #: What remedies declared (:class:`~..remedies.base.Target`): kept in force here.
        self.targets = Targets()

    def __iter__(self) -> Iterator[Remedy]:
        return iter(self.all)

    def get(self, name: str) -> Remedy:
        """The remedy called ``name``."""
        return self.by_name[name]

    # ------------------------------------------------------------------ events
    def context(self, io: Any, event: When, **fields: Any) -> Context:
        """The :class:`~.base.Context` remedies get at ``event``."""
        return Context(io, self.config, event, peers=self.by_name, **fields)

    def takers(self, event: When, ctx: Context, names: Optional[Iterable[str]] = None) -> List[Remedy]:
        """The switched-on remedies that take ``event`` (among ``names`` where given, a ladder's rung) and match
        ``ctx``; at the restore events, only those serving or assisting the incident's class (a remedy declaring
        ``dynamics`` alone is not called for an ``unknown`` incident, on a rung or not)."""
        chosen = None if names is None else set(names)
        out = []
        for r in self._by_event[event]:
            if not r.enabled or (chosen is not None and r.name not in chosen):
                continue
            if event in (When.BEFORE_RESTORE, When.AFTER_RESTORE) and (
                    ctx.cls is None or ctx.cls.cause not in r.causes + r.assists):
                continue
            if r.match(ctx):
                out.append(r)
        return out

    def fire(self, event: When, ctx: Context, names: Optional[Iterable[str]] = None) -> Outcome:
        """Every remedy that takes ``event`` acts in registration order, each seeing the class as the ones before
        left it; their outcomes as one (changes in order, the class's evidence and signals added up)."""
        changes: List[Any] = []
        signals: Dict[str, Any] = {}
        evidence, cause, exclude, samples = "", None, [], None
        for r in self.takers(event, ctx, names):
            out = self._call(r, ctx)
            if out.changes or out.targets:
                self.acted.add(r.name)
            changes += out.changes
            evidence, signals, cause = evidence + out.evidence, {**signals, **out.signals}, out.cause or cause
            samples = out.samples or samples
            if out.exclude is not None:
                exclude.append(out.exclude)
            if ctx.cls is not None:
                ctx = replace(ctx, cls=out.applied_to(ctx.cls))
        return Outcome(tuple(changes), evidence, signals, cause, exclude or None, samples=samples)

    def _call(self, r: Remedy, ctx: Context) -> Outcome:
        """``r``'s method for ``ctx.event``; the targets it declares are applied (their changes join its own) and kept
        in force."""
        method, arguments = r.handler(ctx)
        out = Outcome.of(method(*arguments))
        if out.targets:
            out = replace(out, changes=tuple(out.changes) + tuple(self.targets.declare(r.name, out.targets, ctx.io)))
        return out

    def enforce(self, io: Any) -> List[Change]:
        """Every declared target in force (:meth:`~..remedies.targets.Targets.enforce`); nothing is entered where no
        remedy declared one."""
        return self.targets.enforce(io) if self.targets.by_remedy else []

    def serves(self, cause: Cause) -> bool:
        """Whether any switched-on remedy acts on ``cause`` (the rollback, which every class that rolls back takes,
        is no answer to one by itself)."""
        return any(self.by_name[n].enabled and not self.by_name[n].restore
                   for n in serving(cause, self.ladder) if n in self.by_name)

    # ------------------------------------------------------------------ state, in one generic pass
    def _part(self, r: Remedy, state: Mapping[str, Any]) -> Mapping[str, Any]:
        own = dict(state.get("remedies") or {})
        if r.name in own or state.get("remedies_layout"):
            return dict(own.get(r.name) or {})
        legacy = [dict(state.get(s) or {}) if s else state for s in _LEGACY_SECTIONS]
        return {k: part[k] for part in legacy for k in r.state if k in part}

    def state_dict(self) -> Dict[str, Any]:
        """Their state as the guard's checkpoint state holds it: ``remedies.<name>``, one entry per remedy with state
        (``remedies_layout`` marks the layout; an older checkpoint's top-level keys and ``policy`` section load)."""
        state: Dict[str, Any] = {"policy": {}, "remedies": {}, "remedies_layout": 2}
        if self.targets.by_remedy:
            state["targets"] = self.targets.state_dict()
        for r in self.all:
            if r.state:
                state["remedies"][r.name] = {k: copy.deepcopy(getattr(r, k)) for k in r.state}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The inverse of :meth:`state_dict`; keys a checkpoint lacks keep their defaults (old checkpoints load)."""
        self.targets.load_state_dict(state.get("targets") or {})
        for r in self.all:
            part = self._part(r, state)
            for key in r.state:
                if key in part:
                    setattr(r, key, r.load_value(key, part[key]))

    def idle(self, r: Remedy) -> bool:
        """It never changed anything in this run, and its state is its defaults (no call into it)."""
        return r.name not in self.acted and r.name not in self.targets.by_remedy and all(
            getattr(r, k) == v for k, v in self._defaults[r.name].items())

    def tags(self) -> Dict[str, Any]:
        """What a restore point records of them: ``{'<remedy>.<attribute>': value}``."""
        return {f"{r.name}.{k}": copy.deepcopy(getattr(r, k)) for r in self.all for k in r.tags}

    def tags_in(self, guard_state: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
        """The tags a checkpoint's guard state holds (a tag it lacks: the remedy's default)."""
        out = {}
        for r in self.all:
            part = self._part(r, guard_state or {})
            for k in r.tags:
                out[f"{r.name}.{k}"] = r.load_value(k, part[k]) if k in part else self._defaults[r.name][k]
        return out

    def restored(self, io: Any, tags: Mapping[str, Any], **fields: Any) -> Outcome:
        """A restore put back a point with ``tags``: :attr:`~.base.When.RESTORED` for the remedies whose tags there
        differ from the live values, each given its own (``ctx.restored``)."""
        live = self.tags()
        changed = {t.split(".", 1)[0] for t, v in tags.items() if t in live and live[t] != v}
        outcomes = []
        for name in sorted(changed, key=list(self.by_name).index):
            own = {t.split(".", 1)[1]: v for t, v in tags.items() if t.startswith(name + ".")}
            ctx = self.context(io, When.RESTORED, restored=own, **fields)
            outcomes.append(self.fire(When.RESTORED, ctx, [name]))
        return Outcome(tuple(c for o in outcomes for c in o.changes))

    # ------------------------------------------------------------------ what they put in force
    def summary(self, io: Any) -> Dict[str, Any]:
        """The settings they put in force (the summary's part): an idle remedy's declared ``idle`` summary."""
        out: Dict[str, Any] = {}
        for r in self.all:
            out.update(copy.deepcopy(dict(r.idle)) if self.idle(r) else r.summary(io))
        if self.targets.by_remedy:
            out["targets"] = self.targets.summary()
        return out

    def config_entries(self, io: Any) -> Dict[str, ConfigEntry]:
        """Each remedy's patched-config entry, for those that acted (by name); its declared targets ride in its
        ``carry`` entry."""
        entries = {r.name: r.config_entry(io) for r in self.all if not self.idle(r)}
        for name, entry in entries.items():
            if name in self.targets.by_remedy:
                entries[name] = replace(entry, carry={**entry.carry, CARRY_KEY: self.targets.carried(name)})
        return entries

    def reapply(self, carry: Mapping[str, Mapping[str, Any]], io: Any, log: Any) -> List[Any]:
        """The patched config's ``carry={name: ...}`` given back to each remedy before the first iteration; returns the
        changes (an entry for a remedy not registered here is named in a warning)."""
        changes: List[Any] = []
        for name, carried in carry.items():
            r = self.by_name.get(name)
            if r is None:
                log(f"NanGuard: carry names remedy {name!r}, which is not registered here (its package not in "
                    "custom_imports?): not re-applied", "warning")
                continue
            carried = dict(carried or {})
            targets = dict(carried.pop(CARRY_KEY, None) or {})
            done = self._carried_in(r, carried, self.context(io, When.START))
            done += self.targets.take_carried(name, targets, io) if targets else []
            if done or targets:
                self.acted.add(name)
            changes += done
        return changes


    def _carried_in(self, r: Remedy, carried: Mapping[str, Any], ctx: Context) -> List[Change]:
        """``r`` takes its carried state and acts as at start (what it declares as targets is kept in force)."""
        if type(r).reapply is not Remedy.reapply:  # a remedy that re-applies itself
            return list(r.reapply(carried, ctx))
        r.carry_in(carried)
        if When.START not in r.events or not r.match(ctx):
            return []
        return list(self._call(r, ctx).changes)


class CausePolicy:
    """The state of cause-aware recovery over a run, and the events it fires at the remedies.

    Args:
        config: the guard's settings.
    """

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.remedies = Remedies(config)
        self.ladder = self.remedies.ladder
        self.history = CauseHistory(first_iterations=config.first_iterations)
        #: Rungs climbed in the current chain of dynamics incidents (0: the next incident gets rung 1).
        self.rung = 0

    def remedy(self, name: str) -> Remedy:
        """The run's remedy called ``name`` (its state: ``policy.remedy('quarantine').skip_list``)."""
        return self.remedies.get(name)

    # ------------------------------------------------------------------ the table, as text
    def ladder_text(self) -> str:
        """The ladder as the cause table's action names it, with this run's settings."""
        texts = []
        for rung in self.ladder:
            members = [self.remedies.get(n) for n in rung.remedies]
            # A rung of the declared ladder is named by its first remedy (the known manual fix by the clip's).
            text = members[0].text() if rung in LADDER else " + ".join(r.text() for r in members)
            texts.append(text + (" (again at each incident while it can act: down to lr_min_factor)"
                                 if rung.repeat else ""))
        return ", then ".join(texts)

    def action_text(self, cause: Cause) -> str:
        """The table's action for ``cause`` with this run's ladder and ``lr_backoff`` filled in."""
        backoff = getattr(self.config, "lr_backoff", "lr_backoff")
        overflow = getattr(self.config, "overflow_lr_backoff", "overflow_lr_backoff")
        return row(cause).action.format(ladder=self.ladder_text(), lr_backoff=backoff, overflow_lr_backoff=overflow)

    def enabled(self, cause: Cause) -> bool:
        """Whether any remedy for ``cause`` is switched on."""
        return self.remedies.serves(cause)

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> Dict[str, Any]:
        """The remedies' state (``remedies.<name>``) and the policy's own (the ``policy`` section)."""
        state = self.remedies.state_dict()
        state["policy"].update(history=self.history.state_dict(), rung=self.rung)
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.remedies.load_state_dict(state)
        own = dict(state.get("policy") or {})
        self.history.load_state_dict(own.get("history", {}))
        self.rung = int(own.get("rung", 0))

    def summary(self, io: GuardIO) -> Dict[str, Any]:
        """The settings the remedies put in force, and the ladder's rungs that held."""
        return dict(self.remedies.summary(io), held=[i["held"]["rung"] for i in self.history.incidents
                                                     if (i.get("held") or {}).get("rung")])

    def tags(self) -> Dict[str, Any]:
        """What a restore point records of the remedies (their declared tags)."""
        return self.remedies.tags()

    def config_fix(self, io: GuardIO) -> ConfigFix:
        """What a config must change to start where the live run stands: each remedy that acted says its part (its
        :meth:`~..remedies.base.Remedy.config_entry`: settings the config keeps, and what only the hook entry can
        carry), nothing else."""
        fields: Dict[str, Any] = {}
        carry: Dict[str, Dict[str, Any]] = {}
        fallback: Dict[str, Dict[str, Dict[str, Any]]] = {}
        for name, entry in self.remedies.config_entries(io).items():
            fields.update(entry.fix)
            if entry.carry:
                carry[name] = dict(entry.carry)
            for field_name, value in entry.fallback.items():
                fallback.setdefault(field_name, {})[name] = dict(value)
        return ConfigFix(**fields, carry=carry, fallback=fallback)

    # ------------------------------------------------------------------ outside an incident
    def start(self, io: GuardIO) -> List[Change]:
        """Before the first iteration: what a resumed state recorded, then what the patched config carries
        (``carry=``), re-applied. Returns the changes."""
        changes = list(self.remedies.fire(When.START, self.remedies.context(io, When.START)).changes)
        changes += self.remedies.enforce(io)  # a resumed state's targets: changes nothing where they hold
        carried = self.remedies.reapply(self.config.carry, io, io.log) if self.config.carry else []
        for change in carried:
            io.log(f"NanGuard: carried from the earlier run: {change.target}: {change.old} -> {change.new}")
        return changes + carried

    def attach(self, io: GuardIO) -> Any:
        """The training loader exists: the container of dataset indices it must never serve."""
        outcome = self.remedies.fire(When.ATTACH, self.remedies.context(io, When.ATTACH))
        parts = list(outcome.exclude or [])
        return parts[0] if len(parts) == 1 else _Union(parts)

    def on_healthy(self, io: GuardIO, spikes: Any, iteration: int = 0) -> None:
        """A healthy step: the remedies that act on every one (the adaptive clip, the learning rate's re-warm)."""
        ctx = self.remedies.context(io, When.HEALTHY, iteration=iteration, extra={"spikes": spikes})
        if self.remedies.takers(When.HEALTHY, ctx):
            self.remedies.fire(When.HEALTHY, ctx)

    def event(self, event: When, io: GuardIO, c: Optional[Classification] = None, **fields: Any) -> Outcome:
        """Fires ``event`` (stalled, skipped, handled) at the remedies that take it."""
        return self.remedies.fire(event, self.remedies.context(io, event, cls=c, history=self.history, **fields))

    def fresh_state(self, io: GuardIO) -> List[str]:
        """The temporal state of a healthy moment for a replay on its weights: what every rollback starts afresh
        (:attr:`~..remedies.base.When.AFTER_ROLLBACK`); the modules reset."""
        outcome = self.remedies.fire(When.AFTER_ROLLBACK, self.remedies.context(io, When.AFTER_ROLLBACK))
        return list(outcome.signals.get("temporal_reset") or [])

    # ------------------------------------------------------------------ one incident
    def before_restore(self, c: Classification, io: GuardIO, samples: Sequence[Dict[str, Any]],
                       incident: int) -> Tuple[Classification, List[Change]]:
        """The remedies that need the failing step (its samples, its gradients), before the restore. Returns the
        class they leave (structural where its remedies are spent) and what they changed."""
        if c.cause == Cause.FORWARD_OVERFLOW and not self.enabled(Cause.FORWARD_OVERFLOW):
            c = c.but(cause=Cause.DYNAMICS, evidence=c.evidence + "; the fp32 remedy is off: the ladder instead",
                      signals={**c.signals, "evidence_cause": Cause.FORWARD_OVERFLOW.value})
        ctx = self.remedies.context(io, When.BEFORE_RESTORE, cls=c, incident=incident, samples=samples,
                                    iteration=int(c.signals.get("iteration") or 0), history=self.history)
        names = None
        if c.cause in (Cause.DYNAMICS, Cause.UNKNOWN):
            c, names = self._climb(ctx)
            if c.cause == Cause.STRUCTURAL:
                return c.but(action=self.action_text(c.cause)), []
            ctx = self.remedies.context(io, When.BEFORE_RESTORE, cls=c, incident=incident, samples=samples,
                                        iteration=ctx.iteration, history=self.history)
        outcome = self.remedies.fire(When.BEFORE_RESTORE, ctx, names)
        after = outcome.applied_to(c)
        if after.cause == Cause.STRUCTURAL and c.cause != Cause.STRUCTURAL:
            self.history.mark_spent(c.cause, after.evidence)
            after = after.but(signals={**after.signals, "spent": c.cause.value})  # every remedy tried: evidence enough
        return after.but(action=self.action_text(after.cause)), list(outcome.changes)

    def rolls_back(self, c: Classification, io: GuardIO) -> bool:
        """Whether ``c`` rolls back: its row says so and a switched-on remedy that is the rollback's switch
        (:attr:`~..remedies.base.Remedy.restore`) serves its class."""
        return row(c.cause).rolls_back and any(r.enabled and r.restore and c.cause in r.causes for r in self.remedies)

    def after_restore(self, c: Classification, io: GuardIO, payload: Payload,
                      incident: int) -> Tuple[Classification, List[Change], List[str]]:
        """After a rollback: what the restore undid brought back (the remedies whose restore tags differ), the
        ladder's later rungs, then every rollback's own remedies. Returns (the class with what they add to its
        evidence, the changes, the modules started afresh)."""
        changes = list(self.remedies.restored(io, payload.tags, cls=c, incident=incident).changes)
        changes += self.remedies.enforce(io)  # what the restore put back, in either runner family
        names = None if c.cause not in (Cause.DYNAMICS, Cause.UNKNOWN) else (
            () if c.signals.get("rollback_alone") else self._dynamics())
        if names is None or names:
            ctx = self.remedies.context(io, When.AFTER_RESTORE, cls=c, incident=incident, history=self.history)
            outcome = self.remedies.fire(When.AFTER_RESTORE, ctx, names)
            changes += outcome.changes
            c = outcome.applied_to(c)
        return c, changes, self.fresh_state(io)

    def spent(self, c: Classification, io: GuardIO, samples: Sequence[Dict[str, Any]]) -> Classification:
        """The recovery budget is spent on class ``c``: what its remedies name (every bad sample for data)."""
        return self.event(When.SPENT, io, c, samples=samples).applied_to(c)

    def held(self, iteration: int) -> Optional[str]:
        """A recovery held (a state taken after it is confirmed): the chain ends; the rung that held, if any, is
        recorded with the newest incident (persisted with the guard's state)."""
        rung, self.rung = self.rung, 0
        name = self.ladder[rung - 1].name if 1 <= rung <= len(self.ladder) else None
        last = self.history.last()
        if last is not None and "held" not in last:
            last["held"] = {"iteration": iteration, "rung": name}
        return name

    def record(self, c: Classification, iteration: int, restored_to: Optional[int]) -> None:
        """Remembers the incident by what its evidence showed (a data incident handled by the ladder is data)."""
        evidence = c.signals.get("evidence_cause")
        as_seen = Classification(Cause(evidence), c.evidence, c.modules) if evidence else c
        self.history.record(as_seen, iteration, restored_to)
        # Samples taken, or named but refused for the bound: either way the next batch breaking at once shows every
        # batch breaks. Samples that could not be named at all (an iterable dataset without ids) prove nothing.
        self.history.incidents[-1]["quarantined"] = bool(c.samples and (c.samples.quarantined or c.samples.refused))

    # ------------------------------------------------------------------ the ladder
    def _dynamics(self) -> Tuple[str, ...]:
        """The remedies a dynamics incident fires: the current rung's, then any other declaring the class."""
        rung = self.ladder[self.rung - 1].remedies if 1 <= self.rung <= len(self.ladder) else ()
        on_ladder = {n for r in self.ladder for n in r.remedies}
        return rung + tuple(n for n, r in self.remedies.by_name.items()
                            if Cause.DYNAMICS in r.causes and n not in on_ladder and not r.restore)

    def _climb(self, ctx: Any) -> Tuple[Classification, Optional[Tuple[str, ...]]]:
        """The next rung for a dynamics incident: (the class, the remedies to fire; structural past the last)."""
        c = ctx.cls
        if c.signals.get("between_steps") and self.rung == 0 and not (
                self.history.count(Cause.DYNAMICS) or self.history.count(Cause.UNKNOWN)):
            # The training did not put the NaN there, and nothing diverged before: no setting is changed without
            # evidence the dynamics need it (no remedy fires). A next divergence of the run climbs the ladder.
            first = f" ({self.ladder[0].name} first)" if self.ladder else ""
            return c.but(evidence=c.evidence + f"; a rollback alone, no setting changed: the ladder{first} from the "
                                               "run's next divergence on",
                         signals={**c.signals, "rollback_alone": True}), ()
        held = self.ladder[self.rung - 1] if 1 <= self.rung <= len(self.ladder) else None
        acting = [] if held is None or not held.repeat else [
            r for r in (self.remedies.get(n) for n in held.remedies) if r.enabled]
        again = bool(acting) and all(r.can_repeat(ctx) for r in acting)
        self.rung += 0 if again else 1
        first = [self.remedies.get(n) for n in self.ladder[0].remedies] if self.ladder else []
        if self.rung == 1 and all(not r.enabled or r.in_effect(ctx) for r in first):
            # A rollback that changes nothing is a rollback spent: a new chain starts at the next rung.
            self.rung = 2
            c = c.but(evidence=c.evidence + f"; {self.ladder[0].name} is in force already: the next rung")
        if self.rung > len(self.ladder):
            self.history.mark_spent(Cause.DYNAMICS, "every rung of the ladder was tried")
            rungs = ", ".join(r.name for r in self.ladder)
            return c.but(cause=Cause.STRUCTURAL, signals={**c.signals, "spent": "ladder"},
                         evidence=c.evidence + f"; divergences kept coming after every rung ({rungs})"), ()
        return c, self._dynamics()


class _Union:
    """Dataset indices any of several containers holds (several remedies filtering what the loader serves)."""

    def __init__(self, parts: List[Any]) -> None:
        self.parts = parts

    def __contains__(self, index: Any) -> bool:
        return any(index in part for part in self.parts)

    def __bool__(self) -> bool:
        return any(bool(part) for part in self.parts)
