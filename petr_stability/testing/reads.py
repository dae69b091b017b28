"""Counts the places where Python code reads a tensor's value onto the host.

On CUDA each such read (``float(t)``, ``t.item()``, ``bool(t)``, ...) waits for the device: a host-device
synchronization. ``torch.cuda.set_sync_debug_mode`` finds them on a GPU; this finds the same reads on the CPU,
where tests run, so "a healthy step reads nothing from the device" can be checked without a GPU.
"""
import contextlib
import traceback
import warnings
from typing import Any, Callable, ContextManager, Iterator, List, Sequence

import torch

__all__ = ["count_host_reads", "cuda_syncs", "watch_methods", "watch_healthy_steps"]

_READS = ("__float__", "__int__", "__bool__", "__index__", "item", "tolist", "numpy", "cpu")


@contextlib.contextmanager
def count_host_reads() -> Iterator[List[str]]:
    """Within the block, every tensor-value read is recorded as ``'method at file:line'`` into the yielded list.

    Not thread-safe: it patches ``torch.Tensor`` for the duration of the block.
    """
    reads: List[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in _READS}
    own = {name for name in _READS if name in vars(torch.Tensor)}  # the others are inherited from the C base

    def recording(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            frame = traceback.extract_stack(limit=2)[0]
            reads.append(f"{name} at {frame.filename}:{frame.lineno}")
            return fn(self, *args, **kwargs)

        return read

    for name, fn in originals.items():
        setattr(torch.Tensor, name, recording(name, fn))
    try:
        yield reads
    finally:
        for name, fn in originals.items():
            if name in own:
                setattr(torch.Tensor, name, fn)
            else:
                delattr(torch.Tensor, name)  # back to the inherited method, as before


@contextlib.contextmanager
def cuda_syncs() -> Iterator[List[str]]:
    """Within the block, every host-device synchronization CUDA reports is recorded into the yielded list
    (``torch.cuda.set_sync_debug_mode('warn')``; needs a GPU)."""
    found: List[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(0)
    found.extend(str(w.message) for w in caught if "synchroniz" in str(w.message))


def watch_methods(obj: Any, names: Sequence[str], when: Callable[[Any], bool],
                  recorder: Callable[[], ContextManager[List[str]]] = count_host_reads) -> List[List[str]]:
    """Wraps ``obj``'s methods ``names`` (hook methods: the runner comes first) so that each call for which
    ``when(runner)`` is true runs inside ``recorder``; returns the list that receives one record list per
    watched call."""
    calls: List[List[str]] = []

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(runner: Any, *args: Any, **kwargs: Any) -> Any:
            if not when(runner):
                return original(runner, *args, **kwargs)
            with recorder() as seen:
                out = original(runner, *args, **kwargs)
            calls.append(seen)
            return out

        return call

    for name in names:
        setattr(obj, name, wrap(getattr(obj, name)))
    return calls


def watch_healthy_steps(hook: Any, snapshot_interval: int, warmup: int = 8,
                        recorder: Callable[[], ContextManager[List[str]]] = count_host_reads) -> List[List[str]]:
    """Watches a NanGuardHook's ``before_train_iter`` / ``after_train_iter`` on the steps that should read nothing:
    past ``warmup`` iterations, and not on snapshot iterations (their health check reads the device by design).
    Configure the guard with that ``snapshot_interval`` and a ``check_interval`` beyond the run."""
    return watch_methods(hook, ["before_train_iter", "after_train_iter"], recorder=recorder,
                         when=lambda runner: runner.iter >= warmup and (runner.iter + 1) % snapshot_interval != 0)
