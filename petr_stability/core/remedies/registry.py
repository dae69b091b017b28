"""The remedy types (built-in and registered by users) and the dynamics ladder, as data.

:func:`register_remedy` adds a :class:`~.base.Remedy` subclass; ``remedies=``, the ladder, the cause table's remedies,
the settings, the checkpoint state, the summary and the patched config are read from what is registered, so none can
disagree with another. One run's instances are :class:`~..recovery.policy.Remedies`.
"""
import importlib
import inspect
import os
import pkgutil
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple, Type

from ...configfix.patch import KNOWN_MANUAL_FIX
from ..causes import Cause
from .base import HANDLERS, Remedy, When

__all__ = ["REMEDY_TYPES", "register_remedy", "remedy_types", "REMEDIES", "Rung", "LADDER", "ladder_of", "serving"]

#: Every registered remedy type by name, in registration order (the built-ins first).
REMEDY_TYPES: Dict[str, Type[Remedy]] = {}
#: The modules of this package that hold no remedy (the protocol, the registry, the targets' helper).
_MACHINERY = ("base", "registry", "targets")


def register_remedy(cls: Type[Remedy]) -> Type[Remedy]:
    """Registers a remedy type (usable as a class decorator): ``remedies=[..., cls.name]`` switches it on.

    Raises:
        TypeError: ``cls`` is not a :class:`~.base.Remedy` subclass, or declares an event that is not a
            :class:`~.base.When`.
        ValueError: its name is empty or taken by another type, or a state key or setting it declares is taken.
    """
    if not (isinstance(cls, type) and issubclass(cls, Remedy)) or cls is Remedy:
        raise TypeError(f"register_remedy takes a Remedy subclass, got {cls!r}")
    if not isinstance(cls.name, str) or not cls.name.isidentifier():
        raise ValueError(f"{cls.__name__}.name must be an identifier (its remedies= name), got {cls.name!r}")
    known = REMEDY_TYPES.get(cls.name)
    if known is not None and known.__qualname__ != cls.__qualname__:
        raise ValueError(f"a remedy named {cls.name!r} is registered already ({known.__module__}.{known.__qualname__})")
    for event in cls.events:
        if not isinstance(event, When):
            raise TypeError(f"{cls.__name__}.events must hold When members, got {event!r}")
    if cls.apply is Remedy.apply:  # the typed protocol: the events are the methods it overrides
        handled = tuple(e for e in When if getattr(cls, HANDLERS[e]) is not getattr(Remedy, HANDLERS[e]))
        if handled and cls.events and set(cls.events) != set(handled):
            raise TypeError(f"{cls.__name__}.events {[e.value for e in cls.events]} differ from the events whose "
                            f"method it overrides {[e.value for e in handled]}; leave events out")
        cls.events = handled or cls.events
    others = [r for r in REMEDY_TYPES.values() if r.name != cls.name]
    names = {s.name for r in others for s in r.settings}
    clash = [s.name for s in cls.settings if s.name in names]
    if clash:
        raise ValueError(f"{cls.__name__} declares {clash}, taken by another remedy")
    if not isinstance(cls.order, int) or isinstance(cls.order, bool):
        raise TypeError(f"{cls.__name__}.order must be an int (where it fires among the remedies), got {cls.order!r}")
    REMEDY_TYPES[cls.name] = cls
    ordered = sorted(REMEDY_TYPES.values(), key=lambda r: r.order)  # stable: equal orders keep registration order
    REMEDY_TYPES.clear()
    REMEDY_TYPES.update((r.name, r) for r in ordered)
    return cls


def _builtins() -> Tuple[Type[Remedy], ...]:
    """The built-in remedies: the one :class:`~.base.Remedy` subclass each module of this package defines (a new
    built-in is its module, its test and its docs row: nothing here lists them)."""
    found = []
    for info in sorted(pkgutil.iter_modules([os.path.dirname(__file__)]), key=lambda i: i.name):
        if info.name in _MACHINERY or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        found += [c for c in vars(module).values() if inspect.isclass(c) and issubclass(c, Remedy)
                  and c is not Remedy and c.__module__ == module.__name__]
    return tuple(found)


for _builtin in _builtins():
    register_remedy(_builtin)

#: The built-in remedies ``remedies=`` switches, and its default (docs/how-it-works.md, "Cause-aware recovery").
REMEDIES: Tuple[str, ...] = tuple(name for name, r in REMEDY_TYPES.items() if r.switch == "remedies")


def remedy_types() -> Tuple[Type[Remedy], ...]:
    """Every registered remedy type, in registration order."""
    return tuple(REMEDY_TYPES.values())


@dataclass(frozen=True)
class Rung:
    """One rung of the dynamics ladder: the remedies that act together on one incident of a chain.

    Attributes:
        name: how logs and records name it.
        remedies: their ``remedies=`` names (a rung whose remedies are all off is climbed, changing nothing).
        repeat: the next incident of the chain takes this rung again while its remedies can act once more
            (:meth:`~.base.Remedy.can_repeat`: the learning rate, down to ``lr_min_factor``), before the next rung.
    """

    name: str
    remedies: Tuple[str, ...]
    repeat: bool = False


#: The dynamics ladder, declared once: one rung per incident of a chain (a chain ends when a state taken after the
#: latest recovery is confirmed: that rung held); the learning rate's rung repeats, one backoff per incident, down to
#: ``lr_min_factor`` (a rate 5-8x too high needs three halvings: measured on the model zoo, docs/zoo.md); past the
#: last rung the class is structural. ``ladder=`` replaces it.
LADDER: Tuple[Rung, ...] = (
    Rung(KNOWN_MANUAL_FIX.format(max_norm=1), ("clip", "dropout")),
    Rung("learning rate backoff", ("lr",), repeat=True),
    Rung("optimizer moments reset", ("moments",)),
)


def ladder_of(names: Optional[Sequence[Sequence[str]]]) -> Tuple[Rung, ...]:
    """The ladder ``ladder=`` gives (None: :data:`LADDER`): a rung equal to a default one keeps its name."""
    if names is None:
        return LADDER
    known = {rung.remedies: rung for rung in LADDER}
    return tuple(known.get(tuple(r)) or Rung(" + ".join(REMEDY_TYPES[n].label or n for n in r), tuple(r))
                 for r in names)


def serving(cause: Cause, ladder: Sequence[Rung] = LADDER) -> Tuple[str, ...]:
    """The remedy names that act on ``cause`` (the cause table's remedies; dynamics: the ladder's, then any other
    remedy declaring the class)."""
    cause = Cause(cause)
    on_ladder = tuple(n for rung in ladder for n in rung.remedies) if cause in (Cause.DYNAMICS, Cause.UNKNOWN) else ()
    return on_ladder + tuple(n for n, r in REMEDY_TYPES.items() if cause in r.causes and n not in on_ladder)
