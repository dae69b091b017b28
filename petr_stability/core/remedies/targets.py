"""Declared targets (:class:`~.base.Target`): what remedies put in force in the optimizer's param groups, applied by
one framework helper and kept in force, never applied twice.

A remedy returns its targets in its :class:`~.base.Outcome`; :class:`Targets` applies them at once, again after
every rollback (MMEngine's restore puts the param groups of the restore point back, MMCV 1.x's keeps the live
ones: after either the target holds), at the start of a resumed run (its state saved here) and in the next run
(carried in the patched config without the configured values, which that run reads afresh). A relative target
multiplies the value the group had when the key was first declared, saved with the state: a resumed run, whose
groups hold the changed value already, sets the same value again, which changes nothing.
"""
import re
from typing import Any, Dict, Iterable, List, Mapping, Tuple

from ..port import Change
from .base import Target

__all__ = ["Targets", "CARRY_KEY"]

#: The key of a remedy's ``carry=`` entry that holds its targets.
CARRY_KEY = "_targets"


def _split(key: str) -> Tuple[str, Any]:
    name, index = re.fullmatch(r"(\w+)(?:\[(\d+)\])?", key).groups()
    return name, None if index is None else int(index)


class Targets:
    """Every remedy's declared targets (``{remedy: {key: {'value', 'relative', 'base': {'<opt>.<group>': v}}}}``),
    applied to the optimizers :meth:`~..port.GuardIO.optimizers` returns."""

    def __init__(self) -> None:
        self.by_remedy: Dict[str, Dict[str, Dict[str, Any]]] = {}

    def declare(self, name: str, targets: Iterable[Target], io: Any) -> List[Change]:
        """``name``'s targets from now on (a key declared again replaces the earlier value, keeping the configured
        value it is relative to); applies every target. Returns what changed."""
        own = self.by_remedy.setdefault(name, {})
        for t in targets:
            base = dict(own.get(t.key, {}).get("base") or {})
            own[t.key] = {"value": float(t.value), "relative": bool(t.relative), "base": base}
        return self.enforce(io)

    def enforce(self, io: Any) -> List[Change]:
        """Every target in force: each param group that holds its key set to it where it differs. Returns what
        changed (none where every target holds: resumed, or a restore that kept the live groups)."""
        changes: List[Change] = []
        for own in self.by_remedy.values():
            for key, target in own.items():
                changes += self._apply(key, target, io.optimizers())
        return changes

    @staticmethod
    def _apply(key: str, target: Dict[str, Any], optimizers: Any) -> List[Change]:
        name, index = _split(key)
        changes = []
        for i, optimizer in enumerate(optimizers):
            for j, group in enumerate(optimizer.param_groups):
                held = group.get(name)
                if held is None or (index is not None and not (isinstance(held, (tuple, list)) and index < len(held))):
                    continue
                now = float(held[index] if index is not None else held)
                new = target["value"]
                if target["relative"]:
                    new *= target["base"].setdefault(f"{i}.{j}", now)
                if now == new:
                    continue
                changes.append(Change(f"optimizer{i}.group{j}.{key}", now, new))
                if index is None:
                    group[name] = new
                else:
                    values = list(held)
                    values[index] = new
                    group[name] = type(held)(values)
        return changes

    # ------------------------------------------------------------------ state, summary, carry
    def state_dict(self) -> Dict[str, Any]:
        """JSON-ready: every target with the configured values it is relative to."""
        return {n: {k: dict(t, base=dict(t["base"])) for k, t in own.items()} for n, own in self.by_remedy.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.by_remedy = {n: {k: {"value": float(t["value"]), "relative": bool(t["relative"]),
                                  "base": {g: float(v) for g, v in dict(t.get("base") or {}).items()}}
                              for k, t in dict(own).items()} for n, own in dict(state or {}).items()}

    def summary(self) -> Dict[str, Dict[str, str]]:
        """What each remedy holds in force, as text (``{'decay': {'weight_decay': 'x 0.5'}}``)."""
        return {n: {k: (f"x {t['value']:g}" if t["relative"] else f"{t['value']:g}") for k, t in own.items()}
                for n, own in self.by_remedy.items()}

    def carried(self, name: str) -> Dict[str, Dict[str, Any]]:
        """``name``'s targets as its ``carry=`` entry holds them: without the configured values (the next run's own
        config holds them)."""
        return {k: {"value": t["value"], "relative": t["relative"]} for k, t in self.by_remedy.get(name, {}).items()}

    def take_carried(self, name: str, carried: Mapping[str, Any], io: Any) -> List[Change]:
        """The targets a patched config carries for ``name``, declared in this run (relative ones multiply this
        run's configured values)."""
        return self.declare(name, [Target(k, t["value"], bool(t.get("relative"))) for k, t in carried.items()], io)
