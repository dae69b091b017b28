"""The agreement scenarios both runner families must pass; each family's test module subclasses with its worker."""
import os
from typing import Any, Dict, List, Tuple

import torch
from launch import run_agreeing

__all__ = ["AgreementScenarios", "weights_digest"]


def weights_digest(model: torch.nn.Module) -> str:
    """A hash of the parameters, to compare final weights across ranks.

    Parameters only: DDP broadcasts buffers from rank 0 at the start of each forward, so BatchNorm statistics
    differ between ranks by the last batch after any forward; that is DDP, not the guard.
    """
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class AgreementScenarios:
    """Runs each scenario of ``worker`` under torchrun (2 gloo processes) and checks the ranks agreed."""

    worker = ""

    def run(self, scenario: str, tmp_path: Any) -> Tuple[Dict[str, Any], Dict[str, Any], List[Dict]]:
        return run_agreeing(self.worker, scenario, str(tmp_path))

    def test_weights_poisoned_on_one_rank_roll_back_everywhere(self, tmp_path: Any) -> None:
        r0, r1, (rec,) = self.run("weights_one_rank", tmp_path)
        assert r0["error"] is None and r0["iter"] == 18
        assert rec["event"] == "divergence" and rec["world_size"] == 2
        # Rank 0 (which writes the log) saw nothing wrong itself: the verdict came from rank 1.
        assert rec["reason"].startswith("another rank reported DIVERGED")
        assert rec["restored_from"]["source"] == "memory"
        assert r0["guard"]["recoveries"] == 1 and r0["max_norm"] == 1.0

    def test_loss_nan_on_one_rank_fp32(self, tmp_path: Any) -> None:
        r0, r1, records = self.run("loss_one_rank", tmp_path)
        assert r0["error"] is None and r0["iter"] == 18
        assert [r["event"] for r in records] == ["divergence"]
        assert r0["guard"]["skipped_steps"] >= 1

    def test_weights_poisoned_on_all_ranks_with_one_snapshot_copy_per_node(self, tmp_path: Any) -> None:
        r0, r1, (rec,) = self.run("weights_all_ranks", tmp_path)
        assert r0["error"] is None and r0["iter"] == 18
        assert rec["restored_from"]["source"] == "memory"
        # snapshot_copies='node': rank 0 holds the tensors, rank 1 only the structure (and got them on restore).
        assert r0["snapshot_bytes"] > 0 and r1["snapshot_bytes"] == 0
        assert r0["snapshots"] == r1["snapshots"]

    def test_endless_divergence_stops_every_rank_with_the_same_error(self, tmp_path: Any) -> None:
        r0, r1, records = self.run("endless", tmp_path)
        assert r0["error_type"] == "NanGuardGaveUp"
        assert "recovery budget is spent" in r0["error"]
        assert [r["event"] for r in records] == ["divergence", "gave_up"]

    def test_disk_restore_without_a_shared_filesystem(self, tmp_path: Any) -> None:
        r0, r1, (rec,) = self.run("disk_no_shared_fs", tmp_path)
        assert r0["error"] is None and r0["iter"] == 16
        # Only rank 0's work dir has checkpoints; rank 1 received the state from it.
        assert rec["restored_from"]["source"] == os.path.join(str(tmp_path), "work_rank0", "iter_10.pth")
        rank1_dir = tmp_path / "work_rank1"
        assert not list(rank1_dir.rglob("*.pth")) and not list(rank1_dir.rglob("*.jsonl"))
