"""The diagnosis over plain torch modules: which module it names, RNG fidelity, checkpointing, cleanup, the guard."""
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as cp
from fake_io import FakeIO, make_guard, run
from torch import nn

from petr_stability.core import guard as guard_module
from petr_stability.core.diagnose import FP16_MAX, capture_rng, diagnose, diagnose_step, restore_rng, summarize
from petr_stability.core.guard import GuardConfig
from petr_stability.core.incidents import read_incidents


def no_hooks(model):
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks, m
    for p in model.parameters():
        assert not p._backward_hooks, p.shape


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        h = self.inp(x)
        h = self.norm(h + self.attn(h, h, h)[0])
        return {"loss_a": self.out(h).mean(), "acc": torch.tensor(1.0)}


@pytest.mark.parametrize("param, module, detail", [
    ("attn.in_proj_weight", "attn", "in_proj_weight"),
    # nn.MultiheadAttention reads out_proj.weight itself: out_proj's own forward never runs.
    ("attn.out_proj.weight", "attn.out_proj", "weight"),
])
def test_names_the_attention_projection_holding_nan(param, module, detail):
    model = Attn()
    with torch.no_grad():
        model.get_parameter(param).view(-1)[3] = math.nan
    x = torch.randn(5, 2, 8)
    report = diagnose(model, lambda: model(x))
    first = report["first"]
    assert (first["module"], first["where"], first["detail"]) == (module, "parameter", detail)
    assert report["reproduced"] and report["forward_finite"] is False
    assert report["backward"].startswith("skipped") and report["nonfinite_parameters"] == [param]
    assert module in summarize(report)
    no_hooks(model)


