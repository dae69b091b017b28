"""Diagnosis: the failing batch replayed with hooks (:mod:`.replay`), the fp32 counterfactual (:mod:`.fp32_check`) and
the class read from it (:mod:`.classify`). Nothing here runs on a healthy step but :func:`~.sandbox.capture_rng`."""
from .classify import CauseHistory, batch_broke, classify, data_by_evidence, from_inputs, merge, recurring
from .replay import COMPARE, FP16_MAX, diagnose, diagnose_step, summarize, total_loss
from .sandbox import capture_rng, rank_local, restore_rng

__all__ = ["CauseHistory", "batch_broke", "classify", "from_inputs", "data_by_evidence", "merge", "recurring",
           "COMPARE", "FP16_MAX", "diagnose",
           "diagnose_step", "summarize", "total_loss", "capture_rng", "rank_local", "restore_rng"]
