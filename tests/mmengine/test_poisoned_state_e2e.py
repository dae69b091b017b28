"""A sample that poisons BatchNorm's running statistics with finite weights, in a real MMEngine Runner (CPU, fp32).

The sample's features are huge but finite (1e20 in fp32): its batch's variance overflows, ``running_var`` turns Inf,
while the forward (batch statistics, an inverse std of 0) and every weight stay finite. The routine health check
finds the buffer iterations later, on another batch. The guard must trace the buffer to the batch and the sample
that did it (the window since the healthy snapshot replayed from it), class it data, quarantine that sample alone and
change no hyperparameter; the sample is served every epoch until then.
"""
import torch
from harness import guard_hook, params_finite
from test_attribution import build, decisions

from petr_stability import read_incidents
from petr_stability.testing.poison import HugeSample

N = 32  # 16 iterations an epoch at batch size 2, no shuffle
BAD = 25  # served in the 13th iteration of every epoch; the routine check (every 4) finds the buffer at the 16th
EPOCHS = 5


def test_a_sample_poisoning_batchnorm_statistics_is_traced_quarantined_and_nothing_else_changes(tmp_path):
    wd = str(tmp_path)
    runner = build(wd, HugeSample(N, BAD), amp=None, max_epochs=EPOCHS)
    configured = [m.p for m in runner.model.modules() if isinstance(m, torch.nn.Dropout)]
    runner.train()
    assert runner.epoch == EPOCHS and params_finite(runner)
    model = runner.model
    assert all(bool(b.isfinite().all()) for b in model.buffers())
    guard = guard_hook(runner).guard
    assert list(guard.remedy("quarantine").skip_list) == [BAD]  # the culprit alone: no good sample quarantined
    (rec,) = decisions(wd)
    assert rec["event"] == "divergence" and rec["cause"]["cause"] == "data"
    evidence = rec["cause"]["evidence"]
    assert "running_var" in evidence and "iter 13" in evidence
    assert rec["cause"]["signals"]["quarantined"] == [{"index": BAD, "sample_idx": f"sample-{BAD:04d}-tok"}]
    window = rec["diagnosis"]["window"]
    assert window["found"] and window["iteration"] == 13 and window["rows"] == [1] and not window["ambiguous"]
    assert window["indices"] == [24, BAD]
    # No hyperparameter changed: the quarantine is the only change recorded; max_norm, dropout and lr as configured.
    assert [a["target"] for a in rec["actions"]] == ["quarantine.samples"]
    summary = guard.summary()
    assert summary["max_norm"] is None and not summary["dropout_zeroed"] and summary["lr_factor"] == 1.0
    assert runner.optim_wrapper.clip_grad_kwargs["max_norm"] == 35
    assert configured and [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)] == configured
    assert runner.optim_wrapper.get_lr()["lr"] == [2e-4]
    # The loader served it in epoch 1 only, and every other sample every epoch.
    data = runner.train_dataloader.dataset
    assert data.fetches[BAD] == 1 and all(data.fetches[i] >= EPOCHS for i in range(N) if i != BAD)
    assert data.traced[BAD] == 2  # its batch in the window, then its row
    assert not [r for r in read_incidents(wd) if r["event"] == "gave_up"]
