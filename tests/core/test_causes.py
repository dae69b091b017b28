"""Cause classification and the per-class actions, over plain torch objects (no runner)."""
import copy
import math
import os
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

from petr_stability.core import distributed
from petr_stability.core.causes import Cause, Classification
from petr_stability.core.diagnosis import CauseHistory, classify, diagnose, diagnose_step, merge
from petr_stability.core.remedies import (
    apply_fp32,
    exploded_params,
    force_fp32,
    fp32_modules,
    release_fp32,
    reset_moments,
    reset_temporal_state,
    scale_lr,
)
from petr_stability.core.watch.health import nonfinite_attributes


# ---------------------------------------------------------------------- scale_lr
def _cosine(eta_min):
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.05}], lr=0.1, momentum=0.9)
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20, eta_min=eta_min)


@pytest.mark.parametrize("eta_min", [0.0, 0.01])
def test_scale_lr_halves_a_cosine_schedule_from_then_on(eta_min):
    opt_a, sched_a = _cosine(eta_min)
    opt_b, sched_b = _cosine(eta_min)
    for _ in range(5):
        for opt, sched in ((opt_a, sched_a), (opt_b, sched_b)):
            opt.step()
            sched.step()
    changes = scale_lr([opt_a], 0.5, schedulers=[sched_a])
    targets = {c.target: (c.old, c.new) for c in changes}
    lr0 = opt_b.param_groups[0]["lr"]
    assert targets["optimizer0.group0.lr"] == (pytest.approx(lr0), pytest.approx(lr0 / 2))
    assert targets["optimizer0.group1.initial_lr"] == (pytest.approx(0.05), pytest.approx(0.025))
    assert "CosineAnnealingLR.base_lrs" in targets
    assert ("CosineAnnealingLR.eta_min" in targets) == (eta_min > 0)
    for _ in range(14):  # the rest of the schedule, down to eta_min, continues at half
        for opt, sched in ((opt_a, sched_a), (opt_b, sched_b)):
            opt.step()
            sched.step()
        for ga, gb in zip(opt_a.param_groups, opt_b.param_groups):
            assert ga["lr"] == pytest.approx(gb["lr"] / 2, rel=1e-9, abs=1e-12)
    assert sched_a.get_last_lr()[0] == pytest.approx(sched_b.get_last_lr()[0] / 2)


class FakeParamScheduler:
    """MMEngine's param scheduler layout (duck-typed): param_name, base_values, _last_value, eta_min."""

    def __init__(self, param_name, eta_min=0.001):
        self.param_name = param_name
        self.base_values = [0.1]
        self._last_value = [0.08]
        self.eta_min = eta_min
        self.eta_min_ratio = None


class FakeLrUpdaterHook:
    """MMCV 1.x's LrUpdaterHook layout: base_lr / regular_lr lists (or dicts of lists), min_lr, min_lr_ratio."""

    def __init__(self):
        self.base_lr = {"model": [0.1, 0.2]}
        self.regular_lr = [0.05]
        self.min_lr = 0.001
        self.min_lr_ratio = 0.5


def test_scale_lr_scales_mmengine_and_mmcv1_schedulers_but_not_momentum_ones():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    lr_sched, mom_sched, hook = FakeParamScheduler("lr"), FakeParamScheduler("momentum"), FakeLrUpdaterHook()
    scale_lr([opt], 0.5, schedulers=[lr_sched, mom_sched, hook])
    assert lr_sched.base_values == [0.05] and lr_sched._last_value == [0.04] and lr_sched.eta_min == 0.0005
    assert lr_sched.eta_min_ratio is None
    assert mom_sched.base_values == [0.1] and mom_sched.eta_min == 0.001  # a momentum schedule is left alone
    assert hook.base_lr == {"model": [0.05, 0.1]} and hook.regular_lr == [0.025] and hook.min_lr == 0.0005
    assert hook.min_lr_ratio == 0.5  # a ratio follows the scaled base by itself
    assert opt.param_groups[0]["lr"] == 0.05


