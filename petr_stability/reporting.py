"""What ``petr-stability report WORK_DIR`` shows: a run's incidents as text, a PNG timeline and an HTML page.

A work dir is read as the runners write it: ``nan_guard_incidents.jsonl`` at its top, MMEngine's
``<timestamp>/vis_data/scalars.json`` and MMCV 1.x's ``<timestamp>.log.json`` (one per start, so a resumed run has
several, read in timestamp order). After a rollback the runner's counter replays iterations, so log lines are kept
in file order and cut into *segments* (a new one wherever the iteration does not move forward, and at every new
file): each attempt is drawn as its own line, never sorted into one zig-zag. Damaged lines are reported with file
and line number, and every count that could be short because of them says so.

The PNG has the run's config and work dir as its title, a panel for each series the run logged (loss, grad_norm,
loss scale, max_norm: an fp32 run has no loss-scale panel) and each incident's number, cause and action at its
line. The HTML page beside it shows the picture, one table row per numbered incident and the text summary.
"""
import html
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .core.diagnosis.replay import summarize as summarize_diagnosis
from .core.records import INCIDENT_EVENTS, INCIDENT_FILE, Event, LogProblem, read_records

__all__ = [
    "RunLogs",
    "find_runs",
    "is_run_log",
    "read_incident_records",
    "read_scalars",
    "summarize",
    "run_config",
    "incident_label",
    "timeline_panels",
    "timeline_figure",
    "plot_timeline",
    "html_page",
    "report_run",
    "REPORT_PNG",
]

_DROPOUT_ATTRS = ("p", "dropout", "dropout_p", "drop_prob", "attn_drop", "proj_drop")
_RUNNER_TYPE = re.compile(r"""runner\s*=\s*dict\(\s*type\s*=\s*['"](\w+)['"]"""
                          r"""|['"]runner['"]\s*:\s*\{\s*['"]type['"]\s*:\s*['"](\w+)['"]""")
_EPOCH_LEN = re.compile(r"Epoch \[\d+\]\[\d+/(\d+)\]")
#: The picture's default name in a run's work dir; the page is ``nan_guard_report.html`` beside it.
REPORT_PNG = "nan_guard_report.png"
#: The guard's patched config (adapters/driver.py's PATCHED_CONFIG_FILE): its first line names the run's config.
PATCHED_CONFIG = "nan_guard_patched_config.py"
#: The panels, each drawn only where the run logged it: (label, keys in order of preference, log scale).
_PANELS = (("loss", ("loss",), False), ("grad_norm", ("grad_norm",), True),
           ("loss scale", ("nan_guard/loss_scale", "loss_scale"), True), ("max_norm", ("nan_guard/max_norm",), False))
#: Per-step fp32 records: dotted lines, not numbered (a run can have many).
_PER_STEP = (Event.SKIP, Event.NONFINITE_LOSS)
_LABEL_CHARS = 90
_LABEL_ROWS = 10


@dataclass
class RunLogs:
    """The log files of one run (one work dir), each list in the order it was written."""

    root: str
    incidents: List[str] = field(default_factory=list)
    mmengine: List[str] = field(default_factory=list)
    mmcv1: List[str] = field(default_factory=list)

    def files(self) -> List[str]:
        """Every file, incidents first."""
        return self.incidents + self.mmengine + self.mmcv1


def _run_root(path: str) -> Optional[Tuple[str, str]]:
    """(run root, kind) of a log file by its name and place, or None for other files."""
    name = os.path.basename(path)
    here = os.path.dirname(os.path.abspath(path))
    if name.endswith(".jsonl") and name == INCIDENT_FILE:
        return here, "incidents"
    if name == "scalars.json" and os.path.basename(here) == "vis_data":
        return os.path.dirname(os.path.dirname(here)), "mmengine"  # <work_dir>/<timestamp>/vis_data/
    if name.endswith(".log.json"):
        return here, "mmcv1"
    return None


