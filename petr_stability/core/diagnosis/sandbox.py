"""What a replay leaves exactly as it found it: the RNG (captured on healthy steps), the model's modes, gradients,
buffers and plain-attribute state (:class:`ModelState`), and the process group (a rank-local scope)."""
import contextlib
from typing import Any, Dict, Iterator, List, Mapping, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["capture_rng", "restore_rng", "rank_local", "unwrap", "ModelState"]


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


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP / DataParallel wrapper (a DDP forward on one rank alone would wait for the others)."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model


_PLAIN = (str, bytes, int, float, bool, type(None))


def _is_state(value: Any) -> bool:
    """A value a forward keeps on a module as plain data: a tensor, a list/tuple of tensors, or a scalar / None."""
    if isinstance(value, torch.Tensor) or isinstance(value, _PLAIN):
        return True
    return isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value)


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(v.detach().clone() for v in value)
    return value


class ModelState:
    """Modes, gradients, buffers (train-mode BatchNorm updates its statistics on a re-run), optionally the
    parameters, and the plain attributes modules keep outside ``state_dict()`` (StreamPETR's memory queue: each replayed
    forward pushes the batch into it, and its ``prev_scene_token``), so that a replay leaves no trace.

    Args:
        model: the unwrapped model.
        params: also save the parameters (the replay loads other weights). Defaults to False.
    """

    def __init__(self, model: nn.Module, params: bool = False) -> None:
        self.modes = [(m, m.training) for m in model.modules()]
        self.grads = [(p, p.grad) for p in model.parameters()]
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.params = [(p, p.detach().clone()) for p in model.parameters()] if params else []
        self.attributes: List[Tuple[nn.Module, Dict[str, Any], Set[str]]] = [
            (m, {k: (v, _copy(v)) for k, v in vars(m).items() if not k.startswith("_") and _is_state(v)}, set(vars(m)))
            for m in model.modules()]

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in self.buffers + self.params:
                t.copy_(saved)
        for p, grad in self.grads:
            p.grad = grad
        for m, mode in self.modes:
            m.training = mode
        for module, saved, before in self.attributes:
            for name in [k for k in vars(module) if k not in before and not k.startswith("_")]:
                delattr(module, name)  # made by the replay (a memory the forward created): not there before
            for name, (original, copy) in saved.items():
                setattr(module, name, _restored(original, copy))


def _restored(original: Any, copy: Any) -> Any:
    """The attribute's saved value, in the original tensor objects where shapes allow (other references to them see
    the old values again, as if the replay never ran)."""
    if isinstance(original, torch.Tensor):
        with torch.no_grad():
            if original.shape == copy.shape:
                original.copy_(copy)
                return original
        return copy
    if isinstance(original, (list, tuple)):
        return type(original)(_restored(o, c) for o, c in zip(original, copy))
    return original
