"""Triggers for the cause-aware recovery tests, each made of data or model behaviour, never a write into the weights.

- :class:`IdentifiedDataset`: the PETR-shaped samples, each carrying a nuScenes-like ``sample_idx`` (also listed in
  ``data_infos`` / ``data_list``, where the quarantine looks ids up), with optional bad samples (raw 16-bit pixels,
  NaN pixels) and an optional planted bug (a wrong normalisation from some call on);
- :class:`OverflowAttention`: PETR's attention whose fused core (:class:`ScaledDotProduct`) gives logits past fp16's
  range under fp16 autocast while they stay finite in fp32 (a flash attention over large position embeddings);
- :class:`MemoryHead`: a StreamPETR-style head keeping a memory of past queries as a plain tensor attribute,
  cleared by ``reset_memory()``;
- :class:`DropsSampleIds`: a mixin for the runner families' model wrappers, whose ``forward`` does not take the
  sample id keys a collated batch carries.

Needs MMCV (1.x or 2.x) for the transformer bricks, as :mod:`.petr_like` does; no runner family is imported.
"""
import copy
import math
from typing import Any, Dict, List, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.samples import ID_KEYS
from .data import ListDataset
from .fetches import guard_replay
from .petr_like import ATTENTION, SEED_LAYER_CFG, PETRLike, PETRMultiheadAttention, PETRShapedHead, make_batch

__all__ = [
    "BAD_KINDS",
    "RAW_PIXEL_MAX",
    "IdentifiedDataset",
    "wrong_normalize",
    "ScaledDotProduct",
    "OverflowAttention",
    "overflow_layer_cfg",
    "MemoryHead",
    "build_memory_net",
    "DropsSampleIds",
    "sample_token",
    "ScaleReadAsZero",
    "plant_scale_bug",
    "poison_pixels",
    "poison_box",
    "nan_loss_on_bad_boxes",
]

#: The largest raw 16-bit pixel value: past fp16's largest finite value (65504), so fp16 turns it into Inf.
RAW_PIXEL_MAX = 65535.0

#: What :class:`IdentifiedDataset` can do to a sample: ``'raw16'`` (saturated pixels left as raw 16-bit values,
#: 65535, instead of normalised ones), ``'nan'`` (NaN pixels, as a corrupt image decodes) or ``'inf'`` (Inf pixels).
BAD_KINDS = ("raw16", "nan", "inf")
_BAD_VALUES = {"raw16": RAW_PIXEL_MAX, "nan": math.nan, "inf": math.inf}

Opt = Optional[Tensor]


def sample_token(index: int) -> str:
    """The ``sample_idx`` of dataset index ``index``: a nuScenes-like token string (PETR and StreamPETR use the
    sample token there), deliberately not the index itself, so naming a sample goes through the dataset's infos."""
    return f"sample-{index:04d}-tok"


def wrong_normalize(x: Tensor) -> Tensor:
    """A planted bug: a normalisation reading its scale from the wrong tensor (the range of an all-zero padding
    channel, 0), so every value it returns is +/-Inf or NaN."""
    pad = torch.zeros_like(x[..., :1])
    return (x - x.mean()) / (pad.amax() - pad.amin())


