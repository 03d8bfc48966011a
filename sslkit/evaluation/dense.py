"""The dense linear probe: a linear segmentation head on a frozen ViT's patch features, and mIoU (DINOv3's linear
protocol, facebookresearch/dinov3 ``eval/segmentation``)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sslkit.data.segmentation import IGNORE_INDEX
from sslkit.evaluation.linear import warmup_cosine_lr
from sslkit.models.tokens import TokenTrunk

__all__ = [
    "LinearSegmentationHead",
    "area_stats",
    "dense_logits",
    "dense_lr",
    "evaluate_dense",
    "image_area_stats",
    "on_device",
    "patch_maps",
    "segmentation_metrics",
    "train_dense_epoch",
    "train_dense_head",
]


class LinearSegmentationHead(nn.Module):
    """DINOv3's linear segmentation head (``eval/segmentation/models/heads/linear_head.py``): on the patch feature
    map ``[B, D, h, w]``, ``Dropout2d(dropout)``, BatchNorm, then a 1 x 1 convolution to ``num_classes`` logits,
    its weights drawn from N(0, 0.01) and its bias 0."""

    def __init__(self, in_dim: int, num_classes: int, dropout: float = 0.1, batchnorm: bool = True) -> None:
        super().__init__()
        self.dropout = nn.Dropout2d(dropout)
        self.norm = nn.BatchNorm2d(in_dim) if batchnorm else nn.Identity()
        self.conv = nn.Conv2d(in_dim, num_classes, kernel_size=1)
        nn.init.normal_(self.conv.weight, mean=0.0, std=0.01)
        nn.init.zeros_(self.conv.bias)

    def forward(self, maps: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, num_classes, h, w]`` of the feature map ``[B, D, h, w]``."""
        return self.conv(self.norm(self.dropout(maps)))


