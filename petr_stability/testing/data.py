"""The list-backed dataset the tests share (:mod:`petr_stability.demo.data`)."""
from ..demo.data import ListDataset

__all__ = ["ListDataset"]
