"""The temporal remedy: state modules keep outside ``state_dict()`` (StreamPETR's memory queue) started afresh."""
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from torch import nn

from ..validate import Setting, is_names
from .base import Context, Outcome, Remedy, Run

__all__ = ["TEMPORAL_RESET_METHODS", "GENERIC_RESET_CLASSES", "reset_temporal_state", "TemporalReset"]

#: Methods that reset state a module keeps outside ``state_dict()``: StreamPETR's heads ``reset_memory()``
#: (memory_embedding, memory_reference_point, memory_timestamp, memory_egopose, memory_velo), Sparse4D's
#: ``InstanceBank.reset()`` (cached features, anchors, confidences).
TEMPORAL_RESET_METHODS: Tuple[str, ...] = ("reset_memory", "reset")

#: Generic method names and the only classes (matched by name along the MRO) on which they are called: ``reset``
#: means something else on many modules (optimizer-like helpers, metrics, custom layers), so it runs only on
#: Sparse4D's ``InstanceBank``. A name not listed here (``reset_memory``) is specific enough to call on any module.
GENERIC_RESET_CLASSES: Dict[str, Tuple[str, ...]] = {"reset": ("InstanceBank",)}

#: Never called, whatever the arguments: they re-initialise weights or statistics a rollback just restored.
_FORBIDDEN = ("reset_parameters", "_reset_parameters", "reset_running_stats", "init_weights")


def reset_temporal_state(model: nn.Module, method_names: Sequence[str] = TEMPORAL_RESET_METHODS,
                         generic_classes: Optional[Mapping[str, Sequence[str]]] = None) -> List[str]:
    """Calls each module's temporal-state reset method (after a rollback, so no memory computed by the poisoned
    weights survives: ``memory * prev_exists`` keeps NaN, as NaN * 0 = NaN).

    Args:
        model: the unwrapped model.
        method_names: methods to call where a module has them. Defaults to :data:`TEMPORAL_RESET_METHODS`.
        generic_classes: for generic names, the class names allowed to have them called. Defaults to None
            (:data:`GENERIC_RESET_CLASSES`).

    Returns:
        The names of the modules reset (``'(model)'`` for the model itself), in ``named_modules`` order.

    Raises:
        TypeError: ``method_names`` is a string.
        ValueError: a name re-initialises weights (``reset_parameters``, ``init_weights``, ...).
    """
    if isinstance(method_names, str):
        raise TypeError(f"method_names must be a list of names, got the string {method_names!r}")
    for method in method_names:
        if method in _FORBIDDEN:
            raise ValueError(f"{method!r} re-initialises weights or statistics; it is never called as a "
                             "temporal-state reset")
    generic = GENERIC_RESET_CLASSES if generic_classes is None else generic_classes
    reset: List[str] = []
    for name, module in model.named_modules():
        classes = {cls.__name__ for cls in type(module).__mro__}
        done = False
        for method in method_names:
            fn = getattr(module, method, None)
            if not callable(fn) or isinstance(fn, nn.Module):
                continue
            if method in generic and not classes.intersection(generic[method]):
                continue
            fn()
            done = True
        if done:
            reset.append(name or "(model)")
    return reset


class TemporalReset(Remedy):
    """After every rollback, and before a replay on healthy weights: the modules' state outside ``state_dict()``
    (``temporal_reset`` methods) started afresh, whatever the class. Its outcome's ``temporal_reset`` signal names
    the modules reset."""

    name = "temporal"
    order = 90
    label = "temporal state reset"
    settings = (Setting("temporal_reset", ("reset_memory", "reset"), is_names, "methods called after every "
                        "rollback on modules that have them, to clear state kept outside ``state_dict()`` "
                        "(StreamPETR's ``reset_memory``; ``reset`` only on Sparse4D's ``InstanceBank``)."),)

    def match(self, ctx: Context) -> bool:
        return bool(self.config.temporal_reset)

    def after_rollback(self, run: Run) -> Outcome:
        names = reset_temporal_state(run.io.model(), self.config.temporal_reset)
        return Outcome(signals={"temporal_reset": names} if names else {})
