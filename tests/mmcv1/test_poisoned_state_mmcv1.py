"""A sample that poisons BatchNorm's running statistics with finite weights, on a real MMCV 1.x EpochBasedRunner (CPU,
fp32): traced to its batch and sample (the window since the healthy snapshot replayed from it), classed data,
quarantined alone, no hyperparameter changed, over 5 epochs that serve it every epoch until then."""
import torch
from harness import guard_hook, opt_hook, params_finite, run
from test_attribution_mmcv1 import build, decisions

from petr_stability import read_incidents
from petr_stability.testing.poison import HugeSample

N = 32  # 16 iterations an epoch at batch size 2, no shuffle
BAD = 25  # served in the 13th iteration of every epoch; the routine check (every 4) finds the buffer at the 16th
EPOCHS = 5


def test_a_sample_poisoning_batchnorm_statistics_is_traced_quarantined_and_nothing_else_changes(tmp_path):
    wd = str(tmp_path)
    r = build(wd, HugeSample(N, BAD), amp=None, epochs=EPOCHS)
    configured = [m.p for m in r.model.modules() if isinstance(m, torch.nn.Dropout)]
    run(r)
    assert r.epoch == EPOCHS and params_finite(r)
    assert all(bool(b.isfinite().all()) for b in r.model.buffers())
    guard = guard_hook(r).guard
    assert list(guard.remedy("quarantine").skip_list) == [BAD]
    (rec,) = decisions(wd)
    assert rec["event"] == "divergence" and rec["cause"]["cause"] == "data"
    assert "running_var" in rec["cause"]["evidence"] and "iter 13" in rec["cause"]["evidence"]
    assert rec["cause"]["signals"]["quarantined"] == [{"index": BAD, "sample_idx": f"sample-{BAD:04d}-tok"}]
    window = rec["diagnosis"]["window"]
    assert window["found"] and window["iteration"] == 13 and window["indices"] == [24, BAD]
    assert window["rows"] == [1] and not window["ambiguous"]
    assert [a["target"] for a in rec["actions"]] == ["quarantine.samples"]
    summary = guard.summary()
    assert summary["max_norm"] is None and not summary["dropout_zeroed"] and summary["lr_factor"] == 1.0
    assert opt_hook(r).grad_clip["max_norm"] == 35
    assert r.optimizer.param_groups[0]["lr"] == 2e-4
    assert [m.p for m in r.model.modules() if isinstance(m, torch.nn.Dropout)] == configured
    data = r.loader.dataset
    assert data.fetches[BAD] == 1 and all(data.fetches[i] >= EPOCHS for i in range(N) if i != BAD)
    assert not [x for x in read_incidents(wd) if x["event"] == "gave_up"]
