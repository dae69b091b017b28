"""The model zoo: five small fp16 models unlike the demo, faults planted in their data or weights, and one
hand-written loop that trains each of them as a reference, unguarded, or guarded (benchmarks/zoo.py, tests/zoo).

The models (:data:`MODELS`), each a :class:`ModelSpec`; each carries one fp16 hazard a real model of its kind has:

- ``causal_ts``: a causal pre-norm transformer forecaster of a positive series, forecast in log space (``exp`` of
  the head's output in fp16); its causal mask (``-inf`` above the diagonal) is a registered buffer, as time-series
  code registers it;
- ``detr``: a DETR-like decoder: learned queries over projected patch features, the padded patches masked with an
  additive float mask of ``-inf``, pre-norm layers and no final LayerNorm, DETR's box MLP with box sizes as
  anchor-based heads predict them (pixels, ``anchor * exp(delta)``), L1 loss; trained as DETR is, with no warm-up;
- ``cnn_bn``: Conv-BatchNorm-ReLU twice, pooling and a linear head over raw images standardized inside the model
  (cross-entropy with label smoothing), trained with SGD and momentum as CNNs are: a conv's fp16 output before its
  BatchNorm grows with the conv's weights;
- ``temporal``: a StreamPETR-like memory kept as a plain tensor attribute, carried (detached) across iterations,
  cleared by ``reset_memory()``; a NaN that reaches it stays there (``memory * prev_exists``);
- ``rnn``: a GRU regressing positive levels in a 16-bit sensor's raw counts (``counts * exp(z)``, whose range is
  fp16's).

The faults (:data:`SCENARIOS`): ``none``; ``too_high_lr`` (the model's too-high peak learning rate);
``corrupt_sample`` (one training sample's inputs half NaN, served every epoch); ``bright_sample`` (one sample's
inputs times 1e4: finite, finite in fp16, but overflowing an fp16 forward of the model); ``nan_weights`` (NaN written
into one weight once, mid-run: the one direct write; everything else is data or model behaviour).

The loop (:func:`run`): CPU fp16 autocast, a dynamic ``GradScaler`` (init scale 2**16, growth interval 2000: it
never grows within a run, so each skipped step halves it for good), AdamW (weight decay 0.01; ``cnn_bn``: SGD,
momentum 0.9), a linear warm-up (``detr``: none) then cosine schedule (``LambdaLR``, following the iteration counter
back on a rollback), ``max_norm=35`` through ``TorchLoopIO.clip`` (as PETR configs clip), and for the guarded variant
the driver calls of ``tests/contract/families.py``'s ``TorchLoopRun.train``. Pure torch: it runs in every environment
the package supports.

The learning rates were chosen by the runs alone (docs/results/zoo_lr_tuning_cpu.json, the comment above
``_SPECS``): each stable rate trains well and finite on seeds 0-19 under the native and the default CPU kernels, and
each too-high rate (5-8x the stable one) leaves the unguarded run lost on every seed 0-19 under both kernel sets.
How ``detr`` is lost: with no warm-up, AdamW's first step moves every weight by the full rate, which moves the box
MLP's size deltas (its inputs the decoder's unnormalized residual stream) by tens and the anchor's ``exp`` past
fp16's range on every sample from the second step on. How ``cnn_bn`` is lost: SGD grows the convs' weights (a conv
before a BatchNorm is scale-invariant: its gradient is orthogonal to its weights, so each step lengthens them) until
the second conv's fp16 output overflows, and the overflowed batches also write non-finite values into the
BatchNorm's running statistics.
"""
import copy
import math
import os
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from ..adapters.driver import GuardDriver
from ..adapters.torch_loop import TorchLoopIO
from ..core.config import GuardConfig
from ..core.errors import NanGuardError
from ..core.flags import make_grad_scaler
from ..core.fp16 import FP16_MAX
from ..core.records import read_incidents
from .fetches import guard_replay

__all__ = [
    "MODELS",
    "SCENARIOS",
    "DATA_SCENARIOS",
    "VARIANTS",
    "BRIGHT_FACTOR",
    "FP16_MAX",
    "ZooDataset",
    "ModelSpec",
    "ZooResult",
    "spec",
    "specs",
    "guard_settings",
    "planted_index",
    "plant_data",
    "fp16_overflows",
    "evaluate",
    "run",
    "result_dict",
    "right_class",
    "acted",
    "OBSERVED",
]

Batch = Dict[str, Tensor]
Samples = List[Batch]

MODELS = ("causal_ts", "detr", "cnn_bn", "temporal", "rnn")
SCENARIOS = ("none", "too_high_lr", "corrupt_sample", "bright_sample", "nan_weights")
#: The scenarios that plant their fault in one training sample (:func:`planted_index`).
DATA_SCENARIOS = ("corrupt_sample", "bright_sample")
#: ``reshuffled`` is the reference trained on another order of the same data (:func:`_order`): how far a run that
#: differs from the reference in nothing but the order its batches come in lands from it. A rollback replays
#: iterations on batches the loader moved on to, so no recovery is closer to the reference than this by design.
#: ``without`` is the reference without the training sample a data scenario plants its fault in
#: (:func:`planted_index`): what a run that quarantined the sample before its first serving trains on. A guarded run
#: quarantines it at its first serving at best, so no recovery of a data fault is closer to the reference than this.
VARIANTS = ("reference", "unguarded", "guarded", "reshuffled", "without")
#: A reshuffled run's loader draws its order from this plus the seed.
RESHUFFLE_SEED = 10_000

#: A bright sample: its inputs times this. The data stay within +-6.5, so the sample stays below fp16's largest
#: finite value (65504) as it is cast; what overflows is a layer's output.
BRIGHT_FACTOR = 1e4
#: The data's bound: every input value lies in [-LIMIT, LIMIT], so LIMIT * BRIGHT_FACTOR < FP16_MAX.
LIMIT = 6.4