def is_run_log(path: str) -> bool:
    """Whether ``path`` is named and placed as one of a run's logs (what :func:`find_runs` reads)."""
    return _run_root(path) is not None


def find_runs(path: str) -> List[RunLogs]:
    """The runs under a work dir (or the run a log file belongs to), each with its logs in writing order.

    A run is a directory holding ``nan_guard_incidents.jsonl`` or ``*.log.json``, or the work dir above a
    ``<timestamp>/vis_data/scalars.json``. Timestamped names sort in time order; that order is used.

    Args:
        path: a work dir, a parent of several, or one log file (e.g. the ``.jsonl`` itself).

    Returns:
        The runs, sorted by directory.
    """
    if os.path.isfile(path):
        found = _run_root(path)
        if found is None:
            raise ValueError(f"{path} is not a run's log (nan_guard_incidents.jsonl, vis_data/scalars.json or "
                             "*.log.json); give the run's work dir")
        root, kind = found
        runs = [r for r in find_runs(root) if r.root == root] or [RunLogs(root)]
        setattr(runs[0], kind, [os.path.abspath(path)])
        return runs[:1]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"work dir {path} does not exist")
    runs: Dict[str, RunLogs] = {}
    for here, dirs, files in os.walk(os.path.abspath(path)):
        dirs.sort()
        for name in files:
            found = _run_root(os.path.join(here, name))
            if found is not None:
                root, kind = found
                getattr(runs.setdefault(root, RunLogs(root)), kind).append(os.path.join(here, name))
    for run in runs.values():
        run.mmengine.sort(key=lambda p: os.path.relpath(p, run.root))
        run.mmcv1.sort(key=os.path.basename)
    return [runs[k] for k in sorted(runs)]


def read_incident_records(run: RunLogs) -> Tuple[List[Dict[str, Any]], List[LogProblem]]:
    """The incident log's records (each needs ``event`` and ``iteration``) and the lines that could not be read."""
    records: List[Dict[str, Any]] = []
    problems: List[LogProblem] = []
    for path in run.incidents:
        recs, probs = read_records(path, required=("event", "iteration"))
        for number, rec in recs:
            if isinstance(rec["iteration"], bool) or not isinstance(rec["iteration"], int):
                probs.append(LogProblem(path, number, f"'iteration' is not an integer: {rec['iteration']!r}"))
                continue
            records.append(rec)
        problems += sorted(probs, key=lambda p: p.line)
    return records, problems


def _num(value: Any) -> Optional[float]:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)  # 'nan', 'inf', 'Infinity'
        except ValueError:
            return None
    return None


def _numbers(rec: Dict[str, Any]) -> Dict[str, float]:
    return {k: v for k, v in ((k, _num(v)) for k, v in rec.items()) if v is not None}


def _mmcv1_runner_kind(meta: List[Dict[str, Any]]) -> Optional[str]:
    """'iter' or 'epoch' from the runner type in the config text MMCV 1.x dumps as a log's first line."""
    for rec in meta:
        match = _RUNNER_TYPE.search(str(rec.get("config", "")))
        if match:
            name = match.group(1) or match.group(2)
            if "Iter" in name:
                return "iter"
            if "Epoch" in name:
                return "epoch"
    return None


def _epoch_length_from_text_logs(paths: Sequence[str]) -> Optional[int]:
    """``len(data_loader)`` from the text log next to a ``.log.json`` (``Epoch [1][50/3517]``)."""
    for path in paths:
        text_log = path[: -len(".json")]
        if os.path.isfile(text_log):
            with open(text_log, encoding="utf-8", errors="replace") as f:
                for line in f:
                    match = _EPOCH_LEN.search(line)
                    if match:
                        return int(match.group(1))
    return None


