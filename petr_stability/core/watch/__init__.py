"""Sensors and signals of the per-step watch: the step probe (:mod:`.probe`), health checks (:mod:`.health`), the
detector's verdicts (:mod:`.detector`) and the grad_norm early warning (:mod:`.spikes`). The guard
(:mod:`~petr_stability.core.guard`) runs them once per iteration."""
