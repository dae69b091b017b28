"""The diagnosis over plain torch modules: which module it names, RNG fidelity, checkpointing, cleanup, the guard."""
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as cp
from fake_io import FakeIO, make_guard, run
from torch import nn

from petr_stability.core.config import GuardConfig
from petr_stability.core.diagnosis import FP16_MAX, diagnose, diagnose_step, summarize
from petr_stability.core.diagnosis.sandbox import capture_rng, restore_rng
from petr_stability.core.records import read_incidents
from petr_stability.core.recovery import chain as evidence_module


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

    def rerun_forward(self, batch=None):  # the guard under restructuring passes the batch it kept
        def forward():
            if self.raises:
                raise RuntimeError("the re-run failed")
            return self.net(self.batch)
        return forward

    def rerun_rng_state(self):
        return self.rng


def test_guard_records_the_diagnosis_and_healthy_steps_install_nothing(tmp_path, monkeypatch):
    calls = []
    real = evidence_module.diagnose_step
    monkeypatch.setattr(evidence_module, "diagnose_step", lambda *a, **k: calls.append(1) or real(*a, **k))
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


# ---------------------------------------------------------------------- the fp32 check
class Scores(nn.Module):
    """Dot products past 65504 in fp16 (32 dims * 50 * 50 = 80000), normalised after: fine in fp32."""

    def forward(self, q, k):
        scores = q @ k.transpose(-1, -2)
        return scores / scores.sum(-1, keepdim=True)


class AttnOverflow(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.attn = Scores()
        self.out = nn.Linear(64, 1)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(32))
            self.proj.bias.zero_()

    def forward(self, x):
        h = self.proj(x)
        return {"loss": self.out(self.attn(q=h, k=h)).float().mean()}  # keyword inputs are recorded too


def fp16(model, x):
    def forward():
        with torch.autocast("cpu", dtype=torch.float16):
            return model(x)
    return forward


def test_fp32_check_names_the_module_that_fp32_fixes():
    model = AttnOverflow()
    report = diagnose(model, fp16(model, torch.full((1, 64, 32), 50.0)))
    assert (report["first"]["module"], report["first"]["where"], report["first"]["dtype"]) == \
        ("attn", "output", "float16")
    check = report["fp32_check"]
    assert check["reproduced"] and check["fixed_by"] == "attn" and check["module"] == "attn"
    (tried,) = check["tried"]
    assert tried["inputs_within_fp16"] and tried["inputs_max_abs"] == 50.0
    assert tried["finite"] and 0 < tried["max_abs"] <= FP16_MAX and check["max_abs"] == tried["max_abs"]
    assert "fp16 forward overflow" in summarize(report)
    no_hooks(model)
    assert "forward" not in model.attn.__dict__  # force_fp32 was undone
    assert diagnose(model, fp16(model, torch.full((1, 64, 32), 1.0)))["first"] is None


class Amplify(nn.Module):
    """x1000, then normalised by the parent: the leaf's fp32 output is still past fp16 range."""

    def __init__(self):
        super().__init__()
        self.big = nn.Linear(8, 8, bias=False)
        with torch.no_grad():
            self.big.weight.copy_(1000 * torch.eye(8))

    def forward(self, x):
        h = self.big(x)
        return h / h.abs().amax(-1, keepdim=True)


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Amplify()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.block(x)).float().sum()


def test_fp32_check_walks_out_to_the_enclosing_module_that_contains_the_overflow():
    model = Nested()
    report = diagnose(model, fp16(model, torch.full((2, 8), 100.0)))  # 100 * 1000 = 1e5 > 65504
    check = report["fp32_check"]
    assert report["first"]["module"] == "block.big" and check["module"] == "block.big"
    big, block = check["tried"]
    assert big["module"] == "block.big" and big["finite"] and not big["within_fp16"] and big["max_abs"] == 1e5
    assert block["module"] == "block" and block["within_fp16"] and check["fixed_by"] == "block"


