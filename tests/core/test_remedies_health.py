"""Remedies and health checks as pure functions over torch objects."""
import math

import pytest
import torch
from torch import nn

from petr_stability.core.remedies import tighten_clip, zero_transformer_dropout
from petr_stability.core.tree import iter_tensors
from petr_stability.core.watch.health import all_finite, first_nonfinite, model_tensors, optimizer_tensors
from petr_stability.core.watch.probe import ClipProbe, observing_clip


class FFN(nn.Module):  # named like MMCV's FFN: in scope by class name alone
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.1)


class DropPath(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.drop_prob = p


class FlashInner(nn.Module):
    def __init__(self):
        super().__init__()
        self.dropout_p = 0.1


class FlashMHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner_attn = FlashInner()
        self.drop_path = DropPath(0.2)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.img_backbone = nn.Sequential(nn.Linear(4, 4), DropPath(0.3))
        self.img_backbone.add_module("ffn", FFN())  # a transformer block inside the backbone
        self.head_drop = nn.Dropout(0.5)  # outside any transformer: left alone by default
        self.decoder = nn.TransformerDecoderLayer(4, 2, 8, dropout=0.1)
        self.flash = FlashMHA()
        self.ffn = FFN()


def test_zero_dropout_covers_every_spelling_and_reports_old_values():
    m = Model()
    changes = {c.target: (c.old, c.new) for c in zero_transformer_dropout(m)}
    assert changes["decoder.self_attn.dropout"] == (0.1, 0.0)  # float on nn.MultiheadAttention
    assert changes["decoder.dropout1.p"] == (0.1, 0.0)
    assert changes["flash.inner_attn.dropout_p"] == (0.1, 0.0)
    assert changes["flash.drop_path.drop_prob"] == (pytest.approx(0.2), 0.0)
    assert changes["ffn.drop.p"] == (0.1, 0.0)
    assert m.decoder.self_attn.dropout == 0.0 and m.ffn.drop.p == 0.0
    # Backbone (also its transformer block) and non-transformer dropout untouched.
    assert m.img_backbone[1].drop_prob == 0.3 and m.img_backbone.ffn.drop.p == 0.1
    assert m.head_drop.p == 0.5
    assert not any(t.startswith("img_backbone") or t == "head_drop.p" for t in changes)


def test_zero_dropout_survives_train_and_is_idempotent():
    m = Model()
    zero_transformer_dropout(m)
    m.train()
    assert m.decoder.dropout1.p == 0.0
    assert zero_transformer_dropout(m) == []


def test_zero_dropout_scope_all_and_empty_exclude_reach_backbone():
    m = Model()
    targets = {c.target for c in zero_transformer_dropout(m, scope="all", exclude=())}
    assert {"img_backbone.1.drop_prob", "head_drop.p", "img_backbone.ffn.drop.p"} <= targets


def test_zero_dropout_handles_ddp_style_prefix():
    wrapper = nn.Module()
    wrapper.module = Model()
    targets = {c.target for c in zero_transformer_dropout(wrapper)}
    assert "module.ffn.drop.p" in targets
    assert not any(t.startswith("module.img_backbone") for t in targets)


def test_zero_dropout_bad_scope():
    with pytest.raises(ValueError, match="'everything'"):
        zero_transformer_dropout(Model(), scope="everything")


def test_tighten_clip_never_loosens():
    kw = {"max_norm": 35.0, "norm_type": 2}
    change = tighten_clip(kw, 1.0, "clip")
    assert (change.old, change.new, kw["max_norm"]) == (35.0, 1.0, 1.0)
    kw = {"max_norm": 0.5}
    assert tighten_clip(kw, 1.0) is None and kw["max_norm"] == 0.5
    kw = observing_clip()
    assert tighten_clip(kw, 1.0).old == math.inf


def test_tighten_clip_leaves_value_clipping_alone():
    kw = {"clip_value": 5.0}
    assert tighten_clip(kw, 1.0) is None and kw == {"clip_value": 5.0}


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan])
def test_tighten_clip_bad_target(bad):
    with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
        tighten_clip({"max_norm": 35.0}, bad)


def test_all_finite_over_mixed_dtypes_and_empty():
    ts = [torch.ones(3), torch.ones(2, dtype=torch.float16), torch.empty(0)]
    assert all_finite(ts)
    for bad in (math.nan, math.inf, -math.inf):
        t = torch.ones(5, dtype=torch.float16)
        t[3] = bad
        assert not all_finite(ts + [t])
    assert all_finite([])


def test_all_finite_large_finite_values_are_finite():
    # A sum-based check would overflow here; the max-abs reduction must not.
    assert all_finite([torch.full((1000,), 3e38)])


def test_health_sees_buffers_and_optimizer_state():
    m = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    assert all_finite(model_tensors(m) + optimizer_tensors(opt))
    m[1].running_var[0] = math.nan
    assert all_finite([p.detach() for p in m.parameters()])
    assert not all_finite(model_tensors(m))
    m[1].running_var[0] = 1.0
    next(iter(opt.state.values()))["exp_avg"][0] = math.inf
    assert not all_finite(optimizer_tensors(opt))
    assert first_nonfinite([("a", torch.ones(1)), ("b", torch.tensor([math.nan]))]) == "b"


def test_iter_tensors_walks_nested_state():
    state = {"a": [torch.ones(1), (torch.zeros(2), 3)], "b": {"c": torch.arange(3)}}
    assert len(list(iter_tensors(state))) == 2  # integer tensors are not health-checked


def test_clip_probe_sees_steps_and_skips_nonfinite_fp32_step():
    lin = nn.Linear(2, 2)
    probe = ClipProbe(torch.nn.utils.clip_grad_norm_, skip_nonfinite=True)
    assert probe.read() == (False, None, False)
    lin(torch.ones(1, 2)).sum().backward()
    probe(list(lin.parameters()), max_norm=math.inf)
    stepped, norm, skipped = probe.read()
    assert stepped and math.isfinite(norm) and not skipped
    lin.weight.grad[0, 0] = math.nan
    probe(list(lin.parameters()), max_norm=math.inf)
    stepped, norm, skipped = probe.read()
    assert stepped and math.isnan(norm) and skipped
    assert all(p.grad is None for p in lin.parameters())
    before = lin.weight.detach().clone()
    torch.optim.AdamW(lin.parameters(), lr=1.0).step()  # nothing to apply
    assert torch.equal(before, lin.weight)


def test_clip_probe_without_skip_keeps_grads():
    lin = nn.Linear(2, 2)
    lin(torch.ones(1, 2)).sum().backward()
    lin.weight.grad[0, 0] = math.inf
    probe = ClipProbe(torch.nn.utils.clip_grad_norm_)
    probe(lin.parameters(), max_norm=1.0)
    assert probe.read()[2] is False and lin.weight.grad is not None


def test_count_host_reads_sees_each_value_read_and_leaves_tensor_as_it_was():
    from petr_stability.testing.reads import count_host_reads

    t = torch.tensor([1.0, float("nan")])
    before = {n: n in vars(torch.Tensor) for n in ("__float__", "__bool__", "item", "tolist", "cpu", "__int__")}
    with count_host_reads() as reads:
        torch.isfinite(t).all()  # stays a tensor: no read
        t.sum() * 2
    assert reads == []
    with count_host_reads() as reads:
        bool(torch.isfinite(t).all())
        float(t[0])
        t[0].item()
    assert [r.split(" at ")[0] for r in reads] == ["__bool__", "__float__", "item"]
    assert all(__file__ in r for r in reads)
    assert {n: n in vars(torch.Tensor) for n in before} == before and float(t[0]) == 1.0
