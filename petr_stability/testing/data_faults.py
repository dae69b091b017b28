"""What the data-fault tests check in every family: a run's incident records say data, and nothing but the
quarantine changed (issue 27: bad data never changes max_norm, dropouts, the learning rate or optimizer moments);
under gradient accumulation, a rollback leaves no partial window behind (issue 33)."""
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import nn

from ..core.watch.detector import DivergenceDetector

__all__ = ["TUNED", "tuned_targets", "assert_burst_is_data", "named_indices", "GradReads", "watch_steps",
           "assert_windows_line_up"]

#: Targets of the settings a data fault must leave alone, as records name them (MMEngine, MMCV 1.x, the torch loop).
TUNED = ("max_norm", "dropout", ".lr", "initial_lr", "base_values", "exp_avg")


def tuned_targets(records: Sequence[Dict[str, Any]]) -> List[str]:
    """The targets of hyperparameter changes in ``records`` (empty when only the quarantine acted)."""
    return [a["target"] for r in records for a in r.get("actions") or [] if any(k in a["target"] for k in TUNED)]


def assert_burst_is_data(records: Sequence[Dict[str, Any]], quarantined: Sequence[int], bad: Sequence[int],
                         samples: Sequence[Dict[str, Any]]) -> None:
    """Every record a divergence classed data, no hyperparameter changed, exactly ``bad`` quarantined, and each
    sample named by its index with the ``sample_idx`` it carries (``samples``: the dataset's)."""
    assert records and all(r["event"] == "divergence" and r["cause"]["cause"] == "data" for r in records), records
    assert not tuned_targets(records)
    assert sorted(quarantined) == sorted(bad)  # every bad sample, no good one
    named = [s for r in records for s in r["cause"]["signals"].get("quarantined", [])]
    assert named and all(s.get("sample_idx") == samples[s["index"]]["sample_idx"] for s in named)


def named_indices(records: Sequence[Dict[str, Any]]) -> List[int]:
    """Every dataset index the records name: a skipped step's or a recurring sample's ``batch``, a divergence's
    quarantined and refused samples, a stop's samples."""
    out = []
    for r in records:
        signals = (r.get("cause") or {}).get("signals") or {}
        for sample in list(r.get("batch") or []) + list(signals.get("quarantined") or []) + list(
                signals.get("refused") or []):
            out.append(sample["index"])
    return out


class GradReads:
    """What the gradients hold as each iteration starts (a test's hook reads them before the iteration runs).

    Attributes:
        rows: per read, (1-based iteration, parameters holding a gradient, those with a non-finite value, those with
            a non-zero value).
    """

    def __init__(self) -> None:
        self.rows: List[Tuple[int, int, int, int]] = []

    def read(self, iteration: int, model: nn.Module) -> None:
        """Reads ``model``'s gradients before ``iteration`` (1-based) runs."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        self.rows.append((iteration, len(grads), sum(not bool(torch.isfinite(g).all()) for g in grads),
                          sum(bool(g.any()) for g in grads)))

    def after_rollbacks(self) -> List[Tuple[int, int, int, int]]:
        """The reads right after a rollback: the iteration counter did not move forward since the previous read."""
        return [row for prev, row in zip(self.rows, self.rows[1:]) if row[0] <= prev[0]]


def watch_steps(monkeypatch: Any) -> List[Tuple[int, bool]]:
    """(1-based iteration, stepped) for every iteration the guard judges, as the adapter's ``read_step`` told it."""
    seen: List[Tuple[int, bool]] = []
    observe = DivergenceDetector.observe

    def spy(self: DivergenceDetector, signals: Any) -> Any:
        seen.append((signals.iteration, signals.stepped))
        return observe(self, signals)

    monkeypatch.setattr(DivergenceDetector, "observe", spy)
    return seen


def assert_windows_line_up(reads: GradReads, steps: Sequence[Tuple[int, bool]], every: int) -> int:
    """Accumulation over ``every`` iterations after rollbacks: each window starts from zero gradients (none held, or
    all zero), the windows after a rollback and the iterations right after one included (no partial window carried
    over from the abandoned path), and the optimizer stepped on a window's last iteration only, as in an uninterrupted
    run (the guard read no other iteration as a step). Returns how many reads followed a rollback."""
    after = reads.after_rollbacks()
    starts = [row for row in reads.rows if (row[0] - 1) % every == 0] + after
    assert starts and all(nonfinite == 0 and nonzero == 0 for _, _, nonfinite, nonzero in starts), starts
    assert steps and all(stepped == (iteration % every == 0) for iteration, stepped in steps), steps
    return len(after)
