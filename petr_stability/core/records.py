"""The incident record's schema: event names, the builders every record goes through, the writer and the one reader.

One JSON object per line in ``<work_dir>/nan_guard_incidents.jsonl``, written by rank 0 only. docs/incidents.md
documents every field; tests/core/test_incident_schema.py checks the file against that table. The report, the demo
and :func:`read_incidents` all read through :func:`read_records`.
"""
import dataclasses
import enum
import json
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["INCIDENT_FILE", "Event", "INCIDENT_EVENTS", "LogProblem", "IncidentLog", "step_record", "json_ready",
           "read_records", "read_incidents"]

#: File name of the incident log inside the work dir.
INCIDENT_FILE = "nan_guard_incidents.jsonl"


class Event(str, enum.Enum):
    """The ``event`` of a record (a ``str`` enum: ``Event.SKIP == "skip"``)."""

    DIVERGENCE = "divergence"  #: a confirmed divergence and what the guard did about it
    STALLED = "stalled"  #: a static loss scale skipping every step, made dynamic
    GAVE_UP = "gave_up"  #: the run stops with the guard's error
    SKIP = "skip"  #: fp32: a step with a non-finite gradient dropped before the optimizer applied it
    NONFINITE_LOSS = "nonfinite_loss"  #: fp32: a non-finite loss with finite gradients, the step applied
    RECURRING_SAMPLE = "recurring_sample"  #: a sample broke steps in two epochs: named, quarantined
    #: data-parallel replicas found holding different weights: named, and the majority's copy sent to the others
    REPLICA_DRIFT = "replica_drift"

    def __str__(self) -> str:
        return self.value


#: Events that count as incidents (a recovery or a scale switch); ``gave_up`` ends the run.
INCIDENT_EVENTS: Tuple[Event, ...] = (Event.DIVERGENCE, Event.STALLED)


def step_record(event: Event, signals: Any, decision: Any, changes: Sequence[Any], recoveries: int,
                max_recoveries: int, world_size: int, **fields: Any) -> Dict[str, Any]:
    """The fields every record about one step carries, then ``fields`` (event-specific, in that order).

    Args:
        event: the record's event.
        signals: the step's :class:`~.watch.detector.StepSignals`.
        decision: the detector's :class:`~.watch.detector.Decision` (verdict and reason).
        changes: the :class:`~.remedies.change.Change` list of the settings changed.
        recoveries: recoveries so far in the run.
        max_recoveries: the budget.
        world_size: ranks in the run.
        **fields: the event's own fields (``cause``, ``restored_from``, ``batch``, ...).
    """
    return json_ready({
        "event": Event(event).value,
        "iteration": signals.iteration,
        "reason": decision.reason,
        "verdict": decision.verdict.name,
        "signals": signals.as_dict(),
        "actions": [dataclasses.asdict(c) for c in changes],
        "recoveries": recoveries,
        "max_recoveries": max_recoveries,
        "world_size": world_size,
        **fields,
    })


