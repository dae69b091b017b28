"""The example's own model and data: a toy PETR-shaped detector and a synthetic dataset, for MMEngine.

Importing this module registers ``ToyDetector`` in MMEngine's ``MODELS`` and ``ToyDetDataset`` in its ``DATASETS``,
exactly as your own project's module does (mmdet3d 1.x: ``projects.PETR.petr``); the config imports it through
``custom_imports`` next to ``petr_stability``. Nothing here comes from ``petr_stability``: the guard works on a model
it has never seen.

The model is shaped like PETR where the guard looks: a conv backbone with BatchNorm (whose running statistics a
corrupt image turns NaN) under ``img_backbone``, and a head ``pts_bbox_head`` whose queries cross-attend to the
image features through ``torch.nn.TransformerDecoderLayer`` (the transformer whose dropouts the guard's known manual
fix zeroes).
"""
from typing import Any, Dict, List, Optional

import torch
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, MODELS
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

__all__ = ["ToyDetDataset", "ToyDetector", "ToyHead"]


@DATASETS.register_module()
class ToyDetDataset(Dataset):
    """Synthetic images, each holding one bright square; the target is the square's colour (class) and box.

    Args:
        num_samples: dataset length.
        img_size: images are ``3 x img_size x img_size``.
        num_classes: a class is the colour channel the square is bright in (at most 3).
        bad_sample: index of a corrupt image whose top-left quarter is NaN, as a truncated file or a broken
            preprocessing step delivers one; None for a clean dataset. It comes back every epoch, as a bad
            file on disk would.
        seed: samples are a function of ``(seed, index)``, so every epoch and every run sees the same data.
    """

    def __init__(self, num_samples: int = 64, img_size: int = 32, num_classes: int = 3,
                 bad_sample: Optional[int] = None, seed: int = 0) -> None:
        if bad_sample is not None and not 0 <= bad_sample < num_samples:
            raise ValueError(f"bad_sample must be an index in [0, {num_samples}), got {bad_sample}")
        if not 1 <= num_classes <= 3:
            raise ValueError(f"num_classes must be 1, 2 or 3 (one colour channel each), got {num_classes}")
        self.img_size, self.num_classes, self.bad_sample = img_size, num_classes, bad_sample
        # One info dict per sample, as MMEngine's BaseDataset keeps them in ``data_list`` (mmdet3d: its .pkl
        # infos): the guard looks a batch's ``sample_idx`` up here to quarantine a sample that breaks training.
        self.data_list: List[Dict[str, Any]] = [dict(sample_idx=i, seed=seed * 100003 + i) for i in range(num_samples)]

    def __len__(self) -> int:
        return len(self.data_list)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        info = self.data_list[index]
        g = torch.Generator().manual_seed(info["seed"])
        size = self.img_size
        img = 0.1 * torch.randn(3, size, size, generator=g)
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        side = int(torch.randint(size // 4, size // 2, (1,), generator=g))
        x0, y0 = (int(v) for v in torch.randint(size - side, (2,), generator=g))
        img[label, y0:y0 + side, x0:x0 + side] += 1.0
        # Normalised (cx, cy, w, h), as PETR's head regresses normalised centres and sizes.
        bbox = torch.tensor([x0 + side / 2, y0 + side / 2, side, side]) / size
        if index == self.bad_sample:
            img[:, : size // 2, : size // 2] = float("nan")
        # ``sample_idx`` names the sample as mmdet3d's do: the guard's incident record says which one broke.
        return dict(img=img, gt_label=label, gt_bbox=bbox, sample_idx=info["sample_idx"])


class ToyHead(nn.Module):
    """PETR's head in miniature: object queries cross-attend to the image features through a transformer."""

    def __init__(self, num_classes: int, embed_dims: int, num_queries: int, dropout: float) -> None:
        super().__init__()
        self.query_embed = nn.Embedding(num_queries, embed_dims)
        self.transformer = nn.TransformerDecoderLayer(
            embed_dims, nhead=4, dim_feedforward=2 * embed_dims, dropout=dropout, batch_first=True)
        self.cls_branch = nn.Linear(embed_dims, num_classes)
        self.reg_branch = nn.Linear(embed_dims, 4)

    def forward(self, feats: torch.Tensor) -> Dict[str, torch.Tensor]:
        """``feats``: (batch, tokens, embed_dims); the mean of the queries predicts the image's one object."""
        queries = self.query_embed.weight.unsqueeze(0).expand(feats.shape[0], -1, -1)
        objects = self.transformer(queries, feats).mean(dim=1)
        return dict(cls_score=self.cls_branch(objects), bbox_pred=self.reg_branch(objects).sigmoid())


@MODELS.register_module()
class ToyDetector(BaseModel):
    """``img_backbone`` + ``pts_bbox_head`` (PETR's names); ``forward(mode='loss')`` returns a dict of losses.

    Args:
        num_classes: object classes.
        embed_dims: feature and query width.
        num_queries: learned object queries.
        dropout: the head's transformer dropout (PETR's is 0.1; the known manual fix sets it to 0).
        init_cfg: MMEngine's weight-init config (None: PyTorch's defaults).
    """

    def __init__(self, num_classes: int = 3, embed_dims: int = 32, num_queries: int = 8,
                 dropout: float = 0.1, init_cfg: Optional[dict] = None) -> None:
        super().__init__(init_cfg=init_cfg)
        self.img_backbone = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
            nn.Conv2d(16, embed_dims, 3, stride=2, padding=1), nn.BatchNorm2d(embed_dims), nn.ReLU(inplace=True),
        )
        self.pts_bbox_head = ToyHead(num_classes, embed_dims, num_queries, dropout)

    def forward(self, img: torch.Tensor, gt_label: Optional[torch.Tensor] = None,
                gt_bbox: Optional[torch.Tensor] = None, sample_idx: Any = None, mode: str = "loss") -> Any:
        """``mode='loss'``: the loss dict MMEngine's ``train_step`` sums; ``'predict'``/``'tensor'``: the outputs."""
        out = self.pts_bbox_head(self.img_backbone(img).flatten(2).transpose(1, 2))
        if mode != "loss":
            return out
        return dict(loss_cls=F.cross_entropy(out["cls_score"], gt_label),
                    loss_bbox=F.l1_loss(out["bbox_pred"], gt_bbox))