def test_scale_lr_on_a_real_mmengine_cosine_scheduler():
    schedulers = pytest.importorskip("mmengine.optim.scheduler")
    runs = []
    for scale in (True, False):
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
        sched = schedulers.CosineAnnealingLR(opt, T_max=20, eta_min=0.01, by_epoch=False)
        lrs = []
        for i in range(18):
            if scale and i == 6:
                scale_lr([opt], 0.5, schedulers=[sched])
            opt.step()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
        runs.append(lrs)
    assert runs[0][:5] == runs[1][:5]
    assert runs[0][6:] == pytest.approx([lr / 2 for lr in runs[1][6:]])


@pytest.mark.parametrize("factor", [0, -1, math.inf, math.nan, "0.5"])
def test_scale_lr_rejects_a_bad_factor(factor):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="factor must be a finite number > 0, got"):
        scale_lr([opt], factor)


# ---------------------------------------------------------------------- reset_moments / exploded_params
class Three(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 1)

    def forward(self, x):
        return self.c(self.b(self.a(x))).sum()


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    lambda ps: torch.optim.Adam(ps, lr=1e-3),
    lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
])
def test_reset_moments_clears_only_the_named_tensors_and_the_optimizer_steps_on(make):
    model = Three()
    opt = make(model.parameters())
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(2, 4)).backward()
        opt.step()
    kept = {k: v.clone() for k, v in opt.state[model.a.weight].items() if isinstance(v, torch.Tensor)}
    changes = reset_moments(opt, [("b.weight", model.b.weight), ("b.bias", model.b.bias), ("c.weight", model.c.weight)])
    assert [c.target for c in changes] == ["b.weight", "b.bias", "c.weight"]
    assert all(c.new == "cleared" and ("exp_avg" in c.old or "momentum_buffer" in c.old) for c in changes)
    assert len(opt.state[model.b.weight]) == 0 and len(opt.state[model.c.weight]) == 0
    assert all(torch.equal(v, opt.state[model.a.weight][k]) for k, v in kept.items())
    assert reset_moments(opt, [("b.weight", model.b.weight)]) == []  # nothing left to clear
    opt.zero_grad()
    model(torch.randn(2, 4)).backward()
    opt.step()  # re-initialised as at the start of training
    assert len(opt.state[model.b.weight]) > 0


def test_exploded_params_names_the_outliers_and_the_nonfinite():
    model = Three()
    model(torch.randn(2, 4)).backward()
    assert exploded_params(model, threshold_ratio=1e6) == []
    with torch.no_grad():
        model.b.weight.grad.mul_(1e7)
        model.a.bias.grad[0] = math.inf
    assert exploded_params(model, threshold_ratio=100.0) == ["a.bias", "b.weight"]
    model.c.bias.grad = None  # no gradient: not considered
    assert "c.bias" not in exploded_params(model, threshold_ratio=100.0)
    with pytest.raises(ValueError, match="threshold_ratio must be a finite number > 1, got 0.5"):
        exploded_params(model, threshold_ratio=0.5)


# ---------------------------------------------------------------------- force_fp32
class Softmaxish(nn.Module):
    """Attention-like scores whose dot products pass 65504 in fp16 and stay finite in fp32; normalised after."""

    def forward(self, q, k):
        scores = q @ k.transpose(-1, -2)  # 32 dims * 50 * 50 = 80000 > 65504 in each score
        return scores / scores.sum(-1, keepdim=True)


class TwoStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.attn = Softmaxish()
        self.out = nn.Linear(64, 1)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(32))
            self.proj.bias.zero_()

    def forward(self, x):
        h = self.proj(x)
        return {"loss": self.out(self.attn(q=h, k=h)).float().mean()}


def _fp16(model, x):
    with torch.autocast("cpu", dtype=torch.float16):
        return model(x)["loss"]


