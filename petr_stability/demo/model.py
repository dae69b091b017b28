"""A PETR-shaped detector built from MMCV's transformer bricks with the decoder layer config of the project's seed
document (../shared/seed/TRANSLATION.md, before the known manual fix).

Works with MMCV 1.x (``ATTENTION`` / ``TRANSFORMER_LAYER`` registries) and MMCV 2.x (MMEngine's ``MODELS``).
The head wraps its decoder output and its losses in ``torch.nan_to_num`` as PETR's head does, so a poisoned
model reports a finite loss while grad_norm and the weights are NaN.
"""
import copy
import math
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from mmcv.cnn.bricks.drop import DropPath
from mmcv.cnn.bricks.transformer import BaseTransformerLayer, build_dropout, build_transformer_layer
from torch import Tensor, nn

from ..core.flags import HAS_CHECKPOINT_USE_REENTRANT

try:  # MMCV 1.x
    from mmcv.cnn.bricks.registry import ATTENTION, TRANSFORMER_LAYER
except ImportError:  # MMCV 2.x
    from mmengine.registry import MODELS as ATTENTION
    from mmengine.registry import MODELS as TRANSFORMER_LAYER

Opt = Optional[Tensor]

__all__ = ["SEED_LAYER_CFG", "PETRShapedHead", "build_petr_like", "register", "PETRMultiheadAttention", "make_batch"]

EMBED = 256

# The decoder layer of the seed document (TRANSLATION.md), before the known manual fix: dropout 0.1, ffn_dropout 0.1.
SEED_LAYER_CFG = dict(
    type="PETRLikeDecoderLayer",
    attn_cfgs=[
        dict(type="MultiheadAttention", embed_dims=EMBED, num_heads=8, dropout=0.1),
        dict(type="PETRMultiheadAttention", embed_dims=EMBED, num_heads=8, dropout=0.1),
    ],
    feedforward_channels=2048,
    ffn_dropout=0.1,
    with_cp=True,
    operation_order=("self_attn", "norm", "cross_attn", "norm", "ffn", "norm"),
)


class PETRMultiheadAttention(nn.Module):
    """Same layout as PETR's attention: ``attn`` (``nn.MultiheadAttention``), ``proj_drop``, ``dropout_layer``."""

    def __init__(self, embed_dims: int, num_heads: int, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 dropout_layer: Optional[dict] = None, batch_first: bool = False, init_cfg: Optional[dict] = None,
                 **kwargs: Any) -> None:
        super().__init__()
        if "dropout" in kwargs:  # the megvii config spelling: one value for both
            attn_drop = kwargs["dropout"]
            dropout_layer = dict(type="Dropout", drop_prob=attn_drop)
        self.embed_dims = embed_dims
        self.batch_first = batch_first
        self.attn = nn.MultiheadAttention(embed_dims, num_heads, attn_drop)
        self.proj_drop = nn.Dropout(proj_drop)
        self.dropout_layer = build_dropout(dropout_layer) if dropout_layer else nn.Identity()

    def forward(self, query: Tensor, key: Opt = None, value: Opt = None, identity: Opt = None, query_pos: Opt = None,
                key_pos: Opt = None, attn_mask: Opt = None, key_padding_mask: Opt = None, **kwargs: Any) -> Tensor:
        key = query if key is None else key
        value = key if value is None else value
        identity = query if identity is None else identity
        if key_pos is None and query_pos is not None and query_pos.shape == key.shape:
            key_pos = query_pos
        if query_pos is not None:
            query = query + query_pos
        if key_pos is not None:
            key = key + key_pos
        out = self.attn(query=query, key=key, value=value, attn_mask=attn_mask,
                        key_padding_mask=key_padding_mask)[0]
        return identity + self.dropout_layer(self.proj_drop(out))


