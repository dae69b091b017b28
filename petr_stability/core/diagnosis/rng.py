"""The replay's determinism and isolation: RNG states captured on healthy steps, and a rank-local scope."""
import contextlib
from typing import Any, Dict, Iterator, Mapping

import torch
import torch.distributed as dist

__all__ = ["capture_rng", "restore_rng", "rank_local"]


def capture_rng() -> Dict[str, Any]:
    """The CPU and current CUDA device RNG states.

    Host-side copies only (the CUDA state is a seed and an offset kept on the host): no device sync, cheap
    enough for every step.
    """
    state: Dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        state["cuda"] = torch.cuda.get_rng_state(device)
        state["cuda_device"] = device
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Sets the RNG states captured by :func:`capture_rng`."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], state["cuda_device"])


@contextlib.contextmanager
def rank_local() -> Iterator[None]:
    """Makes ``torch.distributed.is_initialized()`` answer False for the duration of the re-run.

    Only the rank that saw the fault re-runs its batch, so any cross-rank reduction inside the forward
    (mmdet's ``reduce_mean`` in PETR's loss, ``SyncBatchNorm``) would wait forever for ranks that are not
    re-running; code that asks first computes locally instead. Scoped to the re-run, restored afterwards.
    """
    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    original = dist.is_initialized
    dist.is_initialized = lambda: False
    try:
        yield
    finally:
        dist.is_initialized = original