def _mmcv1_rows(paths: Sequence[str]) -> Tuple[List[Tuple[str, Dict[str, Any]]], List[LogProblem], str]:
    """Train lines of MMCV 1.x logs with a global ``iter``, the problems, and how the iteration was worked out."""
    lines: List[Tuple[str, Dict[str, Any]]] = []
    meta: List[Dict[str, Any]] = []
    problems: List[LogProblem] = []
    for path in paths:
        recs, probs = read_records(path)
        problems += probs
        for number, rec in recs:
            if "mode" not in rec:
                meta.append(rec)  # env_info / config / seed, written at the start of each run
                continue
            if rec["mode"] != "train":
                continue
            bad = [k for k in ("epoch", "iter") if _num(rec.get(k)) is None]
            if bad:
                problems.append(LogProblem(path, number, f"train record without a numeric {bad[0]!r}"))
                continue
            lines.append((path, rec))
    kind = _mmcv1_runner_kind(meta)
    how = f"{'IterBasedRunner' if kind == 'iter' else 'EpochBasedRunner'} (from the config in the log)" if kind \
        else ""
    if kind is None:
        # IterBasedRunner logs a global iter and counts loader passes as epochs: across an epoch change the iter
        # keeps growing. EpochBasedRunner's iter restarts in each epoch.
        grows = [int(b["iter"]) > int(a["iter"]) for (_, a), (_, b) in zip(lines, lines[1:])
                 if int(b["epoch"]) > int(a["epoch"])]
        kind = "iter" if grows and all(grows) or not grows else "epoch"
        how = ("a global iter (IterBasedRunner, or a single epoch)" if kind == "iter"
               else "an iter counted within each epoch (EpochBasedRunner)")
    if kind == "epoch":
        length = _epoch_length_from_text_logs(paths)
        if length is not None:
            how += f"; epoch length {length} from the text log"
        else:
            length = max((int(r["iter"]) for _, r in lines), default=0)
            how += (f"; epoch length taken as {length}, the largest iter logged in an epoch (short by less than "
                    "the logging interval unless the length is a multiple of it; the text log next to the "
                    ".log.json gives it exactly)")
        for _, rec in lines:
            rec["iter"] = (int(rec["epoch"]) - 1) * length + int(rec["iter"])
    return lines, problems, how


def read_scalars(run: RunLogs) -> Tuple[List[Dict[str, float]], List[LogProblem], str]:
    """Reads a run's training log lines as rows ``{'iter', 'segment', 'loss', 'grad_norm', ...}``, NaN/Inf kept.

    Rows stay in file order; ``segment`` starts at 0 and grows wherever the iteration does not move forward (the
    counter replays after a rollback) and at each new file (a resumed run). MMEngine lines carry a global
    ``iter``; MMCV 1.x ``IterBasedRunner`` lines too (their ``epoch`` counts loader passes); MMCV 1.x
    ``EpochBasedRunner`` lines count ``iter`` within an epoch, made global with the epoch length.

    Returns:
        (rows, problems, a note on how MMCV 1.x iterations were read, or "").
    """
    lines: List[Tuple[str, Dict[str, Any]]] = []
    problems: List[LogProblem] = []
    how = ""
    for path in run.mmengine:
        recs, probs = read_records(path)
        problems += probs
        for number, rec in recs:
            if "iter" not in rec:
                if "loss" in rec:
                    problems.append(LogProblem(path, number, "training record without 'iter'"))
                continue  # validation lines carry 'step' only
            if _num(rec["iter"]) is None:
                problems.append(LogProblem(path, number, f"'iter' is not a number: {rec['iter']!r}"))
                continue
            lines.append((path, rec))
    if run.mmcv1:
        mmcv1, probs, how = _mmcv1_rows(run.mmcv1)
        lines += mmcv1
        problems += probs
    rows: List[Dict[str, float]] = []
    segment, last_path, last_iter = -1, None, None
    for path, rec in lines:
        row = _numbers(rec)
        if path != last_path or last_iter is None or row["iter"] <= last_iter:
            segment += 1
        row["segment"] = float(segment)
        rows.append(row)
        last_path, last_iter = path, row["iter"]
    return rows, problems, how


