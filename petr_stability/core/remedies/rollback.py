"""The rollback remedy: the switch of the incident chain's restore step (the restore itself is
:mod:`~..recovery.restore`'s: restore points, their order, their lineage)."""
from .base import Remedy, When

__all__ = ["Rollback"]


class Rollback(Remedy):
    """Every class that rolls back returns to the next restore point of this run (``remedies=`` without
    ``'rollback'``: the run goes on from the live state)."""

    name = "rollback"
    when = When.RESTORE
