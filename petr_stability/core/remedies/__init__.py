"""Remedies, one file per remedy: pure functions over live torch objects, each returning the :class:`Change` list of
what it changed (old and new value), and one :class:`~.base.Remedy` object declaring what it matches, its settings,
its state and its patched-config entry. :mod:`.registry` holds the registered types (a user's package adds its own
with :func:`register_remedy`) and the ladder; the policy (:mod:`~petr_stability.core.recovery.policy`) chooses which
act on an incident."""
from ..skiplist import QuarantineSampler, SkipList
from .base import HANDLERS, Change, ConfigEntry, Context, Incident, Outcome, Remedy, Run, Setting, Step, Target, When
from .clip import tighten_clip
from .dropout import DROPOUT_FLOAT_ATTRS, TRANSFORMER_CLASSES, zero_transformer_dropout
from .fp32 import apply_fp32, force_fp32, fp32_modules, is_fp32, release_fp32
from .lr import scale_lr
from .moments import exploded_params, reset_moments
from .registry import LADDER, REMEDIES, Rung, register_remedy
from .temporal import GENERIC_RESET_CLASSES, TEMPORAL_RESET_METHODS, reset_temporal_state

__all__ = ["Change", "ConfigEntry", "Context", "Outcome", "Remedy", "Setting", "Target", "When", "Run", "Incident",
           "Step", "HANDLERS", "register_remedy",
           "REMEDIES", "LADDER", "Rung", "tighten_clip", "DROPOUT_FLOAT_ATTRS", "TRANSFORMER_CLASSES",
           "zero_transformer_dropout",
           "apply_fp32", "force_fp32", "fp32_modules", "is_fp32", "release_fp32", "scale_lr", "exploded_params",
           "reset_moments", "QuarantineSampler", "SkipList", "GENERIC_RESET_CLASSES",
           "TEMPORAL_RESET_METHODS", "reset_temporal_state"]