def _fmt(value: Any) -> str:
    return "-" if value is None else (f"{value:g}" if isinstance(value, float) else str(value))


def summarize(records: List[Dict[str, Any]], rows: List[Dict[str, float]], unreadable_records: int = 0,
              unreadable_lines: int = 0) -> Tuple[str, Dict[str, Any]]:
    """The text summary and its numbers (incidents, actions, iterations lost, skips, max_norm, dropout state).

    Args:
        records: the incident log's records, in file order.
        rows: from :func:`read_scalars`.
        unreadable_records: incident-log lines that could not be read; every count from the incident log is
            then marked as a lower bound. Defaults to 0.
        unreadable_lines: training-log lines that could not be read. Defaults to 0.
    """
    at_least = ">= " if unreadable_records else ""
    incidents = [r for r in records if r.get("event") in INCIDENT_EVENTS]
    gave_up = [r for r in records if r.get("event") == Event.GAVE_UP]
    skips = [r for r in records if r.get("event") == Event.SKIP]
    lost = sum(int(r.get("iterations_lost") or 0) for r in records)
    actions = [(r.get("iteration"), a) for r in records for a in r.get("actions") or [] if isinstance(a, dict)]
    max_norm: Optional[float] = None
    for row in rows:
        if "nan_guard/max_norm" in row:
            max_norm = row["nan_guard/max_norm"]
    clip_actions = [a for _, a in actions if str(a.get("target", "")).endswith("max_norm")]
    if clip_actions:
        max_norm = _num(clip_actions[-1].get("new"))
    dropout = [a for _, a in actions if str(a.get("target", "")).rsplit(".", 1)[-1] in _DROPOUT_ATTRS]
    nonfinite = sum(1 for row in rows for k in ("loss", "grad_norm") if k in row and not math.isfinite(row[k]))
    segments = len({row["segment"] for row in rows})
    numbers = dict(incidents=len(incidents), gave_up=len(gave_up), iterations_lost=lost, actions=len(actions),
                   skipped_steps=len(skips), max_norm=max_norm, dropout_zeroed=len(dropout), log_lines=len(rows),
                   segments=segments, nonfinite_log_values=nonfinite, unreadable_records=unreadable_records,
                   unreadable_lines=unreadable_lines)
    lines = []
    if unreadable_records:
        lines.append(f"WARNING: {unreadable_records} incident record(s) could not be read (see the warnings): "
                     "counts from the incident log below are lower bounds")
    lines.append(f"incidents: {at_least}{len(incidents)}"
                 + (f" (and the guard gave up {len(gave_up)} time(s))" if gave_up else ""))
    for r in records:
        if r.get("event") == Event.SKIP:
            continue
        back = r.get("restored_from") or {}
        where = (f"; rolled back to iter {back.get('iteration')} ({back.get('source')})"
                 if isinstance(back, dict) and back else "")
        lines.append(f"  iter {r.get('iteration')}: {r.get('event')}: {r.get('reason') or r.get('why') or '-'}"
                     f"{where}; {r.get('iterations_lost') or 0} iteration(s) lost")
        if r.get("event") == Event.GAVE_UP and r.get("why"):
            lines.append(f"    gave up: {r['why']}")
        if isinstance(r.get("diagnosis"), dict):
            lines.append(f"    diagnosis: {summarize_diagnosis(r['diagnosis'])}")
        cause = r.get("cause")
        if isinstance(cause, dict) and cause.get("cause"):
            lines.append(f"    cause: {cause['cause']}: {cause.get('evidence') or '-'}; "
                         f"action: {cause.get('action') or '-'}")
        named = quarantined_samples(r)
        if named:
            lines.append("    quarantined: " + "; ".join(_sample_text(x) for x in named))
    lines.append(f"iterations lost: {at_least}{lost}")
    lines.append(f"fp32 steps skipped by the guard: {at_least}{len(skips)}")
    for r in skips:
        lines.append(f"  iter {r.get('iteration')}: {r.get('reason') or '-'}")
    lines.append(f"actions: {at_least}{len(actions)}")
    for it, a in actions:
        lines.append(f"  iter {it}: {a.get('target')}: {_fmt(a.get('old'))} -> {_fmt(a.get('new'))}")
    lines.append("current max_norm: " + ("unknown (no guard scalar or clip action logged)" if max_norm is None
                                         else f"{max_norm:g}"))
    lines.append(f"dropout: {len(dropout)} transformer dropout(s) set to 0 by the guard" if dropout
                 else "dropout: unchanged by the guard (as configured)")
    lines.append(f"log lines: {len(rows)} in {segments} segment(s) (a new one after each rollback and each "
                 f"resume); non-finite loss/grad_norm values in them: {nonfinite} (grad_norm is averaged over the "
                 "logging window; the incident log has per-step values)")
    if unreadable_lines:
        lines.append(f"unreadable training-log lines: {unreadable_lines} (see the warnings; left out above)")
    return "\n".join(lines), numbers