#: The CNN's in-model standardization of its raw images (values in [0, LIMIT]).
CNN_MEAN = 3.2
CNN_STD = 0.8
#: The GRU model's raw sensor counts per normalized unit: it predicts levels as ``RNN_COUNTS * exp(z)``.
RNN_COUNTS = 10000.0
#: The DETR-like model's image size and anchor size, in pixels: its box sizes are ``ANCHOR_PX * exp(delta)``. The
#: objects are 40-400 pixels wide; the anchor is a small one (most objects are larger).
IMAGE_PX = 800.0
ANCHOR_PX = 100.0


def autocast() -> ContextManager[Any]:
    """The training precision of every zoo run: CPU fp16 autocast."""
    return torch.autocast("cpu", dtype=torch.float16)


# ---------------------------------------------------------------------------------------------------------- data
class ZooDataset(Dataset):
    """A map-style dataset over a list of sample dicts, counting what the loader served.

    ``served`` counts each index's fetches by training; the guard's own replays of batches it rebuilds from dataset
    indices (the window trace, the row isolation) count in ``replayed`` instead (:func:`~.fetches.guard_replay`).
    """

    def __init__(self, samples: Samples) -> None:
        self.samples = samples
        self.served: Counter = Counter()
        self.replayed: Counter = Counter()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Batch:
        (self.replayed if guard_replay() else self.served)[int(i)] += 1
        return self.samples[i]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bounded(x: Tensor) -> Tensor:
    return x.clamp(-LIMIT, LIMIT)


def mlp(d_in: int, hidden: int, d_out: int, layers: int = 3, act: Callable[[], nn.Module] = nn.ReLU) -> nn.Sequential:
    """DETR's box head ``MLP``: ``layers`` linear layers with ``act`` (ReLU) between them and no normalization."""
    dims = [d_in] + [hidden] * (layers - 1) + [d_out]
    mods: List[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(dims[i], dims[i + 1]))
        if i < layers - 1:
            mods.append(act())
    return nn.Sequential(*mods)


def _series(n: int, length: int, features: int, g: torch.Generator) -> Tensor:
    """``n`` multichannel series: a level, two sinusoids per channel and a little noise, within +-LIMIT."""
    t = torch.arange(length, dtype=torch.float32).view(1, length, 1)
    level = torch.rand(n, 1, features, generator=g) * 4 - 2
    amp = 1 + 2 * torch.rand(n, 2, features, generator=g)
    freq = 0.2 + 0.6 * torch.rand(n, 2, features, generator=g)
    phase = 2 * math.pi * torch.rand(n, 2, features, generator=g)
    waves = (amp[:, :1] * torch.sin(freq[:, :1] * t + phase[:, :1])
             + amp[:, 1:] * torch.sin(freq[:, 1:] * t + phase[:, 1:]))
    noise = 0.1 * torch.randn(n, length, features, generator=g)
    return _bounded(level + waves + noise)


