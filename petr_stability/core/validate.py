"""Argument checks shared by every constructor: each error names the argument and the bad value."""
import math
from dataclasses import dataclass, field
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

__all__ = ["check_int", "check_bool", "check_number", "check_choice", "check_list", "check_names", "check_indices",
           "Setting", "is_int", "is_number", "is_bool", "is_names", "is_choice"]


def check_int(name: str, value: Any, minimum: int) -> int:
    """An ``int`` (not a bool) >= ``minimum``; raises ``ValueError`` naming ``value`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """A real ``bool``; raises ``TypeError`` naming ``value`` otherwise (``0``/``'no'`` are not accepted)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_number(name: str, value: Any, above: float = 0.0, finite: bool = True) -> float:
    """A real number > ``above`` (and finite unless ``finite=False``); raises ``ValueError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not value > above:
        raise ValueError(f"{name} must be a number > {above:g}, got {value!r}")
    if finite and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number > {above:g}, got {value!r}")
    return float(value)


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """One of ``choices``; raises ``ValueError`` naming ``value`` and the choices otherwise."""
    if isinstance(value, (list, dict, set)) or value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_list(name: str, value: Any) -> List[Any]:
    """A list or tuple (not a string, not None); raises ``TypeError`` naming ``value`` otherwise."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list, got {value!r}")
    return list(value)


def check_names(name: str, value: Any, allowed: Sequence[str] = ()) -> List[str]:
    """A list or tuple of strings (``allowed`` ones where given); the string itself, None, or a non-string
    element is refused, naming it."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of strings, got {value!r}")
    for item in value:
        if not isinstance(item, str):
            raise TypeError(f"{name} must be a list of strings, got the element {item!r} in {value!r}")
        if allowed and item not in allowed:
            raise ValueError(f"{name}: unknown entry {item!r}; choose from {list(allowed)}")
    return list(value)


def check_indices(name: str, value: Any) -> List[int]:
    """A list or tuple of dataset indices (ints >= 0, not bools); refused naming the bad element otherwise."""
    items = check_list(name, value)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ValueError(f"{name} must be a list of dataset indices (integers >= 0), got the element {item!r} "
                             f"in {value!r}")
    return sorted(set(items))


@dataclass(frozen=True)
class Setting:
    """One setting of the guard (an argument of ``NanGuardHook``): its name, default, check and docs text.

    The core's settings are declared in :mod:`~.config`; each remedy declares its own beside its code
    (:attr:`~.remedies.base.Remedy.settings`). docs/configuration.md's table is checked against these declarations.

    Attributes:
        name: the argument's name.
        default: its value when not given (an immutable value: a tuple, not a list).
        check: ``check(name, value) -> value`` validates (raising ``ValueError`` / ``TypeError`` that name the
            value) and normalises it.
        doc: one paragraph for docs/configuration.md.
        start: a remedy's setting that holds a state the run starts from, which a patched config writes on the
            ``NanGuardHook`` entry itself (``quarantine``, ``fp32_modules``): given there it is not deprecated, as a
            remedy's tuning given there is (:func:`~.config.read_remedies`). Defaults to False.
    """

    name: str
    default: Any
    check: Callable[[str, Any], Any] = field(repr=False)
    doc: str = ""
    start: bool = False

    def value(self, arguments: Mapping[str, Any]) -> Any:
        """The checked value ``arguments`` give it (its default where they do not)."""
        return self.check(self.name, arguments.get(self.name, self.default))


def is_int(minimum: int) -> Callable[[str, Any], int]:
    """A :attr:`Setting.check`: an ``int`` >= ``minimum``."""
    return lambda name, value: check_int(name, value, minimum)


def is_number(above: float = 0.0, below: Optional[float] = None) -> Callable[[str, Any], float]:
    """A :attr:`Setting.check`: a finite number > ``above`` (and, where given, < ``below``)."""
    def check(name: str, value: Any) -> float:
        number = check_number(name, value, above)
        if below is not None and not number < below:
            raise ValueError(f"{name} must be a number in ({above:g}, {below:g}), got {value!r}")
        return number
    return check


def is_bool(name: str, value: Any) -> bool:
    """A :attr:`Setting.check`: a real ``bool``."""
    return check_bool(name, value)


def is_names(name: str, value: Any) -> Tuple[str, ...]:
    """A :attr:`Setting.check`: a list of strings, kept as a tuple."""
    return tuple(check_names(name, value))


def is_choice(*choices: Any) -> Callable[[str, Any], Any]:
    """A :attr:`Setting.check`: one of ``choices``."""
    return lambda name, value: check_choice(name, value, choices)