class IdentifiedDataset(ListDataset):
    """The PETR-shaped samples of :func:`~.petr_like.make_batch`, each carrying ``sample_idx``.

    The infos (``data_infos`` for MMCV 1.x datasets, ``data_list`` for MMEngine's) list every ``sample_idx``, so
    :func:`~petr_stability.core.samples.resolve_indices` maps a batch's ids back to dataset indices.

    Args:
        n: number of samples.
        num_query: queries of the model (the targets' length). Defaults to 32.
        seed: the data's seed. Defaults to 0.
        bad: ``{dataset index: kind}`` for samples that break training whenever they are served, kind one of
            :data:`BAD_KINDS`. Defaults to None (none).
        bug_after: a planted code bug: the first ``bug_after`` calls of ``__getitem__`` are served correctly, every
            later one goes through :func:`wrong_normalize`. Defaults to None (no bug).
        bad_tokens: how many of a bad sample's tokens (camera feature rows) are broken. Defaults to 4.

    Raises:
        ValueError: a bad index is out of range, a kind is unknown, ``bug_after`` or ``bad_tokens`` is negative.
    """

    def __init__(self, n: int, num_query: int = 32, seed: int = 0, bad: Optional[Mapping[int, str]] = None,
                 bug_after: Optional[int] = None, bad_tokens: int = 4) -> None:
        samples = make_batch(n, num_query=num_query, seed=seed)
        for i, sample in enumerate(samples):
            sample["sample_idx"] = sample_token(i)
        super().__init__(samples)
        self.bad: Dict[int, str] = {}
        for index, kind in dict(bad or {}).items():
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
                raise ValueError(f"bad sample index must be an integer in [0, {n}), got {index!r}")
            if kind not in BAD_KINDS:
                raise ValueError(f"bad sample kind must be one of {list(BAD_KINDS)}, got {kind!r}")
            self.bad[index] = kind
        if bug_after is not None and (isinstance(bug_after, bool) or not isinstance(bug_after, int) or bug_after < 0):
            raise ValueError(f"bug_after must be None or an integer >= 0, got {bug_after!r}")
        if isinstance(bad_tokens, bool) or not isinstance(bad_tokens, int) or bad_tokens < 1:
            raise ValueError(f"bad_tokens must be an integer >= 1, got {bad_tokens!r}")
        self.bug_after = bug_after
        self.bad_tokens = bad_tokens
        #: How many samples were served (the planted bug counts them), and how often the loader served each index.
        self.calls = 0
        self.served: Dict[int, int] = {}
        self.data_infos: List[Dict[str, Any]] = [{"sample_idx": sample_token(i)} for i in range(n)]
        self.data_list = self.data_infos

    def __getitem__(self, i: int) -> dict:
        self.calls += 1
        if not guard_replay():  # the guard's replays of rebuilt batches train nothing
            self.served[int(i)] = self.served.get(int(i), 0) + 1
        sample = dict(self.samples[i])
        kind = self.bad.get(int(i))
        if kind is not None:
            x = sample["inputs"].clone()
            x[: self.bad_tokens] = _BAD_VALUES[kind]
            sample["inputs"] = x
        if self.bug_after is not None and self.calls > self.bug_after:
            sample["inputs"] = wrong_normalize(sample["inputs"])
        return sample


class ScaledDotProduct(nn.Module):
    """The math of a fused attention kernel: ``softmax(q k^T * logit_gain / sqrt(dim)) v`` over ``(B*heads, L, dim)``.

    Under fp16 autocast ``bmm`` gives fp16 logits: scaled past 65504 they become Inf and the softmax NaN, from
    finite fp16 inputs; in fp32 they stay finite and the output, a convex mix of the values, stays within fp16
    range. ``dropout_p`` is a float, as flash attention's is (the dropout remedy finds it by that name).

    Args:
        logit_gain: the factor on the ``1/sqrt(dim)``-scaled logits.
        dropout_p: the attention weights' dropout. Defaults to 0.0.
    """

    def __init__(self, logit_gain: float, dropout_p: float = 0.0) -> None:
        super().__init__()
        self.logit_gain = float(logit_gain)
        self.dropout_p = float(dropout_p)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        logits = torch.bmm(q, k.transpose(1, 2)) * (self.logit_gain / math.sqrt(q.shape[-1]))
        weights = F.dropout(logits.softmax(-1), self.dropout_p, self.training)
        return torch.bmm(weights.to(v.dtype), v)


