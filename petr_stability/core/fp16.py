"""fp16's range, and which tensors fp16 code can see: the one place every check of "past 65504" asks."""
import torch

__all__ = ["FP16_MAX", "FP16_REACHABLE", "reaches_fp16"]

#: Largest finite float16 value: an activation or a scaled gradient beyond it overflows to Inf in fp16.
FP16_MAX = 65504.0

#: The dtypes fp16 code computes in or casts down from. A float64 tensor never enters an fp16 op: autocast leaves
#: float64 alone and MMCV's ``@auto_fp16`` casts float32 only, so a value past 65504 there (StreamPETR's
#: timestamps, seconds since 1970, ~1.5e9) is no overflow to come.
FP16_REACHABLE = (torch.float16, torch.float32)


def reaches_fp16(t: torch.Tensor) -> bool:
    """Whether fp16 code can see ``t``'s values (its dtype is in :data:`FP16_REACHABLE`)."""
    return t.dtype in FP16_REACHABLE
