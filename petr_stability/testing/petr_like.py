"""The demo's PETR-shaped model for tests (:mod:`petr_stability.demo.model`), its layers registered on import."""
from ..demo.model import (  # noqa: F401 - re-exported for the tests
    ATTENTION,
    EMBED,
    SEED_LAYER_CFG,
    TRANSFORMER_LAYER,
    PETRLike,
    PETRLikeDecoderLayer,
    PETRMultiheadAttention,
    PETRShapedHead,
    TinyBackbone,
    build_petr_like,
    make_batch,
    register,
)

__all__ = ["ATTENTION", "EMBED", "SEED_LAYER_CFG", "TRANSFORMER_LAYER", "PETRLike", "PETRLikeDecoderLayer",
           "PETRMultiheadAttention", "PETRShapedHead", "TinyBackbone", "build_petr_like", "make_batch"]

register()