# ---------------------------------------------------------------------------------------------- a. causal_ts
class CausalForecaster(nn.Module):
    """A causal transformer forecaster of a positive series: each step predicts the next one, in log space (the
    head's output exponentiated, in fp16 under autocast). The step embedding is scaled by ``sqrt(d)`` (the
    Transformer's embedding scale), then two pre-norm encoder layers; the causal mask is a registered buffer holding
    ``-inf`` above the diagonal (non-finite by design, and in ``state_dict()``)."""

    def __init__(self, features: int = 4, length: int = 16, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(features, d)
        self.pos = nn.Parameter(0.1 * torch.randn(length, d))
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = mlp(d, 256, features)
        self.register_buffer("mask", torch.triu(torch.full((length, length), float("-inf")), 1))

    def forward(self, x: Tensor) -> Tensor:
        h = self.encoder(self.embed(x) * math.sqrt(self.pos.shape[1]) + self.pos, mask=self.mask)
        return self.head(self.norm(h)).exp()  # a positive quantity, forecast in log space


def _causal_ts_data(n: int, seed: int) -> Samples:
    """Positive series of 4 channels, 17 steps (a level, two waves, noise): ``x`` the first 16, ``y`` the last 16."""
    s = (_series(n, 17, 4, _gen(seed)) / 2 + 3).clamp(0.05, LIMIT)
    return [{"x": s[i, :-1].clone(), "y": s[i, 1:].clone()} for i in range(n)]


def _causal_ts_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Squared error summed over the forecast horizon, averaged over features and samples."""
    return (model(batch["x"]).float() - batch["y"]).pow(2).sum(1).mean()


# --------------------------------------------------------------------------------------------------- b. detr
class DetrLike(nn.Module):
    """A DETR-like decoder: ``Q`` learned queries (``nn.Embedding``) attend through two pre-norm decoder layers
    (``norm_first=True``) to a projection of the patch features (scaled by ``sqrt(d)``, plus a learned position
    embedding); padded patches are masked by an additive float ``memory_key_padding_mask`` (``-inf``). The decoder is
    ``nn.TransformerDecoder`` as built by default, ``norm=None``: no final LayerNorm (DETR adds one), so the box head
    reads the raw residual stream. DETR's 3-layer box MLP, 256 wide as DETR's, gives each query a box: its centre as
    is, its size in pixels as an anchor-based head predicts it (``ANCHOR_PX * exp(delta)``, in fp16), normalized by
    the image size for the loss."""

    def __init__(self, features: int = 8, tokens: int = 12, queries: int = 4, d: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(features, d)
        self.pos = nn.Parameter(0.1 * torch.randn(tokens, d))
        self.queries = nn.Embedding(queries, d)
        layer = nn.TransformerDecoderLayer(d, 4, 64, dropout=0.1, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, 2)
        self.box = mlp(d, 256, 4)

    def forward(self, feats: Tensor, pad: Tensor) -> Tensor:
        memory = self.proj(feats) * math.sqrt(self.pos.shape[1]) + self.pos
        mask = torch.zeros(pad.shape, dtype=memory.dtype).masked_fill(pad, float("-inf"))
        q = self.queries.weight.unsqueeze(0).expand(feats.shape[0], -1, -1)
        out = self.box(self.decoder(q, memory, memory_key_padding_mask=mask))
        # Sizes in pixels from log-space deltas on an anchor, as anchor heads predict them; normalized for the loss.
        return torch.cat([out[..., :2], ANCHOR_PX * out[..., 2:].exp() / IMAGE_PX], -1)


def _detr_data(n: int, seed: int, tokens: int = 12, queries: int = 4) -> Samples:
    """Each sample: ``tokens`` patches of 8 features, the last 2-4 of them padding (zeros, masked). A patch's first
    four features are a box (scaled), the next ``queries`` say which kind of object it is: one valid patch per kind
    (a strong one-hot), the other valid patches background (weak noise). Query ``q`` is to find the box of the
    kind-``q`` object."""
    g = _gen(seed)
    out = []
    for _ in range(n):
        valid = tokens - int(torch.randint(2, 5, (1,), generator=g))
        boxes = torch.cat([torch.rand(tokens, 2, generator=g), 0.05 + 0.45 * torch.rand(tokens, 2, generator=g)], 1)
        objects = torch.randperm(valid, generator=g)[:queries]
        kinds = 0.3 * torch.randn(tokens, queries, generator=g)
        kinds[objects, torch.arange(queries)] = 2.0
        feats = torch.cat([4 * boxes[:, :2] - 2, 8 * boxes[:, 2:] - 2, kinds], 1)
        pad = torch.arange(tokens) >= valid
        feats[pad] = 0.0
        out.append({"feats": _bounded(feats), "pad": pad, "boxes": boxes[objects]})
    return out


def _detr_loss(model: nn.Module, batch: Batch) -> Tensor:
    """L1 between each query's box and its target (Q boxes per sample, in query order: no matching needed)."""
    return F.l1_loss(model(batch["feats"], batch["pad"]).float(), batch["boxes"])


# ------------------------------------------------------------------------------------------------- c. cnn_bn
class ConvBN(nn.Module):
    """Conv-BatchNorm-ReLU twice (16, then 64 channels), max then average pooling, a linear head. The raw images are
    standardized inside the model (fixed mean and std buffers, as an in-model data preprocessor does), in fp32 before
    the first conv, whose fp16 input cast is where a too-bright image overflows. Trained with SGD (momentum 0.9, no
    weight decay), as CNNs with BatchNorm are: a conv before a BatchNorm is scale-invariant, so a too-high rate grows
    its weights' norm step by step, and with it the conv's fp16 output before the BatchNorm normalizes it."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(CNN_MEAN))
        self.register_buffer("std", torch.tensor(CNN_STD))
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(64, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features((x - self.mean) / self.std).flatten(1))


def _cnn_data(n: int, seed: int, classes: int = 4) -> Samples:
    """Raw images of 3x16x16 in [0, LIMIT]: class ``k`` is a grating at angle ``k * 45`` degrees (random phase,
    contrast and colour) on a mid-grey level, under noise."""
    g = _gen(seed)
    yy, xx = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    out = []
    for _ in range(n):
        k = int(torch.randint(classes, (1,), generator=g))
        angle = math.pi * k / classes
        phase = 2 * math.pi * float(torch.rand(1, generator=g))
        wave = torch.sin(0.8 * (math.cos(angle) * xx + math.sin(angle) * yy) + phase)
        colour = 1.0 + 1.5 * torch.rand(3, 1, 1, generator=g)
        img = CNN_MEAN + colour * wave + 0.5 * torch.randn(3, 16, 16, generator=g)
        out.append({"x": img.clamp(0.0, LIMIT), "y": torch.tensor(k)})
    return out


def _cnn_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Cross-entropy over the 4 classes with label smoothing 0.1 (as torchvision's newer classification recipes
    train); its floor, a perfect fit, is the smoothed targets' entropy, 0.349."""
    return F.cross_entropy(model(batch["x"]).float(), batch["y"], label_smoothing=0.1)


# ----------------------------------------------------------------------------------------------- d. temporal
class TemporalMemory(nn.Module):
    """A StreamPETR-like temporal model: the frame's tokens (scaled by ``sqrt(d)``) plus a projection of a memory of
    past frames, one post-norm encoder layer, pooled, regressed by an MLP. The memory is a plain tensor attribute
    (not a buffer: outside ``state_dict()``), carried detached across iterations as ``0.8 * memory * prev_exists +
    0.2 * pooled``: a NaN that reaches it stays there, as in StreamPETR. ``reset_memory()`` clears it (the guard
    calls it after a rollback)."""

    def __init__(self, features: int = 6, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(features, d)
        self.mem_proj = nn.Linear(d, d)
        self.layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1, batch_first=True)
        self.head = mlp(2 * d, 256, 2)
        self.memory: Optional[Tensor] = None

    def reset_memory(self) -> None:
        """Forgets the past frames (StreamPETR: a new scene)."""
        self.memory = None

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.embed(x) * math.sqrt(self.embed.out_features)
        prev_exists = 0.0 if self.memory is None else 1.0
        memory = torch.zeros(tokens.shape[-1]) if self.memory is None else self.memory
        context = self.mem_proj(memory)
        h = self.layer(tokens + context)
        pooled = h.mean(1)
        self.memory = (0.8 * memory * prev_exists + 0.2 * pooled.detach().float().mean(0)).detach()
        return self.head(torch.cat([pooled, context.expand_as(pooled)], 1))


def _temporal_data(n: int, seed: int, tokens: int = 8, features: int = 6) -> Samples:
    """Frames of a few scenes, in order: each frame's tokens are the scene's context plus the frame's own signal;
    the targets are the frame's signal mean and the scene's context mean (the memory helps with the latter)."""
    g = _gen(seed)
    out = []
    scene = torch.zeros(features)
    for i in range(n):
        if i % 8 == 0:  # a new scene every 8 frames
            scene = 3 * torch.rand(features, generator=g) - 1.5
        signal = 1.5 * torch.randn(tokens, features, generator=g)
        out.append({"x": _bounded(scene + signal), "y": torch.stack([signal.mean(), scene.mean()])})
    return out


def _temporal_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Squared error summed over the targets, averaged over samples."""
    return (model(batch["x"]).float() - batch["y"]).pow(2).sum(1).mean()


# ----------------------------------------------------------------------------------------------------- e. rnn
class GRURegressor(nn.Module):
    """A GRU sequence regressor: a linear embedding per step (scaled by ``sqrt(d)``, then a LayerNorm, as BART embeds),
    one GRU layer (fp32 under CPU autocast), a GELU MLP on the last state. It predicts positive levels in a 16-bit
    sensor's raw counts, ``RNN_COUNTS * exp(z)`` in fp16 (a level past 6.55 units is past 65504 counts), normalized
    for the loss."""

    def __init__(self, features: int = 4, d: int = 32, outputs: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(features, d)
        self.norm = nn.LayerNorm(d)
        self.gru = nn.GRU(d, d, batch_first=True)
        self.head = mlp(d, 64, outputs, act=nn.GELU)

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.gru(self.norm(self.embed(x) * math.sqrt(self.embed.out_features)))
        # The counts first (in fp16, as the sensor's units), then normalized: the order a raw-unit head computes.
        return RNN_COUNTS * self.head(h[:, -1]).exp() / RNN_COUNTS


def _rnn_data(n: int, seed: int, length: int = 20, features: int = 4) -> Samples:
    """Series of ``features`` channels oscillating around a positive level each, under noise; the targets are the
    levels."""
    g = _gen(seed)
    t = torch.arange(length, dtype=torch.float32).view(length, 1)
    out = []
    for _ in range(n):
        level = 0.5 + 2.5 * torch.rand(features, generator=g)
        freq = 0.3 + 1.5 * torch.rand(1, features, generator=g)
        phase = 2 * math.pi * torch.rand(1, features, generator=g)
        amp = 0.5 + 1.0 * torch.rand(1, features, generator=g)
        x = level + amp * torch.sin(freq * t + phase) + 0.3 * torch.randn(length, features, generator=g)
        out.append({"x": _bounded(x), "y": level})
    return out


def _rnn_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Squared error summed over the channels, averaged over samples."""
    return (model(batch["x"]).float() - batch["y"]).pow(2).sum(1).mean()


# ----------------------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class ModelSpec:
    """One zoo model: how to build it, its data, its loss and its training settings.

    Attributes:
        name: the model's name (:data:`MODELS`).
        model_cls: the model class; built with its defaults under ``torch.manual_seed(seed)``.
        data_fn: ``data_fn(n, seed)``: ``n`` samples (dicts of tensors), the same for a seed.
        forward: ``forward(model, batch) -> loss``: the training loss (and the held-out one).
        stable_lr: the peak learning rate it trains well at (the reference's).
        high_lr: a peak learning rate it does not tolerate under fp16 (2-8x ``stable_lr``).
        input_key: the sample's input tensor (where a corrupt or bright sample is planted).
        nan_param: the parameter ``nan_weights`` writes NaN into.
        shuffle: a seeded shuffle each epoch (False: in order, as a temporal model trains on a scene's frames).
        batch_size: samples per iteration.
        train_size: training samples.
        heldout_size: held-out samples.
        iters: training iterations.
        warmup: linear warm-up iterations (from 0.1 of the peak), then cosine to 0.1 of the peak (0: cosine from the
            peak at the first step).
        optimizer: ``optimizer(params, lr)``; None: AdamW, weight decay 0.01.
    """

    name: str
    model_cls: Callable[[], nn.Module]
    data_fn: Callable[[int, int], Samples]
    forward: Callable[[nn.Module, Batch], Tensor]
    stable_lr: float
    high_lr: float
    input_key: str = "x"
    nan_param: str = "head.weight"
    shuffle: bool = True
    batch_size: int = 4
    train_size: int = 24
    heldout_size: int = 32
    iters: int = 120
    warmup: int = 10
    optimizer: Optional[Callable[[Any, float], torch.optim.Optimizer]] = None

    def build(self, seed: int) -> nn.Module:
        """The model, its weights drawn from ``seed``."""
        torch.manual_seed(seed)
        return self.model_cls()

    def datasets(self, seed: int) -> Tuple[Samples, Samples]:
        """(training samples, held-out samples) for ``seed``, drawn apart."""
        return self.data_fn(self.train_size, 1000 + seed), self.data_fn(self.heldout_size, 5000 + seed)


def _adamw(params: Any, lr: float) -> torch.optim.Optimizer:
    """The zoo's default optimizer: AdamW, weight decay 0.01."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def _sgd(params: Any, lr: float) -> torch.optim.Optimizer:
    """SGD with momentum 0.9 and no weight decay (``cnn_bn``), as a CNN with BatchNorm is trained."""
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


# Peak learning rates, measured on seeds 0-19 under the native (AVX-512) and the default CPU kernels (reference:
# held-out median [min, max] native; too high: unguarded runs lost; docs/results/zoo_lr_tuning_cpu.json):
#   causal_ts 1e-2:    5.06 [4.48, 6.56], 0/20 lost;  5e-2 (5x): 20/20 lost, both kernel sets (a stall or 22+ halvings)
#   detr      4e-3:    0.113 [0.071, 0.148];          3.2e-2 (8x): 20/20 lost, both kernel sets (a stall from step 2)
#   cnn_bn    1.25:    0.417 [0.378, 0.464];          10 (8x): 20/20 lost, both kernel sets (92+ halvings, the
#                      (the loss's floor: 0.349)        BatchNorm's running statistics non-finite)
#   temporal  3.75e-2: 0.175 [0.081, 0.569];          3e-1 (8x): 20/20 lost, both kernel sets
#   rnn       1.25e-2: 0.745 [0.487, 1.208];          1e-1 (8x): 20/20 lost, both kernel sets (stalls by iteration 19)
_SPECS = {
    "causal_ts": ModelSpec("causal_ts", CausalForecaster, _causal_ts_data, _causal_ts_loss, 1e-2, 5e-2,
                           nan_param="encoder.layers.1.linear1.weight"),
    "detr": ModelSpec("detr", DetrLike, _detr_data, _detr_loss, 4e-3, 3.2e-2, input_key="feats",
                      nan_param="decoder.layers.0.linear1.weight", warmup=0),
    "cnn_bn": ModelSpec("cnn_bn", ConvBN, _cnn_data, _cnn_loss, 1.25, 10.0, nan_param="features.4.weight",
                        batch_size=8, train_size=48, optimizer=_sgd),
    "temporal": ModelSpec("temporal", TemporalMemory, _temporal_data, _temporal_loss, 3.75e-2, 3e-1,
                          nan_param="layer.linear1.weight", shuffle=False),
    "rnn": ModelSpec("rnn", GRURegressor, _rnn_data, _rnn_loss, 1.25e-2, 1e-1, nan_param="gru.weight_hh_l0"),
}


def spec(name: str) -> ModelSpec:
    """The zoo model ``name``.

    Raises:
        ValueError: no such model.
    """
    if name not in _SPECS:
        raise ValueError(f"unknown zoo model {name!r}; choose from {list(MODELS)}")
    return _SPECS[name]


def specs() -> List[ModelSpec]:
    """Every zoo model, in :data:`MODELS` order."""
    return [_SPECS[m] for m in MODELS]


# ------------------------------------------------------------------------------------------------- the faults
def planted_index(model: str, seed: int) -> int:
    """The training sample a data fault is planted in, drawn from ``seed`` (the same for every variant)."""
    return int(torch.randint(spec(model).train_size, (1,), generator=_gen(7919 + seed)))


def plant_data(samples: Samples, scenario: str, index: int, key: str) -> Samples:
    """A copy of ``samples`` with the scenario's data fault in sample ``index``'s ``key`` tensor: NaN in the first
    half of its values (``corrupt_sample``: a corrupt record), or all of them times :data:`BRIGHT_FACTOR`
    (``bright_sample``). Other scenarios: the samples as they are."""
    if scenario not in DATA_SCENARIOS:
        return list(samples)
    out = list(samples)
    x = out[index][key].clone()
    if scenario == "corrupt_sample":
        x.view(-1)[: x.numel() // 2] = float("nan")
    else:
        x = x * BRIGHT_FACTOR
    out[index] = dict(out[index], **{key: x})
    return out


def fp16_overflows(model: nn.Module, forward: Callable[[nn.Module, Batch], Tensor], batch: Batch) -> List[str]:
    """The modules whose fp16 output is non-finite when ``batch`` runs forward under the zoo's autocast, on a copy of
    ``model`` (its running statistics and memory untouched); empty where nothing overflows."""
    probe = copy.deepcopy(model)
    bad: List[str] = []

    def hook(name: str) -> Callable[..., None]:
        def check(_: nn.Module, __: Any, out: Any) -> None:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            if any(isinstance(o, Tensor) and o.dtype == torch.float16 and not bool(torch.isfinite(o).all())
                   for o in outs):
                bad.append(name)
        return check

    handles = [m.register_forward_hook(hook(n)) for n, m in probe.named_modules() if n]
    try:
        with torch.no_grad(), autocast():
            forward(probe, batch)
    finally:
        for h in handles:
            h.remove()
    return bad


def _plant_nan_weight(model: nn.Module, name: str) -> None:
    """The one direct write of the zoo: NaN into one element of parameter ``name``."""
    with torch.no_grad():
        dict(model.named_parameters())[name].view(-1)[0] = float("nan")


# ------------------------------------------------------------------------------------------------- evaluation
def _memories(model: nn.Module) -> List[Tensor]:
    """The temporal state kept outside ``state_dict()`` (a ``memory`` tensor attribute)."""
    return [m.memory for m in model.modules() if isinstance(getattr(m, "memory", None), Tensor)]


def _reset_memory(model: nn.Module) -> None:
    for m in model.modules():
        if callable(getattr(m, "reset_memory", None)):
            m.reset_memory()


def evaluate(model_spec: ModelSpec, model: nn.Module, heldout: Samples) -> Optional[float]:
    """The mean held-out loss in eval mode and fp32 (a temporal memory started afresh and carried through the
    held-out frames in order); None where it is not finite."""
    was_training = model.training
    model.eval()
    _reset_memory(model)
    total, count = 0.0, 0
    bs = model_spec.batch_size
    with torch.no_grad():
        for i in range(0, len(heldout), bs):
            chunk = heldout[i:i + bs]
            total += float(model_spec.forward(model, default_collate(chunk))) * len(chunk)
            count += len(chunk)
    model.train(was_training)
    loss = total / max(count, 1)
    return loss if math.isfinite(loss) else None


def _finite_masks(model: nn.Module) -> Dict[str, Tensor]:
    return {n: torch.isfinite(b) for n, b in model.named_buffers() if b.is_floating_point()}


def _state_finite(model: nn.Module, optimizer: Any, start_masks: Dict[str, Tensor]) -> bool:
    """Parameters, optimizer state and memory finite; buffers finite wherever they were at the start (a causal
    mask holds ``-inf`` by design)."""
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        return False
    for name, b in model.named_buffers():
        if name in start_masks and not bool((torch.isfinite(b) | ~start_masks[name]).all()):
            return False
    for state in optimizer.state.values():
        if any(isinstance(v, Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())
               for v in state.values()):
            return False
    return all(bool(torch.isfinite(m).all()) for m in _memories(model))


# ------------------------------------------------------------------------------------------------- the result
@dataclass
class ZooResult:
    """What one zoo run did, as measured.

    Attributes:
        model, scenario, variant, seed: the run (a reference run plants nothing: its scenario is ``'none'``).
        lr: its peak learning rate.
        planted: the dataset index of a planted sample, or None.
        finished: the guard did not raise (every iteration ran).
        error_type, error_message: what it raised (``NanGuardGaveUp``, ``StructuralDivergence``,
            ``BadDataError``, ``NoHealthyStateError``; anything else is a crash, its traceback's tail appended).
        state_finite: weights, optimizer state and memory finite at the end (buffers where they were at the start).
        eval_loss: the held-out loss (eval mode, fp32), None where not finite.
        loss_scale: the dynamic loss scale at the end.
        skipped_steps: optimizer steps the loss scaler skipped (its scale fell).
        stalled_from: the iteration (1-based, as run) from which every step was skipped to the end; None where the
            last step was applied.
        lost: state not finite, no finite held-out loss, the guard raised, or the final loss scale below 1.
        incidents: each incident record, summarised (:func:`_summary`).
        causes: each classified record's ``cause.cause``, in order.
        quarantined: the dataset indices in the guard's quarantine at the end.
        iters_lost: iterations rolled back, over the run.
        served: per training index, how often training fetched it (the guard's replays apart).
        replayed: fetches by the guard's own replays.
        lr_factor: the guard's learning-rate factor at the end (1.0: unchanged).
        fp32_modules: modules the guard put in fp32.
        log: the guard's log lines (the last 40).
        wall_s: the run's wall time.
    """

    model: str
    scenario: str
    variant: str
    seed: int
    lr: float
    planted: Optional[int] = None
    finished: bool = True
    error_type: Optional[str] = None
    error_message: Optional[str] = None
    state_finite: bool = True
    eval_loss: Optional[float] = None
    loss_scale: float = 0.0
    skipped_steps: int = 0
    stalled_from: Optional[int] = None
    lost: bool = False
    incidents: List[Dict[str, Any]] = field(default_factory=list)
    causes: List[str] = field(default_factory=list)
    quarantined: List[int] = field(default_factory=list)
    iters_lost: int = 0
    served: List[int] = field(default_factory=list)
    replayed: int = 0
    lr_factor: float = 1.0
    fp32_modules: List[str] = field(default_factory=list)
    log: List[str] = field(default_factory=list)
    wall_s: float = 0.0


def result_dict(result: ZooResult) -> Dict[str, Any]:
    """JSON-ready: a plain dict (every value a JSON type; no NaN: a non-finite eval loss is None already)."""
    out = asdict(result)
    out["loss_scale"] = out["loss_scale"] if math.isfinite(out["loss_scale"]) else str(out["loss_scale"])
    return out


def _indices(samples: Any) -> List[int]:
    return sorted({int(s["index"]) for s in samples or () if isinstance(s, dict) and s.get("index") is not None})


def _summary(rec: Dict[str, Any]) -> Dict[str, Any]:
    """One incident record, the parts the zoo reads: event, iteration, reason, class and its evidence, the
    actions' targets, the samples quarantined, iterations lost, and why the guard gave up."""
    cause = rec.get("cause") or {}
    signals = cause.get("signals") or {}
    return {"event": rec.get("event"), "iteration": rec.get("iteration"), "reason": rec.get("reason"),
            "cause": cause.get("cause"), "evidence": cause.get("evidence"),
            "targets": [a.get("target") for a in rec.get("actions") or ()],
            "quarantined": _indices(signals.get("quarantined")), "samples": _indices(rec.get("samples")),
            "iterations_lost": rec.get("iterations_lost") or 0, "why": rec.get("why")}


def guard_settings(iters: int) -> Dict[str, int]:
    """The guard's snapshot settings scaled to a run of ``iters`` iterations, as the demo scales them: a snapshot
    every ``iters // 6``, confirmed (and the state checked) after half that many clean steps."""
    interval = max(2, iters // 6)
    return dict(snapshot_interval=interval, confirm_steps=max(1, interval // 2), check_interval=max(1, interval // 2))


def right_class(result: ZooResult) -> Tuple[bool, str]:
    """Whether a guarded run's records give its scenario's class, and why not.

    ``too_high_lr``: dynamics, unknown or forward_overflow, nothing quarantined; ``corrupt_sample`` and
    ``bright_sample``: data, exactly the planted sample quarantined, no module in fp32, no learning-rate change;
    ``nan_weights``: dynamics or unknown, its first divergence a rollback alone (no setting changed); ``none``: no
    record where the guard acted (:func:`acted`; a record of a step the scaler skipped is an observation), nothing
    quarantined, no module in fp32, no rate changed, nothing rolled back.
    """
    causes, s = set(result.causes), result.scenario
    if s == "none":
        quiet = (not acted(result) and not result.quarantined and not result.fp32_modules
                 and result.lr_factor == 1.0 and not result.iters_lost)
        return quiet, (f"the guard acted where nothing was planted: {_events(result)}, quarantined "
                       f"{result.quarantined}, fp32 {result.fp32_modules}, lr factor {result.lr_factor}")
    if not causes:
        return False, f"no record classified a cause ({_events(result)})"
    if s == "too_high_lr":
        wrong = causes - {"dynamics", "unknown", "forward_overflow"}
        return (not wrong and not result.quarantined,
                f"classes {sorted(causes)}, quarantined {result.quarantined}")
    if s == "nan_weights":
        # NaN written between two steps (no optimizer step put it there): the first divergence is rolled back alone.
        first = next((r for r in result.incidents if r.get("cause")), {})
        ok = causes <= {"dynamics", "unknown"} and not first.get("targets") and not result.fp32_modules
        return ok, f"classes {sorted(causes)}, the first divergence changed {first.get('targets')}"
    ok = (causes == {"data"} and result.quarantined == [result.planted] and not result.fp32_modules
          and result.lr_factor == 1.0)
    return ok, (f"classes {sorted(causes)}, quarantined {result.quarantined} (planted {result.planted}), fp32 "
                f"{result.fp32_modules}, lr factor {result.lr_factor}")


#: Record events that note what the guard saw and change nothing: a step the scaler skipped because its forward itself
#: was non-finite (``skip``; the rnn's raw counts times ``exp`` overflow fp16 now and then on a healthy run, as the
#: unguarded reference's own skipped steps show) and a non-finite loss dropped in fp32 (``nonfinite_loss``).
OBSERVED = ("skip", "nonfinite_loss")


def acted(result: ZooResult) -> List[Dict[str, Any]]:
    """The run's records where the guard acted (rolled back, changed a setting, quarantined, stopped): every record
    but the :data:`OBSERVED` ones."""
    return [r for r in result.incidents if r.get("event") not in OBSERVED]


def _events(result: ZooResult) -> str:
    return ", ".join(f"{r['event']}@{r['iteration']}:{r['cause']}" for r in result.incidents) or "none"


# ------------------------------------------------------------------------------------------------- the loop
def _lr_lambda(iters: int, warmup: int) -> Callable[[int], float]:
    """Linear warm-up from 0.1 of the peak over ``warmup`` iterations, then cosine down to 0.1 of the peak."""
    def factor(i: int) -> float:
        if i < warmup:
            return 0.1 + 0.9 * i / warmup
        progress = min(1.0, (i - warmup) / max(1, iters - warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))
    return factor


def _seek(sched: torch.optim.lr_scheduler.LambdaLR, iteration: int) -> None:
    """Puts the schedule at ``iteration``: a rollback sets the loop's counter back, and the schedule goes back with
    it, as an iteration-based runner restores its schedulers. Read from the scheduler's bases, which the guard's
    learning-rate backoff scales."""
    sched.last_epoch = iteration
    lrs = [base * fn(iteration) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
    for group, lr in zip(sched.optimizer.param_groups, lrs):
        group["lr"] = lr
    sched._last_lr = lrs


@dataclass
class _Run:
    """One run's live objects."""

    spec: ModelSpec
    model: nn.Module
    opt: torch.optim.Optimizer
    scaler: Any
    sched: Any
    io: TorchLoopIO
    driver: Optional[GuardDriver]
    plant_at: Optional[int]
    nan_param: str
    skipped: int = 0
    steps: int = 0
    last_applied: int = 0


def _order(train: Samples, model_spec: ModelSpec) -> Samples:
    """The same samples in another order for a model trained in order (a third of the way in, the rest after the
    start: the scenes in another sequence, each scene's frames in theirs); a shuffled model's as they are (its loader
    draws another order instead)."""
    if model_spec.shuffle:
        return train
    cut = len(train) // 3
    return train[cut:] + train[:cut]


def _build(model_spec: ModelSpec, train: Samples, seed: int, lr: float, work_dir: str,
           guard: Optional[Dict[str, Any]], plant_at: Optional[int], lines: List[str],
           order_seed: Optional[int] = None) -> _Run:
    model = model_spec.build(seed)
    torch.manual_seed(seed)  # dropout draws: the same for every variant of a seed
    order = seed if order_seed is None else order_seed
    loader = DataLoader(ZooDataset(train), batch_size=model_spec.batch_size, shuffle=model_spec.shuffle,
                        generator=_gen(order) if model_spec.shuffle else None)
    opt = (model_spec.optimizer or _adamw)(model.parameters(), lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(model_spec.iters, model_spec.warmup))
    scaler = make_grad_scaler("cpu")  # init scale 2**16, growth interval 2000: the torch defaults
    io = TorchLoopIO(model, opt, scaler, {"max_norm": 35.0, "norm_type": 2}, work_dir, log_fn=lines.append,
                     loader=loader, schedulers=[sched], max_iters=model_spec.iters, forward=model_spec.forward,
                     autocast=autocast)
    driver = None
    if guard is not None:
        driver = GuardDriver(GuardConfig(**guard))
        driver.bind(io)
    return _Run(model_spec, model, opt, scaler, sched, io, driver, plant_at, model_spec.nan_param)


def _step(run: _Run, batch: Batch) -> None:
    """One iteration: forward under autocast, scaled backward, unscale, clip (the guard's probe), step, update."""
    io = run.io
    with autocast():
        loss = run.spec.forward(run.model, batch)
    run.scaler.scale(loss).backward()
    run.scaler.unscale_(run.opt)
    io.clip(run.model.parameters())
    before = float(run.scaler.get_scale())
    run.scaler.step(run.opt)
    run.scaler.update()
    skipped = float(run.scaler.get_scale()) < before
    run.skipped += int(skipped)
    run.steps += 1
    run.last_applied = run.last_applied if skipped else run.steps
    run.opt.zero_grad()
    io.last_loss = float(loss.detach())


def _train(run: _Run) -> None:
    """The loop, driving the guard as ``TorchLoopRun.train`` does; a rollback sets ``io.iter`` back and the data
    moves on. A new pass over the data advances ``io.epoch`` (the guard tells epochs apart by it)."""
    io, driver = run.io, run.driver
    if driver is not None:
        driver.start()
    batches = iter(io.loader)
    while io.iter < run.spec.iters:
        batch = next(batches, None)
        if batch is None:
            io.epoch += 1
            batches = iter(io.loader)
            batch = next(batches)
        if run.plant_at is not None and io.iter + 1 == run.plant_at:
            _plant_nan_weight(run.model, run.nan_param)
            run.plant_at = None  # once: a rollback past it does not plant it again
        _seek(run.sched, io.iter)
        if driver is not None:
            driver.before_iter(batch)
        _step(run, batch)
        if driver is not None:
            driver.after_iter()
        io.iter += 1
    if driver is not None:
        driver.finish()


def run(model: str, scenario: str, variant: str, seed: int, work_dir: Optional[str] = None,
        guard_kwargs: Optional[Dict[str, Any]] = None, lr: Optional[float] = None) -> ZooResult:
    """Trains zoo model ``model`` once and measures it.

    Args:
        model: a zoo model (:data:`MODELS`).
        scenario: the fault planted (:data:`SCENARIOS`); a ``reference`` run plants nothing.
        variant: ``'reference'`` (stable learning rate, nothing planted, no guard), ``'unguarded'`` (the scenario
            planted, no guard), ``'guarded'`` (the scenario planted, the guard on), ``'reshuffled'`` (the reference
            with its batches in another order) or ``'without'`` (the reference without the sample a data fault is
            planted in: :data:`VARIANTS`).
        seed: weights, data, dropout, shuffle and the planted sample.
        work_dir: where the guard writes its records. Defaults to None (a temporary dir, removed after).
        guard_kwargs: guard settings over :func:`guard_settings` of the run's length. Defaults to None.
        lr: a peak learning rate in place of the scenario's (the tuning sweeps). Defaults to None.

    Returns:
        The run's :class:`ZooResult`.
    """
    if scenario not in SCENARIOS or variant not in VARIANTS:
        raise ValueError(f"scenario must be one of {list(SCENARIOS)} and variant one of {list(VARIANTS)}, got "
                         f"{scenario!r}, {variant!r}")
    if variant in ("reference", "reshuffled", "without"):
        scenario = "none"
    if work_dir is None:
        with tempfile.TemporaryDirectory(prefix="zoo_") as tmp:
            return run(model, scenario, variant, seed, tmp, guard_kwargs, lr)
    t0 = time.perf_counter()
    s = spec(model)
    lr = lr if lr is not None else s.high_lr if scenario == "too_high_lr" else s.stable_lr
    planted = planted_index(model, seed) if scenario in DATA_SCENARIOS else None
    train, heldout = s.datasets(seed)
    train = plant_data(train, scenario, planted, s.input_key) if planted is not None else train
    if variant == "without":
        dropped = planted_index(model, seed)
        train = train[:dropped] + train[dropped + 1:]
    guard = dict(guard_settings(s.iters), **(guard_kwargs or {})) if variant == "guarded" else None
    lines: List[str] = []
    live = _build(s, _order(train, s) if variant == "reshuffled" else train, seed, lr, work_dir, guard,
                  s.iters // 2 + 1 if scenario == "nan_weights" else None, lines,
                  RESHUFFLE_SEED + seed if variant == "reshuffled" else seed)
    result = ZooResult(model, scenario, variant, seed, lr, planted)
    masks = _finite_masks(live.model)
    try:
        _train(live)
    except Exception as exc:  # the guard's stop (NanGuardError) or a crash: the run ends here either way
        result.finished = False
        result.error_type, result.error_message = type(exc).__name__, str(exc)
        if not isinstance(exc, NanGuardError):
            result.error_message += "\n" + "".join(traceback.format_exc(limit=-4))
    _measure(result, live, heldout, masks, work_dir, lines)
    result.wall_s = round(time.perf_counter() - t0, 3)
    return result


def _measure(result: ZooResult, live: _Run, heldout: Samples, masks: Dict[str, Tensor], work_dir: str,
             lines: List[str]) -> None:
    result.state_finite = _state_finite(live.model, live.opt, masks)
    result.eval_loss = evaluate(live.spec, live.model, heldout)
    result.loss_scale = float(live.scaler.get_scale())
    result.skipped_steps = live.skipped
    result.stalled_from = live.last_applied + 1 if live.last_applied < live.steps else None
    result.lost = (not result.state_finite or result.eval_loss is None or not result.finished
                   or result.loss_scale < 1.0)
    dataset = live.io.loader.dataset
    result.served = [dataset.served[i] for i in range(len(dataset))]
    result.replayed = sum(dataset.replayed.values())
    result.log = [line for line in lines if "NanGuard" in line or "nan_guard" in line][-40:]
    if live.driver is None:
        return
    records = read_incidents(work_dir) if os.path.isdir(work_dir) else []
    result.incidents = [_summary(r) for r in records]
    result.causes = [r["cause"] for r in result.incidents if r["cause"]]
    result.iters_lost = sum(int(r["iterations_lost"]) for r in result.incidents)
    guard = live.driver.guard
    skip = guard.remedy("quarantine").skip_list
    result.quarantined = sorted({i for idx in (skip.by_sample().values() if skip is not None else ()) for i in idx})
    result.lr_factor = float(guard.remedy("lr").lr_factor)
    result.fp32_modules = list(guard.remedy("fp32").fp32)