def test_force_fp32_makes_an_overflowing_module_finite_and_is_reversible():
    model, x = TwoStage(), torch.full((1, 64, 32), 50.0)
    assert not torch.isfinite(_fp16(model, x))
    change = force_fp32(model.attn, "attn")
    assert (change.target, change.old, change.new) == ("attn", "autocast", "float32")
    assert torch.isfinite(_fp16(model, x))
    assert force_fp32(model.attn, "attn") is None  # idempotent
    assert fp32_modules(model) == ["attn"]
    # The module's own hooks still see it as the same module; copies and pickles keep the setting.
    assert fp32_modules(copy.deepcopy(model)) == ["attn"]
    assert fp32_modules(pickle.loads(pickle.dumps(model))) == ["attn"]
    assert torch.isfinite(_fp16(pickle.loads(pickle.dumps(model)), x))
    back = release_fp32(model.attn, "attn")
    assert (back.old, back.new) == ("float32", "autocast") and release_fp32(model.attn) is None
    assert fp32_modules(model) == [] and not torch.isfinite(_fp16(model, x))
    # Outside autocast it changes nothing: an fp32 run stays bit-identical.
    plain = model(x)["loss"]
    force_fp32(model.attn)
    assert torch.equal(model(x)["loss"], plain)


def test_apply_fp32_after_resume_and_mmcv_fp16_enabled_flags():
    model, x = TwoStage(), torch.full((1, 64, 32), 50.0)
    model.attn.fp16_enabled = True  # what MMCV 1.x's wrap_fp16_model sets for @auto_fp16
    changes = apply_fp32(model, ["attn"])
    assert [c.target for c in changes] == ["attn"] and model.attn.fp16_enabled is False
    assert torch.isfinite(_fp16(model, x)) and apply_fp32(model, ["attn"]) == []
    release_fp32(model.attn)
    assert model.attn.fp16_enabled is True
    with pytest.raises(ValueError, match="no module named 'nope' in the model"):
        apply_fp32(model, ["nope"])


def test_force_fp32_keeps_an_instance_forward_that_was_there():
    model = TwoStage()
    calls = []
    original = model.attn.forward
    model.attn.forward = lambda *a, **k: calls.append(1) or original(*a, **k)
    force_fp32(model.attn)
    _fp16(model, torch.ones(1, 64, 32))
    assert calls == [1]
    release_fp32(model.attn)
    _fp16(model, torch.ones(1, 64, 32))
    assert calls == [1, 1]


