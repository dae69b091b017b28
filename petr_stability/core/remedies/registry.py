"""The one list of remedies: ``remedies=``, the cause table's remedies, the ladder, the checkpoint state, the summary
and the patched config are all read from :data:`REGISTRY`, so none can disagree with another.

Adding a remedy: one file (its pure function and its :class:`~.base.Remedy`), one line here, its tests (the layout
test asks for them, and for its row in docs/how-it-works.md's remedy table).
"""
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Tuple, Type

from ..causes import Cause
from .adaptive_clip import AdaptiveClip
from .base import Context, Remedy, When
from .change import Change
from .clip import ClipRemedy
from .dropout import DropoutRemedy
from .fp32 import Fp32Remedy
from .lr import LrBackoff
from .moments import MomentsReset
from .quarantine import Quarantine
from .rollback import Rollback
from .scale import ScaleDynamic
from .temporal import TemporalReset

__all__ = ["REGISTRY", "REMEDIES", "Rung", "LADDER", "serving", "ladder_text", "config_fix_fields", "Remedies"]

#: Every remedy, in the order ``remedies=`` lists them (and they act, where several act at one point).
REGISTRY: Tuple[Type[Remedy], ...] = (
    ClipRemedy,
    DropoutRemedy,
    Rollback,
    ScaleDynamic,
    LrBackoff,
    MomentsReset,
    Quarantine,
    Fp32Remedy,
    TemporalReset,
    AdaptiveClip,
)

#: Remedy names accepted by ``remedies=`` (docs/how-it-works.md, "Cause-aware recovery").
REMEDIES: Tuple[str, ...] = tuple(r.name for r in REGISTRY if r.switched)


@dataclass(frozen=True)
class Rung:
    """One rung of the dynamics ladder, read from the remedies that name it.

    Attributes:
        name: how logs and records name it (its first remedy's ``rung_name``).
        remedies: the ``remedies=`` names it uses (a rung whose remedies are all off is climbed, changing nothing).
        when: when its remedies act (:class:`~.base.When`).
    """

    name: str
    remedies: Tuple[str, ...]
    when: When


def _ladder() -> Tuple[Rung, ...]:
    rungs: Dict[int, List[Type[Remedy]]] = {}
    for remedy in REGISTRY:
        if remedy.rung:
            rungs.setdefault(remedy.rung, []).append(remedy)
    return tuple(Rung(members[0].rung_name, tuple(m.name for m in members), members[0].when)
                 for _, members in sorted(rungs.items()))


#: The dynamics ladder, one rung per incident of a chain (a chain ends when a state taken after the latest recovery
#: is confirmed: that rung held); past the last rung the class is structural.
LADDER: Tuple[Rung, ...] = _ladder()


def serving(cause: Cause) -> Tuple[str, ...]:
    """The ``remedies=`` names that act on ``cause`` (the cause table's remedies)."""
    return tuple(r.name for r in REGISTRY if Cause(cause) in r.causes)


def ladder_text(config: Any) -> str:
    """The ladder as the cause table's action names it, with this run's settings."""
    firsts = [next(r for r in REGISTRY if r.rung == i + 1) for i in range(len(LADDER))]
    return ", then ".join(r.rung_text(config) for r in firsts)


def config_fix_fields(summary: Dict[str, Any]) -> Dict[str, Any]:
    """The patched config's :class:`~petr_stability.configfix.ConfigFix` fields, from the guard's summary."""
    return {field: summary[key] for r in REGISTRY for field, key in r.fixes}


class Remedies:
    """One run's remedies: an instance of each, their state, their summary, and who acts when.

    Args:
        config: the guard's settings.
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self.all: Tuple[Remedy, ...] = tuple(r(config) for r in REGISTRY)
        self._by_name = {r.name: r for r in self.all}

    def __iter__(self) -> Iterator[Remedy]:
        return iter(self.all)

    def get(self, name: str) -> Remedy:
        """The remedy called ``name``."""
        return self._by_name[name]

    def serves(self, cause: Cause) -> bool:
        """Whether any remedy for ``cause`` is switched on."""
        return any(self._by_name[n].enabled for n in serving(cause))

    def of_rung(self, rung: int) -> List[Remedy]:
        """The remedies of the ladder's ``rung`` (1-based)."""
        return [r for r in self.all if r.rung == rung]

    def at(self, when: When, ctx: Context) -> List[Change]:
        """Every remedy that acts at ``when``, in registry order; what they changed."""
        return [change for r in self.all if r.when == when for change in r.apply(ctx)]

    def state_dict(self) -> Dict[str, Any]:
        """Their state as the guard's checkpoint state holds it: top-level keys and the ``policy`` section."""
        state: Dict[str, Any] = {"policy": {}}
        for r in self.all:
            (state["policy"] if r.section == "policy" else state).update(r.state_dict())
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for r in self.all:
            r.load_state_dict(dict(state.get("policy") or {}) if r.section == "policy" else state)

    def summary(self, io: Any) -> Dict[str, Any]:
        """The settings they put in force (the summary's and the patched config's part)."""
        out: Dict[str, Any] = {}
        for r in self.all:
            out.update(r.summary(io))
        return out

    def tags(self) -> Dict[str, Any]:
        """What a restore point records of them."""
        out: Dict[str, Any] = {}
        for r in self.all:
            out.update(r.tags())
        return out

    def state_attribute(self, name: str) -> Any:
        """A remedy's state by its key (``policy.skip``, ``policy.fp32``: the names the checkpoint uses)."""
        for r in self.all:
            if name in r.state_keys:
                return getattr(r, name)
        raise AttributeError(name)
