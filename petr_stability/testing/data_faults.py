"""What the data-fault tests check in every family: a run's incident records say data, and nothing but the
quarantine changed (issue 27: bad data never changes max_norm, dropouts, the learning rate or optimizer moments)."""
from typing import Any, Dict, List, Sequence

__all__ = ["TUNED", "tuned_targets", "assert_burst_is_data"]

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
