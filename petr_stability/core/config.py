"""Every setting of the guard (the hook's arguments): the core's declared here, each remedy's beside its code.

:func:`settings` lists them all (the core's, then each registered remedy's, in registration order);
:class:`GuardConfig` takes keyword arguments, checks each against its declaration (an unknown name is refused with the
closest one) and holds the checked values as attributes. docs/configuration.md's table is compared with
:func:`settings` by the docs tests.
"""
import difflib
import math
import warnings
from typing import Any, Dict, List, Mapping, Optional, Tuple, Type

from .remedies.base import Remedy
from .remedies.registry import REMEDIES, REMEDY_TYPES, ladder_of
from .validate import Setting, check_bool, check_choice, check_list, check_names, is_bool, is_int, is_number
from .watch.detector import DetectorConfig

__all__ = ["GuardConfig", "REMEDIES", "CORE_SETTINGS", "settings", "read_remedies", "remedy_type"]


def _scale_fall(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (1 < value <= math.inf):
        raise ValueError(f"{name} must be a number > 1 (math.inf: off), got {value!r}")
    return float(value)


def _remedy_names(name: str, value: Any) -> Tuple[str, ...]:
    return tuple(check_names(name, value, tuple(n for n, r in REMEDY_TYPES.items() if r.switch == "remedies")))


def _ladder(name: str, value: Any) -> Optional[Tuple[Tuple[str, ...], ...]]:
    if value is None:
        return None
    rungs = check_list(name, value)
    if not rungs:
        raise ValueError(f"{name} must hold at least one rung (a list of remedy names), got {value!r}")
    return tuple(tuple(check_names(f"{name} rung {i + 1}", rung, tuple(REMEDY_TYPES))) for i, rung in enumerate(rungs))


#: The core's settings, in the order docs/configuration.md lists them.
CORE_SETTINGS: Tuple[Setting, ...] = (
    Setting("patience", 3, is_int(1), "K: consecutive non-finite steps the loss scaler no longer answers by lowering "
            "the scale (or consecutive fp32 skips, or non-finite losses) before a divergence is declared."),
    Setting("min_loss_scale", 1.0, is_number(), "a dynamic loss scale below this is a divergence."),
    Setting("static_patience", 5, is_int(1), "M: consecutive skipped steps under a static scale before it counts as "
            "stalled."),
    Setting("max_scale_fall", 16.0, _scale_fall, "F: a skip streak during which the dynamic scale falls F times below "
            "the scale the gradients had fitted is a divergence (``math.inf``: off)."),
    Setting("scale_fall_warmup", 20, is_int(0), "applied steps of the run before the ``max_scale_fall`` rule "
            "applies: while the rate warms up the gradients grow and a scale fitted after a few steps falls with "
            "them on a healthy run."),
    Setting("check_interval", 50, is_int(1), "iterations between routine health checks of weights and buffers "
            "(suspicious steps are checked at once anyway; BatchNorm statistics can turn NaN without any gradient "
            "showing it)."),
    Setting("diagnose", True, is_bool, "on a confirmed divergence, re-run the failing batch with module hooks and name "
            "the first module that produced NaN/Inf (docs/diagnosis.md); the evidence every cause rests on."),
    Setting("snapshot_interval", 40, is_int(1), "iterations between in-memory snapshots (40 and ``confirm_steps`` "
            "10: at most ~50 iterations lost per incident on average, benchmarks/bench.py figure 5)."),
    Setting("confirm_steps", 10, is_int(0), "W: stable steps in a row after a snapshot before it counts as healthy."),
    Setting("keep_snapshots", 3, is_int(2), "snapshots kept in host memory (>= 2)."),
    Setting("max_recoveries", 5, is_int(0), "rollbacks allowed in a run before giving up with ``NanGuardGaveUp``."),
    Setting("remedies", REMEDIES, _remedy_names, "which remedies act (``remedies=`` names; a user's registered remedy "
            "is named here to switch it on)."),
    Setting("ladder", None, _ladder, "the dynamics ladder, one rung (a list of remedy names) per incident of a chain; "
            "None: the known manual fix, then the learning-rate backoff, then the moments reset."),
    Setting("skip_nonfinite_fp32", True, is_bool, "in fp32, drop a step with a non-finite gradient before the "
            "optimizer applies it (as a loss scaler does)."),
    Setting("restore_from_checkpoints", True, is_bool, "after the in-memory states, try this run's own finite "
            "checkpoints (newest first; another run's files in the same work dir are never used)."),
    Setting("write_patched_config", True, is_bool, "after an incident and on giving up, rank 0 writes "
            "``<work_dir>/nan_guard_patched_config.py`` with exactly the settings the guard put in force."),
    Setting("first_iterations", 0, is_int(0), "a data divergence within this many iterations is structural at once, "
            "unless the evidence says the data is bad; 0 turns the rule off."),
    Setting("spike_window", 100, is_int(2), "the grad_norm early warning's window (a running z-score over the host "
            "float the runner already logs)."),
    Setting("spike_z", 3.0, is_number(), "the early warning's threshold, in standard deviations."),
    Setting("spike_warmup", 25, is_int(2), "values the early warning needs before it speaks."),
    Setting("stability_window", 50, is_int(2), "healthy means stable: the window of recent steps whose loss and "
            "grad_norm make the run's band (a step out of it confirms no snapshot; docs/how-it-works.md)."),
    Setting("stability_z", 3.0, is_number(), "a step is out of the band when its loss or grad_norm is this many robust "
            "standard deviations (log scale) above the window's median..."),
    Setting("stability_ratio", 4.0, is_number(1.0), "...and at least this many times the median."),
    Setting("stability_warmup", 5, is_int(1), "applied steps before any is judged against the band (the first "
            "iterations are stable)."),
    Setting("snapshot_copies", "rank", lambda n, v: check_choice(n, v, ("rank", "node")), "``'rank'`` (every rank "
            "keeps its own snapshots) or ``'node'`` (one copy per node, on its lowest rank; replicated DDP state "
            "only)."),
    Setting("replica_check_interval", 100, is_int(0), "under a process group of two ranks or more, iterations between "
            "comparisons of the ranks' copies of the model (a digest per tensor, read one iteration later); a rank "
            "whose copy drifted takes the majority's (docs/distributed.md); 0: off."),
    Setting("carry", {}, lambda n, v: _carry(n, v), "what an earlier run's remedies put in force that its config "
            "cannot express (``{remedy: state}``), as its patched config carries it: re-applied before the first "
            "iteration."),
)


def _carry(name: str, value: Any) -> Dict[str, Dict[str, Any]]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, Mapping)
                                                 for k, v in value.items()):
        raise TypeError(f"{name} must map remedy names to dicts, got {value!r}")
    return {k: dict(v) for k, v in value.items()}


