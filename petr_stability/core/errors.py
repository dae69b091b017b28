"""The plugin's own exception types."""

__all__ = ["NanGuardError", "NanGuardGaveUp", "NoHealthyStateError", "StructuralDivergence", "BadDataError",
           "UnsafeCheckpointError", "UnwritableWorkDirError", "ReplicaDriftError"]


class NanGuardError(RuntimeError):
    """Base class of every error the guard raises on purpose."""


class NanGuardGaveUp(NanGuardError):
    """Recovery kept failing (the budget of recoveries is spent): training stops here."""


class NoHealthyStateError(NanGuardGaveUp):
    """A divergence was confirmed but no healthy state exists to roll back to."""


class StructuralDivergence(NanGuardGaveUp):
    """The divergence is structural (a bug, a broken data pipeline): every new batch fails, or the remedies for its
    class are spent; rolling back again would only spend the budget."""


class BadDataError(NanGuardGaveUp):
    """A data problem, not a bug: samples the quarantine's bound refused came back and broke the run again. The
    message names every bad sample found (quarantined and refused); the patched config quarantines them all, so the
    next run starts without them. ``samples`` lists them as the incident records name them; ``samples_indices``
    their dataset indices."""

    def __init__(self, message: str, samples: "list" = ()) -> None:
        super().__init__(message)
        self.samples = [dict(s) for s in samples]
        self.samples_indices = sorted({int(s["index"]) for s in self.samples if s.get("index") is not None})


class UnsafeCheckpointError(NanGuardError):
    """A checkpoint holds non-finite values or objects that safe loading refuses."""


class UnwritableWorkDirError(NanGuardError, PermissionError):
    """The guard cannot write its records into the work dir (raised before the first iteration, naming the path):
    a run it saves must be able to say so. Also a ``PermissionError``, what the failed write itself would raise."""


class ReplicaDriftError(NanGuardError):
    """A data-parallel rank whose copy of the model keeps drifting from the others' however often it is repaired (a
    faulty device or host memory, or code that writes to one rank's weights alone); ``ranks`` names it."""

    def __init__(self, message: str, ranks: "list" = ()) -> None:
        super().__init__(message)
        self.ranks = [int(r) for r in ranks]
