"""Test and demo utilities: a PETR-shaped model from MMCV bricks and CPU stand-ins for CUDA-only pieces.

Importing this package needs MMCV (1.x or 2.x) for the transformer bricks; the core does not.
"""
