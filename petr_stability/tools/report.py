"""``petr-stability report WORK_DIR``: summarizes a run's incidents and plots loss, grad_norm, scale and max_norm."""
import glob
import math
import os
from typing import Any, Dict, List, Optional, Tuple

from ..core.incidents import iter_json_lines, read_incidents

__all__ = ["find_logs", "read_scalars", "summarize", "plot_timeline", "main"]

_DROPOUT_ATTRS = ("p", "dropout", "dropout_p", "drop_prob", "attn_drop", "proj_drop")


def find_logs(work_dir: str) -> Dict[str, List[str]]:
    """Finds the incident logs, MMEngine ``vis_data/scalars.json`` and MMCV 1.x ``*.log.json`` under a work dir."""
    if not os.path.isdir(work_dir):
        raise FileNotFoundError(f"work dir {work_dir} does not exist")
    def rec(pattern: str) -> List[str]:
        return sorted(glob.glob(os.path.join(work_dir, "**", pattern), recursive=True), key=os.path.getmtime)
    return {
        "incidents": rec("nan_guard_incidents.jsonl"),
        "mmengine": rec("scalars.json"),
        "mmcv1": rec("*.log.json"),
    }


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


def read_scalars(paths: Dict[str, List[str]]) -> List[Dict[str, float]]:
    """Reads training log lines as ``{'iter': ..., 'loss': ..., 'grad_norm': ..., ...}``, NaN/Inf kept.

    MMEngine lines carry a global ``iter``; MMCV 1.x epoch-based lines count ``iter`` within an epoch, so a
    global iteration is rebuilt from the epoch boundaries. Lines that do not parse are skipped.
    """
    rows: List[Dict[str, float]] = []
    for path in paths.get("mmengine", []):
        for rec in iter_json_lines(path):
            if "iter" not in rec or "step" not in rec and "loss" not in rec:
                continue
            rows.append({k: v for k, v in ((k, _num(v)) for k, v in rec.items()) if v is not None})
    offset, last_epoch, last_iter = 0, None, 0
    for path in paths.get("mmcv1", []):
        for rec in iter_json_lines(path):
            if rec.get("mode") != "train" or "iter" not in rec:
                continue
            epoch = rec.get("epoch")
            if last_epoch is not None and epoch != last_epoch:
                offset += last_iter
            last_epoch, last_iter = epoch, int(rec["iter"])
            row = {k: v for k, v in ((k, _num(v)) for k, v in rec.items()) if v is not None}
            row["iter"] = float(offset + int(rec["iter"]))
            rows.append(row)
    rows.sort(key=lambda r: r["iter"])
    return rows


def _fmt(value: Any) -> str:
    return "-" if value is None else (f"{value:g}" if isinstance(value, float) else str(value))