class PETRLikeDecoderLayer(BaseTransformerLayer):
    """``BaseTransformerLayer`` with PETR's ``with_cp`` (activation checkpointing through torch.utils.checkpoint)."""

    def __init__(self, *args: Any, with_cp: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.use_checkpoint = with_cp

    def _forward(self, query: Tensor, key: Opt, value: Opt, query_pos: Opt, key_pos: Opt) -> Tensor:
        return super().forward(query, key=key, value=value, query_pos=query_pos, key_pos=key_pos)

    def forward(self, query: Tensor, key: Opt = None, value: Opt = None, query_pos: Opt = None, key_pos: Opt = None,
                **kwargs: Any) -> Tensor:
        if self.use_checkpoint and self.training and HAS_CHECKPOINT_USE_REENTRANT:
            return cp.checkpoint(self._forward, query, key, value, query_pos, key_pos, use_reentrant=False)
        if self.use_checkpoint and self.training:  # torch < 1.11: the reentrant form is the only one
            return cp.checkpoint(self._forward, query, key, value, query_pos, key_pos)
        return self._forward(query, key, value, query_pos, key_pos)


def register() -> None:
    """Registers this model's attention and decoder layer with MMCV's registries (idempotent). Called by
    :func:`build_petr_like`; nothing is registered on import."""
    for registry, cls in ((ATTENTION, PETRMultiheadAttention), (TRANSFORMER_LAYER, PETRLikeDecoderLayer)):
        if registry.get(cls.__name__) is None:
            registry.register_module(module=cls)


class TinyBackbone(nn.Module):
    """Stands in for VoVNet/EVA: a projection with a DropPath (0.1) that the dropout remedy must not touch."""

    def __init__(self, in_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_dim, EMBED)
        self.norm = nn.BatchNorm1d(EMBED)
        self.drop_path = DropPath(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        y = self.proj(x)
        y = self.norm(y.reshape(b * n, -1).float()).reshape(b, n, -1).to(y.dtype)
        return x.new_zeros(()) + y + self.drop_path(y)


class PETRShapedHead(nn.Module):
    """Decoder of ``num_layers`` seed layers over camera tokens, class and box branches, PETR's nan_to_num."""

    def __init__(self, num_layers: int = 2, num_query: int = 32, num_classes: int = 10,
                 layer_cfg: Optional[dict] = None) -> None:
        super().__init__()
        cfg = copy.deepcopy(layer_cfg or SEED_LAYER_CFG)
        self.layers = nn.ModuleList([build_transformer_layer(copy.deepcopy(cfg)) for _ in range(num_layers)])
        self.query_embedding = nn.Embedding(num_query, EMBED)
        self.cls_branch = nn.Linear(EMBED, num_classes)
        self.reg_branch = nn.Linear(EMBED, 10)

    def forward(self, memory: torch.Tensor) -> Dict[str, torch.Tensor]:
        b = memory.shape[0]
        q = self.query_embedding.weight.unsqueeze(1).expand(-1, b, -1)
        mem = memory.transpose(0, 1)
        out = torch.zeros_like(q)
        for layer in self.layers:
            out = layer(out, key=mem, value=mem, query_pos=q)
        out = torch.nan_to_num(out)  # PETR: outs_dec = torch.nan_to_num(outs_dec)
        return {"cls": self.cls_branch(out).transpose(0, 1), "reg": self.reg_branch(out).transpose(0, 1)}


class PETRLike(nn.Module):
    """Backbone + PETR-shaped head; ``forward(inputs, targets)`` returns PETR-style loss dicts."""

    def __init__(self, in_dim: int = 64, num_layers: int = 2, num_query: int = 32,
                 layer_cfg: Optional[dict] = None) -> None:
        super().__init__()
        self.img_backbone = TinyBackbone(in_dim)
        self.pts_bbox_head = PETRShapedHead(num_layers, num_query, layer_cfg=layer_cfg)

    def losses(self, inputs: torch.Tensor, cls_t: torch.Tensor, reg_t: torch.Tensor) -> Dict[str, torch.Tensor]:
        preds = self.pts_bbox_head(self.img_backbone(inputs))
        loss_cls = F.cross_entropy(preds["cls"].float().flatten(0, 1), cls_t.flatten())
        loss_bbox = F.l1_loss(preds["reg"].float(), reg_t)
        # PETR: loss_cls = torch.nan_to_num(loss_cls); loss_bbox = torch.nan_to_num(loss_bbox)
        return {"loss_cls": torch.nan_to_num(loss_cls), "loss_bbox": torch.nan_to_num(loss_bbox)}


def build_petr_like(**kwargs: Any) -> PETRLike:
    """The PETR-shaped model (its layers registered first)."""
    register()
    return PETRLike(**kwargs)


def make_batch(n: int, in_dim: int = 64, tokens: int = 48, num_query: int = 32, seed: int = 0) -> List[dict]:
    """Synthetic multi-camera-like samples whose targets depend on the inputs (so the loss can fall)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(in_dim, 10, generator=g) / math.sqrt(in_dim)
    samples = []
    for _ in range(n):
        x = torch.randn(tokens, in_dim, generator=g)
        pooled = x.mean(0)
        reg = (pooled @ w).expand(num_query, 10).clone() + 0.1 * torch.randn(num_query, 10, generator=g)
        cls_t = torch.full((num_query,), int(pooled[:10].argmax()), dtype=torch.long)
        samples.append({"inputs": x, "cls_t": cls_t, "reg_t": reg})
    return samples
