"""The one walker over nested training state (dicts, lists, tuples, named tuples) that every tensor pass uses."""
import copy
from typing import Any, Callable, Iterator, Mapping

import torch

__all__ = ["map_tensors", "iter_tensors", "nbytes"]


def _identity(value: Any) -> Any:
    return value


def map_tensors(
    obj: Any,
    fn: Callable[[torch.Tensor, Any], Any],
    like: Any = None,
    leaf: Callable[[Any], Any] = _identity,
) -> Any:
    """Rebuilds ``obj`` with every tensor ``t`` replaced by ``fn(t, counterpart)``.

    Dict subclasses (``OrderedDict`` state dicts) and named tuples keep their type. ``like`` is a structure
    walked in parallel (a previous copy to reuse, for example): ``counterpart`` is its leaf at the same place,
    or None where the structures differ.

    Args:
        obj: the nested state.
        fn: called once per tensor, in traversal order (dict order, then list order).
        like: the parallel structure, or None.
        leaf: applied to every other leaf (for example ``copy.deepcopy``). Defaults to the identity.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj, like)
    if isinstance(obj, dict):
        likes = like if isinstance(like, dict) else {}
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = map_tensors(value, fn, likes.get(key), leaf)
        return out
    if isinstance(obj, (list, tuple)):
        likes = like if isinstance(like, (list, tuple)) and len(like) == len(obj) else [None] * len(obj)
        items = [map_tensors(v, fn, other, leaf) for v, other in zip(obj, likes)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return leaf(obj)


def iter_tensors(obj: Any, floating: bool = True) -> Iterator[torch.Tensor]:
    """Yields the tensors inside nested dicts, lists and tuples, in the order :func:`map_tensors` visits them.

    Args:
        obj: the nested state.
        floating: only floating-point and complex tensors (the ones that can hold NaN/Inf). Defaults to True.
    """
    if isinstance(obj, torch.Tensor):
        if not floating or obj.is_floating_point() or obj.is_complex():
            yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from iter_tensors(value, floating)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from iter_tensors(value, floating)


def nbytes(obj: Any) -> int:
    """Bytes held by every tensor inside ``obj`` (integer tensors included)."""
    return sum(t.numel() * t.element_size() for t in iter_tensors(obj, floating=False))