def remedy_type(kind: Any) -> Type[Remedy]:
    """The registered remedy type a ``remedies=`` entry's ``type`` names: its ``remedies=`` name, its class name, or
    the class itself.

    Raises:
        ValueError: nothing registered by that name (the registered names are listed).
    """
    for cls in REMEDY_TYPES.values():
        if kind is cls or kind == cls.name or kind == cls.__name__:
            return cls
    raise ValueError(f"remedies: unknown remedy type {kind!r}; choose from {list(REMEDY_TYPES)} (a remedy of your "
                     "own is registered with register_remedy, docs/remedies.md)")


def _switch(cls: Type[Remedy], on: bool, names: List[str], arguments: Dict[str, Any]) -> None:
    if cls.switch != "remedies":
        arguments[cls.switch] = on
    elif on and cls.name not in names:
        names.append(cls.name)
    elif not on and cls.name in names:
        names.remove(cls.name)


def _flat_notices(arguments: Mapping[str, Any], owner: str) -> List[str]:
    # A remedy's tuning given on the hook itself: one notice per remedy, naming the entry it belongs in.
    owners = {s.name: cls for cls in REMEDY_TYPES.values() for s in cls.settings}
    flat: Dict[str, Dict[str, Any]] = {}
    for key, value in arguments.items():
        cls = owners.get(key)
        if cls is not None and not any(s.name == key and s.start for s in cls.settings):
            flat.setdefault(cls.name, {})[key] = value
    notices = []
    for name, given in flat.items():
        entry = ", ".join([f"type={name!r}"] + [f"{k}={v!r}" for k, v in given.items()])
        notices.append(f"{owner}({', '.join(f'{k}={v!r}' for k, v in given.items())}): a remedy's setting given on "
                       f"the hook is deprecated; give it in the remedy's entry: remedies=[dict({entry})]")
    return notices


def _entry(entry: Any) -> Tuple[Type[Remedy], bool, Dict[str, Any]]:
    # One remedies= entry: its remedy type, whether it switches it on, and the settings it gives.
    if isinstance(entry, str):
        entry = {"type": entry}
    if not isinstance(entry, Mapping):
        raise TypeError(f"remedies: an entry must be a name or dict(type=..., **settings), got {entry!r}")
    entry = dict(entry)
    if "type" not in entry:
        raise ValueError(f"remedies: the entry {entry!r} has no type (the remedy's name: dict(type='lr', ...))")
    cls = remedy_type(entry.pop("type"))
    on = check_bool(f"remedies: {cls.name!r} enabled", entry.pop("enabled", True))
    declared = [s.name for s in cls.settings if s.name != cls.switch]
    for key in entry:
        if key not in declared:
            close = difflib.get_close_matches(str(key), declared, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"remedies: {cls.name!r} has no setting {key!r}{hint} (its settings: "
                            f"{declared + ['enabled']})")
    return cls, on, entry


