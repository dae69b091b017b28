"""The rollback remedy: the switch of the incident chain's restore step (the restore itself is
:mod:`~..recovery.restore`'s: restore points, their order, their lineage)."""
from ..causes import Cause
from .base import Remedy

__all__ = ["Rollback"]


class Rollback(Remedy):
    """Every class that rolls back returns to the next restore point of this run (``remedies=`` without
    ``'rollback'``: the run goes on from the live state). It takes no event: it is the switch
    (:attr:`~.base.Remedy.restore`) the chain reads for every class it serves, every class but structural."""

    name = "rollback"
    order = 30
    label = "roll back"
    causes = (Cause.DATA, Cause.FORWARD_OVERFLOW, Cause.DYNAMICS, Cause.UNKNOWN)
    restore = True
