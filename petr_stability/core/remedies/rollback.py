"""The rollback remedy: the switch of the incident chain's restore step (the restore itself is
:mod:`~..recovery.restore`'s: restore points, their order, their lineage)."""
from ..causes import Cause
from .base import Remedy, When

__all__ = ["Rollback"]


class Rollback(Remedy):
    """Every class that rolls back returns to the next restore point of this run (``remedies=`` without
    ``'rollback'``: the run goes on from the live state). The chain asks whether a remedy takes
    :attr:`~.base.When.RESTORE` for the class; this one does for every class but structural."""

    name = "rollback"
    label = "roll back"
    causes = (Cause.DATA, Cause.FORWARD_OVERFLOW, Cause.DYNAMICS, Cause.UNKNOWN)
    events = (When.RESTORE,)
