"""The distributed case on GPUs: an NCCL process group, one GPU per rank, each runner family's own DDP and fp16.

Uses every GPU up to two (one on the lent machine: a 1-process NCCL group; two or more: the ranks must also
agree). Each test skips itself, with the reason, without a GPU or without its runner family installed.
"""
import os

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HERE = os.path.dirname(os.path.abspath(__file__))
DIST = os.path.join(HERE, "..", "distributed")


def _nccl_run(family, tmp_path):
    import sys

    sys.path.insert(0, os.path.join(DIST, "common"))
    from launch import incident_logs, run_workers

    from petr_stability import read_incidents

    nproc = min(2, torch.cuda.device_count())
    results, log = run_workers(os.path.join(DIST, family, "worker.py"), "weights_all_ranks", str(tmp_path),
                               nproc=nproc, extra_args=["--cuda"])
    for r in results:
        assert r["error"] is None, r.get("traceback")
        assert r["world_size"] == nproc and r["device"].startswith("cuda")
        assert r["side_group"] == {"backend": "nccl", "side_backend": "gloo", "max": nproc}
        assert r["finite"] and r["iter"] == 18 and r["digest"] == results[0]["digest"]
        assert r["guard"]["recoveries"] == 1 and r["max_norm"] == 1.0
    (path,) = incident_logs(str(tmp_path))
    (rec,) = read_incidents(path)
    assert rec["event"] == "divergence" and rec["restored_from"]["source"] == "memory"
    return results


def test_mmengine_nccl_recovers(tmp_path):
    pytest.importorskip("mmengine", reason="the MMEngine case needs MMEngine")
    (r0, *_) = _nccl_run("mmengine", tmp_path)
    assert r0["optim_wrapper"] == "AmpOptimWrapper"


def test_mmcv1_nccl_recovers(tmp_path):
    pytest.importorskip("mmcv.runner", reason="the MMCV 1.x case needs MMCV 1.x")
    (r0, *_) = _nccl_run("mmcv1", tmp_path)
    assert r0["optimizer_hook"] == "Fp16OptimizerHook"
