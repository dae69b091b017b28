"""Non-finite by design (petr_stability/core/watch/health.py): a float -inf attention mask passed as an input (to
PyTorch's layers or mmcv's MultiheadAttention), and a -inf mask buffer unchanged since the run's start, are neither a
divergence nor a diagnosis's "first NaN/Inf"; NaN is, and so is a mask buffer that changed."""
import math

import torch
from torch import nn

from petr_stability.core.diagnosis.recorder import split_masks
from petr_stability.core.diagnosis.replay import diagnose
from petr_stability.core.recovery.restore import checkpoint_finite
from petr_stability.core.samples import is_mask_name, suspect_rows
from petr_stability.core.watch.health import ByDesign, by_design, nonfinite_attributes, state_finite

L = 8


class CausalEncoder(nn.Module):
    """Two pre-norm ``nn.TransformerEncoderLayer``s under a causal mask registered as a buffer (a common idiom)."""

    def __init__(self, d: int = 16, as_attribute: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = nn.Linear(d, 3)
        mask = torch.triu(torch.full((L, L), float("-inf")), 1)
        if as_attribute:
            self.mask = mask  # kept as a plain attribute, outside the state dict
        else:
            self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.out(self.encoder(self.inp(x), mask=self.mask)) - x).pow(2).mean()


def test_mask_names():
    for name in ("attn_mask", "src_mask", "mask", "memory_key_padding_mask", "key_padding_mask", "tgt_mask",
                 "attn_bias", "masks"):
        assert is_mask_name(name), name
    for name in ("x", "query", "bias", "masked_input_scale", "img", None, 3):
        assert not is_mask_name(name), name


def test_split_masks_names_positional_arguments_by_the_forward_signature():
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    x, m = torch.zeros(1, 4, 8), torch.zeros(4, 4)
    (args, kwargs), masks = split_masks(layer, (x, m), {"src_key_padding_mask": None, "is_causal": False})
    assert args[0] is x and args[1] is None and [n for n, _ in masks] == ["src_mask"]
    assert kwargs == {"src_key_padding_mask": None, "is_causal": False}


def test_a_causal_mask_buffer_is_healthy_while_unchanged_and_broken_once_it_changes_or_holds_nan():
    model = CausalEncoder()
    opt = torch.optim.AdamW(model.parameters())
    assert not state_finite(model, [opt], ByDesign())  # the premise: read as a plain tensor, -inf is non-finite
    design = ByDesign.capture(model)
    assert design.names() == ["mask"] and by_design(model) is design
    assert state_finite(model, [opt]) and state_finite(model, [opt], design)
    assert checkpoint_finite({"state_dict": model.state_dict(), "optimizer": opt.state_dict()}, design)
    assert not checkpoint_finite({"state_dict": model.state_dict()}, ByDesign())
    # The prefixed names of a wrapped model's state dict are the same tensors.
    assert checkpoint_finite({"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}}, design)
    with torch.no_grad():
        model.mask[0, 0] = float("-inf")  # changed: an Inf the model did not mean
    assert not state_finite(model, [opt])
    with torch.no_grad():
        model.mask[0, 0] = 0.0
        model.mask[1, 0] = math.nan
    assert not state_finite(model, [opt])
    assert not checkpoint_finite({"state_dict": model.state_dict()}, design)


def test_a_mask_kept_as_a_plain_attribute_is_by_design_too():
    model = CausalEncoder(as_attribute=True)
    assert nonfinite_attributes(model, ByDesign()) == ["mask"]
    ByDesign.capture(model)
    assert nonfinite_attributes(model) == []
    model.mask = model.mask.clone()
    model.mask[0, 0] = float("inf")
    assert nonfinite_attributes(model) == ["mask"]


def test_the_replay_does_not_read_a_float_mask_as_the_first_nan_inf():
    model = CausalEncoder()
    x = torch.randn(4, L, 3)
    report = diagnose(model, lambda: model(x))
    assert report["first"] is None and report["reproduced"] is False, report["first"]
    # A NaN in the batch is still found, at the model's input.
    x[1, 2, 0] = math.nan
    report = diagnose(model, lambda: model(x))
    assert report["first"]["module"] == "(model)" and report["first"]["where"] == "input"


def test_a_nan_mask_is_no_design():
    model = CausalEncoder()
    with torch.no_grad():
        model.mask[3, 1] = math.nan
    report = diagnose(model, lambda: model(torch.randn(2, L, 3)))
    assert report["reproduced"] and report["first"]["where"] == "input" and "mask" in report["first"]["detail"]


def test_a_mask_the_batch_carries_is_not_its_values():
    batch = {"x": torch.randn(4, L, 3), "attn_mask": torch.triu(torch.full((4, L, L), float("-inf")), 1)}
    assert suspect_rows(batch, 4, fp16=True) == []
    batch["x"][2, 0, 0] = math.inf
    assert suspect_rows(batch, 4, fp16=True) == [2]


class MMCVDecoder(nn.Module):
    """mmcv's ``MultiheadAttention`` (both majors) under a float causal mask made in the forward and passed down."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        from mmcv.cnn.bricks.transformer import MultiheadAttention

        torch.manual_seed(0)
        self.inp = nn.Linear(3, d)
        self.attn = MultiheadAttention(d, 2, batch_first=True)
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.full((L, L), float("-inf")), 1)
        return (self.out(self.attn(self.inp(x), attn_mask=mask)) - x).pow(2).mean()


def test_mmcv_multihead_attention_s_float_mask_is_not_the_first_nan_inf():
    model = MMCVDecoder()
    x = torch.randn(4, L, 3)
    assert torch.isfinite(model(x))  # the premise: the mask is -inf where it masks, the output finite
    report = diagnose(model, lambda: model(x))
    assert report["first"] is None and report["reproduced"] is False, report["first"]
    x[2, 1, 1] = math.inf  # an Inf the batch carries is still found, at the model's input
    report = diagnose(model, lambda: model(x))
    assert report["first"]["module"] == "(model)" and report["first"]["where"] == "input"
