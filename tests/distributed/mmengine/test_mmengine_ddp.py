"""NanGuardHook under MMEngine DDP: 2 CPU processes (gloo) under torch.distributed.run, one scenario per job."""
import os

import torch
from launch import run_agreeing
from scenarios import AgreementScenarios

from petr_stability.adapters.mmengine_runner.checkpoints import load_mmengine_checkpoint as safe_load

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


class TestMMEngineDDP(AgreementScenarios):
    worker = WORKER
    known_bugs: dict = {}


def run(scenario, tmp_path):
    return run_agreeing(WORKER, scenario, str(tmp_path))


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
