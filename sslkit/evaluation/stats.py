"""Spreads of evaluation figures: bootstrap intervals over test images, paired differences, the spread of draws."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["Statistic", "bootstrap_indices", "bootstrap_interval", "bootstrap_weights", "draws_summary",
           "miou_statistic", "paired_difference", "per_class_mean", "relative_statistic", "weighted_mean"]

#: Resamples of the bootstrap unless told otherwise (Efron and Tibshirani recommend 1000 or more for percentile
#: intervals).
RESAMPLES = 1000


def bootstrap_indices(n: int, resamples: int = RESAMPLES, seed: int = 0) -> Tensor:
    """``[resamples, n]`` indices, each row ``n`` draws with replacement from ``range(n)``, from a CPU generator
    seeded by ``seed``: every protocol and every backbone resample the same test images the same way, so two
    backbones' intervals and their paired difference see the same resamples."""
    if n < 1:
        raise ValueError("the bootstrap needs at least one test sample")
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, n, (int(resamples), n), generator=g)


def bootstrap_weights(n: int, resamples: int = RESAMPLES, seed: int = 0) -> Tensor:
    """``[resamples, n]`` float64: how often each of ``n`` test images is drawn in each resample of
    :func:`bootstrap_indices` (a resample's statistic is then a weighted one: a mean, or a ratio of sums such as
    mIoU, without copying the values ``resamples`` times)."""
    idx = bootstrap_indices(n, resamples, seed)
    return torch.zeros(idx.shape, dtype=torch.float64).scatter_add_(1, idx, torch.ones(idx.shape, dtype=torch.float64))


def weighted_mean(weights: Tensor, values: Tensor) -> Tensor:
    """The default statistic: ``[R]`` means of per-image ``values`` ``[N]`` under ``weights`` ``[R, N]``."""
    return weights @ values.double() / weights.sum(dim=1)


def miou_statistic(weights: Tensor, values: Tensor) -> Tensor:
    """mIoU ``[R]`` of per-image ``values`` ``[N, 2, K]`` (each image's per-class intersection and union pixels,
    :func:`~sslkit.evaluation.dense.area_stats`'s first two rows) under ``weights`` ``[R, N]``: the summed
    intersections over the summed unions, averaged over the classes whose union is not empty (DINOv3's mIoU of
    the resampled set)."""
    sums = (weights @ values.double().reshape(values.shape[0], -1)).reshape(weights.shape[0], 2, -1)
    inter, union = sums[:, 0], sums[:, 1]
    iou = torch.where(union > 0, inter / union.clamp(min=1e-12), torch.full_like(union, math.nan))
    return iou.nanmean(dim=1)


def relative_statistic(weights: Tensor, values: Tensor) -> Tensor:
    """The mean relative accuracy ``[R]`` of per-image 0/1 hits ``values`` ``[N, 1 + K]`` (column 0 on the clean
    images, the others on K corrupted versions of the same images) under ``weights`` ``[R, N]``: the mean over the K
    of each one's accuracy over the clean accuracy, both on the resampled images."""
    sums = weights @ values.double()
    return (sums[:, 1:] / sums[:, :1].clamp(min=1e-12)).mean(dim=1)


Statistic = Callable[[Tensor, Tensor], Tensor]


def _quantiles(boot: Tensor, level: float) -> list[float]:
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    return torch.quantile(boot, q).tolist()


def bootstrap_interval(values: Tensor, statistic: Statistic | None = None, resamples: int = RESAMPLES,
                       level: float = 0.95, seed: int = 0) -> dict[str, float]:
    """The percentile bootstrap (Efron 1979; Efron and Tibshirani 1993, ch. 13) of a statistic of per-test-image
    ``values`` ``[N, ...]``: the statistic of the whole set, and the ``(1 - level) / 2`` and ``(1 + level) / 2``
    quantiles of the statistic over ``resamples`` sets of ``N`` images drawn with replacement
    (:func:`bootstrap_weights`). ``statistic(weights [R, N], values) -> [R]`` (default :func:`weighted_mean`, e.g.
    of 0/1 hits: the accuracy; :func:`miou_statistic` for segmentation). Returns ``value``, ``low``, ``high`` and
    ``se`` (the standard deviation of the resampled statistics)."""
    stat = statistic or weighted_mean
    values = values.cpu()
    boot = stat(bootstrap_weights(values.shape[0], resamples, seed), values).double()
    whole = float(stat(torch.ones(1, values.shape[0], dtype=torch.float64), values)[0])
    low, high = _quantiles(boot, level)
    return {"value": whole, "low": low, "high": high, "se": float(boot.std(unbiased=True))}


def paired_difference(a: Tensor, b: Tensor, statistic: Statistic | None = None, resamples: int = RESAMPLES,
                      level: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """Is backbone A's figure different from B's on the same test images? The paired percentile bootstrap of
    ``statistic(a) - statistic(b)``: both resampled with the same draws. ``supported`` is true when the interval
    of the difference excludes 0 (the difference is larger than the resampling spread of the test set says can
    happen by chance, at ``level``)."""
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"a paired difference needs the same test images: {a.shape[0]} and {b.shape[0]} values")
    stat = statistic or weighted_mean
    a, b = a.cpu(), b.cpu()
    weights = bootstrap_weights(a.shape[0], resamples, seed)
    diff = stat(weights, a).double() - stat(weights, b).double()
    ones = torch.ones(1, a.shape[0], dtype=torch.float64)
    whole = float(stat(ones, a)[0] - stat(ones, b)[0])
    low, high = _quantiles(diff, level)
    return {"difference": whole, "low": low, "high": high, "supported": bool(low > 0 or high < 0)}


def draws_summary(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sample standard deviation (n - 1), standard error of the mean and the values of repeated seeded draws
    (few-shot): ``std`` and ``se`` are 0 for a single draw."""
    v = [float(x) for x in values]
    if not v:
        raise ValueError("no draws")
    n = len(v)
    mean = sum(v) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / (n - 1)) if n > 1 else 0.0
    return {"value": mean, "std": std, "se": std / math.sqrt(n), "draws": v}


def per_class_mean(hits: Tensor, labels: Tensor, num_classes: int) -> float:
    """The mean over the classes present in ``labels`` of each class's accuracy (DINOv2's ``MEAN_ACCURACY``, the
    metric its linear evaluation picks the best classifier by)."""
    labels = labels.long()
    seen = torch.bincount(labels, minlength=num_classes).double()
    right = torch.bincount(labels, weights=hits.double(), minlength=num_classes)
    present = seen > 0
    return float((right[present] / seen[present]).mean())
