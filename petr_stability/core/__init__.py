"""The framework-free core: detection, remedies, snapshots, rollback and agreement, on torch alone.

Runner adapters (``petr_stability.adapters``) connect it to MMEngine, MMCV 1.x or a plain torch loop.
"""
