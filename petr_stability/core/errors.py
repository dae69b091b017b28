"""The plugin's own exception types."""

__all__ = ["NanGuardError", "NanGuardGaveUp", "NoHealthyStateError", "StructuralDivergence", "UnsafeCheckpointError"]


class NanGuardError(RuntimeError):
    """Base class of every error the guard raises on purpose."""


class NanGuardGaveUp(NanGuardError):
    """Recovery kept failing (the budget of recoveries is spent): training stops here."""


class NoHealthyStateError(NanGuardGaveUp):
    """A divergence was confirmed but no healthy state exists to roll back to."""


class StructuralDivergence(NanGuardGaveUp):
    """The divergence is structural (a bug, a broken data pipeline): every new batch fails, or the remedies for its
    class are spent; rolling back again would only spend the budget."""


class UnsafeCheckpointError(NanGuardError):
    """A checkpoint holds non-finite values or objects that safe loading refuses."""