def test_fp32_check_refuses_inputs_already_past_fp16_and_outputs_it_cannot_contain():
    model = Nested()
    with torch.no_grad():
        model.block.big.weight.copy_(torch.eye(8))
    report = diagnose(model, fp16(model, torch.full((2, 8), 1e6)))  # the batch itself is past fp16 range
    check = report["fp32_check"]
    assert report["first"]["module"] == "block.big"
    assert [t["inputs_within_fp16"] for t in check["tried"]] == [False, False] and check["fixed_by"] is None
    assert "does not come back within fp16 range" in summarize(report)
    # The dropout case: x10 by the dropout itself is the value past 65504; no module below the model contains it.
    model, x = Overflow(), torch.full((1, 16), 1.1)
    bad = next(s for s in range(100) if overflows(model, x, s))
    torch.manual_seed(bad)
    state = capture_rng()
    check = diagnose(model, fp16(model, x), rng_state=state)["fp32_check"]
    assert [t["module"] for t in check["tried"]] == ["drop"] and check["fixed_by"] is None
    assert check["tried"][0]["finite"] and not check["tried"][0]["within_fp16"]  # same dropout mask as the step


class TimedHead(nn.Module):
    """StreamPETR's head shape: float64 timestamps (seconds since 1970, ~1.5e9, as its formatting bundle keeps them)
    ride along with the features, and the head's own functional code (dot products past 65504) overflows in fp16
    before its encoder sees the result."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.encoder = nn.Linear(64, 1)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(32))
            self.proj.bias.zero_()

    def forward(self, x, timestamp):
        h = self.proj(x)
        scores = h @ h.transpose(-1, -2)  # functional code of the head: 32 * 50 * 50 = 80000 in fp16
        age = (timestamp.max() - timestamp).float()  # float64 arithmetic, small again
        return self.encoder(scores / scores.sum(-1, keepdim=True)) + age.view(-1, 1, 1)


class TimedDetector(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = TimedHead()

    def forward(self, x, timestamp):
        return {"loss": self.head(x, timestamp=timestamp).float().mean()}


def test_fp32_check_reads_float64_inputs_as_out_of_fp16_reach():
    # A timestamp past 65504 in float64 never enters an fp16 op: the head holding the overflowing code is the fix.
    model = TimedDetector()
    x, stamp = torch.full((2, 64, 32), 50.0), torch.tensor([1533151603.5, 1533151604.0], dtype=torch.float64)

    def forward():
        with torch.autocast("cpu", dtype=torch.float16):
            return model(x, stamp)

    report = diagnose(model, forward)
    check = report["fp32_check"]
    assert (report["first"]["module"], report["first"]["where"]) == ("head.encoder", "input")
    (head,) = check["tried"]
    assert head["module"] == "head" and head["inputs_within_fp16"] and head["inputs_max_abs"] == 50.0
    assert check["fixed_by"] == "head"
    # Float32 inputs past fp16 range still refuse the fix (a raw pixel batch is the data's fault, not the module's).
    report = diagnose(model, lambda: _autocast(model, torch.full((2, 64, 32), 7e4), stamp))
    assert report["fp32_check"]["fixed_by"] is None


def _autocast(model, *args):
    with torch.autocast("cpu", dtype=torch.float16):
        return model(*args)


def test_suspect_rows_leave_float64_values_out_of_the_fp16_range_check():
    from petr_stability.core.samples import suspect_rows
    stamps = torch.tensor([1533151603.5, 1533151604.0, 1533151604.5], dtype=torch.float64)
    img = torch.zeros(3, 4)
    img[1, 0] = 65535.0  # a raw 16-bit pixel in row 1
    assert suspect_rows({"img": img, "timestamp": stamps}, 3, fp16=True) == [1]
    assert suspect_rows({"img": img, "timestamp": stamps}, 3, fp16=False) == []
    stamps[2] = float("nan")  # non-finite is bad in any dtype
    assert suspect_rows({"img": img, "timestamp": stamps}, 3, fp16=False) == [2]


def test_fp32_check_only_for_half_outputs_and_can_be_switched_off():
    model = Nested()
    assert "fp32_check" not in diagnose(model, fp16(model, torch.full((2, 8), 100.0)), fp32_check=False)
    with torch.no_grad():
        model.head.bias.fill_(math.inf)  # a float32 output going non-finite: nothing for fp32 to fix
    report = diagnose(model, lambda: model(torch.ones(2, 8)))
    assert report["first"]["where"] == "parameter" and "fp32_check" not in report


def test_diagnose_step_compares_on_reproduced_faults_when_asked():
    model = AttnOverflow()
    healthy = {k: v.clone() for k, v in model.state_dict().items()}
    forward = fp16(model, torch.full((1, 64, 32), 50.0))
    assert "on_healthy_weights" not in diagnose_step(model, forward, healthy_weights=healthy)
    report = diagnose_step(model, forward, healthy_weights=healthy, healthy_from="snapshot", compare="reproduced")
    again = report["on_healthy_weights"]
    assert again["reproduced"] and again["fp32_check"]["fixed_by"] == "attn" and again["forward_finite"] is False
    fine = diagnose_step(model, fp16(model, torch.ones(1, 64, 32)), healthy_weights=healthy, compare="reproduced")
    assert "on_healthy_weights" not in fine
    assert "on_healthy_weights" in diagnose_step(model, fp16(model, torch.ones(1, 64, 32)), healthy_weights=healthy,
                                                 compare="always")
    with pytest.raises(ValueError, match="compare must be one of .* got 'sometimes'"):
        diagnose_step(model, forward, compare="sometimes")


# ---------------------------------------------------------------------- the replay leaves no trace
class Memory(nn.Module):
    """A StreamPETR-style module: every training forward pushes its input into a memory kept as plain attributes
    (a tensor created on the first frame, a list of tensors, a scene token string, a frame counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.memory_embedding = None
        self.queue = []
        self.prev_scene_token = None
        self.frames = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        if self.training:
            frame = out.detach().mean(0, keepdim=True)
            self.memory_embedding = frame if self.memory_embedding is None else 0.9 * self.memory_embedding + frame
            self.memory_embedding.mul_(1.0)  # an in-place update too
            self.queue = self.queue[-1:] + [frame]
            self.prev_scene_token = f"scene-{self.frames}"
            self.frames += 1
        return (out + self.memory_embedding).pow(2).mean()


def test_a_replay_leaves_the_plain_attribute_memory_exactly_as_it_found_it():
    torch.manual_seed(0)
    model = Memory().train()
    model(torch.randn(3, 4))  # one healthy frame: the memory exists
    healthy = {k: v.detach().clone() for k, v in model.state_dict().items()}
    before = model.memory_embedding
    saved = (before.clone(), [t.clone() for t in model.queue], model.prev_scene_token, model.frames)
    bad = torch.randn(3, 4)
    bad[1] = math.nan
    good = torch.randn(3, 4)
    report = diagnose_step(model, lambda: model(bad), healthy_weights=healthy, healthy_from="start",
                           compare="reproduced", good_forward=lambda: model(good), good_from="the good batch")
    assert report["reproduced"] and report["on_healthy_weights"]["reproduced"]
    assert report["good_batch"]["reproduced"] is False  # three forwards ran: the failing batch twice, the good one
    assert model.memory_embedding is before and torch.equal(before, saved[0])  # the same tensor, the same values
    assert len(model.queue) == 1 and torch.equal(model.queue[0], saved[1][0])
    assert (model.prev_scene_token, model.frames) == saved[2:]


def test_attributes_a_replay_creates_are_removed():
    torch.manual_seed(0)
    model = Memory().train()
    assert model.memory_embedding is None
    diagnose(model, lambda: model(torch.randn(2, 4)))
    assert model.memory_embedding is None and model.queue == [] and model.frames == 0  # the first frame, undone