class OverflowAttention(PETRMultiheadAttention):
    """PETR's attention with its core computed by a :class:`ScaledDotProduct` whose fp16 logits overflow.

    Laid out as PETR's flash-attention variant: the input projection, a fused kernel module (``inner_attn``), the
    output projection (``attn.out_proj``), then ``proj_drop`` / ``dropout_layer`` and the residual. It stands in for
    a fused attention whose fp16 logits pass 65504 (PETR's flash attention over its 3D position embedding).

    Args:
        logit_gain: the factor on the ``1/sqrt(head_dim)``-scaled logits. Defaults to 1e5.
        fused: compute the core in ``inner_attn`` (a module of its own, fp16 output under autocast). False computes
            it inline in this forward, as attentions written with functional calls do (BEVFormer's deformable
            attention before its ``output_proj``): the first non-finite value a module hook sees is then the output
            projection's input. Defaults to True.
        **kwargs: :class:`~.petr_like.PETRMultiheadAttention`'s arguments.
    """

    def __init__(self, *args: Any, logit_gain: float = 1e5, fused: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fused = bool(fused)
        self.inner_attn = ScaledDotProduct(logit_gain, self.attn.dropout)

    def forward(self, query: Tensor, key: Opt = None, value: Opt = None, identity: Opt = None, query_pos: Opt = None,
                key_pos: Opt = None, attn_mask: Opt = None, key_padding_mask: Opt = None, **kwargs: Any) -> Tensor:
        key = query if key is None else key
        value = key if value is None else value
        identity = query if identity is None else identity
        if query_pos is not None:
            query = query + query_pos
        if key_pos is not None:
            key = key + key_pos
        attn = self.attn
        w_q, w_k, w_v = attn.in_proj_weight.chunk(3)
        b_q, b_k, b_v = attn.in_proj_bias.chunk(3)
        length, batch, embed = query.shape
        heads = attn.num_heads
        dim = embed // heads

        def split(x: Tensor) -> Tensor:  # (L, B, E) -> (B * heads, L, dim)
            return x.reshape(x.shape[0], batch * heads, dim).transpose(0, 1)

        q, k, v = split(F.linear(query, w_q, b_q)), split(F.linear(key, w_k, b_k)), split(F.linear(value, w_v, b_v))
        # Not fused: the same math as plain calls inside this forward, no module boundary around it.
        out = self.inner_attn(q, k, v) if self.fused else ScaledDotProduct.forward(self.inner_attn, q, k, v)
        out = out.transpose(0, 1).reshape(length, batch, embed)
        return identity + self.dropout_layer(self.proj_drop(attn.out_proj(out)))


def _register() -> None:
    if ATTENTION.get(OverflowAttention.__name__) is None:
        ATTENTION.register_module(module=OverflowAttention)


_register()


def overflow_layer_cfg(logit_gain: float = 1e5, fused: bool = True) -> dict:
    """The seed document's decoder layer (``SEED_LAYER_CFG``), its cross attention (``attentions.1``) an
    :class:`OverflowAttention`.

    Args:
        logit_gain: :class:`OverflowAttention`'s ``logit_gain``. Defaults to 1e5 (every batch of
            :func:`~.petr_like.make_batch` overflows fp16; 1e4 none, measured on ``num_layers=1, num_query=16``).
        fused: :class:`OverflowAttention`'s ``fused``. Defaults to True.
    """
    cfg = copy.deepcopy(SEED_LAYER_CFG)
    cfg["attn_cfgs"][1] = dict(cfg["attn_cfgs"][1], type="OverflowAttention", logit_gain=float(logit_gain),
                               fused=bool(fused))
    return cfg


class MemoryHead(PETRShapedHead):
    """A StreamPETR-style head: the decoder's queries are propagated from a memory of past frames' outputs.

    ``memory_embedding`` (StreamPETR's name) is a plain tensor attribute, outside ``state_dict()``, updated by every
    training forward as ``0.9 * memory + 0.1 * mean(decoder output)`` before PETR's ``nan_to_num``: one non-finite
    frame leaves NaN in it for good (``0.9 * NaN`` is NaN), as StreamPETR's ``memory * prev_exists`` does.
    ``reset_memory()`` clears it, as StreamPETR's head does at a new scene.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.memory_embedding: Optional[Tensor] = None

    def reset_memory(self) -> None:
        """Forgets the memory of past frames."""
        self.memory_embedding = None

    def forward(self, memory: Tensor) -> Dict[str, Tensor]:
        b = memory.shape[0]
        q = self.query_embedding.weight.unsqueeze(1).expand(-1, b, -1)
        if self.memory_embedding is not None:
            q = q + self.memory_embedding.to(q.dtype)
        mem = memory.transpose(0, 1)
        out = torch.zeros_like(q)
        for layer in self.layers:
            out = layer(out, key=mem, value=mem, query_pos=q)
        if self.training:
            frame = out.detach().float().mean((0, 1))
            self.memory_embedding = frame if self.memory_embedding is None else (
                0.9 * self.memory_embedding + 0.1 * frame)
        out = torch.nan_to_num(out)  # PETR: outs_dec = torch.nan_to_num(outs_dec)
        return {"cls": self.cls_branch(out).transpose(0, 1), "reg": self.reg_branch(out).transpose(0, 1)}


def build_memory_net(num_layers: int = 2, num_query: int = 32, layer_cfg: Optional[dict] = None,
                     in_dim: int = 64) -> PETRLike:
    """The PETR-shaped model with a :class:`MemoryHead` as ``pts_bbox_head``.

    Args:
        num_layers: decoder layers. Defaults to 2.
        num_query: queries. Defaults to 32.
        layer_cfg: the decoder layer config. Defaults to None (the seed document's, :data:`~.petr_like.SEED_LAYER_CFG`).
        in_dim: the camera feature width. Defaults to 64.
    """
    net = PETRLike(in_dim=in_dim, num_layers=num_layers, num_query=num_query, layer_cfg=layer_cfg)
    net.pts_bbox_head = MemoryHead(num_layers, num_query, layer_cfg=layer_cfg)
    return net


class DropsSampleIds:
    """Mixin for a model wrapper whose ``forward`` rejects the sample id keys (:data:`ID_KEYS` and their aliases)
    that a collated batch carries: ``class Model(DropsSampleIds, PETRLikeModel)``. The ids only name samples for
    the quarantine (which reads them from the batch); the model never needs them."""

    _DROPPED = ID_KEYS + ("idx", "dataset_index")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        for key in self._DROPPED:
            kwargs.pop(key, None)
        return super().forward(*args, **kwargs)  # type: ignore[misc]


class ScaleReadAsZero(nn.Module):
    """A planted bug in the model's code: its features are divided by a scale read as 0 from the ``after``-th
    training forward on, so every value is then +/-Inf or NaN whatever the batch or the weights (a code bug, not
    data: a batch known to be good breaks as well).

    Args:
        after: training forwards served correctly first.
    """

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = int(after)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.calls += 1
        scale = x.new_tensor(0.0 if self.calls > self.after else 1.0)
        return x / scale


def plant_scale_bug(net: PETRLike, after: int) -> PETRLike:
    """``net``'s backbone output goes through :class:`ScaleReadAsZero` (in place; returns ``net``)."""
    net.img_backbone = nn.Sequential(net.img_backbone, ScaleReadAsZero(after))
    return net


def poison_pixels(sample: Mapping[str, Any], rows: int = 4, value: float = math.nan) -> Dict[str, Any]:
    """A copy of a :func:`~.petr_like.make_batch` sample whose first ``rows`` camera feature rows are ``value`` (NaN: a
    corrupt image as it decodes; ``math.inf``: one that decodes to Inf); nothing else names it."""
    x = sample["inputs"].clone()
    x[:rows] = value
    return dict(sample, inputs=x)


def poison_box(sample: Mapping[str, Any]) -> Dict[str, Any]:
    """A copy of a :func:`~.petr_like.make_batch` sample whose first box target is NaN (a degenerate annotation): the
    loss stays finite (PETR's ``nan_to_num``) while the gradients turn NaN, and no BatchNorm statistic sees it."""
    reg = sample["reg_t"].clone()
    reg[0] = math.nan
    return dict(sample, reg_t=reg)


def nan_loss_on_bad_boxes(net: PETRLike) -> PETRLike:
    """Makes ``net``'s losses (and so its gradients) NaN on a batch holding a NaN box, as a box loss that the head does
    not wrap in ``nan_to_num`` does on a degenerate annotation; the forward itself is untouched. Returns ``net``."""
    losses = net.losses

    def checked(inputs: Tensor, cls_t: Tensor, reg_t: Tensor) -> Dict[str, Tensor]:
        out = losses(inputs, cls_t, torch.nan_to_num(reg_t))
        if not bool(torch.isfinite(reg_t).all()):
            out = {k: v * math.nan for k, v in out.items()}
        return out

    net.losses = checked
    return net

