"""NanGuardHook under MMEngine DDP: 2 CPU processes (gloo) under torch.distributed.run, one scenario per job."""
import os

import torch
from launch import run_agreeing

from petr_stability.core.safe_load import safe_load

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


def run(scenario, tmp_path):
    return run_agreeing(WORKER, scenario, str(tmp_path))


def test_weights_poisoned_on_one_rank_roll_back_everywhere(tmp_path):
    r0, r1, (rec,) = run("weights_one_rank", tmp_path)
    assert r0["error"] is None and r0["iter"] == 18
    assert rec["event"] == "divergence" and rec["world_size"] == 2
    # Rank 0 (which writes the log) saw nothing wrong itself: the verdict came from rank 1.
    assert rec["reason"].startswith("another rank reported DIVERGED")
    assert rec["restored_from"]["source"] == "memory"
    assert r0["guard"]["recoveries"] == 1 and r0["max_norm"] == 1.0


def test_loss_nan_on_one_rank_fp32(tmp_path):
    r0, r1, records = run("loss_one_rank", tmp_path)
    assert r0["error"] is None and r0["iter"] == 18
    assert [r["event"] for r in records] == ["divergence"]
    assert r0["guard"]["skipped_steps"] >= 1


def test_weights_poisoned_on_all_ranks_with_one_snapshot_copy_per_node(tmp_path):
    r0, r1, (rec,) = run("weights_all_ranks", tmp_path)
    assert r0["error"] is None and r0["iter"] == 18
    assert rec["restored_from"]["source"] == "memory"
    # snapshot_copies='node': rank 0 holds the tensors, rank 1 only the structure (and got them on restore).
    assert r0["snapshot_bytes"] > 0 and r1["snapshot_bytes"] == 0
    assert r0["snapshots"] == r1["snapshots"]


def test_endless_divergence_stops_every_rank_with_the_same_error(tmp_path):
    r0, r1, records = run("endless", tmp_path)
    assert r0["error_type"] == "NanGuardGaveUp"
    assert "recovery budget is spent" in r0["error"]
    assert [r["event"] for r in records] == ["divergence", "gave_up"]


def test_disk_restore_without_a_shared_filesystem(tmp_path):
    r0, r1, (rec,) = run("disk_no_shared_fs", tmp_path)
    assert r0["error"] is None and r0["iter"] == 16
    # Only rank 0's work dir has checkpoints; rank 1 received the state from it.
    assert rec["restored_from"]["source"] == os.path.join(str(tmp_path), "work_rank0", "iter_10.pth")
    rank1_dir = tmp_path / "work_rank1"
    assert not list(rank1_dir.rglob("*.pth")) and not list(rank1_dir.rglob("*.jsonl"))




def test_epoch_end_save_after_a_fault_on_one_rank_is_finite_and_does_not_hang(tmp_path):
    # MMEngine saves on rank 0 only: a collective in before_save_checkpoint would hang (or pair with the next
    # step's agreement). The fault hits rank 1 in the epoch's last iteration, right before the save.
    r0, r1, (rec,) = run("epoch_save_one_rank", tmp_path)
    assert r0["error"] is None
    assert rec["reason"].startswith("another rank reported DIVERGED")
    files = sorted((tmp_path / "work").glob("epoch_*.pth"))
    assert [f.name for f in files] == ["epoch_1.pth", "epoch_2.pth"]
    for f in files:
        ckpt = safe_load(str(f))
        assert all(bool(torch.isfinite(v).all()) for v in ckpt["state_dict"].values() if v.is_floating_point())