def _superseded_from(rows: List[Dict[str, float]]) -> Dict[float, float]:
    """Per segment, the iteration from which a later segment replays it (abandoned by a rollback)."""
    starts: Dict[float, float] = {}
    for row in rows:
        starts.setdefault(row["segment"], row["iter"])
    cut: Dict[float, float] = {}
    later = math.inf
    for seg in sorted(starts, reverse=True):
        cut[seg] = later
        later = min(later, starts[seg])
    return cut


def run_config(run: RunLogs) -> str:
    """The config a run trained from, for the report's title.

    The path the guard's patched config names in its first line (written after an incident), else the copies of
    it the runner dumped at the top of the work dir (MMEngine's ``dump_config``, mmdet's train scripts: the
    config's own file name), else ``'unknown'``.
    """
    try:
        with open(os.path.join(run.root, PATCHED_CONFIG), encoding="utf-8") as f:
            match = re.match(r"# Written by petr_stability from (.+\.py)\s*$", f.readline())
        if match:
            return match.group(1)
    except (OSError, UnicodeDecodeError):
        pass
    dumped = sorted(n for n in os.listdir(run.root) if n.endswith(".py") and n != PATCHED_CONFIG)
    if dumped:
        return f"{', '.join(dumped)} (the runner's copy in the work dir)"
    return "unknown (no config file in the work dir)"