def read_remedies(arguments: Mapping[str, Any], owner: str = "NanGuardHook") -> Tuple[Dict[str, Any], List[str]]:
    """The hook's arguments with ``remedies=`` read into the flat settings :class:`GuardConfig` holds, and the
    deprecation notices the old forms earn.

    ``remedies=`` entries are names or ``dict(type=name, **settings)``. A list holding a ``dict`` changes the
    defaults (:data:`REMEDIES`): each entry switches its remedy on, with its settings (``dict(type='lr',
    lr_backoff=0.25)``), and ``dict(type=name, enabled=False)`` switches a default off. A list of names only is, as
    it always was, the whole set; where it leaves a default out, a notice names the new form. A remedy's setting given
    on the hook itself (``lr_backoff=0.25``) keeps loading with a notice naming its entry; the states a patched
    config writes there (``quarantine``, ``fp32_modules``: :attr:`~.validate.Setting.start`) earn none.

    Raises:
        TypeError: an entry is neither a name nor a dict, or gives a setting its remedy does not declare (the
            closest one is named).
        ValueError: an entry has no ``type``, names an unknown one or the same remedy twice, or gives a setting the
            hook's arguments give too.
    """
    arguments = dict(arguments)
    notices = _flat_notices(arguments, owner)
    value = arguments.get("remedies")
    if not isinstance(value, (list, tuple)):  # the default, or a value the setting's own check refuses
        return arguments, notices
    entries = list(value)
    if not any(isinstance(e, Mapping) for e in entries):
        left_out = [n for n in REMEDIES if n not in entries]
        if left_out and all(isinstance(e, str) for e in entries):
            off = ", ".join(f"dict(type={n!r}, enabled=False)" for n in left_out)
            notices.append(f"{owner}(remedies={list(entries)!r}): a list of names only is the whole set, which leaves "
                           f"out the defaults {left_out} (the old form, deprecated); list what you add or change, and "
                           f"switch a default off by its entry: remedies=[{off}]")
        return arguments, notices
    names, seen = list(REMEDIES), set()
    for entry in entries:
        cls, on, given = _entry(entry)
        if cls.name in seen:
            raise ValueError(f"remedies: {cls.name!r} is given twice; give each remedy one entry")
        seen.add(cls.name)
        for key, setting in given.items():
            if key in arguments:
                raise ValueError(f"remedies: {cls.name!r} gives {key}={setting!r} and {owner} gives "
                                 f"{key}={arguments[key]!r}; give it once, in the remedy's entry")
            arguments[key] = setting
        _switch(cls, on, names, arguments)
    arguments["remedies"] = tuple(names)
    return arguments, notices


def settings() -> Tuple[Setting, ...]:
    """Every setting: the core's, then each registered remedy type's."""
    return CORE_SETTINGS + tuple(s for r in REMEDY_TYPES.values() for s in r.settings)


class GuardConfig:
    """Every setting of the guard, checked; defaults are sized for PETR on nuScenes-scale runs.

    Keyword arguments are the settings :func:`settings` declares (docs/configuration.md lists each with its
    default); each becomes an attribute. ``detector`` holds the detector's thresholds.

    Raises:
        TypeError: an unknown argument (the closest known one is named), or a value of the wrong type.
        ValueError: a value out of range (named with the setting).
    """

    def __init__(self, **arguments: Any) -> None:
        self._build(arguments, type(self).__name__)

    def _build(self, arguments: Mapping[str, Any], owner: str) -> None:
        arguments, notices = read_remedies(arguments, owner)
        #: What the arguments' old forms earn (:func:`read_remedies`): warned here, logged as the run starts.
        self.notices: Tuple[str, ...] = tuple(notices)
        for notice in notices:
            warnings.warn(notice, DeprecationWarning, stacklevel=3)
        declared = settings()
        names = [s.name for s in declared]
        for key in arguments:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"{owner} got an unknown argument {key!r}{hint} (its arguments: "
                                "docs/configuration.md)")
        for setting in declared:
            setattr(self, setting.name, setting.value(arguments))
        self.detector = DetectorConfig(self.patience, self.min_loss_scale, self.static_patience, self.max_scale_fall,
                                       self.scale_fall_warmup)
        self._check_ladder()

    def _check_ladder(self) -> None:
        for rung in ladder_of(self.ladder):
            for name in rung.remedies:
                if REMEDY_TYPES[name].switch != "remedies":
                    raise ValueError(f"ladder: {name!r} is switched by its own setting, not by remedies=; it cannot "
                                     "be a rung")

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any], owner: str = "NanGuardHook") -> "GuardConfig":
        """The settings from a hook's keyword arguments; an unknown name is refused naming it and the closest
        argument (``TypeError``), and the hook (``owner``), not this class."""
        config = cls.__new__(cls)
        config._build(arguments, owner)
        return config

    def as_dict(self) -> Dict[str, Any]:
        """Every setting's value, by name."""
        return {s.name: getattr(self, s.name) for s in settings()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.as_dict().items())})"
