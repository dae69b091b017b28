"""A CPU stand-in for a GPU's fp16 convolution backward, for tests that train real detectors under CPU fp16 autocast.

torch's CPU kernel for the fp16 convolution backward is a slow fallback (measured: 88 s for the backward of a
ResNet-50 on 12 images of 64 x 176, against 0.6 s in fp32). Inside :func:`fp16_conv_backward_in_fp32`, an
``F.conv2d`` under CPU fp16 autocast (or on fp16 operands) is torch's own fp16 convolution forward whose backward is
computed in fp32 from the same fp16 tensors and rounded to fp16, as a GPU's fp16 convolution backward accumulates
in fp32 and writes fp16 (an overflow still becomes Inf). On a small convolution its gradients are within one fp16
rounding step of torch's fp16 kernel, whatever ``ATEN_CPU_CAPABILITY`` (``tests/core/test_fp16_conv.py``; bit for bit
on some CPUs only: two kernels accumulate in another order). Everything else, fp32 convolutions included, is torch's.
"""
import contextlib
from typing import Any, Callable, Iterator, List, Tuple

import torch
import torch.nn.functional as F

__all__ = ["fp16_conv_backward_in_fp32"]

#: torch's own F.conv2d while the stand-in is installed (a stack: the context nests).
_CONV2D: List[Callable[..., torch.Tensor]] = []


class _HalfConv2d(torch.autograd.Function):
    """An fp16 convolution: torch's fp16 forward, the backward computed in fp32 and rounded to fp16."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: Any, stride: Any, padding: Any, dilation: Any,
                groups: int) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.conf = (stride, padding, dilation, groups, b is not None)
        with torch.autocast("cpu", enabled=False):
            return _CONV2D[0](x, w, b, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Any, ...]:
        from torch.nn.modules.utils import _pair

        x, w = ctx.saved_tensors
        stride, padding, dilation, groups, has_bias = ctx.conf
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], has_bias and ctx.needs_input_grad[2]]
        gx, gw, gb = torch.ops.aten.convolution_backward(
            grad.float(), x.float(), w.float(), [w.shape[0]] if has_bias else None, _pair(stride), _pair(padding),
            _pair(dilation), False, [0, 0], groups, mask)
        half = [g.half() if g is not None else None for g in (gx, gw, gb)]
        return (half[0], half[1], half[2], None, None, None, None)


def _fp16_autocast() -> bool:
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16


def _conv2d(input: torch.Tensor, weight: torch.Tensor, bias: Any = None, stride: Any = 1, padding: Any = 0,
            dilation: Any = 1, groups: int = 1) -> torch.Tensor:
    if (_fp16_autocast() or input.dtype == torch.float16) and not isinstance(padding, str) \
            and input.device.type == "cpu":
        # What CPU autocast does for conv2d (every operand to fp16), then the fp16 convolution.
        return _HalfConv2d.apply(input.half(), weight.half(), None if bias is None else bias.half(), stride,
                                 padding, dilation, groups)
    return _CONV2D[0](input, weight, bias, stride, padding, dilation, groups)


@contextlib.contextmanager
def fp16_conv_backward_in_fp32() -> Iterator[None]:
    """``F.conv2d`` (which ``nn.Conv2d`` and MMCV's ``ConvModule`` call at call time) as the stand-in above for the
    duration of the block; torch's own again on the way out."""
    _CONV2D.append(F.conv2d)
    F.conv2d = _conv2d
    try:
        yield
    finally:
        F.conv2d = _CONV2D.pop()
