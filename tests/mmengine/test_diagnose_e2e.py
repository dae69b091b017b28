"""The diagnosis through a real MMEngine runner on the PETR-shaped model (with_cp layers, CPU fp16 autocast)."""
import torch
from harness import build_runner, guard_hook, params_finite
from mmengine.hooks import Hook

from petr_stability import read_incidents

SMALL = dict(num_layers=1, num_query=16)
GUARD = dict(snapshot_interval=5, confirm_steps=3, check_interval=5)
ATTN = "net.pts_bbox_head.layers.0.attentions.0.attn"


class HookCounter(Hook):
    """Counts module hooks after every iteration (registered after NanGuardHook: LOW runs later)."""

    priority = "LOW"

    def __init__(self):
        self.counts = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        model = runner.model
        n = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())
        n += sum(len(p._backward_hooks or {}) for p in model.parameters())
        self.counts.append(n)


def test_poisoned_attention_projection_is_named_and_hooks_never_stay(tmp_path):
    wd = str(tmp_path)
    # A moderate initial scale: no calibration overflows, so a snapshot is confirmed before the fault.
    runner = build_runner(wd, amp=dict(init_scale=256.0), max_iters=7, guard=GUARD, model_kwargs=SMALL,
                          faults=[dict(kind="weights", iters=[5], value="nan", param=f"{ATTN}.in_proj_weight")])
    counter = HookCounter()
    runner.register_hook(counter)
    assert runner.model.net.pts_bbox_head.layers[0].use_checkpoint
    runner.train()
    assert runner.iter == 7 and params_finite(runner)
    (rec,) = read_incidents(wd)
    diag = rec["diagnosis"]
    assert diag["first"]["module"] == ATTN and diag["first"]["where"] == "parameter"
    assert diag["first"]["detail"] == "in_proj_weight" and diag["first"]["type"] == "MultiheadAttention"
    assert diag["nonfinite_parameters"] == [f"{ATTN}.in_proj_weight"]
    # The same batch on the last healthy weights trains fine: the weights went bad, not the data.
    assert diag["on_healthy_weights"]["reproduced"] is False
    assert counter.counts == [0] * len(counter.counts) and len(counter.counts) >= 7
    assert guard_hook(runner).guard.batches.batch is None  # the batch in hand is not held between iterations


def test_batch_pushing_the_backbone_past_fp16_range_is_named(tmp_path):
    wd = str(tmp_path)
    # Loss scale 1: the first overflow drops it below min_loss_scale, a confirmed divergence at once.
    runner = build_runner(wd, amp=dict(init_scale=1.0), max_iters=7, guard=dict(GUARD, quarantine_fraction=0.05),
                          model_kwargs=SMALL, faults=[dict(kind="batch", iters=[5], value=1e6)])
    runner.train()
    assert runner.iter == 7 and params_finite(runner)
    (rec,) = read_incidents(wd)
    diag = rec["diagnosis"]
    first = diag["first"]
    assert (first["module"], first["where"], first["dtype"]) == ("net.img_backbone.proj", "output", "float16")
    # The 1e6 batch is finite in fp32, past fp16 range: autocast casts it to fp16 for the projection.
    assert diag["over_fp16"][0] == "data_preprocessor" and not diag["forward_finite"]
    assert diag["nonfinite_parameters"] == []
    # The same batch breaks the healthy weights too: bad data, not training dynamics. The test data carries no
    # sample ids: its two samples are named by dataset index (every row is past fp16 range: both), quarantined, and
    # no hyperparameter is changed.
    assert diag["on_healthy_weights"]["reproduced"] is True
    assert rec["cause"]["cause"] == "data" and rec["cause"]["signals"]["quarantined"] == [{"index": 8}, {"index": 9}]
    assert [a["target"] for a in rec["actions"]] == ["quarantine.samples"]
    assert runner.optim_wrapper.clip_grad_kwargs["max_norm"] == 35
    model = runner.model
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(not p._backward_hooks for p in model.parameters())
    assert not torch.is_autocast_enabled()
