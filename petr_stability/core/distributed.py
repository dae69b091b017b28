"""Cross-rank agreement on host-side values, so every rank takes the same decision and none waits alone."""
from typing import Any, List, Optional

import torch
import torch.distributed as dist

__all__ = ["is_distributed", "get_rank", "get_world_size", "reduce_max", "broadcast_object"]

_GROUP: Any = None


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _host_group() -> Any:
    # A gloo group reduces CPU tensors: agreeing on a few host ints adds no host-device sync, whatever the
    # training backend (NCCL would need the values on the GPU and a sync to read them back).
    global _GROUP
    if _GROUP is None:
        _GROUP = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return _GROUP


def reduce_max(values: List[int]) -> List[int]:
    """Element-wise maximum of ``values`` over all ranks (identity when not distributed).

    Every rank must call it at the same point, the same number of times: the guard calls it once per
    optimizer step, from the same hook, on every rank.
    """
    if not is_distributed():
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_host_group())
    return [int(v) for v in t.tolist()]


def broadcast_object(obj: Optional[Any], src: int = 0) -> Any:
    """Sends ``obj`` from ``src`` to every rank over the host group and returns it on all of them."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_host_group())
    return box[0]
