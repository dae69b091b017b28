"""The CPU fp16 convolution stand-in (petr_stability.testing.fp16_conv): torch's fp16 numbers, a fast backward."""
import torch
import torch.nn.functional as F

from petr_stability.testing.fp16_conv import fp16_conv_backward_in_fp32


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
    assert stood_in[0].dtype == torch.float16 and torch.equal(stood_in[0], reference[0])
    for ours, torchs in zip(stood_in[1:], reference[1:]):
        assert ours.dtype == torchs.dtype and torch.equal(ours, torchs)
    assert fp32[0].dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(fp32, _grads(x, conv, autocast=False)))


def test_an_fp16_overflow_still_becomes_inf():
    conv = torch.nn.Conv2d(1, 1, 1, bias=False)
    with torch.no_grad():
        conv.weight.fill_(2.0)
    x = torch.full((1, 1, 2, 2), 40000.0)
    with fp16_conv_backward_in_fp32(), torch.autocast("cpu", dtype=torch.float16):
        y = conv(x)
    assert y.dtype == torch.float16 and torch.isinf(y).all()