def patch_maps(trunk: TokenTrunk, images: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The trunk's last-layer patch tokens (after its final norm: DINOv3's ``use_backbone_norm``) as a feature map
    ``[B, D, h, w]``, float32; read through windows of ``window`` pixels when the images are larger
    (:func:`windowed_maps`)."""
    def whole(x: torch.Tensor) -> torch.Tensor:
        tokens = trunk.forward_tokens(x)
        h, w = tokens.grid
        return tokens.patches.float().transpose(1, 2).reshape(x.shape[0], -1, h, w)
    return windowed_maps(whole, images, window, trunk.patch_size)


def window_starts(size: int, window: int) -> list[int]:
    """Where windows of ``window`` pixels start along a side of ``size``: every ``window`` pixels, the last one
    moved back to end at the edge (overlapping its neighbour when ``window`` does not divide ``size``)."""
    starts = list(range(0, size - window + 1, window))
    if starts[-1] != size - window:
        starts.append(size - window)
    return starts


def windowed_maps(maps_of: Any, images: torch.Tensor, window: int | None, patch: int) -> torch.Tensor:
    """The feature map ``[B, D, H / patch, W / patch]`` of images larger than the network's own size, read window by
    window (DINOv3's sliding-window inference, ``mode: slide``, here with windows side by side): ``maps_of`` on each
    ``window`` x ``window`` crop, each crop's map put in its place, the maps of overlapping windows averaged (the
    head is affine at test time, so this is the average of the windows' logits, as DINOv3 averages them). Without a
    ``window``, or with images no larger, one pass over the whole image."""
    _, _, height, width = images.shape
    if not window or (height <= window and width <= window):
        return maps_of(images)
    if window % patch or height % patch or width % patch:
        raise ValueError(f"windows of {window} px over images of {height} x {width}: all must be multiples of the "
                         f"{patch} px patch")
    total, count = None, torch.zeros(height // patch, width // patch, device=images.device)
    for top in window_starts(height, min(window, height)):
        for left in window_starts(width, min(window, width)):
            part = maps_of(images[:, :, top:top + window, left:left + window])
            if total is None:
                total = part.new_zeros(part.shape[0], part.shape[1], height // patch, width // patch)
            rows, cols = slice(top // patch, top // patch + part.shape[2]), slice(left // patch,
                                                                                  left // patch + part.shape[3])
            total[:, :, rows, cols] += part
            count[rows, cols] += 1
    assert total is not None
    return total / count


def dense_logits(head: nn.Module, maps: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The head's logits upsampled to the class map's ``size`` (bilinear, ``align_corners=False``, as DINOv3)."""
    return F.interpolate(head(maps), size=size, mode="bilinear", align_corners=False)


def dense_lr(base: float, step: int, warmup: int, total: int) -> float:
    """DINOv3's linear-probe schedule (``WarmupOneCycleLR``, ``pct_start`` 0): linear from ``base x 1e-6`` to
    ``base`` over ``warmup`` steps, then a half cosine down to 0 at ``total``."""
    return warmup_cosine_lr(base, step, warmup, total, start=base * 1e-6)


def frozen_maps(trunk: TokenTrunk, images: torch.Tensor, amp: torch.dtype | None,
                window: int | None = None) -> torch.Tensor:
    """:func:`patch_maps` of a frozen trunk: no gradient, under ``torch.autocast`` with ``amp`` when given."""
    with torch.no_grad(), (torch.autocast(images.device.type, amp) if amp else contextlib.nullcontext()):
        return patch_maps(trunk, images, window)


def train_dense_epoch(trunk: TokenTrunk, head: nn.Module, optimizer: torch.optim.Optimizer,
                      batches: Iterable[tuple[torch.Tensor, torch.Tensor]], lr_at: Any, step: int,
                      amp: torch.dtype | None = None, window: int | None = None) -> tuple[float, int]:
    """One epoch of the head on the frozen trunk (eval mode, no gradient): cross-entropy of the upsampled logits
    against the class maps, :data:`~sslkit.data.segmentation.IGNORE_INDEX` left out. Returns the mean loss (read
    once, at the end) and the next step. ``window``: the trunk reads larger images window by window
    (:func:`windowed_maps`)."""
    trunk.eval()
    head.train()
    total = None
    n = 0
    for images, masks in batches:
        loss = _head_step(head, optimizer, frozen_maps(trunk, images, amp, window), masks, lr_at(step))
        total = loss if total is None else total + loss
        n += 1
        step += 1
    return (float(total) / n if total is not None else math.nan), step


def _head_step(head: nn.Module, optimizer: torch.optim.Optimizer, maps: torch.Tensor, masks: torch.Tensor,
               lr: float) -> torch.Tensor:
    """One update of the head at ``lr``: cross-entropy of its upsampled logits against the class maps, ignored
    pixels left out. Returns the loss, detached."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = F.cross_entropy(dense_logits(head, maps, tuple(masks.shape[-2:])), masks, ignore_index=IGNORE_INDEX)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def area_stats(pred: torch.Tensor, target: torch.Tensor, num_classes: int,
               ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``[4, num_classes]``: per class, the pixels predicted and labelled it (intersection), in either (union),
    predicted it, labelled it; pixels labelled ``ignore_index`` left out (DINOv3's
    ``calculate_intersect_and_union``, with ``bincount`` on the device)."""
    keep = target != ignore_index
    p, t = pred[keep], target[keep]
    hit = p[p == t]
    count = [torch.bincount(v.reshape(-1), minlength=num_classes)[:num_classes] for v in (hit, p, t)]
    intersect, predicted, labelled = (c.to(torch.float64) for c in count)
    return torch.stack([intersect, predicted + labelled - intersect, predicted, labelled])


def segmentation_metrics(stats: torch.Tensor) -> dict[str, Any]:
    """From summed :func:`area_stats`: ``miou`` (the mean over the classes with a non-empty union of intersection
    / union, DINOv3's ``nanmean``), ``per_class_iou`` (None where the union is empty), ``pixel_accuracy`` (all
    classes' intersections / all labelled pixels: ``aAcc``) and ``mean_accuracy`` (per class intersection /
    labelled, averaged over the classes present)."""
    intersect, union, _, labelled = stats.double().cpu()
    iou = torch.where(union > 0, intersect / union.clamp(min=1), torch.full_like(union, math.nan))
    acc = torch.where(labelled > 0, intersect / labelled.clamp(min=1), torch.full_like(labelled, math.nan))
    return {"miou": float(iou.nanmean()), "pixel_accuracy": float(intersect.sum() / labelled.sum().clamp(min=1)),
            "mean_accuracy": float(acc.nanmean()),
            "per_class_iou": [None if math.isnan(v) else round(float(v), 6) for v in iou.tolist()]}


def evaluate_dense(trunk: TokenTrunk, head: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                   num_classes: int, amp: torch.dtype | None = None, window: int | None = None) -> dict[str, Any]:
    """:func:`segmentation_metrics` of the head's argmax over every batch (class maps at their own size)."""
    trunk.eval()
    head.eval()
    total = None
    with torch.no_grad():
        for images, masks in batches:
            pred = dense_logits(head, frozen_maps(trunk, images, amp, window), tuple(masks.shape[-2:])).argmax(1)
            stats = area_stats(pred, masks, num_classes)
            total = stats if total is None else total + stats
    if total is None:
        raise ValueError("no test images for the dense probe")
    return segmentation_metrics(total)


def on_device(loader: Iterable[Any], device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(images, class maps) of each batch of ``loader``, on ``device``."""
    for images, masks in loader:
        yield images.to(device, non_blocking=True), masks.to(device, non_blocking=True)


def image_area_stats(pred: torch.Tensor, target: torch.Tensor, num_classes: int,
                     ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``[B, 2, num_classes]``: each image's per-class intersection and union pixels (:func:`area_stats`' first two
    rows, image by image, in one ``bincount``): what a bootstrap over test images resamples for mIoU."""
    b = pred.shape[0]
    keep = target != ignore_index
    image = torch.arange(b, device=pred.device).view(b, *([1] * (pred.ndim - 1))).expand_as(pred)
    p, t, i = pred[keep].long(), target[keep].long(), image[keep]
    size = b * num_classes

    def count(cls: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.bincount(ids * num_classes + cls, minlength=size)[:size].view(b, num_classes).double()

    hit = p == t
    intersect, predicted, labelled = count(p[hit], i[hit]), count(p, i), count(t, i)
    return torch.stack([intersect, predicted + labelled - intersect], dim=1)


def train_dense_head(maps: Any, masks: Any, head: nn.Module, optimizer: torch.optim.Optimizer,
                     lr_at: Any, epochs: int, batch_size: int, device: torch.device, seed: int = 0,
                     progress: Any = None) -> list[float]:
    """The head trained on cached feature maps (``maps`` ``[N, D, h, w]``, ``masks`` ``[N, H, W]``, NumPy or
    memory-mapped; float16 maps read as float32), as :func:`train_dense_epoch` trains it on a frozen trunk's
    (the trunk is frozen and the images are not augmented, so its maps are the same every epoch): a seeded shuffle
    each epoch, cross-entropy of the upsampled logits. Returns each epoch's mean loss."""
    g = torch.Generator().manual_seed(int(seed))
    n, step, losses = int(maps.shape[0]), 0, []
    head.train()
    for _ in range(int(epochs)):
        total, count = None, 0
        order = torch.randperm(n, generator=g).numpy()
        for start in range(0, n, int(batch_size)):
            rows = np.sort(order[start:start + int(batch_size)])
            x = torch.from_numpy(np.asarray(maps[rows], dtype=np.float32)).to(device)
            y = torch.from_numpy(np.asarray(masks[rows], dtype=np.int64)).to(device)
            loss = _head_step(head, optimizer, x, y, lr_at(step))
            total = loss if total is None else total + loss
            count, step = count + 1, step + 1
            if progress is not None:
                progress(1)
        losses.append(float(total) / count if total is not None else math.nan)
    return losses