# ---------------------------------------------------------------------- temporal state
class StreamHead(nn.Module):
    """StreamPETR's head keeps its memory queue as plain attributes and clears it in reset_memory()."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.memory_embedding = None
        self.memory_timestamp = None

    def reset_memory(self):
        self.memory_embedding = None
        self.memory_timestamp = None

    def forward(self, x):
        if self.memory_embedding is None:
            self.memory_embedding = torch.zeros_like(x)
        out = self.fc(x + self.memory_embedding)
        self.memory_embedding = out.detach()
        return out


class InstanceBank(nn.Module):
    def __init__(self):
        super().__init__()
        self.cached_feature = torch.ones(3)
        self.resets = 0

    def reset(self):
        self.cached_feature = None
        self.resets += 1


class OtherWithReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.resets = 0

    def reset(self):  # some unrelated meaning: must not be called
        self.resets += 1


class Temporal(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = StreamHead()
        self.bank = InstanceBank()
        self.other = OtherWithReset()
        self.lin = nn.Linear(2, 2)


def test_reset_temporal_state_calls_only_known_methods_on_allowed_classes():
    model = Temporal()
    model.head(torch.randn(1, 2))
    weight = model.lin.weight.detach().clone()
    assert reset_temporal_state(model) == ["head", "bank"]
    assert model.head.memory_embedding is None and model.bank.cached_feature is None
    assert model.other.resets == 0 and torch.equal(model.lin.weight, weight)  # reset_parameters never runs
    assert reset_temporal_state(model, method_names=("reset",), generic_classes={"reset": ("OtherWithReset",)}) \
        == ["other"]
    with pytest.raises(ValueError, match="'reset_parameters' re-initialises weights"):
        reset_temporal_state(model, method_names=("reset_parameters",))
    with pytest.raises(TypeError, match="method_names must be a list of names, got the string 'reset_memory'"):
        reset_temporal_state(model, method_names="reset_memory")


def test_nonfinite_attributes_finds_poisoned_memory_not_params():
    model = Temporal()
    model.head(torch.randn(1, 2))
    assert nonfinite_attributes(model) == []
    model.head.memory_embedding = model.head.memory_embedding * math.nan  # NaN * 0 stays NaN
    model.bank.queue = [torch.ones(2), torch.tensor([1.0, math.inf])]
    with torch.no_grad():
        model.lin.weight[0, 0] = math.nan  # a parameter: the health check's business, not this one's
    assert nonfinite_attributes(model) == ["head.memory_embedding", "bank.queue[1]"]
    model.reset_memory = None  # harmless non-tensor attributes are skipped
    reset_temporal_state(model)
    assert nonfinite_attributes(model) == ["bank.queue[1]"]


# ---------------------------------------------------------------------- classification from real replays
class LogBox(nn.Module):
    """log(width) of a predicted box: a degenerate sample (width <= 0) gives NaN on any weights."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 1)
        with torch.no_grad():
            self.fc.weight.fill_(0.1)
            self.fc.bias.fill_(0.5)

    def forward(self, x):
        return {"loss": torch.log(self.fc(x)).mean()}


