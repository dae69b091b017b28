"""Command-line tools: the demo, the run report and the config patcher (see :mod:`petr_stability.cli`)."""

__all__ = []
