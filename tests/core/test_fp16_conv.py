"""The CPU fp16 convolution stand-in (petr_stability.testing.fp16_conv): torch's fp16 numbers, a fast backward.

Its backward and torch's fp16 kernel are two roundings to fp16 of the same sums, accumulated in another order (and,
with another ``ATEN_CPU_CAPABILITY``, by other instructions): they agree to one fp16 rounding step at the values
compared, not bit for bit.
"""
import pytest
import torch
import torch.nn.functional as F

from petr_stability.testing.fp16_conv import fp16_conv_backward_in_fp32
from petr_stability.testing.numerics import rounding_step, steps_apart

# Rounding differs with the CPU kernels: this runs again under ATEN_CPU_CAPABILITY=default.
pytestmark = pytest.mark.numerics


def _grads(x, conv, autocast):
    x = x.clone().requires_grad_(True)
    conv.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        y = conv(x)
    y.float().sum().backward()
    return y, x.grad, conv.weight.grad, conv.bias.grad


def test_gradients_match_torchs_fp16_kernel_and_fp32_is_untouched():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)
    x = torch.randn(2, 3, 9, 11)
    reference = _grads(x, conv, autocast=True)
    original = F.conv2d
    with fp16_conv_backward_in_fp32():
        assert F.conv2d is not original
        stood_in = _grads(x, conv, autocast=True)
        fp32 = _grads(x, conv, autocast=False)
    assert F.conv2d is original
    # The forward is torch's own fp16 convolution, called the same way: the same kernel, the same numbers.
    assert stood_in[0].dtype == torch.float16 and torch.equal(stood_in[0], reference[0])
    exact = _grads_in_float64(x, conv)
    for name, ours, torchs, truth in zip(("input", "weight", "bias"), stood_in[1:], reference[1:], exact):
        assert ours.dtype == torchs.dtype, name
        # Each went through fp16 (the gradient of an fp16 operand) before autocast's cast back: .half() is exact.
        assert torch.equal(ours.half().to(ours.dtype), ours) and torch.equal(torchs.half().to(torchs.dtype), torchs)
        ours, torchs = ours.half(), torchs.half()
        apart = steps_apart(ours, torchs)
        # Two roundings of (nearly) the same sum: at most one fp16 step apart, each within one step of the exact one.
        assert float(apart.max()) <= 1.0, (name, float(apart.max()))
        assert float(((ours.double() - truth).abs() / rounding_step(ours)).max()) <= 1.0, name
    assert fp32[0].dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(fp32, _grads(x, conv, autocast=False)))  # the same kernel again


def _grads_in_float64(x, conv):
    """The exact gradients of the fp16 forward's operands (fp16 values, float64 arithmetic): what both round."""
    x64 = x.half().double().requires_grad_(True)
    w64 = conv.weight.detach().half().double().requires_grad_(True)
    b64 = conv.bias.detach().half().double().requires_grad_(True)
    y = F.conv2d(x64, w64, b64, conv.stride, conv.padding)
    y.sum().backward()
    return x64.grad, w64.grad, b64.grad


def test_a_gradient_one_fp16_step_off_is_told_from_a_wrong_one():
    """The tolerance is the arithmetic's, not a loose one: an error of two fp16 steps at the values is caught."""
    g = torch.tensor([24.8, -3.1, 0.002], dtype=torch.float16)
    one_step = g + rounding_step(g).half()
    assert float(steps_apart(one_step, g).max()) == 1.0
    assert float(steps_apart(g + 2 * rounding_step(g).half(), g).max()) >= 2.0


def test_an_fp16_overflow_still_becomes_inf():
    conv = torch.nn.Conv2d(1, 1, 1, bias=False)
    with torch.no_grad():
        conv.weight.fill_(2.0)
    x = torch.full((1, 1, 2, 2), 40000.0)
    with fp16_conv_backward_in_fp32(), torch.autocast("cpu", dtype=torch.float16):
        y = conv(x)
    assert y.dtype == torch.float16 and torch.isinf(y).all()