def _healthy(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_batch_that_breaks_healthy_weights_is_data():
    model = LogBox()
    healthy = _healthy(model)
    bad = torch.full((2, 4), -10.0)  # fc = -3.5: log of a negative width
    report = diagnose_step(model, lambda: model(bad), healthy_weights=healthy, healthy_from="snapshot of iter 40",
                           compare="reproduced")
    c = classify(report, CauseHistory(), iteration=100)
    assert c.cause == Cause.DATA and "breaks the healthy weights too (snapshot of iter 40" in c.evidence
    assert c.as_dict()["cause"] == "data" and "quarantine" in c.action
    # The same replay without the healthy comparison cannot tell.
    alone = diagnose_step(model, lambda: model(bad), healthy_weights=healthy)
    assert classify(alone, CauseHistory(), iteration=100).cause == Cause.UNKNOWN


def test_a_nan_batch_is_data_even_without_healthy_weights():
    model = LogBox()
    x = torch.ones(2, 4)
    x[0, 0] = math.nan
    c = classify(diagnose(model, lambda: model(x)), CauseHistory(), iteration=100)
    assert c.cause == Cause.DATA and "arrives holding NaN/Inf" in c.evidence


def test_weights_gone_bad_on_a_batch_the_healthy_weights_train_on_is_dynamics():
    model = LogBox()
    healthy = _healthy(model)
    with torch.no_grad():
        model.fc.weight[0, 1] = math.inf
    report = diagnose_step(model, lambda: model(torch.ones(2, 4)), healthy_weights=healthy,
                           healthy_from="snapshot of iter 40")
    c = classify(report, CauseHistory(), iteration=100)
    assert c.cause == Cause.DYNAMICS and "trains fine on the healthy weights" in c.evidence
    assert c.signals["healthy_compared"] and c.signals["first"]["where"] == "parameter"


def test_fp16_overflow_in_one_module_is_forward_overflow_and_fp32_fixes_it():
    model, x = TwoStage(), torch.full((1, 64, 32), 50.0)
    healthy = _healthy(model)

    def forward():
        with torch.autocast("cpu", dtype=torch.float16):
            return model(x)

    c = classify(diagnose_step(model, forward, healthy_weights=healthy, compare="reproduced"), CauseHistory(), 100)
    assert c.cause == Cause.FORWARD_OVERFLOW and c.modules == ("attn",)
    assert "fp16 forward of attn" in c.evidence and "on the live weights" in c.evidence
    apply_fp32(model, c.modules)
    assert diagnose(model, forward)["first"] is None
    # Live weights already NaN (the overflow went into an update): the healthy re-run shows the overflow.
    release_fp32(model.attn)
    with torch.no_grad():
        model.proj.weight[0, 0] = math.nan  # read before the attention: the live re-run stops there
    report = diagnose_step(model, forward, healthy_weights=healthy)
    c = classify(report, CauseHistory(), 100)
    assert c.cause == Cause.FORWARD_OVERFLOW and c.modules == ("attn",) and "on the healthy weights" in c.evidence


def test_an_overflow_the_weights_grew_into_says_so_and_one_the_healthy_weights_show_too_does_not():
    # proj is the identity on the live weights (logits 50*50*32 = 80000, past fp16) and half of it on the healthy
    # ones (20000): the same batch is finite there, so the weights grew into the overflow (the training dynamics).
    model, x = TwoStage(), torch.full((1, 64, 32), 50.0)
    before = _healthy(model)
    before["proj.weight"] = before["proj.weight"] * 0.5

    def forward():
        with torch.autocast("cpu", dtype=torch.float16):
            return model(x)

    grew = classify(diagnose_step(model, forward, healthy_weights=before, healthy_from="snapshot of iter 40",
                                  compare="reproduced"), CauseHistory(), 100)
    assert grew.cause == Cause.FORWARD_OVERFLOW and grew.modules == ("attn",) and grew.signals["weights_grew"] is True
    assert "on the healthy weights (snapshot of iter 40) the same batch stays finite in fp16" in grew.evidence
    every = classify(diagnose_step(model, forward, healthy_weights=_healthy(model), compare="reproduced"),
                     CauseHistory(), 100)
    assert every.cause == Cause.FORWARD_OVERFLOW and every.signals["weights_grew"] is False
    assert "grew" not in every.evidence
    alone = classify(diagnose_step(model, forward), CauseHistory(), 100)  # no healthy weights: no such evidence
    assert alone.cause == Cause.FORWARD_OVERFLOW and "weights_grew" not in alone.signals
    # Across ranks it holds only where every rank classing the overflow shows it.
    assert merge([grew, None, grew]).signals["weights_grew"] is True
    assert merge([grew, every]).signals["weights_grew"] is False
    assert merge([every, grew]).signals["weights_grew"] is False


def test_an_overflow_the_weights_grew_into_after_a_loss_explosion_says_so_on_every_rank_or_not_at_all():
    # Issue 43 (the zoo's CNN at 8x its rate): the loss exploded for steps before the weights grew into the overflow.
    # The class stays forward_overflow (the module goes to fp32); unstable_before makes its restore and rate dynamics'.
    from types import SimpleNamespace

    from petr_stability.core.recovery.chain import _grew_unstable

    def incident(unstable_since):  # the first unstable step since the newest healthy state
        return SimpleNamespace(signals=SimpleNamespace(unstable_since=unstable_since))

    grew = Classification(Cause.FORWARD_OVERFLOW, "the weights grew into the overflow", ("conv",),
                          {"weights_grew": True})
    calm = _grew_unstable(grew, incident(None))
    assert "unstable_before" not in calm.signals and calm.evidence == grew.evidence
    hot = _grew_unstable(grew, incident(17))
    assert hot.cause == Cause.FORWARD_OVERFLOW and hot.modules == ("conv",) and hot.signals["unstable_before"] is True
    assert "left its stability band at iter 17" in hot.evidence
    every = grew.but(signals={"weights_grew": False})  # the healthy weights overflow too: not the rate's doing
    assert "unstable_before" not in _grew_unstable(every, incident(17)).signals
    dynamics = Classification(Cause.DYNAMICS, "trains fine on the healthy weights")
    assert _grew_unstable(dynamics, incident(17)) is dynamics
    assert merge([hot, None, hot]).signals["unstable_before"] is True
    # The band's verdict is agreed across ranks; like weights_grew it holds only where every rank shows it.
    assert merge([hot, grew]).signals["unstable_before"] is False


def test_an_overflow_confined_to_one_sample_is_its_data_and_many_batches_are_the_module():
    # A bright but finite frame (x1e4): one row of the batch overflows attn's fp16 forward on every state; re-run from
    # the healthy state it breaks alone beside samples shown clean, and the batch known to be good stays finite there.
    model = TwoStage()
    batch = torch.full((4, 64, 32), 0.5)
    batch[2] = 50.0

    def forward_of(x):
        def forward():
            with torch.autocast("cpu", dtype=torch.float16):
                return model(x)
        return forward

    good = torch.full((4, 64, 32), 0.5)
    report = diagnose_step(model, forward_of(batch), healthy_weights=_healthy(model), compare="reproduced",
                           good_forward=forward_of(good), good_from="the batch of iter 7")
    assert classify(report, CauseHistory(), 100).cause == Cause.FORWARD_OVERFLOW  # the premise: no isolation yet
    report["isolation"] = {"rows": [2], "blamed": [10], "ambiguous": False}  # what Evidence.isolation() found
    data = classify(report, CauseHistory(), 100)
    assert data.cause == Cause.DATA and data.modules == ("attn",) and data.signals["isolated"] == [2]
    assert "confined to 1 sample(s)" in data.evidence and "the batch of iter 7, known to be good, stays finite" in \
        data.evidence and "their data, not attn" in data.evidence
    # The known-good batch overflows too: every batch does, the module.
    every = diagnose_step(model, forward_of(batch), healthy_weights=_healthy(model), compare="reproduced",
                          good_forward=forward_of(torch.full((4, 64, 32), 50.0)))
    every["isolation"] = {"rows": [2], "blamed": [10], "ambiguous": False}
    assert classify(every, CauseHistory(), 100).cause == Cause.FORWARD_OVERFLOW
    # No row breaks alone (ambiguous: every row does): the module.
    report["isolation"] = {"rows": [], "blamed": [], "ambiguous": True}
    assert classify(report, CauseHistory(), 100).cause == Cause.FORWARD_OVERFLOW
    # A batch with no sample in common overflows attn after an earlier sample's overflow there was quarantined.
    history = CauseHistory()
    history.record(data, 50, 40)
    report["isolation"] = {"rows": [0], "blamed": [3], "ambiguous": False}
    again = classify(report, history, 100)
    assert again.cause == Cause.FORWARD_OVERFLOW and again.modules == ("attn",)


def test_structural_from_first_iterations_spent_remedies_and_back_to_back_data():
    model = LogBox()
    healthy = _healthy(model)
    report = diagnose_step(model, lambda: model(torch.full((2, 4), -10.0)), healthy_weights=healthy,
                           compare="reproduced")
    history = CauseHistory(first_iterations=5, recurrence_window=20)
    c = classify(report, history, iteration=3)
    assert c.cause == Cause.STRUCTURAL and "within the first 5 iterations" in c.evidence
    first = classify(report, history, iteration=300)
    assert first.cause == Cause.DATA
    history.record(first, iteration=300, restored_to=200)
    # A planted bug: the very next batches break the healthy weights too.
    c = classify(report, history, iteration=205)
    assert c.cause == Cause.STRUCTURAL and "every batch breaks" in c.evidence and c.signals["clean_iterations"] == 5
    # One bad sample per epoch: the next data incident comes long after the rollback.
    assert classify(report, history, iteration=900).cause == Cause.DATA
    history.mark_spent(Cause.DATA, "skip list full: 3 of 3 samples")
    c = classify(report, history, iteration=900)
    assert c.cause == Cause.STRUCTURAL and "remedies for data are spent (skip list full" in c.evidence


def test_unknown_without_a_report_or_with_a_failed_one():
    assert classify(None).cause == Cause.UNKNOWN
    c = classify({"error": "RuntimeError: boom"}, CauseHistory(), 100)
    assert c.cause == Cause.UNKNOWN and "RuntimeError: boom" in c.evidence
    assert classify({"first": None, "reproduced": False}).cause == Cause.UNKNOWN


def test_history_round_trip_and_validation():
    history = CauseHistory(first_iterations=3, recurrence_window=7)
    history.record(Classification(Cause.FORWARD_OVERFLOW, "x", ["attn"]), 40, restored_to=30)
    history.mark_spent(Cause.DYNAMICS, "the ladder's last rung failed")
    again = CauseHistory(first_iterations=3, recurrence_window=7)
    again.load_state_dict(pickle.loads(pickle.dumps(history.state_dict())))
    assert again.state_dict() == history.state_dict()
    assert again.count(Cause.FORWARD_OVERFLOW) == 1 and again.is_spent(Cause.DYNAMICS)
    assert again.clean_since_last(45) == 15 and again.last()["modules"] == ["attn"]
    fresh = CauseHistory()
    fresh.load_state_dict({})  # an old checkpoint without this state
    assert fresh.incidents == [] and fresh.clean_since_last(10) is None
    with pytest.raises(ValueError, match="first_iterations must be an integer >= 0, got -1"):
        CauseHistory(first_iterations=-1)


def test_merge_prefers_the_specific_evidence_and_unites_modules():
    dyn = Classification(Cause.DYNAMICS, "fine on healthy")
    data = Classification(Cause.DATA, "breaks healthy")
    o1 = Classification(Cause.FORWARD_OVERFLOW, "o1", ["a"])
    o2 = Classification(Cause.FORWARD_OVERFLOW, "o2", ["b", "a"])
    assert merge([dyn, None, data]).cause == Cause.DATA
    m = merge([dyn, o1, data, o2])
    assert m.cause == Cause.FORWARD_OVERFLOW and m.modules == ("a", "b") and m.evidence == "o1"
    assert m.ranks == {"0": "dynamics", "1": "forward_overflow", "2": "data", "3": "forward_overflow"}
    assert merge([o1, Classification(Cause.STRUCTURAL, "bug")]).cause == Cause.STRUCTURAL
    assert merge([None, None]).cause == Cause.UNKNOWN
    assert Classification.from_dict(m.as_dict()) == m


def _agree(c):
    # What the incident chain's agreement does with the classes: one gather, one merge, on every rank.
    return merge([None if d is None else Classification.from_dict(d)
                  for d in distributed.gather(None if c is None else c.as_dict())])


def test_agree_over_a_process_group(tmp_path):
    c = Classification(Cause.DATA, "breaks healthy")
    assert _agree(c) == merge([c])
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(str(tmp_path), 'store')}", rank=0,
                            world_size=1)
    try:
        agreed = _agree(c)
        assert agreed.cause == Cause.DATA and agreed.ranks == {"0": "data"}
        assert _agree(None).cause == Cause.UNKNOWN
    finally:
        dist.destroy_process_group()


def test_how_it_works_writes_out_the_one_cause_table():
    # docs/how-it-works.md's table is CAUSE_TABLE with the default lr_backoff: the policy, the log line and the
    # incident record read the code's, and this keeps the doc the same.
    from petr_stability.core.causes import CAUSE_TABLE
    from petr_stability.core.config import GuardConfig
    from petr_stability.core.recovery.policy import CausePolicy

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "how-it-works.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    table = text.split("| signal in the replay | class | action |", 1)[1].split("\n\n", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in table.strip().splitlines()[1:]]
    policy = CausePolicy(GuardConfig())
    assert rows == [[r.signal, r.label, policy.action_text(r.cause)] for r in CAUSE_TABLE]
    assert "lr x 0.25" in CausePolicy(GuardConfig(lr_backoff=0.25)).action_text(Cause.DYNAMICS).replace(
        "learning rate", "lr")
