"""The distributed case on GPUs: an NCCL process group, one GPU per rank, each runner family's own DDP and fp16.

Uses every GPU up to two (one on the lent machine: a 1-process NCCL group; two or more: the ranks must also
agree). Each test skips itself, with the reason, without a GPU or without its runner family installed; see
cuda_profile.py for the CPU rehearsal (gloo, one process).
"""
import os
import sys

from petr_stability.testing.stacks import require

HERE = os.path.dirname(os.path.abspath(__file__))
DIST = os.path.join(HERE, "..", "distributed")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(DIST, "common"))
from cuda_profile import MARKS, PROFILE  # noqa: E402

pytestmark = MARKS


def _run(family, tmp_path):
    from launch import incident_logs, run_workers

    from petr_stability import read_incidents

    nproc = PROFILE.nproc()
    results, log = run_workers(os.path.join(DIST, family, "worker.py"), "weights_all_ranks", str(tmp_path),
                               nproc=nproc, extra_args=PROFILE.worker_args)
    for r in results:
        assert r["error"] is None, r.get("traceback")
        assert r["world_size"] == nproc and r["device"].startswith(PROFILE.device)
        # The guard agreed over its gloo group beside the training backend, one rank included, and found its
        # node's leader for snapshot_copies='node'.
        assert r["side_group"] == {"backend": PROFILE.backend, "side_backend": "gloo", "max": nproc,
                                   "guard_built_it": True, "node_group": True}
        assert r["finite"] and r["iter"] == 18 and r["digest"] == results[0]["digest"]
        # NaN written into every rank's weights between two steps: rolled back alone (issue 43), no setting changed.
        assert r["guard"]["recoveries"] == 1 and r["max_norm"] == results[0]["max_norm"] != 1.0
    (path,) = incident_logs(str(tmp_path))
    (rec,) = read_incidents(path)
    assert rec["event"] == "divergence" and rec["restored_from"]["source"] == "memory"
    assert rec["cause"]["signals"].get("rollback_alone") is True and rec["actions"] == []
    return results


def test_mmengine_nccl_recovers(tmp_path):
    require("mmengine")
    (r0, *_) = _run("mmengine", tmp_path)
    assert r0["optim_wrapper"] == PROFILE.mmengine_amp


def test_mmcv1_nccl_recovers(tmp_path):
    require("mmcv1")
    (r0, *_) = _run("mmcv1", tmp_path)
    assert r0["optimizer_hook"] == PROFILE.mmcv1_fp16