def json_ready(value: Any) -> Any:
    """``value`` as strict JSON can hold it: every non-finite float (NaN, Inf), however deep, as its string
    (``'nan'``, ``'inf'``, ``'-inf'``); dicts, lists and tuples copied, anything else as it is."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


class IncidentLog:
    """Appends incident records as JSON lines, each flushed to disk before the run goes on.

    A write that fails (a read-only work dir, a full disk) never ends the run: the record is held in memory, one
    warning names the path, and the held records are written, in order, by the next write or :meth:`flush` that
    succeeds (the driver retries after every iteration); :meth:`close` puts what still cannot be written into the
    runner's log in full. Non-finite numbers are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``: every line
    is strict JSON.

    Args:
        work_dir: the run's work dir; the log is ``<work_dir>/nan_guard_incidents.jsonl``.
        enabled: False on every rank but 0, so that exactly one file exists per run.
        log: where a failed write is reported, ``log(message, level)`` (the driver sets the runner's logger).
            Defaults to a ``RuntimeWarning``.
    """

    #: The events a dashboard shows as text (:meth:`take_unshown`); the others are counted in the scalars.
    SHOWN = (Event.DIVERGENCE, Event.STALLED, Event.RECURRING_SAMPLE, Event.REPLICA_DRIFT)

    def __init__(self, work_dir: Optional[str], enabled: bool = True,
                 log: Optional[Callable[[str, str], None]] = None) -> None:
        self.path = os.path.join(work_dir, INCIDENT_FILE) if work_dir else None
        self.enabled = enabled and self.path is not None
        self.log = log
        #: Records not on disk yet (a write failed), in order.
        self.held: List[Dict[str, Any]] = []
        self._unshown: List[Dict[str, Any]] = []
        self._failing = False

    def write(self, record: Dict[str, Any]) -> None:
        """Appends ``record`` (with a ``time`` field) and fsyncs it, after any held ones; held itself on failure."""
        if not self.enabled:
            return
        record = dict(record)
        record.setdefault("time", time.strftime("%Y-%m-%d %H:%M:%S"))
        self.held.append(record)
        if record.get("event") in self.SHOWN:
            self._unshown.append(record)
        self.flush()

    def flush(self) -> bool:
        """Writes the held records; True when none is left held. A failure warns once, naming the path."""
        if not self.held:
            return True
        text = "".join(json.dumps(json_ready(r), default=str) + "\n" for r in self.held)
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            if not self._failing:
                self._say(f"NanGuard: could not write {self.path} ({type(exc).__name__}: {exc}); the run goes on, "
                          f"its records are kept in memory and written there as soon as it takes writes again",
                          "warning")
            self._failing = True
            return False
        if self._failing:
            self._say(f"NanGuard: wrote the {len(self.held)} held record(s) to {self.path}", "info")
        self.held, self._failing = [], False
        return True

    def close(self) -> None:
        """At the run's end: a last :meth:`flush`; each record that still cannot be written goes into the log, one
        JSON line each, so that none is lost."""
        if self.flush():
            return
        self._say(f"NanGuard: {len(self.held)} record(s) could not be written to {self.path}; here they are:", "error")
        for record in self.held:
            self._say(json.dumps(json_ready(record), default=str), "error")
        self.held = []

    def take_unshown(self) -> List[Dict[str, Any]]:
        """The records of :attr:`SHOWN` events written since the last call (held ones too), for the dashboards."""
        records, self._unshown = self._unshown, []
        return records

    def _say(self, message: str, level: str) -> None:
        if self.log is not None:
            self.log(message, level)
        elif level != "info":
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    @staticmethod
    def describe(record: Dict[str, Any]) -> str:
        """A record as a short Markdown text for a dashboard: what happened, its cause, the action, the samples."""
        cause = record.get("cause") or {}
        lines = [f"**{record.get('event')} at iter {record.get('iteration')}**: {record.get('reason') or ''}"]
        if cause.get("cause"):
            lines += [f"- cause: {cause['cause']}: {cause.get('evidence') or '-'}",
                      f"- action: {cause.get('action') or '-'}"]
        changes = [f"{a.get('target')}: {a.get('old')} -> {a.get('new')}" for a in record.get("actions") or []]
        if changes:
            lines.append("- changed: " + "; ".join(changes))
        back = record.get("restored_from")
        if isinstance(back, dict):
            lines.append(f"- rolled back to iter {back.get('iteration')} ({back.get('source')}): "
                         f"{record.get('iterations_lost', 0)} iteration(s) lost")
        signals = cause.get("signals") or {}
        samples = [s for key in ("quarantined", "refused", "bad_data") for s in signals.get(key) or []]
        samples += list(record.get("batch") or [])
        named = list(dict.fromkeys(", ".join(f"{k}={v}" for k, v in s.items() if k != "served_as")
                                   for s in samples if isinstance(s, dict)))
        if named:
            lines.append("- samples: " + "; ".join(named[:20]) + (f" (and {len(named) - 20} more)"
                                                                   if len(named) > 20 else ""))
        if "quarantined" in record:
            lines.append(f"- quarantined: {'yes' if record['quarantined'] else 'no'}")
        lines.append(f"- recoveries: {record.get('recoveries')}/{record.get('max_recoveries')}")
        return "\n".join(lines)


@dataclass
class LogProblem:
    """A line that could not be used: where it is and why."""

    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _parse_line(path: str, number: int, raw: bytes, last: bool, required: Sequence[str]) -> Any:
    """The line's object, or the :class:`LogProblem` saying why it cannot be used."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return LogProblem(path, number, f"not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1})")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return LogProblem(path, number, "a torn line (cut off while it was written)" if last
                          else f"not valid JSON ({exc.msg} at column {exc.colno})")
    if not isinstance(value, dict):
        return LogProblem(path, number, f"a JSON {type(value).__name__}, not an object")
    missing = [k for k in required if k not in value]
    if missing:
        return LogProblem(path, number, f"record without {', '.join(repr(k) for k in missing)}")
    return value


def read_records(path: str, required: Sequence[str] = ()) -> Tuple[List[Tuple[int, Dict[str, Any]]],
                                                                   List[LogProblem]]:
    """Reads a JSON-lines file, keeping line numbers and saying what went wrong with each unusable line.

    Nothing is skipped silently: non-UTF-8 bytes, a line that is not JSON (a torn line), a JSON value that is not an
    object and an object missing one of ``required`` are each a :class:`LogProblem`.

    Args:
        path: the file.
        required: keys every record must have. Defaults to none.

    Returns:
        ([(line number, record), ...], [problem, ...]), both in file order; blank lines are neither.
    """
    with open(path, "rb") as f:
        data = f.read()
    records: List[Tuple[int, Dict[str, Any]]] = []
    problems: List[LogProblem] = []
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        torn = number == len(lines) and not data.endswith(b"\n")
        value = _parse_line(path, number, raw, torn, required)
        if isinstance(value, LogProblem):
            problems.append(value)
        else:
            records.append((number, value))
    return records, problems


def read_incidents(path: str) -> List[Dict[str, Any]]:
    """Reads the incident records of a run.

    Args:
        path: the log file, or a work dir holding ``nan_guard_incidents.jsonl``.

    Returns:
        The records in order. A work dir without the file (a run with no incident) gives an empty list. Lines that
        cannot be used (a torn last line of a killed writer, non-UTF-8 bytes, a JSON value that is not an object,
        a record without ``event``) are skipped with one ``RuntimeWarning`` naming them, as ``report`` does.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"no incident log or work dir at {path}")
    if os.path.isdir(path):
        path = os.path.join(path, INCIDENT_FILE)
        if not os.path.exists(path):
            return []
    records, problems = read_records(path, required=("event",))
    if problems:
        shown = "; ".join(str(p) for p in problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3
                                                           else "")
        warnings.warn(f"read_incidents: skipped {len(problems)} unusable line(s): {shown}", RuntimeWarning,
                      stacklevel=2)
    return [record for _, record in records]
