"""The dropout remedy: every drop probability of the detection head's transformer to 0, in place."""
from typing import Any, Iterable, List, Mapping, Sequence, Tuple

from torch import nn

from ..causes import Cause
from ..validate import Setting, is_choice, is_names
from .base import Change, ConfigEntry, Context, Incident, Remedy, Run, When

__all__ = ["TRANSFORMER_CLASSES", "DROPOUT_FLOAT_ATTRS", "zero_transformer_dropout", "DropoutRemedy"]

#: Classes whose instances (and every descendant module) form the detection head's transformer. Matched by
#: name along the MRO so that subclasses count and no framework has to be importable: MMCV's bricks, PETR's
#: attention and layers (megvii PETR, mmdet3d 1.4 ``projects/PETR``, StreamPETR), flash variants, torch's own.
TRANSFORMER_CLASSES: Tuple[str, ...] = (
    "BaseTransformerLayer",
    "TransformerLayerSequence",
    "MultiheadAttention",
    "FFN",
    "PETRMultiheadAttention",
    "PETRTransformerDecoderLayer",
    "PETRTransformerDecoder",
    "PETRTransformer",
    "PETRTemporalTransformer",
    "PETRTemporalDecoderLayer",
    "FlashMHA",
    "FlashAttention",
    "MultiScaleDeformableAttention",
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
)

#: Float attributes that hold a drop probability (``nn.MultiheadAttention.dropout``, ``FlashMHA``'s
#: ``inner_attn.dropout_p``, ``DropPath.drop_prob``): zeroed like ``nn.Dropout.p``.
DROPOUT_FLOAT_ATTRS: Tuple[str, ...] = ("dropout", "dropout_p", "drop_prob", "attn_drop", "proj_drop")


def _in_transformer(module: nn.Module, classes: Sequence[str]) -> bool:
    return any(cls.__name__ in classes for cls in type(module).__mro__)


def _excluded(name: str, exclude: Sequence[str]) -> bool:
    if name.startswith("module."):
        name = name[len("module.") :]
    return any(name == prefix or name.startswith(prefix + ".") for prefix in exclude)


def _scoped_modules(model: nn.Module, scope: str, exclude: Sequence[str]) -> Iterable[Tuple[str, nn.Module]]:
    if scope == "all":
        roots = [("", model)]
    else:
        roots = []
        for name, module in model.named_modules():
            if _in_transformer(module, TRANSFORMER_CLASSES) and not any(
                name == r or name.startswith(r + ".") for r, _ in roots if r
            ):
                roots.append((name, module))
    seen = set()
    for root_name, root in roots:
        for sub_name, module in root.named_modules(prefix=root_name):
            if id(module) in seen or _excluded(sub_name, exclude):
                continue
            seen.add(id(module))
            yield sub_name, module


def zero_transformer_dropout(
    model: nn.Module, scope: str = "transformer", exclude: Sequence[str] = ("backbone", "img_backbone")
) -> List[Change]:
    """Sets every drop probability inside the transformer to 0, in place: half of the known manual fix
    (transformer dropout 0, max_norm 1).

    Covers ``nn.Dropout``-like modules (``p``, MMCV's ``Dropout`` included) and float probabilities
    (``nn.MultiheadAttention.dropout``, ``dropout_p``, ``DropPath.drop_prob``). The change survives
    ``model.train()`` because it edits the attributes the forward reads, not the mode.

    Args:
        model: the unwrapped model.
        scope: ``'transformer'`` (descendants of the classes in :data:`TRANSFORMER_CLASSES`) or ``'all'``.
        exclude: module-name prefixes left alone (backbone DropPath is a regularizer, not the fault).

    Returns:
        One :class:`Change` per attribute that was above 0, named ``'<module>.<attr>'``.
    """
    if scope not in ("transformer", "all"):
        raise ValueError(f"dropout scope must be 'transformer' or 'all', got {scope!r}")
    changes: List[Change] = []
    for name, module in _scoped_modules(model, scope, exclude):
        attrs = ("p",) if isinstance(module, nn.modules.dropout._DropoutNd) else ()
        for attr in attrs + DROPOUT_FLOAT_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, float) and not isinstance(value, bool) and value > 0:
                setattr(module, attr, 0.0)
                changes.append(Change(f"{name}.{attr}" if name else attr, value, 0.0))
    return changes


class DropoutRemedy(Remedy):
    """The other half of the ladder's first rung: the head transformer's dropout to 0 (``dropout_scope``,
    ``dropout_exclude``), again on resume."""

    name = "dropout"
    order = 20
    label = "transformer dropout 0"
    causes = (Cause.DYNAMICS, Cause.UNKNOWN)
    settings = (
        Setting("dropout_scope", "transformer", is_choice("transformer", "all"), "``'transformer'`` (the detection "
                "head's transformer: every descendant of the classes in ``TRANSFORMER_CLASSES``) or ``'all'``."),
        Setting("dropout_exclude", ("backbone", "img_backbone"), is_names, "module-name prefixes whose dropout is "
                "left alone (a backbone's DropPath is a regularizer, not the fault)."),
    )
    state = ("dropout_zeroed",)
    idle = {"dropout_zeroed": False}

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.dropout_zeroed = False
        #: Every drop probability this run set to 0 (``module.attribute``): what the patched config carries, as a
        #: transformer built in code has no config key for it.
        self.zeroed: List[str] = []

    def in_effect(self, ctx: Context) -> bool:
        return self.dropout_zeroed

    def match(self, ctx: Context) -> bool:
        return ctx.event != When.START or self.dropout_zeroed

    def on_start(self, run: Run) -> List[Change]:
        changes = self.before_restore(run, Incident(None))
        if changes:
            run.io.log(f"NanGuard: resumed remedy: {len(changes)} transformer dropout(s) set to 0")
        return changes

    def before_restore(self, run: Run, incident: Incident) -> List[Change]:
        changes = zero_transformer_dropout(run.io.model(), self.config.dropout_scope, self.config.dropout_exclude)
        self.dropout_zeroed = True
        self.zeroed += [c.target for c in changes if c.target not in self.zeroed]
        return changes

    def reapply(self, carried: Mapping[str, Any], ctx: Context) -> List[Change]:
        """The next run's start: every carried drop probability to 0 on the modules that have it (where the config's
        keys did not already), before its first iteration."""
        model, changes = ctx.io.model(), []
        for target in carried.get("zeroed") or []:
            path, _, attr = str(target).rpartition(".")
            try:
                module = model.get_submodule(path) if path else model
            except AttributeError:
                ctx.io.log(f"NanGuard: carried dropout {target}: no such module in this model; left alone", "warning")
                continue
            value = getattr(module, attr, None)
            if isinstance(value, float) and value > 0:
                setattr(module, attr, 0.0)
                changes.append(Change(str(target), value, 0.0))
        self.dropout_zeroed = True
        self.zeroed = [str(t) for t in carried.get("zeroed") or []]
        return changes

    def load_value(self, key: str, value: Any) -> Any:
        return bool(value)

    def config_entry(self, io: Any) -> ConfigEntry:
        # The config's dropout keys where it has them, and the modules themselves always: a transformer built in code
        # (a torch nn.TransformerDecoderLayer in the head) has no key, and the next run must not train with 0.1 again.
        return ConfigEntry(fix={"zero_dropout": True}, carry={"zeroed": list(self.zeroed)} if self.zeroed else {})
