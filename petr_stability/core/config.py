"""Every setting of the guard (the hook's arguments): the core's declared here, each remedy's beside its code.

:func:`settings` lists them all (the core's, then each registered remedy's, in registration order);
:class:`GuardConfig` takes keyword arguments, checks each against its declaration (an unknown name is refused with the
closest one) and holds the checked values as attributes. docs/configuration.md's table is compared with
:func:`settings` by the docs tests.
"""
import difflib
import math
from typing import Any, Dict, Mapping, Optional, Tuple

from .remedies.registry import REMEDIES, REMEDY_TYPES, ladder_of
from .validate import Setting, check_choice, check_list, check_names, is_bool, is_int, is_number
from .watch.detector import DetectorConfig

__all__ = ["GuardConfig", "REMEDIES", "CORE_SETTINGS", "settings"]


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
        declared = settings()
        names = [s.name for s in declared]
        for key in arguments:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"{type(self).__name__} got an unknown argument {key!r}{hint} (its arguments: "
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
        try:
            return cls(**arguments)
        except TypeError as exc:
            raise TypeError(str(exc).replace(cls.__name__, owner, 1)) from None

    def as_dict(self) -> Dict[str, Any]:
        """Every setting's value, by name."""
        return {s.name: getattr(self, s.name) for s in settings()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.as_dict().items())})"