class Overflow(nn.Module):
    """Eight huge units before a dropout of 0.9: when one survives, x10 pushes it past fp16 range."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.9)
        self.fc2 = nn.Linear(32, 1)
        with torch.no_grad():
            self.fc1.weight.fill_(0.01)
            self.fc1.weight[:8] = 400.0  # 16 * 400 = 6400 in fp16; x10 by the dropout = 64000 .. inf
            self.fc1.bias.zero_()

    def forward(self, x):
        return {"loss": self.fc2(self.drop(self.fc1(x))).float().mean()}


def overflows(model, x, seed):
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.float16):
        return not torch.isfinite(model(x)["loss"]).item()


def test_dropout_pushing_past_fp16_is_named_under_the_failing_steps_rng():
    model, x = Overflow(), torch.full((1, 16), 1.1)  # 1.1 * 6400 * 10 = 70400 > 65504
    bad = next(s for s in range(100) if overflows(model, x, s))
    good = next(s for s in range(100) if not overflows(model, x, s))

    def forward():
        with torch.autocast("cpu", dtype=torch.float16):
            return model(x)

    torch.manual_seed(bad)
    state = capture_rng()
    torch.manual_seed(good)  # the training loop has moved on since
    after = torch.get_rng_state()
    report = diagnose(model, forward, rng_state=state)
    first = report["first"]
    assert (first["module"], first["where"], first["dtype"]) == ("drop", "output", "float16")
    assert report["over_fp16"][0] == "drop"
    assert report["largest_outputs"][0]["over_fp16"] and report["largest_outputs"][0]["module"] in ("drop", "fc2")
    fc1 = next(e for e in report["largest_outputs"] if e["module"] == "fc1")
    assert 0 < fc1["max_abs"] <= FP16_MAX and not fc1["over_fp16"]
    assert torch.equal(torch.get_rng_state(), after)  # the training RNG stream is left as it was
    torch.manual_seed(good)
    assert diagnose(model, forward, rng_state=capture_rng())["first"] is None  # other masks: not reproduced


class Sqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x.abs())  # finite at 0, but its gradient there is not


class Block(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.fc1 = nn.Linear(4, 4, bias=False)
        self.act = Sqrt()
        self.fc2 = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.1)
        self.reentrant = reentrant

    def _forward(self, x):
        return self.drop(self.fc2(self.act(self.fc1(x))))

    def forward(self, x):
        if self.reentrant is None:
            return self._forward(x)
        return cp.checkpoint(self._forward, x, use_reentrant=self.reentrant)


class WithCp(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.fc0 = nn.Linear(4, 4)
        self.block = Block(reentrant)
        self.head = nn.Linear(4, 1)
        self.bn = nn.BatchNorm1d(1)
        with torch.no_grad():
            self.block.fc1.weight[0].zero_()  # a zero into the sqrt

    def forward(self, x):
        return {"loss": self.bn(self.head(self.block(self.fc0(x)))).sum()}


@pytest.mark.parametrize("reentrant", [None, True, False])
def test_backward_fault_inside_a_checkpointed_layer(reentrant):
    model = WithCp(reentrant).train()
    model.block.drop.eval()  # a mode set by hand must survive too
    x = torch.randn(3, 4)
    marker = torch.zeros(1)
    model.head.bias.grad = marker
    running = model.bn.running_mean.clone()
    report = diagnose(model, lambda: model(x), loss_scale=512.0)
    first = report["first"]
    assert report["forward_finite"] and report["backward"] == "run"
    assert (first["module"], first["where"], first["phase"]) == ("block.act", "grad_input", "backward")
    assert report["calls"] == 9  # the checkpoint's recomputation is not counted twice
    assert report["largest_grads"] and report["loss_scale"] == 512.0
    # Everything as it was: hooks, gradients, modes, BatchNorm statistics.
    no_hooks(model)
    assert model.head.bias.grad is marker and model.fc0.weight.grad is None
    assert model.bn.training and not model.block.drop.training and model.training
    assert torch.equal(model.bn.running_mean, running)


def test_forward_that_raises_leaves_no_hooks_and_restores_rng():
    model = Attn()
    state = capture_rng()
    torch.manual_seed(5)
    after = torch.get_rng_state()

    def forward():
        model.inp(torch.randn(2, 8))
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        diagnose(model, forward, rng_state=state)
    no_hooks(model)
    assert torch.equal(torch.get_rng_state(), after)
    restore_rng(state)


def test_live_nan_weights_then_healthy_weights():
    model = Attn()
    healthy = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.inp.weight[0, 0] = math.nan
    x = torch.randn(5, 2, 8)
    report = diagnose_step(model, lambda: model(x), healthy_weights=healthy, healthy_from="snapshot of iter 5")
    assert report["first"]["module"] == "inp" and report["first"]["where"] == "parameter"
    again = report["on_healthy_weights"]
    assert again["reproduced"] is False and again["backward"] == "run" and again["weights"] == "snapshot of iter 5"
    assert math.isnan(model.inp.weight[0, 0].item())  # the live weights are put back
    assert "stays finite" in summarize(report)


def test_nan_batch_is_named_as_the_input():
    model = Attn()
    x = torch.randn(5, 2, 8)
    x[0, 0, 0] = math.inf
    first = diagnose(model, lambda: model(x))["first"]
    assert (first["module"], first["where"]) == ("(model)", "input")
    assert "the batch" in first["why"]


def test_rank_local_rerun_hides_the_process_group(tmp_path):
    seen = []

    class Reducing(nn.Module):
        def forward(self, x):
            seen.append(dist.is_initialized())  # what mmdet's reduce_mean asks before an all_reduce
            return x.sum()

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(str(tmp_path), 'store')}", rank=0,
                            world_size=1)
    try:
        model = Reducing()
        x = torch.ones(2, requires_grad=True)
        diagnose(model, lambda: model(x))
        assert seen == [False] and dist.is_initialized()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- through the guard
class DiagIO(FakeIO):
    """FakeIO whose last batch can be re-run; ``raises`` makes the re-run fail."""

    raises = False

    def train_step(self, poison_grad=False, poison_loss=False):
        self.rng = capture_rng()
        torch.manual_seed(self.iter)
        self.batch = torch.randn(4, 2, 8)
        torch.set_rng_state(self.rng["cpu"])
        loss = self.net(self.batch)
        self.opt.zero_grad()
        loss.backward()
        if poison_grad:
            self.net.out.weight.grad[0, 0] = math.inf
        self.probe(self.net.parameters(), **self.clip)
        self.opt.step()
        self.last_loss = float(loss)

    def rerun_forward(self):
        def forward():
            if self.raises:
                raise RuntimeError("the re-run failed")
            return self.net(self.batch)
        return forward

    def rerun_rng_state(self):
        return self.rng


def test_guard_records_the_diagnosis_and_healthy_steps_install_nothing(tmp_path, monkeypatch):
    calls = []
    real = guard_module.diagnose_step
    monkeypatch.setattr(guard_module, "diagnose_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    io = DiagIO(str(tmp_path))
    guard = make_guard(io)
    run(io, guard, 12)
    assert calls == []  # healthy steps: no diagnosis, so no hooks
    no_hooks(io.net)
    run(io, guard, 16, faults={12: "weights"})
    assert len(calls) == 1
    no_hooks(io.net)
    (rec,) = read_incidents(str(tmp_path))
    diag = rec["diagnosis"]
    assert diag["first"]["module"] == "out" and diag["first"]["detail"] == "weight" and diag["rank"] == 0
    assert diag["on_healthy_weights"]["reproduced"] is False
    assert any("diagnosis of iter 13" in m and "out (Linear" in m for _, m in io.logs)


def test_a_failing_diagnosis_does_not_stop_the_recovery(tmp_path):
    io = DiagIO(str(tmp_path), mode="none", skip=False)
    io.raises = True
    guard = make_guard(io, skip_nonfinite_fp32=False)
    run(io, guard, 16, faults={12: "weights"})
    assert io.restores and guard.recoveries == 1
    (rec,) = read_incidents(str(tmp_path))
    assert rec["diagnosis"]["error"] == "RuntimeError: the re-run failed"
    no_hooks(io.net)


def test_diagnose_can_be_switched_off(tmp_path):
    io = DiagIO(str(tmp_path), mode="none", skip=False)
    guard = make_guard(io, skip_nonfinite_fp32=False, diagnose=False)
    run(io, guard, 16, faults={12: "weights"})
    assert read_incidents(str(tmp_path))[0]["diagnosis"] is None


def test_config_rejects_a_non_bool():
    with pytest.raises(TypeError, match="diagnose must be a bool, got 'yes'"):
        GuardConfig(diagnose="yes")
