"""Tolerances that come from the arithmetic, for tests that compare computed floats.

Two kernels that compute the same value may round it differently (another accumulation order, another CPU
instruction set: ``ATEN_CPU_CAPABILITY``), so a test compares computed floats in units of the format's rounding
step at the values compared, never with ``torch.equal``. Copies and restored state are compared exactly.
"""
import torch

__all__ = ["rounding_step", "steps_apart"]


def rounding_step(values: torch.Tensor) -> torch.Tensor:
    """The spacing of ``values``' floating format at each value's magnitude (its unit in the last place): for fp16,
    ``2**(e - 10)`` for a value in ``[2**e, 2**(e+1))``, and the subnormal step ``2**-24`` below the normal range."""
    info = torch.finfo(values.dtype)
    mag = values.detach().abs().double()
    exponent = torch.floor(torch.log2(mag.clamp_min(info.tiny)))
    return torch.pow(2.0, exponent) * info.eps


def steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise ``|a - b|`` in rounding steps of their format at the larger of the two magnitudes (float64)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"compare like with like: {a.dtype} {tuple(a.shape)} against {b.dtype} {tuple(b.shape)}")
    larger = torch.maximum(a.detach().abs(), b.detach().abs())
    return (a.detach().double() - b.detach().double()).abs() / rounding_step(larger)