def summarize(records: List[Dict[str, Any]], rows: List[Dict[str, float]]) -> Tuple[str, Dict[str, Any]]:
    """The text summary and its numbers (incidents, actions, iterations lost, max_norm, dropout state)."""
    incidents = [r for r in records if r.get("event") in ("divergence", "stalled")]
    gave_up = [r for r in records if r.get("event") == "gave_up"]
    lost = sum(int(r.get("iterations_lost") or 0) for r in records)
    actions = [(r.get("iteration"), a) for r in records for a in r.get("actions", [])]
    max_norm: Optional[float] = None
    for row in rows:
        if "nan_guard/max_norm" in row:
            max_norm = row["nan_guard/max_norm"]
    clip_actions = [a for _, a in actions if str(a.get("target", "")).endswith("max_norm")]
    if clip_actions:
        max_norm = _num(clip_actions[-1].get("new"))
    dropout = [a for _, a in actions if str(a.get("target", "")).rsplit(".", 1)[-1] in _DROPOUT_ATTRS]
    nonfinite = sum(1 for row in rows for k in ("loss", "grad_norm") if k in row and not math.isfinite(row[k]))
    numbers = dict(incidents=len(incidents), gave_up=len(gave_up), iterations_lost=lost, actions=len(actions),
                   max_norm=max_norm, dropout_zeroed=len(dropout), log_lines=len(rows), nonfinite_log_values=nonfinite)
    lines = [f"incidents: {len(incidents)}" + (f" (and the guard gave up {len(gave_up)} time(s))" if gave_up else "")]
    for r in records:
        back = r.get("restored_from") or {}
        where = f"; rolled back to iter {int(back['iteration']) + 1} ({back.get('source')})" if back else ""
        lines.append(f"  iter {r.get('iteration')}: {r.get('event')}: {r.get('reason')}{where}; "
                     f"{r.get('iterations_lost') or 0} iteration(s) lost")
    lines.append(f"iterations lost: {lost}")
    lines.append(f"actions: {len(actions)}")
    for it, a in actions:
        lines.append(f"  iter {it}: {a.get('target')}: {_fmt(a.get('old'))} -> {_fmt(a.get('new'))}")
    lines.append("current max_norm: " + ("unknown (no guard scalar or clip action logged)" if max_norm is None
                                         else f"{max_norm:g}"))
    lines.append(f"dropout: {len(dropout)} transformer dropout(s) set to 0 by the guard" if dropout
                 else "dropout: unchanged by the guard (as configured)")
    lines.append(f"log lines: {len(rows)}; non-finite loss/grad_norm values in them: {nonfinite} "
                 "(grad_norm is averaged over the logging window; the incident log has per-step values)")
    return "\n".join(lines), numbers


def plot_timeline(rows: List[Dict[str, float]], records: List[Dict[str, Any]], path: str) -> None:
    """Writes a PNG with loss, grad_norm, loss scale and max_norm over iterations, incidents marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("loss", ["loss"], False), ("grad_norm", ["grad_norm"], True),
              ("loss scale", ["nan_guard/loss_scale", "loss_scale"], True), ("max_norm", ["nan_guard/max_norm"], False)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 9), sharex=True)
    for ax, (title, keys, log) in zip(axes, panels):
        key = next((k for k in keys if any(k in r for r in rows)), None)
        if key is not None:
            pts = [(r["iter"], r[key]) for r in rows if key in r]
            good = [(x, y) for x, y in pts if math.isfinite(y) and (y > 0 or not log)]
            bad = [x for x, y in pts if not math.isfinite(y)]
            if good:
                ax.plot([x for x, _ in good], [y for _, y in good], lw=1.2)
            if bad:  # NaN/Inf have no height: mark them along the top edge
                ax.plot(bad, [1.0] * len(bad), "x", color="red", transform=ax.get_xaxis_transform(),
                        label="NaN/Inf in log", clip_on=False)
                ax.legend(loc="upper left", fontsize=8)
            if log and good:
                ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
        for r in records:
            it = r.get("iteration")
            if it is None:
                continue
            ax.axvline(it, color="red" if r.get("event") != "stalled" else "orange", ls="--", lw=1)
            back = r.get("restored_from") or {}
            if back:
                ax.axvspan(int(back["iteration"]) + 1, it, color="red", alpha=0.08)
        ax.set_ylabel(title)
    axes[0].set_title("dashed: guard incidents; shaded: iterations rolled back", fontsize=9)
    axes[-1].set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(args: Any) -> int:
    """Entry point of ``petr-stability report`` (``args`` from :mod:`petr_stability.cli`)."""

    paths = find_logs(args.work_dir)
    records = [r for p in paths["incidents"] for r in read_incidents(p)]
    rows = read_scalars(paths)
    if not records and not rows:
        raise FileNotFoundError(f"no nan_guard_incidents.jsonl, vis_data/scalars.json or *.log.json under "
                                f"{args.work_dir}")
    text, _ = summarize(records, rows)
    print(f"work dir: {args.work_dir}")
    print(f"logs: {', '.join(paths['incidents'] + paths['mmengine'] + paths['mmcv1'])}")
    print(text)
    out = args.out or os.path.join(args.work_dir, "nan_guard_report.png")
    plot_timeline(rows, records, out)
    print(f"timeline: {out}")
    return 0
