"""The framework-free core, on torch alone: the per-step watch (:mod:`.watch`), diagnosis (:mod:`.diagnosis`),
remedies (:mod:`.remedies`), recovery (:mod:`.recovery`) and the incident records (:mod:`.records`).

Runner adapters (``petr_stability.adapters``) connect it to MMEngine, MMCV 1.x or a plain torch loop.
"""