def _labelled(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The records numbered in the picture and the page, in file order: all but the per-step fp32 ones."""
    return [r for r in records if r.get("event") not in _PER_STEP]


def _cause(rec: Dict[str, Any]) -> Dict[str, Any]:
    cause = rec.get("cause")
    return cause if isinstance(cause, dict) else {}


def _changes(rec: Dict[str, Any]) -> List[str]:
    """The settings the guard changed at this record, as ``target: old -> new``."""
    return [f"{a.get('target')}: {_fmt(a.get('old'))} -> {_fmt(a.get('new'))}"
            for a in rec.get("actions") or [] if isinstance(a, dict)]


def _rollback(rec: Dict[str, Any]) -> str:
    back = rec.get("restored_from")
    if not isinstance(back, dict) or not back:
        return ""
    return f"iter {back.get('iteration')} ({back.get('source')})"


def quarantined_samples(rec: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The samples this record put in quarantine: its class's ``quarantined`` signal, or a recurring sample's batch
    where the record says it was quarantined."""
    samples = (_cause(rec).get("signals") or {}).get("quarantined")
    if not isinstance(samples, list) and rec.get("event") == Event.RECURRING_SAMPLE and rec.get("quarantined") is True:
        samples = rec.get("batch")
    return [s for s in samples or () if isinstance(s, dict)] if isinstance(samples, list) else []


def _sample_text(sample: Dict[str, Any]) -> str:
    """``index 10 (sample_idx 10, token ...)``: the index a run's sampler serves, then what else names it (scalars)."""
    rest = [f"{k} {v}" for k, v in sample.items()
            if k not in ("index", "evidence") and isinstance(v, (str, int, float)) and not isinstance(v, bool)]
    return f"index {sample.get('index')}" + (f" ({', '.join(rest)})" if rest else "")


def _short_changes(rec: Dict[str, Any]) -> List[str]:
    """The changes by setting name (``max_norm 35 -> 1``; ``dropout 0.1 -> 0 (x12)`` for twelve modules' dropout)."""
    counts: Dict[Tuple[str, str, str], int] = {}
    named = quarantined_samples(rec)
    for a in rec.get("actions") or []:
        if isinstance(a, dict):
            target = str(a.get("target"))
            if named and target == "quarantine.samples":  # which samples, not how many
                continue
            name = target.rsplit(".", 1)[-1] if target.count(".") >= 2 else target
            key = (name, _fmt(a.get("old")), _fmt(a.get("new")))
            counts[key] = counts.get(key, 0) + 1
    done = [f"{name} {old} -> {new}" + (f" (x{n})" if n > 1 else "") for (name, old, new), n in counts.items()]
    if named:
        done.insert(0, "quarantined index " + ", ".join(str(x.get("index")) for x in named))
    return done


def incident_label(number: int, rec: Dict[str, Any]) -> str:
    """One line at an incident's line in the picture: its number, cause (or event) and what the guard did."""
    cause = _cause(rec).get("cause") or rec.get("event")
    done = _short_changes(rec)
    if rec.get("event") == Event.GAVE_UP:
        done = ["gave up"]
    elif _rollback(rec):
        done.append(f"rolled back to {_rollback(rec)}")
    text = f"#{number} {cause}: {'; '.join(done) or rec.get('reason') or '-'}"
    return text if len(text) <= _LABEL_CHARS else text[:_LABEL_CHARS - 3] + "..."


def timeline_panels(rows: List[Dict[str, float]]) -> List[Tuple[str, str, bool]]:
    """(label, key, log scale) of each panel the run has a value for: no loss-scale panel for an fp32 run."""
    panels = []
    for title, keys, log in _PANELS:
        key = next((k for k in keys if any(k in r and math.isfinite(r[k]) for r in rows)), None)
        if key is None:
            key = next((k for k in keys if any(k in r for r in rows)), None)  # logged, only ever NaN/Inf
        if key is not None:
            panels.append((title, key, log))
    return panels


def _draw_series(ax: Any, rows: List[Dict[str, float]], key: str, log: bool, cut: Dict[float, float]) -> None:
    any_good = False
    for seg in sorted(cut):
        pts = [(r["iter"], r[key]) for r in rows if r["segment"] == seg and key in r]
        good = [(x, y) for x, y in pts if math.isfinite(y) and (y > 0 or not log)]
        kept = [(x, y) for x, y in good if x < cut[seg]]
        dropped = [(x, y) for x, y in good if x >= cut[seg]]
        if kept:
            ax.plot([x for x, _ in kept], [y for _, y in kept], lw=1.2, color="C0")
        if dropped:  # joined to where it left off, faint: the attempt a rollback abandoned
            joined = kept[-1:] + dropped
            ax.plot([x for x, _ in joined], [y for _, y in joined], lw=1.0, color="C0", alpha=0.35, ls="--")
        any_good = any_good or bool(good)
    bad = [r["iter"] for r in rows if key in r and not math.isfinite(r[key])]
    if bad:  # NaN/Inf have no height: mark them along the top edge
        ax.plot(bad, [1.0] * len(bad), "x", color="red", transform=ax.get_xaxis_transform(),
                label="NaN/Inf in log", clip_on=False)
        ax.legend(loc="upper left", fontsize=8)
    if log and any_good:
        ax.set_yscale("log")


def _draw_records(ax: Any, records: List[Dict[str, Any]]) -> None:
    for r in records:
        it = r.get("iteration")
        if r.get("event") in _PER_STEP:
            ax.axvline(it, color="grey", ls=":", lw=0.8)
            continue
        ax.axvline(it, color="red" if r.get("event") != Event.STALLED else "orange", ls="--", lw=1)
        back = r.get("restored_from") or {}
        if isinstance(back, dict) and isinstance(back.get("iteration"), int):
            ax.axvspan(back["iteration"], it, color="red", alpha=0.08)


def _label_strip(ax: Any, records: List[Dict[str, Any]], xmin: float, xmax: float) -> None:
    """Writes each numbered incident's label at its iteration, one row each, in a strip above the panels."""
    labelled = _labelled(records)
    rows = min(len(labelled), _LABEL_ROWS)
    ax.set_ylim(rows + 0.5, 0.3)
    ax.set_yticks([])
    for side in ("left", "right", "bottom", "top"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="x", length=0)
    middle = (xmin + xmax) / 2
    for number, rec in enumerate(labelled, 1):
        x, row = rec.get("iteration"), (number - 1) % _LABEL_ROWS + 1
        ax.plot([x, x], [row, rows + 0.5], color="red", lw=0.8, ls="--")
        text = ax.text(x, row, " " + incident_label(number, rec) + " ", va="center", fontsize=8, color="darkred",
                       ha="left" if x <= middle else "right")
        text.set_in_layout(False)  # a long label may run past the axes: never squeeze the panels for it


def timeline_figure(rows: List[Dict[str, float]], records: List[Dict[str, Any]], title: str = "") -> Any:
    """The report's figure: a strip with each numbered incident's label at its iteration (:func:`incident_label`),
    then one panel per logged series (:func:`timeline_panels`) with the incidents marked, ``title`` above.
    Returns the matplotlib ``Figure``.

    Each segment of ``rows`` (see :func:`read_scalars`) is its own line; the part of a segment that a later one
    replays (abandoned by a rollback) is drawn faint.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = timeline_panels(rows) or [("incidents", "", False)]  # no training log: the incidents alone
    labels = min(len(_labelled(records)), _LABEL_ROWS)
    heights = ([0.35 + 0.22 * labels] if labels else []) + [1.9] * len(panels)
    fig, axes = plt.subplots(len(heights), 1, figsize=(11, 1.0 + sum(heights)), sharex=True, squeeze=False,
                             gridspec_kw=dict(height_ratios=heights))
    axes = list(axes[:, 0])
    strip = axes.pop(0) if labels else None
    cut = _superseded_from(rows)
    for ax, (label, key, log) in zip(axes, panels):
        if key:
            _draw_series(ax, rows, key, log, cut)
        else:
            ax.set_yticks([])
        _draw_records(ax, records)
        ax.set_ylabel(label)
    xs = [r["iter"] for r in rows] + [r.get("iteration") for r in records if isinstance(r.get("iteration"), int)]
    if strip is not None:
        _label_strip(strip, records, min(xs), max(xs))
    (strip or axes[0]).set_title("dashed red: guard incidents (#n cause: what the guard did); shaded: iterations "
                                 "rolled back (their first attempt faint); dotted grey: fp32 steps", fontsize=8)
    axes[-1].set_xlabel("iteration")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_timeline(rows: List[Dict[str, float]], records: List[Dict[str, Any]], path: str, title: str = "") -> None:
    """Writes :func:`timeline_figure` as a PNG to ``path``."""
    import matplotlib.pyplot as plt

    fig = timeline_figure(rows, records, title)
    labels = [incident_label(n, r) for n, r in enumerate(_labelled(records), 1)]
    # PNG text chunks: a viewer shows the title; the labels stay readable where the picture crowds them
    fig.savefig(path, dpi=100, metadata={"Title": title.replace("\n", "; "), "Description": "\n".join(labels)})
    plt.close(fig)


def _cell(value: Any) -> str:
    return f"<td>{html.escape(str(value), quote=True)}</td>"


def _incident_rows(records: List[Dict[str, Any]]) -> List[str]:
    out = []
    for number, r in enumerate(_labelled(records), 1):
        cause = _cause(r)
        diagnosis = summarize_diagnosis(r["diagnosis"]) if isinstance(r.get("diagnosis"), dict) else ""
        named = quarantined_samples(r)
        changes = _changes(r) + (["quarantined " + "; ".join(_sample_text(x) for x in named)] if named else [])
        cells = [number, r.get("iteration"), r.get("event"), r.get("reason") or r.get("why") or "",
                 cause.get("cause") or "", cause.get("evidence") or "", cause.get("action") or "",
                 "; ".join(changes), _rollback(r), r.get("iterations_lost") or 0, diagnosis]
        out.append("<tr>" + "".join(_cell(c) for c in cells) + "</tr>")
    return out


def html_page(title: Dict[str, str], summary: str, records: List[Dict[str, Any]], png: Optional[str]) -> str:
    """The report as an HTML page: the title, the picture (``png``, a path relative to the page), one table row
    per numbered incident (the numbers of the picture) and the text summary. Every value is escaped."""
    esc = html.escape
    head = ["#", "iteration", "event", "reason", "cause", "evidence", "the cause's action", "settings changed",
            "rolled back to", "iterations lost", "diagnosis"]
    rows = _incident_rows(records)
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', '<head><meta charset="utf-8">',
        f"<title>petr-stability report: {esc(title['config'])}</title>",
        "<style>body{font:14px sans-serif;margin:1.5em} table{border-collapse:collapse}"
        " td,th{border:1px solid #bbb;padding:3px 6px;vertical-align:top;text-align:left} pre{font-size:12px}</style>",
        "</head>", "<body>", "<h1>petr-stability report</h1>",
        f"<p>config: <code>{esc(title['config'])}</code><br>work dir: <code>{esc(title['work_dir'])}</code></p>",
        f'<p><img src="{esc(png, quote=True)}" alt="timeline"></p>' if png else
        "<p>timeline: not drawn (matplotlib is not installed)</p>",
        f"<h2>Incidents ({len(rows)})</h2>",
        "<table><thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr></thead><tbody>",
        *rows, "</tbody></table>", "<h2>Summary</h2>", f"<pre>{esc(summary)}</pre>", "</body>", "</html>", ""]
    return "\n".join(parts)


def report_run(run: RunLogs, out: Optional[str]) -> None:
    """Prints a run's summary; writes its PNG timeline (with matplotlib) and, beside it, its HTML page.

    Args:
        run: from :func:`find_runs`.
        out: the PNG's path; the page takes its name with ``.html``. Defaults to ``<run>/nan_guard_report.png``.
    """
    records, bad_records = read_incident_records(run)
    rows, bad_lines, how = read_scalars(run)
    for problem in bad_records + bad_lines:
        print(f"warning: {problem}", file=sys.stderr)
    title = {"config": run_config(run), "work_dir": run.root}
    print(f"work dir: {run.root}")
    print(f"config: {title['config']}")
    print(f"logs: {', '.join(run.files())}")
    if how:
        print(f"MMCV 1.x iterations: {how}")
    text, _ = summarize(records, rows, len(bad_records), len(bad_lines))
    print(text)
    out = out or os.path.join(run.root, REPORT_PNG)
    page = os.path.splitext(out)[0] + ".html"
    try:
        import matplotlib  # noqa: F401 - only to know whether the plot can be drawn
    except ImportError:
        png = None
        print("timeline: not drawn, matplotlib is not installed (pip install matplotlib, then run this again)")
    else:
        plot_timeline(rows, records, out, f"{title['config']}\nwork dir: {title['work_dir']}")
        png = os.path.relpath(os.path.abspath(out), os.path.dirname(os.path.abspath(page)))
        print(f"timeline: {out}")
    with open(page, "w", encoding="utf-8") as f:
        f.write(html_page(title, text, records, png))
    print(f"page: {page}")
