"""MMEngine's private attributes the adapter must read or write, each behind one named accessor.

No public API reaches these (a restore must set the loop's iteration counter, the wrappers' accumulation counters,
the message hub's scalar history, and swap EMAHook's weights as EMAHook does; an incident's text goes to every vis
backend, which the visualizer names only by key). Each accessor fails loudly, naming
the attribute and the object, where an MMEngine release no longer has it: a silent ``setattr`` on a renamed
attribute would leave the run half restored.
"""
from typing import Any, Dict

__all__ = ["MissingPrivateAttribute", "set_loop_iter", "inner_count", "set_inner_count", "set_log_scalars",
           "swap_ema_state_dict", "vis_backends"]


class MissingPrivateAttribute(AttributeError):
    """The runner lacks a private attribute the guard relies on (an MMEngine release this adapter does not know)."""


def _require(obj: Any, name: str) -> Any:
    if not hasattr(obj, name):
        raise MissingPrivateAttribute(f"NanGuard: {type(obj).__name__} has no {name!r}; this MMEngine release moved "
                                      "what the guard restores (docs/versions.md lists the releases it knows)")
    return getattr(obj, name)


def set_loop_iter(train_loop: Any, value: int) -> None:
    """The train loop's iteration counter (``IterBasedTrainLoop._iter`` / ``EpochBasedTrainLoop._iter``)."""
    _require(train_loop, "_iter")
    train_loop._iter = value


def inner_count(wrapper: Any) -> int:
    """An optim wrapper's gradient-accumulation counter (``OptimWrapper._inner_count``)."""
    return _require(wrapper, "_inner_count")


def set_inner_count(wrapper: Any, value: int) -> None:
    """Sets :func:`inner_count`."""
    _require(wrapper, "_inner_count")
    wrapper._inner_count = value


def set_log_scalars(message_hub: Any, log_scalars: Dict[str, Any]) -> None:
    """The message hub's scalar history (``MessageHub._log_scalars``; ``log_scalars`` is a read-only property)."""
    _require(message_hub, "_log_scalars")
    message_hub._log_scalars = log_scalars


def swap_ema_state_dict(ema_hook: Any, checkpoint: Dict[str, Any]) -> None:
    """Swaps a checkpoint's ``state_dict`` and ``ema_state_dict`` as EMAHook does (``EMAHook._swap_ema_state_dict``)."""
    _require(ema_hook, "_swap_ema_state_dict")(checkpoint)


def vis_backends(visualizer: Any) -> Dict[str, Any]:
    """The visualizer's backends by name (``Visualizer._vis_backends``; ``get_backend`` needs the name)."""
    return dict(_require(visualizer, "_vis_backends"))
