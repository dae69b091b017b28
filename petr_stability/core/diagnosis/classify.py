"""Why a confirmed divergence happened, from its replay: :func:`classify` a rank's report, :func:`merge` all ranks'.

:func:`classify` reads the report of :func:`~.replay.diagnose_step` (the failing batch re-run on the live weights and
on a healthy snapshot's, same RNG and autocast, plus the fp32 re-run of the module that overflowed) and a small
:class:`CauseHistory` of earlier incidents. What each class gets is :data:`~..causes.CAUSE_TABLE`'s business.
"""
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..causes import PRIORITY, Cause, Classification
from .recorder import FP16_MAX
from .window import window_evidence

__all__ = ["CauseHistory", "classify", "recurring", "merge", "batch_broke", "data_by_evidence", "from_inputs"]


class CauseHistory:
    """What earlier incidents were and which causes have no remedy left: the memory :func:`classify` needs.

    Args:
        first_iterations: a data incident at an iteration (1-based, counted from the start of training) up to this
            one is structural: the first batches break the weights the run started from. Defaults to 10.
        recurrence_window: a data incident fewer than this many iterations after the rollback of the previous
            data incident is structural: a second batch breaking at once means every batch breaks (a bug), not
            one sample. Defaults to 50.
        never_trained: where no batch is known to be good because none has trained since the run's start state,
            a batch breaking the start weights after at least this many batches that all broke (this one
            included) is structural: every batch this run has seen breaks. Defaults to 3.
    """

    def __init__(self, first_iterations: int = 10, recurrence_window: int = 50, never_trained: int = 3) -> None:
        for name, value in (("first_iterations", first_iterations), ("recurrence_window", recurrence_window),
                            ("never_trained", never_trained)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        self.first_iterations = first_iterations
        self.recurrence_window = recurrence_window
        self.never_trained = never_trained
        self.incidents: List[Dict[str, Any]] = []
        self.spent: Dict[str, str] = {}

    def record(self, classification: Classification, iteration: int, restored_to: Optional[int] = None) -> None:
        """Adds an incident: its class, the iteration it happened at and the iteration rolled back to."""
        self.incidents.append({"iteration": int(iteration), "cause": classification.cause.value,
                               "modules": list(classification.modules),
                               "restored_to": None if restored_to is None else int(restored_to)})

    def last(self) -> Optional[Dict[str, Any]]:
        """The newest recorded incident, or None."""
        return self.incidents[-1] if self.incidents else None

    def count(self, cause: Cause) -> int:
        """How many incidents had this cause."""
        return sum(1 for i in self.incidents if i["cause"] == Cause(cause).value)

    def clean_since_last(self, iteration: int) -> Optional[int]:
        """Iterations trained since the newest incident's rollback point (or the incident itself); None if none."""
        last = self.last()
        if last is None:
            return None
        start = last["restored_to"] if last["restored_to"] is not None else last["iteration"]
        return max(0, int(iteration) - start)

    def mark_spent(self, cause: Cause, why: str) -> None:
        """Records that ``cause`` has no remedy left (the ladder's last rung, the skip list's bound, ...)."""
        self.spent[Cause(cause).value] = why

    def is_spent(self, cause: Cause) -> bool:
        """Whether ``cause`` has no remedy left."""
        return Cause(cause).value in self.spent

    def state_dict(self) -> Dict[str, Any]:
        return {"version": 1, "incidents": [dict(i) for i in self.incidents], "spent": dict(self.spent)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.incidents = [dict(i) for i in state.get("incidents", [])]
        self.spent = {str(k): str(v) for k, v in dict(state.get("spent", {})).items()}


def _overflow_module(report: Mapping[str, Any]) -> Optional[str]:
    check = report.get("fp32_check") or {}
    return check.get("fixed_by")


def _forward_overflow(report: Mapping[str, Any], healthy: Optional[Mapping[str, Any]],
                      good: Optional[Mapping[str, Any]],
                      signals: Dict[str, Any]) -> Optional[Tuple[Cause, str, List[str], Dict[str, Any]]]:
    """An fp16 overflow fixed by fp32, on the live weights or (when those already hold NaN) on the healthy ones, or
    on the batch known to be good (the overflow is in every batch, not in this one's data); None without one."""
    for where, rep in (("live", report), ("healthy", healthy or {}), ("good batch's", good or {})):
        module = _overflow_module(rep)
        if not module:
            continue
        check = rep["fp32_check"]
        signals["fp32_check"] = {k: check.get(k) for k in ("module", "fixed_by", "max_abs")}
        made = (f"is made by the code that feeds {check['module']} (its input)" if check.get("where") == "input"
                else f"appears in the fp16 forward of {check['module']} from finite inputs within fp16 range")
        evidence = (f"on the {where} weights the first NaN/Inf {made}, and {module} re-run alone in fp32 on the "
                    f"same inputs is finite (max |x| {check.get('max_abs')}, within {FP16_MAX:g})")
        if where == "live" and healthy is not None:
            # The same batch in fp16 on the healthy weights: finite there, the weights grew into the overflow since
            # then (the training dynamics, not this batch); overflowing there too, they did not.
            signals["weights_grew"] = not healthy.get("reproduced")
            if signals["weights_grew"]:
                evidence += (f"; on the healthy weights ({healthy.get('weights') or 'the last healthy weights'}) the "
                             "same batch stays finite in fp16: the weights grew into the overflow")
        return Cause.FORWARD_OVERFLOW, evidence, [module], signals
    return None


def _confined(report: Mapping[str, Any], overflow: Tuple[Cause, str, List[str], Dict[str, Any]],
              history: CauseHistory) -> Optional[Tuple[Cause, str, List[str], Dict[str, Any]]]:
    """One sample is data, many batches are the module: an fp16 forward overflow the healthy weights show too (the
    weights did not grow into it) whose rows, re-run from there, break alone beside samples shown clean (the rest of
    the batch finite, and the batch known to be good finite there) is those samples' data; None where the module is
    to blame (the known-good batch overflows too, no row breaks alone, or an earlier batch with no sample in common
    overflowed the same module)."""
    _, evidence, modules, signals = overflow
    healthy, good = report.get("on_healthy_weights") or {}, report.get("good_batch")
    isolation = report.get("isolation") or {}
    if not healthy.get("reproduced") or (good is not None and good.get("reproduced")) or not isolation.get("rows"):
        return None
    if any(i["cause"] == Cause.DATA.value and modules[0] in i["modules"] for i in history.incidents):
        return None  # an earlier sample's overflow there was quarantined since: a batch without it overflows it again
    known = f", and {good.get('batch')}, known to be good, stays finite there" if good is not None else ""
    return (Cause.DATA, f"{evidence}; but the overflow is confined to {len(isolation['rows'])} sample(s): re-run "
                        f"from the healthy state, each breaks beside samples shown clean while the rest of its batch "
                        f"does not{known}: their data, not {modules[0]}", list(modules),
            dict(signals, isolated=list(isolation["rows"])))


def _evidence_cause(report: Mapping[str, Any], history: CauseHistory) -> Tuple[Cause, str, List[str], Dict[str, Any]]:
    first = report.get("first") or {}
    healthy = report.get("on_healthy_weights")
    signals: Dict[str, Any] = {"reproduced": bool(report.get("reproduced")),
                               "first": {k: first.get(k) for k in ("module", "where", "dtype")} if first else None,
                               "healthy_compared": healthy is not None}
    good = report.get("good_batch")
    overflow = _forward_overflow(report, healthy, good, signals)
    if overflow is not None:
        return _confined(report, overflow, history) or overflow
    # The batch as it arrives: at the model's input, or at MMEngine's data preprocessor (the model's first module).
    if first and first.get("where") == "input" and first.get("module") in ("(model)", "data_preprocessor"):
        known = (f", while {good.get('batch')}, known to be good, trains fine on the healthy weights"
                 if good is not None and not good.get("reproduced") else "")
        return (Cause.DATA, f"the batch itself arrives holding NaN/Inf at the model's input{known}", [],
                dict(signals, input_nonfinite=True))
    window = report.get("window") or {}
    if window.get("found"):
        # Buffers or plain-attribute state poisoned with finite weights, traced to a batch of the window since the
        # healthy snapshot (diagnosis/window.py): the batch at hand is only where a check noticed it.
        signals["window"] = {k: window.get(k) for k in ("iteration", "indices", "blamed", "ambiguous", "poisoned")}
        return Cause.DATA, window_evidence(window), [], signals
    if healthy is not None:
        weights = healthy.get("weights") or "the last healthy weights"
        if healthy.get("reproduced"):
            where = (healthy.get("first") or {}).get("module")
            signals["good_batch"] = None if good is None else {"batch": good.get("batch"),
                                                               "reproduced": bool(good.get("reproduced"))}
            if good is not None and good.get("reproduced"):
                return (Cause.STRUCTURAL, f"the same batch breaks the healthy weights too ({weights}; first in "
                                          f"{where}), and so does {good.get('batch')}, known to be good: every batch "
                                          "breaks, a bug (no fp32 re-run fixes it)", [],
                        dict(signals, evidence_cause=Cause.STRUCTURAL.value))
            untrained = int(report.get("untrained_batches") or 0)
            if good is None and history.never_trained and untrained >= history.never_trained:
                signals["untrained_batches"] = untrained
                return (Cause.STRUCTURAL, f"the same batch breaks the healthy weights too ({weights}; first in "
                                          f"{where}), and not one of the {untrained} batches since the run's start "
                                          "trained (every step went wrong): every batch breaks, a bug (no fp32 "
                                          "re-run fixes it)", [], dict(signals, evidence_cause=Cause.STRUCTURAL.value))
            known = f", while {good.get('batch')}, known to be good, trains fine there" if good is not None else ""
            return (Cause.DATA, f"the same batch breaks the healthy weights too ({weights}; first in {where}){known}",
                    [], signals)
        return Cause.DYNAMICS, f"the same batch trains fine on the healthy weights ({weights})", [], signals
    if report.get("reproduced"):
        return (Cause.UNKNOWN, "the batch breaks the live weights, but there are no healthy weights to re-run it "
                               "on (no confirmed snapshot)", [], signals)
    return (Cause.UNKNOWN, "the re-run of the failing batch stays finite and there are no healthy weights to "
                           "compare with", [], signals)


def classify(report: Optional[Mapping[str, Any]], history: Optional[CauseHistory] = None,
             iteration: Optional[int] = None, recurrence: bool = True) -> Classification:
    """Classifies one confirmed divergence from its replay report.

    The replay decides (fp16 overflow fixed by fp32 > a non-finite batch or one that breaks the healthy weights =
    data > fine on the healthy weights = dynamics > unknown; an overflow on the live weights whose batch stays finite
    on the healthy ones carries the signal ``weights_grew``: the weights grew into it); a data (or reproduced
    unknown) divergence within ``history.first_iterations`` is structural (the first batches break the start
    weights); then that cause becomes structural when its remedies are spent (:meth:`CauseHistory.mark_spent`),
    or, for data, when the previous incident was data too and fewer than ``history.recurrence_window`` iterations
    trained since its rollback (every batch breaks).

    Args:
        report: a :func:`~.replay.diagnose_step` report (``compare='reproduced'`` gives the healthy
            comparison whenever the live re-run reproduces); None when no diagnosis ran.
        history: earlier incidents. Defaults to None (an empty history with its defaults).
        iteration: the iteration of this incident (1-based, the guard's numbering). Defaults to None (unknown: no
            first-iterations rule).
        recurrence: apply the back-to-back data rule here. The guard applies it after the ranks agreed instead
            (:func:`recurring`), and only when every rank's batch broke. Defaults to True.

    Returns:
        The :class:`Classification`.
    """
    history = history if history is not None else CauseHistory()
    if not report:
        return Classification(Cause.UNKNOWN, "no diagnosis ran (diagnose=False, or the adapter cannot re-run the "
                                             "batch)")
    if report.get("error"):
        return Classification(Cause.UNKNOWN, f"the diagnosis failed: {report['error']}")
    cause, evidence, modules, signals = _evidence_cause(report, history)
    early = iteration is not None and iteration <= history.first_iterations and not data_by_evidence(signals)
    if early and (cause == Cause.DATA or (cause == Cause.UNKNOWN and report.get("reproduced"))):
        # The run's first batches already break the weights it started from: nothing ever trained healthily.
        return Classification(Cause.STRUCTURAL,
                              f"{evidence}; at iteration {iteration}, within the first {history.first_iterations} "
                              "iterations: the model never trained healthily",
                              modules, dict(signals, evidence_cause=cause.value, iteration=iteration))
    if cause != Cause.UNKNOWN and history.is_spent(cause):
        return Classification(Cause.STRUCTURAL, f"{evidence}; and the remedies for {cause} are spent "
                                                f"({history.spent[cause.value]}): divergences keep coming on new data",
                              modules, dict(signals, evidence_cause=cause.value, spent=cause.value))
    c = Classification(cause, evidence, modules, signals)
    return recurring(c, history, iteration) if recurrence else c


def recurring(c: Classification, history: CauseHistory, iteration: Optional[int]) -> Classification:
    """A data divergence fewer than ``history.recurrence_window`` iterations after the previous data incident (its
    rollback point, or the incident itself where the run went on without one), whose samples were quarantined, is
    structural: the batches keep breaking, not one sample. Returns ``c`` unchanged otherwise."""
    last = history.last()
    # Only after a quarantine: its samples are gone, yet the next batch breaks too. Without one (no sample ids),
    # two bad batches in a row are a burst of bad data as much as a bug. And never against the counterfactual: where
    # the batch known to be good trains fine on the healthy weights, this batch is bad data, however soon it came.
    if (c.cause != Cause.DATA or last is None or last["cause"] != Cause.DATA.value or iteration is None
            or not last.get("quarantined", True) or data_by_evidence(c.signals)):
        return c
    clean = history.clean_since_last(iteration)
    if clean is None or clean >= history.recurrence_window:
        return c
    return Classification(Cause.STRUCTURAL, f"{c.evidence}; and only {clean} iteration(s) after the previous bad "
                                            "batch: every batch breaks, not one sample",
                          c.modules, dict(c.signals, evidence_cause=Cause.DATA.value, clean_iterations=clean),
                          dict(c.ranks))


def data_by_evidence(signals: Mapping[str, Any]) -> bool:
    """The evidence says the data is to blame: the batch known to be good, replayed on the same healthy state as the
    failing one, trains fine there (the counterfactual), or the batch (or the samples blamed) holds non-finite values
    of its own at the model's input, or the window's replay traced poisoned state to it, or its rows re-run from the
    healthy state break alone beside samples shown clean. No timing rule overrides it."""
    good = signals.get("good_batch")
    return ((isinstance(good, Mapping) and good.get("reproduced") is False) or bool(signals.get("flagged_inputs"))
            or bool(signals.get("input_nonfinite")) or bool(signals.get("window")) or bool(signals.get("isolated")))


def from_inputs(flagged: Sequence[Mapping[str, Any]], iteration: Optional[int] = None) -> Optional[Classification]:
    """Where no replay ran: the samples of the batch whose own values are non-finite (or past fp16's range under
    fp16) are evidence of bad data by themselves. None when no sample is flagged."""
    if not flagged:
        return None
    return Classification(Cause.DATA, f"no replay ran, and {len(flagged)} sample(s) of the batch hold non-finite (or, "
                                      "under fp16, out-of-range) values of their own",
                          [], {"flagged_inputs": len(flagged), "iteration": iteration})


def merge(classifications: Sequence[Optional[Classification]]) -> Classification:
    """One class from several (ranks): the highest precedence wins; its overflow modules are united.

    Precedence: structural > forward overflow > data > dynamics > unknown. ``None`` entries (ranks that saw no
    fault and ran no diagnosis) are ignored; with none left the result is unknown. A forward overflow's
    ``weights_grew`` and ``unstable_before``, and a dynamics divergence's ``between_steps``, hold only where every rank
    of the class shows it.
    """
    present = [(i, c) for i, c in enumerate(classifications) if c is not None]
    if not present:
        return Classification(Cause.UNKNOWN, "no rank classified the divergence")
    _, best = max(present, key=lambda ic: (PRIORITY[ic[1].cause], -ic[0]))
    modules: List[str] = []
    for _, c in present:
        if c.cause == best.cause:
            modules.extend(m for m in c.modules if m not in modules)
    ranks = {str(i): c.cause.value for i, c in present}
    signals = dict(best.signals)
    for shown in ("weights_grew", "between_steps", "unstable_before"):  # every rank of the class must show it
        if shown in signals:
            signals[shown] = all(c.signals.get(shown) for _, c in present if c.cause == best.cause)
    return Classification(best.cause, best.evidence, modules, signals, ranks)


def batch_broke(report: Optional[Mapping[str, Any]]) -> bool:
    """Whether a rank's replay shows that its own batch breaks: on the healthy weights where it was compared there,
    else on the live weights when those were finite (live non-finite weights break every batch). False without a
    replay, or when it failed: then its batch is not blamed."""
    if not report or report.get("error"):
        return False
    healthy = report.get("on_healthy_weights")
    if healthy is not None:
        return bool(healthy.get("reproduced"))
    return bool(report.get("reproduced")) and not report.get("nonfinite_parameters")
